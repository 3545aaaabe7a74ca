"""``rollout.vllm.weight_transport: collective`` (issue 21): weights into a vLLM server over weight-sync's collective
transport, no disk versions (`shardforge.rollout.vllm.server_collective`).

The server is the stub (tests/rollout_server_stub.py), which joins trainer rank 0's weight group on
``/init_weight_transfer_engine`` and receives each version with weight-sync's `CollectiveReceiver` on
``/update_weights``, checks it against its manifest (crc32) and reports the received tensors' checksums. The
trainer's engine is a tiny model published by weight-sync's `WeightPublisher` (FSDP-sharded over two gloo ranks in
the last test). No vLLM or Ray needed (the real run is tests_vllm/test_vllm_ray_actor.py in ``nox -s vllm``).
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
import torch
from torch import nn

from shardforge.engine.config import parse_dtype
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.server.health import RolloutServerError, probe_health
from shardforge.rollout.testing import STUB_SERVER
from shardforge.rollout.types import SamplingParams
from shardforge.rollout.vllm.server import VLLMServerRolloutEngine
from shardforge.weight_sync import WeightPublisher, tensor_checksum

STUB = STUB_SERVER
FAST = {"health_timeout_s": 1.0, "request_timeout_s": 30.0, "server_startup_timeout_s": 60.0}
TOKENIZER = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
PARAMS = SamplingParams(n=2, max_new_tokens=3, seed=7)
PROMPTS = [[5, 6, 7], [8, 9]]


class TinyTrainer:
    """The part of `TrainEngine` the server engine uses: ``publish_weights`` (weight-sync's publisher, small buckets
    so a version takes several)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.publishes = 0

    def publish_weights(self, transport: Any, version: int | None = None, *, dtype: Any = None,
                        src_rank: int | None = 0, checksums: Any = "crc32") -> Any:  # fmt: skip
        self.publishes += 1
        cast = parse_dtype(dtype) if dtype else None
        publisher = WeightPublisher(self.model, transport, bucket_bytes=512, dtype=cast, src_rank=src_rank,
                                    checksums=checksums)  # fmt: skip
        return publisher.publish(int(version or 0))

    def checksums(self, dtype: torch.dtype = torch.float32) -> dict[str, str]:
        """crc32 of every full tensor (FSDP shards gathered), in ``dtype``, as the server should receive it."""
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in self.model.state_dict().items()}
        return {name: tensor_checksum(tensor.detach().to(dtype)) for name, tensor in full.items()}

    def step(self) -> None:
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(0.01 * (1 + self.publishes))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def _engine(tmp: Path, *stub_args: str, **options: Any) -> VLLMServerRolloutEngine:
    class StubEngine(VLLMServerRolloutEngine):
        def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
            return [sys.executable, str(STUB), "--port", str(port), "--weights", *stub_args]

    vllm = VLLMOptions(mode="server", weight_transport="collective", **(FAST | options))
    return StubEngine(tmp, TOKENIZER, weights_root=tmp / "weights", options=vllm, log_file=tmp / "server.log")


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stub/state", timeout=5) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------ options
def test_the_weight_transport_option_is_checked_in_one_line() -> None:
    with pytest.raises(
        ValueError, match=r"^rollout.vllm.weight_transport='nfs' is not one of \['auto', 'disk', 'collective'\]$"
    ):
        VLLMOptions(mode="server", weight_transport="nfs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sends weights to a vLLM server: set rollout\.vllm\.mode=server") as error:
        VLLMOptions(mode="in_process", weight_transport="collective")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"set rollout\.vllm\.weight_transport=disk or rollout\.sleep=false$"):
        VLLMOptions(mode="server", weight_transport="collective", enable_sleep_mode=True)
    assert VLLMOptions().weight_transport == "auto"  # collective for the Ray server actor, disk elsewhere


def test_async_rollouts_with_the_collective_transport_are_refused() -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.rl.common import check_rollout_batch

    vllm = {"mode": "server", "weight_transport": "collective"}
    config = build_config(GRPOConfig, {"model": "m", "train_file": "t.jsonl", "output_dir": "o", "async_rollouts": True,
                                       "rollout.engine": "vllm", "rollout.vllm": vllm})  # fmt: skip
    prompts = SimpleNamespace(ids=[[1, 2]], images=None)
    with pytest.raises(ValueError, match=r"set rollout\.vllm\.weight_transport=disk$"):
        check_rollout_batch(config, prompts, 1, 4096, "budget")  # type: ignore[arg-type]


def test_the_trainer_publishes_through_the_engine_when_it_says_so() -> None:
    """`choose_publisher` hands the trainer's publish to an engine that publishes directly (then the trainers write
    no disk version and create no output_dir/weights); an engine that does not is published to through disk."""
    from shardforge.rollout.publish import DiskPublisher, choose_publisher

    class Direct:
        def __init__(self, on: bool) -> None:
            self.publishes_directly, self.calls = on, []

        def publish(self, *args: Any) -> int:
            self.calls.append(args)
            return 7

    engine = Direct(True)
    publisher = choose_publisher(engine, dtype="bf16", weights_root=None)
    assert publisher.publish(SimpleNamespace(), None) == 7 and engine.calls[0][1:] == ("bf16", None)  # type: ignore[arg-type]
    assert isinstance(choose_publisher(Direct(False), dtype="bf16", weights_root="w"), DiskPublisher)


# ------------------------------------------------------------------------------------------ one rank
def test_versions_arrive_intact_and_a_server_that_fails_mid_transfer_is_restarted_at_that_version(
    tmp_path: Path,
) -> None:
    """Versions reach the stub bit for bit (crc32 of every tensor) with nothing on disk. A version the server refuses
    is the one-line error (the server keeps running: a restart would not help). A server that dies mid-transfer is
    stopped, restarted by the next generation, joins a new weight group and receives that version again (gathered
    from the trainer's weights) before the batch is sent; with the restarts used up the same failure is the
    one-line error."""
    corrupt, die = tmp_path / "corrupt", tmp_path / "die"
    engine = _engine(tmp_path, "--corrupt-once", str(corrupt), "--die-in-transfer", str(die),
                     on_server_failure="restart", max_server_restarts=1)  # fmt: skip
    trainer = TinyTrainer(_model())
    try:
        assert engine.source is None and engine.publishes_directly
        assert engine.publish(trainer, "float32") == 1
        state = _state(engine.url)
        assert state["received"] == [1] and state["checksums"] == trainer.checksums()
        trainer.step()
        assert engine.publish(trainer, "float32", 2) == 2
        state = _state(engine.url)
        assert state["received"] == [1, 2] and state["checksums"] == trainer.checksums()
        assert engine.update_weights(2) == 2 and engine.update_weights() == 2
        with pytest.raises(RuntimeError, match="version 3 was never published to it"):
            engine.update_weights(3)
        assert {r.version for r in engine.generate(PROMPTS, PARAMS)} == {2}

        corrupt.touch()  # the server refuses version 3: the error, on every rank, and the server keeps serving 2
        trainer.step()
        with pytest.raises(RolloutServerError) as error:
            engine.publish(trainer, "float32")
        message = str(error.value)
        assert message.startswith(f"rollout server {engine.url} refused weight version 3 over the collective "
                                  "transport: loading it failed: ServerErrorReply:"), message  # fmt: skip
        assert "checksum mismatch" in message and "\n" not in message
        assert engine.version == 2 and _state(engine.url)["version"] == 2 and engine.process is not None
        assert engine.process.poll() is None  # not stopped, not restarted

        die.touch()  # the next transfer kills the server after its first bucket
        first_pid = _state(engine.url)["pid"]
        started = time.monotonic()
        assert engine.publish(trainer, "float32") == 3  # stopped, not raised: the next generation restarts it
        assert time.monotonic() - started < FAST["request_timeout_s"] and not die.exists()
        assert probe_health(engine.url, 1.0) is not None  # down
        engine.pop_stats()
        assert {r.version for r in engine.generate(PROMPTS, PARAMS)} == {3}
        state = _state(engine.url)
        assert state["pid"] != first_pid and engine.pop_stats()["rollout_server/restarts"] == 1.0
        assert state["received"] == [3] and state["checksums"] == trainer.checksums()  # sent again, intact
        assert not (tmp_path / "weights").exists()  # no disk version was written or asked for

        die.touch()  # max_server_restarts=1 is used up: the next generation ends with the one-line error
        trainer.step()
        engine.publish(trainer, "float32")
        with pytest.raises(RolloutServerError) as error:
            engine.generate(PROMPTS, PARAMS)
        assert "rollout.vllm.max_server_restarts is used up" in str(error.value) and "\n" not in str(error.value)
    finally:
        engine.shutdown(grace_s=5.0)


# ------------------------------------------------------------------------------------------ two ranks
def _two_ranks(tmp: Path) -> dict[str, Any]:
    """FSDP shards over 2 gloo ranks; the server loads each version slowly (0.5 s). Rank 1 asks the server for its
    version right after ``publish`` returns; then the server dies in a round and the ranks restart it together."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.rollout.server.shared_restart import generation_round

    rank = dist.get_rank()
    model = _model()
    fully_shard(model, mesh=build_mesh(ParallelDims(dp_shard=2)).get("fsdp"))
    trainer = TinyTrainer(model)
    marker = tmp / "die"
    engine = _engine(tmp, "--update-delay", "0.5", "--die-once", str(marker), on_server_failure="restart")
    try:
        out: dict[str, Any] = {"expected": trainer.checksums()}
        out["version"] = engine.publish(trainer, "float32")
        out["seen_after_publish"] = _state(engine.url)["version"]  # the new one on every rank, or a rank went early
        out["first"] = _state(engine.url) if rank == 0 else None
        before = generation_round(engine, lambda: engine.generate(PROMPTS, PARAMS))
        dist.barrier()
        if rank == 1:
            marker.touch()  # the round's first request kills the server
        dist.barrier()
        after = generation_round(engine, lambda: engine.generate(PROMPTS, PARAMS))
        out["same_rollouts"] = [r.response_ids for r in after] == [r.response_ids for r in before]
        out["restarted"] = _state(engine.url)
        out["restarts"] = engine.health.total_restarts
        return out
    finally:
        dist.barrier()
        engine.shutdown(grace_s=5.0)


def test_two_ranks_send_their_shards_wait_for_the_server_and_restore_it_together(tmp_path: Path) -> None:
    from shardforge.mesh.testing import get_rank_pool

    results = get_rank_pool(2).run(_two_ranks, tmp_path, timeout_s=90)
    expected = results[0]["expected"]
    assert results[0]["first"]["checksums"] == expected and results[0]["first"]["received"] == [1]
    for rank, out in enumerate(results):
        assert out["version"] == 1 and out["seen_after_publish"] == 1, f"rank {rank} returned before the switch"
        assert out["restarts"] == 1 and out["same_rollouts"], rank
        # the restarted server (a new process) got version 1 again, gathered from both ranks' shards
        assert out["restarted"]["received"] == [1] and out["restarted"]["checksums"] == expected, rank
        assert out["restarted"]["pid"] != results[0]["first"]["pid"]


# ------------------------------------------------------------------------------------------ the Ray server actor
def test_the_ray_server_actor_gets_its_weights_over_the_collective_transport_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollout.placement: disaggregated``: `RayVLLMServerEngine` with ``weight_transport: auto`` sends over the
    collective transport from the node IP Ray reports to the actor's (stub) server, nothing under output_dir/weights
    (its restart through the actor is `VLLMServerRolloutEngine.restart_server`, tested above). With
    ``on_server_failure: error`` (the default) a server that dies mid-transfer is the one-line error of the publish,
    at once (the broken broadcast, not a timeout). Ray's handle is a stand-in."""
    from shardforge.rollout.ray.vllm_server import RayVLLMServerEngine, VLLMServerActor

    class StubEngine(VLLMServerRolloutEngine):
        def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
            return [sys.executable, str(STUB), "--port", str(port), "--host", "127.0.0.1", "--weights",
                    "--die-in-transfer", str(die)]  # fmt: skip

    class StubActor(VLLMServerActor):
        server_class = StubEngine

    out, die = tmp_path / "out", tmp_path / "die"
    spec = SimpleNamespace(vllm=VLLMOptions(mode="server", **FAST), output_dir=str(out), model=str(tmp_path),
                           tokenizer=str(tmp_path), dtype="float32", seed=3)  # fmt: skip
    actor = StubActor(spec, 0, host="127.0.0.1")

    def method(name: str) -> Any:
        return SimpleNamespace(remote=lambda *args: lambda: getattr(actor, name)(*args))

    handle = SimpleNamespace(**{name: method(name) for name in ("url", "server_info", "restart", "stop_server")})
    errors = SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}),
                             RayTaskError=type("RayTaskError", (Exception,), {}))  # fmt: skip
    ray = SimpleNamespace(get_actor=lambda name: handle, get=lambda ref: ref(), exceptions=errors,
                          util=SimpleNamespace(get_node_ip_address=lambda: "localhost"))  # fmt: skip
    monkeypatch.setitem(sys.modules, "ray", ray)
    try:
        options = VLLMOptions(mode="server", **FAST)
        engine = RayVLLMServerEngine("shardforge-rollout-0", tmp_path, TOKENIZER, options=options,
                                     weights_root=out / "weights")  # fmt: skip
        assert engine.publishes_directly and engine.sender is not None and engine.sender.host == "localhost"
        trainer = TinyTrainer(_model())
        assert engine.publish(trainer, "bf16") == 1  # cast to the rollout dtype on the way
        state = _state(engine.url)
        assert state["received"] == [1] and state["checksums"] == trainer.checksums(torch.bfloat16)

        assert {r.version for r in engine.generate(PROMPTS, PARAMS)} == {1}

        die.touch()  # the next transfer kills the server after its first bucket
        started = time.monotonic()
        with pytest.raises(RolloutServerError) as error:
            engine.publish(trainer, "bf16")
        assert time.monotonic() - started < FAST["request_timeout_s"]
        message = str(error.value)
        assert message.startswith(f"rollout server {engine.url} is down: weight version 2 over the collective "
                                  "transport: sending it failed:") and "\n" not in message, message  # fmt: skip
        assert f"check its log {out / 'vllm_server.log'}" in message
        assert "or set rollout.vllm.on_server_failure: restart" in message
        assert not (out / "weights").exists()
    finally:
        actor.shutdown()
