"""The layout planner's predicted per-rank peak vs the measured peak of a real `train_batch`.

Each case runs one warm-up and one measured `TrainEngine.train_batch` (world 1 in this
process, the others on the shared gloo pool of 2 ranks) and counts live tensor-storage
bytes on each rank (`shardforge.algorithms.plan.measure`); the planner predicts the same
run from shapes (`predict_engine_peak`). The issue's bar is predicted/measured within 15%;
benchmarks/bench_planner.py runs the full table (world 4 layouts, CP, HSDP, ...). Options the
engine gained with issue 10 are covered too: AnyPrecisionAdamW (bf16 params + Kahan), tiled MLP and
LoRA (frozen base: autograd keeps far fewer activations, see plan/activations.py).

The model is big enough that fixed overheads do not dominate: activations (~100 MiB)
and model state (~60 MiB fp32) at 512 tokens per rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardforge.algorithms.plan.measure import measure_on_ranks, predict_engine_peak

TOLERANCE = 0.15  # the bar
# Every case here is measured within 0.1%; 5% still fails on a memory-model error like the ones LoRA
# (+12%: frozen weights keep no inputs) and activation checkpointing (+8%) once had.
TIGHT = 0.05
SEQ_LEN, TOKENS = 256, 512
MODEL = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("d1", 1, {}),
    ("d2", 2, {"compute_dtype": "bf16", "activation_checkpointing": "full"}),
    ("d2", 2, {"param_dtype": "bfloat16", "optimizer": {"name": "anyprecision_adamw"}, "tiled_mlp_shards": 2}),
    ("d1t2", 2, {}),
    ("d2", 2, {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}),
]


# heavy (~31-37 s each): the activation-checkpointing terms are checked by hand in
# test_plan_memory.py::test_activation_checkpointing_terms; AnyPrecisionAdamW and the tiled MLP are measured
# against torch.cuda.max_memory_allocated by benchmarks/gpu/bench_planner.py (0.92-0.99 on an H100 and an
# H200); CI measures the other cases end to end.
HEAVY_CASES = {1, 2}


@pytest.mark.parametrize(
    ("layout", "world", "options"),
    [
        pytest.param(*c, id=f"{c[0]}-{c[2]}", marks=[pytest.mark.heavy] if i in HEAVY_CASES else [])
        for i, c in enumerate(CASES)
    ],
)
def test_predicted_peak_within_15_percent_of_measured(layout: str, world: int, options: dict[str, Any]) -> None:
    kwargs = {"seq_len": SEQ_LEN, "micro_batch_tokens": TOKENS, "engine_options": options}
    per_rank = measure_on_ranks(MODEL, layout, world, **kwargs)
    measured = max(r["peak_bytes"] for r in per_rank)
    predicted = predict_engine_peak(MODEL, layout, world, **kwargs).total
    # Sanity: the measurement saw more than the model state (activations were counted).
    assert measured > 1.5 * per_rank[0]["baseline_bytes"]
    assert abs(predicted / measured - 1) <= TOLERANCE, (layout, options, predicted / 2**20, measured / 2**20)
    assert abs(predicted / measured - 1) <= TIGHT, (layout, options, predicted / 2**20, measured / 2**20)
