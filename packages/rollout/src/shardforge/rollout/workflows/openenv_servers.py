"""Local OpenEnv environment servers for ``workflow.name: openenv``: ``workflow.openenv.app`` served by uvicorn in
subprocesses of this process (no container), each on a free port of 127.0.0.1, logged to a file; a server found dead
when an episode asks for it is started again (its episodes in flight have failed with it); all stop with the
workflow (`LocalServers.close`, or at exit)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shardforge.rollout.server.health import probe_health

__all__ = ["LocalServers", "uvicorn_command"]

logger = logging.getLogger(__name__)


def uvicorn_command(app: str, port: int) -> list[str]:
    """``python -m uvicorn`` serving ``app`` (``package.module:app`` or ``path/file.py:app``) on 127.0.0.1:``port``."""
    target, _, attr = app.rpartition(":")
    extra: list[str] = []
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"workflow.openenv.app={app!r}: no file {path}")
        extra, target = ["--app-dir", str(path.parent)], path.stem
    return [sys.executable, "-m", "uvicorn", f"{target}:{attr}", *extra, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]  # fmt: skip


class LocalServers:
    """``count`` uvicorn servers of ``app``; `url` starts (or restarts) the one asked for and waits for ``/health``."""

    def __init__(self, app: str, count: int, startup_timeout_s: float) -> None:
        self.app, self.startup_timeout_s = app, startup_timeout_s
        self.log_dir = Path(tempfile.mkdtemp(prefix="shardforge-openenv-"))
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * count
        self.urls: list[str] = [""] * count
        self.restarts = 0
        self._locks = [threading.Lock() for _ in range(count)]
        for i in range(count):  # all launched before any is waited for: they start in parallel
            self._launch(i)
        for i in range(count):
            self._wait_ready(i)
        atexit.register(self.close)

    def url(self, index: int) -> str:
        """Server ``index``'s base URL, restarted first when it has died (blocking: call it from a thread)."""
        with self._locks[index]:
            process = self.processes[index]
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                self.restarts += 1
                logger.warning("OpenEnv server %d (%s) exited with code %s; starting it again (log: %s)", index,
                               self.app, code, self._log(index))  # fmt: skip
                self._launch(index)
                self._wait_ready(index)
            return self.urls[index]

    def _log(self, index: int) -> Path:
        return self.log_dir / f"server-{index}.log"

    def _launch(self, index: int) -> None:
        from shardforge.mesh import free_port

        port = free_port("127.0.0.1")
        command = uvicorn_command(self.app, port)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}  # the app imports as here
        with self._log(index).open("ab") as log:
            self.processes[index] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.urls[index] = f"http://127.0.0.1:{port}"

    def _wait_ready(self, index: int) -> None:
        process, url = self.processes[index], self.urls[index]
        assert process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = self._log(index).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the OpenEnv server of workflow.openenv.app={self.app!r} exited with code "
                                   f"{process.returncode} before it answered /health; log tail:\n{tail}")  # fmt: skip
            if probe_health(url, timeout_s=2.0) is None:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the OpenEnv server of {self.app!r} at {url} did not answer /health within "
                           f"workflow.openenv.startup_timeout_s={self.startup_timeout_s} (log: {self._log(index)})")  # fmt: skip

    def kill(self, index: int) -> None:
        """Kill server ``index`` at once (what a crash does; the next `url` starts it again)."""
        process = self.processes[index]
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def close(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after 5 s)."""
        for i, process in enumerate(self.processes):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.kill(i)
            self.processes[i] = None
