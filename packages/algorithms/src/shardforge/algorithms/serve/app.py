"""The HTTP routes of the Tinker API (``/api/v1/...``) that the ``tinker`` SDK calls, as a FastAPI app.

Requests that touch a model are validated here (a bad one gets a 4xx JSON ``{"detail": ...}`` at once) and
then queued (`serve.futures`); the SDK polls ``/api/v1/retrieve_future`` for their results.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from shardforge.algorithms.serve.codecs import PROTO_CONTENT_TYPE, decode_forward_backward
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.service import TinkerService

__all__ = ["build_app"]

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,  # API keys only (X-API-Key), no JWT exchange
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,  # plain httpx
    "parallel_fwdbwd_chunks": False,  # chunks of one call arrive one after the other, in seq_id order
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,  # per-request retrieve_future polling
    "custom_loss_server_side": False,  # forward_backward_custom runs its loss in the client
    "sample_join_sampling_session": False,
}


@contextmanager
def _http_errors() -> Iterator[None]:
    try:
        yield
    except KeyError as exc:
        raise HTTPException(404, str(exc.args[0]) if exc.args else "not found") from exc
    except (UserError, ValueError, TypeError) as exc:
        raise HTTPException(400, str(exc)) from exc


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # the wait may have timed out (cancelled) first
        future.set_result(None)


def build_app(service: TinkerService) -> FastAPI:
    """The FastAPI app serving ``service``."""
    app = FastAPI(title="shardforge serve (Tinker API)")
    app.state.service = service
    limit = service.config.max_request_bytes

    async def tenant(request: Request) -> str:  # async: FastAPI runs a sync dependency on a thread pool
        name = service.keys.tenant(request.headers.get("x-api-key"))
        if name is None:
            raise HTTPException(401, "missing or unknown API key: send X-API-Key: tml-... (the key of your tenant)")
        return name

    async def body(request: Request) -> bytes:
        if int(request.headers.get("content-length") or 0) > limit:
            raise HTTPException(413, f"request body over {limit} bytes (--max-request-bytes)")
        raw = await request.body()
        if len(raw) > limit:
            raise HTTPException(413, f"request body over {limit} bytes (--max-request-bytes)")
        return raw

    async def payload(request: Request) -> dict[str, Any]:
        raw = await body(request)
        try:
            value = json.loads(raw or b"{}")
        except ValueError as exc:
            raise HTTPException(400, f"the body is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise HTTPException(400, f"the body must be a JSON object, got {type(value).__name__}")
        return value

    @app.get("/metrics")
    def metrics() -> Response:
        # No API key: scrapers do not send one, and the body holds tenant names and counts, never keys or data.
        from shardforge.algorithms.serve.metrics import CONTENT_TYPE_LATEST

        return Response(service.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    def client_config(who: str = Depends(tenant)) -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    def dynamic_config(who: str = Depends(tenant)) -> dict[str, Any]:
        return {"sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    def capabilities(who: str = Depends(tenant)) -> dict[str, Any]:
        return service.capabilities()

    @app.post("/api/v1/telemetry")
    def telemetry(who: str = Depends(tenant)) -> dict[str, str]:
        return {"status": "accepted"}  # the SDK's own usage events; nothing to do with them here

    @app.post("/api/v1/create_session")
    async def create_session(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        await payload(request)
        return {"type": "create_session", "session_id": service.open_session(who)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        with _http_errors():
            service.check_session(who, str((await payload(request)).get("session_id")))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        await payload(request)  # {"reason": ..., "detail": ...}: ServiceClient.close / leaving its `with` block
        with _http_errors():
            service.check_session(who, session_id)
        return {}

    @app.get("/api/v1/training_runs/{model_id}")
    async def get_training_run(model_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        with _http_errors():  # the SDK's access_scope query ("owned" / "accessible"): a tenant sees only its own
            return service.training_run(who, model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        with _http_errors():
            return service.list_checkpoints(who, model_id)

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, who: str = Depends(tenant)) -> Response:
        with _http_errors():
            service.delete_checkpoint(who, model_id, checkpoint_id)
        return Response(status_code=204)

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(
        model_id: str, checkpoint_id: str, request: Request, who: str = Depends(tenant)
    ) -> Response:
        with _http_errors():
            service.set_checkpoint_ttl(who, model_id, checkpoint_id, (await payload(request)).get("ttl_seconds"))
        return Response(status_code=204)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(
        model_id: str, checkpoint_id: str, request: Request, who: str = Depends(tenant)
    ) -> dict[str, Any]:
        with _http_errors():
            service.sweep_path(who, f"tinker://{model_id}")  # an expired export has no URLs
            return service.downloads.urls(who, model_id, checkpoint_id, str(request.base_url))

    @app.get("/api/v1/external_weights_files/{owner}/{model_id}/{name}/{file:path}")
    def external_weights_file(owner: str, model_id: str, name: str, file: str, expires: int, sig: str) -> Response:
        # No API key: the URL is the credential (signed for this file, owner and expiry), as a signed URL is.
        try:
            with _http_errors():
                path = service.downloads.file(owner, model_id, name, file, expires, sig)
        except PermissionError as exc:
            raise HTTPException(403, str(exc)) from exc
        return FileResponse(path)

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"request_id": service.save_external(who, data), "model_id": data.get("model_id")}

    @app.post("/api/v1/create_model")
    async def create_model(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"request_id": service.create_model(who, data)}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return service.info(who, str(data.get("model_id")))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        raw = await body(request)
        if request.headers.get("content-encoding"):
            raise HTTPException(
                415, "compressed forward_backward bodies are not accepted (proto_compress_fwdbwd is off)"
            )
        with _http_errors():
            fwdbwd = decode_forward_backward(raw)
            return {"request_id": service.forward_backward(who, fwdbwd), "model_id": fwdbwd.model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"request_id": service.optim_step(who, data), "model_id": data.get("model_id")}

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"request_id": service.save_for_sampler(who, data), "model_id": data.get("model_id")}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"request_id": service.save_state(who, data), "model_id": data.get("model_id")}

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"request_id": service.load_state(who, data), "model_id": data.get("model_id")}

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            return {"type": "create_sampling_session", "sampling_session_id": service.sampling_session(who, data)}

    @app.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str, who: str = Depends(tenant)) -> dict[str, Any]:
        with _http_errors():
            weights = service.registry.session(who, sampler_id)
        return {"sampler_id": sampler_id, "base_model": service.registry.base_model, "model_path": weights.path}

    @app.post("/api/v1/asample")
    async def asample(request: Request, who: str = Depends(tenant)) -> dict[str, Any]:
        data = await payload(request)
        with _http_errors():
            request_id, count = service.sample(who, data)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(count)]}

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request, who: str = Depends(tenant)) -> Response:
        request_id = str((await payload(request)).get("request_id"))
        try:
            result = service.futures.lookup(who, request_id)
        except KeyError as exc:
            raise HTTPException(404, f"request_id {request_id!r} is not a request of this API key") from exc
        if not result.done.is_set():  # wait on the event loop (no thread blocks), answered as soon as it is done
            loop = asyncio.get_running_loop()
            done = loop.create_future()

            def wake() -> None:  # runs on the worker thread that finished the job
                loop.call_soon_threadsafe(_resolve, done)

            result.add_done_callback(wake)
            try:
                await asyncio.wait_for(done, service.config.poll_wait_s)
            except TimeoutError:
                return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if result.error is not None:
            return JSONResponse({"error": result.error, "category": result.category})
        if result.proto is not None:
            return Response(result.proto, media_type=PROTO_CONTENT_TYPE)
        return JSONResponse(result.json)

    return app
