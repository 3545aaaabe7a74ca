"""Vocab-parallel log-probs / entropy / cross-entropy equal the dense computation.

The logits are built identically on every rank, sharded with
``distribute_tensor(full, tp_mesh, [Shard(-1)])`` and made a leaf that requires grad; each
loss is weighted by fixed per-row weights and backpropagated separately, and the DTensor
gradient (``.grad.full_tensor()``) is compared with autograd through the dense float64
reference. Logits have large magnitudes (±1e4, spikes of ±1e6) and the targets hit every
vocab shard, including the arg-max column and columns ~1e4 below it.

Rank functions are module-level so the rank pool can pickle them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
SHAPE = (3, 8)  # leading dims [..., V]: 24 rows

# The vocab-parallel functions compute in float32 from float32 logits; the reference is
# float64 from the same float32 values. Errors are float32 rounding of log Z and of the
# shifted logit, i.e. relative to the log-prob's magnitude (up to ~2e6 here): observed
# <= 6e-8 relative (0.012 absolute on a log-prob of -2.2e5), so rtol 1e-6 (~8 float32 ulps)
# leaves ~20x headroom; atol covers values near 0. Gradients are bounded by the row weights
# (|g| <= 1.5) and observed <= 4e-8 off: atol 1e-6. A wrong shard offset, a missing
# all-reduce or a rank-partial gradient is off by O(1).
VALUE_TOL = {"rtol": 1e-6, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def full_logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*SHAPE, VOCAB, generator=gen, dtype=torch.float64) * 1e4
    rows = x.view(-1, VOCAB)
    rows[0].zero_()  # uniform row: entropy = log V, every log-prob = -log V
    rows[1, 5] = 1e6  # one-hot-like rows: the max is far from everything else ...
    rows[2, 63] = 1e6
    rows[3, 40] = -1e6  # ... and far below
    rows[4, :] = 3e4 + torch.arange(VOCAB, dtype=torch.float64)  # large common offset
    return x.float()


def targets() -> torch.Tensor:
    t = (torch.arange(SHAPE[0] * SHAPE[1]) * 7 + 3) % VOCAB
    t[1], t[2], t[3] = 5, 63, 40  # the spike itself / the far-below column
    return t.view(SHAPE)


def row_weights() -> torch.Tensor:
    return torch.linspace(0.5, 1.5, SHAPE[0] * SHAPE[1]).view(SHAPE)


def dense_reference(logits: torch.Tensor, tgt: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (value, grad of sum(w * value) w.r.t. logits)} in float64."""
    out = {}
    for name in ("logprobs", "entropy", "cross_entropy"):
        x = logits.double().requires_grad_(True)
        logp = torch.log_softmax(x, dim=-1)
        if name == "entropy":
            value = -(logp.exp() * logp).sum(-1)
        else:
            value = logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            if name == "cross_entropy":
                value = -value
        (value * row_weights().double()).sum().backward()
        out[name] = (value.detach(), x.grad)
    return out


def _functions() -> dict[str, Any]:
    from shardforge.tensor_parallel import vocab_parallel_cross_entropy, vocab_parallel_entropy, vocab_parallel_logprobs

    return {
        "logprobs": lambda x, t: vocab_parallel_logprobs(x, t),
        "entropy": lambda x, t: vocab_parallel_entropy(x),
        "cross_entropy": lambda x, t: vocab_parallel_cross_entropy(x, t),
    }


def _tp_mesh() -> Any:
    from shardforge.mesh import ParallelDims, build_mesh

    return build_mesh(ParallelDims(dp_shard=1, tp=dist.get_world_size())).get("tp")


# ---------------------------------------------------------------------------------------------- rank functions
def _sharded_values() -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _tp_mesh()
    out: dict[str, Any] = {}
    for name, fn in _functions().items():
        logits = distribute_tensor(full_logits(), mesh, [Shard(-1)]).requires_grad_(True)
        value = fn(logits, targets())
        (value * row_weights()).sum().backward()
        out[name] = (
            type(value).__name__,
            value.detach(),
            type(logits.grad).__name__,
            repr(logits.grad.placements),
            logits.grad.full_tensor(),
        )
    return out


def _error(fn: Any) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _sharded_errors() -> dict[str, str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardforge.tensor_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    mesh = _tp_mesh()
    logits = full_logits()
    by_vocab = distribute_tensor(logits, mesh, [Shard(-1)])
    by_row = distribute_tensor(logits, mesh, [Shard(0)])
    by_seq = distribute_tensor(logits, mesh, [Shard(1)])
    replicated = distribute_tensor(logits, mesh, [Replicate()])
    odd_vocab = distribute_tensor(torch.randn(4, VOCAB - 1), mesh, [Shard(-1)])
    return {
        "shape": _error(lambda: vocab_parallel_logprobs(by_vocab, targets()[:, :-1])),
        "row_sharded": _error(lambda: vocab_parallel_logprobs(by_row, targets())),
        "seq_sharded": _error(lambda: vocab_parallel_logprobs(by_seq, targets())),
        "seq_sharded_entropy": _error(lambda: vocab_parallel_entropy(by_seq)),
        "replicated": _error(lambda: vocab_parallel_logprobs(replicated, targets())),
        "odd_vocab": _error(lambda: vocab_parallel_entropy(odd_vocab)),
    }


def _two_d_mesh_error() -> str:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardforge.mesh import ParallelDims, build_mesh
    from shardforge.tensor_parallel import vocab_parallel_logprobs

    mesh = build_mesh(ParallelDims(dp_shard=2, tp=2)).get(("fsdp", "tp"))
    logits = distribute_tensor(full_logits(), mesh, [Replicate(), Shard(-1)])
    return _error(lambda: vocab_parallel_logprobs(logits, targets()))


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_targets_cover_every_vocab_shard(tp: int) -> None:
    # Guard for the test data: every rank's slice owns some target (incl. both vocab edges).
    owners = set((targets() // (VOCAB // tp)).flatten().tolist())
    assert owners == set(range(tp))
    assert VOCAB - 1 in targets()  # the last column of the last shard


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_values_and_grads_match_dense(tp: int) -> None:
    reference = dense_reference(full_logits(), targets())
    results = get_rank_pool(tp).run(_sharded_values)
    for rank, res in enumerate(results):
        for name, (ref_value, ref_grad) in reference.items():
            value_type, value, grad_type, grad_placements, grad = res[name]
            # Values come back as plain tensors, identical on every TP rank.
            assert value_type == "Tensor" and value.dtype == torch.float32
            assert grad_type == "DTensor" and "Shard(dim=" in grad_placements, grad_placements
            torch.testing.assert_close(value.double(), ref_value, **VALUE_TOL, msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(
                grad.double(), ref_grad, **GRAD_TOL, msg=lambda m, n=name, r=rank: f"rank {r}, d {n}: {m}"
            )


def test_uniform_and_spiked_rows_exact_values() -> None:
    # Closed forms for the hand-made rows, independent of the dense reference.
    results = get_rank_pool(2).run(_sharded_values)[0]
    logprobs = results["logprobs"][1].view(-1)
    entropy = results["entropy"][1].view(-1)
    log_v = torch.log(torch.tensor(float(VOCAB)))
    torch.testing.assert_close(logprobs[0], -log_v)
    torch.testing.assert_close(entropy[0], log_v)
    assert logprobs[1].item() == 0.0 and logprobs[2].item() == 0.0  # the spike has all the mass
    assert logprobs[3].item() < -9e5  # 1e6 below the rest


def test_plain_tensors_match_dense() -> None:
    from shardforge.tensor_parallel import vocab_parallel_cross_entropy

    reference = dense_reference(full_logits(), targets())
    for name, fn in _functions().items():
        logits = full_logits().requires_grad_(True)
        value = fn(logits, targets())
        (value * row_weights()).sum().backward()
        ref_value, ref_grad = reference[name]
        torch.testing.assert_close(value.double(), ref_value, **VALUE_TOL)
        torch.testing.assert_close(logits.grad.double(), ref_grad, **GRAD_TOL)
    # Cross-entropy is per row, unreduced, and equals torch's dense cross-entropy.
    moderate = torch.randn(5, VOCAB)
    tgt = torch.randint(0, VOCAB, (5,))
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(moderate, tgt),
        torch.nn.functional.cross_entropy(moderate, tgt, reduction="none"),
    )


def test_plain_tensor_shape_mismatch_raises() -> None:
    from shardforge.tensor_parallel import vocab_parallel_cross_entropy, vocab_parallel_logprobs

    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_logprobs(full_logits(), targets()[:, :-1])
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_cross_entropy(full_logits(), targets().flatten())


def test_sharded_misuse_raises() -> None:
    errors = get_rank_pool(2).run(_sharded_errors)[0]
    assert "targets shape (3, 7)" in errors["shape"], errors["shape"]
    for key in ("row_sharded", "seq_sharded", "seq_sharded_entropy", "replicated"):
        assert "sharded on the vocab dim" in errors[key], (key, errors[key])
    assert "vocab size 63 is not divisible by tp=2" in errors["odd_vocab"], errors["odd_vocab"]


def test_two_dimensional_mesh_raises() -> None:
    message = get_rank_pool(4).run(_two_d_mesh_error)[0]
    assert "1-D TP mesh" in message, message
