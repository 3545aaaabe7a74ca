"""engine.freeze_module_prefix: frozen parameters get no gradient, no optimizer state and stay unchanged
after steps, at world 1 and FSDP 2 (whose reduce-scatter only carries parameters that have a gradient)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

SEQS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14], [1, 4, 2, 3], [1, 6, 6, 6, 7, 8, 9, 2]]
FROZEN = ("model.embed_tokens", "model.layers.0")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("freeze")
    tiny_assets(root, seed=5, data=False)
    return str(root / "model")


def _is_frozen(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FROZEN)


def _freeze_steps(model_dir: str, layout: str) -> dict[str, Any]:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
    from shardforge.engine.objectives.sft import sft_loss

    config = EngineConfig(freeze_module_prefix=FROZEN, optimizer=OptimizerConfig(lr=1e-2))
    engine = TrainEngine(model_dir, layout, config)
    batch = pack_sequences(SEQS).select(list(range(engine.dp_rank, len(SEQS), engine.dp_size)))
    before = engine.full_state_dict()
    # One backward by hand: which parameters got a gradient (FSDP2 reduce-scatters exactly those).
    runner = engine.runner
    runner.forward_backward(runner.microbatches(batch), sft_loss, 1.0, wants_entropy=False)
    with_grad = {n for n, p in engine.model.named_parameters() if p.grad is not None}
    engine.optimizer.zero_grad(set_to_none=True)
    losses = [engine.train_batch(batch)["loss"] for _ in range(3)]
    params = dict(engine.model.named_parameters())
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    return {
        "frozen": sorted(n for n, p in params.items() if not p.requires_grad),
        "with_grad": sorted(with_grad),
        "in_optimizer": sorted(n for n, p in params.items() if id(p) in in_optimizer),
        "with_state": sorted(n for n, p in params.items() if p in engine.optimizer.state),
        "before": before,
        "after": engine.full_state_dict(),
        "losses": losses,
    }


def _check(result: dict[str, Any]) -> None:
    names = sorted(result["before"])
    frozen = [n for n in names if _is_frozen(n)]
    trained = [n for n in names if not _is_frozen(n)]
    assert frozen and result["frozen"] == frozen
    assert result["with_grad"] == trained, "frozen parameters must get no gradient, trained ones must"
    assert result["in_optimizer"] == trained and result["with_state"] == trained
    for name in frozen:
        assert torch.equal(result["before"][name], result["after"][name]), f"frozen {name} changed"
    for name in trained:
        assert not torch.equal(result["before"][name], result["after"][name]), f"trained {name} did not change"
    assert result["losses"][-1] < result["losses"][0]


def test_freeze_module_prefix_world1_and_fsdp2(lm_dir: str) -> None:
    single = _freeze_steps(lm_dir, "d1")
    _check(single)
    sharded = get_rank_pool(2).run(_freeze_steps, lm_dir, "d2", timeout_s=300)[0]
    _check(sharded)
    # Same global batch and weights: fp32 rounding-level differences only (reduce-scatter order).
    for a, b in zip(single["losses"], sharded["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (single["losses"], sharded["losses"])


def test_unknown_prefix_lists_module_names(lm_dir: str) -> None:
    from shardforge.engine import EngineConfig, TrainEngine

    with pytest.raises(ValueError, match=r"\['model.vision'\] matches no parameter.*'model.layers'"):
        TrainEngine(lm_dir, "d1", EngineConfig(freeze_module_prefix=("model.vision",)))
    # Whole name components only: "model.layer" is not "model.layers".
    with pytest.raises(ValueError, match=r"model\.layer'"):
        TrainEngine(lm_dir, "d1", EngineConfig(freeze_module_prefix=("model.layer",)))
    with pytest.raises(ValueError, match="list of module names"):
        EngineConfig(freeze_module_prefix="model.visual")  # type: ignore[arg-type]
