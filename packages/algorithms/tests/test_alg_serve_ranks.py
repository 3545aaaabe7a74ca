"""`shardforge serve --nproc-per-node 2` (the base sharded over 2 gloo ranks) against the same service on one rank,
both driven by the real tinker SDK over 127.0.0.1 and sharing one output directory (checkpoints move between them).

Parity: the same SFT loop gives the same per-step losses and the same adapters and AdamW state on 2 ranks as on 1
(rel 1e-5: the ranks sum their halves of each loss and of each gradient, a different float summation order than
one rank's; measured differences are ~1e-7). Also: two tenants batched at once, sampling, a checkpoint saved on one
rank count and resumed on the other, a restart at 2 ranks, bad requests, and a rank that dies taking the service
down.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
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
# 5 datums: 2 on rank 0, 3 on rank 1
TEXTS = ["12+34=46", "7*8=56", "99-9=90", "5+5=10", "64/8=8"]
ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
WAIT = 120  # seconds for any SDK result: a service that died fails the test instead of leaving the SDK retrying
REL = 1e-5  # the 2-rank sums add the ranks' partial sums: another float summation order than one rank (~1e-7 seen)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve_ranks")
    tiny = tiny_model(root)
    out = root / "out"  # shared: a checkpoint one service saves, the other loads
    config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(out), max_tokens=32)
    one = ServiceServer(TinkerService(config, TenantKeys(KEYS)), port=0).start()
    # a long batch window: the two-tenant test's requests meet in one batch
    two = ServeProcess(tiny["model"], KEYS, out, nproc=2, extra=["--batch-window-ms", "500"], log=root / "two.log")
    clients: list = []

    def client(url: str, key: str = ALICE):  # closed before the servers stop: no SDK heartbeat outlives the module
        clients.append(tinker.ServiceClient(base_url=url, api_key=key))
        return clients[-1]

    yield {"one": one.url, "two": two.url, "process": two, "model": tiny["model"], "tokenizer": tiny["tokenizer"],
           "out": out, "client": client}  # fmt: skip
    for made in clients:
        with contextlib.suppress(Exception):
            made.close("success").result(timeout=10)
    one.stop()
    assert two.stop() in (0, 128 + signal.SIGTERM), two.output()[-3000:]


def _datums(tokenizer, texts: list[str] = TEXTS) -> list[types.Datum]:
    return sft_datums(tokenizer, texts)


def _steps(trainer, batches: list[list[types.Datum]]) -> list[float]:
    return [loss for loss, _ in train_steps(trainer, batches, ADAM, timeout=WAIT)]


def test_sft_loop_matches_one_rank(services) -> None:
    datums = _datums(services["tokenizer"])
    # the last step has one datum: rank 1 runs it, rank 0 runs a weight-0 row (FSDP needs both in every pass)
    batches = [datums, datums, datums[:1], datums]
    runs = {}
    for name in ("one", "two"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=7)
        trainer = trainer.result(timeout=WAIT)
        losses = _steps(trainer, batches)
        forward = trainer.forward(datums, "cross_entropy").result(timeout=WAIT)
        runs[name] = (losses, forward, trainer.save_state("final").result(timeout=WAIT).path)
    (losses_1, forward_1, path_1), (losses_2, forward_2, path_2) = runs["one"], runs["two"]
    assert losses_2 == pytest.approx(losses_1, rel=REL)
    assert losses_1[-1] < losses_1[0]
    for out_1, out_2 in zip(forward_1.loss_fn_outputs, forward_2.loss_fn_outputs, strict=True):
        assert out_2["logprobs"].tolist() == pytest.approx(out_1["logprobs"].tolist(), rel=REL, abs=1e-6)
    state_1, state_2 = (
        read_saved_state(services["out"], "alice", path_1),
        read_saved_state(services["out"], "alice", path_2),
    )
    assert any(v.abs().sum() > 0 for k, v in state_2["model"].items() if "lora_B" in k)  # the adapters trained
    assert_states_close(state_2, state_1)


def test_two_tenants_at_once_match_one_rank(services) -> None:
    datums = _datums(services["tokenizer"])

    def tenant(url: str, key: str, rank: int, texts: slice) -> list[float]:
        trainer = services["client"](url, key).create_lora_training_client(base_model="tiny", rank=rank, seed=rank)
        return _steps(trainer.result(timeout=WAIT), [datums[texts]] * 3)

    expected = [tenant(services["one"], ALICE, 4, slice(0, 3)), tenant(services["one"], BOB, 8, slice(1, 5))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(tenant, services["two"], ALICE, 4, slice(0, 3)),
                pool.submit(tenant, services["two"], BOB, 8, slice(1, 5))]  # fmt: skip
        got = [run.result(timeout=120) for run in runs]
    assert got[0] == pytest.approx(expected[0], rel=REL)
    assert got[1] == pytest.approx(expected[1], rel=REL)
    # they met in one batch at least once (the multi-tenant path of the ranks ran)
    assert _batched_requests(httpx.get(f"{services['two']}/metrics").text) > 0


def _batched_requests(metrics: str) -> float:
    """ForwardBackward requests that ran in a batch of 2 or more (``/metrics``' batch-size histogram)."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("shardforge_serve_batch_size_bucket") and 'kind="ForwardBackward"' in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            counts[bound] = float(line.rsplit(" ", 1)[1])
    return counts["+Inf"] - counts["1.0"]


def test_forward_backward_custom_matches_one_rank(services) -> None:
    """The SDK runs a custom loss client-side over `forward`'s log-probs and sends its gradient back as a
    forward_backward: over 2 ranks the step equals the 1-rank one."""
    datums = _datums(services["tokenizer"])

    def squared(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return sum(
            (lp**2 * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True)
        ), {}

    runs = {}
    for name in ("one", "two"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=9)
        trainer = trainer.result(timeout=WAIT)
        loss = trainer.forward_backward_custom(datums, squared).result(timeout=WAIT).metrics["loss:sum"]
        trainer.optim_step(ADAM).result(timeout=WAIT)
        runs[name] = (loss, trainer.forward(datums, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"])
    assert runs["two"] == pytest.approx(runs["one"], rel=REL)


def test_sampling_on_rank_zero(services) -> None:
    prompt = types.ModelInput.from_ints(services["tokenizer"]("12+")["input_ids"])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    samples, logprobs = {}, {}
    for name in ("one", "two"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=1)
        trainer = trainer.result(timeout=WAIT)
        _steps(trainer, [_datums(services["tokenizer"])])
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=WAIT)
        samples[name] = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=WAIT)
        logprobs[name] = sampler.compute_logprobs(prompt).result(timeout=WAIT)
        assert all(1 <= len(s.tokens) <= 6 for s in samples[name].sequences)
    # the trained adapters agree to ~1e-7, so the seeded samples are the same tokens
    assert [s.tokens for s in samples["two"].sequences] == [s.tokens for s in samples["one"].sequences]
    assert logprobs["two"][1:] == pytest.approx(logprobs["one"][1:], rel=REL, abs=1e-6)


def test_checkpoints_move_between_rank_counts(services) -> None:
    datums = _datums(services["tokenizer"])
    for saver, loader in (("two", "one"), ("one", "two")):
        trainer = services["client"](services[saver]).create_lora_training_client(base_model="tiny", rank=4, seed=11)
        trainer = trainer.result(timeout=WAIT)
        _steps(trainer, [datums, datums])
        path = trainer.save_state("mid").result(timeout=WAIT).path
        expected = _steps(trainer, [datums, datums[:1]])
        resumed = (
            services["client"](services[loader])
            .create_training_client_from_state_with_optimizer(path)
            .result(timeout=WAIT)
        )
        assert _steps(resumed, [datums, datums[:1]]) == pytest.approx(expected, rel=REL), (saver, loader)
        # into a live model too: the loader's client, trained on, goes back to the checkpoint on every rank
        with pytest.warns(FutureWarning, match="deprecated"):  # deprecated in the SDK, still served
            resumed.load_state_with_optimizer(path).result(timeout=WAIT)
        assert _steps(resumed, [datums, datums[:1]]) == pytest.approx(expected, rel=REL), (saver, loader, "live")


def test_bad_requests_are_4xx_and_the_ranks_keep_serving(services) -> None:
    url = services["two"]
    service = services["client"](url)
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result(timeout=WAIT)
    datum = _datums(services["tokenizer"])[0]
    bad_tokens = types.Datum(
        model_input=types.ModelInput.from_ints([10**6]), loss_fn_inputs={"target_tokens": [1], "weights": [1.0]}
    )
    with pytest.raises(tinker.BadRequestError, match="outside"):
        trainer.forward_backward([bad_tokens], "cross_entropy").result(timeout=WAIT)
    # a loss that fails on the ranks (clip thresholds out of range): the ranks agree, the request gets the error
    trainer = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result(timeout=WAIT)
    rl = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"],
                        "logprobs": [-1.0] * datum.model_input.length, "advantages": [1.0] * datum.model_input.length},
    )  # fmt: skip
    with pytest.raises(Exception, match="clip_low_threshold"):
        trainer.forward_backward([rl, rl], "ppo", loss_fn_config={"clip_low_threshold": 2.0}).result(timeout=WAIT)
    # still serving, and the RL losses over the ranks are the 1-rank ones
    losses = {}
    for name in ("one", "two"):
        trainer = services["client"](services[name]).create_lora_training_client(base_model="tiny", rank=4, seed=5)
        trainer = trainer.result(timeout=WAIT)
        _steps(trainer, [[datum, datum, datum]])
        losses[name] = [
            trainer.forward_backward([rl, rl, rl], loss).result(timeout=WAIT).metrics["loss:sum"]
            for loss in ("importance_sampling", "ppo", "cispo")
        ]
    assert losses["two"] == pytest.approx(losses["one"], rel=REL)
    assert services["process"].proc.poll() is None


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_restart_at_two_ranks_resumes_and_a_dead_rank_stops_the_service(services, tmp_path: Path) -> None:
    from shardforge.algorithms.testing.processes import alive

    datums = _datums(services["tokenizer"])
    trainer = services["client"](services["two"]).create_lora_training_client(base_model="tiny", rank=4, seed=13)
    trainer = trainer.result(timeout=WAIT)
    _steps(trainer, [datums])
    path = trainer.save_state("before-restart").result(timeout=WAIT).path
    expected = _steps(trainer, [datums, datums])
    again = ServeProcess(services["model"], KEYS, services["out"], nproc=2, log=tmp_path / "again.log")
    try:
        client = tinker.ServiceClient(base_url=again.url, api_key=ALICE)
        resumed = client.create_training_client_from_state_with_optimizer(path).result(timeout=WAIT)
        assert _steps(resumed, [datums, datums]) == pytest.approx(expected, rel=REL)
        client.close("success").result(timeout=10)  # before the service goes: no heartbeat left polling it
        ranks = again.ranks()
        assert len(ranks) == 2, ranks
        follower = next(pid for pid in ranks if _environ(pid).get("RANK") == "1")
        os.kill(follower, signal.SIGKILL)
        code = again.proc.wait(timeout=60)
    finally:
        again.stop()
    assert code not in (0, None)
    assert "rank 1 exited with code -9" in again.output(), again.output()[-3000:]
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in ranks), "a rank outlived the service"


def test_layouts_other_than_fsdp_and_tp_are_refused_before_any_rank_starts(tmp_path: Path, capsys) -> None:
    from shardforge.algorithms.cli.main import main
    from shardforge.algorithms.serve.ranks import check_serve_layout

    assert check_serve_layout("d-1", 4).dp_shard == 4
    assert check_serve_layout("r2d2", 4).dp_replicate == 2
    assert check_serve_layout("d2t2", 4).tp == 2  # tensor parallel: `test_alg_serve_tp`
    with pytest.raises(ValueError, match=r"cp=2; shardforge serve shards the base with FSDP \(d\), HSDP \(r, d\) and "):
        check_serve_layout("d1c2", 2)
    with pytest.raises(ValueError, match=r"pp=2, ep=2;.* e.g. d4, r2d2, t2 or d2t2"):
        check_serve_layout("p2e2", 4)
    (tmp_path / "model").mkdir()
    assert main(["serve", "--model", str(tmp_path / "model"), "--nproc-per-node", "2", "--layout", "d3"]) == 1
    assert "world_size=2" in capsys.readouterr().err


def test_split_rows_gives_each_rank_a_contiguous_chunk_and_a_weight_0_row_when_it_has_none() -> None:
    from shardforge.algorithms.serve.codecs import FwdBwdRequest, WireDatum
    from shardforge.algorithms.serve.rank_batch import split_rows, token_slice

    def request(lengths: list[int]) -> FwdBwdRequest:
        data = [WireDatum(tokens=[1] * n) for n in lengths]
        return FwdBwdRequest(model_id="m", seq_id=0, loss_fn="cross_entropy", forward_only=False, loss_fn_config={},
                             data=data)  # fmt: skip

    a, b = request([2, 3, 4]), request([5, 6])
    items = [("model-a", a), ("model-b", b)]
    first, datums_0 = split_rows(items, 2, 0)  # type: ignore[arg-type]
    second, datums_1 = split_rows(items, 2, 1)  # type: ignore[arg-type]
    assert [len(d.tokens) for d in datums_0] == [2, 3] and [len(d.tokens) for d in datums_1] == [4, 5, 6]
    assert [(i.start, i.rows, len(i.data)) for i in first] == [(0, 2, 2), (2, 0, 0)]
    assert [(i.start, i.rows, len(i.data)) for i in second] == [(0, 1, 1), (1, 2, 2)]
    assert token_slice(second, 1) == slice(4, 15)
    # one datum over two ranks: rank 0 runs it with weight 0 (its request has a row there but no datum)
    alone, datums = split_rows([("model-a", request([7]))], 2, 0)  # type: ignore[list-item]
    assert [len(d.tokens) for d in datums] == [7] and (alone[0].rows, alone[0].data) == (1, [])
    other, datums = split_rows([("model-a", request([7]))], 2, 1)  # type: ignore[list-item]
    assert (other[0].rows, len(other[0].data)) == (1, 1)
