"""wandb and mlflow loggers through the real packages (world 1, tiny SFT): metrics, run parameters
and artifacts read back with each tracker's own formats/clients; a resumed run continues the same
tracker run with every step once (also when the interrupted run logged steps past its last checkpoint:
TensorBoard purges them, W&B rewinds, MLflow tags the stale range); a missing package is a one-time warning naming the pip command."""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config
from shardforge.algorithms.loggers import read_metrics
from shardforge.algorithms.trainers import TRAINERS


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "WANDB_DIR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("trk")
    made = tiny_assets(root, seed=11, max_operand=20, num_eval=8, data_seed=2)
    return {"model": str(root / "model"), "train": str(made["train"])}


def _sft(assets: dict[str, Any], out: Path, **overrides: Any) -> dict[str, Any]:
    data = {
        "model": assets["model"], "output_dir": str(out), "layout": "d1", "steps": 3, "save_every": 1,
        "progress": False, "export_hf_at_end": False, "train_file": assets["train"], "global_batch_size": 4,
        "engine": {"max_tokens_per_microbatch": 64, "optimizer": {"lr": 1e-3}},
    }  # fmt: skip
    spec = TRAINERS.get("sft")
    config = build_config(spec.config_cls, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))
    return spec.run(config)  # type: ignore[no-any-return]


def read_wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file, parsed with wandb's own protobuf messages.

    The file is a LevelDB-style log (32 KiB blocks of records with a 7-byte header: crc32, length,
    type full/first/middle/last) after wandb's 7-byte ``:W&B`` header; wandb 0.31 ships no Python
    reader for it (its writer is the Go ``wandb-core``)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, records, chunk = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        chunk = payload if kind in (1, 2) else chunk + payload
        if kind in (1, 4):  # full or last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_offline_run_has_metrics_config_and_continues_on_resume(assets: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    options = {"loggers": "[jsonl,wandb]", "tracker.tags": "[demo]", "tracker.run_name": "tiny"}
    _sft(assets, out, **options)
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["id"]
    _next_second()
    _sft(assets, out, steps=5, export_hf_at_end="true", **options)  # resumes from step 3
    assert json.loads((out / "trackers.json").read_text())["wandb"]["id"] == run_id
    files = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2, list((out / "wandb").iterdir())  # one directory per process, same run id
    steps, losses, configs, artifacts = [], [], [], []
    _wait_for_history(files[-1], 4)
    for file in files:
        for record in read_wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                if "train/loss" in items:
                    steps.append(record.history.step.num)
                    losses.append(float(items["train/loss"]))
            elif kind == "run":
                configs.append({u.key: json.loads(u.value_json) for u in record.run.config.update})
                assert record.run.run_id == run_id and record.run.display_name == "tiny"
                assert list(record.run.tags) == ["demo"]
            elif kind == "artifact":
                artifacts.append([entry.path for entry in record.artifact.manifest.contents])
    assert steps == [1, 2, 3, 4, 5]  # each step once across the two processes
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx([r["loss"] for r in jsonl if r["split"] == "train"], rel=1e-12)
    assert (
        configs[0]["layout"] == "r1d1c1t1p1e1x1"
        and configs[0]["config"]["steps"] == 3
        and "version.torch" in configs[0]
    )
    assert len(artifacts) == 2  # one per finished process; the second holds the HF export
    assert "hf/config.json" not in artifacts[0] and {"hf/config.json", "summary.json"} <= set(artifacts[1])


def test_mlflow_run_has_metrics_params_artifacts_and_continues_on_resume(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    _sft(assets, out, loggers="[jsonl,mlflow]", **{"tracker.tags": "[demo]"})
    stored = json.loads((out / "trackers.json").read_text())["mlflow"]
    _sft(assets, out, loggers="[jsonl,mlflow]", steps=5, export_hf_at_end="true")  # resumes from step 3
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == stored  # same run continued
    client = MlflowClient(tracking_uri=stored["tracking_uri"])
    assert stored["tracking_uri"] == f"sqlite:///{(out / 'mlflow.db').resolve()}"
    history = client.get_metric_history(stored["run_id"], "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5]  # each step once
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in jsonl if r["split"] == "train"])
    run = client.get_run(stored["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run" and "demo" in run.data.tags
    params = run.data.params
    assert params["config.steps"] == "3" and params["layout"] == "r1d1c1t1p1e1x1" and params["world_size"] == "1"
    assert params["version.torch"].startswith("2.") and "version.mlflow-skinny" in params
    assert run.data.tags["resumed_at_3.config.steps"] == "5"  # params are immutable: the change is a tag
    assert len(params.get("git.revision", "0" * 40)) == 40
    assert run.data.metrics["final/steps"] == 5.0
    assert {a.path for a in client.list_artifacts(stored["run_id"])} >= {"hf", "summary.json"}
    assert (out / "mlartifacts").is_dir()  # the default store keeps artifacts in output_dir


def test_resume_behind_the_last_logged_step_leaves_each_step_once_in_every_tracker(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    loggers = "[jsonl,tensorboard,wandb,mlflow]"
    _sft(assets, out, steps=4, save_every=2, loggers=loggers)
    shutil.rmtree(out / "checkpoints" / "step_00000004")  # "crashed" after logging step 4, before its save
    _next_second()
    summary = _sft(assets, out, steps=4, save_every=2, loggers=loggers)
    assert summary["resumed_from"] == 2
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    losses = [r["loss"] for r in records]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [s.step for s in scalars] == [1, 2, 3, 4]  # without the purge: 1, 2, 3, 4, 3, 4
    assert [s.value for s in scalars] == pytest.approx(losses, rel=1e-5)

    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["id"]
    _first, second = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    branch, steps = None, []
    for record in read_wandb_records(second):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            assert record.run.run_id == run_id
            updates = {u.key: json.loads(u.value_json) for u in record.run.config.update}
            branch = updates["_wandb"].get("branch_point")
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "train/loss" in items:
                steps.append(record.history.step.num)
    assert branch == {"run_id": run_id, "step": 2}  # the rewind: W&B keeps history up to step 2
    assert steps == [3, 4]

    stored = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=stored["tracking_uri"])
    run = client.get_run(stored["run_id"])
    assert run.data.tags["shardforge.stale_steps"] == "3-4" and run.data.tags["shardforge.resumed_from"] == "2"
    history = client.get_metric_history(stored["run_id"], "train/loss")
    latest: dict[int, tuple[int, float]] = {}
    for point in history:  # per step, the point logged last is the run's
        if point.step not in latest or point.timestamp >= latest[point.step][0]:
            latest[point.step] = (point.timestamp, point.value)
    assert sorted(latest) == [1, 2, 3, 4]
    assert [latest[s][1] for s in sorted(latest)] == pytest.approx(losses)


def test_a_missing_tracker_package_is_one_warning_with_the_pip_command(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with caplog.at_level("WARNING", logger="shardforge.algorithms.loggers.registry"):
        summary = _sft(assets, tmp_path / "run", steps=2, save_every=0, loggers="[jsonl,wandb,mlflow]")
    assert summary["steps"] == 2
    # Ours only: other libraries' clients alive in this worker process (the tinker SDK's heartbeats) log too.
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("shardforge.")]
    assert len(warnings) == 2, warnings
    assert "'wandb' failed to start (ImportError: wandb is not installed: pip install" in warnings[0]
    assert "'mlflow' failed to start (ImportError: mlflow is not installed: pip install" in warnings[1]
    assert not (tmp_path / "run" / "trackers.json").exists()


def test_the_package_and_sft_trainer_import_neither_tracker() -> None:
    code = (
        "import sys, shardforge.algorithms, shardforge.algorithms.trainers.sft, shardforge.algorithms.loggers;"
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _next_second() -> None:
    """Wait for the next wall-clock second: wandb names an offline run's directory by its start second, and a
    fast machine can start a resumed run in the second the first one started (both would write one directory).
    A real restart takes seconds."""
    time.sleep(math.ceil(time.time()) - time.time() + 0.01)


def _wait_for_history(path: Path, step: int, timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s``) until the ``.wandb`` file at ``path`` holds ``step``'s history: wandb-core, a
    process of its own, writes the file, and on a loaded machine (two test workers on two cores) it was seen
    still writing a resumed run's last steps after ``finish`` returned. A step that never arrives still fails."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            records = read_wandb_records(path)
        except (AssertionError, ValueError, IndexError):  # a record still being written
            records = []
        if any(r.WhichOneof("record_type") == "history" and r.history.step.num >= step for r in records):
            return
        time.sleep(0.5)
