"""A streaming checkpoint resumed with another data-parallel size (`streaming_resume.rank_share`): the new ranks
train every prompt position the old ranks had not trained, exactly once.

- ``rank_share`` by hand (2 ranks -> 1 and -> 4) and over random checkpoints (any sizes among 1, 2, 4): the
  positions the new ranks regenerate or start are exactly the ones no old rank trained;
- end to end: a 1-process GRPO run with streaming rollouts stopped after its step-2 checkpoint, resumed on 2 ranks
  (FSDP, gloo): the per-rank records hold every prompt position exactly once.
"""

from __future__ import annotations

import json
import random
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.trainers.rl.streaming_resume import rank_share

PROMPTS, GROUP = 4, 2


def _owned(dp_rank: int, dp_size: int, q: int, prompts: int) -> int:
    local = prompts // dp_size
    return (q // local) * prompts + dp_rank + dp_size * (q % local)


def _todo(state: dict[str, Any], prompts: int, horizon: int) -> set[int]:
    """Global positions below ``horizon`` that the ranks of ``state`` have not trained (in flight, unused or new)."""
    size = state["dp_size"]
    done = set()
    for r, rank in enumerate(state["ranks"]):
        done |= {_owned(r, size, q, prompts) for q in range(rank["next_position"]) if q not in rank["regenerate"]}
    return set(range(horizon)) - done


def _trained_next(shares: list[dict[str, Any]], prompts: int, horizon: int) -> list[int]:
    """The global positions the new ranks start from: each one's regenerate list, then its new numbers."""
    size, out = len(shares), []
    for r, share in enumerate(shares):
        out += [_owned(r, size, q, prompts) for q in share["regenerate"]]
        q = share["next_position"]
        while (g := _owned(r, size, q, prompts)) < horizon:
            out.append(g)
            q += 1
    return out


def test_rank_share_by_hand() -> None:
    # 2 ranks, 4 prompts per step (2 each): rank 0 started q 0-5 and has q 4, 5 (positions 8, 10) unused; rank 1
    # started q 0-4 and has q 4 (position 9) in flight; position 11 (rank 1's q 5) was never started.
    state = {
        "dp_size": 2,
        "ranks": [{"regenerate": [4, 5], "next_position": 6}, {"regenerate": [4], "next_position": 5}],
    }
    assert rank_share(state, 0, 2, 4) == state["ranks"][0]
    assert rank_share(state, 0, 1, 4) == {"regenerate": [8, 9, 10], "next_position": 11}
    assert [rank_share(state, r, 4, 4) for r in range(4)] == [
        {"regenerate": [2], "next_position": 3},  # positions 0, 4 done; 8 again
        {"regenerate": [2], "next_position": 3},  # 1, 5 done; 9
        {"regenerate": [2], "next_position": 3},  # 2, 6 done; 10
        {"regenerate": [], "next_position": 2},  # 3, 7 done; 11 is new
    ]
    assert rank_share(None, 0, 2, 4) is None
    with pytest.raises(ValueError, match="do not divide prompts_per_step=6"):
        rank_share({"dp_size": 4, "ranks": state["ranks"] * 2}, 0, 2, 6)


@pytest.mark.parametrize("seed", range(20))
def test_rank_share_trains_every_untrained_position_once(seed: int) -> None:
    rng = random.Random(seed)
    prompts = 8
    old, new = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
    local, batches = prompts // old, rng.randrange(1, 6)
    ranks = []
    for _ in range(old):  # trained the first `batches` batches' share, then some in flight / unused, some not started
        started = batches * local + rng.randrange(0, 2 * local + 1)
        redo = sorted(rng.sample(range(max(0, batches * local - local), started), k=rng.randrange(0, local + 1)))
        ranks.append({"regenerate": [q for q in redo if q < started], "next_position": started})
    state = {"dp_size": old, "ranks": ranks}
    horizon = (batches + 4) * prompts
    shares = [rank_share(state, r, new, prompts) for r in range(new)]
    trained = _trained_next(shares, prompts, horizon)
    assert len(trained) == len(set(trained)), "no position twice"
    assert set(trained) == _todo(state, prompts, horizon), (old, new, state, shares)


REWARDS = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("streaming_resume")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    (root / "streaming_resume_mod.py").write_text(REWARDS)
    return {"root": str(root), "model": str(root / "model"), "train": str(tiny["train"])}


def _run(assets: dict[str, Any], out: Path, **overrides: Any) -> None:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1", "steps": 5,
        "prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 4, "progress": False,
        "reward_fn": "streaming_resume_mod:has_seven", "save_every": 2, "resume": "auto", "export_hf_at_end": False,
        "async_rollouts": True, "streaming_rollouts": True, "max_staleness": 1,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2, "eps": 1e-6}},
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()])))


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_one_process_streaming_run_resumes_on_two_ranks(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.algorithms.trainers.grpo import GRPOTrainer
    from shardforge.mesh.testing import get_rank_pool

    out, steps, cut = tmp_path / "r", 5, 2
    train_step = GRPOTrainer.train_step

    def stop_after_cut(self: Any, step: int) -> dict[str, float]:
        if step == cut:  # dies right after the step-2 checkpoint, with prompts in flight
            raise KeyboardInterrupt
        return train_step(self, step)

    monkeypatch.setattr(GRPOTrainer, "train_step", stop_after_cut)
    with pytest.raises(KeyboardInterrupt):
        _run(assets, out)
    monkeypatch.setattr(GRPOTrainer, "train_step", train_step)
    get_rank_pool(2).run(_run, assets, out, layout="d2", timeout_s=240)
    first, second = _records(out / "streaming" / "rank0.jsonl"), _records(out / "streaming" / "rank1.jsonl")
    assert [r["batch"] for r in first] == list(range(steps)) and [r["batch"] for r in second] == list(range(cut, steps))
    assert all(len(r["positions"]) == PROMPTS for r in first[:cut]), "1 process: whole batches before the resume"
    assert all(len(r["positions"]) == PROMPTS // 2 for r in [*first[cut:], *second]), "2 ranks: half a batch each"
    positions = [p for r in [*first, *second] for p in r["positions"]]
    assert sorted(positions) == list(range(steps * PROMPTS)), "every prompt position trained exactly once"
    for r in [*first, *second]:
        assert all(r["batch"] - v <= 1 for v in r["start_versions"]), r
        if r["batch"] >= cut:
            assert min(r["start_versions"]) >= cut, r  # regenerated or new under the checkpoint's weights or newer
