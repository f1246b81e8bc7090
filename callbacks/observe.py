"""Observation windows: a profiler trace and a CUDA allocator history over chosen updates.

Both are off by default and cost nothing then. When on, they cover whole optimizer updates
(numbered from 1, as the metric lines' ``step`` counts them): the profiler records CPU and CUDA
activity and is exported as a Chrome/Perfetto JSON trace; the allocator history of one update is
dumped as a snapshot for https://pytorch.org/memory_viz. The training module (lit_module.py) marks zero_grad,
forward, backward and optimizer_step with ``record_function``, so both views name the phases.
The metrics callback reports observed updates apart (``"observed": 1``) and leaves them out of
the run summary. Files go to ``<output>/run/``, never into ``model/``. Every rank writes its trace
(data-parallel ranks wait for the slowest); rank 0 alone writes the memory snapshot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning as L
import torch

from runfab.limits import MIB

log = logging.getLogger(__name__)

LoggerName = Literal["csv", "tensorboard", "wandb"]


@dataclass
class ObserveConfig:
    """The ``observe`` section of the config."""

    warmup_updates: int = 10
    """First updates (compilation, allocator growth) left out of the run summary"""
    profile_update: int = 0
    """First update of the profiler window, traced to the output's run/ folder; 0: no trace"""
    profile_updates: int = 2
    """Updates in the profiler window"""
    memory_update: int = 0
    """Update whose CUDA allocator history is dumped as a snapshot; 0: no snapshot"""
    memory_history_entries: int = 200_000
    """Allocator events the snapshot keeps"""
    loggers: list[LoggerName] = field(default_factory=list)
    """Lightning loggers writing to the output's run/logs/ folder (tensorboard and wandb when installed)"""

    def profiled(self) -> range:
        start = self.profile_update
        return range(start, start + self.profile_updates) if start > 0 and self.profile_updates > 0 else range(0)

    def observed_updates(self) -> set[int]:
        return set(self.profiled()) | ({self.memory_update} if self.memory_update > 0 else set())

    def problems(self) -> list[str]:
        found = []
        if min(self.warmup_updates, self.profile_update, self.profile_updates, self.memory_update) < 0:
            found.append("observe: update numbers and counts must be >= 0")
        if self.memory_history_entries < 1:
            found.append(f"observe.memory_history_entries must be at least 1, not {self.memory_history_entries}")
        return found


class ObservationWindows(L.Callback):
    """Starts and stops the profiler and the allocator history at update boundaries (rank 0)."""

    def __init__(self, config: ObserveConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.files: list[str] = []  # written so far, relative to run_dir, for the run record
        self._profiler: torch.profiler.profile | None = None
        self._recording_memory = False
        self._traced = self._snapshotted = False  # each window runs once, even if an update number repeats

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        update = trainer.global_step + 1  # the update this microbatch belongs to
        profiled = self.config.profiled()
        if update == profiled.start and self._profiler is None and not self._traced:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            log.info("profiling updates %d to %d", profiled.start, profiled.stop - 1)
        if not trainer.is_global_zero:
            return  # every rank writes a trace (data parallelism waits for the slowest); rank 0 the snapshot
        if update == self.config.memory_update and not self._recording_memory and not self._snapshotted:
            if pl_module.device.type != "cuda":
                log.warning("observe.memory_update needs a CUDA device; no memory snapshot on %s", pl_module.device)
                self._snapshotted = True
                return
            torch.cuda.memory._record_memory_history(max_entries=self.config.memory_history_entries)
            self._recording_memory = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        finished = trainer.global_step  # an update that just completed; mid-accumulation it is the previous one
        if self._profiler is not None and finished == self.config.profiled().stop - 1:
            self._profiler.stop()
            rank = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
            path = self.run_dir / "profile" / f"trace-updates-{self.config.profiled().start}-{finished}{rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(path))
            self._profiler, self._traced = None, True
            if trainer.is_global_zero:
                self._written(path)
            else:
                log.info("observation written: %s (%.1f MiB)", path, path.stat().st_size / MIB)
        if self._recording_memory and finished == self.config.memory_update:
            path = self.run_dir / "memory" / f"snapshot-update-{finished}.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory, self._snapshotted = False, True
            self._written(path)

    def on_train_end(self, trainer, pl_module) -> None:
        """A run that ends inside a window still leaves what was recorded."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False

    def _written(self, path: Path) -> None:
        self.files.append(path.relative_to(self.run_dir).as_posix())
        log.info("observation written: %s (%.1f MiB)", path, path.stat().st_size / MIB)
