"""Input slicing, padding counts and the autograd-aware gather of per-token CP outputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool
from shardforge.ulysses_cp import gather_sequence, pad_length, slice_for_rank

WORLD = 4


# ---------------------------------------------------------------------------------------------- single process
@pytest.mark.parametrize(
    ("num_tokens", "multiple", "pad"),
    [(17, 2, 1), (17, 4, 3), (16, 4, 0), (0, 4, 0), (5, 1, 0), (1, 8, 7), (9, 6, 3)],
)
def test_pad_length(num_tokens: int, multiple: int, pad: int) -> None:
    assert pad_length(num_tokens, multiple) == pad
    assert (num_tokens + pad) % multiple == 0


@pytest.mark.parametrize("multiple", [0, -2])
def test_pad_length_rejects_non_positive_multiple(multiple: int) -> None:
    with pytest.raises(ValueError, match=rf"multiple={multiple} must be >= 1"):
        pad_length(4, multiple)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_slice_for_rank_is_contiguous_and_covers_everything(cp: int) -> None:
    x = torch.arange(3 * 8 * 2).reshape(3, 8, 2)
    chunks = [slice_for_rank(x, rank, cp, dim=1) for rank in range(cp)]
    for rank, chunk in enumerate(chunks):
        n = 8 // cp
        assert torch.equal(chunk, x[:, rank * n : (rank + 1) * n])
    assert torch.equal(torch.cat(chunks, dim=1), x)
    tokens = torch.arange(12)
    assert slice_for_rank(tokens, cp - 1, cp).tolist() == list(range(12 - 12 // cp, 12))


def test_slice_for_rank_rejects_indivisible_length() -> None:
    with pytest.raises(ValueError, match=r"length 7 along dim 0 is not divisible by cp=2; pad first"):
        slice_for_rank(torch.arange(7), 0, 2)
    with pytest.raises(ValueError, match=r"length 3 along dim 1 is not divisible by cp=4"):
        slice_for_rank(torch.zeros(4, 3), 0, 4, dim=1)


def test_gather_sequence_without_group_is_identity() -> None:
    assert not dist.is_initialized()  # no process group needed for the cp=1 path
    local = torch.randn(5, requires_grad=True)
    assert gather_sequence(local, None) is local


# ---------------------------------------------------------------------------------------------- multi rank
def _gather_rank(cp: int, dim: int) -> dict[str, torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    num_groups = world // cp
    members = [list(range(i, world, num_groups)) for i in range(num_groups)]  # strided: group rank != rank
    groups = [dist.new_group(m) for m in members]
    singles = [dist.new_group([i]) for i in range(world)]
    index = rank % num_groups
    group, r = groups[index], members[index].index(rank)

    gen = torch.Generator().manual_seed(10 * index + r)
    shape = [3, 3]
    shape[dim] = 2  # chunk length along the gathered dim
    local = torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_()
    gathered = gather_sequence(local, group, dim=dim)
    # Every rank of the group evaluates the same loss on the gathered tensor (same weights).
    weights = torch.randn(gathered.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(99 + index))
    (gathered * weights).sum().backward()
    assert local.grad is not None
    return {
        "local": local.detach(),
        "gathered": gathered.detach(),
        "weights": weights,
        "grad": local.grad,
        "group_rank": torch.tensor([index, r]),
        # A size-1 group is no CP: the input comes back untouched.
        "single_is_identity": torch.tensor(gather_sequence(local, singles[rank]) is local),
    }


@pytest.mark.parametrize(("cp", "dim"), [(2, 0), (4, 0), (4, 1)])
def test_gather_sequence_forward_and_backward(cp: int, dim: int) -> None:
    results = get_rank_pool(WORLD).run(_gather_rank, cp, dim)
    by_group: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for res in results:
        index, r = res["group_rank"].tolist()
        by_group.setdefault(index, {})[r] = res
        assert bool(res["single_is_identity"])
    assert len(by_group) == WORLD // cp
    for members in by_group.values():
        want = torch.cat([members[r]["local"] for r in range(cp)], dim=dim)
        for r, res in members.items():
            assert torch.equal(res["gathered"], want)
            # Backward: this rank's own chunk of the (shared) upstream gradient, exactly once (not
            # summed over the cp ranks, which would scale it by cp).
            assert torch.equal(res["grad"], res["weights"].chunk(cp, dim=dim)[r])
