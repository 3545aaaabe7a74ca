"""`shardforge serve` driven by the official tinker SDK (0.38) against a tiny local model on 127.0.0.1.

Parity: the service's per-step cross-entropy losses equal a plain torch loop with the same LoRA init, the same
tokens and the same AdamW; the RL losses equal Tinker's formulas written out here. Isolation and malformed
requests: 4xx answers, and the service keeps serving.
"""

from __future__ import annotations

import contextlib
import os

import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')"
)

import httpx  # noqa: E402
import torch  # noqa: E402
from tinker import types  # noqa: E402

from shardforge.algorithms.serve.config import ServeConfig  # noqa: E402
from shardforge.algorithms.serve.models import lora_config_for  # noqa: E402
from shardforge.algorithms.serve.server import ServiceServer  # noqa: E402
from shardforge.algorithms.serve.service import TinkerService  # noqa: E402
from shardforge.algorithms.serve.tenants import TenantKeys  # noqa: E402

ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789"
TEXTS = ["12+34=46", "7*8=56", "99-9=90"]
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve")
    tiny = tiny_model(root)
    # a long batch window, no spreading over the workers: tenants stepping at once always meet in one batch (the
    # concurrent-tenants test)
    config = ServeConfig(
        model_dir=tiny["model"], base_model="tiny", output_dir=str(root / "out"), max_tokens=32, batch_window_s=0.5,
        batch_spread=False,
    )  # fmt: skip
    server = ServiceServer(TinkerService(config, TenantKeys({ALICE: "alice", BOB: "bob"})), port=0).start()
    clients: list = []

    def client(key: str):  # closed before the server stops: no SDK heartbeat outlives the module
        clients.append(tinker.ServiceClient(base_url=server.url, api_key=key))
        return clients[-1]

    yield {"url": server.url, "tokenizer": tiny["tokenizer"], "model": tiny["model"], "server": server,
           "client": client}  # fmt: skip
    for made in clients:
        with contextlib.suppress(Exception):  # teardown: a client the test already broke need not finish cleanly
            made.close("success").result(timeout=10)
    server.stop()


def _datums(tokenizer, texts: list[str] = TEXTS) -> list[types.Datum]:
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        weights = [0.0] * 2 + [1.0] * (len(ids) - 3)  # no loss on the first targets, as a prompt mask would
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


def _reference_losses(model_dir: str, datums: list[types.Datum], steps: int, seed: int, rank: int = 4) -> list[float]:
    """Plain torch: the base model, our LoRA with the same config and seed, sum-reduced weighted NLL, AdamW."""
    from transformers import AutoModelForCausalLM

    from shardforge.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    apply_lora(model, lora_config_for({"rank": rank}, alpha=32.0), seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps, weight_decay=ADAM.weight_decay
    )
    from shardforge.algorithms.testing.reference import weighted_nll_adamw_losses

    losses = weighted_nll_adamw_losses(model, opt, datums, steps)
    return losses


def test_sft_loop_matches_plain_torch(served) -> None:
    service = served["client"](ALICE)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    datums = _datums(trainer.get_tokenizer())
    losses = []
    for _ in range(3):
        fwdbwd = trainer.forward_backward(datums, "cross_entropy")
        step = trainer.optim_step(ADAM)
        losses.append(fwdbwd.result().metrics["loss:sum"])
        step.result()
    reference = _reference_losses(served["model"], datums, 3, seed=7)
    assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0]
    forward = trainer.forward(datums, "cross_entropy").result()
    assert len(forward.loss_fn_outputs) == len(datums)
    assert forward.loss_fn_outputs[0]["logprobs"].shape == [len(datums[0].model_input.to_ints())]


def test_sampling_and_logprobs(served) -> None:
    service = served["client"](ALICE)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(served["tokenizer"]("12+")["input_ids"])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3 and all(1 <= len(s.tokens) <= 6 for s in first.sequences)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]  # the seed fixes them
    assert all(len(s.logprobs) == len(s.tokens) for s in first.sequences)
    stop_at = first.sequences[0].tokens[0]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=3, stop=[stop_at])).result()
    assert stopped.sequences[0].tokens == [stop_at] and stopped.sequences[0].stop_reason == "stop"
    logprobs = sampler.compute_logprobs(prompt).result()
    assert logprobs[0] is None and all(lp is not None and lp < 0 for lp in logprobs[1:])
    base = service.create_sampling_client(base_model="tiny").result()
    assert len(base.sample(prompt, 1, params).result().sequences[0].tokens) >= 1
    # top_k: 1 leaves only the most likely token, so any seed at temperature 1 samples the greedy sequence
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    top1 = types.SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=5, stop=[])
    assert [s.tokens for s in sampler.sample(prompt, 3, top1).result().sequences] == [greedy.sequences[0].tokens] * 3
    top3 = types.SamplingParams(max_tokens=6, temperature=1.0, top_k=3, seed=5, stop=[])
    assert len({tuple(s.tokens) for s in sampler.sample(prompt, 8, top3).result().sequences}) > 1
    with pytest.raises(Exception, match="top_k=-2 must be -1"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, top_k=-2)).result()


def test_rl_losses_are_tinkers(served) -> None:
    service = served["client"](ALICE)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    ids = served["tokenizer"]("12+34=46")["input_ids"]
    n = len(ids) - 1
    behaviour = torch.linspace(-3.0, -1.0, n)
    advantages = torch.linspace(-1.0, 1.0, n)
    inputs = {"target_tokens": ids[1:], "logprobs": behaviour, "advantages": advantages}
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)
    lp = torch.tensor(trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    ratio = torch.exp(lp - behaviour)
    is_loss = trainer.forward([datum], "importance_sampling").result().metrics["loss:sum"]
    assert is_loss == pytest.approx(float(-(ratio * advantages).sum()), rel=1e-5)
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    ppo_loss = trainer.forward([datum], "ppo", loss_fn_config=config).result().metrics["loss:sum"]
    clipped = torch.minimum(ratio * advantages, ratio.clamp(0.9, 1.1) * advantages)
    assert ppo_loss == pytest.approx(float(-clipped.sum()), rel=1e-5)
    # gspo: the PPO clip on the datum's geometric-mean ratio over its sequence_ratio_mask tokens (the sampled part,
    # as tinker-cookbook's rl_loop sends it); tokens outside the mask add nothing.
    mask = torch.tensor([0.0] * 3 + [1.0] * (n - 3))
    masked = types.Datum(model_input=datum.model_input, loss_fn_inputs={**inputs, "sequence_ratio_mask": mask})
    gspo_loss = trainer.forward([masked], "gspo", loss_fn_config=config).result().metrics["loss:sum"]
    seq_ratio = torch.exp(((lp - behaviour) * mask).sum() / mask.sum())
    per_token = torch.minimum(seq_ratio * advantages, seq_ratio.clamp(0.9, 1.1) * advantages) * mask
    assert gspo_loss == pytest.approx(float(-per_token.sum()), rel=1e-5)
    unmasked = trainer.forward([datum], "gspo", loss_fn_config=config).result().metrics["loss:sum"]
    seq_ratio = torch.exp((lp - behaviour).mean())
    assert unmasked == pytest.approx(
        float(-torch.minimum(seq_ratio * advantages, seq_ratio.clamp(0.9, 1.1) * advantages).sum()), rel=1e-5
    )
    # dro, as Tinker's docs write it: -sum(lp A - beta/2 (lp - q)^2); beta is required (no documented default).
    dro_loss = trainer.forward([datum], "dro", loss_fn_config={"beta": 0.05}).result().metrics["loss:sum"]
    expected = -(lp * advantages - 0.025 * (lp - behaviour) ** 2).sum()
    assert dro_loss == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(Exception, match=r"needs loss_fn_config=\{'beta'"):
        trainer.forward([datum], "dro").result()


def test_save_and_load_state(served) -> None:
    service = served["client"](ALICE)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    datums = _datums(trainer.get_tokenizer())
    trainer.forward_backward(datums, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    saved = trainer.save_state("first").result().path
    before = trainer.forward(datums, "cross_entropy").result().metrics["loss:sum"]
    trainer.forward_backward(datums, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    assert trainer.forward(datums, "cross_entropy").result().metrics["loss:sum"] != pytest.approx(before, rel=1e-6)
    with pytest.warns(FutureWarning):
        trainer.load_state_with_optimizer(saved).result()
    assert trainer.forward(datums, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, rel=1e-6)
    # weights only: the optimizer starts afresh ("optimizer resets", the SDK's docs), so the next step equals a new
    # client's made from the same checkpoint; the moments the live client had would make it differ
    with pytest.warns(FutureWarning):
        trainer.load_state(saved).result()
    fresh = service.create_training_client_from_state(saved)
    after = []
    for client in (trainer, fresh):
        client.forward_backward(datums, "cross_entropy").result()
        client.optim_step(ADAM).result()
        after.append(client.forward(datums, "cross_entropy").result().metrics["loss:sum"])
    assert after[0] == pytest.approx(after[1], rel=1e-6)


def test_rest_client_lists_a_models_checkpoints(served) -> None:
    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as service:
        trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        first = trainer.save_state("a").result().path
        second = trainer.save_state("b").result().path
        sampler = trainer.save_weights_for_sampler("s").result().path
        rest = tinker.RestClient(base_url=served["url"], api_key=ALICE)
        listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
        assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [
            ("training", first),
            ("training", second),
            ("sampler", sampler),
        ]
        assert [c.checkpoint_id for c in listed] == ["weights/a", "weights/b", "sampler_weights/s"]
        assert all(c.size_bytes > 0 for c in listed[:2])
    other = tinker.RestClient(base_url=served["url"], api_key=BOB)  # another tenant: an unknown run
    with pytest.raises(tinker.NotFoundError):
        other.list_checkpoints(trainer.model_id).result()


def test_rest_client_reads_a_training_run_live_and_after_a_restart(served) -> None:
    """``RestClient.get_training_run_by_tinker_path`` (tinker-cookbook reads the run's ``renderer_name`` with it
    before loading a checkpoint): the live model's rank and ``user_metadata``, and after a restart the same from
    its newest checkpoint on disk; another tenant's run is unknown (404), malformed metadata a 400."""
    metadata = {"renderer_name": "role_colon", "recipe": "test"}
    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as service:
        trainer = service.create_lora_training_client(
            base_model="tiny", rank=4, seed=7, user_metadata=metadata
        ).result()
        path = trainer.save_state("run").result().path
        sampler = trainer.save_weights_for_sampler("run").result().path
        run = tinker.RestClient(base_url=served["url"], api_key=ALICE).get_training_run_by_tinker_path(path).result()
        assert (run.training_run_id, run.base_model, run.model_owner) == (trainer.model_id, "tiny", "alice")
        assert (run.is_lora, run.lora_rank, run.user_metadata) == (True, 4, metadata)
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
        assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=served["url"], api_key=BOB).get_training_run(trainer.model_id).result()
    session = _post(served["url"], "create_session", ALICE, json={}).json()["session_id"]
    bad = {"session_id": session, "model_seq_id": 0, "base_model": "tiny", "user_metadata": {"n": 1}}
    answer = _post(served["url"], "create_model", ALICE, json=bad)
    assert answer.status_code == 400 and "user_metadata must be an object of strings" in answer.json()["detail"]
    restarted = ServiceServer(TinkerService(served["server"].service.config, TenantKeys({ALICE: "alice"})), port=0)
    restarted.start()
    try:
        again = tinker.RestClient(base_url=restarted.url, api_key=ALICE).get_training_run(trainer.model_id).result()
        assert (again.lora_rank, again.user_metadata, again.last_checkpoint.tinker_path) == (4, metadata, path)
        assert again.last_sampler_checkpoint is None  # sampler weights live in memory only
    finally:
        restarted.stop()


def test_rest_client_deletes_checkpoints(served) -> None:
    """``RestClient.delete_checkpoint_from_tinker_path`` (tinker-cookbook's rolling checkpoints): a state checkpoint
    or an export leaves the disk and the listing, sampler weights the listing; another tenant's key and unknown ids
    get 404."""
    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as service:
        trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
        keep, gone = trainer.save_state("keep").result().path, trainer.save_state("gone").result().path
        sampler = trainer.save_weights_for_sampler("gone").result().path
        export = trainer.save_weights_external("gone").result().path
        rest, other = (tinker.RestClient(base_url=served["url"], api_key=key) for key in (ALICE, BOB))
        with pytest.raises(tinker.NotFoundError):
            other.delete_checkpoint_from_tinker_path(gone).result()
        rest.delete_checkpoint_from_tinker_path(gone).result()
        rest.delete_checkpoint_from_tinker_path(sampler).result()
        rest.delete_checkpoint_from_tinker_path(export).result()
        assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints] == [keep]
        for path in (gone, sampler, export):  # deleted: unknown now
            with pytest.raises(tinker.NotFoundError):
                rest.delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(Exception, match="not a checkpoint of this API key"):
            service.create_training_client_from_state(gone).result()
    answer = httpx.delete(
        f"{served['url']}/api/v1/training_runs/{trainer.model_id}/checkpoints/other/keep",
        headers={"X-API-Key": ALICE}, timeout=30,
    )  # fmt: skip
    assert answer.status_code == 400 and "sampler_weights/<name> or external_weights/<name>" in answer.json()["detail"]


def _post(url: str, path: str, key: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/api/v1/{path}", headers={"X-API-Key": key}, timeout=30, **kw)


def test_tenants_are_isolated(served) -> None:
    url = served["url"]
    alice = served["client"](ALICE)
    trainer = alice.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    path = trainer.save_weights_for_sampler("mine").result().path
    saved = trainer.save_state("mine").result().path
    bob = served["client"](BOB)
    with pytest.raises(Exception, match="not a saved sampler of this API key"):
        bob.create_sampling_client(model_path=path).result()
    model_id = trainer.model_id
    for route, body in [
        ("get_info", {"model_id": model_id}),
        ("optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1.0}}),
        ("save_weights", {"model_id": model_id, "path": "stolen"}),
        ("save_weights_for_sampler", {"model_id": model_id, "path": "stolen"}),
    ]:
        answer = _post(url, route, BOB, json=body)
        assert answer.status_code == 404 and "of this API key" in answer.json()["detail"], (route, answer.text)
    own = bob.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    with pytest.raises(Exception, match="not a checkpoint of this API key"), pytest.warns(FutureWarning):
        own.load_state(saved).result()
    request_id = _post(url, "optim_step", ALICE, json={"model_id": model_id, "adam_params": {}}).json()["request_id"]
    assert _post(url, "retrieve_future", BOB, json={"request_id": request_id}).status_code == 404


def test_malformed_requests_get_4xx_and_service_keeps_serving(served) -> None:
    url = served["url"]
    assert _post(url, "create_session", "tml-unknown-key-123", json={}).status_code == 401
    assert _post(url, "forward_backward", ALICE, content=b"\xff\x00garbage").status_code == 400
    answer = _post(url, "optim_step", ALICE, content=b"{not json")
    assert answer.status_code == 400 and "not JSON" in answer.json()["detail"]
    service = served["client"](ALICE)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    datum = _datums(trainer.get_tokenizer())[0]
    bad_tokens = types.Datum(
        model_input=types.ModelInput.from_ints([10**6]), loss_fn_inputs={"target_tokens": [1], "weights": [1.0]}
    )
    with pytest.raises(tinker.BadRequestError, match="outside"):
        trainer.forward_backward([bad_tokens], "cross_entropy").result()
    trainer = service.create_lora_training_client(
        base_model="tiny", rank=4, seed=5
    ).result()  # the SDK poisons a client after an error
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs"):
        trainer.forward_backward([datum], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="not served"):
        service.create_lora_training_client(base_model="other/model", rank=4).result()
    answer = _post(url, "optim_step", ALICE, json={"model_id": trainer.model_id, "adam_params": {"beta1": 1.5}})
    assert answer.status_code == 400 and "beta1, beta2" in answer.json()["detail"]
    sampler = service.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints(datum.model_input.to_ints())
    with pytest.raises(tinker.BadRequestError, match="max_tokens"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10**6)).result()
    too_long = {"model_id": "x", "adam_params": {}, "pad": "x" * (64 * 1024**2)}
    assert _post(url, "optim_step", ALICE, json=too_long).status_code == 413
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    assert trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0


def test_state_survives_a_service_restart(served) -> None:
    """save_state on the running service; a second service over the same output_dir (a restart) creates a
    training client from that checkpoint (create_training_client_from_state_with_optimizer) that trains on
    exactly as the first would have."""
    service = served["client"](ALICE)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    datums = _datums(trainer.get_tokenizer())
    trainer.forward_backward(datums, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    path = trainer.save_state("resume").result().path
    trainer.forward_backward(datums, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    expected = trainer.forward(datums, "cross_entropy").result().metrics["loss:sum"]

    old = served["server"].service.config
    restarted = ServiceServer(TinkerService(old, TenantKeys({ALICE: "alice", BOB: "bob"})), port=0).start()
    again = tinker.ServiceClient(base_url=restarted.url, api_key=ALICE)
    bob = tinker.ServiceClient(base_url=restarted.url, api_key=BOB)
    try:
        with pytest.raises(Exception, match="not a checkpoint of this API key"):
            bob.create_training_client_from_state(path).result()
        resumed = again.create_training_client_from_state_with_optimizer(path).result()
        resumed.forward_backward(datums, "cross_entropy").result()
        resumed.optim_step(ADAM).result()
        assert resumed.forward(datums, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            expected, rel=1e-6
        )
    finally:
        for client in (again, bob):  # before the restarted service goes: no heartbeat outlives it
            with contextlib.suppress(Exception):
                client.close("success").result(timeout=10)
        restarted.stop()


def test_forward_backward_custom_matches_cross_entropy(served) -> None:
    """The SDK runs a custom loss client-side over the returned log-probs, then sends its gradient back as
    cross_entropy weights: a custom NLL trains exactly as cross_entropy does."""
    service = served["client"](ALICE)
    builtin, custom = (service.create_lora_training_client(base_model="tiny", rank=4, seed=8).result() for _ in "ab")
    datums = _datums(builtin.get_tokenizer())

    def nll(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
        return loss, {}

    expected = builtin.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]
    assert custom.forward_backward_custom(datums, nll).result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    builtin.optim_step(ADAM).result()
    custom.optim_step(ADAM).result()
    after = builtin.forward(datums, "cross_entropy").result().metrics["loss:sum"]
    assert custom.forward(datums, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(after, rel=1e-5)


def test_concurrent_tenants_train_as_each_alone(served) -> None:
    """Alice (rank 4) and Bob (rank 8, other texts, other seed) train at the same time: their forward_backward
    requests run as one batch over the shared base (the batch-size metric says so), and each gets the losses of
    the plain torch loop with its own rank, seed and data, i.e. what it would get alone."""
    from concurrent.futures import ThreadPoolExecutor

    def batched_requests() -> float:
        registry = served["server"].service.metrics.registry
        labels = {"kind": "ForwardBackward"}
        count = registry.get_sample_value("shardforge_serve_batch_size_count", labels) or 0.0
        return count - (registry.get_sample_value("shardforge_serve_batch_size_bucket", labels | {"le": "1.0"}) or 0)

    tenants = {ALICE: (4, 9, TEXTS), BOB: (8, 11, ["5+5=10", "81/9=9", "2*21=42", "100-1=99"])}

    def run(key: str) -> list[float]:
        rank, seed, texts = tenants[key]
        service = served["client"](key)
        trainer = service.create_lora_training_client(base_model="tiny", rank=rank, seed=seed).result()
        datums = _datums(trainer.get_tokenizer(), texts)
        losses = []
        for _ in range(3):
            fwdbwd, step = trainer.forward_backward(datums, "cross_entropy"), trainer.optim_step(ADAM)
            losses.append(fwdbwd.result().metrics["loss:sum"])
            step.result()
        return losses

    before = batched_requests()
    with ThreadPoolExecutor(2) as pool:
        alice, bob = pool.map(run, [ALICE, BOB])
    assert batched_requests() - before >= 2, "no forward_backward ran in a batch of two tenants"
    for (rank, seed, texts), losses in zip(tenants.values(), (alice, bob), strict=True):
        reference = _reference_losses(served["model"], _datums(served["tokenizer"], texts), 3, seed=seed, rank=rank)
        assert losses == pytest.approx(reference, rel=1e-5)


def test_cli_serves_a_model_directory(served, tmp_path) -> None:
    """`shardforge serve --model DIR` in its own process answers the SDK."""
    import subprocess
    import sys
    import time

    from shardforge.mesh import free_port

    port = free_port()
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "serve", "--model", served["model"], "--port",
               str(port), "--name", "tiny-cli", "--api-key", f"carol={ALICE}", "--output-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/api/v1/healthz", timeout=2).raise_for_status()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.3)
        with tinker.ServiceClient(base_url=url, api_key=ALICE) as service:
            trainer = service.create_lora_training_client(base_model="tiny-cli", rank=2).result()
            datum = _datums(trainer.get_tokenizer())[0]
            assert trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_metrics_count_each_tenants_requests_tokens_and_errors(served) -> None:
    url = served["url"]
    ok = {"tenant": "bob", "kind": "ForwardBackward", "outcome": "ok"}
    before = _metric(url, "shardforge_serve_requests_total", **ok)
    tokens_before = _metric(url, "shardforge_serve_trained_tokens_total", tenant="bob", kind="ForwardBackward")
    alice_tokens = _metric(url, "shardforge_serve_trained_tokens_total", tenant="alice", kind="ForwardBackward")
    trainer = served["client"](BOB).create_lora_training_client(
        base_model="tiny", rank=4, seed=6
    ).result()  # fmt: skip
    datums = _datums(trainer.get_tokenizer())
    trainer.forward_backward(datums, "cross_entropy").result()
    assert _metric(url, "shardforge_serve_requests_total", **ok) == before + 1
    sent = sum(len(d.model_input.to_ints()) for d in datums)
    assert _metric(url, "shardforge_serve_trained_tokens_total", tenant="bob", kind="ForwardBackward") == (
        tokens_before + sent
    )
    assert _metric(url, "shardforge_serve_trained_tokens_total", tenant="alice", kind="ForwardBackward") == (
        alice_tokens  # another tenant's work is not counted as Alice's
    )
    assert _metric(url, "shardforge_serve_training_clients", tenant="bob") >= 1
    assert _metric(url, "shardforge_serve_job_seconds_count", kind="ForwardBackward") >= 1
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert "tml-" not in text  # tenant names only, never keys
