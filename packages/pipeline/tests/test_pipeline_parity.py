"""Pipeline parity: every schedule at pp2 and pp4 gives the loss and gradients of the unsplit model.

Every rank builds the same seeded tiny decoder, keeps the stages `split_decoder` assigns to
it and runs M packed micro-batches (several sequences per row, padded to one static length
with a zero-weight padding sequence; a block-diagonal causal 4-D mask keeps sequences
apart) through `Pipeline.step`. The loss is token-weighted: each micro-batch returns
``-sum(w * logp) / W`` with W the weight of the *whole* batch, so the sum over
micro-batches is the global mean whatever M is. The reference runs the unsplit HF model
micro-batch by micro-batch in the pytest process with the same loss.

Compared: the total loss (on the last stage's rank), forward-only outputs (``Pipeline.forward``,
the per-token log-probs RL needs) and the gradient of every parameter
under its global name (each rank reports the parameters it owns; together they must cover
the whole model exactly once).

Rank functions are module-level so the rank pool can pickle them; transformers and the
package are imported inside them.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
NUM_LAYERS = 8  # pp4 x 2 virtual stages = 8 stages of one layer each
SEQ_LEN = 12  # static micro-batch length
NUM_MICROBATCHES = 4

# float32 on CPU. Each stage runs exactly the reference's ops on the same micro-batch, and both
# accumulate gradients micro-batch by micro-batch in the same order, so results agree to float32
# rounding (observed <= 1e-7 on gradients of magnitude <= 0.5). The zero-bubble schedule splits
# backward into input and weight passes (two autograd calls), which only reorders sums. A real
# fault (a missing micro-batch, a gradient scaled by M, a wrong layer on a stage) is off by
# >= 1e-2 here.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def tiny_config(family: str = "qwen3") -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[], **common
        )
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**common)


def build_model(family: str = "qwen3") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa")
    # Perturb every parameter: HF initialises norm weights to exactly 1, which hides scaling errors.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def make_data() -> dict[str, torch.Tensor]:
    """Stacked micro-batches: ids/positions/labels/weights [M, L], block-diagonal mask [M, 1, L, L]."""
    from shardforge.pipeline import stack_packed_microbatches

    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(NUM_MICROBATCHES):
        # Uneven packing: 1-3 sequences and 6-12 real tokens per micro-batch.
        lengths = [[5, 4], [12], [3, 3, 2], [6]][i]
        ids = torch.randint(1, VOCAB, (sum(lengths),), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lengths])
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        rows.append((ids, pos, cu))
    stacked = stack_packed_microbatches(rows, SEQ_LEN)
    masks, labels, weights = [], [], []
    for m in range(NUM_MICROBATCHES):
        cu = stacked.cu_seqlens[m]
        seg = torch.bucketize(torch.arange(SEQ_LEN), cu[1:].long(), right=True)
        causal = torch.arange(SEQ_LEN)[:, None] >= torch.arange(SEQ_LEN)[None, :]
        masks.append(((seg[:, None] == seg[None, :]) & causal)[None])
        labels.append(torch.roll(stacked.input_ids[m], -1))
        # Target weights: random on real tokens whose next token is in the same sequence, 0 on padding.
        w = torch.rand(SEQ_LEN, generator=gen) + 0.5
        last_of_seq = torch.zeros(SEQ_LEN, dtype=torch.bool)
        last_of_seq[cu[1:].long().clamp(max=SEQ_LEN) - 1] = True
        w[last_of_seq] = 0.0
        w[stacked.num_tokens[m] :] = 0.0
        weights.append(w)
    return {
        "input_ids": stacked.input_ids,
        "position_ids": stacked.position_ids,
        "attention_mask": torch.stack(masks),
        "labels": torch.stack(labels),
        "weights": torch.stack(weights),
    }


def _next_token_logprobs(logits: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    return -torch.nn.functional.cross_entropy(logits[0].float(), kwargs["labels"][0], reduction="none")[None]


@functools.cache
def reference(family: str = "qwen3") -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    model = build_model(family)
    data = make_data()
    total_weight = data["weights"].sum()
    loss_total = 0.0
    logps = []
    for i in range(NUM_MICROBATCHES):
        logits = model(
            input_ids=data["input_ids"][i : i + 1],
            position_ids=data["position_ids"][i : i + 1],
            attention_mask=data["attention_mask"][i : i + 1],
        ).logits
        logp = _next_token_logprobs(logits, {"labels": data["labels"][i : i + 1]})[0]
        loss = -(logp * data["weights"][i]).sum() / total_weight
        loss.backward()
        loss_total += float(loss.detach())
        logps.append(logp.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss_total, grads, torch.stack(logps)


def _pp_rank(schedule: str, stages_per_rank: int, family: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.pipeline import Pipeline, merge_stages, resolve_schedule, split_decoder, split_layers
    from shardforge.pipeline import stage_ids_for_rank as ids_for

    pp, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(family)
    spec = resolve_schedule(schedule)
    layers = split_layers(NUM_LAYERS, pp * stages_per_rank)
    stages = split_decoder(
        model,
        layers,
        ids_for(rank, pp, stages_per_rank, spec.style),
        layer_kwargs_fn=lambda kw: {"attention_mask": kw["attention_mask"]},
        output_fn=_next_token_logprobs,
    )
    del model
    pipe = Pipeline(stages, schedule=schedule, group=dist.group.WORLD, device="cpu")
    data = make_data()
    total_weight = data["weights"].sum()

    calls: list[tuple[int, bool]] = []

    def loss_fn(logp: torch.Tensor, i: int) -> torch.Tensor:
        calls.append((i, bool(torch.isfinite(logp).all())))
        return -(logp[0] * data["weights"][i]).sum() / total_weight

    kwargs = {k: data[k] for k in ("position_ids", "attention_mask", "labels")}
    losses = pipe.step(data["input_ids"], loss_fn=loss_fn, **kwargs)
    # Forward only (e.g. RL log-probs): the last stage's outputs of every micro-batch.
    logp = pipe.forward(data["input_ids"], **kwargs)
    merged = merge_stages(stages)
    return {
        "logp": logp,
        "loss": float(sum(float(x) for x in losses)) if losses else None,
        "grads": {n: p.grad.detach().clone() for n, p in merged.named_parameters() if p.grad is not None},
        "params": sorted(n for n, _ in merged.named_parameters()),
        "loss_calls": calls,
        "num_microbatches": int(data["input_ids"].shape[0]),
    }


def _check(results: list[dict[str, Any]], family: str = "qwen3") -> None:
    ref_loss, ref_grads, ref_logp = reference(family)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 1, f"exactly one rank holds the last stage, got losses {losses}"
    assert losses[0] == pytest.approx(ref_loss, rel=1e-6)
    # The caller's loss sees each real micro-batch once, never torch's metadata-inference placeholder call.
    [calls] = [r["loss_calls"] for r in results if r["loss"] is not None]
    assert sorted(calls) == [(i, True) for i in range(results[0]["num_microbatches"])], calls
    [logp] = [r["logp"] for r in results if r["logp"] is not None]
    torch.testing.assert_close(logp.reshape(ref_logp.shape), ref_logp, **TOL)
    owned = [n for r in results for n in r["params"]]
    assert sorted(owned) == sorted(ref_grads), "stages must cover every parameter exactly once under its global name"
    grads = {n: g for r in results for n, g in r["grads"].items()}
    assert sorted(grads) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, **TOL, msg=lambda m, n=name: f"{n}: {m}")


CASES = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("ZBVZeroBubble", 2),
]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize(("schedule", "stages_per_rank"), CASES)
def test_schedule_matches_unsplit_model(schedule: str, stages_per_rank: int, pp: int) -> None:
    results = get_rank_pool(pp).run(_pp_rank, schedule, stages_per_rank, "qwen3")
    _check(results)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_other_families_match_at_pp2(family: str) -> None:
    results = get_rank_pool(2).run(_pp_rank, "1F1B", 1, family)
    _check(results, family)
