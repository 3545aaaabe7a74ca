"""Asynchronous GRPO (``async_rollouts``): the staleness schedule, the decoupled loss, errors from
the background generator, and resume.

- ``max_staleness=0`` reproduces the synchronous trainer exactly (same losses and weights).
- ``max_staleness=1``: batch k comes from the weights after step max(k - 1, 0) whatever the
  thread timing, so world 1 and TP 2 (2 processes, each with its own generator thread; the
  same data-parallel size, hence the same sampling seeds) give the same metrics and weights,
  and stale batches are corrected by the rollout-correction weight (behaviour != proximal log-probs).
  FSDP 2 vs world 1 (per-request seeds make their samples the same) is compared with partial
  rollouts on in packages/algorithms/tests/test_alg_partial_rollouts.py.
- A reward function that raises in the background thread surfaces on every rank, with its
  message, instead of hanging a collective.
- Resume: the prefetched batches (made by weights older than the checkpoint) are saved with
  the checkpoint, so the resumed steps equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

STEPS = 4
# world 1 vs TP 2: TP sums partial matmuls in another order (fp32); see test_rl_layouts.py.
LOSS_TOL = 1e-5
WEIGHT_TOL = 5e-5

REWARDS = textwrap.dedent(
    """
    import torch.distributed as dist

    CALLS, LIMIT, FAIL_RANK = 0, None, 0

    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)

    def fails_later(prompt, response, reference):
        # Raises on FAIL_RANK after LIMIT calls (batch 0 scores fine; batch 1, generated while
        # step 0 trains, fails in the background thread).
        global CALLS
        CALLS += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if LIMIT is not None and CALLS > LIMIT and rank == FAIL_RANK:
            raise KeyError("reward backend down")
        return has_seven(prompt, response, reference)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("grpo_async")
    _tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    train, evaluation = _tiny["train"], _tiny["eval"]
    (root / "async_rewards_mod.py").write_text(REWARDS)
    return {"root": str(root), "model": str(root / "model"), "train": str(train), "eval": str(evaluation)}


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1",
        "steps": STEPS, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4,
        "reward_fn": "async_rewards_mod:has_seven", "progress": False, "save_every": 0, "resume": "never",
        "async_rollouts": True, "max_staleness": 1, "export_hf_at_end": True,
        "rollout_correction": {"mode": "token_mis", "high": 5.0},  # AReaL's cap-5 mask
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2, "eps": 1e-6}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _run(assets: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    """Train (on every rank of a pool, or in this process); rank 0 returns metrics and weights."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from shardforge.algorithms.trainers.grpo import run_grpo

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    summary = run_grpo(_config(assets, out, **overrides))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights: dict[str, torch.Tensor] = {}
    for path in sorted((out / "hf").glob("*.safetensors")) if (out / "hf").is_dir() else []:
        weights |= load_file(str(path))
    train = [r for r in rows if r["split"] == "train"]
    return {"summary": summary, "train": train, "eval": [r for r in rows if r["split"] == "eval"], "weights": weights}


def _max_weight_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def async_d1(assets: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference asynchronous run: world 1, max_staleness=1, held-out eval, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("async_d1")
    return _run(assets, out, eval_file=assets["eval"], eval_size=4, eval_every=2, save_every=2)


def test_staleness_zero_equals_the_synchronous_trainer(assets: dict[str, Any], tmp_path: Path) -> None:
    sync = _run(assets, tmp_path / "sync", async_rollouts=False, steps=3)
    async0 = _run(assets, tmp_path / "async0", max_staleness=0, steps=3)
    for a, b in zip(sync["train"], async0["train"], strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "response_len_mean", "actor/clip_frac", "behaviour_kl"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["staleness"] == 0 and abs(b["rollout_corr/weight_max"] - 1.0) < 1e-4, "fresh: trainer ~ engine"
    assert _max_weight_diff(sync["weights"], async0["weights"]) == 0.0


def test_staleness_schedule_and_decoupled_loss(async_d1: dict[str, Any]) -> None:
    train = async_d1["train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    # Batch k is generated by the weights after step max(k - 1, 0).
    assert [r["rollout_policy_step"] for r in train] == [0, 0, 1, 2]
    assert [r["staleness"] for r in train] == [0, 1, 1, 1]
    assert abs(train[0]["rollout_corr/weight_max"] - 1.0) < 1e-4 and train[0]["rollout_corr/kl_k3"] < 1e-8
    for record in train[1:]:
        # Stale batches: the behaviour policy (the rollout's log-probs) lags the proximal one
        # (the trainer's recomputation), so the rollout-correction weight prox/behav is not 1.
        assert record["behaviour_kl"] > 1e-3, record["behaviour_kl"]
        assert abs(record["rollout_corr/weight_max"] - 1.0) > 1e-3, record
        assert record["rollout_corr/kl_k3"] > 1e-6, record
        assert 0.0 <= record["rollout_corr/masked_frac"] <= 1.0
    assert train[0]["behaviour_kl"] < 1e-4, "a fresh batch's log-probs match the trainer's"
    assert all(r["rollout_wait_s"] >= 0 and r["generate_s"] > 0 for r in train)
    assert [r["step"] for r in async_d1["eval"]] == [0, 2, 4], "held-out eval runs on the generator thread"
    assert any(r["reward_std"] > 0 for r in train), "the reward varies, so the steps carry a signal"


def test_async_tp2_matches_world1(assets: dict[str, Any], async_d1: dict[str, Any], tmp_path: Path) -> None:
    overrides = {"eval_file": assets["eval"], "eval_size": 4, "eval_every": 2}
    tp2 = get_rank_pool(2).run(_run, assets, tmp_path / "t2", layout="t2", **overrides, timeout_s=240)[0]
    for a, b in zip(async_d1["train"], tp2["train"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (a["step"], a["loss"], b["loss"])
        for key in ("reward_mean", "response_len_mean", "rollout_policy_step", "staleness"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], (a["step"], a, b)
    assert [r["accuracy"] for r in async_d1["eval"]] == [r["accuracy"] for r in tp2["eval"]]
    assert _max_weight_diff(async_d1["weights"], tp2["weights"]) <= WEIGHT_TOL


def _failing_run(assets: dict[str, Any], out: Path, limit: int, fail_rank: int, **overrides: Any) -> str:
    import async_rewards_mod  # type: ignore[import-not-found]

    async_rewards_mod.CALLS, async_rewards_mod.LIMIT, async_rewards_mod.FAIL_RANK = 0, limit, fail_rank
    overrides = {"steps": 3, "export_hf_at_end": False, "reward.on_error": "raise"} | overrides
    try:
        _run(assets, out, reward_fn="async_rewards_mod:fails_later", **overrides)
    except Exception as exc:  # the test inspects what each rank raised
        return f"{type(exc).__name__}: {exc}"
    finally:
        async_rewards_mod.LIMIT = None
    return "no error"


def _failing_run_on_rank(assets: dict[str, Any], out: Path, limit: int, fail_rank: int) -> str:
    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    return _failing_run(assets, out, limit, fail_rank, layout="d2")


def test_a_background_reward_error_surfaces_on_every_rank(assets: dict[str, Any], tmp_path: Path) -> None:
    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    # World 1: batch 0 scores 16 rollouts fine; batch 1 fails in the background during step 0.
    message = _failing_run(assets, tmp_path / "one", limit=16, fail_rank=0)
    assert message.startswith("RuntimeError: the reward function raised on prompt"), message
    assert "reward backend down" in message
    # FSDP 2: only rank 1's generator fails (8 rollouts per rank and batch); rank 0 must raise too, naming rank 1 and the cause.
    # The pool's timeout turns a hang into a failure.
    messages = get_rank_pool(2).run(_failing_run_on_rank, assets, tmp_path / "two", 8, 1, timeout_s=120)
    assert messages[1].startswith("RuntimeError: the reward function raised on prompt"), messages
    assert messages[0].startswith("RolloutGenerationError: the background rollout generator failed on rank(s) [1]")
    assert "reward backend down" in messages[0], messages


def test_async_resume_reproduces_the_next_steps(
    assets: dict[str, Any], async_d1: dict[str, Any], tmp_path: Path
) -> None:
    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    out = tmp_path / "resumed"
    overrides = {"eval_file": assets["eval"], "eval_size": 4, "eval_every": 2, "save_every": 2}
    # A crash after the step-2 checkpoint: batch 3's rewards (16 calls per batch) fail.
    crashed = _failing_run(assets, out, 48, 0, steps=STEPS, **overrides)
    assert "reward backend down" in crashed
    resumed = _run(assets, out, resume="auto", **overrides)  # continues from the step-2 checkpoint
    straight, after = async_d1["train"][2:], resumed["train"][-2:]
    assert [r["step"] for r in after] == [3, 4]
    # Batch 2 was generated by the weights after step 1 (older than the checkpoint): it comes
    # from the checkpoint, so step 3 is still stale by one step, exactly as without the restart.
    assert [r["rollout_policy_step"] for r in after] == [1, 2]
    for a, b in zip(straight, after, strict=True):
        for key in ("loss", "grad_norm", "reward_mean", "behaviour_kl", "rollout_corr/weight", "staleness"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert _max_weight_diff(async_d1["weights"], resumed["weights"]) == 0.0


def test_restored_batches_from_another_dp_size_are_regenerated() -> None:
    from shardforge.algorithms.trainers.rl.sources import _decode, generation_policy_step

    assert [generation_policy_step(k, 2, 0) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [generation_policy_step(k, 1, 3) for k in range(3, 6)] == [3, 3, 4], "resume: no older weights"
    state = {"dp_size": 2, "ranks": [[], []]}
    with pytest.warns(UserWarning, match="made by 2 data-parallel ranks, this run has 1"):
        assert _decode(state, 2, 0, 1) == {}


def test_async_config_errors(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.trainers.grpo import _validate
    from shardforge.rollout.types import PromptSet

    prompts = PromptSet(["1+1="], ["2"], [[1, 5, 6, 5, 7]])
    with pytest.raises(ValueError, match=r"max_staleness=-1 must be >= 0"):
        _validate(_config(assets, tmp_path, max_staleness=-1), prompts, 1)
    with pytest.raises(ValueError, match="async_rollouts needs recompute_logprobs=true and a rollout_correction"):
        _validate(_config(assets, tmp_path, **{"rollout_correction.mode": "bypass"}), prompts, 1)
    with pytest.raises(ValueError, match=r"set rollout_correction\.mode=bypass"):
        _validate(_config(assets, tmp_path, recompute_logprobs=False, async_rollouts=False), prompts, 1)
    _validate(_config(assets, tmp_path, async_rollouts=False, **{"rollout_correction.mode": "bypass"}), prompts, 1)
    with pytest.raises(ValueError, match=r"actor.behav_weight_cap=5.0 is not used by GRPO.*mode: token_mis"):
        _validate(_config(assets, tmp_path, **{"actor.behav_weight_cap": 5.0}), prompts, 1)
