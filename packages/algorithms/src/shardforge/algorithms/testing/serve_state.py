"""What the `shardforge serve` tests compare: a ``save_state`` checkpoint (DCP, `serve.dcp_state`) read back as one
plain dict, and two such dicts compared within the tolerances the multi-rank parity tests use."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["assert_states_close", "read_saved_state"]


def _named(what: str) -> Callable[[str], str]:
    """An ``assert_close`` message naming the tensor and keeping torch's numbers."""
    return lambda message: f"{what}: {message}"


def read_saved_state(out: Path, tenant: str, tinker_path: str) -> dict[str, Any]:
    """The checkpoint ``tinker_path`` of ``tenant`` under the service's output directory ``out``: ``model`` and
    ``optimizer`` (by parameter name), and ``meta`` (its ``serve.json``). Asserts the checkpoint is committed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model_id, _, name = tinker_path.removeprefix("tinker://").partition("/weights/")
    folder = out / tenant / model_id / "weights" / name
    assert (folder / ".metadata").is_file() and (folder / "COMMITTED").is_file(), f"{folder} is not a DCP checkpoint"
    file = folder.parent / f".{name}.read.pt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_to_torch_save(folder, file)
    try:
        state: dict[str, Any] = torch.load(file, weights_only=False)["train"]
    finally:
        file.unlink()
    return state | {"meta": json.loads((folder / "serve.json").read_text())}


def assert_states_close(a: dict[str, Any], b: dict[str, Any], *, rel: float = 1e-5, moments_rel: float = 1e-4) -> None:
    """Same trained weights (``rel``) and AdamW moments (``moments_rel``; near-zero entries, gradients that cancel,
    carry the summation order's absolute error, hence an absolute tolerance by each moment's scale) and steps."""
    assert a["model"].keys() == b["model"].keys() and a["model"]
    for name, value in a["model"].items():
        torch.testing.assert_close(value, b["model"][name], rtol=rel, atol=1e-6, msg=_named(name))
    moments_a, moments_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert moments_a.keys() == moments_b.keys() and moments_a
    for name, state in moments_a.items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(state[key].abs().max())
            torch.testing.assert_close(
                state[key], moments_b[name][key], rtol=moments_rel, atol=1e-5 * scale, msg=_named(f"{name} {key}")
            )
        assert float(state["step"]) == float(moments_b[name]["step"])
    assert a["meta"]["steps"] == b["meta"]["steps"]
