"""Rollout-engine selection without vLLM: the factory, the vLLM options and the trainer config fields.

Runs in the main test venv (no vLLM). "vLLM missing" is simulated with ``sys.modules["vllm"] = None``
so the test means the same where vLLM is installed. The vLLM engine itself is tested against a
real vLLM in packages/algorithms/tests_vllm (``nox -s vllm``).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config
from shardforge.rollout import HFRolloutEngine
from shardforge.rollout.factory import build_rollout_engine
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.vllm.engine import VLLMOptions, _tokenizer_dir, require_main_thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("factory")
    tokenizer = tiny_assets(root, seed=0, data=False)["tokenizer"]
    return str(root / "model"), tokenizer


def test_factory_builds_the_hf_engine_and_rejects_unknown_kinds(tiny: tuple[str, Any], tmp_path: Path) -> None:
    model, tokenizer = tiny
    engine = build_rollout_engine("hf", model, tokenizer, weights_root=tmp_path / "weights")
    assert isinstance(engine, HFRolloutEngine) and engine.version == 0 and engine.source is not None
    with pytest.raises(ValueError, match=r"rollout_engine='tgi' is not one of \['hf', 'vllm'\]"):
        build_rollout_engine("tgi", model, tokenizer)


def test_the_embedded_engine_generates_on_this_ranks_device(
    tiny: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU rank the trainers' HF rollout engine must sample on the GPU, not on the CPU (it did:
    the factory never passed a device). "meta" stands in for cuda:N here: any device but the CPU."""
    import torch

    import shardforge.mesh

    model, tokenizer = tiny
    monkeypatch.setattr(shardforge.mesh, "current_device", lambda: torch.device("meta"))
    engine = build_rollout_engine("hf", model, tokenizer)
    assert isinstance(engine, HFRolloutEngine)
    assert engine.device == torch.device("meta")
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}


def test_factory_says_how_to_install_vllm_when_it_is_missing(
    tiny: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r"needs vLLM, which is not installed: pip install .*\[vllm\]") as info:
        build_rollout_engine("vllm", model, tokenizer)
    assert "nox -s vllm" in str(info.value) and "docs/packages/algorithms-grpo.md" in str(info.value)
    # A server started from this interpreter needs vLLM here too.
    with pytest.raises(ImportError, match="needs vLLM, which is not installed"):
        build_rollout_engine("vllm", model, tokenizer, vllm=VLLMOptions(mode="server"))


def test_server_mode_reports_a_server_that_does_not_start(tiny: tuple[str, Any], tmp_path: Path) -> None:
    """A server interpreter without vLLM: the engine fails fast with the server's own log."""
    import sys

    model, tokenizer = tiny
    options = VLLMOptions(mode="server", server_python=sys.executable, server_startup_timeout_s=120)
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') is None else 1)"
    if __import__("subprocess").run([sys.executable, "-c", code]).returncode != 0:
        pytest.skip("this interpreter has vLLM: the server would start")
    with pytest.raises(RuntimeError, match=r"the vLLM server exited with code 1; log tail:\n.*No module named 'vllm'"):
        build_rollout_engine("vllm", model, tokenizer, weights_root=tmp_path / "w", vllm=options)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"placement": "rank1"}, r"vllm.placement='rank1' is not one of \['rank0', 'each_rank'\]"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        ({"kv_cache_space_gib": 0}, "kv_cache_space_gib=0 must be a whole number >= 1"),
        ({"max_model_len": 1}, "max_model_len=1 must be >= 2"),
        ({"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
        ({"mode": "remote"}, r"vllm.mode='remote' is not one of \['in_process', 'server'\]"),
        ({"server_startup_timeout_s": 0.0}, "server_startup_timeout_s=0.0 must be > 0"),
    ],
)
def test_vllm_options_are_validated(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VLLMOptions(**change)


def test_factory_checks_the_options_type(tiny: tuple[str, Any]) -> None:
    model, tokenizer = tiny
    with pytest.raises(TypeError, match="vllm= must be VLLMOptions, got dict"):
        build_rollout_engine("vllm", model, tokenizer, vllm={"placement": "rank0"})  # type: ignore[arg-type]


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_trainer_configs_select_the_engine(trainer: str) -> None:
    if trainer == "grpo":
        from shardforge.algorithms.trainers.grpo import GRPOConfig as Config
    else:
        from shardforge.algorithms.trainers.ppo import PPOConfig as Config  # type: ignore[assignment]
    base = {"model": "m", "train_file": "t.jsonl", "output_dir": "o"}
    default = build_config(Config, base)
    assert default.rollout_engine == "hf" and default.vllm == VLLMOptions()
    data = apply_overrides(base, ["rollout_engine=vllm", "vllm.gpu_memory_utilization=0.3", "vllm.max_model_len=48"])
    config = build_config(Config, data)
    assert config.rollout_engine == "vllm"
    assert config.vllm == dataclasses.replace(VLLMOptions(), gpu_memory_utilization=0.3, max_model_len=48)
    with pytest.raises(ValueError, match=r"rollout_engine: 'sglang' is not one of \['hf', 'vllm'\]"):
        build_config(Config, base | {"rollout_engine": "sglang"})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['gpu_mem'\] in vllm"):
        build_config(Config, base | {"vllm": {"gpu_mem": 0.3}})
    with pytest.raises(ValueError, match=r"vllm.placement: 'everywhere' is not one of \['rank0', 'each_rank'\]"):
        build_config(Config, base | {"vllm": {"placement": "everywhere"}})
    with pytest.raises(ValueError, match=r"vllm.gpu_memory_utilization=2.0 must be in \(0, 1\]"):
        build_config(Config, base | {"vllm": {"gpu_memory_utilization": 2}})


def test_request_seeds_are_distinct_and_leave_room_for_the_sample_index() -> None:
    n = 8
    seeds = [request_seed(s, i, n) for s in range(50) for i in range(64)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**62 - n for s in seeds)
    # vLLM gives sample k of a prompt seed s + k: the ranges of different prompts must not overlap.
    spans = sorted(seeds)
    assert all(b - a >= n for a, b in itertools.pairwise(spans))
    assert request_seed(3, 5, n) == request_seed(3, 5, n)


def test_vllm_gets_the_tokenizer_directory_the_trainer_loaded(tiny: tuple[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model, tokenizer = tiny
    separate = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(separate))
    assert _tokenizer_dir(AutoTokenizer.from_pretrained(str(separate)), model) == str(separate)
    assert _tokenizer_dir(object(), model) == model  # no directory to point at: the model's


def test_collective_vllm_modes_refuse_the_async_rollout_thread() -> None:
    """rank0 placement and a shared server use collectives: not from GRPO's async generator thread."""
    from concurrent.futures import ThreadPoolExecutor

    require_main_thread("rank0 placement")  # the trainer's own thread: fine
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(require_main_thread, "rank0 placement")
        with pytest.raises(RuntimeError, match=r"cannot run on a background thread .* vllm.placement=each_rank"):
            future.result()


def test_rank0_vllm_refuses_a_held_out_split_that_leaves_a_rank_without_prompts() -> None:
    from types import SimpleNamespace

    from shardforge.algorithms.trainers.rl.common import check_eval_split

    def config(engine: str = "vllm", placement: str = "rank0", eval_size: int | None = None) -> Any:
        return SimpleNamespace(rollout_engine=engine, vllm=VLLMOptions(placement=placement), eval_size=eval_size)

    with pytest.raises(ValueError, match="1 prompts for 2 data-parallel ranks"):
        check_eval_split(config(eval_size=1), 16, 2)
    with pytest.raises(ValueError, match="3 prompts for 4"):
        check_eval_split(config(), 3, 4)
    # Fine: enough prompts, one rank, no held-out set, per-rank engines, or the embedded engine.
    check_eval_split(config(eval_size=2), 16, 2)
    check_eval_split(config(eval_size=1), 16, 1)
    check_eval_split(config(eval_size=1), None, 2)
    check_eval_split(config(placement="each_rank", eval_size=1), 16, 2)
    check_eval_split(config(engine="hf", eval_size=1), 16, 2)
