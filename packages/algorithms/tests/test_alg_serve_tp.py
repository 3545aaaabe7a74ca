"""`shardforge serve --nproc-per-node 2 --layout t2` (the base tensor-parallel over 2 gloo ranks, LoRA adapters
replicated, `serve.tp_lora`) against the same service on one rank, both driven by the real tinker SDK over 127.0.0.1.

Parity (rel 1e-5, AdamW moments 1e-4, as `test_alg_serve_ranks`): the TP ranks run the datums packed (one rank runs
them padded) and sum partial matmuls over the TP group, other float summation orders than one rank's. Every LoRA
target is adapted (attention, MLP and the vocab-parallel LM head), so each of the four gradient rules of
`serve.tp_lora` (column/row-parallel A and B) is exercised; a wrong reduction of any of them changes the adapters
after the first step far beyond the tolerance.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
from pathlib import Path

import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')"
)

import httpx  # noqa: E402
import torch  # noqa: E402
from tinker import types  # noqa: E402

from shardforge.algorithms.serve.config import ServeConfig  # noqa: E402
from shardforge.algorithms.serve.server import ServiceServer  # noqa: E402
from shardforge.algorithms.serve.service import TinkerService  # noqa: E402
from shardforge.algorithms.serve.tenants import TenantKeys  # noqa: E402
from shardforge.algorithms.testing.serve_datums import sft_datums, train_steps  # noqa: E402
from shardforge.algorithms.testing.serve_process import ServeProcess  # noqa: E402
from shardforge.algorithms.testing.serve_state import assert_states_close, read_saved_state  # noqa: E402

ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789"
KEYS = {ALICE: "alice", BOB: "bob"}
TEXTS = ["12+34=46", "7*8=56", "99-9=90", "5+5=10", "64/8=8"]
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
WAIT = 120
REL = 1e-5


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve_tp")
    tiny = tiny_model(root)
    out = root / "out"
    config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(out), max_tokens=32)
    one = ServiceServer(TinkerService(config, TenantKeys(KEYS)), port=0).start()
    tp = ServeProcess(tiny["model"], KEYS, out, nproc=2, extra=["--layout", "t2", "--batch-window-ms", "500"],
                      log=root / "t2.log")  # fmt: skip
    clients: list = []

    def client(url: str, key: str = ALICE):
        clients.append(tinker.ServiceClient(base_url=url, api_key=key))
        return clients[-1]

    yield {"one": one.url, "t2": tp.url, "process": tp, "tokenizer": tiny["tokenizer"], "out": out, "client": client}
    for made in clients:
        with contextlib.suppress(Exception):
            made.close("success").result(timeout=10)
    one.stop()
    assert tp.stop() in (0, 128 + signal.SIGTERM), tp.output()[-3000:]


def _datums(tokenizer, texts: list[str] = TEXTS) -> list[types.Datum]:
    return sft_datums(tokenizer, texts)


def _steps(trainer, batches: list[list[types.Datum]], loss: str = "cross_entropy") -> list[float]:
    return [value for value, _ in train_steps(trainer, batches, ADAM, loss=loss, timeout=WAIT)]


def test_sft_loop_matches_one_rank(services) -> None:
    datums = _datums(services["tokenizer"])
    batches = [datums, datums, datums[:1], datums]
    runs = {}
    for name in ("one", "t2"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=7)
        trainer = trainer.result(timeout=WAIT)
        losses = _steps(trainer, batches)
        forward = trainer.forward(datums, "cross_entropy").result(timeout=WAIT)
        runs[name] = (losses, forward, trainer.save_state("final").result(timeout=WAIT).path)
    (losses_1, forward_1, path_1), (losses_2, forward_2, path_2) = runs["one"], runs["t2"]
    assert losses_2 == pytest.approx(losses_1, rel=REL)
    assert losses_1[-1] < losses_1[0]
    for out_1, out_2 in zip(forward_1.loss_fn_outputs, forward_2.loss_fn_outputs, strict=True):
        assert out_2["logprobs"].tolist() == pytest.approx(out_1["logprobs"].tolist(), rel=REL, abs=1e-6)
    state_1, state_2 = (
        read_saved_state(services["out"], "alice", path_1),
        read_saved_state(services["out"], "alice", path_2),
    )
    adapted = {key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for key in state_2["model"]}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert all(v.abs().sum() > 0 for k, v in state_2["model"].items() if "lora_B" in k)  # every adapter trained
    assert_states_close(state_2, state_1)
    # the 1-rank checkpoint (the same format) loads into the TP ranks and gives the 1-rank log-probs
    resumed = services["client"](services["t2"]).create_training_client_from_state_with_optimizer(path_1)
    again = resumed.result(timeout=WAIT).forward(datums, "cross_entropy").result(timeout=WAIT)
    for out_1, out_2 in zip(forward_1.loss_fn_outputs, again.loss_fn_outputs, strict=True):
        assert out_2["logprobs"].tolist() == pytest.approx(out_1["logprobs"].tolist(), rel=REL, abs=1e-6)


def test_two_tenants_at_once_match_one_rank(services) -> None:
    """Two tenants of different ranks in one batch (the token-span plan of `serve.tp_lora`)."""
    datums = _datums(services["tokenizer"])

    def tenant(url: str, key: str, rank: int, texts: slice) -> list[float]:
        trainer = services["client"](url, key).create_lora_training_client(base_model="tiny", rank=rank, seed=rank)
        return _steps(trainer.result(timeout=WAIT), [datums[texts]] * 3)

    expected = [tenant(services["one"], ALICE, 4, slice(0, 3)), tenant(services["one"], BOB, 8, slice(1, 5))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(tenant, services["t2"], ALICE, 4, slice(0, 3)),
                pool.submit(tenant, services["t2"], BOB, 8, slice(1, 5))]  # fmt: skip
        got = [run.result(timeout=120) for run in runs]
    assert got[0] == pytest.approx(expected[0], rel=REL)
    assert got[1] == pytest.approx(expected[1], rel=REL)
    assert _batched_requests(httpx.get(f"{services['t2']}/metrics").text) > 0


def _batched_requests(metrics: str) -> float:
    """ForwardBackward requests that ran in a batch of 2 or more (``/metrics``' batch-size histogram)."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("shardforge_serve_batch_size_bucket") and 'kind="ForwardBackward"' in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            counts[bound] = float(line.rsplit(" ", 1)[1])
    return counts["+Inf"] - counts["1.0"]


def test_forward_backward_custom_matches_one_rank(services) -> None:
    """The SDK's custom loss (computed client-side over `forward`'s log-probs, its gradient sent back as a
    forward_backward) over the TP ranks: the step equals the 1-rank one."""
    datums = _datums(services["tokenizer"])

    def squared(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return sum(
            (lp**2 * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True)
        ), {}

    runs = {}
    for name in ("one", "t2"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=9)
        trainer = trainer.result(timeout=WAIT)
        loss = trainer.forward_backward_custom(datums, squared).result(timeout=WAIT).metrics["loss:sum"]
        trainer.optim_step(ADAM).result(timeout=WAIT)
        runs[name] = (loss, trainer.forward(datums, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"])
    assert runs["t2"] == pytest.approx(runs["one"], rel=REL)
    assert runs["one"][0] > 0


def test_rl_losses_and_sampling_from_saved_weights_match_one_rank(services) -> None:
    """importance_sampling / ppo / cispo steps over the TP ranks, then sampling (rank 0, from the saved adapters)."""
    tokenizer = services["tokenizer"]
    rl = []
    for i, datum in enumerate(_datums(tokenizer)[:3]):
        n = datum.model_input.length
        rl.append(types.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"],
                            "logprobs": [-2.0 - 0.1 * i] * n, "advantages": [1.0 - i] * n},
        ))  # fmt: skip
    prompt = types.ModelInput.from_ints(tokenizer("12+")["input_ids"])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    runs = {}
    for name in ("one", "t2"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=5)
        trainer = trainer.result(timeout=WAIT)
        losses = [_steps(trainer, [rl], loss)[0] for loss in ("importance_sampling", "ppo", "cispo")]
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=WAIT)
        samples = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=WAIT)
        assert all(1 <= len(s.tokens) <= 6 for s in samples.sequences)
        runs[name] = (losses, [s.tokens for s in samples.sequences], sampler.compute_logprobs(prompt).result(WAIT))
    assert runs["t2"][0] == pytest.approx(runs["one"][0], rel=REL)
    assert runs["t2"][1] == runs["one"][1]  # the adapters agree to ~1e-7: the seeded samples are the same tokens
    assert runs["t2"][2][1:] == pytest.approx(runs["one"][2][1:], rel=REL, abs=1e-6)
    # full fine-tuning is sharded with FSDP/HSDP only: on a TP layout it is a 400, and the service keeps serving
    from shardforge.algorithms.serve.client import create_full_training_client

    with pytest.raises(tinker.BadRequestError, match="tensor-parallel"):
        create_full_training_client(services["client"](services["t2"]), "tiny")
    assert services["process"].proc.poll() is None


def test_d2t2_sft_loop_matches_one_rank(services, tmp_path: Path) -> None:
    """4 ranks: 2 data-parallel replicas (FSDP) of a 2-way tensor-parallel base; gradients summed over all 4."""
    datums = _datums(services["tokenizer"])
    # 5 datums: 2 on dp rank 0, 3 on dp rank 1; one datum: dp rank 0 runs a weight-0 row. (Seed 21 with
    # [datums, datums[:1], datums] leaves one adapter 1.2e-4 off at d4 and d2t2 alike: a near-zero gradient entry
    # that AdamW's eps amplifies, not a sharding error; this schedule is the one `test_alg_serve_ranks` uses.)
    batches = [datums, datums, datums[:1], datums]
    d2t2 = ServeProcess(str(services["out"].parent / "model"), KEYS, services["out"], nproc=4,
                        extra=["--layout", "d2t2"], log=tmp_path / "d2t2.log")  # fmt: skip
    try:
        runs = {}
        for name, url in (("one", services["one"]), ("d2t2", d2t2.url)):
            client = tinker.ServiceClient(base_url=url, api_key=ALICE)
            trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result(timeout=WAIT)
            losses = _steps(trainer, batches)
            runs[name] = (losses, trainer.save_state("d2t2").result(timeout=WAIT).path)
            client.close("success").result(timeout=10)
    finally:
        code = d2t2.stop()
    assert code in (0, 128 + signal.SIGTERM), d2t2.output()[-3000:]
    assert runs["d2t2"][0] == pytest.approx(runs["one"][0], rel=REL)
    out = services["out"]
    assert_states_close(read_saved_state(out, "alice", runs["d2t2"][1]), read_saved_state(out, "alice", runs["one"][1]))
