"""``rollout.placement: disaggregated`` + ``rollout.engine: vllm`` (issue 21): the vLLM server actor and the ranks'
engine on it, with a stub server process standing in for ``vllm serve`` (tests/rollout_server_stub.py) and an
in-process stand-in for Ray's actor handle. No Ray or vLLM needed (the real run, a vLLM CPU server actor under a
local Ray cluster, is packages/algorithms/tests_vllm/test_vllm_ray_actor.py in ``nox -s vllm``)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.trainers.grpo import GRPOConfig
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.ray.placement import rollout_actor_spec
from shardforge.rollout.ray.vllm_server import RayVLLMServerEngine, VLLMServerActor
from shardforge.rollout.server.health import RolloutServerError
from shardforge.rollout.testing import STUB_SERVER
from shardforge.rollout.types import SamplingParams
from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

STUB = STUB_SERVER
TOKENIZER = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
PARAMS = SamplingParams(n=3, max_new_tokens=4, seed=7)
PROMPTS = [[5, 6, 7], [8, 9], [10]]
FAST = {"health_timeout_s": 0.5, "request_timeout_s": 2.0, "server_startup_timeout_s": 30.0}
SERVER = {"rollout.placement": "disaggregated", "rollout.engine": "vllm", "rollout.vllm": {"mode": "server"}}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _config(**entries: Any) -> Any:
    return build_config(GRPOConfig, {"model": "m", "train_file": "t.jsonl", "output_dir": "o"} | entries)


# ------------------------------------------------------------------------------------------ config
def test_a_vllm_server_actor_is_accepted_under_ray() -> None:
    config = _config(**SERVER, seed=4, **{"rollout.dtype": "bf16"})
    spec = rollout_actor_spec(config, "ray", world_size=2)
    assert spec is not None and (spec.engine, spec.num_actors, spec.seed, spec.dtype) == ("vllm", 1, 4, "bf16")
    assert spec.vllm == config.rollout.vllm and spec.output_dir == str(Path("o").resolve()) and spec.gpus_per_actor == 1
    tp2 = rollout_actor_spec(_config(**SERVER | {"rollout.vllm": {"mode": "server", "tensor_parallel_size": 2}}), "ray")
    assert tp2 is not None and tp2.gpus_per_actor == 2
    hf = rollout_actor_spec(_config(**{"rollout.placement": "disaggregated"}), "ray")
    assert hf is not None and (hf.engine, hf.vllm, hf.gpus_per_actor) == ("hf", None, 1)


@pytest.mark.parametrize(
    ("entries", "launcher", "world", "fragment"),
    [
        ({}, "local", 2, "which only --launcher ray starts (this run's launcher: local)"),
        (
            {"rollout.vllm": {"mode": "in_process"}},
            "ray",
            2,
            "runs vLLM as a server actor: set rollout.vllm.mode=server",
        ),
        ({"rollout.vllm": {"mode": "server", "server_url": "http://h:1"}}, "ray", 2, "remove rollout.vllm.server_url"),
        ({"rollout.num_actors": 2}, "ray", 2, "set rollout.num_actors=1"),
        ({"rollout.on_actor_failure": "drop"}, "ray", 2, "set rollout.on_actor_failure=error (it is drop)"),
        (
            {"async_rollouts": True, "rollout.vllm": {"mode": "server", "weight_transport": "collective"}},
            "ray",
            1,
            "set rollout.vllm.weight_transport=auto or disk",
        ),
        ({"rollout.partial_rollouts": True}, "ray", 1, "set rollout.partial_rollouts=false"),
    ],
)
def test_what_the_vllm_server_actor_does_not_support_is_refused_in_one_line(
    entries: dict[str, Any], launcher: str, world: int, fragment: str
) -> None:
    with pytest.raises(ValueError) as error:
        rollout_actor_spec(_config(**SERVER | entries), launcher, world_size=world)
    message = str(error.value)
    assert message.startswith("rollout.placement=disaggregated ") and "\n" not in message, message
    assert fragment in message, message


@pytest.mark.parametrize("world", [1, 2, None])
def test_restart_with_the_actor_is_accepted_at_any_world_size(world: int | None) -> None:
    """Several ranks agree on the actor's restarts (tests/test_ray_vllm_server_shared_restart.py)."""
    config = _config(**SERVER | {"rollout.vllm": {"mode": "server", "on_server_failure": "restart"}})
    assert rollout_actor_spec(config, "ray", world_size=world) is not None


def test_the_server_actors_bundle_holds_its_tensor_parallel_gpus_when_the_cluster_has_them() -> None:
    from shardforge.algorithms.launch.ray import _bundles

    tp2 = rollout_actor_spec(_config(**SERVER | {"rollout.vllm": {"mode": "server", "tensor_parallel_size": 2}}), "ray")
    cpu, gpu = {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}
    assert _bundles(2, tp2, 1, gpus=0.0) == [cpu, cpu, cpu, cpu]  # 2 ranks, the server, a reward actor
    assert _bundles(2, tp2, 1, gpus=4.0) == [gpu, gpu, {"CPU": 1.0, "GPU": 2.0}, cpu]
    assert _bundles(2, tp2, 0, gpus=3.0) == [cpu, cpu, cpu]  # 2 + 2 GPUs needed: all on CPU, as for the ranks
    hf = rollout_actor_spec(_config(**{"rollout.placement": "disaggregated", "rollout.num_actors": 2}), "ray")
    assert _bundles(2, hf, 0, gpus=4.0) == [gpu] * 4 and _bundles(2, None, 0, gpus=2.0) == [gpu] * 2


def test_the_launcher_finds_the_actor_class_of_each_engine() -> None:
    import importlib

    from shardforge.algorithms.launch.ray import _ROLLOUT_ACTORS
    from shardforge.rollout.ray.hf_actor import RolloutActor

    module, _, name = _ROLLOUT_ACTORS["vllm"].partition(":")
    assert getattr(importlib.import_module(module), name) is VLLMServerActor
    module, _, name = _ROLLOUT_ACTORS["hf"].partition(":")
    assert getattr(importlib.import_module(module), name) is RolloutActor


# ------------------------------------------------------------------------------------------ actor
class StubEngine(VLLMServerRolloutEngine):
    """Builds the stub's command instead of ``vllm serve`` (everything else is the real engine)."""

    def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        return [sys.executable, str(STUB), "--port", str(port), "--host", "127.0.0.1"]


class StubActor(VLLMServerActor):
    server_class = StubEngine


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stub/state", timeout=5) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def _spec(tmp_path: Path, **options: Any) -> Any:
    spec = rollout_actor_spec(_config(**SERVER, output_dir=str(tmp_path / "out"), seed=3), "ray", 1)
    assert spec is not None
    return pickle.loads(pickle.dumps(spec)).__class__(  # what Ray hands the actor: a pickled copy
        **{f: getattr(spec, f) for f in spec.__dataclass_fields__} | {"vllm": VLLMOptions(mode="server", **options)}
    )


@pytest.fixture
def actor(tmp_path: Path) -> Iterator[VLLMServerActor]:
    server = StubActor(_spec(tmp_path, **FAST), 0, host="localhost")  # the stub listens on 127.0.0.1 anyway
    try:
        yield server
    finally:
        server.shutdown()


def test_the_actor_serves_restarts_and_stops_its_server(actor: VLLMServerActor, tmp_path: Path) -> None:
    url = actor.url()
    assert url.startswith("http://localhost:") and actor.url() == url
    command, log_path = actor.server_info()
    assert command[command.index("--host") + 1] == "localhost"  # the actor's address, not the colocated loopback
    assert log_path == str(tmp_path / "out" / "vllm_server.log")
    first = _state(url)["pid"]
    assert actor.restart() == url  # same port: the ranks keep their URL
    assert _state(url)["pid"] != first
    stats = actor.stats()
    assert stats["restarts"] == 1 and stats["url"] == url and stats["weight_updates"] == stats["completions"] == 0
    assert stats["weight_version"] is None  # the stub has no /weight_info
    process = actor.server.process
    actor.shutdown()
    assert process is not None and process.poll() is not None  # no `vllm serve` outlives the run


def test_the_actor_counts_the_requests_its_server_answered_from_its_access_log(actor: VLLMServerActor) -> None:
    actor.url()
    assert actor.server.log_path is not None
    with actor.server.log_path.open("a") as log:  # what uvicorn writes in `vllm serve`
        log.write('INFO:     10.0.0.1:4242 - "POST /update_weights HTTP/1.1" 200 OK\n')
        log.write('INFO:     10.0.0.1:4243 - "POST /v1/completions HTTP/1.1" 200 OK\n' * 3)
        log.write('INFO:     10.0.0.1:4244 - "POST /update_weights HTTP/1.1" 400 Bad Request\n')
        log.write('INFO:     10.0.0.1:4245 - "POST /update_weights HTTP/1.1" 200 OK\n')
    stats = actor.stats()
    assert (stats["weight_updates"], stats["completions"]) == (2, 3), stats


class NeverReadyEngine(VLLMServerRolloutEngine):
    def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(120)", "--port", str(port)]  # never listens


def test_a_shutdown_while_the_ranks_wait_for_a_starting_server_stops_it(tmp_path: Path) -> None:
    """The run fails while the server still starts: the driver's `shutdown` (the actor is threaded) stops the
    server, and the `url` call waiting for it fails instead of waiting out server_startup_timeout_s."""
    import threading

    class NeverReady(VLLMServerActor):
        server_class = NeverReadyEngine

    actor = NeverReady(_spec(tmp_path, **FAST | {"server_startup_timeout_s": 100.0}), 0, host="127.0.0.1")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            actor.url()
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    process = actor.server.process
    actor.shutdown()
    waiter.join(timeout=20)
    assert not waiter.is_alive() and process is not None and process.poll() is not None
    assert len(errors) == 1 and "the vLLM server exited with code" in str(errors[0]), errors


# ------------------------------------------------------------------------------------------ ranks' engine
class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        sent = pickle.loads(pickle.dumps(args))  # what Ray's serialisation does to the arguments
        return lambda: self.fn(*sent)


class _Handle:
    """A Ray actor handle's shape: ``handle.method.remote(...)`` -> a ref; ``ray.get(ref)`` runs it."""

    def __init__(self, actor: VLLMServerActor) -> None:
        for name in ("url", "server_info", "restart", "stop_server"):
            setattr(self, name, _Method(getattr(actor, name)))


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch, actor: VLLMServerActor) -> _Handle:
    handle = _Handle(actor)
    errors = SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}),
                             RayTaskError=type("RayTaskError", (Exception,), {}))  # fmt: skip
    names = {"shardforge-rollout-0": handle}
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(get_actor=names.__getitem__, get=lambda ref: ref(),
                                                            exceptions=errors))  # fmt: skip
    return handle


def _rank_engine(tmp_path: Path, **options: Any) -> RayVLLMServerEngine:
    vllm = VLLMOptions(mode="server", **(FAST | {"weight_transport": "disk"} | options))
    return RayVLLMServerEngine("shardforge-rollout-0", tmp_path, TOKENIZER, options=vllm,
                               weights_root=tmp_path / "out" / "weights")  # fmt: skip


def _responses(rollouts: list[Any]) -> list[tuple[int, list[int]]]:
    return [(r.prompt_index, r.response_ids) for r in rollouts]


def test_a_dead_server_is_restarted_through_the_actor_at_the_current_version(
    fake_ray: _Handle, actor: VLLMServerActor, tmp_path: Path
) -> None:
    """The ranks' engine talks to the actor's server by URL; when the server dies, ``on_server_failure: restart``
    asks the actor to restart it, restores weight version 2 and resends the batch (same rollouts)."""
    engine = _rank_engine(tmp_path, on_server_failure="restart", max_server_restarts=1)
    assert engine.url == actor.url() and engine.process is None  # the rank started nothing itself
    engine.update_weights(2)
    expected = _responses(engine.generate(PROMPTS, PARAMS))
    first = _state(engine.url)
    assert first["version"] == 2
    engine.pop_stats()

    os.kill(first["pid"], signal.SIGKILL)
    assert actor.server.process is not None
    actor.server.process.wait()
    assert _responses(engine.generate(PROMPTS, PARAMS)) == expected
    state = _state(engine.url)
    assert state["pid"] != first["pid"] and state["version"] == 2 and actor.restarts == 1
    assert engine.pop_stats()["rollout_server/restarts"] == 1.0

    os.kill(state["pid"], signal.SIGKILL)  # max_server_restarts=1 is used up: the one-line error, with the log
    actor.server.process.wait()
    with pytest.raises(RolloutServerError) as info:
        engine.generate(PROMPTS, PARAMS)
    assert f"check its log {tmp_path / 'out' / 'vllm_server.log'}" in str(info.value) and actor.restarts == 1


def test_without_restart_a_dead_server_is_the_one_line_error(
    fake_ray: _Handle, actor: VLLMServerActor, tmp_path: Path
) -> None:
    engine = _rank_engine(tmp_path)
    assert len(engine.generate(PROMPTS, PARAMS)) == 9
    os.kill(_state(engine.url)["pid"], signal.SIGKILL)
    assert actor.server.process is not None
    actor.server.process.wait()
    with pytest.raises(RolloutServerError) as info:
        engine.generate(PROMPTS, PARAMS)
    message = str(info.value)
    assert message.startswith(f"rollout server {engine.url} is down: /health"), message
    assert "or set rollout.vllm.on_server_failure: restart" in message and "\n" not in message
    assert actor.restarts == 0


def test_a_failed_weight_switch_has_the_actor_stop_its_server(
    fake_ray: _Handle, actor: VLLMServerActor, tmp_path: Path
) -> None:
    """A switch that fails on a live server stops it through the actor (the rank has no process of its own to
    stop), so the next generation restarts it at the new version instead of sampling the old one."""
    engine = _rank_engine(tmp_path, on_server_failure="restart", max_server_restarts=1)
    engine.update_weights(2)
    switch = engine._switch

    def fail_once(target: int) -> None:
        engine._switch = switch  # type: ignore[method-assign]
        raise ConnectionResetError("the switch's connection was reset")

    engine._switch = fail_once  # type: ignore[method-assign]
    assert engine.update_weights(3) == 3
    assert actor.server.process is not None and actor.server.process.poll() is not None  # stopped
    rollouts = engine.generate(PROMPTS, PARAMS)
    assert _state(engine.url)["version"] == 3 and actor.restarts == 1 and {r.version for r in rollouts} == {3}
