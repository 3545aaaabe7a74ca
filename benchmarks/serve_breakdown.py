"""Where one tenant's `forward_backward` + `optim_step` step through `shardforge serve` goes (docs/tinker.md).

The bench_serve setup (tiny Qwen3, LoRA r8 on the attention and MLP Linears, 32 addition strings per step), one
tenant, the service in its own process. Events are timed on one monotonic clock (``time.perf_counter``, the
same clock in both processes on Linux): in the client, the step's start, its datums built, each HTTP request
sent; in the service (this script re-run as the service, with `FutureQueue` timing its jobs), each job's
submit, start and end and its thread's CPU time. Prints the median and fastest of each part over ``STEPS``
steps, and the engine's step (tokenize + pack, ``train_batch``) for comparison.

``--canned``: the service answers ``forward_backward`` / ``optim_step`` with a canned result of the right shape
instead of training: what the protocol (SDK, HTTP, queue) costs alone. Run: ``python benchmarks/serve_breakdown.py
[--canned]`` (~30 s). Writes ``benchmarks/out/serve_breakdown[_canned].json``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common
import bench_serve

from shardforge.algorithms.testing.serve_process import ServeProcess

STEPS, WARMUP = 60, 5
_SERVE_FLAG = "--serve-timed"
_PARTS = (
    ("client: tokenize, build the Datums", "step", "datums"),
    ("client: SDK until the forward_backward POST is sent", "datums", "sent:forward_backward"),
    ("HTTP, decode, checks, queued", "sent:forward_backward", "submit:ForwardBackward"),
    ("queue until the job starts", "submit:ForwardBackward", "start:ForwardBackward"),
    ("the forward_backward job", "start:ForwardBackward", "end:ForwardBackward"),
    ("until the optim_step job starts", "end:ForwardBackward", "start:OptimStep"),
    ("the optim_step job", "start:OptimStep", "end:OptimStep"),
    ("until the client holds both results", "end:OptimStep", "results"),
)


def _serve_timed(out: str, canned: bool, argv: list[str]) -> int:
    """The service (``shardforge serve argv``) with its jobs timed into ``out`` (JSON, rewritten every 0.5 s)."""
    from shardforge.algorithms.cli.main import main
    from shardforge.algorithms.serve import futures, training

    events: list[tuple[float, str, str, float]] = []  # (time, what, job kind, thread CPU seconds of the job)
    submit, execute, finish = futures.FutureQueue.submit, futures.FutureQueue._execute, futures.FutureResult.finish
    done_at: dict[int, float] = {}  # id(result) -> when its result was set (before the metrics are recorded)

    def timed_finish(self: Any) -> None:
        done_at[id(self)] = time.perf_counter()
        finish(self)

    def timed_submit(self: Any, owner: str, kind: str, *args: Any, **kwargs: Any) -> str:
        request_id = submit(self, owner, kind, *args, **kwargs)
        events.append((time.perf_counter(), "submit", kind, 0.0))
        return request_id

    def timed_execute(self: Any, result: Any, job: Any, started: float | None = None) -> None:
        cpu, start = time.thread_time(), time.perf_counter()
        try:
            execute(self, result, job, started)
        finally:
            end = done_at.pop(id(result), time.perf_counter())
            events.append((start, "start", result.kind, 0.0))
            events.append((end, "end", result.kind, time.thread_time() - cpu))

    futures.FutureQueue.submit = timed_submit  # type: ignore[method-assign]
    futures.FutureQueue._execute = timed_execute  # type: ignore[method-assign]
    futures.FutureResult.finish = timed_finish  # type: ignore[method-assign]
    if canned:
        _use_canned_training(training)

    def dump() -> None:
        while True:
            time.sleep(0.5)
            Path(out).write_text(json.dumps(list(events)))

    threading.Thread(target=dump, daemon=True).start()
    return main(argv)


def _use_canned_training(training: Any) -> None:
    """forward_backward / optim_step answer at once (zeros of the right shapes), training nothing."""
    import torch

    from shardforge.algorithms.serve.codecs import encode_packed_forward_backward_output

    def forward_backward(model: Any, request: Any) -> bytes:
        lengths = [len(datum.tokens) for datum in request.data]
        zeros = torch.zeros(sum(lengths))
        return encode_packed_forward_backward_output(
            {"logprobs": zeros, "elementwise_loss": zeros}, lengths, {"loss:sum": 0.0}
        )

    def optim_step(model: Any, adam: dict[str, Any]) -> dict[str, Any]:
        model.steps += 1
        return {"metrics": {"grad_norm:mean": 0.0, "step:max": float(model.steps)}}

    training.forward_backward, training.optim_step = forward_backward, optim_step


class _TimedService(ServeProcess):
    def __init__(self, model: str, keys: dict[str, str], out: Path, events: Path, canned: bool) -> None:
        prefix = [sys.executable, __file__, _SERVE_FLAG, str(events), "canned" if canned else "train"]
        super().__init__(model, keys, out, launcher=prefix)


def _client_steps(url: str, key: str, tokenizer: Any) -> list[dict[str, float]]:
    """One tenant's timed steps: per step the times of its events (the first of each name)."""
    import httpx
    import tinker
    from tinker import types

    marks: dict[str, float] = {}
    send = httpx.AsyncClient.send

    async def timed_send(self: httpx.AsyncClient, request: httpx.Request, *args: Any, **kwargs: Any) -> Any:
        marks.setdefault("sent:" + request.url.path.rsplit("/", 1)[-1], time.perf_counter())
        return await send(self, request, *args, **kwargs)

    httpx.AsyncClient.send = timed_send  # type: ignore[method-assign]
    try:
        client = tinker.ServiceClient(base_url=url, api_key=key)
        trainer = client.create_lora_training_client(
            base_model="tiny", rank=bench_serve.RANK, seed=0, train_unembed=False
        ).result()
        adam = types.AdamParams(learning_rate=1e-3)
        steps = []
        for step in range(WARMUP + STEPS):
            marks.clear()
            marks["step"] = time.perf_counter()
            datums = bench_serve._datums(tokenizer, step)
            marks["datums"] = time.perf_counter()
            fwdbwd, optim = trainer.forward_backward(datums, "cross_entropy"), trainer.optim_step(adam)
            fwdbwd.result()
            optim.result()
            marks["results"] = time.perf_counter()
            if step >= WARMUP:
                steps.append(dict(marks))
        return steps
    finally:
        httpx.AsyncClient.send = send  # type: ignore[method-assign]


def _merge_service_events(steps: list[dict[str, float]], events: list[list[Any]]) -> list[float]:
    """Each step gets the service's first submit and start of each job kind inside it and that job's end (the
    previous step's job may log its end just after this step began); the forward_backward jobs' thread CPU
    seconds."""
    events = sorted(events)
    cpu = []
    for step in steps:
        inside = [e for e in events if step["step"] <= e[0] <= step["results"]]
        for kind in ("ForwardBackward", "OptimStep"):
            submits = [at for at, what, k, _ in inside if what == "submit" and k == kind]
            starts = [at for at, what, k, _ in inside if what == "start" and k == kind]
            if not submits or not starts:
                continue
            step[f"submit:{kind}"], step[f"start:{kind}"] = submits[0], starts[0]
            ends = [(at, seconds) for at, what, k, seconds in events if what == "end" and k == kind and at >= starts[0]]
            if ends:
                step[f"end:{kind}"] = ends[0][0]
                if kind == "ForwardBackward":
                    cpu.append(ends[0][1])
    return cpu


def _engine_steps(model: str, tokenizer: Any) -> tuple[list[float], list[float]]:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
    from shardforge.lora import LoRAConfig

    lora = LoRAConfig(r=bench_serve.RANK, alpha=32.0, target_modules=bench_serve.TARGETS)
    engine = TrainEngine(model, "d1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3), lora=lora))
    prepare, train = [], []
    for step in range(WARMUP + STEPS):
        start = time.perf_counter()
        ids = [tokenizer(text)["input_ids"] for text in bench_serve._texts(step)]
        packed = pack_sequences(ids, loss_masks=[[0.0] + [1.0] * (len(row) - 1) for row in ids])
        mid = time.perf_counter()
        engine.train_batch(packed)
        if step >= WARMUP:
            prepare.append(mid - start)
            train.append(time.perf_counter() - mid)
    return prepare, train


def _row(name: str, seconds: list[float]) -> dict[str, Any]:
    ms = [1000 * s for s in seconds]
    return {"part": name, "median_ms": round(statistics.median(ms), 2), "fastest_ms": round(min(ms), 2)}


def main() -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from shardforge.rollout.testing.tiny import tiny_model

    canned = "--canned" in sys.argv
    keys = {"tml-breakdown-tenant-0123456789": "tenant0"}
    with tempfile.TemporaryDirectory(prefix="serve_breakdown_") as tmp:
        tiny = tiny_model(Path(tmp), hidden=bench_serve.HIDDEN, layers=2)
        events_path = Path(tmp) / "events.json"
        server = _TimedService(tiny["model"], keys, Path(tmp) / "out", events_path, canned)
        try:
            steps = _client_steps(server.url, next(iter(keys)), tiny["tokenizer"])
            time.sleep(1.2)  # the service writes its events every 0.5 s
            events = json.loads(events_path.read_text())
        finally:
            server.stop()
        cpu = _merge_service_events(steps, events)
        rows = []
        for name, first, last in _PARTS:
            spans = [step[last] - step[first] for step in steps if first in step and last in step]
            if spans:
                rows.append(_row(name, spans))
        if cpu:
            rows.append(_row("  (the forward_backward job's thread CPU)", cpu))
        rows.append(_row("whole step", [step["results"] - step["step"] for step in steps]))
        if not canned:
            prepare, train = _engine_steps(tiny["model"], tiny["tokenizer"])
            rows += [_row("engine: tokenize and pack", prepare), _row("engine: train_batch", train)]
    load = os.getloadavg()
    print(f"{'part of the step':55s} {'median':>8s} {'fastest':>8s}  (ms, {STEPS} steps, load {load[0]:.2f})")
    for row in rows:
        print(f"{row['part']:55s} {row['median_ms']:8.2f} {row['fastest_ms']:8.2f}")
    payload = {"machine": _common.machine_info(), "canned": canned, "steps": STEPS, "load": load, "rows": rows}
    _common.write_json("serve_breakdown_canned" if canned else "serve_breakdown", payload)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == _SERVE_FLAG:
        sys.exit(_serve_timed(sys.argv[2], sys.argv[3] == "canned", sys.argv[4:]))
    main()
