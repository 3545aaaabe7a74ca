"""Streaming rollouts on the embedded-HF Ray rollout actors (issue 41), with a real Ray actor on a local CPU cluster.

The trainer side is one process here (the trainer's multi-rank runs are integration_tests/test_ray_launch.py): a
`StreamingSource` with two generator threads streams groups through `RayRolloutClient` (built with the disk root)
from one `RolloutActor`, while the test plays the trainer: after each batch it changes the policy's weights and
publishes them as a weight-sync disk version. Every call names the version its groups need and the actor loads it
first. Checked: every response's behaviour log-probs equal the teacher-forced log-probs of the weights of the version
it says generated it (within 1e-4; the versions' weights differ by far more, so a response tagged with the wrong
version would fail), each call ran under one version (all tokens of a response carry one), that version is at least
the group's start version's and never newer than what was published, the staleness bound holds, and every batch is
``prompts_per_step`` complete groups. Run by `nox -s ray`; skipped where Ray is not installed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from shardforge.rollout.ray.hf_actor import RolloutActor  # noqa: E402  (after the skip: the gated actor's base)

STEPS, PROMPTS, GROUP, STALENESS = 4, 2, 2, 1
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A local Ray cluster of 3 CPUs whose workers import this checkout and this test module (PYTHONPATH, inherited:
    the gated actor below is a class of this module)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), saved]))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(num_cpus=3, include_dashboard=False, namespace="shardforge-test-streaming", log_to_driver=False)
        yield ray
        ray.shutdown()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _teacher_logprobs(model: Any, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_streamed_groups_on_an_hf_rollout_actor_carry_the_disk_version_that_generated_them(
    cluster: Any, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.data.prompts import load_prompts
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.episodes.trajectory import Trajectory
    from shardforge.rollout.ray.hf_actor import RayRolloutClient, RolloutActor
    from shardforge.rollout.ray.placement import RolloutActorSpec
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    assets = tiny_assets(tmp_path / "assets", seed=5, max_operand=20, num_eval=4)
    prompts = load_prompts(assets["train"], assets["tokenizer"]).ids
    spec = RolloutActorSpec(num_actors=1, model=assets["model"], tokenizer=str(tmp_path / "assets" / "tokenizer"),
                            dtype="float32", kv_reuse=True, kv_reuse_max_tokens=4096)  # fmt: skip
    actor = ray.remote(num_cpus=1)(RolloutActor).options(name="stream-actor-0").remote(spec, 0)
    ray.get(actor.ready.remote())
    root = tmp_path / "weights"
    client = RayRolloutClient(["stream-actor-0"], weights_root=root)
    assert not client.publishes_directly and client.source is not None

    policy = AutoModelForCausalLM.from_pretrained(assets["model"])
    weights = {0: {k: v.clone() for k, v in policy.state_dict().items()}}  # version -> the policy's weights
    publisher = WeightPublisher(policy, DiskTransport(root, keep_last=STEPS + 1), bucket_bytes=1 << 16)
    made: dict[int, list[Any]] = {}

    def groups(positions: list[int]) -> list[tuple[list[Trajectory], torch.Tensor]]:  # a generator thread
        asked = client.version
        params = SamplingParams(n=GROUP, max_new_tokens=6, temperature=TEMPERATURE, seed=100 + positions[0])
        rollouts = client.generate([prompts[q] for q in positions], params)
        out = []
        for i, q in enumerate(positions):
            made[q] = [(asked, r) for r in rollouts[GROUP * i : GROUP * (i + 1)]]
            trajs = []
            for r in made[q]:
                traj = Trajectory(group=q, token_ids=[], loss_mask=[], logprobs=[], versions=[])
                traj.append(r[1].response_ids, logprobs=r[1].logprobs, version=r[1].versions)
                trajs.append(traj)
            out.append((trajs, torch.zeros(GROUP)))
        return out

    def publish(version: int | None) -> int:  # the trainer's publish (main thread)
        if version is None:
            return 0  # the model directory's weights
        publisher.publish(version)
        weights[version] = {k: v.clone() for k, v in policy.state_dict().items()}
        return version

    source = StreamingSource(
        rollout=client, groups_fn=groups, publish_fn=publish, prompts_per_step=PROMPTS, max_staleness=STALENESS,
        num_batches=STEPS, start=0, dp_rank=0, dp_size=1, workers=2,
    )  # fmt: skip
    batches = []
    try:
        for step in range(STEPS):
            batches.append(source.batch(step))
            time.sleep(0.5)  # "training": the generator runs ahead under the old weights meanwhile
            with torch.no_grad():  # the step's update: far larger than the 1e-4 tolerance below
                for p in policy.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + step)))
            if step + 1 < STEPS:
                source.publish(step + 1)
    finally:
        source.close()
    stats = ray.get(actor.stats.remote())
    ray.kill(actor)

    for step, (batch, info) in enumerate(zip(batches, source.stream.infos, strict=True)):
        assert len(info.positions) == PROMPTS and len(batch.rollouts) == PROMPTS * GROUP, "complete groups"
        assert all(step - v <= STALENESS for v in info.start_versions), (step, info.start_versions)
    assert sorted(q for info in source.stream.infos for q in info.positions) == list(range(STEPS * PROMPTS))
    assert max(step - v for step, info in enumerate(source.stream.infos) for v in info.start_versions) == 1
    served = set()
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    with torch.no_grad():
        for q in range(STEPS * PROMPTS):
            start = next(
                info.start_versions[info.positions.index(q)] for info in source.stream.infos if q in info.positions
            )
            for asked, r in made[q]:
                assert r.versions == [r.version] * len(r.response_ids), "one call, one version"
                assert r.version == asked >= start, (q, r.version, asked, start)  # one rank: exactly what it named
                served.add(r.version)
                model.load_state_dict(weights[r.version])
                expected = _teacher_logprobs(model, r.prompt_ids, r.response_ids)
                assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-4), (q, r.version)
                other = (r.version + 1) % len(weights)
                model.load_state_dict(weights[other])
                assert not torch.allclose(torch.tensor(r.logprobs), _teacher_logprobs(model, r.prompt_ids,
                                                                                      r.response_ids), atol=1e-3)  # fmt: skip
    assert len(served) >= 3, served  # the actor moved through the versions ...
    assert stats["loaded"] == sorted(served - {0}) and stats["received"] == [], stats  # ... loading each from disk once
    assert stats["served_newer"] == 0, stats


class GatedRolloutActor(RolloutActor):
    """A `RolloutActor` whose second generate call waits at its first chunk boundary until the file ``gate`` exists
    (the test publishes a newer version first), so an interruption happens by construction, not by timing."""

    def __init__(self, spec: Any, index: int, gate: str) -> None:
        super().__init__(spec, index)
        self.gate, self.armed_call = Path(gate), 2

    def _between_chunks(self) -> bool:
        if self.generate_calls == self.armed_call:
            self.armed_call = -1
            deadline = time.monotonic() + 120
            while not self.gate.exists():
                assert time.monotonic() < deadline, "the test never published"
                time.sleep(0.02)
        return super()._between_chunks()


def test_partial_rollouts_on_an_hf_rollout_actor_continue_under_the_new_version(cluster: Any, tmp_path: Path) -> None:
    """Partial rollouts on the actor (``rollout.interrupt_chunk_tokens: 2``): the groups of batch 1, started under
    version 0, wait at their first chunk boundary until the test has published version 1, then continue under it.
    Every token carries the version that sampled it, and its behaviour log-prob equals the teacher-forced log-prob of
    that version's weights (within 1e-4); the groups keep their start version (the bound counts from it), and the
    per-token staleness counts see the interruption."""
    from transformers import AutoModelForCausalLM

    from shardforge.algorithms.data.prompts import load_prompts
    from shardforge.algorithms.testing import tiny_assets
    from shardforge.algorithms.trainers.rl.streaming_source import StreamingSource
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.chunked import ChunkedGeneration
    from shardforge.rollout.episodes.trajectory import Trajectory
    from shardforge.rollout.ray.hf_actor import RayRolloutClient
    from shardforge.rollout.ray.placement import RolloutActorSpec
    from shardforge.weight_sync import DiskTransport, WeightPublisher

    assets = tiny_assets(tmp_path / "assets", seed=11, max_operand=20, num_eval=4)
    prompts = load_prompts(assets["train"], assets["tokenizer"]).ids
    spec = RolloutActorSpec(num_actors=1, model=assets["model"], tokenizer=str(tmp_path / "assets" / "tokenizer"),
                            dtype="float32", kv_reuse=True, kv_reuse_max_tokens=4096, interrupt_chunk_tokens=2)  # fmt: skip
    gate = tmp_path / "gate"
    actor = ray.remote(num_cpus=1)(GatedRolloutActor).options(name="partial-actor-0").remote(spec, 0, str(gate))
    ray.get(actor.ready.remote())
    root = tmp_path / "weights"
    client = RayRolloutClient(["partial-actor-0"], weights_root=root)
    policy = AutoModelForCausalLM.from_pretrained(assets["model"])
    weights = {0: {k: v.clone() for k, v in policy.state_dict().items()}}
    publisher = WeightPublisher(policy, DiskTransport(root, keep_last=STEPS + 1), bucket_bytes=1 << 16)
    made: dict[int, Any] = {}

    def groups(positions: list[int]) -> list[tuple[list[Trajectory], torch.Tensor]]:
        params = SamplingParams(n=GROUP, max_new_tokens=8, temperature=TEMPERATURE, seed=300 + positions[0])
        rollouts = client.generate([prompts[q] for q in positions], params)
        out = []
        for i, q in enumerate(positions):
            made[q] = rollouts[GROUP * i : GROUP * (i + 1)]
            trajs = []
            for r in made[q]:
                traj = Trajectory(group=q, token_ids=[], loss_mask=[], logprobs=[], versions=[])
                traj.append(r.response_ids, logprobs=r.logprobs, version=r.versions)
                trajs.append(traj)
            out.append((trajs, torch.zeros(GROUP)))
        return out

    def publish(version: int | None) -> int:
        if version is None:
            return 0
        publisher.publish(version)
        weights[version] = {k: v.clone() for k, v in policy.state_dict().items()}
        return version

    source = StreamingSource(
        rollout=client, groups_fn=groups, publish_fn=publish, prompts_per_step=PROMPTS, max_staleness=STALENESS,
        num_batches=3, start=0, dp_rank=0, dp_size=1, chunks=ChunkedGeneration(2),
    )  # fmt: skip
    batches = []
    try:
        for step in range(3):
            batches.append(source.batch(step))
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + step)))
            if step + 1 < 3:
                source.publish(step + 1)
            gate.touch()  # after the first publish: the waiting call continues under version 1
    finally:
        source.close()
    stats = ray.get(actor.stats.remote())
    ray.kill(actor)

    infos = source.stream.infos
    assert [sorted(info.positions) for info in infos] == [[0, 1], [2, 3], [4, 5]], "whole groups, in order"
    assert infos[1].start_versions == [0, 0], "batch 1's groups started under version 0 (staleness 1)"
    assert all(step - v <= STALENESS for step, info in enumerate(infos) for v in info.start_versions)
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    continued = 0
    with torch.no_grad():
        for q, rollouts in made.items():
            for r in rollouts:
                n = len(r.response_ids)
                assert len(r.versions) == n and r.versions == sorted(r.versions), r.versions  # forward only
                if q in (2, 3):  # the interrupted call: its first chunk by version 0, the rest by version 1
                    assert r.versions == [0] * min(n, 2) + [1] * max(n - 2, 0), r.versions
                    continued += n > 2
                got = torch.tensor(r.logprobs)
                for version in set(r.versions):
                    model.load_state_dict(weights[version])
                    mask = torch.tensor([v == version for v in r.versions])
                    expected = _teacher_logprobs(model, r.prompt_ids, r.response_ids)
                    assert torch.allclose(got[mask], expected[mask], atol=1e-4), (q, version, r.versions)
    assert continued > 0, "some response was interrupted and continued"
    assert stats["switched_mid_call"] >= 1 and stats["received"] == [], stats
    assert batches[1].stats["interrupted"] == continued, batches[1].stats
