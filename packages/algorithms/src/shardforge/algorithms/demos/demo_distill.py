"""The distillation demo: a small student learns addition from the SFT demo's model.

1. Teacher: the SFT demo's Qwen3 (3.2M parameters), SFT ``teacher_steps`` on the addition data.
2. Student: a smaller Qwen3 (same tokenizer), SFT ``student_steps`` on the same data.
   Both SFT stages use the SFT demo's settings (``demo_sft.yaml``: lr 1e-3, cosine, 1000 steps), which get
   past the addition task's loss plateau on every seed measured; lr 3e-3 over 300-600 steps left the
   student on it (8-11% held-out) or past it depending on the float order.
3. From that student, the same number of further steps two ways:
   - SFT-only baseline: ``extra_steps`` more SFT steps on the ground-truth answers;
   - on-policy distillation: ``extra_steps`` distill steps (the student samples; the teacher's
     per-token log-probs give the reverse-KL advantage, or with ``distill_loss`` = full_reverse_kl /
     full_forward_kl / jsd its whole next-token distributions give GKD's exact per-position loss).
Held-out greedy exact match of every model is measured on the same 500 unseen pairs and written
to ``demo_distill_result.json``. Every stage runs with FSDP on ``nproc`` CPU ranks through torchrun.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from shardforge.algorithms.config_io import load_yaml
from shardforge.algorithms.demos.demo import held_out_accuracy, prepare_demo
from shardforge.algorithms.demos.demo_rl import _torchrun
from shardforge.algorithms.testing.tiny import build_tiny_qwen3

__all__ = ["run_distill_demo"]

logger = logging.getLogger(__name__)


def _sft(nproc: int, model: Path, assets: dict[str, Any], out: Path, steps: int, *extra: str) -> Path:
    config = Path(__file__).parent / "demo_sft.yaml"
    _torchrun(nproc, "sft", config, [
        f"model={model}", f"train_file={assets['train']}", f"output_dir={out}", f"steps={steps}",
        f"layout=d{nproc}", f"engine.scheduler.total_steps={steps}", "eval_every=0", "resume=never", *extra,
    ])  # fmt: skip
    return out / "hf"


def run_distill_demo(
    out_dir: str | Path = "outputs/demo_distill",
    *,
    nproc: int = 2,
    teacher_steps: int = 1000,
    student_steps: int = 1000,
    extra_steps: int = 100,
    student_hidden: int = 128,
    student_layers: int = 4,
    seed: int = 0,
    teacher_dir: str | Path | None = None,
    distill_loss: str | None = None,
    distill_overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run the four stages and return the held-out accuracies (also in ``demo_distill_result.json``)."""
    out = Path(out_dir)
    started = time.time()
    assets = prepare_demo(out, seed=seed, num_eval=500)  # 500 held-out pairs: +-2% standard error
    tokenizer_dir = out / "tokenizer"
    from transformers import AutoTokenizer

    student_init = out / "student_init"
    student_params = build_tiny_qwen3(
        student_init, AutoTokenizer.from_pretrained(str(tokenizer_dir)),
        hidden=student_hidden, layers=student_layers, seed=seed + 1,
    )  # fmt: skip
    if teacher_dir is not None:  # an earlier run's teacher (e.g. this demo's out/teacher/hf): skip its SFT
        teacher = Path(teacher_dir)
        if not (teacher / "config.json").is_file():
            raise FileNotFoundError(f"--teacher {teacher} is not an HF model directory (no config.json)")
    else:
        teacher = _sft(nproc, assets["model"], assets, out / "teacher", teacher_steps)
    student = _sft(nproc, student_init, assets, out / "student_sft", student_steps)
    distill_config = Path(__file__).parent / "demo_distill.yaml"
    continuation_lr = load_yaml(distill_config)["engine"]["optimizer"]["lr"]  # the same for both continuations
    baseline = _sft(
        nproc, student, assets, out / "student_sft_more", extra_steps, f"engine.optimizer.lr={continuation_lr}"
    )
    distill_dir = out / "student_distill"
    _torchrun(nproc, "distill", distill_config, [
        f"model={student}", f"teacher_model={teacher}", f"train_file={assets['train']}",
        f"output_dir={distill_dir}", f"steps={extra_steps}", f"layout=d{nproc}", "resume=never",
        f"engine.scheduler.total_steps={extra_steps}",
        *([f"distill_loss={distill_loss}"] if distill_loss else []), *(distill_overrides or []),
    ])  # fmt: skip
    resolved = json.loads((distill_dir / "config.json").read_text())
    accuracy = {
        name: held_out_accuracy(path, assets["eval"])
        for name, path in (
            ("teacher", teacher), ("student_sft", student), ("student_sft_more", baseline),
            ("student_distill", distill_dir / "hf"),
        )
    }  # fmt: skip
    result = {
        "teacher_params": assets["num_params"], "student_params": student_params,
        "teacher_steps": teacher_steps, "student_steps": student_steps, "extra_steps": extra_steps,
        "student_hidden": student_hidden, "student_layers": student_layers,
        "distill_loss": resolved.get("distill_loss"), "distill_lr": resolved["engine"]["optimizer"]["lr"],
        "accuracy": accuracy, "ranks": nproc, "minutes": (time.time() - started) / 60,
    }  # fmt: skip
    (out / "demo_distill_result.json").write_text(json.dumps(result, indent=2))
    for name, value in accuracy.items():
        logger.info(f"held-out exact match, {name}: {value:.1%}")
    gain = accuracy["student_distill"] - accuracy["student_sft_more"]
    logger.info(
        f"after {student_steps} + {extra_steps} steps: distillation {accuracy['student_distill']:.1%} vs SFT-only "
        f"{accuracy['student_sft_more']:.1%} ({gain:+.1%}); total {result['minutes']:.1f} min"
    )
    return result
