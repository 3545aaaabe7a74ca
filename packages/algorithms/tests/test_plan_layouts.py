"""Layout enumeration (only what the engine accepts), ranking, and the `shardforge plan` CLI."""

from __future__ import annotations

import json

import pytest

from shardforge.algorithms.plan import PlanOptions, enumerate_layouts, load_model_config, model_stats, plan_layouts
from shardforge.algorithms.plan.layouts import validate_for_engine
from shardforge.mesh import ParallelDims

MODEL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}
OPTS = PlanOptions(seq_len=128, micro_batch_tokens=256)


def _stats():  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    return model_stats(Qwen3Config(**MODEL))


def test_every_enumerated_layout_is_valid_and_none_is_missing() -> None:
    stats = _stats()
    layouts = enumerate_layouts(stats, 8, OPTS)
    assert len({d.to_string() for d in layouts}) == len(layouts)
    for dims in layouts:
        assert dims.world_size == 8
        validate_for_engine(dims, stats, OPTS)  # would raise
        assert dims.pp <= 2 and dims.tp in (1, 2) and dims.cp in (1, 2, 4)  # cp=4 > 2 kv heads: repeated
    strings = {d.to_string() for d in layouts}
    assert ParallelDims.parse("d8").resolve(8).to_string() in strings
    assert ParallelDims.parse("r2d2t2").resolve(8).to_string() in strings
    # tp=4 does not divide 2 kv heads, pp=4/8 exceeds 2 layers, pp with cp is refused by the engine
    for refused in ("d2t4", "d2p4", "d1p8", "d2c2p2"):
        assert ParallelDims.parse(refused).resolve(8).to_string() not in strings


def test_moe_enumerates_expert_parallel_sizes_that_divide_the_experts() -> None:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**{**MODEL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    layouts = enumerate_layouts(model_stats(config), 8, OPTS)
    eps = {d.ep for d in layouts}
    assert eps == {1, 2, 4}
    assert all(d.pp == 1 for d in layouts if d.ep > 1) and all(d.dp_replicate == 1 for d in layouts if d.ep > 1)


def test_ranking_prefers_data_parallel_and_respects_the_budget() -> None:
    stats = _stats()
    result = plan_layouts(stats, 8, OPTS, budget=None)
    assert result.fitting[0].dims.tp * result.fitting[0].dims.cp * result.fitting[0].dims.pp == 1
    smallest = min(e.total for e in result.fitting)
    tight = plan_layouts(stats, 8, OPTS, budget=smallest)
    assert all(e.total <= smallest for e in tight.fitting) and tight.too_big
    assert [e.total for e in tight.too_big] == sorted(e.total for e in tight.too_big)


def test_bad_layout_and_world_size_errors() -> None:
    stats = _stats()
    with pytest.raises(ValueError, match="divisible"):
        plan_layouts(stats, 8, OPTS, layouts=["t3"])  # 3 does not divide world 8
    with pytest.raises(ValueError, match="tp=4 must divide"):
        plan_layouts(stats, 8, OPTS, layouts=["d2t4"])
    with pytest.raises(ValueError, match="world_size"):
        enumerate_layouts(stats, 0, OPTS)


def test_prime_world_size_leaves_pure_data_parallel_layouts() -> None:
    layouts = enumerate_layouts(_stats(), 7, OPTS)
    assert {(d.dp_replicate, d.dp_shard) for d in layouts} == {(1, 7), (7, 1)}


def test_cli_plans_llama3_70b_on_1024_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    from shardforge.algorithms.cli.main import main

    argv = ["plan", "llama3-70b", "--world-size", "1024", "--seq-len", "8192", "--memory", "80GiB"]
    assert main([*argv, "--compute-dtype", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_params"] == pytest.approx(70.55e9, rel=1e-3)
    assert out["fitting"] and all(e["total"] <= 80 * 2**30 for e in out["fitting"])
    assert main([*argv, "--ac", "full", "--top", "5"]) == 0
    table = capsys.readouterr().out
    assert "layout" in table and "total" in table and "yes" in table
    assert "params GiB" in table and "p1 r" not in table  # rows in the CLI's layout form, e.g. r64d16


def test_cli_plan_errors_are_one_line_and_units_fit_tiny_models(capsys: pytest.CaptureFixture[str]) -> None:
    from shardforge.algorithms.cli.main import main

    argv = ["plan", "llama3-70b", "--world-size", "8", "--seq-len", "128"]
    assert main([*argv, "--memory", "80"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory '80' has no unit and is under 1 MiB; write the unit, e.g. '80GiB'" in err
    assert main(["plan", "nope-7b", "--world-size", "8", "--seq-len", "128"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_plan_table_scales_units_and_prints_cli_layouts() -> None:
    from types import SimpleNamespace

    from shardforge.algorithms.plan.report import format_table, layout_string
    from shardforge.mesh import ParallelDims

    assert layout_string(ParallelDims.parse("r64d16")) == "r64d16"
    assert layout_string(ParallelDims.parse("p2d4t2")) == "p2d4t2"
    assert layout_string(ParallelDims(dp_shard=1)) == "d1"
    tiny = SimpleNamespace(dims=ParallelDims(dp_shard=2), params=3000, grads=3000, optim=6000, activations=500,
                           comm=100, total=12600, phase="backward")  # fmt: skip
    table = format_table([tiny], None)  # type: ignore[list-item]
    assert "params KiB" in table and "12.30" in table and "0.00  " not in table.splitlines()[2]


def test_cli_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    from shardforge.algorithms.cli.main import main

    with pytest.raises(ValueError, match="presets"):
        main(["--debug", "plan", "nope-7b", "--world-size", "8", "--seq-len", "128"])
    assert load_model_config("qwen3-30b-a3b").num_experts == 128


def test_one_refused_layout_among_several_is_reported_and_the_others_planned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stats = _stats()
    result = plan_layouts(stats, 8, OPTS, layouts=["d8", "d2t4", "d4t2"])
    assert sorted(e.dims.to_string() for e in result.fitting) == sorted(
        ParallelDims.parse(t).resolve(8).to_string() for t in ("d8", "d4t2")
    )
    assert [layout for layout, _ in result.rejected] == ["d2t4"] and "tp=4 must divide" in result.rejected[0][1]
    assert result.as_dict()["rejected"][0]["layout"] == "d2t4"

    from shardforge.algorithms.cli.main import main

    assert main(["plan", "qwen3-8b", "--world-size", "8", "--seq-len", "128", "--layout", "d8", "--layout", "t3"]) == 0
    out = capsys.readouterr().out
    assert "layout t3 not planned:" in out and "divisible" in out
    assert "d8" in out.split("layout t3")[0]  # d8's row is still in the table
