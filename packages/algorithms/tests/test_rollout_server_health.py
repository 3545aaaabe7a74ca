"""Rollout-server health checks and restarts (`shardforge.rollout.server.health`).

`VLLMServerRolloutEngine` against a stub server process on 127.0.0.1 (tests/rollout_server_stub.py)
that the tests kill (SIGKILL), hang (SIGSTOP) or let die mid-request: the engine must not hang,
must fail in one line naming the server, and with ``on_server_failure: restart`` must restart a
server it started at the current weight version and return what a healthy server would have.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.server.health import RolloutServerError
from shardforge.rollout.testing import STUB_SERVER
from shardforge.rollout.types import SamplingParams
from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

STUB = STUB_SERVER
TOKENIZER = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
PARAMS = SamplingParams(n=3, max_new_tokens=4, seed=7)
PROMPTS = [[5, 6, 7], [8, 9], [10]]
FAST = {"health_timeout_s": 0.5, "request_timeout_s": 2.0, "server_startup_timeout_s": 30.0}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


class StubEngine(VLLMServerRolloutEngine):
    """Starts the stub instead of ``vllm serve`` (everything else is the real engine)."""

    die_once: Path | None = None

    def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        extra = [] if self.die_once is None else ["--die-once", str(self.die_once)]
        return [sys.executable, str(STUB), "--port", str(port), *extra]


def _free_port() -> int:
    from shardforge.rollout.vllm.server import _free_port as free

    return free()


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stub/state", timeout=5) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


@pytest.fixture
def external_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A stub server this test started (the engine gets only its URL)."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        yield process, url
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.wait()


def _engine_on(url: str, tmp_path: Path, **options: Any) -> VLLMServerRolloutEngine:
    vllm = VLLMOptions(mode="server", server_url=url, **(FAST | options))
    return VLLMServerRolloutEngine(tmp_path, TOKENIZER, weights_root=tmp_path / "w", options=vllm)


def _responses(rollouts: list[Any]) -> list[tuple[int, list[int]]]:
    return [(r.prompt_index, r.response_ids) for r in rollouts]


def test_a_killed_server_fails_fast_in_one_line_naming_it(external_server, tmp_path: Path) -> None:
    process, url = external_server
    engine = _engine_on(url, tmp_path)
    assert len(engine.generate(PROMPTS, PARAMS)) == 9
    process.kill()
    process.wait()
    with pytest.raises(RolloutServerError) as info:
        engine.generate(PROMPTS, PARAMS)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"rollout server {url} is down: /health: connection refused")
    assert "check that the server is running and reachable" in message and "rollout.vllm.server_url" in message
    assert engine.pop_stats() == {"rollout_server/health_checks": 2.0, "rollout_server/failures": 1.0,
                                  "rollout_server/restarts": 0.0, "rollout_server/resent_requests": 0.0}  # fmt: skip


def test_a_hung_server_times_out_instead_of_hanging(external_server, tmp_path: Path) -> None:
    process, url = external_server
    engine = _engine_on(url, tmp_path)
    os.kill(process.pid, signal.SIGSTOP)  # accepts connections (kernel backlog), never answers
    with pytest.raises(RolloutServerError, match=r"/health did not answer within 0\.5 s \(hung or overloaded\)"):
        engine.generate(PROMPTS, PARAMS)


def test_restart_needs_a_server_this_trainer_started(external_server, tmp_path: Path) -> None:
    process, url = external_server
    engine = _engine_on(url, tmp_path, on_server_failure="restart")
    process.kill()
    process.wait()
    with pytest.raises(RolloutServerError, match="only a server this trainer started can be restarted"):
        engine.generate(PROMPTS, PARAMS)


def test_a_server_dying_mid_request_is_restarted_at_the_current_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stub dies with the batch in flight; the engine restarts it, restores weight version 3
    and resends the batch: the rollouts equal those of a server that never died."""
    marker = tmp_path / "die"
    monkeypatch.setattr(StubEngine, "die_once", marker)
    options = VLLMOptions(mode="server", on_server_failure="restart", max_server_restarts=1, **FAST)
    engine = StubEngine(tmp_path, TOKENIZER, weights_root=tmp_path / "w", options=options, log_file=tmp_path / "log")
    try:
        engine.update_weights(3)
        expected = _responses(engine.generate(PROMPTS, PARAMS))
        first_pid = _state(engine.url)["pid"]
        engine.pop_stats()

        marker.touch()  # the server dies on the batch's first request
        assert _responses(engine.generate(PROMPTS, PARAMS)) == expected
        assert not marker.exists()
        state = _state(engine.url)
        assert state["pid"] != first_pid and state["version"] == 3
        assert engine.pop_stats() == {"rollout_server/health_checks": 2.0, "rollout_server/failures": 1.0,
                                      "rollout_server/restarts": 1.0, "rollout_server/resent_requests": 3.0}  # fmt: skip

        # max_server_restarts=1 is used up: the next death is the one-line error, with the log.
        assert engine.process is not None
        engine.process.kill()
        engine.process.wait()
        with pytest.raises(RolloutServerError) as info:
            engine.generate(PROMPTS, PARAMS)
        assert f"check its log {tmp_path / 'log'}" in str(info.value)
        assert "rollout.vllm.max_server_restarts is used up" in str(info.value)
    finally:
        engine.shutdown(grace_s=5.0)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it has stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_shutdown_also_stops_the_children_a_killed_server_left_running(tmp_path: Path) -> None:
    """`vllm serve` runs its engine core in a child process, which outlives a server killed with SIGKILL and holds its
    memory (GPU memory on a GPU, where the restarted server would then not fit): `shutdown`, also the one before a
    restart, stops the server's whole process group."""
    import time

    from shardforge.rollout.ray.vllm_server import server_process

    pid_file = tmp_path / "child"
    script = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)")  # fmt: skip
    server = server_process(VLLMServerRolloutEngine, VLLMOptions(mode="server"), tmp_path / "log")
    server.command = [sys.executable, "-c", script, "--port", "1"]
    server._launch()
    process = server.process
    assert process is not None
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        process.kill()  # the server dies; its child runs on
        process.wait()
        assert _running(child)
        server.shutdown(grace_s=1.0)
        deadline = time.monotonic() + 5
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the killed server's child still runs after shutdown"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"health_timeout_s": 0.0}, "health_timeout_s=0.0 and rollout.vllm.request_timeout_s=600.0 must be > 0"),
        ({"request_timeout_s": -1.0}, "request_timeout_s=-1.0 must be > 0"),
        ({"on_server_failure": "drop"}, r"on_server_failure='drop' is not one of \['error', 'restart'\]"),
        ({"max_server_restarts": -1}, "max_server_restarts=-1 must be >= 0"),
    ],
)
def test_health_options_are_validated(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VLLMOptions(**change)


# ------------------------------------------------------------------------------------------ trainer
@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("grpo_server")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=16, data_seed=2)
    return {"model": str(root / "model"), "train": tiny["train"], "vocab_size": len(tiny["tokenizer"])}


def _grpo(assets: dict[str, Any], out: Path, marker: Path, monkeypatch: pytest.MonkeyPatch, **vllm: Any) -> Any:
    """Three GRPO steps whose rollouts come from a stub server the trainer starts; the server dies
    with step 2's requests in flight (after step 1's 8: 4 prompts x group_size 2, one request each)."""
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    def stub_command(self: Any, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        return [
            sys.executable,
            str(STUB),
            "--port",
            str(port),
            "--die-once",
            str(marker),
            "--die-after",
            "8",
            "--vocab-size",
            str(assets["vocab_size"]),
        ]

    monkeypatch.setattr(VLLMServerRolloutEngine, "_server_command", stub_command)
    marker.touch()
    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "layout": "d1",
        "steps": 3, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4, "reward_fn": "zero",
        "progress": False, "save_every": 0, "export_hf_at_end": False, "rollout.engine": "vllm",
        "rollout.vllm": {"mode": "server", "server_python": sys.executable, **FAST, **vllm},
        "engine": {"max_tokens_per_microbatch": 64},
    }  # fmt: skip
    return run_grpo(build_config(GRPOConfig, data))


def test_grpo_continues_after_its_rollout_server_dies_mid_step(assets, tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "die"
    _grpo(assets, tmp_path / "out", marker, monkeypatch, on_server_failure="restart")
    assert not marker.exists(), "the server died once"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["rollout_server/restarts"] for r in train] == [0.0, 1.0, 0.0]
    assert [r["rollout_server/resent_requests"] for r in train] == [0.0, 8.0, 0.0]


def test_grpo_stops_with_one_line_when_its_rollout_server_dies(assets, tmp_path: Path, monkeypatch) -> None:
    # How the dying server's last request fails depends on timing (closed without a response, or reset).
    with pytest.raises(RolloutServerError, match=r"^rollout server http://127\.0\.0\.1:\d+ is down: /v1/completions"
                       r"(: connection reset| failed: RemoteDisconnected).*, then /health: connection (refused|reset)"
                       r".*; check its log"):  # fmt: skip
        _grpo(assets, tmp_path / "out", tmp_path / "die", monkeypatch)


def test_a_reset_connection_reads_as_an_exiting_server() -> None:
    import urllib.error

    from shardforge.rollout.server.health import describe_failure

    reset = urllib.error.URLError(ConnectionResetError(104, "Connection reset by peer"))
    assert describe_failure("/health", reset, 5.0) == "/health: connection reset (the server is exiting or dead)"
    assert describe_failure("/health", ConnectionRefusedError(), 5.0).startswith("/health: connection refused")
