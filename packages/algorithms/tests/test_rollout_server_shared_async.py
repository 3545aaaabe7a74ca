"""Asynchronous rollouts on a vLLM server that the trainer starts itself (or reaches by ``server_url``), shared by
two trainer ranks (issue 41), built the way the trainers build it.

Each gloo rank builds its engine with `build_trainer_rollout` (``rollout.engine: vllm``, ``rollout.vllm.mode:
server``, colocated): rank 0 starts the server, every rank connects, and ``asynchronous=True`` reaches the ``vllm``
builder, so the server switches versions through the ranks' `SharedVersionGate`. Only the server's command line is
the stub's (`shardforge.rollout.testing.stub_server`; each completion takes 50 ms, so the ranks' requests overlap);
it counts completions whose weight version changed while they were in flight (``switched_under_requests``) and
samples deterministically from (prompt, seed, version). Prompts and seeds depend on the global prompt position
only, so a position's samples say which version generated them, whichever rank generated it.

Checked: streaming (`StreamingSource`, two generator threads per rank) and whole-batch asynchronous rollouts
(`AsyncRollouts`) at max_staleness 1: no switch under a request, the bound holds, whole groups, every position
once; streaming at max_staleness 0 on a trainer-started server and on one given by ``server_url``: the very
batches (positions per step, samples) of the synchronous run (`SyncRollouts`, collective switches). And the trainer
end to end: streaming GRPO at max_staleness 0 on 2 FSDP ranks sharing the server it starts equals synchronous GRPO.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardforge.rollout.testing import STUB_SERVER
from shardforge.rollout.testing.stub_client import start_stub, stub_state, stub_tokens

STEPS, PROMPTS, GROUP, RANKS = 4, 4, 2, 2
VOCAB = 50
LOCAL = PROMPTS // RANKS


def _stub_command(self: Any, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
    return [sys.executable, str(STUB_SERVER), "--port", str(port), "--completion-delay", "0.05"]


def _global(q: int, rank: int) -> int:
    """This rank's q-th prompt as a global position (`StreamingSource.global_position`'s layout)."""
    index, row = divmod(q, LOCAL)
    return index * PROMPTS + rank + RANKS * row


def _run(tmp: Path, mode: str, max_staleness: int, url: str | None) -> dict[str, Any]:
    """One rank: build the rollout as a trainer does, run ``mode`` (sync, streaming, async) for STEPS steps."""
    import torch
    import torch.distributed as dist

    from shardforge.algorithms.trainers.rl.publish import build_trainer_rollout
    from shardforge.algorithms.trainers.rl.sources import AsyncRollouts, SyncRollouts
    from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource
    from shardforge.rollout.config import RolloutConfig, VLLMOptions
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    rank = dist.get_rank()
    asynchronous = mode != "sync"
    options = VLLMOptions(mode="server", server_python=sys.executable, server_url=url, server_startup_timeout_s=30.0,
                          request_timeout_s=60.0)  # fmt: skip
    config = SimpleNamespace(
        rollout=RolloutConfig(engine="vllm", vllm=options), model=str(tmp), seed=0,
        engine=SimpleNamespace(router_replay=False, dist_timeout_s=60.0),
    )  # fmt: skip
    trainer = SimpleNamespace(dims=SimpleNamespace(pp=1))
    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    original = VLLMServerRolloutEngine._server_command
    VLLMServerRolloutEngine._server_command = _stub_command  # type: ignore[method-assign]  # rank 0 starts the stub
    built = build_trainer_rollout(config, tokenizer, tmp / f"w_{mode}{max_staleness}", trainer,  # type: ignore[arg-type]
                                  asynchronous=asynchronous)  # fmt: skip
    engine: Any = built.engine
    assert (engine.gate is not None) is asynchronous, "asynchronous rollouts on 2 ranks: the version gate"
    made: dict[int, list[tuple[int, Any]]] = {}  # global position -> (version asked, rollout) per sample
    lock = threading.Lock()

    def generate(qs: list[int]) -> list[list[Any]]:  # this rank's prompts qs, one call
        asked = engine.version
        positions = [_global(q, rank) for q in qs]
        prompts = [[5 + g % 7, 6, 7 + g % 3] for g in positions]
        params = SamplingParams(n=GROUP, max_new_tokens=4, seeds=[1000 + g for g in positions])
        rollouts = engine.generate(prompts, params)
        rows = [rollouts[GROUP * i : GROUP * (i + 1)] for i in range(len(qs))]
        with lock:
            made.update({g: [(asked, r) for r in row] for g, row in zip(positions, rows)})
        return rows

    def groups(qs: list[int]) -> list[tuple[list[Any], torch.Tensor]]:  # a streaming generator thread
        return [(row, torch.zeros(GROUP)) for row in generate(qs)]

    def sample(index: int) -> tuple[list[Any], torch.Tensor]:  # a whole batch: this rank's share of batch `index`
        rows = generate(list(range(index * LOCAL, (index + 1) * LOCAL)))
        return [r for row in rows for r in row], torch.zeros(GROUP * LOCAL)

    def publish(version: int | None) -> int:  # the trainer's collective publish (the stub reads no weights)
        dist.barrier()
        return 1 if version is None else version  # policy step p is weight version p + 1

    common = {"publish_fn": publish, "max_staleness": max_staleness, "num_batches": STEPS, "start": 0,
              "dp_rank": rank, "dp_size": RANKS}  # fmt: skip
    source: Any
    if mode == "sync":
        source = SyncRollouts(engine, sample, publish)
    elif mode == "async":
        source = AsyncRollouts(rollout=engine, sample_fn=sample, **common)
    else:
        source = StreamingSource(rollout=engine, groups_fn=groups, prompts_per_step=PROMPTS, workers=2, **common)
    trained: list[tuple[int, list[int], list[int]]] = []  # (step, global positions, their start policy steps)
    try:
        for step in range(STEPS):
            batch = source.batch(step)
            if mode == "streaming":
                info = source.stream.infos[-1]
                positions = [source.global_position(q) for q in info.positions]
                assert positions == [_global(q, rank) for q in info.positions]
                trained.append((step, positions, list(info.start_versions)))
            else:
                positions = [_global(q, rank) for q in range(step * LOCAL, (step + 1) * LOCAL)]
                trained.append((step, positions, [batch.policy_step] * LOCAL))
            if step + 1 < STEPS:
                source.publish(step + 1)
        dist.barrier()
        state = stub_state(engine.url)
        dist.barrier()  # every rank has read the state before rank 0 stops its server
    finally:
        source.close()
        engine.shutdown(grace_s=5.0)
        VLLMServerRolloutEngine._server_command = original  # type: ignore[method-assign]
    rows = {g: [(asked, r.version, r.prompt_ids, r.response_ids) for asked, r in v] for g, v in made.items()}
    return {"trained": trained, "rows": rows, "state": state, "switches": engine.gate.switches if engine.gate else 0}


def _merged(runs: list[dict[str, Any]]) -> dict[int, Any]:
    return {g: [(row[1], row[3]) for row in rows] for run in runs for g, rows in run["rows"].items()}


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """The synchronous run's samples per global position (every rank's); batch k is generated by version k + 1."""
    from shardforge.mesh.testing import get_rank_pool

    runs = get_rank_pool(RANKS).run(_run, tmp_path_factory.mktemp("sync"), "sync", 0, None, timeout_s=120)
    merged = _merged(runs)
    assert sorted(merged) == list(range(STEPS * PROMPTS))
    assert all(version == g // PROMPTS + 1 for g, rows in merged.items() for version, _ in rows)
    return merged


@pytest.mark.parametrize(("mode", "max_staleness"), [("streaming", 1), ("async", 1), ("streaming", 0)])
def test_two_ranks_run_asynchronous_rollouts_on_the_server_the_trainer_starts(
    tmp_path: Path, synchronous: dict[int, Any], mode: str, max_staleness: int
) -> None:
    from shardforge.mesh.testing import get_rank_pool

    runs = get_rank_pool(RANKS).run(_run, tmp_path, mode, max_staleness, None, timeout_s=120)
    _check(runs, synchronous, max_staleness)


def test_streaming_on_a_shared_server_given_by_url(tmp_path: Path, synchronous: dict[int, Any]) -> None:
    """``rollout.vllm.server_url``: a running server; the ranks share it through the same gate."""
    from shardforge.mesh.testing import get_rank_pool

    server, url = start_stub("--completion-delay", "0.05")
    try:
        runs = get_rank_pool(RANKS).run(_run, tmp_path, "streaming", 0, url, timeout_s=120)
    finally:
        server.kill()
        server.wait()
    _check(runs, synchronous, 0)


def _check(runs: list[dict[str, Any]], synchronous: dict[int, Any], max_staleness: int) -> None:
    assert runs[0]["state"]["switched_under_requests"] == 0, runs[0]["state"]
    assert sum(run["switches"] for run in runs) >= STEPS - 1, "the server moved through the versions"
    merged = _merged(runs)
    trained = []
    for run in runs:
        for step, positions, starts in run["trained"]:
            assert len(positions) == LOCAL, "this rank's share: whole groups"
            assert all(step - start <= max_staleness for start in starts), (step, starts)
            for g, start in zip(positions, starts):
                assert len(run["rows"][g]) == GROUP, "a whole group"
                for i, (asked, version, prompt, response) in enumerate(run["rows"][g]):
                    assert version >= asked >= start + 1, (g, version, asked, start)  # versions only move forward
                    # what the stub samples at the version the rollout carries (choice i of the request seeded
                    # 1000 + g), and not what it samples at the next one
                    assert response == stub_tokens(prompt, 1000 + g, version, i, 4, VOCAB), (g, i, version)
                    assert response != stub_tokens(prompt, 1000 + g, version + 1, i, 4, VOCAB), (
                        "versions sample differently"
                    )
            trained += positions
            if max_staleness == 0:  # the synchronous batch: its positions, generated by its own step's weights
                assert {g // PROMPTS for g in positions} == {step}, (step, positions)
                assert [merged[g] for g in positions] == [synchronous[g] for g in positions], (step, positions)
    assert sorted(trained) == list(range(STEPS * PROMPTS)), "every prompt position trained once over the ranks"


# ------------------------------------------------------------------------------------------ trainer
REWARD = "def has_seven(prompt, response, reference):\n    return float('7' in response) + 0.1 * len(response)\n"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("grpo_shared_async")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    (root / "shared_async_rewards.py").write_text(REWARD)
    return {"root": str(root), "model": str(root / "model"), "train": str(tiny["train"]),
            "vocab_size": len(tiny["tokenizer"])}  # fmt: skip


def _grpo(assets: dict[str, Any], out: Path, streaming: bool) -> list[dict[str, Any]]:
    """Three GRPO steps on 2 ranks (FSDP d2) on a stub server that rank 0 starts; the train metrics (rank 0)."""
    import torch.distributed as dist

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    def stub_command(self: Any, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        return [sys.executable, str(STUB_SERVER), "--port", str(port), "--vocab-size", str(assets["vocab_size"])]

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])  # the reward function's module
    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d2",
        "steps": 3, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4, "progress": False,
        "reward_fn": "shared_async_rewards:has_seven", "save_every": 0, "export_hf_at_end": False,
        "reuse_training_logprobs": False, "rollout.engine": "vllm",
        "rollout.vllm": {"mode": "server", "server_python": sys.executable, "server_startup_timeout_s": 30.0},
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-2, "eps": 1e-6}},
    }  # fmt: skip
    if streaming:
        data |= {"async_rollouts": True, "streaming_rollouts": True, "max_staleness": 0}
    original = VLLMServerRolloutEngine._server_command
    VLLMServerRolloutEngine._server_command = stub_command  # type: ignore[method-assign]
    try:
        run_grpo(build_config(GRPOConfig, data))
    finally:
        VLLMServerRolloutEngine._server_command = original  # type: ignore[method-assign]
    if dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_grpo_streams_on_two_ranks_sharing_the_server_it_starts(assets: dict[str, Any], tmp_path: Path) -> None:
    """The trainer end to end (its config checks, `build_trainer_rollout`, `StreamingSource`): streaming GRPO at
    max_staleness 0 on 2 ranks sharing the server the trainer starts trains as the synchronous run does (measured
    bitwise equal: rewards, losses, entropies)."""
    from shardforge.mesh.testing import get_rank_pool

    pool = get_rank_pool(RANKS)
    synchronous = pool.run(_grpo, assets, tmp_path / "sync", False, timeout_s=180)[0]
    streamed = pool.run(_grpo, assets, tmp_path / "stream", True, timeout_s=180)[0]
    assert [r["step"] for r in streamed] == [1, 2, 3]
    assert len({r["reward_mean"] for r in synchronous}) > 1, "the rewards vary (the weights change)"
    assert [r["stream/staleness_max"] for r in streamed] == [0.0, 0.0, 0.0], "streamed"
    for a, b in zip(synchronous, streamed, strict=True):  # the same batches, the same computation: bitwise
        for key in ("reward_mean", "loss", "tokens", "actor/entropy", "rollout_version"):
            assert b[key] == a[key], (a["step"], key, a[key], b[key])
