"""The vLLM rollout engine in server mode: an OpenAI-compatible ``vllm serve`` process over HTTP.

The trainer talks to the server with the standard library only (``urllib``): the server can
run from another interpreter or venv (``VLLMOptions.server_python``), or already be running
(``VLLMOptions.server_url``), so the trainer's environment does not need vLLM.

- Sampling: one ``/v1/completions`` request per prompt (token-id prompt, ``n`` samples,
  ``logprobs=0``, ``return_token_ids``), sent concurrently so vLLM batches them. The server is
  started with ``--logprobs-mode processed_logprobs`` and ``--generation-config vllm``, so the
  log-probs are those of ``softmax(logits / T)``, as in the in-process engine, and requests
  get the same per-prompt seeds (same seed and weights -> the same samples in both modes).
- Weights: the server runs with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL routes) and
  ``--weight-transfer-config '{"backend": "shardforge"}'``. ``rollout.vllm.weight_transport: disk``:
  `update_weights` calls ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``
  (disk versions of weight-sync, verified before loading) and ``/reset_prefix_cache``; with
  ``rollout.vllm.enable_sleep_mode`` (``rollout.sleep``) `sleep` posts ``/sleep`` and the switch wakes it
  (`rollout.vllm_sleep`). ``collective``: the trainer calls `publish`, which sends each version from
  the trainer's shards to the server's workers over weight-sync's collective transport
  (`shardforge.rollout.vllm.server_collective`; no disk).
- Health: requests time out, ``/health`` is checked before every `generate` and after a failed
  request; a server that is down raises a one-line error or (``rollout.vllm.on_server_failure: restart``,
  a server this trainer started) is restarted at the current weight version and the batch is
  resent (`shardforge.rollout.server.health`; ``rollout_server/*`` metrics). With several
  ranks the ranks agree on the restart at the end of each generation round and the failing ranks
  regenerate their round (`shardforge.rollout.server.shared_restart`). A server that fails its
  weight switch is stopped, so the next generation restarts it at the new version.
- Ranks: global rank 0 starts the server and shares its URL; every rank sends its own
  requests. `update_weights` and `publish` are collective: rank 0 switches the server, and no
  rank returns (so none samples from the previous version) before it has. Asynchronous rollouts on
  several ranks (``per_call_versions``, disk versions): `update_weights` only records the version this
  rank's next calls need, and each `generate` runs through the ranks' `SharedVersionGate`, which
  switches the server (from whichever rank) only while no rank's call is in flight.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardforge.core.log import get_logger
from shardforge.mesh import free_port as _free_port
from shardforge.rollout.chunked import ChunkedGeneration, chunked_requests
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.seeds import prompt_seeds
from shardforge.rollout.server.health import (
    REQUEST_FAILURES,
    HealthCounters,
    RolloutServerError,
    describe_failure,
    down_message,
    probe_health,
)
from shardforge.rollout.server.http import get_json as _get
from shardforge.rollout.server.http import local_address_towards
from shardforge.rollout.server.http import post_json as _post
from shardforge.rollout.server.shared_restart import SharedServerRestarts
from shardforge.rollout.server.version_gate import SharedVersionGate, check_per_call_versions
from shardforge.rollout.types import Rollout, SamplingParams
from shardforge.rollout.vllm.engine import require_main_thread
from shardforge.rollout.vllm.server_collective import (
    CollectivePublishing,
    CollectiveSender,
    WeightPublishingEngine,
)
from shardforge.rollout.vllm.server_process import SERVED_NAME, VLLMServerProcess
from shardforge.rollout.vllm.sleep import ServerSleepCalls, VLLMSleep, require_sleep_mode
from shardforge.weight_sync import DiskWeightSource, WeightVersionError

__all__ = ["VLLMServerRolloutEngine"]

log = get_logger(__name__)


class VLLMServerRolloutEngine(CollectivePublishing, VLLMServerProcess):
    """`RolloutEngine` on an OpenAI-compatible vLLM server; weights follow a weight-sync disk root, or arrive
    through `publish` (``rollout.vllm.weight_transport: collective``; ``weights_root`` is then not used).

    Arguments as for `VLLMRolloutEngine`; ``options.server_url`` connects to a running server
    (started with the flags above), else rank 0 starts one with ``options.server_python``
    (default: this interpreter), logging to ``log_file`` (default: a file in the temp directory).
    ``per_call_versions``: asynchronous rollouts (generator threads drive the engine); with several ranks every
    call names its version and the ranks share the server's switches through a `SharedVersionGate`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: Any,
        *,
        weights_root: str | os.PathLike[str] | None = None,
        dtype: str = "float32",
        options: VLLMOptions | None = None,
        seed: int = 0,
        log_file: str | os.PathLike[str] | None = None,
        chunks: ChunkedGeneration | None = None,
        per_call_versions: bool = False,
    ) -> None:
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"rollout model directory {str(model_dir)!r} does not exist")
        self.options = options or VLLMOptions(mode="server")
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.publishes_directly = self.options.weight_transport == "collective"
        """The trainer sends each version with `publish` (`rollout.publish.DirectPublisher`), not through disk."""
        self.weights_root = None if self.publishes_directly else weights_root
        self.source = DiskWeightSource(self.weights_root) if self.weights_root is not None else None
        self._version = 0
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.sender: CollectiveSender | None = None
        """Rank 0, rollout.vllm.weight_transport=collective: its end of the collective transport into the server."""
        self.trainer: tuple[WeightPublishingEngine, str] | None = None
        """The trainer's engine and dtype of the last `publish` (a restarted server gets the version again)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.shared_restarts: SharedServerRestarts | None = None
        """Several ranks share the server, with on_server_failure=restart: they agree on restarts (`shared_restart`)."""
        if self.options.on_server_failure == "restart" and world > 1:
            restarts = self.options.max_server_restarts
            self.shared_restarts = SharedServerRestarts(self, rank=self.rank, world_size=world, max_restarts=restarts)
        self.requests_sent = 0
        """Completion requests sent so far (`shared_restart` counts the resent ones)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.command: list[str] | None = None
        """The command that started the server when this engine started it (None: given by URL)."""
        self.log_path: Path | None = None
        self.health = HealthCounters()
        self.chunks = chunks
        """Partial rollouts: ``chunks.chunk_tokens`` new tokens per request, ``chunks.between_chunks()`` after
        each (`rollout.chunked`); None: whole requests."""
        if self.options.enable_sleep_mode:
            require_sleep_mode()
        self.url: str  # set below, once the server answers (the sleep calls read it later)
        calls = ServerSleepCalls(lambda path: _post(self.url, path, {})) if self.rank == 0 else None
        self.sleeper = VLLMSleep(calls) if self.options.enable_sleep_mode else None
        """Sleep mode (rank 0 posts; every rank tracks the state: `sleep` and `update_weights` are collective)."""
        url = self.options.server_url
        if self.rank == 0:
            if url is None:
                port = _free_port()
                self.command = self._server_command(model_dir, tokenizer, dtype, seed, port)
                default_log = Path(tempfile.gettempdir()) / f"shardforge_vllm_server_{port}.log"
                self.log_path = Path(log_file) if log_file is not None else default_log
                url = self._launch()
                atexit.register(self.shutdown)
            self._wait_ready(url)
            self._init_weight_transfer(url)
        if dist.is_initialized():
            shared = [url]
            dist.broadcast_object_list(shared, src=0)
            url = shared[0]
        assert url is not None
        self.url = url.rstrip("/")
        self.max_model_len = int(_get(self.url, "/v1/models")["data"][0]["max_model_len"])
        self.gate: SharedVersionGate | None = None
        """Asynchronous rollouts on several ranks: every call runs under one version the ranks agree on."""
        if per_call_versions and world > 1:
            check_per_call_versions(self.options, self.publishes_directly, chunks)
            self.gate = SharedVersionGate.create(
                self._transfer_host(self.url), timeout_s=self.options.request_timeout_s
            )

    # ------------------------------------------------------------------ weight transfer set-up
    def _transfer_host(self, url: str) -> str:
        """Where the server's workers reach rank 0's collective transport."""
        return local_address_towards(url)

    def _init_weight_transfer(self, url: str) -> None:
        if self.publishes_directly:  # a (re)started server's workers join a new group at the next send
            if self.sender is not None:
                self.sender.reset()
            options = self.options
            host = self._transfer_host(url)
            self.sender = CollectiveSender(host, options.tensor_parallel_size, options.request_timeout_s)
        elif self.weights_root is not None:
            info = {"transport": "disk", "root": str(self.weights_root)}
            _post(url, "/init_weight_transfer_engine", {"init_info": info})

    # ------------------------------------------------------------------ health and restarts
    def check_health(self) -> None:
        """Raise `RolloutServerError` (or restart, see the module docstring) unless /health answers."""
        if self.shared_restarts is not None:  # an earlier request of this round failed: fail at once
            self.shared_restarts.raise_if_down()
        self.health.add("health_checks")
        reason = probe_health(self.url, self.options.health_timeout_s)
        if reason is not None:
            self._recover(reason)

    def _recover(self, reason: str) -> None:
        """The server failed (``reason``): restart it when allowed, else raise the one-line error. A server
        shared by several ranks is not restarted here: the ranks agree at the end of the round."""
        self.health.add("failures")
        if self.shared_restarts is not None:
            self.shared_restarts.server_down(reason)
        options = self.options
        restarts_left = options.max_server_restarts - self.health.total_restarts
        if options.on_server_failure != "restart" or self.command is None or restarts_left <= 0:
            left = restarts_left if options.on_server_failure == "restart" else None
            message = down_message(self.url, reason, launched=self.command is not None, log_path=self.log_path,
                                   restarts_left=left)  # fmt: skip
            raise RolloutServerError(message)
        log.warning(f"rollout server {self.url} is down ({reason}); restarting it ({restarts_left} left)")
        self.restart_server()
        self.health.add_restart()

    def restart_server(self) -> None:
        """Kill the server this engine started, start it again and switch it to the current weight version."""
        self.shutdown(grace_s=5.0)
        self._wait_ready(self._launch())
        self._init_weight_transfer(self.url)
        if self._version == 0:  # the model directory's weights: nothing to restore
            return
        if not self.publishes_directly:
            self._switch(self._version)  # serve the current policy, not the initial model
        elif self.shared_restarts is None:  # this rank alone gathers the weights (several: `restore_weights`)
            self.restore_weights()

    @property
    def restartable(self) -> bool:
        """Whether this engine started the server (only rank 0's did; a server given by URL is not restarted)."""
        return self.command is not None

    def down_error(self, reason: str) -> str:
        """The one-line error when the server is down and not restarted (given by URL, or restarts used up)."""
        return down_message(self.url, reason, launched=self.restartable, log_path=self.log_path, restarts_left=0)

    def pop_stats(self) -> dict[str, float]:
        """``rollout_server/health_checks|failures|restarts|resent_requests`` since the last call."""
        return self.health.pop()

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, version: int | None = None) -> int:
        """Switch the server to ``version`` (None = newest committed); collective over all ranks."""
        if self.publishes_directly:  # versions arrive through `publish` only
            if version is not None and version != self._version:
                raise RuntimeError(f"the vLLM server serves version {self._version}; version {version} was never "
                                   "published to it (rollout.vllm.weight_transport=collective)")  # fmt: skip
            return self._version
        if self.source is None:
            raise RuntimeError("this rollout engine has no weights_root to update from")
        target = self.source.latest() if version is None else version
        if target is None:
            raise WeightVersionError(f"no committed weight version under {self.source.root}")
        if self.gate is not None:  # the next calls switch the server when they need to (`SharedVersionGate`)
            self._version = target
            return target
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:  # one server for all ranks: its version switches are collective
            require_main_thread("a shared vLLM server switches versions for all ranks at once")
        if target != self._version and self.rank == 0:
            self._switch_or_stop(target)
        if world > 1:
            dist.barrier()  # nobody samples before rank 0 has switched the server
        if target != self._version and self.sleeper is not None:
            self.sleeper.asleep = False  # rank 0's switch woke the server (a stopped one restarts awake)
        self._version = target
        return self._version

    def _switch_or_stop(self, target: int) -> None:
        """Switch the server to ``target``; with on_server_failure=restart, a server this trainer started that
        fails to answer is stopped instead (no request may reach it at the old version): the next generation
        finds it down and restarts it at ``target``."""
        try:
            self._switch(target)
        except REQUEST_FAILURES as exc:
            if self.options.on_server_failure != "restart" or self.command is None:
                raise
            reason = describe_failure("the weight switch", exc, 600.0)
            log.warning(f"rollout server {self.url} failed to switch to weight version {target} ({reason}); stopped it")
            self._stop_server()

    def _stop_server(self) -> None:
        """Stop the server this engine started until the next restart (`_switch_or_stop`)."""
        self.shutdown(grace_s=5.0)

    def _switch(self, target: int) -> None:
        with self.sleeper.switching() if self.sleeper is not None else contextlib.nullcontext():
            _post(self.url, "/start_weight_update", {})
            _post(self.url, "/update_weights", {"update_info": {"version": target}})  # verified; stale refused
            _post(self.url, "/finish_weight_update", {"weight_version": str(target)})
            _post(self.url, "/reset_prefix_cache", {})  # cached KV blocks hold the old weights' keys/values

    def sleep(self) -> None:
        """Discard the server's weights and KV cache (level-2 sleep) until `update_weights` switches to a newer
        version; collective over all ranks, as `update_weights` (rank 0 posts)."""
        if self.sleeper is None:
            raise RuntimeError(
                "this vLLM server was started without sleep mode: set rollout.vllm.enable_sleep_mode=true"
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the other ranks' requests of the round are answered before the server drops its state
        self.sleeper.sleep()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """``len(prompts) * params.n`` rollouts, prompt by prompt (each prompt's samples together). Partial
        rollouts (``chunks`` given): each chunk is a completion request that continues from the
        returned token ids, `between_chunks` after each (`rollout.chunked`)."""
        if self.sleeper is not None:
            self.sleeper.check_awake(self._version)
        if self.chunks is not None:
            if dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(
                    "partial rollouts on a shared vLLM server need a trainer world size of 1 (one rank's weight "
                    "switch between its chunks would change the weights under the other ranks' requests); use "
                    "rollout.vllm.mode=in_process with rollout.vllm.placement=each_rank"
                )
            decode = partial(self.tokenizer.decode, skip_special_tokens=True)
            chunks = self.chunks
            return chunked_requests(self._generate, prompts, params, chunks.chunk_tokens, chunks.between_chunks, decode)
        if self.gate is not None:  # several ranks' asynchronous calls: one version per call, switched between calls
            with self.gate.serve(self._version, self._switch) as serving:
                return self._generate(prompts, params, serving)
        return self._generate(prompts, params)

    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, version: int | None = None
    ) -> list[Rollout]:
        """One completion request per prompt; the rollouts carry ``version`` (None: the served one)."""
        version = self._version if version is None else version
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        seeds = prompt_seeds(params, len(prompts))
        bodies = []
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) + params.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} > "
                    f"vLLM's max_model_len={self.max_model_len}; shorten prompts or raise rollout.vllm.max_model_len"
                )
            bodies.append(
                {
                    "model": SERVED_NAME, "prompt": list(prompt), "n": params.n,
                    "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "top_k": params.top_k, "logprobs": 0, "return_token_ids": True,
                    "stop_token_ids": [self.eos_id] if self.eos_id is not None else [],
                    "skip_special_tokens": False,
                    "seed": None if seeds is None else seeds[i],
                }
            )  # fmt: skip
        replies = self._complete_all(bodies)
        rollouts = []
        for prompt_index, (prompt, reply) in enumerate(zip(prompts, replies)):
            for choice in sorted(reply["choices"], key=lambda c: c["index"]):
                tokens = [int(t) for t in choice["token_ids"]]
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                if len(logprobs) != len(tokens):
                    raise RuntimeError(f"the vLLM server returned {len(logprobs)} log-probs for {len(tokens)} tokens")
                rollouts.append(
                    Rollout(
                        prompt_index=prompt_index,
                        prompt_ids=list(prompt),
                        response_ids=tokens,
                        logprobs=logprobs,
                        finished=choice["finish_reason"] == "stop",
                        version=version,
                        text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    )
                )
        return rollouts

    def _complete_all(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every body's ``/v1/completions`` reply; on a server failure the whole batch is sent again
        after a restart (whole groups, same seeds), or `RolloutServerError` is raised."""
        timeout = self.options.request_timeout_s
        while True:
            self.check_health()  # before use: a dead server fails in health_timeout_s, not request_timeout_s
            self.requests_sent += len(bodies)
            try:
                with ThreadPoolExecutor(max_workers=min(32, len(bodies))) as pool:
                    return list(pool.map(lambda body: _post(self.url, "/v1/completions", body, timeout), bodies))
            except REQUEST_FAILURES as exc:
                failed = describe_failure("/v1/completions", exc, timeout)
                health = probe_health(self.url, self.options.health_timeout_s)
                self._recover(failed if health is None else f"{failed}, then {health}")
                self.health.add("resent_requests", len(bodies))
