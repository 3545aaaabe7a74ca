"""Driving `STUB_SERVER` from a test: start it and wait until it answers, read its ``/stub/state``, and the tokens
it samples for a request (its formula, so a test can check which weight version served a response)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from typing import Any

__all__ = ["start_stub", "stub_state", "stub_tokens"]


def stub_state(url: str) -> dict[str, Any]:
    """The stub's ``GET /stub/state`` (its weight version, counters such as ``switched_under_requests``)."""
    with urllib.request.urlopen(url + "/stub/state", timeout=5) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def start_stub(*flags: str, timeout_s: float = 15.0) -> tuple[subprocess.Popen[bytes], str]:
    """``python STUB_SERVER --port <free> *flags``, once it answers: the process and its URL (kill it when done)."""
    from shardforge.mesh import free_port
    from shardforge.rollout.testing import STUB_SERVER

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(STUB_SERVER), "--port", str(port), *flags], stdout=subprocess.DEVNULL
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while True:
        try:
            stub_state(url)
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the stub server did not answer on {url} (exit code {server.poll()})") from None
            time.sleep(0.05)


def stub_tokens(prompt: list[int], seed: int, version: int, choice: int, max_tokens: int, vocab: int) -> list[int]:
    """What the stub samples for choice ``choice`` of a request under weight version ``version`` (the choices draw
    one after another from one generator seeded by prompt, seed and version: `stub_server.completion`)."""
    rng = random.Random(f"{prompt}|{seed}|{version}")
    draws = [[rng.randrange(3, vocab) for _ in range(max_tokens)] for _ in range(choice + 1)]
    return draws[choice]
