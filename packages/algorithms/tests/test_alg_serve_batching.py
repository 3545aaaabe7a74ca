"""LoRA tenants batched into one forward/backward over the shared base (`serve.batching.LoRABatcher`) give each
tenant the log-probs, loss and adapter gradients it gets alone; a tenant whose loss fails fails only itself; and
the queue runs queued jobs of one batch group as one batch (`serve.futures.FutureQueue`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')")

import torch
from tinker.proto import tinker_public_pb2 as pb

from shardforge.algorithms.serve.batching import LoRABatcher
from shardforge.algorithms.serve.codecs import FwdBwdRequest, WireDatum
from shardforge.algorithms.serve.futures import BatchGroup, FutureQueue
from shardforge.algorithms.serve.models import ModelRegistry, TrainingModel, lora_config_for
from shardforge.algorithms.serve.training import forward_backward
from shardforge.lora import lora_modules


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    from shardforge.rollout.testing.tiny import tiny_model

    tiny = tiny_model(tmp_path_factory.mktemp("batching"))
    return ModelRegistry(tiny["model"], base_model="tiny")


def _model(registry: ModelRegistry, name: str, lora: dict, seed: int) -> TrainingModel:
    model = registry.create_model(name, f"{name}:train:0", lora_config_for(lora, alpha=32.0), seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B starts at zero: give every tenant a different non-zero adapter, so mixed rows show
        for param in model.module.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


def _request(model: TrainingModel, texts: list[str], loss_fn: str, forward_only: bool = False, **config: float):
    data = []
    for i, text in enumerate(texts):
        ids = [3 + ord(c) % 11 for c in text]  # small ids: inside any tokenizer's vocabulary
        inputs = {"target_tokens": torch.tensor(ids[1:], dtype=torch.int64)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.linspace(0.2, 1.0, len(ids) - 1)
        else:
            inputs["logprobs"] = torch.full((len(ids) - 1,), -2.0 - i)
            inputs["advantages"] = torch.linspace(-1.0, 1.0, len(ids) - 1)
        data.append(WireDatum(tokens=ids[:-1], inputs=inputs))
    return FwdBwdRequest(
        model_id=model.model_id, seq_id=0, loss_fn=loss_fn, forward_only=forward_only, loss_fn_config=config, data=data
    )


def _decode(body: bytes) -> tuple[float, np.ndarray]:
    """(loss:sum, every datum's log-probs concatenated) of a ForwardBackwardOutput."""
    msg = pb.ForwardBackwardOutput.FromString(body)
    logprobs = np.frombuffer(msg.loss_fn_outputs[0].fields["logprobs"].data, dtype=np.float32)
    return msg.metrics["loss:sum"], logprobs


def _grads(model: TrainingModel) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}
    model.optimizer.zero_grad(set_to_none=True)
    return grads


def test_batched_tenants_get_what_each_gets_alone(registry: ModelRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three tenants with different ranks, targets, data lengths and losses: batched == alone (1e-5), and every
    adapter got a non-zero gradient (a test that would pass with rows swapped or adapters ignored cannot). Both
    ways of adding the adapters run (stacked, and tenant by tenant for adapters with dropout)."""
    models = [
        _model(registry, "alice", {"rank": 4}, seed=1),
        _model(registry, "bob", {"rank": 8, "train_mlp": False}, seed=2),
        _model(registry, "carol", {"rank": 2, "train_attn": False, "train_unembed": True}, seed=3),
    ]
    # carol's adapters have a dropout module (in eval mode: deterministic): the Linears she adapts (MLP, LM head)
    # take the tenant-by-tenant path, the attention ones (alice and bob only) the stacked one
    for _, module in lora_modules(models[2].module):
        module.lora_dropout = torch.nn.Dropout(0.1).eval()
    requests = [
        _request(models[0], ["12+34=46", "7*8=56"], "cross_entropy"),
        _request(models[1], ["99-9=90", "1+1=2", "123+456=579"], "importance_sampling"),
        _request(models[2], ["5*5=25"], "ppo", clip_low_threshold=0.9, clip_high_threshold=1.1),
    ]
    alone = []
    for model, request in zip(models, requests, strict=True):
        alone.append((_decode(forward_backward(model, request)), _grads(model)))
    from shardforge.algorithms.serve import batching

    calls = {"_stacked_delta": 0, "_per_tenant_delta": 0}
    for fn in calls:
        original = getattr(batching, fn)
        monkeypatch.setattr(batching, fn, lambda *a, _fn=fn, _original=original: calls.__setitem__(_fn, calls[_fn] + 1)
                            or _original(*a))  # fmt: skip
    batched = LoRABatcher(registry).run(list(zip(models, requests, strict=True)))
    assert calls["_stacked_delta"] > 0 and calls["_per_tenant_delta"] > 0, calls
    for (model, (loss, logprobs)), ((alone_loss, alone_lp), alone_grads) in zip(
        zip(models, [_decode(b) for b in batched if isinstance(b, bytes)], strict=True), alone, strict=True
    ):
        assert loss == pytest.approx(alone_loss, rel=1e-5, abs=1e-5), model.model_id
        np.testing.assert_allclose(logprobs, alone_lp, rtol=1e-5, atol=1e-5)
        grads = _grads(model)
        assert grads.keys() == alone_grads.keys() and len(grads) > 0
        for name, grad in grads.items():
            assert grad.abs().sum() > 0, f"{model.model_id}: {name} got no gradient"
            torch.testing.assert_close(grad, alone_grads[name], rtol=1e-5, atol=1e-6, msg=f"{model.model_id}: {name}")
    # the three tenants really differ: had rows been swapped, the losses above could not have matched
    assert len({round(loss, 3) for (loss, _), _ in alone}) == 3


def test_a_failing_tenant_fails_alone_and_forward_only_batches(registry: ModelRegistry) -> None:
    """A ppo loss with invalid clip thresholds fails its own item; the other tenant still trains as alone."""
    good = _model(registry, "dave", {"rank": 4}, seed=4)
    bad = _model(registry, "eve", {"rank": 4}, seed=5)
    good_request = _request(good, ["12+34=46", "7*8=56"], "cross_entropy")
    bad_request = _request(bad, ["1+2=3"], "ppo", clip_low_threshold=1.5, clip_high_threshold=0.5)
    expected = _decode(forward_backward(good, good_request))[0], _grads(good)
    outcomes = LoRABatcher(registry).run([(bad, bad_request), (good, good_request)])
    assert isinstance(outcomes[0], ValueError) and "clip_low_threshold" in str(outcomes[0])
    assert isinstance(outcomes[1], bytes) and _decode(outcomes[1])[0] == pytest.approx(expected[0], rel=1e-5)
    grads = _grads(good)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=1e-5, atol=1e-6)
    assert not _grads(bad), "the failed tenant's adapters must get no gradient"
    forward = [_request(m, ["3+4=7"], "cross_entropy", forward_only=True) for m in (good, bad)]
    alone = [_decode(forward_backward(m, r))[0] for m, r in zip((good, bad), forward, strict=True)]
    together = LoRABatcher(registry).run(list(zip((good, bad), forward, strict=True)))
    assert [_decode(b)[0] for b in together if isinstance(b, bytes)] == pytest.approx(alone, rel=1e-5)
    assert not _grads(good) and not _grads(bad)
    with pytest.raises(ValueError, match="mixes forward and forward_backward"):
        LoRABatcher(registry).run([(good, good_request), (bad, forward[1])])


def test_queue_runs_a_groups_queued_jobs_as_one_batch() -> None:
    """Jobs of one group queued while the worker is busy run as one batch; a job queued behind one that runs alone
    does not pass it; a batch that raises runs its jobs alone."""
    batches: list[list[str]] = []
    fail = {"on": False}

    def run_batch(items: list) -> list:
        if fail["on"]:
            raise RuntimeError("boom")
        batches.append(list(items))
        return [{"item": item, "batched": True} for item in items]

    group = BatchGroup(name="g", run_batch=run_batch, max_weight=10)
    queue = FutureQueue(workers=1)
    gate = threading.Event()
    try:
        blocker = queue.submit("t", "Block", lambda: gate.wait(10) and {}, lane="x")
        ids = [
            queue.submit(
                "t", "Fb", lambda i=i: {"item": i, "batched": False}, lane=f"l{i}", group=group, item=i, weight=3
            )
            for i in range(4)
        ]
        gate.set()
        results = [queue.get("t", rid, 10) for rid in [blocker, *ids]]
        assert all(r is not None and r.error is None for r in results)
        # weight 3 each, max 10: three in one batch, the fourth after it (a batch of one runs its own job)
        assert batches == [[0, 1, 2]]
        assert [r.json for r in results[1:]] == [  # type: ignore[union-attr]
            {"item": 0, "batched": True}, {"item": 1, "batched": True}, {"item": 2, "batched": True},
            {"item": 3, "batched": False},
        ]  # fmt: skip
        assert [r.batch_size for r in results[1:]] == [3, 3, 3, 1]  # type: ignore[union-attr]
        fail["on"] = True
        gate.clear()
        blocker = queue.submit("t", "Block", lambda: gate.wait(10) and {}, lane="x")
        ids = [queue.submit("t", "Fb", lambda i=i: {"alone": i}, lane=f"l{i}", group=group, item=i) for i in range(2)]
        gate.set()
        assert [queue.get("t", rid, 10).json for rid in ids] == [{"alone": 0}, {"alone": 1}]  # type: ignore[union-attr]
    finally:
        gate.set()
        queue.close()


def test_batch_window_waits_for_stepping_lanes_only() -> None:
    """A lone lane's job runs at once; once another lane steps in the group, a job waits (up to the window) for
    that lane's next job and they run as one batch."""
    import time

    batches: list[list[int]] = []

    def run_batch(items: list) -> list:
        batches.append(list(items))
        return [{"item": item} for item in items]

    group = BatchGroup(name="g", run_batch=run_batch, max_weight=99, window_s=5.0)
    queue = FutureQueue(workers=1)
    try:
        start = time.monotonic()
        first = queue.submit("t", "Fb", lambda: {"item": 0}, lane="a", group=group, item=0)
        assert queue.get("t", first, 5) is not None and time.monotonic() - start < 1.0, "a lone lane must not wait"
        start = time.monotonic()
        waiting = queue.submit("t", "Fb", lambda: {"item": 1}, lane="b", group=group, item=1)  # a stepped: wait
        time.sleep(0.3)
        joined = queue.submit("t", "Fb", lambda: {"item": 2}, lane="a", group=group, item=2)
        results = [queue.get("t", rid, 10) for rid in (waiting, joined)]
        assert time.monotonic() - start < 4.0, "the window ends when every stepping lane has joined"
    finally:
        queue.close()
    assert batches == [[1, 2]] and [r.batch_size for r in results] == [2, 2]  # type: ignore[union-attr]


def test_spread_gives_each_worker_its_share_of_the_stepping_lanes() -> None:
    """Four stepping lanes (queued while both workers are busy), two workers, ``spread``: two batches of two, run
    at once (both are inside ``run_batch`` together), instead of one batch of four."""
    batches: list[list[int]] = []
    inside, both = threading.Semaphore(0), threading.Event()

    def run_batch(items: list) -> list:
        batches.append(list(items))
        inside.release()
        if len(batches) == 2:
            both.set()
        both.wait(10)  # the first batch is still running when the second starts
        return [{"item": item} for item in items]

    group = BatchGroup(name="g", run_batch=run_batch, max_weight=99, window_s=5.0, spread=True)
    queue = FutureQueue(workers=2)
    gate = threading.Event()
    try:
        blockers = [queue.submit("t", "Block", lambda: gate.wait(10) and {}, lane=f"x{i}") for i in range(2)]
        ids = [queue.submit("t", "Fb", lambda: {}, lane=lane, group=group, item=i) for i, lane in enumerate("abcd")]
        gate.set()
        results = [queue.get("t", rid, 10) for rid in [*blockers, *ids]]
    finally:
        gate.set()
        queue.close()
    assert both.is_set() and all(r is not None and r.error is None for r in results)
    assert sorted(sorted(b) for b in batches) == [[0, 1], [2, 3]], batches
