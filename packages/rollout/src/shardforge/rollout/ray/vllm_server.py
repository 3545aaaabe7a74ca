"""A vLLM server as the rollout actor under Ray: ``rollout.placement: disaggregated`` + ``rollout.engine: vllm``.

- `VLLMServerActor` (started by `shardforge.algorithms.launch.ray` in a placement-group bundle of its own, which
  holds its GPUs when the cluster has them) runs ``vllm serve`` as a child process: the command, environment,
  start-up wait and stop are `VLLMServerRolloutEngine`'s own (`server_process`), with the server listening on
  the actor's node IP so ranks on other nodes reach it. It answers its URL once the server is healthy, restarts
  the server on request (stop, start again on the same port, wait for health) and stops it when the run ends.
- `RayVLLMServerEngine` is the trainer ranks' `RolloutEngine`: a `VLLMServerRolloutEngine` on the actor's URL
  (as with ``rollout.vllm.server_url``), so requests, health checks, timeouts and weight versions are the server path's.
  Weights (``rollout.vllm.weight_transport``): ``auto`` (default) and ``collective`` send each version from the trainer's
  shards over weight-sync's collective transport, rank 0's TCP store on its node IP, to the server's workers
  (`shardforge.rollout.vllm.server_collective`; no shared filesystem); ``disk``: weight-sync disk
  versions under ``output_dir/weights`` that rank 0 tells the server to load (on several Ray nodes ``output_dir``
  must be on storage that rank 0's and the server's nodes share). ``rollout.vllm.on_server_failure: restart``: the actor
  restarts the server when trainer rank 0 asks it (``restart_server`` -> `RayVLLMServerEngine._launch`), then the
  current version is restored, as for a server rank 0 started (collective: gathered and sent again). At world size
  1 the rank resends its batch; with several ranks they agree on the restart once per generation round
  (`shardforge.rollout.server.shared_restart`: only rank 0 asks the actor, once per agreed restart) and the
  failing ranks regenerate their round. A weight switch that fails has the actor stop the server
  (`VLLMServerActor.stop_server`), so the next generation restarts it at the new version.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

from shardforge.core.log import get_logger
from shardforge.mesh import free_port
from shardforge.rollout.config import VLLMOptions
from shardforge.rollout.server.health import RolloutServerError, ray_get
from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

__all__ = ["RayVLLMServerEngine", "VLLMServerActor", "server_process"]

log = get_logger(__name__)

# The server's access log: one line per answered request (uvicorn's, on in `vllm serve` by default).
_ANSWERED = re.compile(r'"POST (/update_weights|/v1/completions) HTTP/[\d.]+" 200')


def server_process(cls: type[VLLMServerRolloutEngine], options: VLLMOptions, log_path: Path) -> VLLMServerRolloutEngine:
    """A ``cls`` with only its server-process half set up (``options``, ``command``, ``log_path``, ``process``): its
    ``_server_command``, ``_launch``, ``_wait_ready`` and ``shutdown`` start and stop ``vllm serve`` exactly as
    rank 0 of a colocated run does, without the HTTP client half (no tokenizer, no rank, no URL yet)."""
    holder = cls.__new__(cls)
    holder.options, holder.command, holder.log_path, holder.process = options, None, log_path, None
    return holder


class VLLMServerActor:
    """One ``vllm serve`` for every trainer rank, as a Ray actor (the launcher wraps the class with ``ray.remote``).

    ``server_class``: whose ``_server_command`` builds the command (tests substitute a stub server there)."""

    server_class: ClassVar[type[VLLMServerRolloutEngine]] = VLLMServerRolloutEngine
    max_concurrency: ClassVar[int] = 4
    """Calls served at once (threads): the driver's `shutdown` must not queue behind a `url` that waits for a
    server still starting when the run fails early (a killed actor would leave its ``vllm serve`` running)."""

    def __init__(self, spec: Any, index: int, host: str | None = None) -> None:
        """Start the server (not waiting for it: the ranks start meanwhile; `url` waits). ``host``: the address to
        listen on (None: this node's IP as Ray sees it)."""
        if host is None:
            import ray

            host = str(ray.util.get_node_ip_address())
        self.index = index
        options: VLLMOptions = spec.vllm
        out = Path(spec.output_dir) if spec.output_dir else Path(tempfile.gettempdir())
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.server = server_process(self.server_class, options, out / "vllm_server.log")
        command = self.server._server_command(  # the colocated server's command
spec.model, SimpleNamespace(name_or_path=spec.tokenizer), spec.dtype,
                                              spec.seed, port)  # fmt: skip
        if "--host" in command:  # ranks on other nodes reach it (the colocated server listens on loopback)
            command[command.index("--host") + 1] = host
        self.server.command = command
        self._url = f"http://{host}:{port}"
        self.ready = False
        self.restarts = 0
        self.server._launch()

    def url(self) -> str:
        """The server's URL, once ``/health`` answers (`RuntimeError` with the log's tail when the server exited,
        `TimeoutError` after ``rollout.vllm.server_startup_timeout_s``)."""
        if not self.ready:
            self.server._wait_ready(self._url)
            self.ready = True
            log.info("vLLM server actor %d: %s serves (log: %s)", self.index, self._url, self.server.log_path)
        return self._url

    def server_info(self) -> tuple[list[str], str]:
        """(the command that starts the server, its log file on the actor's node)."""
        assert self.server.command is not None  # set when the actor launched it
        return list(self.server.command), str(self.server.log_path)

    def restart(self) -> str:
        """Stop the server (SIGTERM, SIGKILL after 5 s: also a hung one), start the same command on the same port
        (its log appended) and return the URL once it is healthy; it serves the model directory's weights again."""
        log.warning("vLLM server actor %d: restarting %s", self.index, self._url)
        self.server.shutdown(grace_s=5.0)
        self.ready = False
        self.server._launch()
        self.restarts += 1
        return self.url()

    def stop_server(self) -> None:
        """Stop the server until the next `restart` (trainer rank 0's weight switch failed: no request may reach it
        at the old version; the ranks' next generation finds it down and restarts it at the new version)."""
        log.warning("vLLM server actor %d: stopping %s (its weight switch failed)", self.index, self._url)
        process = self.server.process
        self.server.shutdown(grace_s=5.0)
        self.server.process = process  # exited: `url` fails at once until `restart` starts it again
        self.ready = False

    def shutdown(self) -> None:
        """Stop the server (the launcher calls this before it kills the actor: a killed actor would leave it)."""
        process = self.server.process
        self.server.shutdown(grace_s=30.0)
        self.server.process = process  # exited: a `url` still waiting for the server fails instead of polling on

    def stats(self) -> dict[str, Any]:
        """What the server did: its URL, restarts, the weight updates and completion requests it answered (its
        access log, over restarts) and the version it reports now (``/weight_info``; None when it does not answer)."""
        try:
            text = self.server.log_path.read_text(errors="replace") if self.server.log_path is not None else ""
        except OSError:
            text = ""
        answered = _ANSWERED.findall(text)
        return {
            "index": self.index,
            "engine": "vllm",
            "url": self._url,
            "restarts": self.restarts,
            "weight_updates": answered.count("/update_weights"),
            "completions": answered.count("/v1/completions"),
            "weight_version": _weight_version(self._url),
        }


def _weight_version(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url + "/weight_info", timeout=5) as reply:
            return str(json.loads(reply.read())["weight_version"])
    except (OSError, ValueError, KeyError):
        return None


class RayVLLMServerEngine(VLLMServerRolloutEngine):
    """A trainer rank's `VLLMServerRolloutEngine` on the `VLLMServerActor` named ``actor_name``; the other
    arguments are the engine's. Restarts (``rollout.vllm.on_server_failure: restart``) go through the actor."""

    def __init__(self, actor_name: str, model_dir: Any, tokenizer: Any, *, options: VLLMOptions, **kwargs: Any) -> None:
        import ray

        self.ray = ray
        self.actor_name = actor_name
        self.actor = ray.get_actor(actor_name)
        url = self._call(self.actor.url.remote())  # waits for the server's first /health
        if options.weight_transport == "auto":  # no shared filesystem needed with the server's node
            options = dataclasses.replace(options, weight_transport="collective")
        if kwargs.get("weights_root") is not None:  # the server resolves the root in its own working directory
            kwargs["weights_root"] = Path(kwargs["weights_root"]).resolve()
        super().__init__(model_dir, tokenizer, options=dataclasses.replace(options, server_url=url), **kwargs)
        # The server is restartable (through the actor) and its log is the actor's: the down message says where.
        command, log_path = self._call(self.actor.server_info.remote())
        self.command, self.log_path = command, Path(log_path)

    def _transfer_host(self, url: str) -> str:
        """This node's IP as Ray sees it: the server's workers may run on another node."""
        return str(self.ray.util.get_node_ip_address())

    def _call(self, ref: Any) -> Any:
        """``ray.get(ref)``; a dead actor or a failed call (the server did not start) becomes an error naming it."""
        return ray_get(self.ray, ref, f"vLLM server actor {self.actor_name}", RolloutServerError)

    def _launch(self) -> str:
        """A restart (`restart_server`: its ``shutdown`` is a no-op here, this rank started no process): the actor
        stops its server and starts it again; `restart_server` then restores the weights."""
        url: str = self._call(self.actor.restart.remote())
        return url

    def _stop_server(self) -> None:
        """Rank 0's weight switch failed: the actor stops its server (the next generation restarts it)."""
        self._call(self.actor.stop_server.remote())
