"""Partial (interruptible) rollouts: the embedded engine's chunked generation continued under new weights,
the async source's switch between chunks (made deterministic with an event, not timing), per-token
versions through checkpoints, the settings' errors, and a GRPO resume mid-run with partial rollouts on."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.data.prompts import load_prompts
from shardforge.algorithms.trainers.rl.partial_stats import staleness_metrics, token_staleness_counts
from shardforge.algorithms.trainers.rl.sources import AsyncRollouts
from shardforge.rollout import Rollout, SamplingParams
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.episodes.trajectory import Trajectory

REWARDS = textwrap.dedent(
    """
    def has_seven(prompt, response, reference):
        return float("7" in response) + 0.1 * len(response)
    """
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("partial")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    (root / "partial_rewards_mod.py").write_text(REWARDS)
    sys.path.insert(0, str(root))
    return {
        "tokenizer": tiny["tokenizer"],
        "model": str(root / "model"),
        "train": str(tiny["train"]),
        "root": str(root),
    }


def _teacher_logprobs(model: Any, r: Rollout, temperature: float) -> torch.Tensor:
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]


def test_an_interrupted_generation_continues_under_the_new_weights(assets: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.rollout import HFRolloutEngine
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    tokenizer = assets["tokenizer"]
    prompts = load_prompts(assets["train"], tokenizer).ids[:3]
    engine = HFRolloutEngine(assets["model"], tokenizer, weights_root=tmp_path / "w")
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.9, seed=3)
    whole = engine.generate(prompts, params)
    old = AutoModelForCausalLM.from_pretrained(assets["model"])
    new = AutoModelForCausalLM.from_pretrained(assets["model"])
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    WeightPublisher(new, DiskTransport(tmp_path / "w"), bucket_bytes=1 << 16).publish(1)
    calls: list[int] = []

    chunks = ChunkedGeneration(2)
    engine = HFRolloutEngine(assets["model"], tokenizer, weights_root=tmp_path / "w", chunks=chunks)

    def publish_once() -> None:  # the deterministic stand-in for "the trainer published while generating"
        calls.append(engine.version)
        if len(calls) == 1:
            engine.update_weights(1)

    with chunks.refreshing(publish_once):
        chunked = engine.generate(prompts, params)
    assert calls and calls[0] == 0 and engine.version == 1
    assert [r.response_ids[:2] for r in chunked] == [r.response_ids[:2] for r in whole], "chunk 0: same seed, weights"
    with torch.no_grad():
        for r in chunked:
            n = len(r.response_ids)
            assert r.token_versions == [0] * min(n, 2) + [1] * max(n - 2, 0) and r.versions == r.token_versions
            assert r.version == 0 and len(r.logprobs) == n
            assert r.finished == (r.response_ids[-1] == tokenizer.eos_token_id)
            # Every token's behaviour log-prob is that of the weights that sampled it.
            got = torch.tensor(r.logprobs)
            assert torch.allclose(got[:2], _teacher_logprobs(old, r, 0.9)[:2], atol=1e-4), r
            assert torch.allclose(got[2:], _teacher_logprobs(new, r, 0.9)[2:], atol=1e-4), r
    assert any(len(set(r.versions)) == 2 for r in chunked), "some response was interrupted and continued"
    traj = Trajectory(group=0, token_ids=[], loss_mask=[], logprobs=[], versions=[])
    traj.append(chunked[0].response_ids, logprobs=chunked[0].logprobs, version=chunked[0].versions)
    assert traj.versions == chunked[0].token_versions and traj.version == 0
    stored = Trajectory.from_state(json.loads(json.dumps(traj.to_state())))  # as async checkpoints keep it
    assert stored.versions == traj.versions and stored.logprobs == traj.logprobs


class _ChunkedFake:
    """A rollout engine stand-in: 3 chunks of one token each, the token = the serving version."""

    def __init__(self) -> None:
        self.version = 0
        self.chunks = ChunkedGeneration(1)
        self.gate: dict[int, threading.Event] = {}

    def update_weights(self, version: int | None = None) -> int:
        if version is not None and version < self.version:  # as WeightReceiver: versions only move forward
            raise ValueError(f"stale version {version}: serving {self.version}")
        self.version = self.version if version is None else version
        return self.version

    def sample(self, index: int) -> tuple[list[Any], torch.Tensor]:
        tokens: list[int] = []
        for chunk in range(3):
            if chunk and self.chunks.is_refreshing:
                if chunk == 1 and index in self.gate:
                    assert self.gate[index].wait(30), "the main thread never published"
                self.chunks.between_chunks()
            tokens.append(self.version)
        r = Trajectory(
            group=0,
            token_ids=tokens,
            loss_mask=[1] * 3,
            logprobs=[-0.5 * t - 0.25 for t in tokens],
            versions=list(tokens),
        )  # fmt: skip (the generated tokens alone: versions are theirs)
        return [r], torch.tensor([float(index)])


def _source(fake: _ChunkedFake, versions: list[int], **kwargs: Any) -> AsyncRollouts:
    def publish(version: int | None) -> int:
        versions.append(10 if version is None else version)
        return versions[-1]

    kwargs = {"max_staleness": 1} | kwargs
    return AsyncRollouts(rollout=fake, sample_fn=fake.sample, publish_fn=publish, num_batches=3,
                         dp_rank=0, dp_size=1, chunks=fake.chunks, **kwargs)  # fmt: skip


def test_the_async_source_switches_weights_between_chunks_and_checkpoints_token_versions() -> None:
    fake, published = _ChunkedFake(), []
    fake.gate = {1: threading.Event(), 2: threading.Event()}
    source = _source(fake, published, start=0)
    first = source.batch(0)  # batch 1 is generated next, under policy 0, and stops at its gate after one chunk
    assert first.rollouts[0].versions == [10, 10, 10] and first.stats["interrupted"] == 0.0
    source.publish(1)  # version 11 = policy step 1 (batch 1 may use it: staleness 0 for those tokens)
    source.publish(2)  # version 12 = policy step 2: newer than batch 1 may ever use (step 1 trains on it)
    fake.gate[1].set()
    second = source.batch(1)
    r = second.rollouts[0]
    assert (second.policy_step, r.versions, r.version) == (0, [10, 11, 11], 10)
    # This rank's counts (the trainer sums them over ranks into partial/*): lags [1, 0, 0].
    counts = {
        "lag_sum": 1.0,
        "tokens": 3.0,
        "fresher_tokens": 2.0,
        "interrupted": 1.0,
        "sequences": 1.0,
        "lag_max": 1.0,
    }
    assert second.stats == counts
    assert staleness_metrics(second.stats) == {"partial/token_staleness_mean": 1 / 3, "partial/token_staleness_max": 1.0,
                                               "partial/fresher_token_frac": 2 / 3, "partial/interrupted_frac": 1.0}  # fmt: skip
    fake.gate[2].set()  # batch 2 (started under policy 1) may continue under policy 2
    state = source.checkpoint_state()  # the prefetched batch 2, which a resumed run cannot regenerate
    saved = state["ranks"][0][0]["rollouts"][0]
    source.close()
    assert not fake.chunks.is_refreshing
    # A resumed run gets the checkpoint's batch back exactly: tokens, per-token versions, log-probs, stats.
    resumed = _source(_ChunkedFake(), [], start=2, restored=json.loads(json.dumps(state)))
    again = resumed.batch(2)
    resumed.close()
    assert again.rollouts[0].versions == saved["versions"] == [11, 12, 12]
    assert again.rollouts[0].logprobs == saved["logprobs"] == [-5.75, -6.25, -6.25]
    assert again.stats == counts


def test_a_batch_after_a_continued_one_starts_with_the_newer_weights() -> None:
    # max_staleness=2: batches 0-2 are all scheduled with policy 0; batch 1 is continued under policy 1, so
    # batch 2 starts there too (the engine cannot go back to version 10) and reports policy step 1.
    fake, published = _ChunkedFake(), []
    fake.gate = {1: threading.Event()}
    source = _source(fake, published, start=0, max_staleness=2)
    source.batch(0)
    source.publish(1)
    fake.gate[1].set()
    assert source.batch(1).rollouts[0].versions == [10, 11, 11]
    third = source.batch(2)
    source.close()
    assert (third.policy_step, third.rollouts[0].versions) == (1, [11, 11, 11])


def _config(assets: dict[str, Any], out: Path, **overrides: Any) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    data = {
        "model": assets["model"], "train_file": assets["train"], "output_dir": str(out), "layout": "d1",
        "steps": 4, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5, "progress": False,
        "reward_fn": "partial_rewards_mod:has_seven", "save_every": 2, "export_hf_at_end": True,
        "async_rollouts": True, "max_staleness": 2, "rollout.partial_rollouts": True, "rollout.interrupt_chunk_tokens": 2,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))


def _train(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def _refresh_to_previous_policy(self: AsyncRollouts, index: int) -> None:
    """A deterministic stand-in for `AsyncRollouts._refresh`: between chunks, wait for the weights of policy step
    ``index - 1`` and continue under exactly those (the real one takes the newest published, timing-dependent)."""
    target = max(index - 1, self.start)
    deadline = time.monotonic() + 120  # a guard against a hang, not a timed assertion
    while target not in self._versions:
        assert time.monotonic() < deadline, f"policy step {target} was never published"
        time.sleep(0.005)
    self.rollout.update_weights(self._versions[target])


@pytest.fixture(scope="module")
def partial_d1(assets: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """World 1, 4 steps, checkpoints at 2 and 4. Batch k (k >= 2) starts under policy k - 2 and continues under
    k - 1 after its first chunk, whatever the thread timing: its trajectories mix two versions through the
    loss, the checkpoint and the resume."""
    from shardforge.algorithms.trainers.grpo import run_grpo

    out = tmp_path_factory.mktemp("partial_d1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AsyncRollouts, "_refresh", _refresh_to_previous_policy)
        run_grpo(_config(assets, out))
    return out


def test_grpo_with_partial_rollouts_resumes_mid_run_to_the_same_steps(
    assets: dict[str, Any], partial_d1: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.algorithms.trainers.grpo import run_grpo

    monkeypatch.setattr(AsyncRollouts, "_refresh", _refresh_to_previous_policy)
    # A resume from run a's step-2 checkpoint reproduces run a's steps 3 and 4: they train on the prefetched
    # batches (with their per-token versions and log-probs) that the checkpoint holds (max_staleness=2).
    shutil.copytree(partial_d1 / "checkpoints" / "step_00000002", tmp_path / "b" / "checkpoints" / "step_00000002")
    run_grpo(_config(assets, tmp_path / "b"))
    a, b = _train(partial_d1), _train(tmp_path / "b")
    assert [r["step"] for r in b] == [3, 4]
    for key in ("loss", "grad_norm", "reward_mean", "behaviour_kl", "partial/token_staleness_mean"):
        assert [r[key] for r in a[2:]] == [r[key] for r in b[-2:]], key
    for r in a:  # the limit counts the oldest token: never more than max_staleness versions behind
        assert 0.0 <= r["partial/token_staleness_mean"] <= r["partial/token_staleness_max"] <= 2.0, r
    assert [r["partial/token_staleness_max"] for r in a] == [0.0, 1.0, 2.0, 2.0]
    assert all(r["partial/fresher_token_frac"] > 0 and r["partial/interrupted_frac"] > 0 for r in a[2:]), a
    assert all(1.0 < r["partial/token_staleness_mean"] < 2.0 for r in a[2:]), "tokens of policies k - 2 and k - 1"


def _train_and_weights(assets: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    """A deterministic partial-rollout run (on every rank of a pool, or here); rank 0 returns metrics and the
    exported weights."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from shardforge.algorithms.trainers.grpo import run_grpo

    if assets["root"] not in sys.path:
        sys.path.insert(0, assets["root"])
    refresh = AsyncRollouts._refresh
    AsyncRollouts._refresh = _refresh_to_previous_policy  # type: ignore[method-assign]
    try:
        run_grpo(_config(assets, out, **overrides))
    finally:  # the pool's processes serve later tests
        AsyncRollouts._refresh = refresh  # type: ignore[method-assign]
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    weights: dict[str, torch.Tensor] = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        weights |= load_file(str(path))
    return {"train": _train(out), "weights": weights}


@pytest.mark.parametrize(
    "layout",
    ["d2", pytest.param("t2", marks=pytest.mark.heavy)],  # TP 2: one dp rank, the same samples even before seeds
)
def test_grpo_with_partial_rollouts_two_ranks_match_world1(
    assets: dict[str, Any], partial_d1: Path, tmp_path: Path, layout: str
) -> None:
    from safetensors.torch import load_file

    from shardforge.mesh.testing import get_rank_pool

    # Every request samples from a seed of (run seed, step, round, global prompt position, sample, turn), so
    # FSDP 2's ranks (2 prompts x 4 samples each) sample what world 1 (4 x 4) samples from the same weights.
    shared = {k: assets[k] for k in ("model", "train", "root")}
    runs = get_rank_pool(2).run(
        _train_and_weights, shared, tmp_path / layout, layout=layout, save_every=0, timeout_s=300
    )
    d1, fsdp = _train(partial_d1), runs[0]
    weights = {}
    for path in sorted((partial_d1 / "hf").glob("*.safetensors")):
        weights |= load_file(str(path))
    assert [r["step"] for r in fsdp["train"]] == [1, 2, 3, 4]
    # FSDP reduce-scatters gradients (TP sums partial matmuls) in another order than one process (fp32): metrics to
    # rel 1e-5, weights after 4 Adam steps at lr 3e-3 to 2e-5. The samples must be the very same token ids:
    # identical seeds and uniforms, and logits that differ by float rounding only (batch rows, left padding,
    # the updated weights), which moves a token only if its uniform falls within ~1e-6 of a CDF boundary
    # (odds ~1e-4 over the run's few hundred tokens, and fixed per machine); then loss and rewards would differ
    # by far more than the tolerances, which is what the test is there to catch.
    for a, b in zip(d1, fsdp["train"], strict=True):
        for key in ("loss", "reward_mean", "response_len_mean", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-8), (a["step"], key, a[key], b[key])
        # behaviour_kl is trainer-vs-engine rounding noise (~1e-8 here: the same weights on both sides), so it
        # differs between layouts by its own size (TP 2: 5.4e-8 vs 7.1e-8); a wrong version or log-prob gives >1e-3.
        assert b["behaviour_kl"] == pytest.approx(a["behaviour_kl"], abs=1e-6), (a["step"], a["behaviour_kl"])
        # partial/* are sums of per-token integer counts over both ranks (rank 0's own half before): exact
        # given the same tokens and versions (the deterministic refresh fixes each chunk's version).
        for key in ("token_staleness_mean", "token_staleness_max", "fresher_token_frac", "interrupted_frac"):
            assert b[f"partial/{key}"] == pytest.approx(a[f"partial/{key}"], rel=1e-12), (a["step"], key)
    assert weights.keys() == fsdp["weights"].keys() and weights
    worst = max(float((weights[k] - fsdp["weights"][k]).abs().max()) for k in weights)
    assert worst <= 2e-5, worst


def _stats_on_rank(rollouts: list[list[Any]]) -> dict[str, float]:
    import torch.distributed as dist

    from shardforge.algorithms.trainers.rl.metrics import StepMetrics
    from shardforge.algorithms.trainers.rl.step_stats import add_partial_rollout_stats

    counts = token_staleness_counts(rollouts[dist.get_rank()], 3, {10: 0, 11: 1, 12: 2, 13: 3})
    metrics = StepMetrics()
    add_partial_rollout_stats(metrics, counts)
    return metrics.reduce(dist.group.WORLD, torch.device("cpu"))


def test_partial_metrics_describe_every_ranks_share() -> None:
    from shardforge.mesh.testing import get_rank_pool

    def rollout(versions: list[int]) -> Rollout:
        return Rollout(prompt_index=0, prompt_ids=[1], response_ids=[2] * len(versions), logprobs=[0.0] * len(versions),
                       finished=True, version=min(versions), token_versions=versions)  # fmt: skip

    # Rank 0: fresh, uninterrupted tokens (lag 0); rank 1: older, interrupted ones (lags 2, 2, 1 and 1, 0).
    shares = [[rollout([13, 13]), rollout([13])], [rollout([11, 11, 12]), rollout([12, 13])]]
    everything = staleness_metrics(token_staleness_counts(shares[0] + shares[1], 3, {10: 0, 11: 1, 12: 2, 13: 3}))
    assert everything == {"partial/token_staleness_mean": 6 / 8, "partial/token_staleness_max": 2.0,
                          "partial/fresher_token_frac": 2 / 8, "partial/interrupted_frac": 2 / 4}  # fmt: skip
    reduced = get_rank_pool(2).run(_stats_on_rank, shares, timeout_s=60)
    assert reduced == [everything, everything], "sums of counts and max lag over ranks, the same on each rank"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"async_rollouts": False}, "rollout.partial_rollouts=true .* set async_rollouts=true"),
        ({"max_staleness": 0}, "max_staleness=0 never overlaps"),
        ({"rollout.interrupt_chunk_tokens": 0}, "rollout.interrupt_chunk_tokens=0 must be >= 1"),
        ({"engine.router_replay": True}, "router_replay=true is not supported"),
    ],
)
def test_partial_rollout_settings_errors(
    assets: dict[str, Any], tmp_path: Path, overrides: dict[str, Any], match: str
) -> None:
    from shardforge.algorithms.trainers.rl.partial import check_partial_rollouts

    with pytest.raises(ValueError, match=match):
        check_partial_rollouts(_config(assets, tmp_path, **overrides))


def test_partial_rollouts_on_vllm_refuse_engines_shared_by_ranks(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.algorithms.trainers.rl import partial as rl_partial

    check = rl_partial.check_partial_rollouts
    check(_config(assets, tmp_path, **{"rollout.engine": "vllm"}))  # world 1: in-process or server, any placement
    check(_config(assets, tmp_path, **{"rollout.engine": "vllm"}, **{"rollout.vllm.mode": "server"}))
    monkeypatch.setattr(rl_partial.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rl_partial.dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="placement=rank0 and 2 ranks is not supported"):
        check(_config(assets, tmp_path, **{"rollout.engine": "vllm"}))
    with pytest.raises(ValueError, match="vLLM server needs a trainer world size of 1"):
        check(
            _config(
                assets,
                tmp_path,
                **{"rollout.engine": "vllm"},
                **{"rollout.vllm.mode": "server", "rollout.vllm.placement": "each_rank"},
            )
        )
    check(_config(assets, tmp_path, **{"rollout.engine": "vllm"}, **{"rollout.vllm.placement": "each_rank"}))


class _RequestEngine:
    """A whole-request engine (as vLLM's): response token t of a request is ``seed % 97 + t`` (the seed it was
    given), its log-prob ``-version``; it stops (EOS 0) after ``stop_after[prompt[0]]`` tokens in all."""

    def __init__(self, stop_after: dict[int, int]) -> None:
        self.version, self.stop_after, self.calls = 1, stop_after, []  # type: ignore[var-annotated]

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        from shardforge.rollout import Rollout

        assert params.n == 1 and params.seeds is not None and len(params.seeds) == len(prompts)
        self.calls.append((len(prompts), params.max_new_tokens, params.seeds))
        out = []
        for prompt, seed in zip(prompts, params.seeds, strict=True):
            left = self.stop_after[prompt[0]] - (len(prompt) - 2)  # prompts are 2 tokens long
            tokens = [seed % 97 + t for t in range(min(left, params.max_new_tokens))]
            finished = left <= params.max_new_tokens
            if finished:
                tokens[-1] = 0
            out.append(Rollout(prompt_index=0, prompt_ids=prompt, response_ids=tokens, logprobs=[-float(self.version)]
                               * len(tokens), finished=finished, version=self.version))  # fmt: skip
        return out


def test_chunked_requests_continue_from_the_returned_ids_under_new_weights() -> None:
    """vLLM's partial rollouts (`rollout.chunked.chunked_requests`): each response is re-sent with its ids so far
    after every chunk; a weight switch between chunks shows in the per-token versions and log-probs; finished
    responses leave; the first chunk samples from the response's own seed, a continuation from a seed of
    (that seed, tokens done)."""
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.chunked import chunked_requests
    from shardforge.rollout.seeds import request_seed

    engine = _RequestEngine({5: 3, 6: 7})
    switches = []

    def between() -> None:
        switches.append(engine.version)
        engine.version += 1

    params = SamplingParams(n=2, max_new_tokens=7, temperature=1.0, seeds=(100, 200))
    out = chunked_requests(engine.generate, [[5, 9], [6, 9]], params, 3, between, lambda ids: str(ids))
    assert [r.prompt_index for r in out] == [0, 0, 1, 1] and [r.prompt_ids for r in out] == [[5, 9]] * 2 + [[6, 9]] * 2
    assert [len(r.response_ids) for r in out] == [3, 3, 7, 7]
    assert [r.finished for r in out] == [True, True, True, True]
    # Chunk 1 (version 1) for all four; chunks 2 and 3 only for prompt 6's two responses, under versions 2 and 3.
    assert [c[:2] for c in engine.calls] == [(4, 3), (2, 3), (2, 1)] and switches == [1, 2]
    assert out[2].token_versions == [1, 1, 1, 2, 2, 2, 3] and out[2].version == 1
    assert out[0].token_versions == [1, 1, 1] and out[2].logprobs == [-1.0] * 3 + [-2.0] * 3 + [-3.0]
    assert engine.calls[0][2] == (100, 101, 200, 201)
    assert engine.calls[1][2] == (request_seed(200, 3), request_seed(201, 3))
    assert out[2].response_ids[:3] == [200 % 97 + t for t in range(3)]
    assert out[2].response_ids[3:6] == [request_seed(200, 3) % 97 + t for t in range(3)]


def test_chunked_generation_stops_when_the_hook_says_so() -> None:
    """`between_chunks` answering True (the streaming source's released call) ends the generation at that boundary:
    the unfinished responses keep their tokens so far and are not finished; finished ones are unaffected."""
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.chunked import ChunkedGeneration, chunked_requests

    engine, chunks, asked = _RequestEngine({5: 2, 6: 7}), ChunkedGeneration(3), []

    def stop() -> bool:
        asked.append(engine.version)
        return True

    params = SamplingParams(n=1, max_new_tokens=7, temperature=1.0, seeds=(100, 200))
    with chunks.refreshing(stop):
        out = chunked_requests(engine.generate, [[5, 9], [6, 9]], params, 3, chunks.between_chunks, str)
    assert asked == [1] and len(engine.calls) == 1, "one chunk, then stopped"
    assert [len(r.response_ids) for r in out] == [2, 3] and [r.finished for r in out] == [True, False]
    assert out[1].token_versions == [1, 1, 1]
    assert chunks.between_chunks() is False, "outside `refreshing` the hook never stops a generation"
