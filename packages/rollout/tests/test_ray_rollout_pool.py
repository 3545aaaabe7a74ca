"""A pool of HF rollout actors that drops a dead one (``rollout.on_actor_failure: drop``, issue 21).

Two gloo ranks use `RayRolloutClient` on stand-in rollout actors behind a stand-in for Ray's actor handles (no Ray,
no model): each rank process holds its own copy of the actor objects, whose state lives in files both ranks see
(the version each serves, whether it died). A stand-in samples deterministically from (prompt, seed, the version it
serves), as the real actors do from per-request seeds, so a round regenerated on another actor at the same version
equals the healthy round. The real run (Ray actors, a killed actor process) is integration_tests/test_ray_launch.py.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

NAMES = ["rollout-0", "rollout-1", "rollout-2"]
PROMPTS = {0: [[5, 6, 7], [8, 9]], 1: [[11, 12], [13, 14, 15]]}


class ActorDied(Exception):
    """Stands in for ``ray.exceptions.RayActorError``."""


class StandInActor:
    """A rollout actor's methods; its served version and death are files in ``tmp`` (shared by the rank processes).
    ``die_at``: the generate call (of this process) in which it dies with the call in flight."""

    def __init__(self, index: int, tmp: Path) -> None:
        self.index, self.tmp = index, tmp
        self.dead = tmp / f"dead-{index}"
        self.version_file = tmp / f"version-{index}"
        self.generate_calls = 0
        self.die_at: int | None = None

    def call(self, name: str, *args: Any) -> Any:
        if self.dead.exists():
            raise ActorDied(f"The actor died unexpectedly before finishing this task ({NAMES[self.index]}).\nmore")
        return getattr(self, name)(*args)

    def ready(self) -> int:
        return self.version()

    def version(self) -> int:
        return int(self.version_file.read_text()) if self.version_file.exists() else 0

    def generate(self, prompts: list[list[int]], params: Any, keys: Any, weights: Any = None) -> list[tuple[Any, ...]]:
        assert weights is None, "versions arrive over the collective transport here"
        from shardforge.rollout.seeds import prompt_seeds

        self.generate_calls += 1
        if self.generate_calls == self.die_at:
            self.dead.touch()
            raise ActorDied(f"The actor died unexpectedly before finishing this task ({NAMES[self.index]}).")
        seeds = prompt_seeds(params, len(prompts))
        assert seeds is not None
        out = []
        for prompt, seed in zip(prompts, seeds):
            rng = random.Random(f"{prompt}|{seed}|{self.version()}")
            out.append((tuple(prompt), seed, self.version(), tuple(rng.randrange(50) for _ in range(4))))
        return out

    def receive_weights(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> int:
        """Runs when rank 0 waits for it (after the stand-in engine 'sent' the version): serves it."""
        version, world = json.loads((self.tmp / "published").read_text())
        assert world == world_size, (world, world_size)
        self.version_file.write_text(str(version))
        with (self.tmp / "received.jsonl").open("a") as log:
            log.write(json.dumps([self.index, version, rank, world_size]) + "\n")
        return int(version)


def _fake_ray(actors: list[StandInActor], calls: list[tuple[int, str]]) -> Any:
    """A ``ray`` module whose actor handles call ``actors`` when ``ray.get`` asks for the result."""

    class Method:
        def __init__(self, actor: StandInActor, name: str) -> None:
            self.actor, self.name = actor, name

        def remote(self, *args: Any) -> Any:
            calls.append((self.actor.index, self.name))
            return lambda: self.actor.call(self.name, *args)

    methods = ("ready", "generate", "end_sessions", "receive_weights")
    handles = {NAMES[a.index]: SimpleNamespace(**{m: Method(a, m) for m in methods}) for a in actors}
    errors = SimpleNamespace(RayActorError=ActorDied, RayTaskError=type("RayTaskError", (Exception,), {}))
    util = SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")
    return SimpleNamespace(is_initialized=lambda: True, get_actor=handles.__getitem__, get=lambda ref: ref(),
                           exceptions=errors, util=util)  # fmt: skip


class StandInTrainEngine:
    """``publish_weights``: rank 0 'sends' the version (the stand-in actors read it when rank 0 waits for them)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def publish_weights(self, transport: Any, version: int, **kwargs: Any) -> None:
        if transport is not None:
            (self.tmp / "published").write_text(json.dumps([version, transport.world_size]))


def _pool_on_two_ranks(tmp: Path) -> dict[str, Any]:
    """Version 1 to the 3 actors; a healthy round; a round in which actor 1 dies in rank 1's second call; version 2;
    actor 2 (rank 1's new actor) dies between rounds; version 3; a round; then actor 0, the last, dies."""
    import torch.distributed as dist

    from shardforge.rollout.ray.hf_actor import RayRolloutClient
    from shardforge.rollout.server.health import RolloutServerError
    from shardforge.rollout.server.shared_restart import generation_round
    from shardforge.rollout.types import SamplingParams

    rank = dist.get_rank()
    actors = [StandInActor(i, tmp) for i in range(3)]
    calls: list[tuple[int, str]] = []
    saved = sys.modules.get("ray")
    sys.modules["ray"] = _fake_ray(actors, calls)
    engine, params = StandInTrainEngine(tmp), SamplingParams(n=2, max_new_tokens=4, seed=7)
    out: dict[str, Any] = {}
    try:
        client = RayRolloutClient(NAMES, timeout_s=5.0, on_actor_failure="drop")

        def round_() -> list[Any]:  # two calls: a round lost in its second call must not keep its first
            return client.generate(PROMPTS[rank][:1], params) + client.generate(PROMPTS[rank][1:], params)

        def marked(name: str) -> list[tuple[int, str]]:
            out[name] = [c for c in calls if c[1] != "ready"]
            calls.clear()
            return out[name]

        client.publish(engine, "float32", None)
        marked("publish_v1")
        out["expected"] = generation_round(client, round_)
        client.pop_stats()
        marked("healthy")
        if rank == 1:
            actors[1].die_at = actors[1].generate_calls + 2  # rank 1's second call of the next round
        out["got"] = generation_round(client, round_)
        out["stats"] = client.pop_stats()
        marked("dying")
        client.publish(engine, "float32", None)
        marked("publish_v2")
        out["after_drop"] = (list(client.pool.live), client.actor_index, [a.version() for a in actors])
        dist.barrier()
        if rank == 0:
            actors[2].dead.touch()  # between rounds: no rank notices; rank 0's check before publishing does
        dist.barrier()
        client.publish(engine, "float32", None)
        out["after_publish_drop"] = (list(client.pool.live), client.actor_index, client.pop_stats())
        marked("publish")
        out["v3"] = generation_round(client, round_)
        out["v3_stats"] = client.pop_stats()
        marked("v3_round")
        if rank == 0:
            actors[0].die_at = actors[0].generate_calls + 1  # the last actor dies in rank 0's first call
        try:
            generation_round(client, round_ if rank == 0 else list)  # rank 1 sends nothing this round
        except RolloutServerError as exc:
            out["error"] = str(exc)
        out["received"] = [json.loads(line) for line in (tmp / "received.jsonl").read_text().splitlines()]
        return out
    finally:
        if saved is None:
            sys.modules.pop("ray", None)
        else:
            sys.modules["ray"] = saved


def test_a_dead_actor_is_dropped_and_its_ranks_regenerate_their_round_on_a_live_one(tmp_path: Path) -> None:
    from shardforge.mesh.testing import get_rank_pool

    results = get_rank_pool(2).run(_pool_on_two_ranks, tmp_path, timeout_s=60)
    for rank, out in enumerate(results):
        # the lost round, regenerated whole on actor 2 (same seeds, same version), is the healthy round
        assert out["got"] == out["expected"], rank
        assert [r[2] for r in out["got"]] == [1, 1], rank
    assert results[0]["publish_v1"] == [(i, "receive_weights") for i in range(3)] and results[1]["publish_v1"] == []
    assert results[0]["healthy"] == [(0, "generate")] * 2 and results[1]["healthy"] == [(1, "generate")] * 2
    assert results[0]["dying"] == [(0, "generate")] * 2  # rank 0's round succeeded and is kept
    # rank 1: its first call succeeded on actor 1, the second died; the whole round again on live[1 % 2] = actor 2
    assert results[1]["dying"] == [(1, "generate"), (1, "generate"), (2, "generate"), (2, "generate")]
    assert results[0]["stats"] == {"rollout_actors/dropped": 1.0, "rollout_actors/live": 2.0,
                                   "rollout_actors/resent_requests": 0.0}  # fmt: skip
    assert results[1]["stats"] == {"rollout_actors/dropped": 0.0, "rollout_actors/live": 0.0,
                                   "rollout_actors/resent_requests": 2.0}  # fmt: skip

    # version 2 went to the live actors only (a group of rank 0 + 2 actors); the dead actor 1 still has version 1
    assert results[0]["after_drop"] == ([0, 2], 0, [2, 1, 2]) and results[1]["after_drop"][:2] == ([0, 2], 2)
    # actor 2 died between rounds: rank 0 found it before publishing version 3, to actor 0 alone; rank 1 moved
    for rank, out in enumerate(results):
        live, current, stats = out["after_publish_drop"]
        assert (live, current) == ([0], 0), rank
        assert stats["rollout_actors/dropped"] == (1.0 if rank == 0 else 0.0), (rank, stats)
    assert [r for r in results[0]["received"] if r[1] == 3] == [[0, 3, 1, 2]]
    assert sorted(r[0] for r in results[0]["received"] if r[1] == 2) == [0, 2]
    assert all(r[3] == 4 for r in results[0]["received"] if r[1] == 1)
    assert results[0]["publish_v2"] == [(0, "receive_weights"), (2, "receive_weights")]
    assert results[1]["publish"] == results[1]["publish_v2"] == []  # rank 1 made no call to learn of the drop
    assert (
        results[1]["v3_round"] == [(0, "generate")] * 2
        and results[1]["v3_stats"]["rollout_actors/resent_requests"] == 0
    )
    assert [r[2] for r in results[1]["v3"]] == [3, 3]

    # the last actor died: the same one-line error on both ranks (rank 1 sent nothing to a dead actor)
    errors = [out.get("error") for out in results]
    assert errors[0] is not None and errors[0] == errors[1] and "\n" not in errors[0], errors
    assert errors[0].startswith("rollout actor rollout-0 died: The actor died unexpectedly"), errors[0]
    assert "(seen by rank(s) [0])" in errors[0] and "no rollout actor is left (all 3 died" in errors[0], errors[0]


def test_with_on_actor_failure_error_a_dead_actor_is_a_one_line_error_that_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.rollout.ray.hf_actor import RayRolloutClient
    from shardforge.rollout.server.health import RolloutServerError
    from shardforge.rollout.server.shared_restart import generation_round
    from shardforge.rollout.types import SamplingParams

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    actors = [StandInActor(i, tmp_path) for i in range(2)]
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(actors, []))
    client = RayRolloutClient(NAMES[:2], on_actor_failure="error")
    assert client.shared_restarts is None  # no agreement per round: the run ends
    actors[0].die_at = 1
    with pytest.raises(RolloutServerError) as error:
        generation_round(client, lambda: client.generate([[1, 2]], SamplingParams(n=1, seed=3)))
    message = str(error.value)
    assert "\n" not in message and message.startswith("rollout actor rollout-0 died: The actor died"), message
    assert message.endswith("set rollout.on_actor_failure: drop (rollout.num_actors >= 2) to go on without it")
    with pytest.raises(ValueError, match=r"rollout.on_actor_failure='restart' is not one of \['error', 'drop'\]"):
        RayRolloutClient(NAMES[:2], on_actor_failure="restart")
