"""Partial rollouts inside streaming rollouts (issue 41): a weight update interrupts the streamed groups still
generating at a chunk boundary, and their continuations run under the new weights.

- the embedded HF engine: a group started under policy 0 and interrupted after its first chunk (made deterministic
  with a gate, not timing) records per-token versions equal to the policy steps that sampled the tokens, and every
  token's behaviour log-prob equals the teacher-forced log-prob of those weights (the continuation: the new
  policy's) within 1e-4; the group keeps its start version (staleness counts from it) and ``partial/*`` counts it;
- two generator workers: a weight switch happens only while no chunk is running (every call in flight waits at a
  chunk boundary), tokens carry the serving version, versions only move forward, the bound holds;
- a call whose groups were released (too stale for any later batch) stops at its next chunk boundary.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.data.prompts import load_prompts
from shardforge.algorithms.trainers.rl.partial_stats import staleness_metrics
from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource
from shardforge.rollout import Rollout, SamplingParams
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.episodes.trajectory import Trajectory


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("streaming_partial")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)
    return {"tokenizer": tiny["tokenizer"], "model": str(root / "model"), "train": str(tiny["train"])}


class _GatedChunks(ChunkedGeneration):
    """Chunked generation whose first chunk boundary after `arm` waits until the test has published new weights."""

    def __init__(self, chunk_tokens: int) -> None:
        super().__init__(chunk_tokens)
        self.armed, self.gate = False, threading.Event()

    def between_chunks(self) -> bool:
        if self.armed:
            self.armed = False
            assert self.gate.wait(120), "the test never published"
        return super().between_chunks()


def _teacher_logprobs(model: Any, r: Rollout, temperature: float) -> torch.Tensor:
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None])[:, 0]


def _trajectory(position: int, r: Rollout) -> Trajectory:
    traj = Trajectory(group=position, token_ids=[], loss_mask=[], logprobs=[], versions=[])
    traj.append(r.response_ids, logprobs=r.logprobs, version=r.versions)
    return traj


def test_an_interrupted_streamed_group_continues_under_the_new_policy(assets: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.rollout import HFRolloutEngine
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    tokenizer, temperature = assets["tokenizer"], 0.9
    prompts = load_prompts(assets["train"], tokenizer).ids
    chunks = _GatedChunks(2)
    engine = HFRolloutEngine(assets["model"], tokenizer, weights_root=tmp_path / "w", chunks=chunks)
    old = AutoModelForCausalLM.from_pretrained(assets["model"])
    new = AutoModelForCausalLM.from_pretrained(assets["model"])
    with torch.no_grad():  # the trainer's step 0: policy 1
        for p in new.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    publisher = WeightPublisher(new, DiskTransport(tmp_path / "w"), bucket_bytes=1 << 16)
    made: dict[int, list[Rollout]] = {}
    calls: list[list[int]] = []

    def groups(positions: list[int]) -> list[tuple[list[Trajectory], torch.Tensor]]:
        calls.append(positions)
        chunks.armed = len(calls) == 2  # batch 1's groups: interrupted after their first chunk
        params = SamplingParams(n=2, max_new_tokens=8, temperature=temperature, seed=100 + positions[0])
        rollouts = engine.generate([prompts[q] for q in positions], params)  # one chunked loop for the call
        out = []
        for i, q in enumerate(positions):
            made[q] = rollouts[2 * i : 2 * i + 2]
            out.append(([_trajectory(q, r) for r in made[q]], torch.zeros(2)))
        return out

    def publish(version: int | None) -> int:
        if version is None:
            return 0  # the engine's own weights
        publisher.publish(version)
        return version

    source = StreamingSource(
        rollout=engine, groups_fn=groups, publish_fn=publish, prompts_per_step=2, max_staleness=1, num_batches=2,
        start=0, dp_rank=0, dp_size=1, chunks=chunks,
    )  # fmt: skip
    try:
        first = source.batch(0)  # groups 0, 1; groups 2, 3 (also started under policy 0) wait at their first boundary
        source.publish(1)
        chunks.gate.set()
        second = source.batch(1)
    finally:
        source.close()
    assert not chunks.is_refreshing, "the source leaves the engine's chunk hook as it found it"
    assert calls == [[0, 1], [2, 3]]
    assert source.stream.infos[1].start_versions == [0, 0], "a group keeps its start version (staleness 1)"
    with torch.no_grad():
        for q in (0, 1):
            for r in made[q]:
                assert r.versions == [0] * len(r.response_ids)
                assert torch.allclose(torch.tensor(r.logprobs), _teacher_logprobs(old, r, temperature), atol=1e-4)
        continued = 0
        for q in (2, 3):
            for r in made[q]:
                n = len(r.response_ids)
                # version v = policy step v here: the first chunk by policy 0, the rest by policy 1
                assert r.versions == [0] * min(n, 2) + [1] * max(n - 2, 0), r.versions
                got = torch.tensor(r.logprobs)
                assert torch.allclose(got[:2], _teacher_logprobs(old, r, temperature)[:2], atol=1e-4), r
                assert torch.allclose(got[2:], _teacher_logprobs(new, r, temperature)[2:], atol=1e-4), r
                continued += n > 2
    assert continued > 0, "some response was interrupted and continued"
    assert first.stats["interrupted"] == 0.0 and second.stats["interrupted"] == continued
    metrics = staleness_metrics(second.stats)
    assert metrics["partial/interrupted_frac"] == continued / 4 and metrics["partial/token_staleness_max"] == 1.0
    assert second.stats["staleness_max"] == 1.0


class _ChunkedFake:
    """A rollout engine stand-in whose chunks take time: one token per chunk, the token = the serving version.
    A weight switch while any chunk is running is recorded as an error (the source must switch at boundaries)."""

    def __init__(self, chunks: ChunkedGeneration, lengths: dict[int, int], chunk_s: float = 0.004) -> None:
        self.version, self.chunks, self.lengths, self.chunk_s = 0, chunks, lengths, chunk_s
        self.running, self.lock, self.errors = 0, threading.Lock(), []  # type: ignore[var-annotated]
        self.attempts: dict[int, list[int]] = {}  # position -> tokens generated by each attempt

    def update_weights(self, version: int | None = None) -> int:
        with self.lock:
            if self.running:
                self.errors.append(f"switched to {version} while {self.running} chunk(s) ran")
            if version is not None and version < self.version:
                self.errors.append(f"went back from {self.version} to {version}")
            self.version = self.version if version is None else version
        return self.version

    def group(self, position: int, default: int) -> tuple[list[Trajectory], torch.Tensor]:
        with self.lock:
            attempts = self.attempts.setdefault(position, [])
            attempt = len(attempts)
            attempts.append(-1)  # in progress
        length = self.lengths.get(position, default) if attempt == 0 else default
        tokens: list[int] = []
        for i in range(length):
            if i and self.chunks.between_chunks():
                break
            with self.lock:
                self.running += 1
                version = self.version
            time.sleep(self.chunk_s)
            with self.lock:
                self.running -= 1
            tokens.append(version)
        self.attempts[position][attempt] = len(tokens)
        traj = Trajectory(group=position, token_ids=tokens, loss_mask=[1] * len(tokens), logprobs=[0.0] * len(tokens),
                          versions=list(tokens))  # fmt: skip
        return [traj], torch.zeros(1)


def _fake_source(fake: _ChunkedFake, workers: int, steps: int, default: int, prompts: int = 2) -> StreamingSource:
    def publish(version: int | None) -> int:
        return 0 if version is None else version

    def groups(positions: list[int]) -> list[tuple[list[Trajectory], torch.Tensor]]:
        return [fake.group(q, default) for q in positions]

    return StreamingSource(
        rollout=fake, groups_fn=groups, publish_fn=publish, prompts_per_step=prompts, max_staleness=1,  # type: ignore[arg-type]
        num_batches=steps, start=0, dp_rank=0, dp_size=1, workers=workers, chunks=fake.chunks,
    )  # fmt: skip


def test_two_workers_switch_weights_only_at_chunk_boundaries() -> None:
    fake = _ChunkedFake(ChunkedGeneration(1), lengths={})
    source = _fake_source(fake, workers=2, steps=6, default=12)
    batches = []
    try:
        for k in range(6):
            batches.append(source.batch(k))
            time.sleep(0.01)  # the training step: shorter than a group, so groups are in flight at every publish
            source.publish(k + 1)
    finally:
        source.close()
    assert not fake.errors, fake.errors
    assert source.max_active == 2, "the two workers' calls overlapped"
    interrupted = 0.0
    for k, (b, info) in enumerate(zip(batches, source.stream.infos, strict=True)):
        assert len(b.rollouts) == 2 and all(k - v <= 1 for v in info.start_versions), info
        for r, start in zip(b.rollouts, info.start_versions, strict=True):
            # weight version v = policy step v: never older than the start, never newer than the batch, never back
            assert start <= r.versions[0] and r.versions == sorted(r.versions) and r.versions[-1] <= k, (k, r.versions)
        interrupted += b.stats["interrupted"]
    assert interrupted > 0, "some group was continued under newer weights"


def test_a_released_call_stops_at_its_next_chunk_boundary() -> None:
    # Position 1's first attempt would take 300 chunks; it starts under policy 0 next to position 0 (two workers).
    # Batch 1 is taken from position 2 (started under policy 1), which releases position 1 (no later batch may take
    # a group started under policy 0): its call stops at the next boundary, and its prompt is generated again.
    fake = _ChunkedFake(ChunkedGeneration(1), lengths={1: 300}, chunk_s=0.005)
    source = _fake_source(fake, workers=2, steps=3, default=2, prompts=1)
    try:
        positions = []
        for k in range(3):
            source.batch(k)
            positions += source.stream.infos[k].positions
            source.publish(k + 1)
    finally:
        source.close()
    assert not fake.errors, fake.errors
    assert sorted(positions) == [0, 1, 2], "every position trained once"
    first_attempt = fake.attempts[1][0]
    assert first_attempt < 300 and len(fake.attempts[1]) == 2, fake.attempts
    assert source.stream.infos[1].positions == [2] and source.stream.infos[2].positions == [1]
