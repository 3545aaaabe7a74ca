"""Sampled evaluation: the Codex pass@k estimator against its binomial definition, the per-prompt
sums, `evaluate_prompts` on a stub rollout engine with known rewards (world 1 and split over two
data-parallel "ranks"), GRPO reporting pass@k at its evals, and `shardforge eval` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from math import comb
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(10, 0, 1), (10, 3, 1), (10, 3, 5), (10, 8, 3), (5, 5, 5), (20, 1, 20), (7, 2, 6)]
)
def test_pass_at_k_equals_the_binomial_definition(n: int, c: int, k: int) -> None:
    from shardforge.engine.objectives.passk import pass_at_k

    expected = 1.0 - comb(n - c, k) / comb(n, k)  # Chen et al. 2021: 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_bad_k_is_refused() -> None:
    from shardforge.engine.objectives.passk import pass_at_k, sampled_eval_sums

    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    sums = sampled_eval_sums([[1.0, 0.0, 0.5, 0.0], [0.0] * 4], [[True, False, False, False], [False] * 4], (1, 2))
    assert sums == {"num_prompts": 2.0, "avg@4": pytest.approx(0.375), "pass@1": 0.25, "pass@2": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="same number of samples"):
        sampled_eval_sums([[1.0], [1.0, 0.0]], [[True], [True, False]], (1,))
    from shardforge.algorithms.trainers.rl.eval import EvalSamplingConfig

    # A k above the sample count is refused where the config is built (the CLI prints this line, exit 2).
    with pytest.raises(ValueError, match=r"pass_k=\[5\] needs every k in \[1, samples=2\]"):
        EvalSamplingConfig(samples=2, pass_k=(5,))


class _StubRollout:
    """Answers prompt i's greedy call with its reference when i is even; samples: the reference on the
    first ``i % 4`` of n samples, a wrong answer on the rest. Responses are len(text) tokens long."""

    def __init__(self, prompts: Any) -> None:
        self.prompts = prompts
        self.version = 0

    def generate(self, ids: list[list[int]], params: Any) -> list[Any]:
        from shardforge.rollout.types import Rollout

        outs = []
        for p, one in enumerate(ids):
            index = self.prompts.ids.index(one)
            ref = self.prompts.references[index]
            for s in range(params.n):
                right = (index % 2 == 0) if params.temperature == 0 else s < index % 4
                text = ref if right else ref + "9"
                outs.append(Rollout(prompt_index=p, prompt_ids=one, response_ids=[1] * len(text), logprobs=[0.0] * len(text),
                                    finished=True, version=0, text=text))  # fmt: skip
        return outs


class _Engine:
    def __init__(self, rank: int, size: int) -> None:
        self.dp_rank, self.dp_size, self.dp_group, self.device = rank, size, None, "cpu"


def _expected(prompts: Any, n: int, ks: tuple[int, ...]) -> dict[str, float]:
    from shardforge.engine.objectives.passk import pass_at_k

    count = len(prompts)
    out = {
        "accuracy": sum(i % 2 == 0 for i in range(count)) / count,
        f"avg@{n}": sum(min(i % 4, n) / n for i in range(count)) / count,
    }
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, min(i % 4, n), k) for i in range(count)) / count
    return out


def test_evaluate_prompts_reports_greedy_avg_and_pass_at_k(tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.rl.eval import EvalSamplingConfig, evaluate_prompts
    from shardforge.rewards import exact_match_reward
    from shardforge.rollout.types import PromptSet

    prompts = PromptSet([f"{i}+1=" for i in range(9)], [str(i + 1) for i in range(9)], [[2, i] for i in range(9)])
    sampling = EvalSamplingConfig(samples=4, pass_k=(1, 2, 4))
    got = evaluate_prompts(_StubRollout(prompts), prompts, _Engine(0, 1), exact_match_reward, sampling, 8)  # type: ignore[arg-type]
    for key, value in _expected(prompts, 4, (1, 2, 4)).items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert got["pass@1"] == pytest.approx(got["avg@4"])  # 0/1 rewards: pass@1 = mean reward
    # Two data-parallel ranks (no process group: each rank's sums, added as the all-reduce would).
    halves = [evaluate_prompts(_StubRollout(prompts), prompts, _Engine(r, 2), exact_match_reward, sampling, 8)  # type: ignore[arg-type]
              for r in (0, 1)]  # fmt: skip
    assert halves[0]["pass@2"] + halves[1]["pass@2"] == pytest.approx(got["pass@2"], abs=1e-12)
    greedy_only = evaluate_prompts(_StubRollout(prompts), prompts, _Engine(0, 1), exact_match_reward,  # type: ignore[arg-type]
                                   EvalSamplingConfig(), 8)  # fmt: skip
    assert set(greedy_only) == {"accuracy", "response_len_mean"}
    with pytest.raises(ValueError, match=r"every k in \[1, samples=4\]"):
        EvalSamplingConfig(samples=4, pass_k=(8,))


def test_grpo_evals_report_pass_at_k(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    assets = tiny_assets(tmp_path / "a", seed=2, tokenizer_dir="model")
    config = build_config(GRPOConfig, {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(tmp_path / "out"), "layout": "d1", "steps": 1, "prompts_per_step": 2, "group_size": 2,
        "max_new_tokens": 3, "progress": False, "export_hf_at_end": False, "eval_size": 4,
        "eval_sampling": {"samples": 3, "pass_k": [1, 3]},
    })  # fmt: skip
    run_grpo(config)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["split"] == "eval"]
    assert evals and all({"accuracy", "avg@3", "pass@1", "pass@3", "response_len_mean"} <= set(r) for r in evals)
    assert all(0 <= r["pass@1"] <= r["pass@3"] <= 1 for r in evals)


def test_shardforge_eval_writes_results_per_dataset(tmp_path: Path) -> None:
    from shardforge.algorithms.testing import tiny_assets

    assets = tiny_assets(tmp_path / "a", seed=2, tokenizer_dir="model")
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"model: {assets['model']}\neval_files: [{assets['train']}, {assets['eval']}]\n"
        f"output_dir: {tmp_path / 'out'}\nmax_new_tokens: 3\neval_size: 6\n"
        "eval_sampling: {samples: 2, pass_k: [1, 2]}\n"
    )
    cmd = [sys.executable, "-m", "shardforge.algorithms.cli", "eval", "--config", str(config)]
    # Two ranks: prompts split over data-parallel ranks, sums reduced, rank 0 writes (then a barrier).
    done = subprocess.run([*cmd, "--nproc-per-node", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())["results"]
    assert set(results) == {Path(assets["train"]).stem, Path(assets["eval"]).stem}
    for metrics in results.values():
        assert metrics["num_prompts"] == 6 and {"accuracy", "avg@2", "pass@1", "pass@2"} <= set(metrics)


class _SeedRecorder(_StubRollout):
    """Records the seed each prompt's samples were asked for (None when the call gave no per-prompt seeds)."""

    def __init__(self, prompts: Any) -> None:
        super().__init__(prompts)
        self.seeds: dict[int, int | None] = {}

    def generate(self, ids: list[list[int]], params: Any) -> list[Any]:
        if params.temperature > 0:
            for p, one in enumerate(ids):
                self.seeds[self.prompts.ids.index(one)] = None if params.seeds is None else params.seeds[p]
        return super().generate(ids, params)


def test_sampled_eval_seeds_each_prompt_alike_on_every_layout() -> None:
    """A held-out prompt samples from a seed of its own (its index in the eval set), not from one derived from
    the data-parallel rank: world 1 and two ranks sample the same responses, so avg@k/pass@k agree across layouts."""
    from shardforge.algorithms.trainers.rl.eval import EvalSamplingConfig, evaluate_prompts
    from shardforge.rewards import exact_match_reward
    from shardforge.rollout.types import PromptSet

    prompts = PromptSet([f"{i}+1=" for i in range(7)], [str(i + 1) for i in range(7)], [[2, i] for i in range(7)])
    sampling = EvalSamplingConfig(samples=4, pass_k=(1, 2))
    one = _SeedRecorder(prompts)
    evaluate_prompts(one, prompts, _Engine(0, 1), exact_match_reward, sampling, 8)  # type: ignore[arg-type]
    split: dict[int, int | None] = {}
    for rank in (0, 1):
        half = _SeedRecorder(prompts)
        evaluate_prompts(half, prompts, _Engine(rank, 2), exact_match_reward, sampling, 8)  # type: ignore[arg-type]
        split |= half.seeds
    assert set(one.seeds) == set(range(7)) and None not in one.seeds.values()
    assert split == one.seeds
    assert len(set(one.seeds.values())) == 7  # every prompt its own stream
