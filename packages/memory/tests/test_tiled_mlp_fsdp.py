"""Tiled MLP under FSDP2 on 2 ranks (with and without activation checkpointing) vs one process.

Each rank trains on its own batch; the one-process reference runs both batches and
averages the losses, which is what FSDP's gradient reduce-scatter (mean over ranks) gives.
If the tiled MLP's parameter gradients did not reach FSDP's unsharded parameters before
the layer's reduce-scatter, the MLP weights' gradients would be missing or zero.

Tolerance: the sharded run sums the two ranks' gradients in a reduce-scatter and the tiled
MLP sums its chunks in another order; observed <= 1e-7 on grads of magnitude <= 0.3.
rtol/atol 1e-5/1e-6 leave >10x headroom; a lost chunk or rank is off by >= 1e-3.
Rank functions are module-level so the rank pool can pickle them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
SEQ = 11  # prime: uneven chunks for 3 shards


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
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(100 + rank))


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def tiled_fsdp_vs_single(checkpointing: bool) -> dict[str, Any]:
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardforge.memory import apply_tiled_mlp

    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model()
    reference = copy.deepcopy(model)
    ref_losses = [loss_of(reference, batch(r)) for r in range(world)]
    (sum(ref_losses) / world).backward()

    num_tiled = apply_tiled_mlp(model, 3)
    if checkpointing:
        for layer in model.model.layers:
            checkpoint(layer)  # the composable API, as shardforge.fsdp_wrap uses it
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)  # reshard_after_forward=True: params re-gathered for backward
    fully_shard(model, mesh=mesh)
    loss = loss_of(model, batch(rank))
    loss.backward()

    grad_errors = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        got = p.grad.full_tensor() if p.grad is not None else None
        if got is None:
            grad_errors[name] = "missing"
            continue
        try:
            torch.testing.assert_close(got, q.grad, rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            grad_errors[name] = str(err).splitlines()[0] + f" (max ref {q.grad.abs().max().item():.3g})"
    return {
        "num_tiled": num_tiled,
        "loss": loss.item(),
        "ref_loss": ref_losses[rank].item(),
        "grad_errors": grad_errors,
        "mlp_grad_norm": float(model.model.layers[0].mlp.down_proj.weight.grad.full_tensor().norm()),
    }


def test_tiled_mlp_under_fsdp2_matches_one_process() -> None:
    for checkpointing in (False, True):
        results = get_rank_pool(2).run(tiled_fsdp_vs_single, checkpointing)
        for rank, res in enumerate(results):
            assert res["num_tiled"] == 2
            assert abs(res["loss"] - res["ref_loss"]) <= 1e-6 * abs(res["ref_loss"]), (checkpointing, rank, res)
            assert res["grad_errors"] == {}, f"checkpointing={checkpointing} rank {rank}: {res['grad_errors']}"
            assert res["mlp_grad_norm"] > 1e-3
