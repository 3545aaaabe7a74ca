"""shardforge.rewards needs no torch: importing it (every module) and scoring with ``exact_match``, a composite
reward, the guarded batch runner and (where math-verify is installed) ``math_verify`` load no torch, in a fresh
process. The assertion is on ``sys.modules``, so it holds in the workspace venv, where torch is installed, as well
as in ``nox -s isolation``'s venv for this package, which has no torch (the session checks that too). The package
declares no dependency but shardforge-core, itself dependency-free."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

SCRIPT = """
import importlib, importlib.util, json, pkgutil, sys

import shardforge.rewards

names = [info.name for info in pkgutil.walk_packages(shardforge.rewards.__path__, "shardforge.rewards.")]
for name in names:  # math_answers and ray_pool import math-verify and ray only when used
    importlib.import_module(name)

from shardforge.rewards import REWARD_FUNCTIONS, RewardTermConfig, build_reward, load_reward_fn
from shardforge.rewards.guarded import GuardedReward, RewardConfig

exact = load_reward_fn("exact_match")
assert exact is REWARD_FUNCTIONS.get("exact_match")
scores = [exact("12+7=", "19", "19"), exact("12+7=", " 19.0 ", "19"), exact("12+7=", "18 or 19", "19")]
composite = build_reward("exact_match", (RewardTermConfig(name="exact_match", weight=2.0),))
guarded = GuardedReward(exact, RewardConfig(max_concurrency=2), name="exact")
batch = guarded.score_many([("", "3", "3"), ("", "4", "3")])
# math-verify (the [math] extra, in [test]) and its sympy stack: no torch either
math = None
if importlib.util.find_spec("math_verify"):
    math = load_reward_fn("math_verify")("", "so \\\\boxed{0.5}", "\\\\frac{1}{2}")
print(json.dumps({
    "modules": names,
    "scores": scores,
    "composite": composite("", "5", "5"),
    "batch": batch,
    "math_verify": math,
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
}))
"""


def test_rewards_import_and_score_without_loading_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert {"shardforge.rewards.functions", "shardforge.rewards.guarded", "shardforge.rewards.compose"} <= set(
        result["modules"]
    )
    assert result["scores"] == [1.0, 1.0, 0.0]
    assert result["composite"] == 2.0
    assert result["batch"] == [1.0, 0.0]
    assert result["math_verify"] in (1.0, None)  # None: math-verify not installed
    assert result["torch"] == []


def test_rewards_declare_only_shardforge_core() -> None:
    requires = importlib.metadata.requires("shardforge-rewards") or []
    assert [r.split(";")[0].strip() for r in requires if "extra ==" not in r] == ["shardforge-core==0.1.0"]
