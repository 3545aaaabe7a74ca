"""`shardforge serve`'s parts that need no SDK: API keys, config limits, the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardforge.algorithms.cli.main import main
from shardforge.algorithms.serve.config import ServeConfig
from shardforge.algorithms.serve.tenants import TenantKeys, generate_key


def test_keys_name_tenants_and_must_start_with_tml(tmp_path: Path) -> None:
    file = tmp_path / "keys.json"
    file.write_text(json.dumps({"bob": "tml-bob-0123456789"}))
    keys = TenantKeys.parse(["alice=tml-alice-0123456789"], file)
    assert keys.tenant("tml-alice-0123456789") == "alice" and keys.tenant("tml-bob-0123456789") == "bob"
    assert keys.tenant("tml-nobody-01234567") is None and keys.tenant(None) is None
    assert keys.tenants == ["alice", "bob"]
    assert generate_key().startswith("tml-")
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        TenantKeys({"sk-0123456789abcdef": "eve"})
    with pytest.raises(ValueError, match="TENANT=tml-"):
        TenantKeys.parse(["tml-no-tenant-0123"])
    with pytest.raises(ValueError, match="no API keys"):
        TenantKeys({})


def test_config_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        ServeConfig(model_dir="m", max_tokens=0)
    with pytest.raises(ValueError, match=r"batch_window_s=-0.1 must be >= 0 \(0: no waiting\)"):
        ServeConfig(model_dir="m", batch_window_s=-0.1)


def test_cli_refuses_a_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "missing")]) != 0
    assert "is not a directory" in capsys.readouterr().err


def test_cli_without_the_sdk_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tinker" else real(name, *a))
    assert main(["serve", "--model", str(tmp_path)]) != 0
    assert "pip install 'shardforge-algorithms[serve]'" in capsys.readouterr().err


def test_future_lanes_run_at_once_in_order_and_lane_less_jobs_alone() -> None:
    import threading
    import time

    from shardforge.algorithms.serve.futures import FutureQueue

    queue = FutureQueue(workers=2)
    log: list[str] = []
    other_started = threading.Event()

    def job(name: str, wait: threading.Event | None = None, started: threading.Event | None = None):
        def run() -> dict[str, str]:
            if started is not None:
                started.set()
            log.append(f"{name}+")
            if wait is not None:
                assert wait.wait(5), f"{name}: the other lane's job never ran alongside"
            time.sleep(0.05)
            log.append(f"{name}-")
            return {"name": name}

        return run

    try:
        # a1 waits for b1 to start: with one worker (or one lane for all) this would time out and fail a1
        a1 = queue.submit("t", "X", job("a1", wait=other_started), lane="a")
        a2 = queue.submit("t", "X", job("a2"), lane="a")  # same lane: after a1 even with a worker free
        b1 = queue.submit("t", "X", job("b1", started=other_started), lane="b")
        sample = queue.submit("t", "Sample", job("s"))  # no lane: alone, after everything queued before it
        b2 = queue.submit("t", "X", job("b2"), lane="b")  # queued after the lane-less job: runs after it
        results = [queue.get("t", rid, 10) for rid in (a1, a2, b1, sample, b2)]
    finally:
        queue.close()
    assert all(r is not None and r.error is None for r in results), [r and r.error for r in results]
    assert log.index("a1-") < log.index("a2+")
    assert log.index("b1+") < log.index("a1-")  # b1 ran while a1 ran
    assert log.index("s+") > max(log.index(x) for x in ("a1-", "a2-", "b1-"))
    assert log.index("s-") + 1 == log.index("b2+")  # nothing ran beside the lane-less job


def test_a_done_callback_runs_once_when_the_job_ends_or_at_once_if_it_has() -> None:
    """What `retrieve_future` waits on (no thread blocks): a callback added while the job runs runs once, right
    after the result is set; one added after it ended runs at once; another tenant's id reads as unknown."""
    import threading

    from shardforge.algorithms.serve.futures import FutureQueue

    queue = FutureQueue(workers=1)
    release = threading.Event()
    try:
        request_id = queue.submit("alice", "Job", lambda: {"ok": release.wait(5)}, lane="m")
        result = queue.lookup("alice", request_id)
        seen: list[object] = []
        called = threading.Event()
        result.add_done_callback(lambda: (seen.append(result.json), called.set()))
        assert not called.wait(0.1) and seen == []  # still running
        release.set()
        assert called.wait(5) and seen == [{"ok": True}]  # the result is set before the callback runs
        late: list[bool] = []
        result.add_done_callback(lambda: late.append(True))
        assert late == [True] and seen == [{"ok": True}]  # at once; the first one did not run again
        with pytest.raises(KeyError):
            queue.lookup("bob", request_id)
    finally:
        release.set()
        queue.close()


def test_retrieve_future_answers_try_again_after_the_poll_wait_then_the_result() -> None:
    """`retrieve_future` on the event loop: a pending job is answered ``try_again`` after ``poll_wait_s``, and
    once the job is done, with its result; an unknown id (or another tenant's) is a 404."""
    import threading
    from types import SimpleNamespace

    pytest.importorskip("tinker")
    from fastapi.testclient import TestClient

    from shardforge.algorithms.serve.app import build_app
    from shardforge.algorithms.serve.futures import FutureQueue

    key = generate_key()
    queue = FutureQueue(workers=1)
    config = SimpleNamespace(max_request_bytes=1 << 20, poll_wait_s=0.2)
    service = SimpleNamespace(keys=TenantKeys({key: "alice"}), futures=queue, config=config)
    release = threading.Event()
    try:
        request_id = queue.submit("alice", "Job", lambda: {"type": "done", "ok": release.wait(5)}, lane="m")
        with TestClient(build_app(service)) as http:  # type: ignore[arg-type]
            headers = {"X-API-Key": key}
            pending = http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
            assert pending.status_code == 200 and pending.json()["type"] == "try_again"
            threading.Timer(0.05, release.set).start()
            answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
            assert answer.json() == {"type": "done", "ok": True}
            unknown = http.post("/api/v1/retrieve_future", json={"request_id": "req-999"}, headers=headers)
            assert unknown.status_code == 404
    finally:
        release.set()
        queue.close()
