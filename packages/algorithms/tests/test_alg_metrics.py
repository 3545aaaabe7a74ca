"""`MetricsLogger` (JSONL + TensorBoard) and `read_metrics`."""

from __future__ import annotations

import json

from shardforge.algorithms.loggers import MetricsLogger, read_metrics


def test_logger_writes_one_json_line_per_call(tmp_path):
    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    logger.log(1, {"loss": 2.5, "lr": 0.1})
    logger.log(2, {"loss": 2.0, "lr": 0.1})
    logger.log(2, {"loss": 3.0}, split="eval")
    logger.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["split"], r["loss"]) for r in records] == [
        (1, "train", 2.5),
        (2, "train", 2.0),
        (2, "eval", 3.0),
    ]
    assert all(isinstance(r["time"], float) for r in records)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_read_metrics_filters_by_split(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "split": "train", "loss": 1.0}\n'
        "\n"
        '{"step": 1, "split": "eval", "loss": 5.0}\n'
        '{"step": 2, "split": "train", "loss": 0.5}\n'
    )
    assert [r["loss"] for r in read_metrics(path)] == [1.0, 0.5]
    assert [r["loss"] for r in read_metrics(path, "eval")] == [5.0]
    assert read_metrics(path, "test") == []


def test_logger_appends_to_an_existing_file(tmp_path):
    MetricsLogger(tmp_path, tensorboard=False).log(1, {"loss": 1.0})
    MetricsLogger(tmp_path, tensorboard=False).log(2, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_event_file_is_written(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"loss": 1.0})
    logger.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
