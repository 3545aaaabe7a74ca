"""Rollout-engine selection without vLLM: the factory, the vLLM options and the trainer config fields.

Runs in the main test venv (no vLLM). "vLLM missing" is simulated with ``sys.modules["vllm"] = None``
so the test means the same where vLLM is installed. The vLLM engine itself is tested against a
real vLLM in packages/algorithms/tests_vllm (``nox -s vllm``).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import apply_overrides, build_config
from shardforge.rollout import HFRolloutEngine
from shardforge.rollout.config import RolloutConfig, VLLMOptions
from shardforge.rollout.factory import build_rollout_engine
from shardforge.rollout.seeds import request_seed
from shardforge.rollout.vllm.engine import _tokenizer_dir, require_main_thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("factory")
    tokenizer = tiny_assets(root, seed=0, data=False)["tokenizer"]
    return str(root / "model"), tokenizer


def test_factory_builds_the_hf_engine_and_rejects_unknown_kinds(tiny: tuple[str, Any], tmp_path: Path) -> None:
    model, tokenizer = tiny
    engine = build_rollout_engine("hf", model, tokenizer, weights_root=tmp_path / "weights")
    assert isinstance(engine, HFRolloutEngine) and engine.version == 0 and engine.source is not None
    with pytest.raises(ValueError, match=r"rollout.engine='tgi' is not one of \['hf', 'vllm'\]"):
        build_rollout_engine("tgi", model, tokenizer)


def test_the_embedded_engine_generates_on_this_ranks_device(
    tiny: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU rank the trainers' HF rollout engine must sample on the GPU, not on the CPU (it did:
    the factory never passed a device). "meta" stands in for cuda:N here: any device but the CPU."""
    import torch

    import shardforge.mesh

    model, tokenizer = tiny
    monkeypatch.setattr(shardforge.mesh, "current_device", lambda: torch.device("meta"))
    engine = build_rollout_engine("hf", model, tokenizer)
    assert isinstance(engine, HFRolloutEngine)
    assert engine.device == torch.device("meta")
    assert {p.device.type for p in engine.model.parameters()} == {"meta"}


def test_factory_says_how_to_install_vllm_when_it_is_missing(
    tiny: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r"needs vLLM, which is not installed: pip install .*\[vllm\]") as info:
        build_rollout_engine("vllm", model, tokenizer)
    assert "nox -s vllm" in str(info.value) and "docs/packages/algorithms-grpo.md" in str(info.value)
    # A server started from this interpreter needs vLLM here too.
    with pytest.raises(ImportError, match="needs vLLM, which is not installed"):
        build_rollout_engine(RolloutConfig(engine="vllm", vllm=VLLMOptions(mode="server")), model, tokenizer)


def test_server_mode_reports_a_server_that_does_not_start(tiny: tuple[str, Any], tmp_path: Path) -> None:
    """A server interpreter without vLLM: the engine fails fast with the server's own log."""
    import sys

    model, tokenizer = tiny
    options = VLLMOptions(mode="server", server_python=sys.executable, server_startup_timeout_s=120)
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') is None else 1)"
    if __import__("subprocess").run([sys.executable, "-c", code]).returncode != 0:
        pytest.skip("this interpreter has vLLM: the server would start")
    with pytest.raises(RuntimeError, match=r"the vLLM server exited with code 1; log tail:\n.*No module named 'vllm'"):
        build_rollout_engine(RolloutConfig(engine="vllm", vllm=options), model, tokenizer, weights_root=tmp_path / "w")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"placement": "rank1"}, r"rollout.vllm.placement='rank1' is not one of \['rank0', 'each_rank'\]"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        ({"kv_cache_space_gib": 0}, "kv_cache_space_gib=0 must be a whole number >= 1"),
        ({"max_model_len": 1}, "max_model_len=1 must be >= 2"),
        ({"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
        ({"mode": "remote"}, r"rollout.vllm.mode='remote' is not one of \['in_process', 'server'\]"),
        ({"server_startup_timeout_s": 0.0}, "server_startup_timeout_s=0.0 must be > 0"),
    ],
)
def test_vllm_options_are_validated(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VLLMOptions(**change)


def test_factory_checks_the_options_type() -> None:
    with pytest.raises(TypeError, match=r"rollout\.vllm must be VLLMOptions, got dict"):
        RolloutConfig(engine="vllm", vllm={"placement": "rank0"})  # type: ignore[arg-type]


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_trainer_configs_select_the_engine(trainer: str) -> None:
    if trainer == "grpo":
        from shardforge.algorithms.trainers.grpo import GRPOConfig as Config
    else:
        from shardforge.algorithms.trainers.ppo import PPOConfig as Config  # type: ignore[assignment]
    base = {"model": "m", "train_file": "t.jsonl", "output_dir": "o"}
    default = build_config(Config, base)
    assert default.rollout.engine == "hf" and default.rollout.vllm == VLLMOptions()
    data = apply_overrides(
        base, ["rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.max_model_len=48"]
    )
    config = build_config(Config, data)
    assert config.rollout.engine == "vllm"
    assert config.rollout.vllm == dataclasses.replace(VLLMOptions(), gpu_memory_utilization=0.3, max_model_len=48)
    with pytest.raises(ValueError, match=r"rollout.engine: 'sglang' is not one of \['hf', 'vllm'\]"):
        build_config(Config, base | {"rollout.engine": "sglang"})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['gpu_mem'\] in rollout.vllm"):
        build_config(Config, base | {"rollout.vllm": {"gpu_mem": 0.3}})
    with pytest.raises(
        ValueError, match=r"rollout.vllm.placement: 'everywhere' is not one of \['rank0', 'each_rank'\]"
    ):
        build_config(Config, base | {"rollout.vllm": {"placement": "everywhere"}})
    with pytest.raises(ValueError, match=r"rollout.vllm.gpu_memory_utilization=2.0 must be in \(0, 1\]"):
        build_config(Config, base | {"rollout.vllm": {"gpu_memory_utilization": 2}})


def test_request_seeds_are_distinct_and_leave_room_for_the_sample_index() -> None:
    n = 8
    seeds = [request_seed(s, i, n) for s in range(50) for i in range(64)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**62 - n for s in seeds)
    # vLLM gives sample k of a prompt seed s + k: the ranges of different prompts must not overlap.
    spans = sorted(seeds)
    assert all(b - a >= n for a, b in itertools.pairwise(spans))
    assert request_seed(3, 5, n) == request_seed(3, 5, n)


def test_vllm_gets_the_tokenizer_directory_the_trainer_loaded(tiny: tuple[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model, tokenizer = tiny
    separate = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(separate))
    assert _tokenizer_dir(AutoTokenizer.from_pretrained(str(separate)), model) == str(separate)
    assert _tokenizer_dir(object(), model) == model  # no directory to point at: the model's


def test_collective_vllm_modes_refuse_the_async_rollout_thread() -> None:
    """rank0 placement and a shared server use collectives: not from GRPO's async generator thread."""
    from concurrent.futures import ThreadPoolExecutor

    require_main_thread("rank0 placement")  # the trainer's own thread: fine
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(require_main_thread, "rank0 placement")
        with pytest.raises(
            RuntimeError, match=r"cannot run on a background thread .* rollout.vllm.placement=each_rank"
        ):
            future.result()


def test_rank0_vllm_refuses_a_held_out_split_that_leaves_a_rank_without_prompts() -> None:
    from types import SimpleNamespace

    from shardforge.algorithms.trainers.rl.common import check_eval_split

    def config(engine: str = "vllm", placement: str = "rank0", eval_size: int | None = None) -> Any:
        rollout = RolloutConfig(engine=engine, vllm=VLLMOptions(placement=placement))
        return SimpleNamespace(rollout=rollout, eval_size=eval_size)

    with pytest.raises(ValueError, match="1 prompts for 2 data-parallel ranks"):
        check_eval_split(config(eval_size=1), 16, 2)
    with pytest.raises(ValueError, match="3 prompts for 4"):
        check_eval_split(config(), 3, 4)
    # Fine: enough prompts, one rank, no held-out set, per-rank engines, or the embedded engine.
    check_eval_split(config(eval_size=2), 16, 2)
    check_eval_split(config(eval_size=1), 16, 1)
    check_eval_split(config(eval_size=1), None, 2)
    check_eval_split(config(placement="each_rank", eval_size=1), 16, 2)
    check_eval_split(config(engine="hf", eval_size=1), 16, 2)


def test_old_flat_rollout_keys_fail_in_one_line_naming_the_new_key() -> None:
    """The RL configs' flat rollout keys moved into the ``rollout:`` section (issue 37): each old key is refused in one
    line that names its new place, for every RL trainer and for ``shardforge eval``."""
    from shardforge.algorithms.trainers.eval_run import EvalConfig
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.ppo import PPOConfig
    from shardforge.algorithms.trainers.rl.common import ROLLOUT_KEYS

    bases = {
        GRPOConfig: {"model": "m", "train_file": "t.jsonl", "output_dir": "o"},
        PPOConfig: {"model": "m", "train_file": "t.jsonl", "output_dir": "o"},
        EvalConfig: {"model": "m", "eval_files": ["e.jsonl"], "output_dir": "o"},
    }
    assert set(ROLLOUT_KEYS) >= {"rollout_engine", "rollout_placement", "vllm", "partial_rollouts"}
    for cls, base in bases.items():
        for old, new in ROLLOUT_KEYS.items():
            with pytest.raises(ValueError) as error:
                build_config(cls, base | {old: {} if old == "vllm" else "x"})
            message = str(error.value)
            assert "\n" not in message and message.startswith(f"config key {old} is now {new}"), message
    with pytest.raises(ValueError, match=r"also move \['rollout_sleep'\]"):
        build_config(GRPOConfig, bases[GRPOConfig] | {"rollout_engine": "hf", "rollout_sleep": True})


USER_ENGINE = '''
from shardforge.rollout.hf.engine import HFRolloutEngine


class TaggedEngine(HFRolloutEngine):
    """A user's engine: the embedded one, remembering the section it was built from."""

    def __init__(self, *args, built_with, **kwargs):
        super().__init__(*args, **kwargs)
        self.built_with = built_with


def build(model_dir, tokenizer, *, config, weights_root, seed, record_routing, chunks):
    return TaggedEngine(model_dir, tokenizer, weights_root=weights_root, dtype=config.dtype, kv_reuse=config.kv_reuse,
                        record_routing=record_routing, chunks=chunks, built_with=config)
'''


def test_a_users_engine_is_selected_from_yaml_by_import_path(
    tiny: tuple[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollout.engine: package.module:function`` builds a user's engine with every option of the section, and the
    factory picks its publisher in one place (in memory for an engine in the trainer's processes, else disk)."""
    import yaml

    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.rollout.factory import build_rollout
    from shardforge.rollout.publish import DiskPublisher, InProcessPublisher

    model, tokenizer = tiny
    (tmp_path / "user_engines.py").write_text(USER_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = f"model: {model}\ntrain_file: unused.jsonl\noutput_dir: {tmp_path}/o\nrollout:\n  engine: user_engines:build\n  kv_reuse: false\n"
    config = build_config(GRPOConfig, yaml.safe_load(text))
    built = build_rollout(config.rollout, model, tokenizer, weights_root=tmp_path / "w")
    engine: Any = built.engine
    assert type(engine).__name__ == "TaggedEngine" and engine.built_with == config.rollout
    assert engine.kv_reuse is False and engine.chunks is None and built.chunks is None
    assert isinstance(built.publisher, InProcessPublisher)
    asynchronous = build_rollout(config.rollout, model, tokenizer, weights_root=tmp_path / "w", asynchronous=True,
                                 keep_versions=5)  # fmt: skip
    assert isinstance(asynchronous.publisher, DiskPublisher) and asynchronous.publisher.keep_last == 5
    partial = dataclasses.replace(config.rollout, partial_rollouts=True, interrupt_chunk_tokens=4)
    chunked = build_rollout(partial, model, tokenizer, weights_root=tmp_path / "w", asynchronous=True)
    assert chunked.chunks is not None and chunked.chunks.chunk_tokens == 4 and chunked.engine.chunks is chunked.chunks  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_engines'"):
        build_rollout(dataclasses.replace(config.rollout, engine="no_such_engines:build"), model, tokenizer)


def test_variant_knobs_live_in_their_variants_section() -> None:
    """Issue 37: a variant's options are a section named after it (``actor.sapo``, ``workflow.tool_use``); the old
    flat keys are refused in one line naming the new key."""
    from shardforge.algorithms.trainers.grpo import GRPOConfig

    base = {"model": "m", "train_file": "t.jsonl", "output_dir": "o"}
    config = build_config(GRPOConfig, base | {"actor.sapo.tau_neg": 1.2, "workflow.tool_use.tools": ["python"]})
    assert config.actor.sapo.tau_neg == 1.2 and config.workflow.tool_use.tools == ("python",)
    for old, new in (("actor.clip_cov_ratio", "actor.clip_cov.ratio"), ("actor.ppo_kl_coef", "actor.kl_cov.coef"),
                     ("workflow.tools", "workflow.tool_use.tools"), ("workflow.feedback", "workflow.multi_turn.feedback")):  # fmt: skip
        with pytest.raises(ValueError) as error:
            build_config(GRPOConfig, base | {old: 1})
        assert str(error.value).startswith(f"config key {old} is now {new}"), str(error.value)


KEYWORD_BUILDERS = """
from types import SimpleNamespace

CALLS = []


def _engine(**kwargs):
    CALLS.append(kwargs)
    return SimpleNamespace(source=None, version=0)


def old(model_dir, tokenizer, *, config, weights_root, seed, record_routing, chunks):
    return _engine(config=config)


def new(model_dir, tokenizer, *, config, weights_root, seed, record_routing, chunks, asynchronous=False):
    return _engine(config=config, asynchronous=asynchronous)


def catch_all(model_dir, tokenizer, **kwargs):
    return _engine(**kwargs)
"""


def test_asynchronous_reaches_only_builders_that_declare_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_rollout_engine(asynchronous=...)` calls a builder written against `RolloutEngineBuilder` (no such
    keyword) exactly as before, passes it to one that declares it, and not into a ``**kwargs`` catch-all."""
    import importlib

    (tmp_path / "keyword_builders.py").write_text(KEYWORD_BUILDERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = importlib.import_module("keyword_builders").CALLS
    for asynchronous in (False, True):
        for name in ("old", "new", "catch_all"):
            build_rollout_engine(f"keyword_builders:{name}", tmp_path, None, asynchronous=asynchronous)
        assert "asynchronous" not in calls[-3]
        assert calls[-2]["asynchronous"] is asynchronous
        assert "asynchronous" not in calls[-1] and set(calls[-1]) >= {"config", "chunks"}


def test_the_vllm_builder_makes_a_shared_server_switch_per_call_when_asynchronous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollout.vllm.mode: server`` built for asynchronous rollouts gets ``per_call_versions`` (the version gate
    with several ranks: test_rollout_server_shared_async.py); synchronous, it does not."""
    from shardforge.rollout.vllm import server

    seen: list[bool] = []

    def record(self: Any, *args: Any, per_call_versions: bool = False, **kwargs: Any) -> None:
        seen.append(per_call_versions)

    monkeypatch.setattr(server.VLLMServerRolloutEngine, "__init__", record)
    config = RolloutConfig(engine="vllm", vllm=VLLMOptions(mode="server", server_url="http://127.0.0.1:1"))
    for asynchronous in (False, True):
        build_rollout_engine(config, tmp_path, None, asynchronous=asynchronous)
    assert seen == [False, True]
