"""Tiled MLP with tensor-parallel MLPs (DTensor weights) on 2 ranks.

The MLP plan is the one shardforge.tensor_parallel uses for dense decoders, written with
torch's ParallelStyles directly (a feature package's tests do not import another feature
package): the MLP input becomes a replicated DTensor, gate/up are column-parallel,
down is row-parallel. Without sequence parallelism each chunk's output is the replicated
chunk, so tiling is exact up to the all-reduce; with sequence parallelism the MLP returns a
sequence shard of each chunk, which tiling cannot reassemble: it must raise, not be wrong.

Tolerance: the row-parallel all-reduce and the chunked parameter-gradient sums change the
fp32 summation order; observed <= 3e-6 on grads of magnitude <= 3 (sum loss over tokens).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
SEQ = 10


def build_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def mlp_plan(*, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    return {
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }


def grads_of(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    logits = model(input_ids=ids).logits
    torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum"
    ).backward()
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}


def tp_parity() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from shardforge.memory import apply_tiled_mlp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(7))
    model = build_model()
    reference = grads_of(copy.deepcopy(model), ids)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, mlp_plan(sequence_parallel=False))
    apply_tiled_mlp(model, 3)
    grads = grads_of(model, ids)
    errors = {}
    for name, ref in reference.items():
        if not torch.allclose(grads[name], ref, rtol=1e-5, atol=1e-5):
            errors[name] = (grads[name] - ref).abs().max().item()
    return {"errors": errors, "dtensor_mlp": isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor)}


def tp_sequence_parallel_raises() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shardforge.memory import apply_tiled_mlp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layer = build_model().model.layers[0]
    parallelize_module(layer, mesh, mlp_plan(sequence_parallel=True))
    holder = torch.nn.Module()
    holder.mlp = layer.mlp
    apply_tiled_mlp(holder, 2)
    x_local = torch.randn(1, 4, 32, requires_grad=True)  # this rank's sequence shard
    try:
        layer.mlp(x_local)
    except NotImplementedError as err:
        return str(err)
    return "no error"


def test_tiled_mlp_with_tensor_parallel_mlp_matches_one_process() -> None:
    for rank, res in enumerate(get_rank_pool(2).run(tp_parity)):
        assert res["dtensor_mlp"]
        assert res["errors"] == {}, f"rank {rank}: {res['errors']}"


def test_tiled_mlp_with_sequence_parallel_raises_clearly() -> None:
    for message in get_rank_pool(2).run(tp_sequence_parallel_raises):
        assert "maps each input token to one output token" in message
        assert "sequence parallelism" in message
