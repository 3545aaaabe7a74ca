"""Vision-language SFT from YAML (`shardforge train sft` on image chat rows, one process) and its HF export:
the CLI detects the VLM, trains on image rows (loss falls), exports a directory plain transformers loads
(model + tokenizer + image processor); the export generates the engine's greedy tokens; data mistakes
are one clear error before training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from shardforge.algorithms.cli.main import main
from shardforge.algorithms.loggers import read_metrics


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Larger initial weights, so greedy tokens differ clearly between candidates (see tiny_qwen2_5_vl_config);
    Qwen2.5-VL unless a test asks for another family (``indirect`` parametrization)."""
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    family = getattr(request, "param", "qwen2_5_vl")
    return tiny_vlm_assets(
        tmp_path_factory.mktemp(f"vlm_cli_{family}"), seed=2, num_train=8, num_eval=3, initializer_range=0.2,
        family=family,
    )  # fmt: skip


def _config(path: Path, **entries: Any) -> str:
    base = {
        "global_batch_size": 4, "progress": False, "layout": "d1", "steps": 4, "loggers": ["jsonl"],
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(base | entries))
    return str(path)


def test_cli_sft_trains_on_image_rows_and_exports_for_transformers(tmp_path: Path, vlm: dict[str, Any]) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    out = tmp_path / "run"
    config = _config(
        tmp_path / "c.yaml", model=vlm["model"], train_file=str(vlm["train"]), eval_file=str(vlm["eval"]),
        output_dir=str(out), eval_every=2,
    )  # fmt: skip
    assert main(["train", "sft", "--config", config]) == 0
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
    evals = [r["loss"] for r in read_metrics(out / "metrics.jsonl", "eval")]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert len(evals) == 2 and evals[-1] < evals[0], evals
    summary = json.loads((out / "summary.json").read_text())
    hf = Path(summary["hf_dir"])
    model = AutoModelForImageTextToText.from_pretrained(str(hf))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(str(hf)).to_dict() == vlm["image_processor"].to_dict()
    assert AutoTokenizer.from_pretrained(str(hf)).chat_template == vlm["tokenizer"].chat_template


def _engine_greedy(engine: Any, prompt: Any, max_new_tokens: int, eos: int) -> tuple[list[int], float]:
    """Greedy decoding through the engine's own packed path (its packing, per-sequence mRoPE, packed
    attention): the full prefix is re-run for each token (no KV cache). Also returns the smallest
    top-1 minus top-2 logit gap seen (how clear each choice was)."""
    from shardforge.algorithms.data.vlm import VLMExample, pack_vlm_examples

    ids: list[int] = []
    gap = float("inf")
    engine.model.eval()
    for _ in range(max_new_tokens):
        full = VLMExample(prompt.input_ids + ids, [0.0] * (len(prompt.input_ids) + len(ids)), prompt.pixel_values,
                          prompt.image_grid_thw)  # fmt: skip
        batch = pack_vlm_examples([full], [0]).to(engine.device)
        kwargs, real = engine.head.model_inputs(engine.model, engine.ctx, batch)
        with torch.no_grad():
            top = engine.model(**kwargs).logits[0, real - 1].float().topk(2)
        gap = min(gap, float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
        if ids[-1] == eos:
            break
    return ids, gap


@pytest.mark.parametrize("vlm", ["qwen2_5_vl", "qwen3_vl"], indirect=True)
def test_export_generates_the_engines_greedy_tokens(tmp_path: Path, vlm: dict[str, Any]) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from shardforge.algorithms.data.vlm import (
        encode_vlm_prompt,
        load_image_processor,
        load_vlm_examples,
        pack_vlm_examples,
    )  # fmt: skip
    from shardforge.algorithms.demos.demo_vlm import greedy_vlm_ids
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    tokenizer, processor = vlm["tokenizer"], vlm["image_processor"]
    examples = load_vlm_examples(vlm["train"], tokenizer, processor, image_token="<|image_pad|>")
    engine = TrainEngine(vlm["model"], "d1", EngineConfig(optimizer=OptimizerConfig(lr=3e-3)))
    for _ in range(2):  # trained weights, not the initial ones, must reach the export
        engine.train_batch(pack_vlm_examples(examples, list(range(len(examples)))))
    out = tmp_path / "hf"
    engine.export_hf(out, tokenizer=tokenizer)
    processor.save_pretrained(str(out))  # what the SFT trainer adds for a VLM
    model = AutoModelForImageTextToText.from_pretrained(str(out)).eval()
    hf_tokenizer, hf_processor = AutoTokenizer.from_pretrained(str(out)), load_image_processor(out)
    rows = [json.loads(line) for line in Path(vlm["eval"]).read_text().splitlines()]
    rows.append(json.loads(Path(vlm["train"]).read_text().splitlines()[2]))  # a row with two images
    assert any(sum(p.get("type") == "image" for p in r["messages"][0]["content"]) == 2 for r in rows)
    decoded, data = [], Path(vlm["train"]).parent
    for row in rows:
        prompt_ids, theirs = greedy_vlm_ids(model, hf_tokenizer, hf_processor, row["messages"][:-1], data, 6)
        prompt = encode_vlm_prompt(row["messages"][:-1], tokenizer, processor, image_token="<|image_pad|>", base=data)
        assert prompt.input_ids == prompt_ids
        ours, gap = _engine_greedy(engine, prompt, 6, tokenizer.eos_token_id)
        # fp32 in both; a choice closer than 1e-3 could flip on rounding alone and would prove nothing.
        assert gap > 1e-3, f"the model is too flat for an exact token comparison (top-2 gap {gap})"
        assert theirs == ours, (tokenizer.decode(theirs), tokenizer.decode(ours))
        decoded.append(tokenizer.decode(ours))
    assert len(set(decoded)) > 1, f"the answers do not depend on the image: {decoded}"


# ------------------------------------------------------------------------------------------ data mistakes
def _write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _image_row(image: str, answer: str = "red") -> dict[str, Any]:
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "colour?"}]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def _first_image(vlm: dict[str, Any]) -> str:
    return json.loads(Path(vlm["train"]).read_text().splitlines()[0])["messages"][0]["content"][0]["image"]


def test_missing_image_names_the_row_and_the_path(tmp_path: Path, vlm: dict[str, Any]) -> None:
    data = Path(vlm["train"]).parent
    train = _write_rows(data / "missing.jsonl", [_image_row(_first_image(vlm)), _image_row("images/nope.png")])
    config = _config(tmp_path / "c.yaml", model=vlm["model"], train_file=train, output_dir=str(tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl:2: image 'images/nope\.png' not found .*relative to"):
        main(["--debug", "train", "sft", "--config", config])


def test_unreadable_image_names_the_row_and_the_file(tmp_path: Path, vlm: dict[str, Any]) -> None:
    data = Path(vlm["train"]).parent
    (data / "images" / "broken.png").write_bytes(b"not a png")
    train = _write_rows(data / "broken.jsonl", [_image_row(_first_image(vlm)), _image_row("images/broken.png")])
    config = _config(tmp_path / "c.yaml", model=vlm["model"], train_file=train, output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: '.*broken\.png' is not an image Pillow can read"):
        main(["--debug", "train", "sft", "--config", config])


def test_image_rows_for_a_text_only_model_are_refused(tmp_path: Path, vlm: dict[str, Any]) -> None:
    from shardforge.algorithms.testing import tiny_assets

    text = tiny_assets(tmp_path / "text", data=False, tokenizer_dir="model")
    train = _write_rows(tmp_path / "rows.jsonl", [_image_row(str(Path(vlm["train"]).parent / _first_image(vlm)))])
    config = _config(tmp_path / "c.yaml", model=text["model"], train_file=train, output_dir=str(tmp_path / "o"))
    with pytest.raises(
        ValueError, match=r"rows\.jsonl:1: message 0 has an image content part, but the model is text-only"
    ):
        main(["--debug", "train", "sft", "--config", config])


def test_vlm_without_image_processor_says_what_to_add(tmp_path: Path, vlm: dict[str, Any]) -> None:
    model = tmp_path / "model"
    shutil.copytree(vlm["model"], model)
    (model / "preprocessor_config.json").unlink()
    config = _config(
        tmp_path / "c.yaml", model=str(model), train_file=str(vlm["train"]), output_dir=str(tmp_path / "o")
    )
    with pytest.raises(
        FileNotFoundError, match=r"vision-language model \(qwen2_5_vl\) but no preprocessor_config\.json"
    ):
        main(["--debug", "train", "sft", "--config", config])


def test_max_seq_len_through_an_image_is_refused(tmp_path: Path, vlm: dict[str, Any]) -> None:
    config = _config(
        tmp_path / "c.yaml", model=vlm["model"], train_file=str(vlm["train"]), output_dir=str(tmp_path / "o"),
        max_seq_len=6,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"train\.jsonl:1: max_seq_len=6 would cut through an image"):
        main(["--debug", "train", "sft", "--config", config])
