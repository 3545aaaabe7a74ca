"""The planner's analytic per-rank parameter counts vs the real sharding on a fake process group.

`shards.ShardPlan` computes local shard sizes from shapes (so a 1024-rank plan takes no
process group); here the real `apply_tensor_parallel` + `apply_fsdp` run on a meta-device
model over a fake mesh, and rank 0's local shard elements (FSDP2 gives rank 0 the full
``ceil(dim0 / n)`` rows) must equal the analytic count exactly.
"""

from __future__ import annotations

import pytest
import torch

from shardforge.algorithms.plan.options import PlanOptions
from shardforge.algorithms.plan.shards import shard_plan
from shardforge.algorithms.plan.stats import model_stats
from shardforge.mesh import ParallelDims
from shardforge.mesh.testing import fake_mesh

# d3 / d6t2 split vocab 1000 and MLP width 680 unevenly, so FSDP pads: the analytic ceil() must match.
MODEL = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 680,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "tie_word_embeddings": False,
}


def _real_local_numel(dims: ParallelDims, world: int) -> int:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, Qwen3Config

    from shardforge.fsdp_wrap import FSDPConfig, apply_fsdp
    from shardforge.tensor_parallel import apply_tensor_parallel

    with fake_mesh(dims, world, rank=0) as mesh:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL))
        if dims.tp > 1:
            apply_tensor_parallel(model, mesh.get("tp"))
        if mesh.has("dp_replicate") and mesh.has("fsdp"):
            apply_fsdp(model, mesh.get(("dp_replicate", "fsdp")), FSDPConfig())
        elif mesh.has("fsdp"):
            apply_fsdp(model, mesh.get("fsdp"), FSDPConfig())
        elif mesh.has("dp_replicate"):
            apply_fsdp(model, mesh.get("dp_replicate"), FSDPConfig())
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("layout", "world"),
    [
        ("d1", 1),
        ("d3", 3),
        ("d4", 4),
        ("d1t2", 2),
        ("d2t2", 4),
        ("r2d2", 4),
        ("r4d1", 4),
        ("d2c2t2", 8),
        ("d6t2", 12),
        ("d64t4", 256),
    ],
)
def test_analytic_shards_match_fake_pg_sharding(layout: str, world: int) -> None:
    from transformers import Qwen3Config

    stats = model_stats(Qwen3Config(**MODEL))
    dims = ParallelDims.parse(layout).resolve(world)
    plan = shard_plan(stats, dims)
    params = [*stats.embedding, *stats.lm_head, *stats.root]
    params += [p for k in stats.layer_kind for p in stats.layer_specs[k].params]
    analytic = sum(plan.local_numel(p) for p in params)
    assert analytic == _real_local_numel(dims, world)


def test_memory_params_term_is_the_shard_count_times_dtype() -> None:
    from transformers import Qwen3Config

    from shardforge.algorithms.plan.memory import estimate_memory

    stats = model_stats(Qwen3Config(**MODEL))
    dims = ParallelDims.parse("d2t2").resolve(4)
    opts = PlanOptions(seq_len=64, micro_batch_tokens=64, param_dtype="fp32")
    est = estimate_memory(stats, dims, opts)
    assert est.params == 4 * _real_local_numel(dims, 4)
    assert est.state["optim"] == 2 * est.params  # AdamW: two fp32 moments per param
