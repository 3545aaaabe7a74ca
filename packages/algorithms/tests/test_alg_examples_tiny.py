"""Every ``examples/*_tiny.yaml`` runs as shipped after one `shardforge prepare-tiny` (issue 42, item 4).

One prepared folder for the module (a 2-step SFT instead of the default 150: the examples need the
files, not a good policy); each example then trains one step (one eval for ``eval_tiny``) through the CLI
in this process, with only the run length, batch sizes and outputs overridden."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardforge.algorithms.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TINY = sorted(path.name for path in EXAMPLES.glob("*_tiny.yaml"))
SHORT = ["steps=1", "save_every=0", "export_hf_at_end=false", "progress=false", "eval_every=0", "loggers=[jsonl]"]
RL = ["prompts_per_step=2", "group_size=2", "eval_file=null"]
OVERRIDES = {
    "sft": ["global_batch_size=4", "eval_file=null"], "rm": ["global_batch_size=2", "eval_file=null"],
    "dpo": ["global_batch_size=2", "eval_file=null"], "grpo": RL, "ppo": RL, "distill": RL,
}  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, root / "examples")  # the examples' relative paths (examples/..., outputs/...)
    assert main(["prepare-tiny", "--out", str(root / "outputs"), "--sft-steps", "2"]) == 0
    return root


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_every_tiny_example_is_covered() -> None:
    assert len(TINY) >= 15, TINY


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_example_runs_as_shipped(name: str, prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "verifiers" in name:  # shardforge-rollout[verifiers]; the tests session installs it
        pytest.importorskip("verifiers.v1")
    if "openenv" in name:  # shardforge-rollout[openenv]; the tests session installs it
        pytest.importorskip("openenv.core")
    if "openai" in name:  # the agent is written against the openai SDK (shardforge-rollout[openai])
        pytest.importorskip("openai")
    monkeypatch.chdir(prepared)
    out = prepared / "runs" / name.removesuffix(".yaml")
    family = name.split("_")[0]
    if family == "eval":
        argv = ["eval", "--config", f"examples/{name}", f"output_dir={out}", "eval_size=4"]
        assert main(argv) == 0
        assert json.loads((out / "eval_results.json").read_text())["results"]
        return
    argv = ["train", family, "--config", f"examples/{name}", f"output_dir={out}", *SHORT, *OVERRIDES[family]]
    if name == "sft_mix_tiny.yaml":
        argv.remove("eval_file=null")
    assert main(argv) == 0, name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records if r.get("split") == "train"] == [1]
    if "streaming" in name:  # the streaming source trained it: whole groups, never stale at step 1
        [train] = [r for r in records if r.get("split") == "train"]
        assert train["stream/staleness_max"] == 0.0 and train["stream/staleness_0_frac"] == 1.0, train
