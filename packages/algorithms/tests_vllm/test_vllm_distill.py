"""Off-policy distillation with the teacher sampling on vLLM (``teacher_engine: vllm``).

Runs only in ``nox -s vllm``. Student and teacher are tiny Qwen3s (hidden 128, head_dim 32 for vLLM's
CPU attention) from different seeds, sharing the character tokenizer. The teacher samples at
temperature 0.7 on vLLM; the test records every training batch and checks that the behaviour
log-probs the batch carries are the *teacher's* (its HF forward at 0.7 over the same tokens, gap <
1e-4) and not the student's (gap > 0.1: the two models disagree), and that the logged
``distill/teacher_logprob`` is their mean. (That the student learns the teacher's tokens is shown with
greedy teacher samples in tests/test_alg_distill.py; sampled at 0.7 from a random teacher, the NLL of
fresh samples is too noisy over 6 steps to show it.)
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch

from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS

LOGPROB_ATOL = 1e-4  # float32, vLLM CPU kernels vs HF: measured ~1e-6 (test_vllm_rollout.py)


def _forward_logprobs(model_dir: str, ids: list[int], mask: list[float], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1] / temperature
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logprobs[torch.tensor(mask[1:]) != 0]


def test_off_policy_distillation_samples_the_teacher_on_vllm(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import DistillConfig, DistillTrainer
    from shardforge.algorithms.trainers.rl.advantages import SupervisedAdvantages

    student = tiny_assets(tmp_path / "s", seed=1, hidden=128, tokenizer_dir="model", max_operand=6)
    teacher = tiny_assets(tmp_path / "t", seed=9, hidden=128, tokenizer_dir="model", data=False)["model"]
    batches: list[tuple[list[list[int]], list[list[float]], list[list[float]]]] = []

    class Recording(SupervisedAdvantages):  # the off-policy stage, recording the batches it sees
        def token_advantages(self, batch, sampled, metrics):  # type: ignore[no-untyped-def]
            bounds = list(itertools.pairwise(batch.cu_seqlens.tolist()))
            behaviour = batch.extras[BEHAVIOUR_LOGPROBS]
            batches.append((
                [batch.input_ids[a:b].tolist() for a, b in bounds],
                [batch.loss_mask[a:b].tolist() for a, b in bounds],
                [behaviour[a:b].tolist() for a, b in bounds],
            ))  # fmt: skip
            return super().token_advantages(batch, sampled, metrics)

    class RecordingTrainer(DistillTrainer):
        def build_advantage_stage(self) -> SupervisedAdvantages:
            return Recording()

    out = tmp_path / "out"
    config = build_config(DistillConfig, {
        "model": student["model"], "teacher_model": teacher, "train_file": str(student["train"]),
        "output_dir": str(out), "layout": "d1", "steps": 6, "prompts_per_step": 8, "group_size": 1,
        "max_new_tokens": 4, "temperature": 0.7, "progress": False, "export_hf_at_end": False,
        "mode": "off_policy", "teacher_engine": "vllm", "rollout.vllm": {"max_num_seqs": 16},
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-2}},
    })  # fmt: skip
    RecordingTrainer(config).run()

    ids, masks, behaviour = batches[0]
    teacher_gap = student_gap = 0.0
    for seq, mask, recorded in zip(ids, masks, behaviour, strict=True):
        engine_lp = torch.tensor(recorded)[1:][torch.tensor(mask[1:]) != 0]
        teacher_gap = max(teacher_gap, (engine_lp - _forward_logprobs(teacher, seq, mask, 0.7)).abs().max().item())
        student_gap = max(
            student_gap, (engine_lp - _forward_logprobs(student["model"], seq, mask, 0.7)).abs().max().item()
        )
    assert teacher_gap < LOGPROB_ATOL, teacher_gap
    assert student_gap > 0.1, student_gap  # the check above could tell the two models apart
    # The logged teacher log-prob is the mean of vLLM's behaviour log-probs over the step's teacher tokens.
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 6 and all(math.isfinite(r["loss"]) for r in train)
    recorded = [lp for seq_lp, mask in zip(behaviour, masks) for lp, m in zip(seq_lp, mask) if m]
    assert math.isclose(train[0]["distill/teacher_logprob"], sum(recorded) / len(recorded), rel_tol=1e-5)
