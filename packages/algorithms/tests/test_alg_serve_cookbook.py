"""tinker-cookbook's basic recipes, unchanged, against `shardforge serve` on 127.0.0.1.

``tinker_cookbook.recipes.sl_basic`` and ``rl_basic`` (synchronous and asynchronous) are run through their own entry
points (``main(config)``, the config from their ``build_config_blueprint()`` with overrides, as their command line
would apply them).
What is swapped goes through the recipes' own hooks: the model is the directory of a tiny local Qwen3 (the
cookbook's ``get_tokenizer`` loads a local directory's tokenizer; the service accepts the directory as
``base_model``), the renderer is the cookbook's generic ``role_colon``, the SFT data is a local JSONL file through
``FromConversationFileBuilder`` (the swap the recipe's own comment shows) and the RL data is the cookbook's own
``ArithmeticDatasetBuilder`` (generated, nothing downloaded) instead of GSM8K. The RL run starts from the SFT
run's final checkpoint (``load_checkpoint_path``), so its groups have reward variance to learn from. Skips
without ``tinker`` or ``tinker_cookbook`` (the tests session installs the cookbook ``--no-deps``, noxfile.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')")
pytest.importorskip(
    "tinker_cookbook", reason="tinker-cookbook is not installed (noxfile.py's tests session installs it --no-deps)"
)

import tinker

from shardforge.algorithms.serve.config import ServeConfig
from shardforge.algorithms.serve.server import ServiceServer
from shardforge.algorithms.serve.service import TinkerService
from shardforge.algorithms.serve.tenants import TenantKeys

KEY = "tml-cook-0123456789"
RENDERER = "role_colon"
SFT_ROWS, SFT_TEST_ROWS, SFT_BATCH, SFT_EPOCHS = 160, 8, 8, 3
RL_STEPS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import PRINTABLE_CHARS, build_char_tokenizer, build_tiny_qwen3

    root = tmp_path_factory.mktemp("cookbook")
    model_dir = root / "model"
    # The recipes render chat text ("User: ...\n\nAssistant: ..."): a character tokenizer over printable ASCII, and
    # a context long enough for the RL recipe's few-shot prompt plus its answer.
    tokenizer = build_char_tokenizer(model_dir, chars=PRINTABLE_CHARS)
    build_tiny_qwen3(model_dir, tokenizer, hidden=64, layers=2, max_positions=256)
    config = ServeConfig(model_dir=str(model_dir), output_dir=str(root / "out"), max_tokens=32)
    server = ServiceServer(TinkerService(config, TenantKeys({KEY: "cook"})), port=0).start()
    # The recipes build their own ServiceClient(base_url=config.base_url): the key comes from the environment.
    saved = {name: os.environ.get(name) for name in ("TINKER_API_KEY", "TINKER_TELEMETRY")}
    os.environ.update(TINKER_API_KEY=KEY, TINKER_TELEMETRY="0")
    # The recipes replace the root logger's handlers (a console and a log file) and set its level: put them back
    # after this module, for the tests that run after it in the same process.
    root_logger = logging.getLogger()
    handlers, level = root_logger.handlers[:], root_logger.level
    yield {"root": root, "model": str(model_dir), "server": server, "service": server.service}
    for handler in root_logger.handlers[:]:
        if handler not in handlers:
            root_logger.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root_logger.handlers:
            root_logger.addHandler(handler)
    root_logger.setLevel(level)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _model_id(tinker_path: str) -> str:
    return tinker_path.removeprefix("tinker://").split("/")[0]


def _finite(row: dict[str, Any]) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


@pytest.fixture(scope="module")
def sl_run(served) -> Path:
    """sl_basic.main on addition conversations in the RL recipe's few-shot format (a local JSONL file)."""
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    root: Path = served["root"]
    rng = random.Random(0)
    with open(root / "conversations.jsonl", "w") as f:
        for _ in range(SFT_ROWS + SFT_TEST_ROWS):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            messages = [
                {"role": "user", "content": "What is 4 + 5?"},
                {"role": "assistant", "content": "9"},
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": str(x + y)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=served["model"], renderer_name=RENDERER, max_length=128, batch_size=SFT_BATCH,
        train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE,
    )  # fmt: skip
    data = FromConversationFileBuilder(
        common_config=common, file_path=str(root / "conversations.jsonl"), test_size=SFT_TEST_ROWS
    )
    config = (
        sl_basic.build_config_blueprint()
        .apply({
            "model_name": served["model"], "renderer_name": RENDERER, "dataset_builder": data,
            "base_url": served["server"].url, "log_path": str(root / "sl_basic"),
            # a tiny random model needs a far larger step than the recipe's 2e-4 for a 9B model
            "learning_rate": 1e-2, "num_epochs": SFT_EPOCHS, "save_every": 20, "eval_every": 20,
        })
        .make()
    )  # fmt: skip
    sl_basic.main(config)
    return root / "sl_basic"


def test_sl_basic_recipe_trains_through_the_service(served, sl_run: Path) -> None:
    rows = _rows(sl_run / "metrics.jsonl")
    steps = SFT_EPOCHS * SFT_ROWS // SFT_BATCH
    assert [row["step"] for row in rows] == list(range(steps))
    assert all(_finite(row) for row in rows)
    # The service's optimizer-step counter (optim_step's metrics) follows the recipe's step, one step per batch.
    assert [row["step:max"] for row in rows] == [float(step + 1) for step in range(steps)]
    nll = [row["train_mean_nll"] for row in rows]
    assert sum(nll[-5:]) / 5 < 0.4 * nll[0], nll
    # test/nll: the recipe's SamplerNLLEvaluator over the held-out rows, through save_weights_and_get_sampling_client
    # and compute_logprobs on the service's sampler, before steps 0, 20, 40.
    evals = [row["test/nll"] for row in rows if "test/nll" in row]
    assert len(evals) == 3 and evals[-1] < 0.4 * evals[0], evals

    checkpoints = _rows(sl_run / "checkpoints.jsonl")
    assert [c["name"] for c in checkpoints] == ["000020", "000040", "final"]
    model_id = _model_id(checkpoints[-1]["state_path"])
    model = served["service"].registry.models[model_id]
    assert model.steps == steps and model.lora is not None and model.lora.r == 32  # the recipe's lora_rank
    rest = tinker.RestClient(base_url=served["server"].url, api_key=KEY)
    listed = {c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints}
    assert {c[kind] for c in checkpoints for kind in ("state_path", "sampler_path")} <= listed
    # What the cookbook reads back before it loads a checkpoint: the renderer it trained with, kept by the service.
    run = rest.get_training_run_by_tinker_path(checkpoints[-1]["state_path"]).result()
    assert run.training_run_id == model_id and run.is_lora and run.lora_rank == 32
    assert run.user_metadata is not None and run.user_metadata["renderer_name"] == RENDERER
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == checkpoints[-1]["state_path"]


def test_rl_basic_recipe_trains_from_the_sft_checkpoint(served, sl_run: Path) -> None:
    from tinker_cookbook.recipes import rl_basic
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder

    start = _rows(sl_run / "checkpoints.jsonl")[-1]["state_path"]
    log_path = served["root"] / "rl_basic"
    data = ArithmeticDatasetBuilder(
        batch_size=2, group_size=4, n_batches=RL_STEPS, renderer_name=RENDERER, model_name_for_tokenizer=served["model"]
    )
    config = (
        rl_basic.build_config_blueprint()
        .apply({
            "model_name": served["model"], "renderer_name": RENDERER, "dataset_builder": data,
            "base_url": served["server"].url, "log_path": str(log_path), "load_checkpoint_path": start,
            "learning_rate": 3e-4, "max_tokens": 16, "save_every": 2,
            # rolling checkpoints at steps 1 and 3, each deleted (RestClient.delete_checkpoint) once the next is saved
            "rolling_save_every": 1,
        })
        .make()
    )  # fmt: skip
    rl_basic.main(config)

    rows = _rows(log_path / "metrics.jsonl")
    steps = [row for row in rows if "env/all/reward/total" in row]
    assert [row["step"] for row in steps] == list(range(RL_STEPS)) and all(_finite(row) for row in rows)
    assert [row["step:max"] for row in steps] == [float(step + 1) for step in range(RL_STEPS)]
    # The sampler's log-probs of the sampled tokens equal the trainer's forward on them (the recipe's
    # kl_sample_train_v1, ~1e-8 here): both serve the weights of the step's save_weights_and_get_sampling_client.
    assert all(abs(row["optim/kl_sample_train_v1"]) < 1e-4 for row in steps)
    # From the SFT checkpoint some answers end with the stop sequence and some do not: groups with reward
    # variance, whose importance_sampling gradients the service applied (the base model never stops: all -0.1).
    mixed = [row for row in steps if row["env/all/by_group/frac_mixed"] > 0]
    assert mixed and all(row["grad_norm:mean"] > 0 for row in mixed)
    assert all(row["grad_norm:mean"] == 0 for row in steps if row["env/all/by_group/frac_mixed"] == 0)

    checkpoints = _rows(log_path / "checkpoints.jsonl")
    rolling = sorted(c["name"] for c in checkpoints if c.get("rolling"))
    kept = [c for c in checkpoints if not c.get("rolling")]
    assert rolling == ["000001", "000003"] and [c["name"] for c in kept] == ["000002", "000004", "final"]
    model_id = _model_id(checkpoints[-1]["state_path"])
    rest = tinker.RestClient(base_url=served["server"].url, api_key=KEY)
    listed = {c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints}
    assert {c["state_path"] for c in kept} <= listed
    assert not {c["state_path"] for c in checkpoints if c.get("rolling")} & listed  # the recipe deleted them
    assert model_id != _model_id(start)  # a new training run, created from the SFT state
    model = served["service"].registry.models[model_id]
    assert model.steps == RL_STEPS and model.user_metadata["renderer_name"] == RENDERER
    assert model.lora is not None and model.lora.r == 32  # the checkpoint's rank


def test_rl_basic_recipe_with_kl_penalty_ppo_and_substeps(served, sl_run: Path) -> None:
    """The same recipe with the loop's other paths: a KL penalty against the base model (a base-model sampling
    client and ``compute_logprobs``), the ``ppo`` loss, two optimizer steps per batch, post-update KL metrics."""
    from tinker_cookbook.recipes import rl_basic
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl.train import KLReferenceConfig

    log_path = served["root"] / "rl_basic_kl"
    data = ArithmeticDatasetBuilder(
        batch_size=2, group_size=4, n_batches=2, renderer_name=RENDERER, model_name_for_tokenizer=served["model"]
    )
    config = (
        rl_basic.build_config_blueprint()
        .apply({
            "model_name": served["model"], "renderer_name": RENDERER, "dataset_builder": data,
            "base_url": served["server"].url, "log_path": str(log_path), "save_every": 0,
            "load_checkpoint_path": _rows(sl_run / "checkpoints.jsonl")[-1]["state_path"],
            "learning_rate": 3e-4, "max_tokens": 16, "loss_fn": "ppo", "num_substeps": 2, "compute_post_kl": True,
            "kl_penalty_coef": 0.01, "kl_reference_config": KLReferenceConfig(base_model=served["model"]),
        })
        .make()
    )  # fmt: skip
    rl_basic.main(config)

    steps = [row for row in _rows(log_path / "metrics.jsonl") if "env/all/reward/total" in row]
    assert [row["step"] for row in steps] == [0, 1] and all(_finite(row) for row in steps)
    assert [row["step:max"] for row in steps] == [2.0, 4.0]  # two optim_step calls per batch
    # The SFT policy has moved far from the random base: a large KL to it (about 3.8 nats a token here).
    assert all(row["kl_policy_base"] > 0.5 for row in steps)
    # the sampler after the update differs from the one before it wherever a gradient moved the weights
    assert all(row["kl_pre_post_v2"] > 0 for row in steps if row["grad_norm:mean"] > 0)
    model_id = _model_id(_rows(log_path / "checkpoints.jsonl")[-1]["state_path"])
    assert served["service"].registry.models[model_id].steps == 4


def test_rl_basic_recipe_asynchronous(served, sl_run: Path) -> None:
    """The recipe's asynchronous mode (``AsyncConfig``): sampling for the next steps runs while the service trains,
    at most one step off policy, with the ``ppo`` loss (the mode's default ``stable_reinforce`` is not served)."""
    from tinker_cookbook.recipes import rl_basic
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl.train import AsyncConfig

    log_path = served["root"] / "rl_basic_async"
    data = ArithmeticDatasetBuilder(
        batch_size=2, group_size=4, n_batches=RL_STEPS, renderer_name=RENDERER, model_name_for_tokenizer=served["model"]
    )
    config = (
        rl_basic.build_config_blueprint()
        .apply({
            "model_name": served["model"], "renderer_name": RENDERER, "dataset_builder": data,
            "base_url": served["server"].url, "log_path": str(log_path), "save_every": 0,
            "load_checkpoint_path": _rows(sl_run / "checkpoints.jsonl")[-1]["state_path"],
            "learning_rate": 3e-4, "max_tokens": 16,
            "async_config": AsyncConfig(max_steps_off_policy=1, groups_per_batch=2, loss_fn="ppo"),
        })
        .make()
    )  # fmt: skip
    rl_basic.main(config)
    steps = [row for row in _rows(log_path / "metrics.jsonl") if "env/all/reward/total" in row]
    assert [row["step"] for row in steps] == list(range(RL_STEPS)) and all(_finite(row) for row in steps)
    # Every batch was sampled at most one optimizer step before it was trained, and some were: the sampling
    # clients of older weights kept serving while the service trained.
    assert all(row["async/staleness_max"] <= 1 for row in steps)
    assert any(row["async/staleness_max"] == 1 for row in steps)
    assert steps[-1]["training_client/step"] == RL_STEPS - 1
    mixed = [row for row in steps if row["env/all/by_group/frac_mixed"] > 0]
    assert all(row["grad_norm:mean"] > 0 for row in mixed)
    # The asynchronous loop saves its first checkpoint with the recipe's ttl_seconds (7 days), the final one
    # without: the service keeps both as asked.
    saved = {row["name"]: row["state_path"] for row in _rows(log_path / "checkpoints.jsonl")}
    rest = tinker.RestClient(base_url=served["server"].url, api_key=KEY)
    listed = {
        c.tinker_path: c.expires_at for c in rest.list_checkpoints(_model_id(saved["final"])).result().checkpoints
    }
    first = listed[saved["000000"]]
    assert first is not None and abs(first.timestamp() - time.time() - 7 * 24 * 3600) < 600
    assert listed[saved["final"]] is None
