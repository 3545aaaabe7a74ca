"""AnyPrecisionAdamW on FSDP2 DTensor shards (2 ranks) vs one process, and its state-dict round trip.

Every rank trains on the same batch, so FSDP's averaged gradient is the mean of identical
values (x + x and / 2 are exact), the forward and backward on the all-gathered parameters
run the same ops on the same shapes as one process, and the optimizer is elementwise on
each shard: the sharded weights and state must equal the one-process ones bit for bit.

Parameters are bf16 (no fp32 master), exp_avg bf16, exp_avg_sq fp32 (a state dtype that
differs from the param dtype, which a plain ``Optimizer.load_state_dict`` would round) and
a bf16 Kahan buffer. Rank functions are module-level so the rank pool can pickle them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
STEPS = 3
OPTIM_KWARGS: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum_dtype": torch.bfloat16,
    "variance_dtype": torch.float32,
    "compensation_buffer_dtype": torch.bfloat16,
    "use_kahan_summation": True,
}


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
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # Reduce in fp32: gloo has no bf16 reduce-scatter on every build, and the mean of two
    # identical bf16 values is exact either way.
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def _local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        out[name] = {
            k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items() if k != "step"
        }
        out[name]["step"] = state["step"].clone()
        out[name]["param"] = p.to_local().detach().clone()
    return out


def sharded_vs_single() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from shardforge.memory import AnyPrecisionAdamW

    single = build_model()
    single_opt = AnyPrecisionAdamW(single.parameters(), **OPTIM_KWARGS)
    model = shard(build_model())
    optimizer = AnyPrecisionAdamW(model.parameters(), **OPTIM_KWARGS)
    for i in range(STEPS):
        step(single, single_opt, seed=i)
        step(model, optimizer, seed=i)

    mismatches = []
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        if not torch.equal(p.full_tensor(), q):
            mismatches.append(f"param {name}")
        for key, value in optimizer.state[p].items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if full.dtype != single_opt.state[q][key].dtype or not torch.equal(full, single_opt.state[q][key]):
                mismatches.append(f"state {name}.{key}")
    placements_ok = all(
        isinstance(optimizer.state[p][k], DTensor) and optimizer.state[p][k].placements == p.placements
        for p in model.parameters()
        for k in ("exp_avg", "exp_avg_sq", "compensation")
    )

    # Round trip: full (unsharded) optimizer state dict -> a fresh sharded model + optimizer.
    options = StateDictOptions(full_state_dict=True)
    full_osd = get_optimizer_state_dict(model, optimizer, options=options)
    full_dtypes = {k: str(v.dtype) for k, v in next(iter(full_osd["state"].values())).items()}
    fresh = shard(build_model())
    fresh.load_state_dict(model.state_dict())  # sharded model state (DTensors), same layout
    fresh_opt = AnyPrecisionAdamW(fresh.parameters(), **OPTIM_KWARGS)
    set_optimizer_state_dict(fresh, fresh_opt, full_osd, options=options)
    before, after = _local_state(model, optimizer), _local_state(fresh, fresh_opt)
    roundtrip_bad = [
        f"{name}.{key}"
        for name, entry in before.items()
        for key, value in entry.items()
        if after[name][key].dtype != value.dtype or not torch.equal(after[name][key], value)
    ]
    # One more step on both: the restored optimizer continues exactly (step count, moments, Kahan).
    step(model, optimizer, seed=STEPS)
    step(fresh, fresh_opt, seed=STEPS)
    continue_bad = [
        name
        for (name, p), q in zip(model.named_parameters(), fresh.parameters())
        if not torch.equal(p.to_local(), q.to_local())
    ]
    return {
        "mismatches": mismatches,
        "placements_ok": placements_ok,
        "full_dtypes": full_dtypes,
        "roundtrip_bad": roundtrip_bad,
        "continue_bad": continue_bad,
        "num_params": len(before),
    }


def test_fsdp2_sharded_anyprecision_equals_one_process_and_state_dict_round_trips() -> None:
    results = get_rank_pool(2).run(sharded_vs_single)
    for rank, res in enumerate(results):
        assert res["num_params"] > 10
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches']}"
        assert res["placements_ok"], f"rank {rank}: optimizer state is not a DTensor shaped like its param"
        assert res["full_dtypes"] == {
            "step": "torch.float32",
            "exp_avg": "torch.bfloat16",
            "exp_avg_sq": "torch.float32",
            "compensation": "torch.bfloat16",
        }
        assert res["roundtrip_bad"] == [], f"rank {rank}: {res['roundtrip_bad']}"
        assert res["continue_bad"] == [], f"rank {rank}: {res['continue_bad']}"


def test_one_process_reference_is_not_trivially_equal() -> None:
    # Guard for the test above: three steps must change the weights, else equality proves nothing.
    from shardforge.memory import AnyPrecisionAdamW

    model = build_model()
    initial = copy.deepcopy(model)
    optimizer = AnyPrecisionAdamW(model.parameters(), **OPTIM_KWARGS)
    for i in range(STEPS):
        step(model, optimizer, seed=i)
    changed = [not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters())]
    assert all(changed)
