"""Restarts of the vLLM server actor's server when several trainer ranks share it (``rollout.placement:
disaggregated`` + ``rollout.engine: vllm`` + ``rollout.vllm.on_server_failure: restart`` at world size 2).

Two gloo ranks use `RayVLLMServerEngine` on one `VLLMServerActor` running the stub server
(tests/rollout_server_stub.py), with stand-ins for Ray's actor handle: rank 0's calls the actor object, which it
holds (it owns the server process), rank 1's only answers the URL and the server's command and log, and fails
the test if it is asked to restart or stop the server. Only rank 0 may ask the actor, once per restart the ranks
agreed on (`shardforge.rollout.server.shared_restart`). No Ray or vLLM needed.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardforge.rollout.testing import STUB_SERVER

STUB = STUB_SERVER
# Fast failure detection, but not so fast that a live stub on a loaded 2-core CI machine reads as hung: a
# 0.5 s /health timeout failed there once (2026-11-29). Dead servers here refuse connections at once anyway.
FAST = {"health_timeout_s": 5.0, "request_timeout_s": 10.0, "server_startup_timeout_s": 30.0}
PROMPTS = {0: [[5, 6, 7], [8, 9], [10]], 1: [[11, 12], [13], [14, 15, 16]]}
"""Each rank's own prompts (3 requests per rank and round)."""


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def _fake_ray(rank: int, actor: Any, info: list[Any], calls: list[str]) -> Any:
    """A ``ray`` module whose actor handle calls ``actor`` (rank 0) or answers ``info`` = [url, server_info]
    and refuses everything else (rank 1); every call's name goes to ``calls``."""

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args: Any) -> Any:
            calls.append(self.name)
            if actor is not None:
                return lambda: getattr(actor, self.name)(*args)
            if self.name in ("url", "server_info"):
                return lambda: info[0] if self.name == "url" else info[1]

            def refused() -> None:
                raise AssertionError(f"rank {rank} asked the server actor to {self.name}: only rank 0 may")

            return refused

    handle = SimpleNamespace(**{name: Method(name) for name in ("url", "server_info", "restart", "stop_server")})
    errors = SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}),
                             RayTaskError=type("RayTaskError", (Exception,), {}))  # fmt: skip
    return SimpleNamespace(get_actor=lambda name: handle, get=lambda ref: ref(), exceptions=errors)


def _two_ranks_share_the_actors_server(tmp: Path, dying_rank: int) -> dict[str, Any]:
    """On each of 2 ranks: a healthy round at weight version 3; a round during which the server dies with
    ``dying_rank``'s batch in flight (the other rank's round already succeeded); a switch to version 4 that
    fails on rank 0 (the server is alive: it must be stopped, not left at version 3) and the rounds after it;
    then, with the two restarts used up, a round in which only the other rank sends requests to a killed server."""
    import torch.distributed as dist

    from shardforge.rollout.config import VLLMOptions
    from shardforge.rollout.ray.vllm_server import RayVLLMServerEngine, VLLMServerActor
    from shardforge.rollout.server.health import RolloutServerError
    from shardforge.rollout.server.shared_restart import generation_round
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    rank = dist.get_rank()
    marker = tmp / "die"

    class StubEngine(VLLMServerRolloutEngine):
        def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
            return [sys.executable, str(STUB), "--port", str(port), "--host", "127.0.0.1", "--die-once", str(marker)]

    class StubActor(VLLMServerActor):
        server_class = StubEngine

    actor, info = None, [None, None]
    if rank == 0:  # the actor's process, in Ray its own
        spec = SimpleNamespace(vllm=VLLMOptions(mode="server", **FAST), output_dir=str(tmp / "out"), model=str(tmp),
                               tokenizer=str(tmp), dtype="float32", seed=3)  # fmt: skip
        actor = StubActor(spec, 0, host="127.0.0.1")
        info = [actor.url(), actor.server_info()]
    dist.broadcast_object_list(info, src=0)
    calls: list[str] = []
    saved = sys.modules.get("ray")
    sys.modules["ray"] = _fake_ray(rank, actor, info, calls)
    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    params = SamplingParams(n=3, max_new_tokens=4, seed=7)
    options = VLLMOptions(mode="server", on_server_failure="restart", max_server_restarts=2, weight_transport="disk",
                          **FAST)  # fmt: skip
    try:
        engine = RayVLLMServerEngine("shardforge-rollout-0", tmp, tokenizer, options=options, weights_root=tmp / "w")

        def responses() -> list[tuple[int, list[int]]]:
            return [(r.prompt_index, r.response_ids) for r in engine.generate(PROMPTS[rank], params)]

        def state() -> dict[str, Any]:
            with urllib.request.urlopen(engine.url + "/stub/state", timeout=5) as reply:
                return json.loads(reply.read())  # type: ignore[no-any-return]

        attempts = 0

        def dying_round() -> list[tuple[int, list[int]]]:
            nonlocal attempts
            attempts += 1
            if rank != dying_rank:
                out = responses()
                (tmp / "other_done").touch()  # the survivor's round is over before the server dies
                return out
            if attempts == 1:
                _wait_for(tmp / "other_done")
                marker.touch()  # the server dies on this batch's first request (the next start finds no marker)
            return responses()

        engine.update_weights(3)
        expected = generation_round(engine, responses)
        first_pid = state()["pid"]
        engine.pop_stats()
        got = generation_round(engine, dying_round)
        after, stats, restarts = state(), engine.pop_stats(), engine.health.total_restarts
        dist.barrier()  # no rank asks the server for its state while rank 0 stops it below

        # Rank 0's switch to version 4 fails on a live server: stopped, the next round restarts it at version 4.
        if rank == 0:
            switch = engine._switch

            def fail_once(target: int) -> None:
                engine._switch = switch  # type: ignore[method-assign]
                raise ConnectionResetError("the switch's connection was reset")

            engine._switch = fail_once  # type: ignore[method-assign]
        engine.update_weights(4)
        after_switch = generation_round(engine, responses)
        switch_state, switch_stats = state(), engine.pop_stats()
        healthy4 = generation_round(engine, responses)

        # max_server_restarts=2 is used up: only the other rank sends requests, to a killed server.
        dist.barrier()  # every rank is between rounds
        if actor is not None and actor.server.process is not None:
            actor.server.process.kill()
            actor.server.process.wait()
        dist.barrier()
        error = None
        try:
            generation_round(engine, responses if rank != dying_rank else list)
        except RolloutServerError as exc:
            error = str(exc)
        return {
            "expected": expected, "got": got, "attempts": attempts, "first_pid": first_pid, "state": after,
            "stats": stats, "restarts": restarts, "error": error, "url": engine.url, "after_switch": after_switch,
            "healthy4": healthy4, "switch_state": switch_state, "switch_stats": switch_stats,
            "total_restarts": engine.health.total_restarts, "calls": calls,
            "actor_restarts": None if actor is None else actor.restarts,
        }  # fmt: skip
    finally:
        if saved is None:
            sys.modules.pop("ray", None)
        else:
            sys.modules["ray"] = saved
        if actor is not None:
            actor.shutdown()


@pytest.mark.parametrize("dying_rank", [1, 0])
def test_two_ranks_restart_the_actors_server_once_through_rank_0(tmp_path: Path, dying_rank: int) -> None:
    from shardforge.mesh.testing import get_rank_pool

    results = get_rank_pool(2).run(_two_ranks_share_the_actors_server, tmp_path, dying_rank, timeout_s=90)
    other = 1 - dying_rank
    log = tmp_path / "out" / "vllm_server.log"
    starts = [line for line in log.read_text().splitlines() if line.startswith("stub server ")]
    assert len(starts) == 3, f"the actor started the server once and restarted it twice: {starts}"
    assert results[0]["actor_restarts"] == 2
    # Only rank 0 asked the actor: once per agreed restart, once to stop the server whose switch failed.
    assert results[0]["calls"] == ["url", "server_info", "restart", "stop_server", "restart"], results[0]["calls"]
    assert results[1]["calls"] == ["url", "server_info"], results[1]["calls"]

    for rank, out in enumerate(results):
        assert out["got"] == out["expected"], f"rank {rank}: the rollouts differ from a healthy server's"
        assert out["state"]["version"] == 3, "the restarted server serves the current weight version"
        assert out["state"]["pid"] != out["first_pid"]
        assert out["restarts"] == 1, f"rank {rank}: the run's restart count (max_server_restarts) is the same"
    assert results[dying_rank]["attempts"] == 2 and results[other]["attempts"] == 1  # only the lost round reruns
    total = {k: sum(out["stats"][k] for out in results) for k in results[0]["stats"]}
    assert total == {"rollout_server/health_checks": 3.0, "rollout_server/failures": 1.0,
                     "rollout_server/restarts": 1.0, "rollout_server/resent_requests": 3.0}  # fmt: skip
    assert results[0]["stats"]["rollout_server/restarts"] == 1.0  # reported by rank 0 only

    # The failed switch stopped the live server: restarted at version 4, never sampled at version 3 as 4.
    for rank, out in enumerate(results):
        assert out["switch_state"]["version"] == 4 and out["after_switch"] == out["healthy4"], rank
        assert out["after_switch"] != out["expected"] and out["total_restarts"] == 2, rank
    total = {k: sum(out["switch_stats"][k] for out in results) for k in results[0]["switch_stats"]}
    assert total == {"rollout_server/health_checks": 4.0, "rollout_server/failures": 2.0,
                     "rollout_server/restarts": 1.0, "rollout_server/resent_requests": 6.0}  # fmt: skip

    # Restarts used up: the same one-line error on both ranks (also the rank that sent nothing), naming the log.
    errors = [out["error"] for out in results]
    assert errors[0] is not None and errors[0] == errors[1] and "\n" not in errors[0], errors
    assert errors[0].startswith(f"rollout server {results[0]['url']} is down: /health: connection refused")
    assert f"(seen by rank(s) [{other}])" in errors[0]
    assert f"check its log {log}" in errors[0] and "rollout.vllm.max_server_restarts is used up" in errors[0]
