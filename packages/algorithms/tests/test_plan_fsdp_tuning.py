"""The planner's FSDP settings (plan/fsdp_tuning.py): the memory model charges each knob its
gathered units, the suggestion is the fastest measured setting that fits the budget, nothing is
suggested where FSDP does not run or the user set the knobs, and the CLI prints the overrides."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import Qwen3Config

from shardforge.algorithms.plan import PlanOptions, estimate_memory, model_stats
from shardforge.algorithms.plan.ddp import estimate_ddp_memory
from shardforge.algorithms.plan.fsdp_tuning import suggest_fsdp
from shardforge.mesh import ParallelDims

# Small vocabulary: the peak is in a decoder layer's backward, where the gathered units count.
MODEL = {"vocab_size": 512, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128}  # fmt: skip
OPTS = PlanOptions(seq_len=1024, micro_batch_tokens=1024, compute_dtype="bfloat16")


@pytest.fixture(scope="module")
def stats():  # type: ignore[no-untyped-def]
    return model_stats(Qwen3Config(**MODEL))


def _d4():  # type: ignore[no-untyped-def]
    return ParallelDims.parse("d4").resolve(4)


def test_each_knob_adds_its_gathered_units(stats) -> None:  # type: ignore[no-untyped-def]
    base = estimate_memory(stats, _d4(), OPTS)
    assert base.phase == "layer"
    # One decoder layer gathered in bf16: q/k/v/o + gate/up/down weights (+ norms) = 2 bytes each.
    layer = 2 * (1024 * 1024 * 2 + 1024 * 512 * 2 + 3 * 1024 * 4096)
    prefetch = estimate_memory(stats, _d4(), replace(OPTS, fsdp_forward_prefetch=1))
    two_layers = estimate_memory(stats, _d4(), replace(OPTS, fsdp_layers_per_unit=2))
    keep = estimate_memory(stats, _d4(), replace(OPTS, reshard_after_forward=False))
    # prefetch: one more unit in flight; two layers per unit: the two units in flight are twice as big
    assert prefetch.comm - base.comm == pytest.approx(layer, rel=0.01)
    assert two_layers.comm - base.comm == pytest.approx(2 * layer, rel=0.01)
    assert keep.total > two_layers.total > prefetch.total > base.total


def test_the_fastest_setting_that_fits_is_suggested(stats) -> None:  # type: ignore[no-untyped-def]
    base = estimate_memory(stats, _d4(), OPTS)
    prefetch = estimate_memory(stats, _d4(), replace(OPTS, fsdp_forward_prefetch=1))
    unbounded = suggest_fsdp(stats, base, OPTS, None)
    assert unbounded is not None and unbounded.overrides == {"fsdp_forward_prefetch": 1}
    assert unbounded.cli() == "engine.fsdp_forward_prefetch=1" and unbounded.gain == "x1.24"
    assert unbounded.extra_bytes == prefetch.total - base.total > 0
    fits = suggest_fsdp(stats, base, OPTS, prefetch.total)
    assert fits is not None and fits.overrides == {"fsdp_forward_prefetch": 1}
    # Every setting needs more than the default's peak: with no room left, nothing is suggested.
    assert suggest_fsdp(stats, base, OPTS, base.total) is None


def test_nothing_is_suggested_without_fsdp_or_when_the_user_chose(stats) -> None:  # type: ignore[no-untyped-def]
    one = ParallelDims.parse("d1").resolve(1)
    assert suggest_fsdp(stats, estimate_memory(stats, one, OPTS), OPTS, None) is None
    replicas = ParallelDims.parse("r4").resolve(4)
    assert suggest_fsdp(stats, estimate_ddp_memory(stats, replicas, OPTS), OPTS, None) is None
    chosen = replace(OPTS, fsdp_layers_per_unit=2)
    assert suggest_fsdp(stats, estimate_memory(stats, _d4(), chosen), chosen, None) is None


def test_cli_prints_the_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardforge.algorithms.cli.main import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", **MODEL}))
    args = ["plan", str(config), "--world-size", "4", "--seq-len", "1024", "--layout", "d4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "FSDP settings for d4: engine.fsdp_forward_prefetch=1 (measured x1.24" in out, out
    assert main([*args, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["fsdp_settings"]["overrides"] == {"fsdp_forward_prefetch": 1}
