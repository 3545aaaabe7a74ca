"""The vision-language demo: a tiny Qwen2.5-VL learns to name the colour of a square in an image.

1. Assets, all local (`testing_vlm`): a character tokenizer with Qwen2.5-VL's vision tokens, a tiny
   Qwen2.5-VL initialised from a config, its image processor, and generated 56x56 PNGs: a grey
   background with one square of random colour, size and position. Every row asks the same question
   ("what colour is the square?"), so only the image tells the answer: a model that ignores the image
   is right at most as often as the commonest colour (the ``text_only_ceiling`` in the result).
2. Held-out greedy exact match of the initial model, SFT through ``shardforge train sft``
   (`demo_vlm_sft.yaml`, FSDP on ``nproc`` CPU ranks through torchrun), exact match of the exported
   HF model.
3. GRPO from the SFT export through ``shardforge train grpo`` (`demo_vlm_grpo.yaml`: the same image rows
   as prompts, exact-match reward on the colour, the embedded HF rollout engine generating from the
   images), exact match of its export. Every accuracy comes from plain ``transformers``
   (``AutoModelForImageTextToText.generate``) on the exported directories, and is written to
   ``demo_vlm_result.json``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from shardforge.algorithms.demos.demo_rl import _torchrun

__all__ = [
    "SQUARE_COLORS",
    "greedy_vlm_answers",
    "greedy_vlm_ids",
    "held_out_vlm_accuracy",
    "make_square_rows",
    "prepare_vlm_demo",
    "run_vlm_demo",
]

logger = logging.getLogger(__name__)

SQUARE_COLORS = {
    "red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 60, 220), "yellow": (235, 220, 20),
    "purple": (140, 40, 170), "orange": (245, 140, 20),
}  # fmt: skip
QUESTION = "what colour is the square?"


def make_square_rows(data_dir: Path, count: int, *, seed: int, prefix: str) -> list[dict[str, Any]]:
    """``count`` chat rows, each with one 56x56 PNG (grey background, one square of a random colour, side
    14-35 px, random position) under ``data_dir/images``, named relative to ``data_dir``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    (data_dir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        name = rng.choice(sorted(SQUARE_COLORS))
        image = Image.new("RGB", (56, 56), (128, 128, 128))
        side = rng.randint(14, 35)
        x, y = rng.randint(0, 56 - side), rng.randint(0, 56 - side)
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=SQUARE_COLORS[name])
        relative = f"images/{prefix}{i}.png"
        image.save(data_dir / relative)
        parts = [{"type": "image", "image": relative}, {"type": "text", "text": QUESTION}]
        rows.append({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": name}]})
    return rows


def prepare_vlm_demo(
    out_dir: str | Path, *, seed: int = 0, num_train: int = 400, num_eval: int = 120, hidden: int = 64
) -> dict[str, Any]:
    """Write the tiny model (``out/model``: weights, tokenizer, image processor) and ``out/data/{train,eval}.jsonl``
    (eval images never appear in train: other seeds). Returns the paths and the parameter count."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from shardforge.algorithms.testing.vlm import build_vlm_tokenizer, tiny_qwen2_5_vl_config

    out = Path(out_dir)
    model_dir, data_dir = out / "model", out / "data"
    tokenizer = build_vlm_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_qwen2_5_vl_config(tokenizer, hidden=hidden))
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    # A 56x56 image is 16 patches of 14 px, merged 2x2 into 4 image tokens.
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56).save_pretrained(str(model_dir))
    files = {}
    for split, count, data_seed in (("train", num_train, seed + 1), ("eval", num_eval, seed + 2)):
        rows = make_square_rows(data_dir, count, seed=data_seed, prefix=split)
        files[split] = data_dir / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = sum(p.numel() for p in model.parameters())
    return {"model": model_dir, "num_params": params} | files


def greedy_vlm_ids(
    model: Any, tokenizer: Any, image_processor: Any, messages: list[dict[str, Any]], base: Path, max_new_tokens: int
) -> tuple[list[int], list[int]]:
    """``(prompt ids, greedy new ids)`` of a plain HF image-text model for the generation prompt after
    ``messages`` (image paths relative to ``base``)."""
    import torch

    from shardforge.algorithms.data.vlm import encode_vlm_prompt

    token = tokenizer.convert_ids_to_tokens(model.config.image_token_id)
    prompt = encode_vlm_prompt(messages, tokenizer, image_processor, image_token=token, base=base)
    ids = torch.tensor([prompt.input_ids])
    # mm_token_type_ids (1 = image token; the HF processor returns it): without it transformers 5 gives the
    # image tokens 1-D text positions instead of Qwen2-VL's 3-D ones, unlike training.
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    return prompt.input_ids, out[0, ids.shape[1] :].tolist()


def greedy_vlm_answers(
    model_dir: str | Path, rows: list[dict[str, Any]], base: Path, max_new_tokens: int = 8
) -> list[str]:
    """Greedy answers of an HF model directory (plain ``transformers``) to the rows' prompts (every message
    before the last, an assistant turn); image paths relative to ``base``."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_image_processor

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = load_image_processor(model_dir, model.config.model_type)
    answers = []
    for row in rows:
        _, new = greedy_vlm_ids(model, tokenizer, processor, row["messages"][:-1], base, max_new_tokens)
        answers.append(str(tokenizer.decode(new, skip_special_tokens=True)).strip())
    return answers


def held_out_vlm_accuracy(model_dir: str | Path, eval_file: Path) -> float:
    """Greedy exact match of ``model_dir`` on the rows of ``eval_file``."""
    rows = [json.loads(line) for line in eval_file.read_text().splitlines() if line.strip()]
    answers = greedy_vlm_answers(model_dir, rows, eval_file.parent)
    return sum(a == r["messages"][-1]["content"] for a, r in zip(answers, rows)) / len(rows)


def run_vlm_demo(
    out_dir: str | Path = "outputs/demo_vlm",
    *,
    nproc: int = 2,
    steps: int | None = None,
    grpo_steps: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Prepare, measure, SFT with FSDP on ``nproc`` ranks, measure, GRPO from the SFT export (exact-match
    reward on the same image prompts), measure again; return (and save) the result. ``grpo_steps=0`` skips
    the GRPO stage."""
    out = Path(out_dir)
    started = time.time()
    assets = prepare_vlm_demo(out, seed=seed)
    before = held_out_vlm_accuracy(assets["model"], assets["eval"])
    sft_dir, grpo_dir, here = out / "sft", out / "grpo", Path(__file__).parent
    paths = [f"train_file={assets['train']}", f"eval_file={assets['eval']}", f"layout=d{nproc}", "resume=never",
             "progress=false"]  # fmt: skip
    overrides = [f"model={assets['model']}", f"output_dir={sft_dir}", *paths]
    if steps is not None:
        overrides += [f"steps={steps}", f"engine.scheduler.total_steps={steps}"]
    _torchrun(nproc, "sft", here / "demo_vlm_sft.yaml", overrides)
    after = held_out_vlm_accuracy(sft_dir / "hf", assets["eval"])
    logger.info(f"held-out exact match after SFT: {after:.1%}")
    summary = json.loads((sft_dir / "summary.json").read_text())
    grpo: dict[str, Any] = {}
    if grpo_steps != 0:
        overrides = [f"model={sft_dir / 'hf'}", f"output_dir={grpo_dir}", *paths]
        if grpo_steps is not None:
            overrides.append(f"steps={grpo_steps}")
        _torchrun(nproc, "grpo", here / "demo_vlm_grpo.yaml", overrides)
        grpo = _grpo_result(grpo_dir, assets["eval"])
    eval_rows = [json.loads(line) for line in assets["eval"].read_text().splitlines() if line.strip()]
    answers = Counter(r["messages"][-1]["content"] for r in eval_rows)
    result = {
        "params": assets["num_params"], "train_rows": sum(1 for _ in assets["train"].open()),
        "eval_rows": len(eval_rows), "steps": summary["steps"], "ranks": nproc,
        "accuracy_before": before, "accuracy_after": after,
        "text_only_ceiling": max(answers.values()) / len(eval_rows),
        "eval_loss": summary.get("eval_loss"), **grpo, "minutes": (time.time() - started) / 60,
    }  # fmt: skip
    (out / "demo_vlm_result.json").write_text(json.dumps(result, indent=2))
    grpo_note = ""
    if grpo:
        grpo_note = (
            f", then {grpo['grpo_steps']} GRPO steps {grpo['accuracy_after_grpo']:.1%} (sampled at temperature 1: "
            f"{grpo['sampled_accuracy_after_sft']:.1%} -> {grpo['sampled_accuracy_after_grpo']:.1%})"
        )
    logger.info(
        f"held-out exact match (colour of the square): before {before:.1%}, after {summary['steps']} SFT steps "
        f"{after:.1%}{grpo_note} (a model blind to the image: at most {result['text_only_ceiling']:.1%}); "
        f"{result['minutes']:.1f} min"
    )
    return result


def _grpo_result(grpo_dir: Path, eval_file: Path) -> dict[str, Any]:
    """Greedy exact match of the GRPO export (plain transformers) and the trainer's sampled held-out accuracy
    (avg@n at temperature 1, `demo_vlm_grpo.yaml`'s eval_sampling) before and after GRPO."""
    from shardforge.algorithms.loggers import read_metrics

    evals = [r for r in read_metrics(grpo_dir / "metrics.jsonl", "eval") if any(k.startswith("avg@") for k in r)]
    key = next(k for k in evals[0] if k.startswith("avg@"))
    summary = json.loads((grpo_dir / "summary.json").read_text())
    return {
        "grpo_steps": summary["steps"], "accuracy_after_grpo": held_out_vlm_accuracy(grpo_dir / "hf", eval_file),
        "sampled_metric": f"{key} at temperature 1", "sampled_accuracy_after_sft": evals[0][key],
        "sampled_accuracy_after_grpo": evals[-1][key], "grpo_curves": str(grpo_dir / "curves.png"),
    }  # fmt: skip
