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

STEPS, PROMPTS, GROUP, STALENESS = 4, 2, 2, 1
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A local Ray cluster of 3 CPUs whose workers import this checkout (PYTHONPATH, inherited)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=3, include_dashboard=False, namespace="shardforge-test-streaming", log_to_driver=False)
    yield ray
    ray.shutdown()


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
