"""Start-up thread count (threads.py): a single process takes the free cores (never 0, never
more than it has), several processes one thread each, the user's OMP_NUM_THREADS wins, and the
choice is logged in one line."""

from __future__ import annotations

import logging

import pytest
import torch

from shardforge.algorithms.trainers.run.threads import default_threads, set_process_threads


def test_default_threads_takes_the_free_cores() -> None:
    assert default_threads(2, 0.1) == 2  # quiet 2-core machine: both cores
    assert default_threads(2, 1.2) == 1
    assert default_threads(2, 4.0) == 1  # loaded: one thread, not two fighting for a core
    assert default_threads(16, 3.0) == 13
    assert default_threads(8, None) == 8


def test_set_process_threads_logs_one_line_and_honours_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("SHARDFORGE_THREADS", raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        with caplog.at_level(logging.INFO, logger="shardforge.algorithms.trainers.run.threads"):
            line = set_process_threads(1)
        assert line == "torch threads: 1 (from OMP_NUM_THREADS; set OMP_NUM_THREADS to choose)"
        assert [r.getMessage() for r in caplog.records] == [line]
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_process_threads(2).startswith("torch threads: 1 (2 processes on this machine")
        monkeypatch.setattr("shardforge.algorithms.trainers.run.threads._load", lambda: 5.0)
        assert set_process_threads(1).startswith("torch threads: 1 (")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
