"""`TinkerService`: the state behind the routes (tenants, sessions, models, sampler weights, the futures
queue) and the validation every request passes before it is queued."""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from pathlib import Path
from typing import Any

from shardforge.algorithms.serve.checkpoints import check_name, recover_interrupted_saves
from shardforge.algorithms.serve.codecs import FwdBwdRequest
from shardforge.algorithms.serve.config import ServeConfig
from shardforge.algorithms.serve.distributed import LocalOps, OpsFactory
from shardforge.algorithms.serve.expiry import check_ttl
from shardforge.algorithms.serve.futures import BatchGroup, FutureQueue, UserError
from shardforge.algorithms.serve.models import ModelRegistry, SamplerWeights, TrainingModel, lora_config_for
from shardforge.algorithms.serve.runs import check_user_metadata
from shardforge.algorithms.serve.tenants import TenantKeys

__all__ = ["TinkerService"]

log = logging.getLogger(__name__)


class TinkerService:
    """Everything `shardforge serve` holds, for one base model.

    Args:
        config: what to serve and the limits.
        keys: the API keys of the tenants.
        ops: builds how jobs touch the training models (None: `LocalOps`, in this process; rank 0 of a multi-rank
            service passes `serve.distributed.sharded_ops`).
    """

    def __init__(self, config: ServeConfig, keys: TenantKeys, ops: OpsFactory | None = None) -> None:
        from shardforge.algorithms.serve.batching import LoRABatcher
        from shardforge.algorithms.serve.expiry import ExpiryBook
        from shardforge.algorithms.serve.export import DownloadSigner
        from shardforge.algorithms.serve.metrics import ServeMetrics
        from shardforge.algorithms.serve.sampling import SamplerEngine
        from shardforge.algorithms.serve.step_logs import TenantStepLogs

        self.config = config
        self.keys = keys
        recover_interrupted_saves(Path(config.output_dir))  # what a crash of the previous service cut short
        name = config.base_model or Path(config.model_dir).resolve().name
        self.registry = ModelRegistry(config.model_dir, base_model=name, lora_alpha=config.lora_alpha)
        self.sampler = SamplerEngine(self.registry, max_tokens=config.max_tokens)
        self.metrics = ServeMetrics()
        # Sample jobs have no lane (they run alone: the sampler folds adapters into the shared base weights);
        # every other job runs in its training model's lane, concurrently with other models' jobs.
        self.futures = FutureQueue(workers=config.workers, on_done=self._job_done)
        # LoRA models' forward(_backward) jobs of different tenants that are queued at once run as one batch
        # over the shared base (`LoRABatcher`); forward-only and training batches apart.
        self._batcher = LoRABatcher(self.registry)
        self.ops = (ops or LocalOps)(self.registry, self._batcher)
        # On CPU each worker's batch runs on its own core, so the tenants are spread over the workers; an
        # accelerator gets one batch (one device, where a bigger batch is what saves time).
        spread = config.batch_spread
        if spread is None:
            spread = next(self.registry.base.parameters()).device.type == "cpu"
        self._groups = {
            forward_only: BatchGroup(
                name="Forward" if forward_only else "ForwardBackward",
                run_batch=self._run_batch,
                max_weight=config.max_batch_tokens,
                window_s=config.batch_window_s,
                spread=spread,
            )
            for forward_only in (False, True)
        }
        self.downloads = DownloadSigner(Path(config.output_dir))
        self.step_logs = TenantStepLogs(Path(config.output_dir), config.loggers) if config.loggers else None
        self._sessions: dict[str, str] = {}  # session id -> tenant
        self._lock = threading.Lock()
        self.expiry = ExpiryBook(Path(config.output_dir), self.delete_checkpoint)
        self._closed = threading.Event()
        threading.Thread(target=self._sweep_expired, name="serve-expiry", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self.futures.close()
        self.ops.close()
        if self.step_logs is not None:
            self.step_logs.close()

    def _sweep_expired(self) -> None:
        from shardforge.algorithms.serve.expiry import SWEEP_EVERY_S

        while True:
            try:
                self.expiry.sweep()
            except Exception:  # a full disk or a file removed by hand must not stop the sweeps
                log.exception("deleting expired checkpoints failed; retrying in %.0f s", SWEEP_EVERY_S)
            if self._closed.wait(SWEEP_EVERY_S):
                return

    def sweep_path(self, tenant: str, tinker_path: object) -> None:
        """Delete the expired checkpoints of the model a ``tinker://<model_id>/...`` path names, before it is read."""
        if isinstance(tinker_path, str) and tinker_path.startswith("tinker://"):
            model_id = tinker_path.removeprefix("tinker://").split("/", 1)[0]
            with contextlib.suppress(UserError):  # a malformed id: the read that follows says what is wrong
                self.expiry.sweep_model(tenant, model_id)

    def _expire(self, tenant: str, model_id: str, result: dict[str, Any], ttl_s: int | None) -> dict[str, Any]:
        """Record the TTL of the checkpoint a save job just wrote (None clears an overwritten one's)."""
        self.expiry.set(tenant, model_id, str(result["path"]).removeprefix(f"tinker://{model_id}/"), ttl_s)
        return result

    def _log_forward_backward(
        self, model: TrainingModel, request: FwdBwdRequest, output: bytes, started: float
    ) -> None:
        if self.step_logs is None or request.forward_only:
            return
        from tinker.proto import tinker_public_pb2 as pb

        loss = pb.ForwardBackwardOutput.FromString(output).metrics["loss:sum"]
        tokens = sum(len(datum.tokens) for datum in request.data)
        self.step_logs.forward_backward(model, tokens, len(request.data), loss, started)

    def _run_batch(self, items: list[tuple[TrainingModel, FwdBwdRequest]]) -> list[bytes | Exception]:
        started = time.perf_counter()
        outcomes = self.ops.run_batch(items)
        for (model, request), outcome in zip(items, outcomes, strict=True):
            if isinstance(outcome, bytes):
                self._log_forward_backward(model, request, outcome, started)
        return outcomes

    def _job_done(self, result: Any, waited_s: float, ran_s: float) -> None:
        outcome = "ok" if result.error is None else f"{result.category}_error"
        self.metrics.job_done(result.owner, result.kind, outcome, waited_s, ran_s, batch_size=result.batch_size)

    def render_metrics(self) -> bytes:
        """The ``/metrics`` body (Prometheus text format)."""
        return self.metrics.render(self.futures.depth, self.registry.clients_per_tenant)

    def capabilities(self) -> dict[str, Any]:
        model = {"model_name": self.registry.base_model, "trainable": True, "sampleable": True}
        return {"supported_models": [model | {"max_context_length": self.registry.max_context}]}

    def open_session(self, tenant: str) -> str:
        session_id = self.registry.new_id("session")
        with self._lock:
            self._sessions[session_id] = tenant
        return session_id

    def check_session(self, tenant: str, session_id: str) -> None:
        if self._sessions.get(session_id) != tenant:
            raise KeyError(f"session_id {session_id!r} is not a session of this API key; create_session first")

    def create_model(self, tenant: str, data: dict[str, Any]) -> str:
        self.check_session(tenant, str(data.get("session_id")))
        self.registry.check_base_model(data.get("base_model"))
        lora_json = data.get("lora_config")  # absent: full fine-tuning
        if lora_json is not None and not isinstance(lora_json, dict):
            raise UserError("lora_config must be an object {'rank': ...}, or absent for full fine-tuning")
        optimizer = (data.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer_config.type={optimizer!r} is not served; only 'adamw'")
        lora = None if lora_json is None else lora_config_for(lora_json, alpha=self.config.lora_alpha)
        self.ops.check_lora(lora)
        seed = None if lora_json is None else lora_json.get("seed")
        metadata = check_user_metadata(data.get("user_metadata"))
        model_id = self._model_id(data)

        def job() -> dict[str, Any]:
            model = self.ops.create_model(tenant, model_id, lora, None if seed is None else int(seed), metadata)
            return {"type": "create_model", "model_id": model.model_id}

        return self.futures.submit(tenant, "CreateModel", job, lane=model_id)

    @staticmethod
    def _model_id(data: dict[str, Any]) -> str:
        # The SDK derives a model's id from its session the same way (create-via-load expects it).
        seq = data.get("model_seq_id")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise UserError(f"model_seq_id={seq!r} must be an integer >= 0")
        return f"{data['session_id']}:train:{seq}"

    def info(self, tenant: str, model_id: str) -> dict[str, Any]:
        model = self.registry.model(tenant, model_id)
        arch = type(self.registry.base).__name__
        model_data = {"arch": arch, "model_name": model.base_model, "tokenizer_id": self.registry.model_dir}
        return {
            "type": "get_info", "model_id": model_id, "model_data": model_data, "is_lora": model.lora is not None,
            "lora_rank": None if model.lora is None else model.lora.r, "model_name": model.base_model,
        }  # fmt: skip

    def forward_backward(self, tenant: str, request: FwdBwdRequest) -> str:
        from shardforge.algorithms.serve.training import check_datums

        model = self.registry.model(tenant, request.model_id)
        check_datums(
            request.data, request.loss_fn, vocab_size=self.registry.vocab_size,
            max_context=self.registry.max_context, max_tokens=self.config.max_batch_tokens,
        )  # fmt: skip
        kind = "Forward" if request.forward_only else "ForwardBackward"
        tokens = sum(len(datum.tokens) for datum in request.data)
        self.metrics.tokens.labels(tenant, kind).inc(tokens)
        # a full fine-tuning model has weights of its own: nothing to share a batch over
        group = self._groups[request.forward_only] if model.lora is not None and self.config.batch_tenants else None

        def job() -> bytes:  # alone (a batch runs `_run_batch` instead)
            started = time.perf_counter()
            output = self.ops.forward_backward(model, request)
            self._log_forward_backward(model, request, output, started)
            return output

        return self.futures.submit(
            tenant, kind, job, lane=model.model_id, group=group, item=(model, request), weight=tokens
        )

    def optim_step(self, tenant: str, data: dict[str, Any]) -> str:
        from shardforge.algorithms.serve.training import check_adam

        model = self.registry.model(tenant, str(data.get("model_id")))
        adam = data.get("adam_params")
        if not isinstance(adam, dict):
            raise UserError("optim_step needs adam_params {'learning_rate': ..., ...}")
        check_adam(adam)

        def job() -> dict[str, Any]:
            started = time.perf_counter()
            result = self.ops.optim_step(model, adam)
            if self.step_logs is not None:
                self.step_logs.optim_step(model, adam, result, started)
            return result

        return self.futures.submit(tenant, "OptimStep", job, lane=model.model_id)

    def save_for_sampler(self, tenant: str, data: dict[str, Any]) -> str:
        model = self.registry.model(tenant, str(data.get("model_id")))
        name = data.get("path")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise UserError(f"path={name!r} must be a non-empty name without '/'")
        ttl_s = check_ttl(data.get("ttl_seconds"))

        def job() -> dict[str, Any]:
            label = name or self.registry.new_id("sampler")
            path = f"tinker://{model.model_id}/sampler_weights/{label}"
            weights = SamplerWeights(
                path=path, owner=tenant, lora=model.lora, adapter=self.ops.trained_weights(model),
                created=datetime.datetime.now(datetime.UTC).isoformat(),
            )  # fmt: skip
            self.registry.samplers[path] = weights
            session = None if name is not None else self.registry.open_session(tenant, weights)
            result = {"type": "save_weights_for_sampler", "path": path, "sampling_session_id": session}
            return self._expire(tenant, model.model_id, result, ttl_s)

        return self.futures.submit(tenant, "SaveWeightsForSampler", job, lane=model.model_id)

    def save_external(self, tenant: str, data: dict[str, Any]) -> str:
        """``save_weights_external``: a PEFT adapter (LoRA) or an HF model directory (full fine-tuning)."""
        from shardforge.algorithms.serve.export import export_dir, save_external

        model = self.registry.model(tenant, str(data.get("model_id")))
        name = data.get("path")
        if not isinstance(name, str):
            raise UserError(f"path={name!r} must be the export's name (a string without '/')")
        root = Path(self.config.output_dir)
        export_dir(root, tenant, model.model_id, name)  # checks the name now: a bad one is a 400, not a failed job
        if data.get("age_encryption_recipients"):
            raise UserError("age_encryption_recipients: encrypted exports are not supported by shardforge serve")
        ttl_s = check_ttl(data.get("ttl_seconds"))

        def job() -> dict[str, Any]:
            registry = self.registry
            # a full fine-tuning model's weights, gathered whole (sharded on several ranks), on the base's tree
            full = None if model.lora is not None else (registry.base, self.ops.trained_weights(model))
            result = save_external(
                root, model, name, tokenizer=registry.tokenizer, base_model=registry.model_dir, full_weights=full
            )
            return self._expire(tenant, model.model_id, result, ttl_s)

        return self.futures.submit(tenant, "SaveWeightsExternal", job, lane=model.model_id)

    def sampling_session(self, tenant: str, data: dict[str, Any]) -> str:
        self.check_session(tenant, str(data.get("session_id")))
        path = data.get("model_path")
        self.sweep_path(tenant, path)
        if path:
            return self.registry.open_session(tenant, self.registry.sampler(tenant, str(path)))
        self.registry.check_base_model(data.get("base_model"))
        return self.registry.open_session(tenant, SamplerWeights(path=None, owner=tenant))

    def sample(self, tenant: str, data: dict[str, Any]) -> tuple[str, int]:
        if data.get("sampling_session_id"):
            weights = self.registry.session(tenant, str(data["sampling_session_id"]))
        elif data.get("model_path"):
            self.sweep_path(tenant, data["model_path"])
            weights = self.registry.sampler(tenant, str(data["model_path"]))
        else:
            self.registry.check_base_model(data.get("base_model"))
            weights = SamplerWeights(path=None, owner=tenant)
        job = self.sampler.parse(data)
        self.metrics.samples.labels(tenant).inc(job.params.n)
        return self.futures.submit(tenant, "Sample", lambda: self.sampler.sample(weights, job)), job.params.n

    def save_state(self, tenant: str, data: dict[str, Any]) -> str:
        model = self.registry.model(tenant, str(data.get("model_id")))
        root = Path(self.config.output_dir)
        ttl_s = check_ttl(data.get("ttl_seconds"))

        def job() -> dict[str, Any]:
            return self._expire(tenant, model.model_id, self.ops.save_state(root, model, data), ttl_s)

        return self.futures.submit(tenant, "SaveWeights", job, lane=model.model_id)

    def list_checkpoints(self, tenant: str, model_id: str) -> dict[str, Any]:
        """``RestClient.list_checkpoints``: the model's ``save_state`` checkpoints and ``save_weights_external``
        exports (on disk) and sampler weights (in memory; they do not survive a restart). Unknown ids and another
        tenant's models: KeyError (404)."""
        from shardforge.algorithms.serve.checkpoints import list_training_checkpoints
        from shardforge.algorithms.serve.export import list_exports

        root = Path(self.config.output_dir)
        self.expiry.sweep_model(tenant, check_name(model_id, "model id"))
        checkpoints = list_training_checkpoints(root, tenant, model_id) + list_exports(root, tenant, model_id)
        live = self.registry.models.get(model_id)
        if not checkpoints and (live is None or live.owner != tenant):
            raise KeyError(f"training run {model_id!r} is not a model of this API key")
        now = datetime.datetime.now(datetime.UTC).isoformat()
        prefix = f"tinker://{model_id}/sampler_weights/"
        for path, weights in list(self.registry.samplers.items()):
            if weights.owner == tenant and path.startswith(prefix):
                checkpoints.append({
                    "checkpoint_id": path.removeprefix(f"tinker://{model_id}/"), "checkpoint_type": "sampler",
                    "time": weights.created or now, "tinker_path": path,
                })  # fmt: skip
        expires = self.expiry.expires_at(tenant, model_id)
        for checkpoint in checkpoints:
            checkpoint["expires_at"] = expires.get(checkpoint["checkpoint_id"])
        return {"checkpoints": checkpoints, "cursor": None}

    def set_checkpoint_ttl(self, tenant: str, model_id: str, checkpoint_id: str, ttl_seconds: object) -> None:
        """``RestClient.set_checkpoint_ttl_from_tinker_path``: expire one of the tenant's checkpoints ``ttl_seconds``
        from now (None: never); KeyError (404) for another tenant's or a missing checkpoint."""
        ttl_s = check_ttl(ttl_seconds)
        listed = {c["checkpoint_id"] for c in self.list_checkpoints(tenant, model_id)["checkpoints"]}
        if checkpoint_id not in listed:
            raise KeyError(f"tinker://{model_id}/{checkpoint_id} is not a checkpoint of this API key")
        self.expiry.set(tenant, model_id, checkpoint_id, ttl_s)

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        """``RestClient.delete_checkpoint[_from_tinker_path]`` (``checkpoint_id``: ``weights/<name>``, a
        ``save_state`` checkpoint on disk, or ``sampler_weights/<name>``, sampler weights in memory; sampling clients
        already made from them keep working). tinker-cookbook deletes its rolling checkpoints with it."""
        from shardforge.algorithms.serve.checkpoints import delete_checkpoint
        from shardforge.algorithms.serve.export import delete_export

        kind, _, name = checkpoint_id.partition("/")
        if kind == "weights":
            delete_checkpoint(Path(self.config.output_dir), tenant, model_id, name)
        elif kind == "external_weights":
            delete_export(Path(self.config.output_dir), tenant, model_id, name)
        elif kind == "sampler_weights":
            path = f"tinker://{model_id}/{checkpoint_id}"
            self.registry.sampler(tenant, path)  # KeyError (404) unless the tenant's
            self.registry.samplers.pop(path, None)
        else:
            raise UserError(
                f"checkpoint_id {checkpoint_id!r} must be weights/<name>, sampler_weights/<name> or "
                "external_weights/<name>"
            )

    def training_run(self, tenant: str, model_id: str) -> dict[str, Any]:
        """``RestClient.get_training_run``: the run's base model, LoRA rank, ``user_metadata`` and newest
        checkpoints (`serve.runs`); KeyError (404) for unknown ids and other tenants' runs."""
        from shardforge.algorithms.serve.runs import training_run

        self.sweep_path(tenant, f"tinker://{model_id}")
        return training_run(Path(self.config.output_dir), self.registry, tenant, model_id)

    def load_state(self, tenant: str, data: dict[str, Any]) -> str:
        """Into a live model (``model_id``), or into a new one (``session_id`` + ``model_seq_id``: the SDK's
        ``create_training_client_from_state*``, which also resumes a checkpoint after a service restart)."""
        from shardforge.algorithms.serve.checkpoints import read_lora

        root = Path(self.config.output_dir)
        self.sweep_path(tenant, data.get("path"))
        if data.get("model_id"):
            model = self.registry.model(tenant, str(data["model_id"]))
            return self.futures.submit(
                tenant, "LoadWeights", lambda: self.ops.load_state(root, model, data), lane=model.model_id
            )
        self.check_session(tenant, str(data.get("session_id")))
        if data.get("base_model") is not None:
            self.registry.check_base_model(data["base_model"])
        model_id = self._model_id(data)
        lora = read_lora(root, tenant, data, alpha=self.config.lora_alpha)
        self.ops.check_lora(lora)
        metadata = check_user_metadata(data.get("user_metadata"))

        def job() -> dict[str, Any]:
            return self.ops.load_state(root, self.ops.create_model(tenant, model_id, lora, 0, metadata), data)

        return self.futures.submit(tenant, "LoadWeights", job, lane=model_id)
