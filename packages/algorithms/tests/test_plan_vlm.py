"""The planner on image-text models: the vision tower's parameters (trained or frozen) and activations,
predicted vs the storage-tracked measurement of a real step (the bench_vlm check, smaller)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def config() -> Any:
    from shardforge.algorithms.testing.vlm import build_vlm_tokenizer, tiny_qwen2_5_vl_config

    return tiny_qwen2_5_vl_config(build_vlm_tokenizer(), hidden=64, layers=2, vision_depth=2)


def test_vision_tower_is_counted_and_frozen_params_are_frozen(config: Any) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from shardforge.algorithms.plan import PlanOptions
    from shardforge.algorithms.plan.memory import estimate_memory
    from shardforge.algorithms.plan.stats import model_stats
    from shardforge.mesh import ParallelDims

    stats = model_stats(config)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert stats.num_params == sum(p.numel() for p in model.parameters())
    assert stats.vision is not None and stats.vision.depth == 2 and stats.num_layers == 2
    assert any(p.name.startswith("model.visual.merger.") for p in stats.root)
    dims = ParallelDims.parse("d1").resolve(1)

    def estimate(**kw: Any) -> Any:
        opts = PlanOptions(seq_len=128, micro_batch_tokens=256, param_dtype="float32", attention="cpu", **kw)
        return estimate_memory(stats, dims, opts)

    trained, frozen = estimate(vision_patches=256), estimate(vision_patches=256, frozen_prefixes=("model.visual",))
    assert trained.state["params"] == frozen.state["params"]
    assert trained.state["grads"] - frozen.state["grads"] == 4 * vision  # fp32 grads of the tower
    assert trained.state["optim"] - frozen.state["optim"] == 8 * vision  # two fp32 Adam moments
    assert trained.activations > frozen.activations
    no_images = estimate()
    assert no_images.total < trained.total
    with pytest.raises(ValueError, match=r"reach into decoder layers"):
        estimate(frozen_prefixes=("model.language_model.layers.0",))


@pytest.mark.parametrize("frozen", [(), ("model.visual",)], ids=["trained", "frozen"])
def test_predicted_vlm_peak_within_15_percent_of_measured(config: Any, frozen: tuple[str, ...]) -> None:
    from shardforge.algorithms.plan.vision_measure import measure_vlm_peak, predict_vlm_peak, synthetic_vlm_examples

    examples = synthetic_vlm_examples(config, 2, 128, 16, seed=0)  # 2 sequences, 256 patches each
    measured = measure_vlm_peak(config, examples, [0, 1], freeze=frozen)["peak_bytes"]
    est = predict_vlm_peak(config, "d1", 1, seq_len=128, micro_batch_tokens=256, vision_patches=512, frozen=frozen)
    assert abs(est.total / measured - 1) <= 0.15, (est.as_dict(), measured)
