"""On-policy distillation: the per-token advantage against its formula, a teacher equal to the student
gives exactly zero reverse KL (so no update direction), and a student distilled from a different
teacher moves towards it (reverse KL falls) through `shardforge train distill`."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_distill_advantages_follow_the_formula() -> None:
    from shardforge.algorithms.trainers.distill import distill_advantages
    from shardforge.engine.batching import pack_sequences
    from shardforge.engine.objectives.loss_fns import ADVANTAGES, OLD_LOGPROBS

    batch = pack_sequences([[1, 2, 3, 4], [1, 5, 6]], [[0, 0, 1, 1], [0, 1, 1]])
    student = torch.tensor([0.0, 9.0, -1.0, -2.0, 0.0, -0.5, -3.0])  # 9.0 sits on a prompt token: ignored
    teacher = torch.tensor([0.0, 7.0, -0.5, -4.0, 0.0, -0.5, -1.0])
    task = torch.tensor([0.0, 0.0, 2.0, 2.0, 0.0, -1.0, -1.0])
    batch.extras = {OLD_LOGPROBS: student, ADVANTAGES: task}
    advantages, reverse_kl = distill_advantages(batch, teacher, distill_coef=0.5, task_reward_coef=0.25)
    mask = batch.loss_mask.bool()
    expected_kl = torch.where(mask, student - teacher, torch.zeros(7))
    torch.testing.assert_close(reverse_kl, expected_kl)
    torch.testing.assert_close(advantages, torch.where(mask, 0.5 * (teacher - student) + 0.25 * task, torch.zeros(7)))
    assert advantages[1] == 0.0  # prompt tokens get nothing


def test_bad_coefficients_are_refused(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.distill import DistillConfig

    base = {"model": "m", "teacher_model": "t", "train_file": "x", "output_dir": str(tmp_path)}
    with pytest.raises(ValueError, match="not both 0"):
        build_config(DistillConfig, base | {"distill_coef": 0.0})
    with pytest.raises(ValueError, match=r"missing required config key.*teacher_model"):
        build_config(DistillConfig, {k: v for k, v in base.items() if k != "teacher_model"})


def _config(assets: dict[str, Any], teacher: str, out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.distill import DistillConfig

    data = {
        "model": assets["model"], "teacher_model": teacher, "train_file": str(assets["train"]),
        "output_dir": str(out), "layout": "d1", "steps": 6, "prompts_per_step": 8, "group_size": 1,
        "max_new_tokens": 4, "progress": False, "export_hf_at_end": False, "temperature": 1.0,
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 1e-2}},
    }  # fmt: skip
    return build_config(DistillConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _train_records(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_student_equal_to_teacher_has_zero_reverse_kl(tmp_path: Path) -> None:
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import run_distill

    assets = tiny_assets(tmp_path / "s", seed=1, tokenizer_dir="model")
    run_distill(_config(assets, assets["model"], tmp_path / "out", steps=1))
    [record] = _train_records(tmp_path / "out")
    assert abs(record["distill/reverse_kl"]) < 1e-5, record  # same weights, same temperature: log-ratios 0
    assert abs(record["loss"]) < 1e-6


def test_distillation_moves_the_student_towards_the_teacher(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import run_distill

    student = tiny_assets(tmp_path / "s", seed=1, tokenizer_dir="model")
    teacher_dir = tiny_assets(tmp_path / "t", seed=9, tokenizer_dir="model", data=False)["model"]
    # A peaked teacher (its logits scaled up): far from the near-uniform random student in reverse KL.
    model = AutoModelForCausalLM.from_pretrained(teacher_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(teacher_dir)
    run_distill(_config(student, teacher_dir, tmp_path / "out", steps=16, prompts_per_step=48))
    kl = [r["distill/reverse_kl"] for r in _train_records(tmp_path / "out")]
    # Per-step estimates on ~150 fresh tokens are noisy (+-0.05): compare 4-step means. On this machine
    # the first four average ~0.31 and the last four ~0.16 (20 steps of 64 prompts reach ~0.06).
    assert len(kl) == 16 and kl[0] > 0.1, kl
    assert sum(kl[-4:]) / 4 < 0.75 * sum(kl[:4]) / 4, kl  # the reverse KL to the teacher falls


def test_off_policy_refuses_what_it_cannot_use_and_pins_the_loss(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.distill import DistillConfig

    base = {"model": "m", "teacher_model": "t", "train_file": "x", "output_dir": str(tmp_path), "mode": "off_policy"}
    config = build_config(DistillConfig, base)
    assert config.actor.policy_loss == "gpg" and config.rollout_correction.mode == "none"
    for bad, match in [
        ({"task_reward_coef": 0.5, "group_size": 2}, "task_reward_coef=0.5"),
        ({"actor": {"policy_loss": "cispo"}}, "actor.policy_loss='cispo'"),
        ({"rollout_correction": {"mode": "token_mis"}}, "rollout_correction.mode='token_mis'"),
        ({"rollout.engine": "vllm"}, "rollout.engine='vllm'"),
    ]:
        with pytest.raises(ValueError, match=f"mode=off_policy does not take {match}"):
            build_config(DistillConfig, base | bad)
    # the teacher may sample on vLLM (off_policy only: on_policy's teacher never samples)
    assert build_config(DistillConfig, base | {"teacher_engine": "vllm"}).teacher_engine == "vllm"
    with pytest.raises(ValueError, match="teacher_engine='vllm' samples with the teacher, which only mode=off_policy"):
        build_config(DistillConfig, base | {"teacher_engine": "vllm", "mode": "on_policy"})


def test_off_policy_trains_the_student_by_nll_on_the_teachers_samples(tmp_path: Path) -> None:
    """Greedy teacher samples (temperature 0) so the test can regenerate them: every training sequence's
    completion is the teacher's greedy continuation (not the student's), the step-1 loss is the student's
    float64 token-mean NLL of those tokens, and the NLL falls as the student learns them."""
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import DistillTrainer
    from shardforge.algorithms.trainers.rl.advantages import SupervisedAdvantages

    student = tiny_assets(tmp_path / "s", seed=1, tokenizer_dir="model", max_operand=6)
    teacher_dir = tiny_assets(tmp_path / "t", seed=9, tokenizer_dir="model", data=False)["model"]
    batches: list[tuple[list[list[int]], list[list[int]]]] = []

    class Recording(SupervisedAdvantages):  # the off-policy stage, recording the batches it sees
        def token_advantages(self, batch, sampled, metrics):  # type: ignore[no-untyped-def]
            bounds = batch.cu_seqlens.tolist()
            ids = [batch.input_ids[a:b].tolist() for a, b in itertools.pairwise(bounds)]
            masks = [batch.loss_mask[a:b].tolist() for a, b in itertools.pairwise(bounds)]
            batches.append((ids, masks))
            return super().token_advantages(batch, sampled, metrics)

    class RecordingTrainer(DistillTrainer):
        def build_advantage_stage(self) -> SupervisedAdvantages:
            assert self.advantage_stage_name() == "teacher_nll"
            return Recording()

    num_prompts = len(Path(student["train"]).read_text().splitlines())
    config = _config(
        student, teacher_dir, tmp_path / "out", mode="off_policy", steps=8, temperature=0.0,
        prompts_per_step=num_prompts, max_new_tokens=3,
    )  # fmt: skip
    RecordingTrainer(config).run()
    records = _train_records(tmp_path / "out")
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    first = AutoModelForCausalLM.from_pretrained(student["model"], dtype=torch.float64).eval()

    def greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    ids, masks = batches[0]
    nll, tokens, differs = 0.0, 0, False
    for seq, mask in zip(ids, masks, strict=True):
        start = mask.index(1) - 1  # loss_mask marks targets: the first generated token's label position
        prompt, completion = seq[: start + 1], seq[start + 1 :]
        assert completion == greedy(teacher, prompt, len(completion)), (prompt, completion)
        differs |= completion != greedy(first, prompt, len(completion))
        with torch.no_grad():
            logp = torch.log_softmax(first(torch.tensor([seq])).logits[0, :-1], -1)
        picked = logp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        nll -= float(picked[keep].sum())
        tokens += int(keep.sum())
    assert differs, "the student's own greedy answers equal the teacher's: the test could not tell them apart"
    assert records[0]["loss"] == pytest.approx(nll / tokens, rel=1e-4), (records[0]["loss"], nll / tokens)
    losses = [r["loss"] for r in records]
    assert losses[-1] < 0.5 * losses[0], losses  # the student learns the teacher's answers
    assert all(r["distill/teacher_logprob"] <= 0 for r in records)


def test_kl_baseline_mean_centres_the_advantages(tmp_path: Path) -> None:
    """kl_baseline=mean: A_t = -(KL_t - mean KL), so the token-mean advantage is 0; none: it is -mean KL."""
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.distill import run_distill

    student = tiny_assets(tmp_path / "s", seed=1, tokenizer_dir="model")
    teacher = tiny_assets(tmp_path / "t", seed=9, tokenizer_dir="model", data=False)["model"]
    for baseline in ("none", "mean"):
        run_distill(_config(student, teacher, tmp_path / baseline, steps=1, kl_baseline=baseline))
    [raw], [centred] = _train_records(tmp_path / "none"), _train_records(tmp_path / "mean")
    assert raw["distill/reverse_kl"] > 1e-3  # two random models disagree a little
    assert raw["actor/advantages"] == pytest.approx(-raw["distill/reverse_kl"], rel=1e-5)
    assert centred["distill/reverse_kl"] == pytest.approx(raw["distill/reverse_kl"], rel=1e-6)  # same samples
    assert abs(centred["actor/advantages"]) < 1e-6
