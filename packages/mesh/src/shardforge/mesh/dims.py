"""`ParallelDims`: the sizes of every parallel axis, parsed and validated in one place.

Axis letters in layout strings (AReaL-style, e.g. ``d4t2c2p1e2`` or ``fsdp:d4t2``):

    r  dp_replicate   data-parallel replicas (HSDP outer axis)
    d  dp_shard       data-parallel shards (FSDP axis); -1 = "the rest of the world"
    c  cp             context (sequence) parallel
    t  tp             tensor parallel
    p  pp             pipeline parallel
    e  ep             expert parallel (borrows ranks from dp_shard x cp [x tp])
    x  etp            expert tensor parallel: 1 or equal to tp
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

__all__ = ["ParallelDims", "divisors"]

_LETTER_TO_FIELD = {
    "r": "dp_replicate",
    "d": "dp_shard",
    "c": "cp",
    "t": "tp",
    "p": "pp",
    "e": "ep",
    "x": "etp",
}
_TOKEN = re.compile(r"([a-z])(-?\d+)")


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order (used in error messages)."""
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """Sizes of the parallel axes. The product of the dense axes is the world size:
    ``pp * dp_replicate * dp_shard * cp * tp``. ``ep``/``etp`` re-use those ranks."""

    dp_replicate: int = 1
    """Number of data-parallel replicas (HSDP replicate axis)."""
    dp_shard: int = -1
    """FSDP shard count; -1 means whatever is left of the world size."""
    cp: int = 1
    """Context-parallel size (Ulysses): sequence split across ranks."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (number of stages)."""
    ep: int = 1
    """Expert-parallel size; borrows ranks from dp_shard x cp (x tp when etp == 1)."""
    etp: int = 1
    """Expert tensor-parallel size: 1 (experts not TP-sharded) or tp."""

    @classmethod
    def parse(cls, spec: str) -> ParallelDims:
        """Parse ``"d4t2c2p1e2"`` (optionally prefixed ``fsdp:``) into `ParallelDims`.

        Letters not given keep their defaults (dp_shard=-1, the others 1).
        """
        if not isinstance(spec, str):
            raise TypeError(f"layout must be a string like 'd4t2', got {type(spec).__name__}")
        text = spec.strip().lower()
        if text.startswith("fsdp:"):
            text = text[len("fsdp:") :]
        if not text:
            raise ValueError(f"empty layout {spec!r}; expected letters+sizes like 'd4t2' ({_letters_help()})")
        pos = 0
        values: dict[str, int] = {}
        for match in _TOKEN.finditer(text):
            if match.start() != pos:
                break
            letter, number = match.group(1), int(match.group(2))
            if letter not in _LETTER_TO_FIELD:
                raise ValueError(f"unknown axis letter {letter!r} in layout {spec!r}; valid letters: {_letters_help()}")
            field = _LETTER_TO_FIELD[letter]
            if field in values:
                raise ValueError(f"axis {letter!r} ({field}) given twice in layout {spec!r}")
            values[field] = number
            pos = match.end()
        if pos != len(text):
            raise ValueError(
                f"cannot parse layout {spec!r} at {text[pos:]!r}; expected letters+sizes like 'd4t2c2' "
                f"({_letters_help()})"
            )
        return cls(**values)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{field.name} must be an int, got {value!r}")
            if field.name == "dp_shard":
                if value == 0 or value < -1:
                    raise ValueError(f"dp_shard={value} is invalid; use a positive size or -1 for 'the rest'")
            elif value < 1:
                raise ValueError(f"{field.name}={value} is invalid; sizes must be >= 1")

    # ----------------------------------------------------------------- resolution
    def resolve(self, world_size: int) -> ParallelDims:
        """Return a copy with ``dp_shard=-1`` replaced by the rest of ``world_size``, validated."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        dims = self
        if self.dp_shard == -1:
            others = self.pp * self.dp_replicate * self.cp * self.tp
            if world_size % others != 0:
                raise ValueError(
                    f"world_size={world_size} is not divisible by pp*dp_replicate*cp*tp="
                    f"{self.pp}*{self.dp_replicate}*{self.cp}*{self.tp}={others}, so dp_shard=-1 cannot "
                    f"be inferred; pick sizes whose product divides {world_size} "
                    f"(divisors: {divisors(world_size)})"
                )
            dims = dataclasses.replace(self, dp_shard=world_size // others)
        dims.validate(world_size)
        return dims

    def validate(self, world_size: int) -> None:
        """Raise `ValueError` naming what is wrong and what would be valid."""
        if self.dp_shard == -1:
            self.resolve(world_size)
            return
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != world_size:
            raise ValueError(
                f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp}"
                f" = {product}, but world_size={world_size}; the product must equal the world size "
                f"(set dp_shard=-1 to infer it, or choose sizes from the divisors of {world_size}: "
                f"{divisors(world_size)})"
            )
        if self.etp not in (1, self.tp):
            raise ValueError(f"etp={self.etp} must be 1 or equal to tp={self.tp}")
        if self.ep > 1:
            pool = self.dp_shard * self.cp * (self.tp if self.etp == 1 else 1)
            if pool % self.ep != 0:
                label = "dp_shard*cp*tp" if self.etp == 1 else "dp_shard*cp"
                raise ValueError(
                    f"ep={self.ep} must divide {label}={pool} (expert parallelism borrows those ranks); "
                    f"valid ep: {divisors(pool)}"
                )

    # ----------------------------------------------------------------- derived sizes
    def _require_resolved(self) -> None:
        if self.dp_shard == -1:
            raise ValueError("dp_shard=-1 is unresolved; call dims.resolve(world_size) first")

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-loading parallel size: dp_replicate x dp_shard."""
        self._require_resolved()
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Parameter sharding size: dp_shard x cp."""
        self._require_resolved()
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """Gradient-averaging size for dense params: dp_replicate x dp_shard x cp."""
        self._require_resolved()
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP size for expert params: (dp_shard x cp [x tp if etp == 1]) / ep; equals fsdp when ep == 1."""
        self._require_resolved()
        if self.ep == 1:
            return self.fsdp
        return self.dp_shard * self.cp * (self.tp if self.etp == 1 else 1) // self.ep

    def size(self, axis: str) -> int:
        """Size of a named axis (dense, derived, or expert)."""
        if axis in _AXIS_NAMES:
            return int(getattr(self, axis))
        raise ValueError(f"unknown axis {axis!r}; valid axes: {sorted(_AXIS_NAMES)}")

    def to_string(self) -> str:
        """Inverse of `parse` (letters in a fixed order), e.g. ``'r1d4c1t2p1e1x1'``."""
        return "".join(f"{letter}{getattr(self, field)}" for letter, field in _LETTER_TO_FIELD.items())


_AXIS_NAMES = {
    "dp_replicate",
    "dp_shard",
    "cp",
    "tp",
    "pp",
    "ep",
    "etp",
    "dp",
    "fsdp",
    "dp_cp",
    "efsdp",
    "world_size",
}


def _letters_help() -> str:
    return ", ".join(f"{k}={v}" for k, v in _LETTER_TO_FIELD.items())
