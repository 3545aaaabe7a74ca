"""``layout: auto`` (issue 42, item 6): the planner's best data-parallel layout, resolved by the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.algorithms.plan.auto import resolve_auto_layout
from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.trainers.sft import SFTConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_assets(tmp_path_factory.mktemp("auto"), tokenizer_dir="model")["model"])


def _config(model: str, layout: str) -> SFTConfig:
    return SFTConfig(model=model, train_file="unused.jsonl", output_dir="unused", layout=layout)


def test_auto_picks_the_planners_ddp_replicas_for_a_small_model(model_dir: str) -> None:
    # The planner ranks DDP over 2 replicas first for a model this small (docs/planner.md); FSDP d2 is slower.
    config, line = resolve_auto_layout(_config(model_dir, "auto"), 2)
    assert (config.layout, config.engine.data_parallel) == ("r2d1", "ddp")
    assert line is not None and "layout=auto -> layout=r2d1 engine.data_parallel=ddp" in line
    assert "\n" not in line
    one, _ = resolve_auto_layout(_config(model_dir, "auto"), 1)
    assert (one.layout, one.engine.data_parallel) == ("d1", "fsdp")


def test_an_explicit_layout_is_left_alone(model_dir: str) -> None:
    config = _config(model_dir, "d-1")
    assert resolve_auto_layout(config, 2) == (config, None)


def test_the_cli_trains_with_auto_and_prints_one_line(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from shardforge.algorithms.cli.main import main

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SHARDFORGE_AUTO_LAYOUT_SHOWN"):
        monkeypatch.delenv(var, raising=False)
    train = Path(model_dir).parent / "data" / "train.jsonl"
    out = tmp_path / "run"
    argv = ["train", "sft", "--config", str(Path(__file__).resolve().parents[3] / "examples" / "sft_tiny.yaml"),
            f"model={model_dir}", f"train_file={train}", "eval_file=null", f"output_dir={out}", "steps=1",
            "global_batch_size=4", "save_every=0", "export_hf_at_end=false", "progress=false", "eval_every=0"]  # fmt: skip
    assert main(argv) == 0
    captured = capfd.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "layout=auto ->" in line]
    assert len(lines) == 1 and "layout=auto -> layout=d1 engine.data_parallel=fsdp" in lines[0], lines
    assert (out / "metrics.jsonl").is_file()
