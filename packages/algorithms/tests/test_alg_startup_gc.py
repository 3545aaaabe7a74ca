"""The cyclic GC is paused while a `shardforge` command starts up, and on again for the steps (issue 25).

`startup_gc.paused_gc` wraps ``cli.main``; the trainer loop calls `end_startup_gc` just before the
first step (the launcher: before its agent waits for the ranks). A run must train with the collector
on (a long run would otherwise keep every garbage cycle it makes), start up with it off (that is
the speed-up), and leave an in-process caller (tests, notebooks) as it found it.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import yaml

from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.trainers.run.startup_gc import end_startup_gc, paused_gc


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("startup_gc"))


def test_paused_until_end_of_startup_then_frozen_and_restored():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with paused_gc():
        assert not gc.isenabled()
        made = [[] for _ in range(10)]  # objects start-up made
        end_startup_gc()
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)  # frozen: never scanned again
        end_startup_gc()  # a second call changes nothing
        assert gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the caller's objects are collectable again


def test_a_command_that_fails_during_startup_restores_the_collector():
    with pytest.raises(ValueError), paused_gc():
        raise ValueError("bad config")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_caller_that_turned_the_collector_off_keeps_it_off():
    gc.disable()
    try:
        with paused_gc():
            end_startup_gc()
            assert not gc.isenabled() and gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


# A rank as `shardforge train` runs it (world 1, a fresh interpreter): the collector's state while the
# data is read and while each step runs, and after `main` returns.
PROBE = """
import gc, json, sys
from shardforge.algorithms.trainers.sft import SFTTrainer
seen = {"load_data": [], "train_step": []}
for name in seen:
    original = getattr(SFTTrainer, name)
    def wrapped(self, *args, _original=original, _name=name):
        seen[_name].append([gc.isenabled(), gc.get_freeze_count() > 0])
        return _original(self, *args)
    setattr(SFTTrainer, name, wrapped)
from shardforge.algorithms.cli.main import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "after": [gc.isenabled(), gc.get_freeze_count()], **seen}))
"""


def test_a_training_run_starts_up_without_and_steps_with_the_collector(tmp_path, assets):
    config = tmp_path / "sft.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": assets["model"], "tokenizer": str(assets["root"] / "tokenizer"),
                "train_file": str(assets["train"]), "output_dir": str(tmp_path / "out"), "layout": "d1",
                "steps": 2, "global_batch_size": 4, "progress": False, "export_hf_at_end": False,
                "loggers": ["jsonl"],
            }
        )
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "train", "sft", "--config", str(config)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, result
    assert result["load_data"] == [[False, False]], result  # start-up: paused
    assert result["train_step"] == [[True, True], [True, True]], result  # steps: on, start-up objects frozen
    assert result["after"] == [True, 0], result  # main returned: as the caller had it
