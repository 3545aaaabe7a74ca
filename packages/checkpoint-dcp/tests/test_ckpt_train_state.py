"""`TrainState` round trips, RNG restore, validation errors and interrupted saves (one process).

Every load goes into a freshly constructed, differently initialised model/optimizer/
scheduler, so a value that is not restored shows up as a mismatch.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardforge.checkpoint_dcp import (
    COMMIT_MARKER,
    Checkpointer,
    TrainState,
    capture_rng_state,
    check_compatible,
    checkpoint_tensor_shapes,
    restore_rng_state,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB, DIM, HIDDEN = 16, 10, 7


class TinyNet(nn.Module):
    """Embedding, two MLP blocks with uneven shapes (7x10, 10x7), LayerNorm, head, and a
    non-persistent buffer. The keyword arguments build incompatible variants."""

    def __init__(self, *, hidden: int = HIDDEN, head_name: str = "head", extra: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, hidden), nn.GELU(), nn.Linear(hidden, DIM)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head_name = head_name
        self.add_module(head_name, nn.Linear(DIM, VOCAB, bias=False))
        if extra:
            self.extra = nn.Parameter(torch.zeros(3))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = h + block(h)
        return getattr(self, self.head_name)(self.norm(h))


def lr_lambda(step: int) -> float:
    return (step + 1) / 3 if step < 2 else 0.8**step


def build(seed: int, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = TinyNet(**kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int) -> float:
    ids = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(step))
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return float(loss)


def assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, sorted(got), sorted(want))
        for key in want:
            assert_tree_equal(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            assert_tree_equal(a, b, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


def trained(steps: int = 2, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model, optimizer, scheduler = build(seed)
    for step in range(steps):
        train_step(model, optimizer, scheduler, step)
    return model, optimizer, scheduler


# ---------------------------------------------------------------------------------------------- round trip
def test_train_state_round_trip(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained()
    data = {"seed": 3, "global_batch_size": 8, "num_examples": 100, "name": "sft", "nested": {"epoch": 1}}
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2, data_state=data)})

    model2, optimizer2, scheduler2 = build(seed=1)
    assert not torch.equal(model2.embed.weight, model.embed.weight)
    assert optimizer2.state_dict()["state"] == {}
    state = TrainState(model2, optimizer2, scheduler2)  # step 0, no data state: as on a restart
    assert ckpt.load({"train": state}) == 2

    assert state.step == 2
    assert state.data_state == data
    assert state.rng_restored
    assert_tree_equal(model2.state_dict(), model.state_dict())
    assert_tree_equal(optimizer2.state_dict(), optimizer.state_dict())
    want_sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    got_sched = {k: v for k, v in scheduler2.state_dict().items() if k != "lr_lambdas"}
    assert got_sched == want_sched
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * lr_lambda(2))

    # The restored optimizer and schedule continue exactly like the originals.
    for step in (2, 3):
        assert train_step(model2, optimizer2, scheduler2, step) == train_step(model, optimizer, scheduler, step)
        assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert_tree_equal(model2.state_dict(), model.state_dict())


def test_checkpoint_holds_fqn_keys_and_no_non_persistent_buffer(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained(steps=1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"train": TrainState(model, optimizer, scheduler, step=1)})
    shapes = checkpoint_tensor_shapes(ckpt.path(1))
    model_keys = {k[len("train.model.") :]: v for k, v in shapes.items() if k.startswith("train.model.")}
    assert model_keys == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert "scale" not in model_keys
    assert model_keys["blocks.0.0.weight"] == (HIDDEN, DIM)
    assert model_keys["blocks.1.2.weight"] == (DIM, HIDDEN)
    assert shapes["train.optimizer.state.blocks.0.2.weight.exp_avg"] == (DIM, HIDDEN)


def test_two_optimizers_and_schedulers_round_trip(tmp_path: Path) -> None:
    def setup(seed: int) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        torch.manual_seed(seed)
        model = TinyNet()
        embed = [model.embed.weight]
        rest = [p for n, p in model.named_parameters() if n != "embed.weight"]
        opts: list[torch.optim.Optimizer] = [
            torch.optim.AdamW(embed, lr=1e-2, foreach=False),
            torch.optim.SGD(rest, lr=0.1, momentum=0.9, foreach=False),
        ]
        scheds = [
            torch.optim.lr_scheduler.LambdaLR(opts[0], lr_lambda),
            torch.optim.lr_scheduler.StepLR(opts[1], step_size=1, gamma=0.5),
        ]
        return model, opts, scheds

    model, opts, scheds = setup(0)
    for step in range(3):
        ids = torch.randint(VOCAB, (2, 5), generator=torch.Generator().manual_seed(step))
        model(ids).square().mean().backward()
        for opt, sched in zip(opts, scheds):
            opt.step()
            opt.zero_grad()
            sched.step()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, {"train": TrainState(model, opts, scheds, step=3)})

    model2, opts2, scheds2 = setup(1)
    ckpt.load({"train": TrainState(model2, opts2, scheds2)})
    assert_tree_equal(model2.state_dict(), model.state_dict())
    for got, want in zip(opts2, opts):
        assert_tree_equal(got.state_dict(), want.state_dict())
    assert [o.param_groups[0]["lr"] for o in opts2] == [o.param_groups[0]["lr"] for o in opts]
    assert scheds2[1].state_dict() == scheds[1].state_dict()


def test_model_only_state(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2)})
    torch.manual_seed(5)
    fresh = TinyNet()
    state = TrainState(fresh)  # inference: no optimizer, no scheduler
    assert ckpt.load({"train": state}) == 2
    assert state.step == 2
    assert_tree_equal(fresh.state_dict(), model.state_dict())


def test_scheduler_count_mismatch_is_a_value_error(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2)})
    model2, optimizer2, scheduler2 = build(seed=1)
    extra = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=1)
    with pytest.raises(ValueError, match=r"checkpoint has 1 LR scheduler state\(s\) but 2 were given"):
        ckpt.load({"train": TrainState(model2, optimizer2, [scheduler2, extra])})


def test_data_state_keys_may_change(tmp_path: Path) -> None:
    # The loading side's data_state does not decide what is restored: the saved one wins.
    model, optimizer, scheduler = trained()
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2, data_state={"a": 1, "b": [1, 2]})})
    state = TrainState(*build(seed=1), step=9, data_state={"c": 3})
    ckpt.load({"train": state})
    assert state.data_state == {"a": 1, "b": [1, 2]}
    assert state.step == 2


# ---------------------------------------------------------------------------------------------- RNG
def _draw() -> tuple[list[float], torch.Tensor, int]:
    return [random.random() for _ in range(3)], torch.rand(4), int(torch.randint(1 << 30, ()))


def test_rng_restored_after_load(tmp_path: Path) -> None:
    model, optimizer, scheduler = trained()
    random.seed(11)
    torch.manual_seed(12)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2)})
    want = _draw()  # what the saved run draws next

    random.seed(99)
    torch.manual_seed(99)
    model2, optimizer2, scheduler2 = build(seed=3)
    assert _draw() != want
    state = TrainState(model2, optimizer2, scheduler2)
    ckpt.load({"train": state})
    assert state.rng_restored
    got = _draw()
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])
    assert got[2] == want[2]


def test_numpy_rng_restored_after_load(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")  # optional: not a dependency of this package
    model, optimizer, scheduler = trained(steps=1)
    np.random.seed(21)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"train": TrainState(model, optimizer, scheduler, step=1)})
    want = np.random.rand(5)
    np.random.seed(0)
    ckpt.load({"train": TrainState(*build(seed=2))})
    assert np.array_equal(np.random.rand(5), want)


def test_capture_restore_rng_state() -> None:
    random.seed(1)
    torch.manual_seed(1)
    blob = capture_rng_state()
    assert isinstance(blob, bytes)
    want = _draw()
    restore_rng_state(blob)
    got = _draw()
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]


# ---------------------------------------------------------------------------------------------- validation
@pytest.fixture
def saved(tmp_path: Path) -> Checkpointer:
    model, optimizer, scheduler = trained(steps=1)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"train": TrainState(model, optimizer, scheduler, step=1)})
    return ckpt


def _load_error(ckpt: Checkpointer, **kwargs: Any) -> tuple[str, nn.Module, dict[str, torch.Tensor]]:
    model, optimizer, scheduler = build(seed=4, **kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        ckpt.load({"train": TrainState(model, optimizer, scheduler)})
    return str(info.value), model, before


def _assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    # Validation runs before any tensor is read: the model keeps its own values.
    assert_tree_equal(model.state_dict(), before)


def test_validation_renamed_parameter(saved: Checkpointer) -> None:
    message, model, before = _load_error(saved, head_name="lm_head")
    assert "missing in checkpoint (1): ['lm_head.weight']" in message
    assert "unexpected in checkpoint (1): ['head.weight']" in message
    assert "shape mismatch" not in message
    assert str(saved.path(1)) in message
    _assert_untouched(model, before)


def test_validation_extra_parameter(saved: Checkpointer) -> None:
    message, model, before = _load_error(saved, extra=True)
    assert "missing in checkpoint (1): ['extra']" in message
    assert "unexpected" not in message
    _assert_untouched(model, before)


def test_validation_shape_mismatch(saved: Checkpointer) -> None:
    message, model, before = _load_error(saved, hidden=HIDDEN + 1)
    assert "shape mismatch (6):" in message
    assert f"blocks.0.0.weight: checkpoint ({HIDDEN}, {DIM}) vs model ({HIDDEN + 1}, {DIM})" in message
    assert f"blocks.1.2.weight: checkpoint ({DIM}, {HIDDEN}) vs model ({DIM}, {HIDDEN + 1})" in message
    assert f"blocks.0.0.bias: checkpoint ({HIDDEN},) vs model ({HIDDEN + 1},)" in message
    assert "missing" not in message and "unexpected" not in message
    _assert_untouched(model, before)


def test_validation_under_other_top_level_key(saved: Checkpointer) -> None:
    model, optimizer, scheduler = build(seed=4)
    with pytest.raises(ValueError, match="missing in checkpoint"):
        check_compatible({"student": TrainState(model, optimizer, scheduler)}, saved.path(1))
    check_compatible({"train": TrainState(model, optimizer, scheduler)}, saved.path(1))  # compatible: no error


# ---------------------------------------------------------------------------------------------- interrupted saves
class _Exploding:
    """A Stateful whose state_dict raises, as a crash in the middle of a save would."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("boom")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # pragma: no cover - never loaded
        raise AssertionError


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, scheduler = trained(steps=1)
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(1, {"train": TrainState(model, optimizer, scheduler, step=1)})
    want = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(RuntimeError, match="boom"):
        ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2), "x": _Exploding()})
    # A failure while writing the files.
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def fail_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", fail_write)
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        ckpt.save(3, {"train": TrainState(model, optimizer, scheduler, step=3)})
    assert "disk full" in repr(info.value) + "".join(map(repr, getattr(info.value, "failures", {}).values()))
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_00000002", ".tmp-step_00000003", "step_00000001"]
    assert ckpt.latest_step() == 1
    with pytest.raises(FileNotFoundError):
        ckpt.load({"train": TrainState(*build(seed=1))}, step=3)
    model2, optimizer2, scheduler2 = build(seed=1)
    assert ckpt.load({"train": TrainState(model2, optimizer2, scheduler2)}) == 1
    assert_tree_equal(model2.state_dict(), want)

    ckpt.save(3, {"train": TrainState(model, optimizer, scheduler, step=3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]
    assert (ckpt.path(3) / COMMIT_MARKER).is_file()
