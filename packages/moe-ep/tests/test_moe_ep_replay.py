"""Router replay (R3): a forward under `RouterReplay.replay` routes every token to the recorded experts,
gates them with its own router's (renormalised) probabilities of those experts, and lets router gradients
flow; under expert parallelism 2 the routing and logits equal one process's.

A "trainer" model is the "rollout" model with its router weights perturbed, so some tokens pick other
experts (what different kernels or precision do, made larger); replay must remove that difference.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB, NUM_EXPERTS, TOP_K = 64, 8, 2


def build_model(family: str = "qwen3_moe") -> torch.nn.Module:
    """A tiny seeded MoE model (2 MoE layers, 8 experts, top-2), HF's eager experts."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "num_experts_per_tok": TOP_K,
    }  # fmt: skip
    if family == "qwen3_moe":
        config: Any = Qwen3MoeConfig(
            head_dim=8, intermediate_size=64, num_experts=NUM_EXPERTS, moe_intermediate_size=16,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common,
        )  # fmt: skip
    else:
        config = MixtralConfig(intermediate_size=16, num_local_experts=NUM_EXPERTS, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((1.0 if name.endswith("gate.weight") else 0.05) * torch.randn_like(p))
    return model


def tokens(batch: int = 4, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _perturbed(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


def _record(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[T, L, K] top-k experts of one forward over ``ids`` [B, S] (T = B * S)."""
    from shardforge.moe_ep import RouterReplay

    replay = RouterReplay(model)
    with replay.record() as recorded, torch.no_grad():
        model(input_ids=ids)
    replay.remove()
    return torch.stack([calls[0] for calls in recorded], dim=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replay_routes_to_the_recorded_experts_with_the_trainers_gates(family: str) -> None:
    from shardforge.moe_ep import RouterReplay, find_moe_blocks

    rollout = build_model(family)
    trainer = _perturbed(rollout)
    ids = tokens()
    recorded = _record(rollout, ids)
    assert recorded.shape == (ids.numel(), 2, TOP_K)
    own = _record(trainer, ids)
    differs = (own.sort(-1).values != recorded.sort(-1).values).any(-1)
    assert differs.any(), "the perturbation must change some tokens' experts, else the test proves nothing"

    replay = RouterReplay(trainer)
    with replay.replay(recorded), replay.record() as seen:
        logits = trainer(input_ids=ids).logits
    torch.testing.assert_close(torch.stack([c[0] for c in seen], dim=1), recorded, rtol=0, atol=0)
    mismatched, rows = replay.pop_mismatch()
    # Layer 0 sees the same hidden states with or without replay: its count is exact. Later layers compare
    # with their own choice under replay (their inputs changed), so only bounds hold for the total.
    assert rows == ids.numel() * 2 and int(differs[:, 0].sum()) <= mismatched <= rows and mismatched > 0

    # The first block by hand: its router's probabilities of the recorded experts, renormalised, into its experts.
    _, block = find_moe_blocks(trainer)[0]
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    forced = recorded[:5, 0]
    with replay.replay(recorded[:5]):
        out = block(hidden[None])[0]
    probs = torch.softmax(block.gate(hidden)[0].float(), dim=-1).gather(-1, forced)
    gates = probs / probs.sum(-1, keepdim=True)
    torch.testing.assert_close(out, block.experts(hidden, forced, gates.to(hidden.dtype)), rtol=1e-6, atol=1e-6)

    # Router gradients still flow (through the gates of the recorded experts).
    logits.float().pow(2).mean().backward()
    assert all(block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0 for _, block in
               find_moe_blocks(trainer))  # fmt: skip


def test_rows_marked_minus_one_and_padding_keep_the_routers_choice() -> None:
    from shardforge.moe_ep import RouterReplay

    rollout = build_model()
    trainer = _perturbed(rollout)
    ids = tokens()
    recorded, own = _record(rollout, ids), _record(trainer, ids)
    partial = recorded.clone()
    partial[::2] = -1  # every other token: no recording (e.g. the last generated token)
    replay = RouterReplay(trainer)
    with replay.replay(partial[:-3]), replay.record() as seen, torch.no_grad():  # the last 3 rows: padding
        trainer(input_ids=ids)
    got = torch.stack([c[0] for c in seen], dim=1)
    keep_own = torch.zeros(ids.numel(), dtype=torch.bool)
    keep_own[::2] = True
    keep_own[-3:] = True
    # Layer 0's inputs do not depend on the replay: its kept rows are the router's own choice there.
    torch.testing.assert_close(got[keep_own, 0], own[keep_own, 0], rtol=0, atol=0)
    torch.testing.assert_close(got[~keep_own], recorded[~keep_own], rtol=0, atol=0)
    with pytest.raises(ValueError, match="replay indices must be"):
        with replay.replay(recorded[:, :1]):
            pass


def _ep_replay(layout: str) -> dict[str, Any]:
    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.moe_ep import RouterReplay, apply_expert_parallel

    mesh = build_mesh(ParallelDims.parse(layout))
    rollout = build_model()
    recorded = _record(rollout, tokens())
    trainer = _perturbed(rollout)
    apply_expert_parallel(trainer, mesh.get("ep"))
    ids = tokens().chunk(mesh.dims.dp)[mesh.local_rank("dp")]
    mine = recorded.view(tokens().shape[0], -1, *recorded.shape[1:]).chunk(mesh.dims.dp)[mesh.local_rank("dp")]
    replay = RouterReplay(trainer)
    with replay.replay(mine.reshape(-1, *recorded.shape[1:])), replay.record() as seen, torch.no_grad():
        logits = trainer(input_ids=ids).logits
    gathered = [torch.empty_like(logits) for _ in range(mesh.dims.dp)]
    dist.all_gather(gathered, logits.contiguous(), group=mesh.get("dp").get_group())
    return {"routing": torch.stack([c[0] for c in seen], dim=1), "mine": mine.reshape(-1, *recorded.shape[1:]),
            "logits": torch.cat(gathered)}  # fmt: skip


def test_replay_under_expert_parallel_2_matches_one_process() -> None:
    from shardforge.moe_ep import RouterReplay

    results = get_rank_pool(2).run(_ep_replay, "d2e2")
    rollout = build_model()
    recorded = _record(rollout, tokens())
    trainer = _perturbed(rollout)
    replay = RouterReplay(trainer)
    with replay.replay(recorded), torch.no_grad():
        reference = trainer(input_ids=tokens()).logits
    for res in results:
        torch.testing.assert_close(res["routing"], res["mine"], rtol=0, atol=0)  # token for token
        torch.testing.assert_close(res["logits"], reference, rtol=1e-5, atol=5e-6)
