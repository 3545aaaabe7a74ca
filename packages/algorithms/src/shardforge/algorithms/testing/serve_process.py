"""`shardforge serve` in a process of its own (and, with ``nproc`` > 1, its ranks under torchrun's agent), for
tests and benchmarks that drive it with the tinker SDK over 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ServeProcess"]


class ServeProcess:
    """Start ``shardforge serve --model model`` on a free port and wait until it answers ``/healthz``.

    Args:
        model: the HF model directory.
        keys: API key -> tenant.
        out: ``--output-dir``.
        nproc: ``--nproc-per-node``.
        extra: more command-line flags.
        log: where the service's stdout and stderr go (None: discarded).
        timeout_s: how long to wait for it to answer.
        launcher: the command before ``serve ...`` (None: ``python -m shardforge.algorithms.cli``).
        env: variables added to the service's environment (e.g. `testing.fault_injection.fault_env`).
    """

    def __init__(
        self,
        model: str,
        keys: Mapping[str, str],
        out: Path,
        *,
        nproc: int = 1,
        extra: Sequence[str] = (),
        log: Path | None = None,
        timeout_s: float = 180.0,
        launcher: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        import httpx

        from shardforge.mesh import free_port

        self.port = free_port()
        launcher = launcher or [sys.executable, "-m", "shardforge.algorithms.cli"]
        command = [*launcher, "serve", "--model", model, "--port",
                   str(self.port), "--name", "tiny", "--output-dir", str(out), "--nproc-per-node", str(nproc),
                   *extra]  # fmt: skip
        for key, tenant in keys.items():
            command += ["--api-key", f"{tenant}={key}"]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TINKER_TELEMETRY="0") | dict(
            env or {}
        )
        self.log = log
        sink = subprocess.DEVNULL if log is None else open(log, "wb")  # closed in stop
        self.proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        self._sink = sink
        self.url, deadline = f"http://127.0.0.1:{self.port}", time.monotonic() + timeout_s
        while True:
            try:
                httpx.get(f"{self.url}/api/v1/healthz", timeout=2).raise_for_status()
                return
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"shardforge serve did not start (exit code {self.proc.poll()}):\n{self.output()}"
                    ) from None
                time.sleep(0.3)

    def ranks(self) -> list[int]:
        """The live processes the launcher started (its ranks, each in a session of its own; none with one rank)."""
        from shardforge.algorithms.testing.processes import descendants

        return descendants(self.proc.pid)

    def output(self) -> str:
        """What the service wrote so far (empty without ``log``)."""
        return self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the launcher forwards it to every rank); the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._sink is not subprocess.DEVNULL:
            self._sink.close()  # type: ignore[union-attr]
        return self.proc.returncode
