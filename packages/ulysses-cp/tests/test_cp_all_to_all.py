"""Ulysses all-to-all primitives on local gloo ranks, against references built from other collectives.

`seq_to_head` / `head_to_seq` only move data, so forward results must be *equal* (no tolerance)
to the same data moved by `all_gather` + slicing and by list-based `all_to_all`. Backward is
checked against the gradient written down by hand: the loss is the sum over ranks of a
weighted sum of each rank's output.

CP groups are strided subsets of the 4-rank world (cp 2: ranks {0, 2} and {1, 3}), so a
group rank differs from the global rank and two groups exchange different data at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardforge.mesh.testing import get_rank_pool

WORLD = 4
# (local tokens S, query heads per rank after the exchange k, head dim D): heads before = cp * k.
SHAPES = [(3, 1, 2), (1, 2, 5), (5, 3, 1), (2, 2, 8)]


def _cp_group(cp: int) -> tuple[dist.ProcessGroup, int, int]:
    """(group, rank in group, group index). Every rank creates every group (new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    num_groups = world // cp
    members = [list(range(i, world, num_groups)) for i in range(num_groups)]
    groups = [dist.new_group(m) for m in members]
    index = rank % num_groups
    assert dist.get_rank(groups[index]) == members[index].index(rank)
    return groups[index], members[index].index(rank), index


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _all_to_all(send: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    recv = [torch.empty_like(send[0]) for _ in send]
    dist.all_to_all(recv, [s.contiguous() for s in send], group=group)
    return recv


# ---------------------------------------------------------------------------------------------- rank functions
def _forward_rank(cp: int, shapes: list[tuple[int, int, int]]) -> list[dict[str, torch.Tensor]]:
    from shardforge.ulysses_cp import head_to_seq, seq_to_head

    group, r, index = _cp_group(cp)
    out = []
    for s, k, d in shapes:
        h = cp * k
        gen = torch.Generator().manual_seed(1000 * index + 100 * r + 7 * s + k)  # different data on every rank
        x_SHD = torch.randn(s, h, d, dtype=torch.float64, generator=gen)
        y_THD = torch.randn(cp * s, k, d, dtype=torch.float64, generator=gen)

        # seq_to_head: the whole sequence (all ranks' chunks in rank order), my head chunk r.
        gathered = torch.cat(_all_gather(x_SHD, group))
        ref_gather = gathered[:, r * k : (r + 1) * k]
        # Same thing with explicit lists: head chunk c goes to rank c, arrivals stack along tokens.
        ref_a2a = torch.cat(_all_to_all([x_SHD[:, c * k : (c + 1) * k] for c in range(cp)], group))
        got = seq_to_head(x_SHD, group)
        # The attention feeds transposed views ([1, H, S, D] -> [S, H, D]): strides must not matter.
        got_strided = seq_to_head(x_SHD.transpose(0, 1).contiguous().transpose(0, 1), group)

        # head_to_seq: my token chunk r of every rank's heads, head blocks in source-rank order.
        ys = _all_gather(y_THD, group)
        ref_h2s_gather = torch.cat([ys[c][r * s : (r + 1) * s] for c in range(cp)], dim=1)
        ref_h2s_a2a = torch.cat(_all_to_all([y_THD[c * s : (c + 1) * s] for c in range(cp)], group), dim=1)
        got_h2s = head_to_seq(y_THD, group)

        out.append(
            {
                "x": x_SHD,
                "got": got,
                "got_strided": got_strided,
                "ref_gather": ref_gather,
                "ref_a2a": ref_a2a,
                "y": y_THD,
                "got_h2s": got_h2s,
                "ref_h2s_gather": ref_h2s_gather,
                "ref_h2s_a2a": ref_h2s_a2a,
                "round_trip_x": head_to_seq(seq_to_head(x_SHD, group), group),
                "round_trip_y": seq_to_head(head_to_seq(y_THD, group), group),
            }
        )
    return out


def _backward_rank(cp: int, s: int, k: int, d: int) -> dict[str, torch.Tensor]:
    from shardforge.ulysses_cp import head_to_seq, seq_to_head

    group, r, index = _cp_group(cp)
    h = cp * k
    gen = torch.Generator().manual_seed(50 + 10 * index + r)
    x_SHD = torch.randn(s, h, d, dtype=torch.float64, generator=gen).requires_grad_()
    w_THD = torch.randn(cp * s, k, d, dtype=torch.float64, generator=gen)
    z_THD = torch.randn(cp * s, k, d, dtype=torch.float64, generator=gen).requires_grad_()
    v_SHD = torch.randn(s, h, d, dtype=torch.float64, generator=gen)

    # Total loss L = sum_c <seq_to_head(x)_c, w_c>. Rank c's output holds x_r[:, head block c] at
    # token block r, so dL/dx_r[:, head block c] = w_c[token block r].
    (seq_to_head(x_SHD, group) * w_THD).sum().backward()
    ws = _all_gather(w_THD, group)
    want_x = torch.cat([ws[c][r * s : (r + 1) * s] for c in range(cp)], dim=1)

    # L = sum_c <head_to_seq(z)_c, v_c>. Rank c's output holds z_r[token block c] at head block r,
    # so dL/dz_r[token block c] = v_c[:, head block r].
    (head_to_seq(z_THD, group) * v_SHD).sum().backward()
    vs = _all_gather(v_SHD, group)
    want_z = torch.cat([vs[c][:, r * k : (r + 1) * k] for c in range(cp)], dim=0)
    assert x_SHD.grad is not None and z_THD.grad is not None
    return {"grad_x": x_SHD.grad, "want_x": want_x, "grad_z": z_THD.grad, "want_z": want_z}


def _errors_rank(cp: int) -> list[str]:
    from shardforge.ulysses_cp import head_to_seq, seq_to_head

    group, _, _ = _cp_group(cp)
    messages = []
    # Shapes are the same on every rank, so every rank raises before any collective.
    for fn, x in ((seq_to_head, torch.zeros(2, cp + 1, 3)), (head_to_seq, torch.zeros(cp + 1, 1, 3))):
        try:
            fn(x, group)
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("cp", [2, 4])
def test_forward_matches_all_gather_and_list_all_to_all(cp: int) -> None:
    results = get_rank_pool(WORLD).run(_forward_rank, cp, SHAPES)
    for rank, per_shape in enumerate(results):
        for (s, k, d), res in zip(SHAPES, per_shape, strict=True):
            where = f"rank {rank}, cp={cp}, shape S={s} k={k} D={d}"
            assert res["got"].shape == (cp * s, k, d), where
            assert res["got_h2s"].shape == (s, cp * k, d), where
            # Pure data movement: exact equality.
            assert torch.equal(res["ref_gather"], res["ref_a2a"]), where  # the two references agree
            assert torch.equal(res["got"], res["ref_gather"]), where
            assert torch.equal(res["got_strided"], res["ref_gather"]), where
            assert torch.equal(res["ref_h2s_gather"], res["ref_h2s_a2a"]), where
            assert torch.equal(res["got_h2s"], res["ref_h2s_gather"]), where
            assert torch.equal(res["round_trip_x"], res["x"]), where
            assert torch.equal(res["round_trip_y"], res["y"]), where


@pytest.mark.parametrize(("cp", "shape"), [(2, (3, 2, 4)), (4, (2, 1, 3)), (4, (1, 3, 2))])
def test_backward_matches_analytic_gradient(cp: int, shape: tuple[int, int, int]) -> None:
    for rank, res in enumerate(get_rank_pool(WORLD).run(_backward_rank, cp, *shape)):
        # Backward is the inverse exchange (data movement again): exact.
        assert torch.equal(res["grad_x"], res["want_x"]), f"rank {rank}: seq_to_head backward"
        assert torch.equal(res["grad_z"], res["want_z"]), f"rank {rank}: head_to_seq backward"


@pytest.mark.parametrize("cp", [2, 4])
def test_indivisible_shapes_raise(cp: int) -> None:
    for messages in get_rank_pool(WORLD).run(_errors_rank, cp):
        assert messages[0] == f"heads on this rank ({cp + 1}) must be divisible by cp={cp} for the Ulysses exchange"
        assert messages[1] == f"sequence length {cp + 1} must be divisible by cp={cp}"
