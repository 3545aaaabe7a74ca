"""Checkpoint download through the tinker SDK: ``save_weights_external`` + ``RestClient.get_external_weights_urls``
+ plain GETs. A LoRA export loads with ``peft`` onto the base model, a full fine-tuning export with
``transformers``, and both give the service's own ``forward`` log-probs (1e-4). Only the owner gets the URLs; a
tampered URL is refused. And the per-tenant step metrics the service writes through our jsonl logger."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')"
)

import httpx  # noqa: E402
import torch  # noqa: E402
from tinker import types  # noqa: E402

from shardforge.algorithms.serve.client import create_full_training_client  # noqa: E402
from shardforge.algorithms.serve.config import ServeConfig  # noqa: E402
from shardforge.algorithms.serve.server import ServiceServer  # noqa: E402
from shardforge.algorithms.serve.service import TinkerService  # noqa: E402
from shardforge.algorithms.serve.tenants import TenantKeys  # noqa: E402

ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789"
TEXTS = ["12+34=46", "7*8=56", "99-9=90"]
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve_export")
    tiny = tiny_model(root)
    config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(root / "out"), loggers=("jsonl",))
    server = ServiceServer(TinkerService(config, TenantKeys({ALICE: "alice", BOB: "bob"})), port=0).start()
    yield {"url": server.url, "model": tiny["model"], "tokenizer": tiny["tokenizer"], "out": root / "out"}
    server.stop()


def _datums(tokenizer) -> list[types.Datum]:
    out = []
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return out


def _train_and_export(trainer, datums: list[types.Datum], name: str) -> tuple[str, list[list[float]]]:
    """Two SFT steps, then the export's tinker path and the service's forward log-probs of ``datums``."""
    for _ in range(2):
        trainer.forward_backward(datums, "cross_entropy").result()
        trainer.optim_step(ADAM).result()
    path = trainer.save_weights_external(name).result().path
    outputs = trainer.forward(datums, "cross_entropy").result().loss_fn_outputs
    return path, [out["logprobs"].tolist() for out in outputs]


def _download(url: str, key: str, path: str, into: Path) -> list[str]:
    urls = tinker.RestClient(base_url=url, api_key=key).get_external_weights_urls(path).result().urls
    for file, file_url in urls.items():
        answer = httpx.get(file_url, timeout=30)  # no API key: the signed URL is enough
        answer.raise_for_status()
        (into / file).parent.mkdir(parents=True, exist_ok=True)
        (into / file).write_bytes(answer.content)
    return sorted(urls)


def _logprobs(model: torch.nn.Module, datums: list[types.Datum]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for d in datums:
            logits = model(input_ids=torch.tensor([d.model_input.to_ints()])).logits.float()[0]
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
            out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].tolist())
    return out


def test_lora_export_loads_in_peft_and_matches_the_services_forward(served, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=1, train_unembed=True).result()
        datums = _datums(trainer.get_tokenizer())
        base_logprobs = _logprobs(AutoModelForCausalLM.from_pretrained(served["model"]).eval(), datums)
        path, served_logprobs = _train_and_export(trainer, datums, "adapter")
        assert path == f"tinker://{trainer.model_id}/external_weights/adapter"
        files = _download(served["url"], ALICE, path, tmp_path)
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        base = AutoModelForCausalLM.from_pretrained(served["model"], dtype=torch.float32).eval()
        loaded = PeftModel.from_pretrained(base, str(tmp_path)).eval()
        for got, want, before in zip(_logprobs(loaded, datums), served_logprobs, base_logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-4)
            assert max(abs(a - b) for a, b in zip(want, before, strict=True)) > 1e-2  # the adapter is in there
        listed = tinker.RestClient(base_url=served["url"], api_key=ALICE).list_checkpoints(trainer.model_id).result()
        assert ("external", path) in [(c.checkpoint_type, c.tinker_path) for c in listed.checkpoints]

    # another tenant gets no URLs (the export reads as missing); a tampered or expired URL is refused
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=served["url"], api_key=BOB).get_external_weights_urls(path).result()
    url = next(iter(tinker.RestClient(base_url=served["url"], api_key=ALICE).get_external_weights_urls(path).result()
                    .urls.values()))  # fmt: skip
    assert httpx.get(url.replace("/alice/", "/bob/"), timeout=30).status_code == 403
    assert httpx.get(url[:-4] + "0000", timeout=30).status_code == 403
    expires = url.split("expires=")[1].split("&")[0]
    assert httpx.get(url.replace(f"expires={expires}", "expires=1"), timeout=30).status_code == 403


def test_full_fine_tuning_export_is_an_hf_model(served, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as client:
        trainer = create_full_training_client(client, "tiny")
        datums = _datums(trainer.get_tokenizer())
        path, served_logprobs = _train_and_export(trainer, datums, "full")
        files = _download(served["url"], ALICE, path, tmp_path)
        assert "config.json" in files and "model.safetensors" in files and "tokenizer.json" in files
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
        assert (
            AutoTokenizer.from_pretrained(str(tmp_path))(TEXTS[0])["input_ids"]
            == served["tokenizer"](TEXTS[0])["input_ids"]
        )
        for got, want in zip(_logprobs(model, datums), served_logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-4)
        with pytest.raises(Exception, match="must be non-empty, without '/'"):
            trainer.save_weights_external("../escape").result()


def test_each_tenants_steps_are_logged_through_the_jsonl_logger(served) -> None:
    """Two tenants; per optim_step one row per training client under out/<tenant>/<model_id>/metrics.jsonl with
    the step's summed loss (two forward_backward calls), tokens, datums, timings, learning rate, grad norm."""
    from shardforge.algorithms.loggers import read_metrics

    datums = _datums(served["tokenizer"])
    tokens = sum(len(d.model_input.to_ints()) for d in datums)
    expected: dict[str, tuple[str, list[float]]] = {}
    for key, tenant in ((ALICE, "alice"), (BOB, "bob")):
        with tinker.ServiceClient(base_url=served["url"], api_key=key) as client:
            trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
            losses = []
            for step in range(2):
                first = trainer.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"]
                second = trainer.forward_backward(datums[:1], "cross_entropy").result().metrics["loss:sum"]
                trainer.forward(datums, "cross_entropy").result()  # forward only: not a training step's loss
                trainer.optim_step(types.AdamParams(learning_rate=1e-2 * (step + 1))).result()
                losses.append(first + second)
            expected[tenant] = (trainer.model_id, losses)
    for tenant, (model_id, losses) in expected.items():
        rows = read_metrics(served["out"] / tenant / model_id / "metrics.jsonl")
        assert [row["step"] for row in rows] == [1, 2]
        assert [row["loss"] for row in rows] == pytest.approx(losses, rel=1e-6)
        assert [row["learning_rate"] for row in rows] == pytest.approx([1e-2, 2e-2])
        for row in rows:
            assert row["tokens"] == tokens + len(datums[0].model_input.to_ints()) and row["datums"] == 4
            assert row["grad_norm"] > 0 and 0 < row["forward_backward_s"] <= row["step_s"]
            assert 0 < row["optim_step_s"] <= row["step_s"]
