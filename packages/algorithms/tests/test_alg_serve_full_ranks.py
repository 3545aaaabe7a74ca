"""Full fine-tuning on `shardforge serve --nproc-per-node 2` (the trainable copy sharded with FSDP over 2 gloo ranks)
against the same service on one rank, both driven by the real tinker SDK over 127.0.0.1 and sharing one output
directory, so DCP checkpoints move between them (2 -> 1 and 1 -> 2; the loader never held the model: a resume as
after a restart).

Parity: per-step SFT losses, the gradient norm of each ``optim_step``, the final weights and the AdamW moments on 2
ranks equal the 1-rank ones (rel 1e-5: the ranks' partial sums are another float summation order). Adam is
(nearly) invariant to a constant gradient scale, so the gradient norm and a clipped step are what show that the
ranks' gradients sum to the 1-rank gradient (FSDP's reduce-scatter averages; `serve.full_ranks` scales by dp).
Also: a checkpoint of an earlier service version (``state.pt``) still loads on 1 and on 2 ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')"
)

import torch  # noqa: E402
from tinker import types  # noqa: E402

from shardforge.algorithms.serve.client import create_full_training_client  # noqa: E402
from shardforge.algorithms.serve.config import ServeConfig  # noqa: E402
from shardforge.algorithms.serve.server import ServiceServer  # noqa: E402
from shardforge.algorithms.serve.service import TinkerService  # noqa: E402
from shardforge.algorithms.serve.tenants import TenantKeys  # noqa: E402
from shardforge.algorithms.testing.fault_injection import FAULT_FAIL_SAVE_ENV, fault_env  # noqa: E402
from shardforge.algorithms.testing.serve_datums import sft_datums, train_steps  # noqa: E402
from shardforge.algorithms.testing.serve_process import ServeProcess  # noqa: E402
from shardforge.algorithms.testing.serve_state import assert_states_close, read_saved_state  # noqa: E402

ALICE = "tml-alice-0123456789"
KEYS = {ALICE: "alice"}
TEXTS = ["12+34=46", "7*8=56", "99-9=90", "5+5=10", "64/8=8"]  # 2 datums on rank 0, 3 on rank 1
ADAM = types.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
# a clipped step: its update scales with the gradient (the plain Adam steps barely do)
CLIPPED = types.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=0.05)
WAIT = 120
REL = 1e-5


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve_full_ranks")
    tiny = tiny_model(root)
    out = root / "out"
    config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(out), max_tokens=32)
    one = ServiceServer(TinkerService(config, TenantKeys(KEYS)), port=0).start()
    # a full disk on rank 1 in one save, armed by deleting the marker (test_a_failed_sharded_save_...)
    marker = root / "fail_save.marker"
    marker.write_text("disarmed")
    faults = fault_env(**{FAULT_FAIL_SAVE_ENV: f"1:{marker}"})
    two = ServeProcess(tiny["model"], KEYS, out, nproc=2, log=root / "two.log", env=faults)
    clients = {name: tinker.ServiceClient(base_url=url, api_key=ALICE) for name, url in (("one", one.url),
               ("two", two.url))}  # fmt: skip
    yield {"one": one, "two": two, "clients": clients, "out": out, "tokenizer": tiny["tokenizer"], "marker": marker}
    for client in clients.values():
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=10)
    one.stop()
    assert two.stop() in (0, 128 + signal.SIGTERM), two.output()[-3000:]


def _datums(tokenizer, texts: list[str] = TEXTS) -> list[types.Datum]:
    return sft_datums(tokenizer, texts)


def _steps(trainer, batches: list[list[types.Datum]], adam=ADAM) -> list[tuple[float, float]]:
    """Per step its loss and the optim_step's gradient norm."""
    return train_steps(trainer, batches, adam, timeout=WAIT)


def _flat(steps: list[tuple[float, float]]) -> list[float]:
    return [value for step in steps for value in step]


def test_full_fine_tuning_on_two_ranks_matches_one_rank(services) -> None:
    datums = _datums(services["tokenizer"])
    runs = {}
    for name in ("one", "two"):
        trainer = create_full_training_client(services["clients"][name], "tiny")
        assert trainer.get_info().is_lora is False
        # the last step has one datum: rank 1 runs it, rank 0 a weight-0 row (FSDP needs both in every pass)
        steps = _steps(trainer, [datums, datums[:3]]) + _steps(trainer, [datums], CLIPPED)
        # two forward_backward calls before one optim_step: the gradients accumulate (a sum, as on one rank)
        first = trainer.forward_backward(datums[:2], "cross_entropy")
        second = trainer.forward_backward(datums[2:], "cross_entropy")
        losses = [first.result(timeout=WAIT).metrics["loss:sum"], second.result(timeout=WAIT).metrics["loss:sum"]]
        steps.append((sum(losses), trainer.optim_step(CLIPPED).result(timeout=WAIT).metrics["grad_norm:mean"]))
        steps += _steps(trainer, [datums[:1]])
        forward = trainer.forward(datums, "cross_entropy").result(timeout=WAIT)
        runs[name] = (steps, forward, trainer.save_state("final").result(timeout=WAIT).path)
    (steps_1, forward_1, path_1), (steps_2, forward_2, path_2) = runs["one"], runs["two"]
    assert [s for s, _ in steps_1][-1] < 0.9 * steps_1[0][0]  # it trained
    for (loss_1, norm_1), (loss_2, norm_2) in zip(steps_1, steps_2, strict=True):
        assert loss_2 == pytest.approx(loss_1, rel=REL)
        assert norm_2 == pytest.approx(norm_1, rel=REL)  # a halved (averaged) gradient fails here
    assert all(norm > 0.05 for _, norm in steps_1[2:4])  # the clipped steps did clip
    for out_1, out_2 in zip(forward_1.loss_fn_outputs, forward_2.loss_fn_outputs, strict=True):
        assert out_2["logprobs"].tolist() == pytest.approx(out_1["logprobs"].tolist(), rel=REL, abs=1e-6)
    state_1, state_2 = (
        read_saved_state(services["out"], "alice", path_1),
        read_saved_state(services["out"], "alice", path_2),
    )
    assert len(state_2["model"]) > 10 and state_2["optimizer"]["state"].keys() == state_2["model"].keys()
    assert_states_close(state_2, state_1)


def test_full_checkpoints_move_between_rank_counts(services) -> None:
    """Saved sharded on 2 ranks, resumed on 1, and the reverse: the resumed run continues as the uninterrupted one.
    The loader never held the model (as after a service restart)."""
    datums = _datums(services["tokenizer"])
    for saver, loader in (("two", "one"), ("one", "two")):
        trainer = create_full_training_client(services["clients"][saver], "tiny")
        _steps(trainer, [datums, datums[:2]])
        path = trainer.save_state("mid").result(timeout=WAIT).path
        expected = _steps(trainer, [datums, datums[:1]], CLIPPED)
        rest = tinker.RestClient(base_url=services[loader].url, api_key=ALICE)
        listed = rest.list_checkpoints(trainer.model_id).result(timeout=WAIT)
        assert path in [c.tinker_path for c in listed.checkpoints], (saver, loader)
        resumed = (
            services["clients"][loader].create_training_client_from_state_with_optimizer(path).result(timeout=WAIT)
        )
        assert resumed.get_info().is_lora is False
        got = _steps(resumed, [datums, datums[:1]], CLIPPED)
        assert _flat(got) == pytest.approx(_flat(expected), rel=REL), (saver, loader)
        # weights only, into the live model: the weights go back, the optimizer starts afresh (the SDK's docs)
        with pytest.warns(FutureWarning, match="deprecated"):  # deprecated in the SDK, still served
            resumed.load_state(path).result(timeout=WAIT)
        forward = resumed.forward(datums, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        assert forward == pytest.approx(expected[0][0], rel=REL), (saver, loader)


def test_sampling_and_export_of_a_sharded_model(services) -> None:
    """save_weights_for_sampler and save_weights_external gather the sharded weights whole onto rank 0."""
    from transformers import AutoModelForCausalLM

    datums = _datums(services["tokenizer"])
    prompt = types.ModelInput.from_ints(services["tokenizer"]("12+")["input_ids"])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    samples, logprobs, exports = {}, {}, {}
    for name in ("one", "two"):
        trainer = create_full_training_client(services["clients"][name], "tiny")
        _steps(trainer, [datums, datums])
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=WAIT)
        samples[name] = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=WAIT)
        ids = [*datums[0].model_input.to_ints(), datums[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
        logprobs[name] = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=WAIT)
        expected = trainer.forward([datums[0]], "cross_entropy").result(timeout=WAIT).loss_fn_outputs[0]
        assert logprobs[name][3:] == pytest.approx(expected["logprobs"].tolist()[2:], abs=1e-4), name
        export = trainer.save_weights_external("hf").result(timeout=WAIT)
        model_id = export.path.removeprefix("tinker://").split("/")[0]
        folder = services["out"] / "alice" / model_id / "external_weights" / "hf"
        exports[name] = dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    assert [s.tokens for s in samples["two"].sequences] == [s.tokens for s in samples["one"].sequences]
    assert logprobs["two"][1:] == pytest.approx(logprobs["one"][1:], rel=REL, abs=1e-6)
    assert exports["two"].keys() == exports["one"].keys()
    for key, value in exports["one"].items():
        torch.testing.assert_close(exports["two"][key], value, rtol=REL, atol=1e-6, msg=key)


def _write_legacy(out: Path, model, name: str) -> str:
    """``model`` (a live model of the 1-rank service) saved as an earlier service version did: one ``state.pt``."""
    folder = out / model.owner / model.model_id / "weights" / name
    folder.mkdir(parents=True)
    torch.save({
        "adapter": model.adapter_state(), "optimizer": model.optimizer.state_dict(),
        "rank": None if model.lora is None else model.lora.r,
        "target_modules": [] if model.lora is None else list(model.lora.target_modules),
        "steps": model.steps, "base_model": model.base_model, "user_metadata": dict(model.user_metadata),
    }, folder / "state.pt")  # fmt: skip
    return f"tinker://{model.model_id}/weights/{name}"


def test_state_pt_checkpoints_of_earlier_versions_still_load(services) -> None:
    datums = _datums(services["tokenizer"])
    registry = services["one"].service.registry
    lora = services["clients"]["one"].create_lora_training_client(base_model="tiny", rank=4, seed=5).result(WAIT)
    full = create_full_training_client(services["clients"]["one"], "tiny")
    paths, expected = {}, {}
    for kind, trainer in (("lora", lora), ("full", full)):
        _steps(trainer, [datums, datums[:2]])
        paths[kind] = _write_legacy(services["out"], registry.model("alice", trainer.model_id), "legacy")
        expected[kind] = _flat(_steps(trainer, [datums, datums[:1]]))
    rest = tinker.RestClient(base_url=services["one"].url, api_key=ALICE)
    assert paths["lora"] in [c.tinker_path for c in rest.list_checkpoints(lora.model_id).result(WAIT).checkpoints]
    for name in ("one", "two"):  # a LoRA state.pt loads on any number of ranks (its adapters are replicated)
        resumed = services["clients"][name].create_training_client_from_state_with_optimizer(paths["lora"])
        got = _flat(_steps(resumed.result(timeout=WAIT), [datums, datums[:1]]))
        assert got == pytest.approx(expected["lora"], rel=REL), name
    resumed = services["clients"]["one"].create_training_client_from_state_with_optimizer(paths["full"])
    assert _flat(_steps(resumed.result(timeout=WAIT), [datums, datums[:1]])) == pytest.approx(expected["full"], rel=REL)
    # a full fine-tuning state.pt on 2 ranks: the request's (user) error says how to move it to DCP, and the service
    # keeps serving
    with pytest.raises(tinker.RequestFailedError, match="nproc-per-node 1 and save_state it again") as failed:
        services["clients"]["two"].create_training_client_from_state_with_optimizer(paths["full"]).result(WAIT)
    assert failed.value.category is types.RequestErrorCategory.User
    assert services["two"].proc.poll() is None


def test_restart_at_two_ranks_resumes_a_full_fine_tuning_checkpoint(services, tmp_path: Path) -> None:
    """Saved FSDP-sharded (d2), resumed by a restarted service whose ranks replicate the copy (HSDP r2d1)."""
    datums = _datums(services["tokenizer"])
    trainer = create_full_training_client(services["clients"]["two"], "tiny")
    _steps(trainer, [datums])
    path = trainer.save_state("before-restart").result(timeout=WAIT).path
    expected = _flat(_steps(trainer, [datums, datums[:1]], CLIPPED))
    model = str(services["out"].parent / "model")
    again = ServeProcess(model, KEYS, services["out"], nproc=2, extra=["--layout", "r2d1"], log=tmp_path / "again.log")
    try:
        client = tinker.ServiceClient(base_url=again.url, api_key=ALICE)
        resumed = client.create_training_client_from_state_with_optimizer(path).result(timeout=WAIT)
        assert _flat(_steps(resumed, [datums, datums[:1]], CLIPPED)) == pytest.approx(expected, rel=REL)
        client.close("success").result(timeout=10)
    finally:
        assert again.stop() in (0, 128 + signal.SIGTERM), again.output()[-3000:]


def test_a_damaged_sharded_checkpoint_is_a_user_error_and_the_ranks_keep_serving(services) -> None:
    datums = _datums(services["tokenizer"])
    trainer = create_full_training_client(services["clients"]["two"], "tiny")
    _steps(trainer, [datums])
    path = trainer.save_state("to-damage").result(timeout=WAIT).path
    folder = services["out"] / "alice" / trainer.model_id / "weights" / "to-damage"
    shard = folder / "__1_0.distcp"  # rank 1's shard
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(tinker.RequestFailedError, match="truncated") as failed:
        services["clients"]["two"].create_training_client_from_state_with_optimizer(path).result(timeout=WAIT)
    assert failed.value.category is types.RequestErrorCategory.User
    assert len(_steps(trainer, [datums])) == 1 and services["two"].proc.poll() is None


def test_a_failed_sharded_save_fails_that_request_and_the_ranks_keep_serving(services) -> None:
    """Rank 1's write of a full fine-tuning checkpoint fails (an injected full disk, `checkpoint_write`): DCP raises
    it on both ranks, they agree on it, and that request fails; nothing is half-saved, the earlier checkpoint still
    loads, and the service trains and saves on. Before, any failure inside the ranks' job ended the service."""
    datums = _datums(services["tokenizer"])
    trainer = create_full_training_client(services["clients"]["two"], "tiny")
    _steps(trainer, [datums])
    kept = trainer.save_state("kept").result(timeout=WAIT).path
    services["marker"].unlink()  # arm: rank 1's next checkpoint write fails once
    with pytest.raises(tinker.RequestFailedError, match="No space left on device"):
        trainer.save_state("lost").result(timeout=WAIT)
    assert services["marker"].exists()  # the fault fired (and is disarmed again)
    weights = services["out"] / "alice" / trainer.model_id / "weights"
    assert sorted(p.name for p in weights.iterdir()) == ["kept"]  # no half-written or staging folder
    assert services["two"].proc.poll() is None
    assert len(_steps(trainer, [datums])) == 1
    assert trainer.save_state("after").result(timeout=WAIT).path.endswith("/weights/after")
    resumed = services["clients"]["two"].create_training_client_from_state_with_optimizer(kept).result(timeout=WAIT)
    assert resumed.forward(datums, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"] > 0
