"""vLLM sleep mode for a colocated rollout engine (rollout/vllm_sleep.py), without vLLM and without a GPU:
the server engine against the stub server (tests/rollout_server_stub.py, which emulates sleep mode: it refuses
weight updates into sleeping weights and completions while asleep), the in-process engine against a fake
``vllm.LLM`` that records its calls. Sleep mode needs CUDA: without it both engines refuse in one line. Nothing
here runs vLLM's real sleep on a GPU (docs/gpu.md lists it under "to measure on a device")."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.testing import STUB_SERVER
from shardforge.rollout.types import SamplingParams
from shardforge.rollout.vllm import sleep as vllm_sleep
from shardforge.rollout.vllm.engine import VLLMRolloutEngine
from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

STUB = STUB_SERVER
TOKENIZER = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
PARAMS = SamplingParams(n=2, max_new_tokens=3, seed=7)
PROMPTS = [[5, 6, 7], [8, 9]]
FAST = {"health_timeout_s": 2.0, "request_timeout_s": 5.0, "server_startup_timeout_s": 30.0}
# A switch into a sleeping engine: weights first, then the version, then the KV cache and a clean prefix cache.
WAKE = ["/wake_up?tags=weights", "/start_weight_update", "/update_weights", "/finish_weight_update",
        "/reset_prefix_cache", "/wake_up?tags=kv_cache", "/reset_prefix_cache"]  # fmt: skip


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


class StubEngine(VLLMServerRolloutEngine):
    """Starts the stub, with the sleep-mode flag of the real command when it has it."""

    def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        real = super()._server_command(model_dir, tokenizer, dtype, seed, port)
        return [sys.executable, str(STUB), "--port", str(port), *[f for f in real if f == "--enable-sleep-mode"]]


def _calls(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/stub/state", timeout=5) as reply:
        return json.loads(reply.read())["calls"]  # type: ignore[no-any-return]


def test_server_sleeps_after_generating_and_wakes_into_the_next_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_sleep, "sleep_mode_available", lambda: True)  # the stub needs no GPU
    options = VLLMOptions(mode="server", enable_sleep_mode=True, **FAST)
    engine = StubEngine(tmp_path, TOKENIZER, weights_root=tmp_path / "w", options=options, log_file=tmp_path / "log")
    try:
        engine.update_weights(1)
        first = engine.generate(PROMPTS, PARAMS)
        done = len(_calls(engine.url))
        # With several ranks sharing the server, rank 0 sleeps it only after every rank finished its round.
        barriers: list[int] = []
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: barriers.append(len(_calls(engine.url))))
        engine.sleep()
        assert barriers == [done], "rank 0 posted /sleep before the ranks' barrier"
        monkeypatch.undo()
        engine.sleep()  # idempotent: one /sleep
        with pytest.raises(RuntimeError, match=r"vLLM rollout engine sleeps .* version 1 .* publish before generating"):
            engine.generate(PROMPTS, PARAMS)
        assert engine.update_weights(2) == 2
        assert _calls(engine.url)[done:] == ["/sleep?level=2", *WAKE]
        second = engine.generate(PROMPTS, PARAMS)
        assert [r.version for r in second] == [2] * 4 and second != first
    finally:
        engine.shutdown(grace_s=5.0)


def test_server_without_sleep_mode_has_no_flag_and_refuses_sleep(tmp_path: Path) -> None:
    engine = StubEngine(tmp_path, TOKENIZER, weights_root=tmp_path / "w", options=VLLMOptions(mode="server", **FAST))
    try:
        assert engine.command is not None and "--enable-sleep-mode" not in engine.command
        with pytest.raises(RuntimeError, match=r"started without sleep mode: set rollout.vllm.enable_sleep_mode=true"):
            engine.sleep()
        engine.update_weights(1)
        assert _calls(engine.url)[-4:] == WAKE[1:5]
        assert not any("wake_up" in c or "sleep" in c for c in _calls(engine.url))
    finally:
        engine.shutdown(grace_s=5.0)


class FakeLLM:
    """What the in-process engine calls on ``vllm.LLM`` (sleep mode) and on its weight-transfer client
    (`shardforge.weight_sync.vllm.LLMClient`, whose finish also resets the prefix cache), recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("start_weight_update")

    def update_weights(self, info: dict[str, Any]) -> None:
        self.calls.append(f"update_weights {info['version']}")

    def finish_weight_update(self, version: str | None) -> None:
        self.calls.append("finish_weight_update")
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up {tags}")


def _in_process(llm: FakeLLM | None, tmp_path: Path) -> VLLMRolloutEngine:
    """The in-process engine on ``llm`` (None: a rank of placement=rank0 without an instance), built without vLLM."""
    from shardforge.weight_sync import DiskWeightSource

    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.options, engine.tokenizer, engine.eos_id = VLLMOptions(enable_sleep_mode=True), TOKENIZER, 2
    engine.source, engine._version, engine.llm = DiskWeightSource(tmp_path), 0, llm
    engine.client = llm  # the LLMClient stand-in
    engine.sleeper = vllm_sleep.VLLMSleep(llm)
    return engine


def test_in_process_engine_sleeps_and_wakes_in_verls_order(tmp_path: Path) -> None:
    llm = FakeLLM()
    engine = _in_process(llm, tmp_path)
    engine.update_weights(1)
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"vLLM rollout engine sleeps .* version 1"):
        engine._run([([[5, 6]], PARAMS)])
    engine.update_weights(2)
    assert llm.calls == [
        "start_weight_update", "update_weights 1", "finish_weight_update", "reset_prefix_cache",  # awake: as before
        "sleep 2",
        "wake_up ['weights']", "start_weight_update", "update_weights 2", "finish_weight_update", "reset_prefix_cache",
        "wake_up ['kv_cache']", "reset_prefix_cache",
    ]  # fmt: skip
    # A rank without an instance (placement=rank0) only follows the state, which every rank changes together.
    other = _in_process(None, tmp_path)
    other.sleep()
    assert other.sleeper is not None and other.sleeper.asleep
    other.update_weights(1)
    assert not other.sleeper.asleep


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_sleep_mode_without_cuda_is_refused_in_one_line(tmp_path: Path) -> None:
    for build in (
        lambda: VLLMRolloutEngine(tmp_path, TOKENIZER, options=VLLMOptions(enable_sleep_mode=True)),
        lambda: VLLMServerRolloutEngine(
            tmp_path, TOKENIZER, options=VLLMOptions(mode="server", enable_sleep_mode=True)
        ),
    ):
        with pytest.raises(
            ValueError, match=r"^rollout.vllm.enable_sleep_mode needs CUDA: vLLM's sleep mode frees GPU memory"
        ) as info:
            build()
        assert "\n" not in str(info.value)
