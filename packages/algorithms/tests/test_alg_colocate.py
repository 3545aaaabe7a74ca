"""Colocated placement (trainers/rl_colocate.py): ``rollout.sleep`` frees the embedded HF engine's weights and KV
caches after every batch's generation and the next publish brings them back; ``offload_train_state_during_rollout``
keeps the policy (PPO: and the critic) in host memory while generating. The runs must equal runs without them
(samples, behaviour log-probs, losses), the phases must come in order (offload -> generate -> sleep -> onload ->
train -> publish), and the sleeping engine must hold no weight storage while the trainer trains.

On CPU the trainer's move to the host is a no-op (the device is the host): the tests force `OffloadState.active`
so the offload/onload bookkeeping runs and its order is checked; gpu_tests/test_gpu_offload.py checks the
device memory on CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.engine.features.offload import OffloadState
from shardforge.rollout import HFRolloutEngine, SamplingParams
from shardforge.weight_sync import DiskTransport, WeightPublisher, WeightReceiver

COLOCATED = {"rollout.sleep": "true", "offload_train_state_during_rollout": "true"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("colocate")
    return tiny_assets(root, seed=11, max_operand=20, num_eval=4, data_seed=2)


def _tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and persistent buffers (tied weights once)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages behind the parameters and persistent buffers (each storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in model.state_dict(keep_vars=True).values()}
    return sum(s.nbytes() for s in storages.values())


def _run(
    assets: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch, trainer: str = "grpo", **overrides: Any
) -> dict[str, Any]:
    """Train 3 steps; record every generate's (version, responses, behaviour log-probs) and the phase events."""
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers import TRAINERS
    from shardforge.engine import TrainEngine

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "eval_file": str(assets["eval"]),
        "output_dir": str(out), "layout": "d1", "steps": 3, "prompts_per_step": 4, "group_size": 2,
        "max_new_tokens": 5, "temperature": 0.9, "progress": False, "save_every": 0, "resume": "never",
        "export_hf_at_end": False, "reward_fn": "shardforge.algorithms.testing:digit_reward",
        "engine": {"max_tokens_per_microbatch": 128, "optimizer": {"lr": 5e-2}},
    }  # fmt: skip
    spec = TRAINERS.get(trainer)
    config = build_config(spec.config_cls, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))
    samples: list[tuple[int, list[list[int]], list[list[float]]]] = []
    events: list[str] = []
    rollouts: list[HFRolloutEngine] = []
    generate, sleep, train = HFRolloutEngine.generate, HFRolloutEngine.sleep, TrainEngine.train_batch
    offload, onload, apply = OffloadState.offload, OffloadState.onload, WeightReceiver.apply

    def recording(self: HFRolloutEngine, prompts: Any, params: Any, **kwargs: Any) -> Any:
        rollouts.append(self)
        outs = generate(self, prompts, params, **kwargs)
        events.append("generate")
        samples.append((self.version, [o.response_ids for o in outs], [o.logprobs for o in outs]))
        return outs

    def training(self: TrainEngine, *args: Any, **kwargs: Any) -> Any:
        # The rollout engine sleeps while the trainer trains: no weight storage (and no KV cache) held.
        held = _storage_bytes(rollouts[-1].model) if rollouts else -1
        events.append(f"train(rollout holds {held} B)" if held > 4 else "train")  # 4 B: the shared fill element
        assert self.offload_state is None, "the policy trains while its generation-phase offload is still on"
        return train(self, *args, **kwargs)

    def log(name: str, method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            events.append(name)
            return method(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(HFRolloutEngine, "generate", recording)
    monkeypatch.setattr(HFRolloutEngine, "sleep", log("sleep", sleep))
    monkeypatch.setattr(TrainEngine, "train_batch", training)
    monkeypatch.setattr(WeightReceiver, "apply", log("publish", apply))
    monkeypatch.setattr(OffloadState, "offload", log("offload", offload))
    monkeypatch.setattr(OffloadState, "onload", log("onload", onload))
    # On CPU the device is the host: force the bookkeeping to run (the moves themselves stay no-ops).
    monkeypatch.setattr(OffloadState, "active", property(lambda self: True))
    summary = spec.run(config)
    monkeypatch.undo()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"samples": samples, "events": events, "train": [r for r in rows if r["split"] == "train"],
            "summary": summary}  # fmt: skip


def _same_runs(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...], steps: int = 3) -> None:
    # eval at the start (version 1), one batch per step, eval at the end (version steps + 1)
    assert [s[0] for s in a["samples"]] == [s[0] for s in b["samples"]] == [1, *range(1, steps + 2)]
    assert a["samples"] == b["samples"], "the sleeping engine must serve exactly the published versions"
    assert len({str(s[1]) for s in a["samples"][1 : steps + 1]}) == steps, "the weights change between steps"
    for x, y in zip(a["train"], b["train"], strict=True):
        for key in keys:
            assert x[key] == y[key], (key, x[key], y[key])


# One step: the trainer goes to the host, the engine generates, sleeps, the trainer comes back, trains, publishes.
STEP = ["offload", "generate", "sleep", "onload", "train", "publish"]


def test_grpo_colocated_sleep_and_offload_equal_the_plain_run(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _run(assets, tmp_path / "plain", monkeypatch)
    colocated = _run(assets, tmp_path / "colocated", monkeypatch, **COLOCATED)
    _same_runs(colocated, plain, ("loss", "grad_norm", "reward_mean", "rollout_version"))
    assert colocated["summary"]["accuracy_end"] == plain["summary"]["accuracy_end"]
    # Asleep from the start (version 0 is never served), woken by the first publish, eval at start and end.
    assert colocated["events"] == ["sleep", "publish", "generate", *STEP * 3, "generate"]
    assert all(r["colocate/switch_s"] >= 0 for r in colocated["train"]) and "colocate/switch_s" not in plain["train"][0]
    # Through disk (update_weights loads each version) the sleeping engine serves the same weights.
    disk = _run(
        assets, tmp_path / "disk", monkeypatch, **{"rollout.publish_in_memory": "false", "rollout.sleep": "true"}
    )
    _same_runs(disk, plain, ("loss", "grad_norm", "reward_mean"))
    assert disk["events"] == ["sleep", "publish", "generate", *[e for e in STEP if "load" not in e] * 3, "generate"]


def test_ppo_offloads_actor_and_critic_while_the_engine_generates(
    assets: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _run(assets, tmp_path / "plain", monkeypatch, "ppo", update_epochs=1, steps=2)
    colocated = _run(assets, tmp_path / "colocated", monkeypatch, "ppo", update_epochs=1, steps=2, **COLOCATED)
    _same_runs(colocated, plain, ("loss", "grad_norm", "critic/loss", "reward_mean", "rollout_version"), steps=2)
    offload2, onload2 = ["offload", "offload"], ["onload", "onload"]  # actor and critic
    step = [*offload2, "generate", "sleep", *onload2, "train", "train", "publish"]  # actor, critic updates
    assert colocated["events"] == ["sleep", "publish", "generate", *step * 2, "generate"]


def _publish(model_dir: str, root: Path, version: int, scale: float) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    WeightPublisher(model, DiskTransport(root, keep_last=3)).publish(version)


def test_sleeping_engine_frees_weights_and_sessions_and_wakes_with_the_next_version(
    assets: dict[str, Any], tmp_path: Path
) -> None:
    tokenizer, root = assets["tokenizer"], tmp_path / "weights"
    engine = HFRolloutEngine(assets["model"], tokenizer, weights_root=root)
    control = HFRolloutEngine(assets["model"], tokenizer, weights_root=root)
    prompts = [tokenizer.encode("1+2="), tokenizer.encode("13+4=")]
    params = SamplingParams(max_new_tokens=4, temperature=0.9, seed=3)
    engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=5), sessions=["a", "b"])
    assert len(engine.kv_cache) == 2
    freed = engine.sleep()
    assert engine.asleep and freed == _tensor_bytes(control.model) > 0 and _storage_bytes(engine.model) == 4
    assert len(engine.kv_cache) == 0, "sleep must drop every session's KV cache"
    with pytest.raises(RuntimeError, match=r"rollout engine sleeps .* version 0 .* publish before generating"):
        engine.generate(prompts, params)
    for version, scale in ((1, 0.9), (2, 1.1)):
        _publish(assets["model"], root, version, scale)
        assert engine.update_weights(version) == control.update_weights(version) == version
        assert not engine.asleep and _storage_bytes(engine.model) >= _tensor_bytes(control.model)
        got, want = engine.generate(prompts, params), control.generate(prompts, params)
        assert [(r.response_ids, r.logprobs, r.version) for r in got] == [
            (r.response_ids, r.logprobs, r.version) for r in want
        ]
        engine.sleep()
    assert engine.update_weights(2) == 2 and engine.asleep, "the same version does not wake it: nothing to load"


def test_colocation_refusals(assets: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import apply_overrides, build_config, load_yaml
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.rl.colocate import ColocatedPhases, check_colocation
    from shardforge.rollout.ray.placement import rollout_actor_spec

    def config(**overrides: str) -> GRPOConfig:
        data = {"model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(tmp_path)}
        return build_config(GRPOConfig, apply_overrides(data, [f"{k}={v}" for k, v in overrides.items()]))

    with pytest.raises(ValueError, match=r"async_rollouts=true generates the next batch while"):
        check_colocation(config(**{"rollout.sleep": "true"}, async_rollouts="true"))
    with pytest.raises(ValueError, match=r"engine.cpu_offload=true: the policy's weights and optimizer state are in"):
        check_colocation(config(offload_train_state_during_rollout="true", **{"engine.cpu_offload": "true"}))
    with pytest.raises(ValueError, match=r"engine.offload_when_idle=true"):
        check_colocation(config(offload_train_state_during_rollout="true", **{"engine.offload_when_idle": "true"}))
    with pytest.raises(ValueError, match=r"rollout.placement=disaggregated gives the rollout engine devices of its"):
        rollout_actor_spec(config(**{"rollout.placement": "disaggregated", "rollout.sleep": "true"}), "ray", 1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"rollout.sleep=true with rollout.engine=vllm needs CUDA"):
            check_colocation(config(**{"rollout.sleep": "true", "rollout.engine": "vllm"}))
    with pytest.raises(ValueError, match=r"object has no sleep"):
        ColocatedPhases(object(), [], sleep=True, offload=False)
    check_colocation(
        config(**{"rollout.sleep": "true"}, offload_train_state_during_rollout="true")
    )  # the supported case
    example = Path(__file__).parents[3] / "examples" / "grpo_colocated_tiny.yaml"
    parsed = build_config(GRPOConfig, load_yaml(example))
    assert parsed.rollout.sleep and parsed.offload_train_state_during_rollout
    check_colocation(parsed)
