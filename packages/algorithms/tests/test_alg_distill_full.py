"""Full-distribution distillation (GKD): the per-position divergences against a float64 reference written
from the formulas (masks, all-masked rows, top-k + tail bucket, JSD's beta ends), the student's whole
distribution the engine hands the loss against an HF forward, and `shardforge train distill` with
``distill_loss=full_reverse_kl``: zero when the teacher is the student, refusals of what cannot apply."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _kl64(p: list[float], q: list[float]) -> float:
    return sum(x * (math.log(x) - math.log(y)) for x, y in zip(p, q, strict=True))


def _reference(student_TV: torch.Tensor, teacher_TV: torch.Tensor, mask: list[bool], loss: str, beta: float) -> float:
    """sum over masked rows of the divergence, float64, one row and one vocabulary entry at a time."""
    total = 0.0
    for t, keep in enumerate(mask):
        if not keep:
            continue
        p_s, p_t = student_TV[t].double().softmax(-1).tolist(), teacher_TV[t].double().softmax(-1).tolist()
        if loss == "full_reverse_kl":
            total += _kl64(p_s, p_t)
        elif loss == "full_forward_kl":
            total += _kl64(p_t, p_s)
        else:
            m = [beta * b + (1 - beta) * a for a, b in zip(p_s, p_t, strict=True)]
            total += beta * _kl64(p_t, m) + (1 - beta) * _kl64(p_s, m)
    return total


def _batch() -> Any:
    from shardforge.engine.batching import pack_sequences

    # sequence 0: two targets; sequence 1: all masked (a prompt-only row); sequence 2: three targets
    return pack_sequences([[1, 2, 3, 4], [1, 5, 6], [1, 2, 7, 8]], [[0, 0, 1, 1], [0, 0, 0], [0, 1, 1, 1]])


@pytest.mark.parametrize(("loss", "beta"), [("full_reverse_kl", 0.5), ("full_forward_kl", 0.5), ("jsd", 0.3),
                                            ("jsd", 0.0), ("jsd", 1.0)])  # fmt: skip
def test_divergence_term_matches_the_formula(loss: str, beta: float) -> None:
    from shardforge.engine.objectives.distillation import TEACHER_LOGPROBS, DistributionDistillTerm

    batch, vocab = _batch(), 7
    gen = torch.Generator().manual_seed(0)
    student_logits = torch.randn(batch.num_tokens, vocab, generator=gen, dtype=torch.float64) * 2
    teacher_logits = torch.randn(batch.num_tokens, vocab, generator=gen, dtype=torch.float64) * 3
    batch.extras[TEACHER_LOGPROBS] = teacher_logits.log_softmax(-1).float()
    coefficients = torch.ones(batch.num_tokens)
    student = student_logits.float().requires_grad_(True)
    term, stats = DistributionDistillTerm(divergence=loss, beta=beta, coef=0.5)(
        student.log_softmax(-1), batch, coefficients
    )
    mask = (batch.loss_mask != 0).tolist()
    ref_loss = "full_forward_kl" if (loss, beta) == ("jsd", 0.0) else "full_reverse_kl" if beta == 1.0 else loss
    expected = _reference(student_logits, teacher_logits, mask, ref_loss, beta)
    assert expected > 0.1
    assert float(term.detach()) == pytest.approx(0.5 * expected, rel=1e-5)
    assert float(stats["distill_divergence"]) == pytest.approx(expected, rel=1e-5)
    term.backward()
    assert student.grad is not None
    assert torch.all(student.grad[~batch.loss_mask.bool()] == 0)  # masked rows (incl. the all-masked row) get nothing
    # the gradient is the float64 autograd of the same formula, through the student's whole distribution
    s64 = student_logits.clone().requires_grad_(True)
    from shardforge.engine.objectives.distillation import DIVERGENCES

    rows = batch.loss_mask.bool()
    ref = 0.5 * DIVERGENCES.get(loss)(s64.log_softmax(-1)[rows], teacher_logits.log_softmax(-1)[rows], beta).sum()
    ref.backward()
    torch.testing.assert_close(student.grad.double(), s64.grad, rtol=1e-4, atol=1e-6)


def test_top_k_with_tail_bucket_is_exact_when_the_tail_is_empty_and_a_bucketed_kl_otherwise() -> None:
    from shardforge.engine.objectives.distillation import (
        TEACHER_LOGPROBS,
        TEACHER_TOKEN_IDS,
        DistributionDistillTerm,
    )

    batch, vocab, k = _batch(), 6, 3
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(batch.num_tokens, vocab, generator=gen, dtype=torch.float64).log_softmax(-1)
    teacher = torch.randn(batch.num_tokens, vocab, generator=gen, dtype=torch.float64).log_softmax(-1)
    term = DistributionDistillTerm(divergence="full_reverse_kl")
    coefficients = torch.ones(batch.num_tokens)
    top = teacher.topk(k, dim=-1)
    batch.extras = {TEACHER_LOGPROBS: top.values, TEACHER_TOKEN_IDS: top.indices}
    got, _ = term(student, batch, coefficients)
    expected = 0.0  # (k+1)-way distributions: the top-k entries and everything else in one bucket
    for t in batch.loss_mask.nonzero()[:, 0].tolist():
        ids = top.indices[t]
        tail_s = 1 - student[t, ids].exp().sum()
        tail_t = 1 - teacher[t, ids].exp().sum()
        expected += float((student[t, ids].exp() * (student[t, ids] - teacher[t, ids])).sum())
        expected += float(tail_s * (tail_s.log() - tail_t.log()))
    assert float(got) == pytest.approx(expected, rel=1e-6)  # the term computes in float32
    full = teacher.topk(vocab, dim=-1)  # k = V: the tail is empty, the bucketed KL is the exact one
    batch.extras = {TEACHER_LOGPROBS: full.values, TEACHER_TOKEN_IDS: full.indices}
    exact, _ = term(student, batch, coefficients)
    batch.extras = {TEACHER_LOGPROBS: teacher}
    assert float(exact) == pytest.approx(float(term(student, batch, coefficients)[0]), rel=1e-6)


def test_engine_hands_the_loss_the_whole_distribution_of_each_target(tmp_path: Path) -> None:
    """The [T, V] rows the loss gets (and the teacher's `forward_distribution`) equal HF's log-softmax of the
    previous position, 0 at sequence starts; the target log-probs are those rows at the tokens."""
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.testing import tiny_assets
    from shardforge.engine import EngineConfig, TrainEngine

    model_dir = tiny_assets(tmp_path, seed=3, data=False)["model"]
    engine = TrainEngine(model_dir, "d1", EngineConfig(max_tokens_per_microbatch=8))
    engine.logprob_temperature = 0.7
    batch = _batch()
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = torch.zeros(batch.num_tokens, hf.config.vocab_size)
    bounds = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in itertools.pairwise(bounds):
            logits = hf(batch.input_ids[a:b][None]).logits[0].float() / 0.7
            expected[a + 1 : b] = logits[:-1].log_softmax(-1)
    seen: list[tuple[torch.Tensor, Any, torch.Tensor]] = []

    def loss_fn(logprobs: torch.Tensor, mb: Any, distribution: torch.Tensor) -> torch.Tensor:
        seen.append((logprobs.detach(), mb, distribution.detach()))
        return -(logprobs * mb.loss_mask).sum() + (distribution[:, 0] * mb.loss_mask).sum()

    loss_fn.wants_distribution = True  # type: ignore[attr-defined]
    rows, ids = engine.forward_distribution(batch)
    assert ids is None
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(rows[mask], expected[mask], rtol=1e-4, atol=1e-5)
    assert torch.all(rows[~mask] == 0)
    values, top_ids = engine.forward_distribution(batch, top_k=3)
    assert top_ids is not None and values.shape == (batch.num_tokens, 3)
    torch.testing.assert_close(values[mask], expected[mask].topk(3, dim=-1).values, rtol=1e-4, atol=1e-5)
    engine.train_batch(batch, loss_fn)
    assert len(seen) >= 2  # several micro-batches: rows travel with their sequences
    for logprobs, mb, distribution in seen:
        assert distribution.shape == (mb.num_tokens, hf.config.vocab_size)
        rows_mb = mb.loss_mask.bool()  # the loss's rows are the teacher-side rows of the same tokens
        torch.testing.assert_close(distribution.gather(1, mb.input_ids[:, None])[:, 0][rows_mb], logprobs[rows_mb])


def _config(assets: dict[str, Any], teacher: str, out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.distill import DistillConfig

    data = {
        "model": assets["model"], "teacher_model": teacher, "train_file": str(assets["train"]),
        "output_dir": str(out), "layout": "d1", "steps": 1, "prompts_per_step": 8, "group_size": 1,
        "max_new_tokens": 4, "progress": False, "export_hf_at_end": False, "temperature": 1.0,
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-2}},
    }  # fmt: skip
    return build_config(DistillConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def test_full_reverse_kl_is_zero_when_the_teacher_is_the_student(tmp_path: Path) -> None:
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import run_distill

    assets = tiny_assets(tmp_path / "s", seed=1, tokenizer_dir="model")
    run_distill(_config(assets, assets["model"], tmp_path / "out", distill_loss="full_reverse_kl"))
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    [record] = [r for r in rows if r["split"] == "train"]
    assert abs(record["distill/full_reverse_kl"]) < 1e-6, record
    assert abs(record["loss"]) < 1e-6 and record["grad_norm"] < 1e-5


def test_full_distribution_settings_that_cannot_apply_are_refused(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.distill import DistillConfig

    base = {"model": "m", "teacher_model": "t", "train_file": "x", "output_dir": str(tmp_path)}
    full = base | {"distill_loss": "full_reverse_kl"}
    for bad, match in [
        ({"layout": "d1t2"}, "tp=2"),
        ({"kl_baseline": "mean"}, "kl_baseline='mean'"),
        ({"mode": "off_policy"}, "mode='off_policy'"),
        ({"distill_loss": "jsd", "beta": 1.5}, "beta=1.5"),
        ({"teacher_top_k": -1}, "teacher_top_k=-1"),
    ]:
        with pytest.raises(ValueError, match=f"distill_loss='(full_reverse_kl|jsd)' does not take .*{match}"):
            build_config(DistillConfig, full | bad)
    with pytest.raises(ValueError, match="teacher_top_k=4 needs a full-distribution distill_loss"):
        build_config(DistillConfig, base | {"teacher_top_k": 4})
    with pytest.raises(ValueError, match="distill_loss"):
        build_config(DistillConfig, base | {"distill_loss": "kl"})
