"""``rollout.placement: colocated | disaggregated`` (issue 21): the refusals, the rollout actors' spec, the rank ->
actor map and the launcher's environment contract. No Ray needed (the Ray run is integration_tests/test_ray_launch.py)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from shardforge.algorithms.cli.main import main
from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.testing import tiny_assets
from shardforge.algorithms.trainers.grpo import GRPOConfig
from shardforge.algorithms.trainers.ppo import PPOConfig
from shardforge.rollout.ray.placement import (
    ROLLOUT_ACTORS_ENV,
    actor_for_rank,
    actor_names,
    rollout_actor_names_from_env,
    rollout_actor_spec,
)


def _config(cls=GRPOConfig, **entries):
    return build_config(cls, {"model": "m", "train_file": "t.jsonl", "output_dir": "o"} | entries)


def test_colocated_is_the_default_and_starts_no_actor():
    config = _config()
    assert config.rollout.placement == "colocated" and config.rollout.num_actors == 1
    for launcher in ("local", "ray"):
        assert rollout_actor_spec(config, launcher) is None


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_disaggregated_under_ray_gives_the_actors_spec(cls):
    config = _config(cls, **{"rollout.placement": "disaggregated", "rollout.num_actors": 2, "rollout.dtype": "bf16"})
    spec = rollout_actor_spec(config, "ray")
    assert spec is not None
    assert (spec.num_actors, spec.model, spec.tokenizer, spec.dtype) == (2, "m", "m", "bf16")
    with_tokenizer = rollout_actor_spec(dataclasses.replace(config, tokenizer="tok"), "ray")
    assert with_tokenizer is not None and with_tokenizer.tokenizer == "tok"


@pytest.mark.parametrize(
    ("entries", "launcher", "fragment"),
    [
        ({}, "local", "only --launcher ray starts (this run's launcher: local)"),
        ({}, "external", "add --launcher ray, or set rollout.placement=colocated"),
        ({"rollout.engine": "vllm"}, "ray", "runs vLLM as a server actor: set rollout.vllm.mode=server"),
        (
            {
                "async_rollouts": True,
                "rollout.engine": "vllm",
                "rollout.vllm": {"mode": "server", "weight_transport": "collective"},
            },
            "ray",
            "set rollout.vllm.weight_transport=auto or disk",
        ),
        (
            {
                "rollout.partial_rollouts": True,
                "async_rollouts": True,
                "rollout.engine": "vllm",
                "rollout.vllm": {"mode": "server"},
            },
            "ray",
            "does not interrupt the server's generations: set rollout.partial_rollouts=false",
        ),
        ({"engine": {"router_replay": True}}, "ray", "set engine.router_replay=false"),
        ({"rollout.num_actors": 0}, "ray", "rollout.num_actors=0 must be >= 1"),
        ({"rollout.on_actor_failure": "drop"}, "ray", "needs rollout.num_actors >= 2 (rollout.num_actors=1)"),
        (
            {"async_rollouts": True, "rollout.num_actors": 2, "rollout.on_actor_failure": "drop"},
            "ray",
            "which asynchronous rollouts run on a background thread: set rollout.on_actor_failure=error",
        ),
    ],
)
def test_unsupported_combinations_are_refused_with_the_fix(entries, launcher, fragment):
    with pytest.raises(ValueError, match=r"disaggregated|rollout\.num_actors") as error:
        rollout_actor_spec(_config(**({"rollout.placement": "disaggregated"} | entries)), launcher)
    assert fragment in str(error.value), str(error.value)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_the_rollout_actors_take_asynchronous_and_streaming_rollouts(engine, streaming):
    """Issue 41: the server actor loads disk versions when the generator asks (tests_vllm/test_vllm_streaming.py runs
    it); the embedded-HF actors load the disk version each call names (integration_tests/test_ray_launch.py and
    packages/rollout/tests/test_ray_rollout_disk_versions.py run them)."""
    server = {"rollout.vllm": {"mode": "server"}} if engine == "vllm" else {}
    entries = {"rollout.placement": "disaggregated", "rollout.engine": engine, **server,
               "async_rollouts": True, "streaming_rollouts": streaming, "rollout.streaming_workers": 2 if streaming else 1}  # fmt: skip
    spec = rollout_actor_spec(_config(**entries), "ray", world_size=2)
    assert spec is not None and spec.engine == engine and spec.interrupt_chunk_tokens == 0


def test_the_hf_rollout_actors_take_partial_rollouts():
    """Issue 41: the HF actors interrupt a call at a chunk boundary (integration_tests/test_ray_streaming_actors.py)."""
    entries = {"rollout.placement": "disaggregated", "async_rollouts": True, "streaming_rollouts": True,
               "rollout.partial_rollouts": True, "rollout.interrupt_chunk_tokens": 3}  # fmt: skip
    spec = rollout_actor_spec(_config(**entries), "ray", world_size=2)
    assert spec is not None and spec.engine == "hf" and spec.interrupt_chunk_tokens == 3


def test_dropping_dead_actors_needs_two_and_disaggregated_rollouts():
    config = _config(
        **{"rollout.placement": "disaggregated", "rollout.num_actors": 2, "rollout.on_actor_failure": "drop"}
    )
    assert rollout_actor_spec(config, "ray") is not None and config.rollout.on_actor_failure == "drop"
    assert _config().rollout.on_actor_failure == "error"
    with pytest.raises(ValueError) as error:
        rollout_actor_spec(_config(**{"rollout.on_actor_failure": "drop"}), "local")
    message = str(error.value)
    assert "\n" not in message and message.startswith("rollout.on_actor_failure=drop applies to the rollout actors")
    assert "set rollout.placement=disaggregated" in message, message
    with pytest.raises(ValueError, match=r"rollout.on_actor_failure: 'restart' is not one of \['error', 'drop'\]"):
        _config(**{"rollout.on_actor_failure": "restart"})


def test_an_unknown_placement_lists_the_valid_ones():
    with pytest.raises(ValueError, match="colocated") as error:
        _config(**{"rollout.placement": "remote"})
    assert "disaggregated" in str(error.value)


def test_ranks_map_round_robin_onto_actors():
    assert [actor_for_rank(rank, 2) for rank in range(5)] == [0, 1, 0, 1, 0]
    assert [actor_for_rank(rank, 1) for rank in range(3)] == [0, 0, 0]
    assert actor_names(2) == ["shardforge-rollout-0", "shardforge-rollout-1"]
    with pytest.raises(ValueError):
        actor_for_rank(0, 0)


def test_a_rank_finds_the_launchers_actors_or_says_it_needs_ray():
    assert rollout_actor_names_from_env(2, {ROLLOUT_ACTORS_ENV: "a,b"}) == ["a", "b"]
    with pytest.raises(ValueError, match=r"needs the rollout actors that .*--launcher ray"):
        rollout_actor_names_from_env(1, {})
    with pytest.raises(ValueError, match=r"started 2 rollout actors .* asks for 1"):
        rollout_actor_names_from_env(1, {ROLLOUT_ACTORS_ENV: "a,b"})


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"rollout.placement": "disaggregated"}, "rollout.placement=disaggregated runs the rollout engine in Ray"),
        (
            {"rollout.placement": "disaggregated", "rollout.engine": "vllm", "rollout.vllm": {"mode": "server"}},
            "rollout.placement=disaggregated runs the rollout engine in Ray",
        ),
        ({"reward": {"ray_workers": 2}}, "reward.ray_workers=2 scores rewards in Ray actors"),
    ],
    ids=["disaggregated", "vllm_server_actor", "reward_workers"],
)
def test_cli_refuses_ray_only_settings_without_ray_before_any_rank_starts(
    tmp_path, capsys, monkeypatch, setting, message
):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assets = tiny_assets(tmp_path / "assets", max_operand=9, num_eval=4)
    capsys.readouterr()  # the assets' progress bars
    data = {
        "model": str(assets["model"]), "train_file": str(assets["train"]), "output_dir": str(tmp_path / "run"),
        "steps": 1, "prompts_per_step": 2, "group_size": 2, "progress": False, **setting,
    }  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    code = main(["train", "grpo", "--config", str(path), "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"shardforge: error: {message}"), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
