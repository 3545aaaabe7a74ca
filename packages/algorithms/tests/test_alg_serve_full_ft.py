"""Full fine-tuning through `shardforge serve` (the SDK's ``CreateModelRequest`` without ``lora_config``; tinker
0.38 has no public call for it, `create_full_training_client` sends it): SFT losses equal a plain torch loop
over all weights, the base model (and a LoRA client on it) stays untouched, and save/load/sample work."""

from __future__ import annotations

import os

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
from shardforge.algorithms.testing.serve_datums import sft_datums  # noqa: E402

ALICE = "tml-alice-0123456789"
TEXTS = ["12+34=46", "7*8=56", "99-9=90"]
ADAM = types.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve_full")
    tiny = tiny_model(root)
    config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(root / "out"), max_tokens=32)
    service = TinkerService(config, TenantKeys({ALICE: "alice"}))
    server = ServiceServer(service, port=0).start()
    yield {"url": server.url, "model": tiny["model"], "service": service}
    server.stop()


def _datums(tokenizer, texts: list[str] = TEXTS) -> list[types.Datum]:
    return sft_datums(tokenizer, texts)


def _reference(model_dir: str, datums: list[types.Datum], steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch over every weight: sum-reduced weighted NLL, AdamW; the losses and the final weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
    )  # fmt: skip
    from shardforge.algorithms.testing.reference import weighted_nll_adamw_losses

    losses = weighted_nll_adamw_losses(model, opt, datums, steps)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_full_fine_tuning_matches_plain_torch(served) -> None:
    service = served["service"]
    base_before = {n: p.detach().clone() for n, p in service.registry.base.named_parameters()}
    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as client:
        trainer = create_full_training_client(client, "tiny")
        info = trainer.get_info()
        assert info.model_data.model_name == "tiny" and info.is_lora is False and info.lora_rank is None
        lora = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        datums = _datums(trainer.get_tokenizer())
        lora_before = lora.forward(datums, "cross_entropy").result().metrics["loss:sum"]
        losses = []
        for _ in range(3):
            fwdbwd = trainer.forward_backward(datums, "cross_entropy")
            step = trainer.optim_step(ADAM)
            losses.append(fwdbwd.result().metrics["loss:sum"])
            step.result()
        reference, final = _reference(served["model"], datums, 3)
        assert losses == pytest.approx(reference, rel=1e-5)
        assert losses[-1] < 0.9 * losses[0]
        trained = dict(service.registry.model("alice", trainer.model_id).module.named_parameters())
        assert set(trained) == set(final)
        for name, value in final.items():  # every weight trained, as in the plain loop
            torch.testing.assert_close(trained[name].detach(), value, rtol=1e-4, atol=1e-6, msg=name)
        # the shared base (and a LoRA client on it) did not move
        for name, value in service.registry.base.named_parameters():
            assert torch.equal(value, base_before[name]), name
        assert lora.forward(datums, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            lora_before, rel=1e-6
        )

        # save_state -> a new full FT client from the state has the same loss; sampling from the trained weights
        path = trainer.save_state("ft").result().path
        after = trainer.forward(datums, "cross_entropy").result().metrics["loss:sum"]
        restored = client.create_training_client_from_state_with_optimizer(path).result()
        assert restored.get_info().is_lora is False
        assert restored.forward(datums, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(after, rel=1e-6)
        sampler = trainer.save_weights_and_get_sampling_client().result()
        ids = [*datums[0].model_input.to_ints(), datums[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
        logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        expected = trainer.forward([datums[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert logprobs[3:] == pytest.approx(expected[2:], abs=1e-4)
