"""Each data-parallel rank's share of a streaming checkpoint (`StreamingSource.checkpoint_state`), also when the
resumed run has another data-parallel size than the run that saved it.

A rank streams its own prompt numbers ``q`` (0, 1, 2, ...); rank ``r`` of ``D`` ranks with ``local = P / D`` prompts
per step owns the global prompt positions ``(q // local) * P + r + D * (q % local)`` (``P`` = prompts_per_step). The
checkpoint holds, per rank, the prompt numbers in flight or finished-unused (``regenerate``) and the next new one
(``next_position``); every number below ``next_position`` and not in ``regenerate`` was trained (or dropped by
dynamic sampling) before the checkpoint. A global position is therefore **done**, **to redo** (in a ``regenerate``
list) or **new**. With another size ``D'`` each new rank walks its own positions: the done ones are skipped, the
others up to its last done-or-redo position are regenerated first, and its next new number follows that one. Every
position the old ranks had not trained is trained once by the new ranks, none twice (`test_alg_streaming_resume.py`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["rank_share"]


def rank_share(
    state: dict[str, Any] | None, dp_rank: int, dp_size: int, prompts_per_step: int
) -> dict[str, Any] | None:
    """This rank's ``{"regenerate": [...], "next_position": n}`` of a gathered streaming checkpoint ``state``
    (``{"dp_size": D, "ranks": [per-rank state, ...]}``); None without one."""
    if not state:
        return None
    old_size = int(state["dp_size"])
    if old_size == dp_size:
        return state["ranks"][dp_rank]
    if prompts_per_step % old_size:
        raise ValueError(
            f"the checkpoint's streaming rollouts were made by {old_size} data-parallel ranks, which do not divide "
            f"prompts_per_step={prompts_per_step}: resume with a data-parallel size that divides it (or resume=never)"
        )
    old_local, local = prompts_per_step // old_size, prompts_per_step // dp_size
    redo = [set(rank["regenerate"]) for rank in state["ranks"]]
    nexts = [int(rank["next_position"]) for rank in state["ranks"]]

    def status(position: int) -> str:
        index, slot = divmod(position, prompts_per_step)
        rank, row = slot % old_size, slot // old_size
        q = index * old_local + row
        return "redo" if q in redo[rank] else "done" if q < nexts[rank] else "new"

    # every old rank's numbers at or past its next_position are new: no position of a later batch is done or redone
    horizon = max(-(-n // old_local) for n in [*nexts, *(max(r, default=-1) + 1 for r in redo)]) * local
    statuses = [status((q // local) * prompts_per_step + dp_rank + dp_size * (q % local)) for q in range(horizon)]
    next_position = max((q + 1 for q, s in enumerate(statuses) if s != "new"), default=0)
    regenerate = [q for q in range(next_position) if statuses[q] != "done"]
    return {"regenerate": regenerate, "next_position": next_position}
