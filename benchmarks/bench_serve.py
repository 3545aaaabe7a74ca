"""`shardforge serve` driven by the real ``tinker`` SDK: what the service costs, and what tenants share.

Setup: the tiny Qwen3 of the serve tests (`shardforge.rollout.testing.tiny.tiny_model`, hidden ``HIDDEN``),
LoRA rank 8 on every linear of the attention and MLP (on both sides: the service's clients pass
``train_unembed=False``, since 2026-11-29 late morning; before, the SDK's default also adapted ``lm_head`` on the
service side only), batches of ``BATCH`` addition strings (``"37+45=82"``,
about 9 tokens each), AdamW.

1. ``serve_vs_trainer``: tokens/s of ``forward_backward("cross_entropy")`` + ``optim_step`` through the service
   (the SDK over HTTP on 127.0.0.1, one process) vs our training engine (`TrainEngine`, 1 process, the same LoRA,
   the same batches packed, one ``train_batch`` per step; its packed rows hold each string's last token too, as
   a masked input: one position per row more than the service's datums, the same trained tokens). Target >= 0.8x.
2. ``serve_tenants``: total tokens/s of ``TENANTS`` tenants training at once (a thread each, own API key and
   LoRA) vs one tenant alone, the service at its defaults: ``workers`` 2 (threads running different models' jobs
   at once) and LoRA tenants' queued ``forward_backward`` requests batched into one forward/backward over the
   shared base (``batch_window_s`` 0.02; on CPU spread over the workers: two batches of two). Target >= 2x.

Each is measured with two client modes (`AHEAD`), in the same run: ``pipelined``, as tinker-cookbook's supervised
loop drives the service by default (``submit_ahead=1``: step k+1's requests are sent before step k's results are
awaited, so the client's work and the HTTP round trips overlap the service's training); its rows carry the targets.
``lockstep`` (``_lockstep`` rows, report only): the client awaits each step before building the next.

The service runs as ``shardforge serve`` in a process of its own, as it is deployed (the SDK's client runs elsewhere);
``--in-process`` runs it in the benchmark's process instead (one interpreter for the client's HTTP work and the
service's training, as the rows before 2026-11-29 evening were measured). Median of ``ROUNDS`` alternated rounds of
``STEPS`` steps after ``WARMUP`` steps. Run: ``python benchmarks/bench_serve.py [--in-process]`` (~2 min; needs
``tinker``, ``fastapi``, ``uvicorn``, ``prometheus-client``).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

NAME_VS_TRAINER, NAME_TENANTS = "serve_vs_trainer", "serve_tenants"
HIDDEN, BATCH, STEPS, WARMUP, ROUNDS, TENANTS, RANK = 64, 32, 24, 2, 5, 4, 8
AHEAD = {"pipelined": 1, "lockstep": 0}
"""Client modes: how many steps a client submits ahead of the one it waits on (tinker-cookbook's supervised loop
`submit_ahead`: 1 by default, 0 = wait for each step before sending the next)."""
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(BATCH))]


def _datums(tokenizer: Any, seed: int) -> list[Any]:
    from tinker import types

    out = []
    for text in _texts(seed):
        ids = tokenizer(text)["input_ids"]
        weights = [1.0] * (len(ids) - 1)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


def _service_steps(
    url: str,
    key: str,
    tokenizer: Any,
    steps: int,
    seed: int,
    barrier: threading.Barrier | None = None,
    ahead: int = 0,
) -> tuple[int, float, float]:
    """(trained tokens, start, end) of ``steps`` forward_backward + optim_step calls of one new training client,
    timed after its warm-up (and after every tenant's, at ``barrier``); ``ahead`` steps are submitted before the
    client waits for the oldest one's results."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key=key)
    # train_unembed=False: the SDK's default also adapts lm_head, which the engine's TARGETS do not
    trainer = client.create_lora_training_client(base_model="tiny", rank=RANK, seed=seed, train_unembed=False).result()
    adam = types.AdamParams(learning_rate=1e-3)
    for step in range(WARMUP):
        trainer.forward_backward(_datums(tokenizer, seed * 1000 + step), "cross_entropy").result()
        trainer.optim_step(adam).result()
    if barrier is not None:
        barrier.wait()
    tokens, start = 0, time.perf_counter()
    pending: list[tuple[Any, Any]] = []
    for step in range(steps):
        datums = _datums(tokenizer, seed * 1000 + WARMUP + step)
        tokens += sum(len(d.model_input.to_ints()) for d in datums)
        pending.append((trainer.forward_backward(datums, "cross_entropy"), trainer.optim_step(adam)))
        while len(pending) > ahead:  # ahead 1: step k+1 is sent before step k's results are awaited
            fwdbwd, optim = pending.pop(0)
            fwdbwd.result()
            optim.result()
    for fwdbwd, optim in pending:
        fwdbwd.result()
        optim.result()
    return tokens, start, time.perf_counter()


def _tenants_at_once(url: str, keys: list[str], tokenizer: Any, seed: int, ahead: int) -> float:
    """Total tokens/s of every key's training client stepping at once (timed from the common start)."""
    results: list[tuple[int, float, float]] = []
    barrier = threading.Barrier(len(keys))

    def tenant(key: str, offset: int) -> None:
        results.append(_service_steps(url, key, tokenizer, STEPS, seed + offset, barrier, ahead))

    threads = [threading.Thread(target=tenant, args=(key, i)) for i, key in enumerate(keys)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    window = max(end for _, _, end in results) - min(start for _, start, _ in results)
    return sum(tokens for tokens, _, _ in results) / window


def _engine_steps(model_dir: str, tokenizer: Any, steps: int, seed: int) -> tuple[int, float]:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
    from shardforge.lora import LoRAConfig

    lora = LoRAConfig(r=RANK, alpha=32.0, target_modules=TARGETS)
    engine = TrainEngine(model_dir, "d1", EngineConfig(optimizer=OptimizerConfig(lr=1e-3), lora=lora))

    def batch(step: int) -> tuple[Any, int]:
        ids = [tokenizer(text)["input_ids"] for text in _texts(seed * 1000 + step)]
        masks = [[0.0] + [1.0] * (len(row) - 1) for row in ids]  # every target token, as the service's datums
        return pack_sequences(ids, loss_masks=masks), sum(len(row) - 1 for row in ids)

    for step in range(WARMUP):
        engine.train_batch(batch(step)[0])
    tokens, start = 0, time.perf_counter()
    for step in range(steps):
        packed, count = batch(WARMUP + step)
        tokens += count
        engine.train_batch(packed)
    return tokens, time.perf_counter() - start


def main() -> None:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from shardforge.algorithms.serve.config import ServeConfig
    from shardforge.algorithms.serve.server import ServiceServer
    from shardforge.algorithms.serve.service import TinkerService
    from shardforge.algorithms.serve.tenants import TenantKeys
    from shardforge.algorithms.testing.serve_process import ServeProcess
    from shardforge.rollout.testing.tiny import tiny_model

    separate = "--in-process" not in sys.argv  # default: the service in its own process, as it is deployed
    keys = {f"tml-bench-tenant-{i}-0123456789": f"tenant{i}" for i in range(TENANTS)}
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        tiny = tiny_model(Path(tmp), hidden=HIDDEN, layers=2)
        if separate:
            server: Any = ServeProcess(tiny["model"], keys, Path(tmp) / "out")
        else:
            config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(Path(tmp) / "out"))
            server = ServiceServer(TinkerService(config, TenantKeys(keys)), port=0).start()
        try:
            first_key = next(iter(keys))
            engine: list[float] = []
            alone: dict[str, list[float]] = {mode: [] for mode in AHEAD}
            together: dict[str, list[float]] = {mode: [] for mode in AHEAD}
            for round_ in range(ROUNDS):
                for mode, ahead in AHEAD.items():
                    tokens, start, end = _service_steps(
                        server.url, first_key, tiny["tokenizer"], STEPS, round_, ahead=ahead
                    )
                    alone[mode].append(tokens / (end - start))
                tokens, seconds = _engine_steps(tiny["model"], tiny["tokenizer"], STEPS, round_)
                engine.append(tokens / seconds)
                for mode, ahead in AHEAD.items():
                    seed = 100 + 10 * round_
                    together[mode].append(_tenants_at_once(server.url, list(keys), tiny["tokenizer"], seed, ahead))
        finally:
            server.stop()
    info = _common.machine_info()
    where = "its own process" if separate else "in the client process"
    payload: dict[str, Any] = {
        "machine": info, "batch": BATCH, "steps": STEPS, "rounds": ROUNDS, "lora_rank": RANK, "hidden": HIDDEN,
        "service_process": "separate" if separate else "in-process", "engine_tokens_s": engine,
    }  # fmt: skip
    summary = []
    for mode, ahead in AHEAD.items():
        vs_trainer = statistics.median(s / e for s, e in zip(alone[mode], engine, strict=True))
        tenants = statistics.median(t / a for t, a in zip(together[mode], alone[mode], strict=True))
        payload[mode] = {
            "submit_ahead": ahead, "one_tenant_tokens_s": alone[mode], f"{TENANTS}_tenants_tokens_s": together[mode],
            "ratio_vs_trainer": vs_trainer, "ratio_tenants": tenants,
        }  # fmt: skip
        headline = mode == "pipelined"  # tinker-cookbook's default client: the targets are judged on it
        suffix = "" if headline else f"_{mode}"
        client = (
            f"clients submit step k+1 before awaiting step k (submit_ahead {ahead}, tinker-cookbook's default)"
            if ahead
            else "clients await each step before sending the next (submit_ahead 0)"
        )
        _common.upsert_result_row(
            benchmark=NAME_VS_TRAINER + suffix,
            metric=f"LoRA r{RANK} training tokens/s, tiny Qwen3, {BATCH} rows/step: forward_backward + optim_step "
            f"through `shardforge serve` ({where}; tinker SDK over HTTP; {client}) vs TrainEngine.train_batch, "
            f"1 process; median of {ROUNDS}",
            ours=f"{statistics.median(alone[mode]):,.0f}",
            baseline=f"{statistics.median(engine):,.0f}",
            ratio=f"{vs_trainer:.2f}",
            target=_common.target_cell(">= 0.8x", vs_trainer >= 0.8) if headline else "report",
            machine=_common.machine_label(info),
        )
        _common.upsert_result_row(
            benchmark=NAME_TENANTS + suffix,
            metric=f"total training tokens/s of {TENANTS} tenants at once vs 1 alone through `shardforge serve` "
            f"({where}; {client}) (2 worker threads; tenants' forward_backward batched over the shared base, "
            f"spread over the 2 workers, 20 ms window); median of {ROUNDS}",
            ours=f"{statistics.median(together[mode]):,.0f}",
            baseline=f"{statistics.median(alone[mode]):,.0f}",
            ratio=f"{tenants:.2f}",
            target=_common.target_cell(">= 2x", tenants >= 2.0) if headline else "report",
            machine=_common.machine_label(info),
        )
        summary.append(f"{mode}: service/engine {vs_trainer:.2f}x, {TENANTS} tenants / 1 {tenants:.2f}x")
    _common.write_json("serve", payload)
    print("; ".join(summary))


if __name__ == "__main__":
    main()
