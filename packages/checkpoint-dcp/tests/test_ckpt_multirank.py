"""Multi-rank checkpoints on local gloo ranks: resume parity, resharding, crash safety and
validation of sharded models.

Rank functions are module-level so the shared rank pools can pickle them; each pool.run
call builds its model, optimizer and scheduler from scratch, as a restarted job would.
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardforge.checkpoint_dcp import COMMIT_MARKER, Checkpointer, TrainState, convert_dcp_to_hf
from shardforge.mesh import ParallelDims, build_mesh
from shardforge.mesh.testing import RankFailure, get_rank_pool

VOCAB, DIM, HIDDEN = 16, 10, 7
LR = 1e-2
DATA_STATE = {"seed": 0, "global_batch_size": 4, "num_examples": 64}


class TinyNet(nn.Module):
    """Embedding, two MLP blocks with uneven shapes (7x10, 10x7: not divisible by 2 or 4),
    dropout (draws from the torch RNG), LayerNorm, head, and a non-persistent buffer."""

    def __init__(self, *, hidden: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, DIM))
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def lr_lambda(step: int) -> float:
    return (step + 1) / 3 if step < 2 else 0.7 ** (step - 1)


def _mesh(layout: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if layout == "hsdp":
            return build_mesh(ParallelDims(dp_replicate=2, dp_shard=2), device_type="cpu").get(("dp_replicate", "fsdp"))
        return build_mesh(ParallelDims(dp_shard=dist.get_world_size()), device_type="cpu").get("fsdp")


def build(seed: int, layout: str = "fsdp", **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = TinyNet(**kwargs)
    mesh = _mesh(layout)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return model, optimizer, scheduler


def train(model: nn.Module, optimizer: Any, scheduler: Any, steps: range) -> tuple[list[torch.Tensor], list[float]]:
    """Steps whose data depend on (step, rank) and on the python RNG (sequence length)."""
    rank = dist.get_rank()
    losses, lrs = [], []
    for step in steps:
        length = random.randint(5, 9)
        ids = torch.randint(VOCAB, (2, length), generator=torch.Generator().manual_seed(1000 * step + rank))
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        lrs.append(optimizer.param_groups[0]["lr"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.detach().clone())
    return losses, lrs


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def clone_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_tree(v) for v in value]
    return value


def full_optim(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    # A snapshot: some values (the scalar "step") alias the live optimizer state.
    return clone_tree(get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)))


def seed_rngs(base: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(base + rank)  # per-rank dropout masks
    random.seed(base + 10 * rank)


def assert_tree_equal(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, (path, got.shape, want.shape)
        assert torch.equal(got, want), path
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


# ---------------------------------------------------------------------------------------------- resume parity
def _straight(steps: int) -> dict[str, Any]:
    model, optimizer, scheduler = build(seed=0, dropout=0.2)
    seed_rngs(100)
    losses, lrs = train(model, optimizer, scheduler, range(steps))
    return {"losses": losses, "lrs": lrs, "params": full_params(model)}


def _first_half(root: str, steps: int, mode: str) -> dict[str, Any]:
    model, optimizer, scheduler = build(seed=0, dropout=0.2)
    seed_rngs(100)
    losses, lrs = train(model, optimizer, scheduler, range(steps))
    ckpt = Checkpointer(root, keep_last=2, async_mode=mode)  # type: ignore[arg-type]
    ckpt.save(steps, {"train": TrainState(model, optimizer, scheduler, step=steps, data_state=DATA_STATE)})
    ckpt.close()
    return {"losses": losses, "lrs": lrs}


def _second_half(root: str, total: int, mode: str) -> dict[str, Any]:
    # A "restarted" job: different init and RNG seeds, nothing carried over but the files.
    model, optimizer, scheduler = build(seed=1234, dropout=0.2)
    seed_rngs(777)
    state = TrainState(model, optimizer, scheduler)
    ckpt = Checkpointer(root, keep_last=2, async_mode=mode)  # type: ignore[arg-type]
    loaded = ckpt.load({"train": state})
    losses, lrs = train(model, optimizer, scheduler, range(state.step, total))
    ckpt.close()
    return {
        "loaded": loaded,
        "step": state.step,
        "data": state.data_state,
        "rng_restored": state.rng_restored,
        "losses": losses,
        "lrs": lrs,
        "params": full_params(model),
    }


@pytest.mark.parametrize("mode", ["off", "async"])
def test_resume_is_bit_identical(tmp_path: Path, mode: str) -> None:
    pool = get_rank_pool(2)
    total, half = 6, 3
    straight = pool.run(_straight, total)
    first = pool.run(_first_half, str(tmp_path), half, mode)
    assert Checkpointer(tmp_path).committed_steps() == [half]
    second = pool.run(_second_half, str(tmp_path), total, mode)

    expected_lrs = [LR * lr_lambda(s) for s in range(total)]
    for rank in range(2):
        assert second[rank]["loaded"] == half
        assert second[rank]["step"] == half
        assert second[rank]["data"] == DATA_STATE
        assert second[rank]["rng_restored"]
        assert_tree_equal(first[rank]["losses"], straight[rank]["losses"][:half])
        # Losses of steps 4-6: data, dropout masks and weights all match bit for bit.
        assert_tree_equal(second[rank]["losses"], straight[rank]["losses"][half:])
        assert first[rank]["lrs"] + second[rank]["lrs"] == straight[rank]["lrs"]
        assert straight[rank]["lrs"] == pytest.approx(expected_lrs, rel=1e-12)
        assert_tree_equal(second[rank]["params"], straight[rank]["params"])
    # The two ranks saw different data: the per-rank comparison above is not trivial.
    assert not torch.equal(straight[0]["losses"][-1], straight[1]["losses"][-1])


# ---------------------------------------------------------------------------------------------- validation
def _load_mismatched(root: str) -> list[str]:
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(root)
    ckpt.save(1, {"train": TrainState(model, optimizer, scheduler, step=1)})
    messages = []
    for kwargs in ({"hidden": HIDDEN + 2},):
        other, other_opt, other_sched = build(seed=1, **kwargs)
        try:
            ckpt.load({"train": TrainState(other, other_opt, other_sched)})
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_validation_reports_global_shapes_of_sharded_params(tmp_path: Path) -> None:
    results = get_rank_pool(2).run(_load_mismatched, str(tmp_path))
    for messages in results:
        assert len(messages) == 1
        # Global shapes, not the local shards ((4, 10)/(3, 10) on 2 ranks).
        assert f"blocks.0.0.weight: checkpoint ({HIDDEN}, {DIM}) vs model ({HIDDEN + 2}, {DIM})" in messages[0]
        assert f"blocks.1.3.weight: checkpoint ({DIM}, {HIDDEN}) vs model ({DIM}, {HIDDEN + 2})" in messages[0]


# ---------------------------------------------------------------------------------------------- resharding
def _save_trained(root: str, layout: str) -> dict[str, Any] | None:
    model, optimizer, scheduler = build(seed=0, layout=layout)
    seed_rngs(5)
    train(model, optimizer, scheduler, range(2))
    params, optim = full_params(model), full_optim(model, optimizer)
    ckpt = Checkpointer(root)
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2, data_state=DATA_STATE)})
    if dist.get_rank() != 0:
        return None
    return {"params": params, "optim": optim, "sched": scheduler.state_dict(), "world": dist.get_world_size()}


def _load_resharded(root: str, layout: str) -> dict[str, Any]:
    model, optimizer, scheduler = build(seed=99, layout=layout)
    state = TrainState(model, optimizer, scheduler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = Checkpointer(root).load({"train": state})
    placements = {str(p.placements) for p in model.parameters()}
    out = {
        "loaded": loaded,
        "step": state.step,
        "data": state.data_state,
        "rng_restored": state.rng_restored,
        "rng_warnings": [str(w.message) for w in caught if "RNG states" in str(w.message)],
        "params": full_params(model),
        "optim": full_optim(model, optimizer),
        "sched": scheduler.state_dict(),
        "placements": placements,
        "lr": optimizer.param_groups[0]["lr"],
    }
    # The loaded optimizer state is usable: one more step runs and moves the weights.
    train(model, optimizer, scheduler, range(2, 3))
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(full_params(model).values(), out["params"].values()))
    return out


@pytest.fixture(scope="module")
def saved_fsdp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fsdp4")
    results = get_rank_pool(4).run(_save_trained, str(root), "fsdp")
    assert results[0]["world"] == 4
    return root, results[0]


def _check_resharded(got: dict[str, Any], saved: dict[str, Any]) -> None:
    assert got["loaded"] == 2 and got["step"] == 2
    assert got["data"] == DATA_STATE
    assert_tree_equal(got["params"], saved["params"])
    assert_tree_equal(got["optim"]["state"], saved["optim"]["state"])
    assert set(saved["optim"]["state"]["blocks.0.0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert got["optim"]["param_groups"] == saved["optim"]["param_groups"]
    want_sched = {k: v for k, v in saved["sched"].items() if k != "lr_lambdas"}
    assert {k: v for k, v in got["sched"].items() if k != "lr_lambdas"} == want_sched
    assert got["lr"] == pytest.approx(LR * lr_lambda(2))
    assert got["moved"]


def test_reshard_fsdp4_to_fsdp2(saved_fsdp4: tuple[Path, dict[str, Any]]) -> None:
    root, saved = saved_fsdp4
    results = get_rank_pool(2).run(_load_resharded, str(root), "fsdp")
    for rank, got in enumerate(results):
        _check_resharded(got, saved)
        assert got["placements"] == {"(Shard(dim=0),)"}
        # 4 saved RNG states cannot map onto 2 ranks: kept fresh, warned once (rank 0).
        assert not got["rng_restored"]
        assert len(got["rng_warnings"]) == (1 if rank == 0 else 0)
    assert "4 ranks but this run has 2" in results[0]["rng_warnings"][0]


def test_reshard_fsdp4_to_hsdp_2x2(saved_fsdp4: tuple[Path, dict[str, Any]]) -> None:
    root, saved = saved_fsdp4
    results = get_rank_pool(4).run(_load_resharded, str(root), "hsdp")
    for got in results:
        _check_resharded(got, saved)
        assert got["placements"] == {"(Replicate(), Shard(dim=0))"}
        assert got["rng_restored"]  # same world size: each rank gets its own generators back
        assert got["rng_warnings"] == []


def test_reshard_fsdp2_to_hsdp_2x2(tmp_path: Path) -> None:
    # The layout pair the issue names: 2 FSDP shards -> 2 replicas x 2 shards (4 ranks).
    [saved, _] = get_rank_pool(2).run(_save_trained, str(tmp_path), "fsdp")
    assert saved["world"] == 2
    results = get_rank_pool(4).run(_load_resharded, str(tmp_path), "hsdp")
    for got in results:
        _check_resharded(got, saved)
        assert got["placements"] == {"(Replicate(), Shard(dim=0))"}
        assert not got["rng_restored"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_sharded_checkpoint_offline(saved_fsdp4: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root, saved = saved_fsdp4
    names = convert_dcp_to_hf(root / "step_00000002", tmp_path / "hf")
    assert sorted(names) == sorted(saved["params"])
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert_tree_equal(tensors, saved["params"])


# ---------------------------------------------------------------------------------------------- crash safety
def _save_step1(root: str) -> dict[str, torch.Tensor]:
    model, optimizer, scheduler = build(seed=0)
    seed_rngs(3)
    train(model, optimizer, scheduler, range(1))
    Checkpointer(root).save(1, {"train": TrainState(model, optimizer, scheduler, step=1)})
    return full_params(model)


def _die_while_saving_step2(root: str) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model, optimizer, scheduler = build(seed=0)
    seed_rngs(3)
    train(model, optimizer, scheduler, range(2))
    if dist.get_rank() == 1:
        original = FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            assert (Path(root) / ".tmp-step_00000002").is_dir()
            original(self, plan, planner)  # this rank's shard files are written ...
            os._exit(1)  # ... and the process dies before the save completes

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    Checkpointer(root).save(2, {"train": TrainState(model, optimizer, scheduler, step=2)})


def _recover(root: str) -> dict[str, Any]:
    ckpt = Checkpointer(root)
    out: dict[str, Any] = {"latest": ckpt.latest_step(), "committed": ckpt.committed_steps()}
    model, optimizer, scheduler = build(seed=42)
    try:
        ckpt.load({"train": TrainState(model, optimizer, scheduler)}, step=2)
    except FileNotFoundError as error:
        out["step2_error"] = str(error)
    state = TrainState(model, optimizer, scheduler)
    out["loaded"] = ckpt.load({"train": state})
    out["step"] = state.step
    out["params"] = full_params(model)
    train(model, optimizer, scheduler, range(1, 2))
    ckpt.save(2, {"train": TrainState(model, optimizer, scheduler, step=2)})
    out["after_save"] = sorted(os.listdir(root))
    return out


def test_crash_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    pool = get_rank_pool(2)
    step1 = pool.run(_save_step1, str(root))
    with pytest.raises(RankFailure) as info:
        pool.run(_die_while_saving_step2, str(root), timeout_s=120)
    assert 1 in info.value.errors

    # On disk: the committed step 1 and the interrupted step 2 temp dir (with rank 1's
    # shard but no COMMITTED marker and no final directory).
    names = sorted(os.listdir(root))
    assert names == [".tmp-step_00000002", "step_00000001"]
    partial = root / ".tmp-step_00000002"
    assert any(p.suffix == ".distcp" for p in partial.iterdir())
    assert not (partial / COMMIT_MARKER).exists()
    assert Checkpointer(root).latest_step() == 1

    recovered = pool.run(_recover, str(root))  # the pool restarts: a new job
    for got in recovered:
        assert got["latest"] == 1 and got["committed"] == [1]
        assert "no committed checkpoint for step 2" in got["step2_error"]
        assert "committed steps: [1]" in got["step2_error"]
        assert got["loaded"] == 1 and got["step"] == 1
        assert_tree_equal(got["params"], step1[0])
        # Saving step 2 again succeeds and removes the stale temp dir.
        assert got["after_save"] == ["step_00000001", "step_00000002"]
    assert (root / "step_00000002" / COMMIT_MARKER).is_file()
