"""LoRA under tensor parallelism (+ sequence parallelism) and under FSDP2, against one process.

Every rank builds the same seeded tiny Llama with the same adapters (init="random": B != 0, so every
adapter gets a gradient) and keeps an unsharded copy as the reference.

- TP (2 ranks): a Megatron plan written here with torch's styles (this package must not import
  shardforge.tensor_parallel), passed through `lora_tp_plan`; adapters on colwise (q/v/up) and rowwise
  (o/down) parents. Compared: logits and every adapter gradient (``full_tensor()``).
- FSDP2 (2 ranks): each decoder layer one unit holding frozen base weights and trainable adapters
  together (FSDP2 accepts mixed requires_grad in one unit); each rank trains on its half of the batch.
  Compared: adapters after 2 AdamW steps, merged weights (`merged_state_dict` on the sharded model).

Tolerances (fp32, CPU): sharded runs sum the same products in another order (partial matmuls +
reduce-scatter / all-reduce), so results differ by rounding only: observed 1.2e-7 on logits, 2.4e-8 on grads
(of magnitude <= 0.08), 7.4e-8 on updated adapters and merged weights; we allow 1e-5 (a missing reduction
or a wrong shard is off by O(1e-3) or more).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
SEQ = 8
TOL = {"rtol": 1e-5, "atol": 1e-5}
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _model_and_reference() -> tuple[Any, Any, list[str]]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardforge.lora import LoRAConfig, apply_lora

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    names = apply_lora(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS, init="random"), seed=1)
    return model, copy.deepcopy(model), names


def _batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(rows, SEQ)
    return ids, pos, torch.roll(ids, -1, dims=1)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    layer = "model.layers.*"
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        **{f"{layer}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{layer}.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _tp_rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from shardforge.lora import lora_tp_plan

    model, reference, names = _model_and_reference()
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), lora_tp_plan(_tp_plan()))
    ids, pos, targets = _batch(2, seed=3)
    out = {}
    for key, m in (("ref", reference), ("tp", model)):
        logits = m(input_ids=ids, position_ids=pos).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        out[key] = {
            "logits": _full(logits),
            "grads": {n: _full(p.grad) for n, p in m.named_parameters() if p.requires_grad},
        }
    placements = {}
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module.lora_A.weight, DTensor) and isinstance(module.weight, DTensor)
        placements[name] = (module.lora_A.weight.placements[0], module.lora_B.weight.placements[0])
    out["placements"] = placements
    return out


def test_tensor_parallel_lora_matches_one_process() -> None:
    from torch.distributed.tensor import Replicate, Shard

    results = get_rank_pool(2).run(_tp_rank)
    for result in results:
        torch.testing.assert_close(result["tp"]["logits"], result["ref"]["logits"], **TOL)
        ref_grads, tp_grads = result["ref"]["grads"], result["tp"]["grads"]
        assert tp_grads.keys() == ref_grads.keys() and len(ref_grads) == 2 * 2 * len(TARGETS)
        for name, grad in ref_grads.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(tp_grads[name], grad, **TOL, msg=name)
        # Colwise parents: A replicated, B split on out features; rowwise parents: A split on in features.
        assert result["placements"]["model.layers.0.self_attn.q_proj"] == (Replicate(), Shard(0))
        assert result["placements"]["model.layers.1.mlp.down_proj"] == (Shard(1), Replicate())


def _fsdp_rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from shardforge.lora import merged_state_dict

    model, reference, _ = _model_and_reference()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # frozen base sharded too
    rank, world = dist.get_rank(), dist.get_world_size()
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        for m in (model, reference)
    ]
    for step in range(2):
        ids, pos, targets = _batch(2 * world, seed=10 + step)
        for m, rows, scale in ((reference, slice(None), 1.0), (model, slice(2 * rank, 2 * rank + 2), world)):
            logits = m(input_ids=ids[rows], position_ids=pos[rows]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), targets[rows].flatten(), reduction="sum"
            )
            # FSDP averages grads over ranks; scale so the sum equals the full batch's mean loss.
            (loss * scale / targets.numel()).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return {
        "adapters": {n: _full(p) for n, p in model.named_parameters() if p.requires_grad},
        "ref": {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad},
        "frozen_grads": frozen_grads,
        "merged": merged_state_dict(model),
        "ref_merged": merged_state_dict(reference),
        "names_after": sorted(n for n, _ in model.named_parameters()),
        "names_ref": sorted(n for n, _ in reference.named_parameters()),
    }


def test_fsdp2_lora_steps_match_one_process() -> None:
    results = get_rank_pool(2).run(_fsdp_rank)
    for result in results:
        assert result["frozen_grads"] == []
        assert result["names_after"] == result["names_ref"]  # merged_lora restored the adapters
        for name, value in result["ref"].items():
            torch.testing.assert_close(result["adapters"][name], value, **TOL, msg=name)
        assert result["merged"].keys() == result["ref_merged"].keys()
        for name, value in result["ref_merged"].items():
            torch.testing.assert_close(result["merged"][name], value, **TOL, msg=name)
