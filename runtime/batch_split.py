"""RunFab's batch contract: microbatch x accumulation x ranks rows make one optimizer update.

RunFab chooses the microbatch and the accumulation; the ranks are the data-parallel processes.
Their product must equal the bundle's literal ``EFFECTIVE_BATCH_SIZE``: it is checked here, once,
when the split is made, and never overridden.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from config import ConfigError


@dataclass(frozen=True)
class BatchSplit:
    microbatch: int  # rows per forward/backward on one rank
    accumulation: int  # microbatches per optimizer update on one rank
    ranks: int  # data-parallel processes
    effective: int  # rows per optimizer update across all ranks: train.EFFECTIVE_BATCH_SIZE

    def __post_init__(self) -> None:
        for name in ("microbatch", "accumulation"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ConfigError(f"{name} must be a whole number of rows, not {value!r} ({type(value).__name__})")
        if self.microbatch < 1 or self.accumulation < 1:  # (-8) x (-4) would pass the product's check
            raise ConfigError(f"microbatch ({self.microbatch}) and accumulation ({self.accumulation}) must each be "
                              f"at least 1, their product x devices ({self.ranks}) equal to EFFECTIVE_BATCH_SIZE "
                              f"({self.effective})")
        if self.rows_per_update != self.effective:
            raise ConfigError(
                f"microbatch ({self.microbatch}) x accumulation ({self.accumulation}) x devices ({self.ranks}) must "
                f"equal EFFECTIVE_BATCH_SIZE ({self.effective}) rows per optimizer update"
            )

    @property
    def rows_per_update(self) -> int:
        return self.microbatch * self.accumulation * self.ranks

    @classmethod
    def for_command_line(cls, effective: int, ranks: int, default_microbatch: int, microbatch: int | None = None,
                         accumulation: int | None = None) -> BatchSplit:
        """A local run names either part, or neither (the config's microbatch); the other follows."""
        named = microbatch
        microbatch = command_line_microbatch(effective, ranks, default_microbatch, microbatch, accumulation)
        # Say which part does not divide, rather than imply the other or blame one the user never gave.
        per_rank = effective // ranks
        fits = ", ".join(str(m) for m in range(1, per_rank + 1) if per_rank % m == 0)
        if named is None and accumulation is not None and effective % (accumulation * ranks):
            raise ConfigError(f"accumulation {accumulation} x {ranks} device(s) does not divide EFFECTIVE_BATCH_SIZE "
                              f"({effective}) rows per update; use one of {fits}")
        if accumulation is None and effective % (microbatch * ranks):
            raise ConfigError(f"microbatch {microbatch} x {ranks} device(s) does not divide EFFECTIVE_BATCH_SIZE "
                              f"({effective}) rows per update; use one of {fits}")
        implied = max(1, effective // (microbatch * ranks))
        return cls(microbatch, accumulation if accumulation is not None else implied, ranks, effective)

    def as_dict(self) -> dict:
        return {"effective": self.effective, "microbatch": self.microbatch, "accumulation": self.accumulation,
                "world_size": self.ranks}


def command_line_microbatch(effective: int, ranks: int, default: int, microbatch: int | None,
                            accumulation: int | None) -> int:
    """The microbatch a local command asks for: named, implied by a named accumulation, or the config's."""
    for name, value in (("microbatch", microbatch), ("accumulation", accumulation)):
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be at least 1, not {value}")
    if microbatch is not None:
        return microbatch
    return effective // (accumulation * ranks) if accumulation is not None else default


def probe_accumulation(effective: int, microbatch: int, ranks: int) -> int:
    """The probe accumulates over two microbatches when the batch allows: gradients are then held
    while the next forward runs, as in training."""
    return 2 if effective // (microbatch * ranks) >= 2 else 1
