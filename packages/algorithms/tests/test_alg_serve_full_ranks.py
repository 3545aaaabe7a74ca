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
import warnings
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
from shardforge.algorithms.testing.serve_process import ServeProcess  # noqa: E402

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
    two = ServeProcess(tiny["model"], KEYS, out, nproc=2, log=root / "two.log")
    clients = {name: tinker.ServiceClient(base_url=url, api_key=ALICE) for name, url in (("one", one.url),
               ("two", two.url))}  # fmt: skip
    yield {"one": one, "two": two, "clients": clients, "out": out, "tokenizer": tiny["tokenizer"]}
    for client in clients.values():
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=10)
    one.stop()
    assert two.stop() in (0, 128 + signal.SIGTERM), two.output()[-3000:]


def _datums(tokenizer) -> list[types.Datum]:
    out = []
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        weights = [0.0] * 2 + [1.0] * (len(ids) - 3)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


def _steps(trainer, batches: list[list[types.Datum]], adam=ADAM) -> list[tuple[float, float]]:
    """Per step its loss and the optim_step's gradient norm."""
    out = []
    for batch in batches:
        fwdbwd = trainer.forward_backward(batch, "cross_entropy")
        step = trainer.optim_step(adam)
        loss = fwdbwd.result(timeout=WAIT).metrics["loss:sum"]
        out.append((loss, step.result(timeout=WAIT).metrics["grad_norm:mean"]))
    return out


def _read(out: Path, tinker_path: str) -> dict:
    """A DCP checkpoint of the service as one plain dict (``model`` / ``optimizer`` by parameter name)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model_id, _, name = tinker_path.removeprefix("tinker://").partition("/weights/")
    folder = out / "alice" / model_id / "weights" / name
    assert (folder / ".metadata").is_file() and (folder / "COMMITTED").is_file() and (folder / "serve.json").is_file()
    file = folder.parent / f"{name}.pt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_to_torch_save(folder, file)
    state = torch.load(file, weights_only=False)["train"]
    file.unlink()
    return state


def _assert_states_close(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) > 10
    for name, value in a["model"].items():
        torch.testing.assert_close(value, b["model"][name], rtol=REL, atol=1e-6, msg=name)
    moments_a, moments_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert moments_a.keys() == moments_b.keys() == a["model"].keys()
    for name, state in moments_a.items():
        for key in ("exp_avg", "exp_avg_sq"):
            # near-zero entries (gradients that cancel) carry the summation order's absolute error: atol by scale
            scale = float(state[key].abs().max())
            torch.testing.assert_close(state[key], moments_b[name][key], rtol=1e-4, atol=1e-5 * scale, msg=name)
        assert float(state["step"]) == float(moments_b[name]["step"])


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
    _assert_states_close(_read(services["out"], path_2), _read(services["out"], path_1))
