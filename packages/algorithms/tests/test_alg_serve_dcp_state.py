"""The ``save_state`` DCP format (`serve.dcp_state`, `serve.checkpoints`) on one process, without the HTTP service:
a round trip restores weights, AdamW state and steps; a save that fails half-way leaves the previous checkpoint
whole and no staging folder in the listing; a crash while overwriting loses neither checkpoint; damaged files and another model's checkpoint are user errors that
name the problem; a weights-only load resets the optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardforge.algorithms.serve import checkpoints, dcp_state
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import ModelRegistry, TrainingModel
from shardforge.lora import LoRAConfig

LORA = LoRAConfig(r=4, alpha=32.0, target_modules=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    from shardforge.rollout.testing.tiny import tiny_model

    tiny = tiny_model(tmp_path_factory.mktemp("dcp_state"), hidden=16, layers=1)
    return ModelRegistry(tiny["model"], base_model="tiny")


def _trained(registry: ModelRegistry, model_id: str, lora: LoRAConfig | None, seed: int) -> TrainingModel:
    model = registry.create_model("alice", model_id, lora, seed)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for param in model.trainable:
            param.grad = torch.randn(param.shape, generator=generator)
        model.optimizer.step()
        model.steps += 1
    return model


def _weights(model: TrainingModel) -> dict[str, torch.Tensor]:
    return model.adapter_state()


def _moments(model: TrainingModel) -> list[torch.Tensor]:
    return [state[key] for state in model.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_round_trip_restores_weights_adam_and_steps(registry, tmp_path: Path, lora) -> None:
    saved = _trained(registry, f"a-{lora is None}", lora, seed=1)
    path = checkpoints.save_state(tmp_path, saved, {"path": "ckpt"})["path"]
    folder = tmp_path / "alice" / saved.model_id / "weights" / "ckpt"
    assert dcp_state.read_meta(folder)["rank"] == (None if lora is None else 4)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "COMMITTED", "__0_0.distcp", "serve.json"]
    fresh = registry.create_model("alice", f"b-{lora is None}", lora, seed=2)
    assert checkpoints.read_lora(tmp_path, "alice", {"path": path}, alpha=32.0) == lora
    checkpoints.load_state(tmp_path, fresh, {"path": path, "optimizer": True})
    for name, value in _weights(saved).items():
        assert torch.equal(_weights(fresh)[name], value), name
    assert len(_moments(fresh)) == len(_moments(saved)) > 0
    for got, want in zip(_moments(fresh), _moments(saved), strict=True):
        assert torch.equal(got, want)
    assert fresh.steps == saved.steps == 2


def test_a_failed_save_leaves_the_previous_checkpoint(registry, tmp_path: Path, monkeypatch) -> None:
    model = _trained(registry, "c", LORA, seed=3)
    checkpoints.save_state(tmp_path, model, {"path": "ckpt"})
    before = _weights(model)
    with torch.no_grad():
        for param in model.trainable:
            param.add_(1.0)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp_state.dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save_state(tmp_path, model, {"path": "ckpt", "overwrite": True})
    monkeypatch.undo()
    weights = tmp_path / "alice" / "c" / "weights"
    assert [p.name for p in weights.iterdir()] == ["ckpt"]  # no staging folder left behind
    listed = checkpoints.list_training_checkpoints(tmp_path, "alice", "c")
    assert [c["checkpoint_id"] for c in listed] == ["weights/ckpt"]
    checkpoints.load_state(tmp_path, model, {"path": "tinker://c/weights/ckpt"})  # the old one, whole
    for name, value in before.items():
        assert torch.equal(_weights(model)[name], value), name
    with pytest.raises(UserError, match="exists; pass another name or overwrite=True"):
        checkpoints.save_state(tmp_path, model, {"path": "ckpt"})


@pytest.mark.parametrize("killed", ["between_renames", "before_old_deleted"])
def test_a_crash_while_overwriting_loses_neither_checkpoint(registry, tmp_path: Path, killed) -> None:
    """An overwrite renames the old checkpoint aside before the new one goes in (`checkpoint_dcp.replace`). The folders a
    process killed in between leaves (made here with the same renames) are put right when the service starts: the
    new, complete checkpoint in place and the old one removed."""
    model = _trained(registry, f"h-{killed}", LORA, seed=8)
    checkpoints.save_state(tmp_path, model, {"path": "ckpt"})
    with torch.no_grad():
        for param in model.trainable:
            param.add_(1.0)
    after = _weights(model)
    checkpoints.save_state(tmp_path, model, {"path": "new"})
    weights = tmp_path / "alice" / model.model_id / "weights"
    (weights / "ckpt").rename(weights / ".old-ckpt-0123abcd")  # the first rename of the overwrite
    if killed == "between_renames":
        (weights / "new").rename(weights / ".tmp-ckpt-89abcdef")  # the new one, still in its staging folder
    else:
        (weights / "new").rename(weights / "ckpt")  # the second rename done; the old one not deleted yet
    checkpoints.recover_interrupted_saves(tmp_path)  # what a restarted service does first
    assert [p.name for p in weights.iterdir()] == ["ckpt"]
    fresh = registry.create_model("alice", f"fresh-{killed}", LORA, seed=9)
    checkpoints.load_state(tmp_path, fresh, {"path": f"tinker://{model.model_id}/weights/ckpt"})  # the new one
    for name, value in after.items():
        assert torch.equal(_weights(fresh)[name], value), name


def test_an_error_in_the_overwrites_last_rename_keeps_the_old_checkpoint(registry, tmp_path: Path, monkeypatch) -> None:
    from shardforge.checkpoint_dcp import replace

    model = _trained(registry, "i", LORA, seed=10)
    checkpoints.save_state(tmp_path, model, {"path": "ckpt"})
    before = _weights(model)
    with torch.no_grad():
        for param in model.trainable:
            param.add_(1.0)
    real_replace, calls = replace.os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new checkpoint's rename into place
            raise OSError("device busy")
        return real_replace(src, dst)

    monkeypatch.setattr(replace.os, "replace", failing_replace)
    with pytest.raises(OSError, match="device busy"):
        checkpoints.save_state(tmp_path, model, {"path": "ckpt", "overwrite": True})
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "alice" / "i" / "weights").iterdir()] == ["ckpt"]
    checkpoints.load_state(tmp_path, model, {"path": "tinker://i/weights/ckpt"})  # the old one, whole
    for name, value in before.items():
        assert torch.equal(_weights(model)[name], value), name


def test_a_failed_write_is_an_oserror_and_leaves_nothing(registry, tmp_path: Path) -> None:
    """A failure inside DCP's write (here from the ``checkpoint_write`` hook point, as a full disk) comes out as an
    OSError naming it (DCP's CheckpointException is a BaseException, which would escape the service's job handler),
    and no folder is left."""
    from shardforge.core import hooks

    model = _trained(registry, "j", LORA, seed=11)

    def full_disk(rank: int, path: str) -> None:
        raise OSError(28, "No space left on device")

    hooks.register("checkpoint_write", full_disk)
    try:
        with pytest.raises(OSError, match=r"checkpoint write failed \(rank 0: OSError: .*No space left on device"):
            checkpoints.save_state(tmp_path, model, {"path": "ckpt"})
    finally:
        hooks.clear("checkpoint_write")
    assert list((tmp_path / "alice" / "j" / "weights").iterdir()) == []
    checkpoints.save_state(tmp_path, model, {"path": "ckpt"})  # the next save works


def test_damaged_or_foreign_checkpoints_are_user_errors(registry, tmp_path: Path) -> None:
    model = _trained(registry, "d", LORA, seed=4)
    checkpoints.save_state(tmp_path, model, {"path": "ckpt"})
    other = registry.create_model("alice", "e", LoRAConfig(r=4, alpha=32.0, target_modules=("k_proj",)), seed=5)
    with pytest.raises(UserError, match=r"LoRA rank 4 on \['q_proj', 'v_proj'\]; this model has rank 4 on"):
        checkpoints.load_state(tmp_path, other, {"path": "tinker://d/weights/ckpt"})
    with pytest.raises(KeyError, match="not a checkpoint of this API key"):
        checkpoints.load_state(tmp_path, other, {"path": "tinker://d/weights/missing"})
    data = tmp_path / "alice" / "d" / "weights" / "ckpt" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(UserError, match="truncated"):
        checkpoints.load_state(tmp_path, model, {"path": "tinker://d/weights/ckpt"})


def test_a_weights_only_load_resets_the_optimizer(registry, tmp_path: Path) -> None:
    """``load_state`` without the optimizer: the checkpoint's weights, and the optimizer afresh (the SDK's docs:
    "weights only, optimizer resets"), not the live model's moments nor the checkpoint's."""
    saved = _trained(registry, "f", LORA, seed=6)
    path = checkpoints.save_state(tmp_path, saved, {"path": "ckpt"})["path"]
    live = _trained(registry, "g", LORA, seed=7)
    assert _moments(live) and live.optimizer.state
    live.steps = 5
    checkpoints.load_state(tmp_path, live, {"path": path})
    for name, value in _weights(saved).items():
        assert torch.equal(_weights(live)[name], value), name
    assert not live.optimizer.state and live.steps == 0
    checkpoints.load_state(tmp_path, live, {"path": path, "optimizer": True})  # with it: the checkpoint's
    for got, want in zip(_moments(live), _moments(saved), strict=True):
        assert torch.equal(got, want)
    assert live.steps == saved.steps
