"""The ``vllm serve`` process a rank-0 `VLLMServerRolloutEngine` (or the Ray `VLLMServerActor`) starts and stops.

`VLLMServerProcess` is the process half of the server engine: the command (our flags: the ``shardforge``
weight-transfer backend, processed log-probs, vLLM's generation config), the launch in a process group of its own
(so `shutdown` also stops the engine core and workers a killed server leaves behind), the wait for ``/health``, and
the stop. The Ray actor uses it alone (`rollout.ray_vllm_server.server_process`): no tokenizer, rank or URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from shardforge.mesh import parse_dtype
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.vllm.engine import _tokenizer_dir, _vllm_process_env

__all__ = ["SERVED_NAME", "VLLMServerProcess"]

SERVED_NAME = "policy"
"""The model name the server serves the policy under (``--served-model-name``; requests name it)."""


class VLLMServerProcess:
    """Start, wait for and stop ``vllm serve`` (``options``; ``command`` and ``log_path`` set before `_launch`)."""

    options: VLLMOptions
    command: list[str] | None
    """The command that started the server (None: given by URL, nothing to start)."""
    log_path: Path | None
    process: subprocess.Popen[bytes] | None

    def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        options = self.options
        command = [
            options.server_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--tokenizer", _tokenizer_dir(tokenizer, model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", str(parse_dtype(dtype)).removeprefix("torch."), "--seed", str(seed),
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--max-num-seqs", str(options.max_num_seqs),
            "--gpu-memory-utilization", str(options.gpu_memory_utilization),
            "--tensor-parallel-size", str(options.tensor_parallel_size),
            "--weight-transfer-config", json.dumps({"backend": "shardforge"}),
            "--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if options.enforce_eager:
            command.append("--enforce-eager")
        if options.enable_sleep_mode:
            command.append("--enable-sleep-mode")
        if options.max_model_len is not None:
            command += ["--max-model-len", str(options.max_model_len)]
        return command

    def _launch(self) -> str:
        """Start ``self.command`` (logging to ``self.log_path``, appended on restarts); its URL."""
        assert self.command is not None and self.log_path is not None
        with _vllm_process_env(self.options):
            env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # mounts the RL and cache routes
            with self.log_path.open("ab") as log:  # a process group of its own: `shutdown` stops its engine core too
                self.process = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)  # fmt: skip
        return f"http://127.0.0.1:{self.command[self.command.index('--port') + 1]}"

    def _wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.options.server_startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                assert self.log_path is not None
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the vLLM server exited with code {self.process.returncode}; log tail:\n{tail}")
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"the vLLM server at {url} was not ready after {self.options.server_startup_timeout_s} s "
            "(rollout.vllm.server_startup_timeout_s)"
        )

    def shutdown(self, grace_s: float = 60.0) -> None:
        """Stop the server this engine started (a server given by URL keeps running)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()  # also ends a stopped (SIGSTOP) or wedged server
                self.process.wait()
        if self.process is not None:  # a killed server leaves its engine-core process running (and its memory held)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)  # the server's own group (start_new_session)
        self.process = None
