"""The planner's DDP form of replicate-only layouts (plan/ddp.py): proposed and ranked first when
it fits, its memory is the one-process estimate plus DDP's gradient buckets, not proposed with
CPU offload or when it does not fit the budget, and the CLI shows how to select it."""

from __future__ import annotations

import pytest

from shardforge.algorithms.plan import PlanOptions, estimate_memory, model_stats, plan_layouts
from shardforge.algorithms.plan.ddp import ddp_applies, estimate_ddp_memory
from shardforge.mesh import ParallelDims

MODEL = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False,
}  # fmt: skip
OPTS = PlanOptions(seq_len=128, micro_batch_tokens=256, param_dtype="fp32")


def _stats():  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    return model_stats(Qwen3Config(**MODEL))


def test_ddp_memory_is_one_process_plus_gradient_buckets() -> None:
    stats = _stats()
    r2 = ParallelDims.parse("r2").resolve(2)
    single = estimate_memory(stats, ParallelDims.parse("d1").resolve(1), OPTS)
    ddp = estimate_ddp_memory(stats, r2, OPTS)
    grads = single.state["grads"]
    assert grads == 4 * stats.num_params  # fp32 gradients of every parameter
    assert ddp.data_parallel == "ddp" and ddp.dims == r2
    assert ddp.total == single.total + grads and ddp.comm == single.comm + grads
    fsdp = estimate_memory(stats, r2, OPTS)
    assert fsdp.data_parallel == "fsdp" and fsdp.total < ddp.total  # FSDP shards: less memory
    assert not ddp_applies(ParallelDims.parse("r2d2").resolve(4), OPTS)
    assert not ddp_applies(r2, PlanOptions(seq_len=128, micro_batch_tokens=256, cpu_offload=True))
    with pytest.raises(ValueError, match="not a replicate-only layout"):
        estimate_ddp_memory(stats, ParallelDims.parse("d2").resolve(2), OPTS)


def test_planner_picks_ddp_when_it_fits_and_fsdp_when_it_does_not() -> None:
    stats = _stats()
    result = plan_layouts(stats, 4, OPTS)
    best = result.fitting[0]
    assert (best.dims.to_string(), best.data_parallel) == (ParallelDims.parse("r4").resolve(4).to_string(), "ddp")
    assert [e.data_parallel for e in result.fitting].count("ddp") == 1  # only r4 is replicate-only
    ddp_total = best.total
    fsdp_best = next(e for e in result.fitting if e.data_parallel == "fsdp")
    tight = plan_layouts(stats, 4, OPTS, budget=(ddp_total + fsdp_best.total) // 2)
    assert all(e.data_parallel == "fsdp" for e in tight.fitting)
    assert [e.data_parallel for e in tight.too_big] == ["ddp"]
    offload = plan_layouts(stats, 4, PlanOptions(seq_len=128, micro_batch_tokens=256, cpu_offload=True))
    assert all(e.data_parallel == "fsdp" for e in offload.fitting + offload.too_big)
    assert result.as_dict()["fitting"][0]["data_parallel"] == "ddp"


def test_cli_table_marks_ddp_rows_and_says_how_to_select_them(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    from pathlib import Path

    from shardforge.algorithms.cli.main import main

    config = Path(str(tmp_path)) / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", **MODEL}))
    assert main(["plan", str(config), "--world-size", "2", "--seq-len", "128", "--param-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0:2] for line in out.splitlines()[3:] if line and not line.startswith("'")]
    assert rows[0] == ["r2d1", "ddp"], out
    assert "layout=rN engine.data_parallel=ddp" in out
