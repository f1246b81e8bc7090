"""The host memory of a run, stage by stage (runfab/process_memory.py reads it), and the teardown copy it avoids."""

from __future__ import annotations

import lightning as L
import torch

from runfab.process_memory import record_stage


class MemoryStages(L.Callback):
    """Records this process's memory at each stage of a run, and keeps Lightning's teardown from
    copying a finished GPU run's weights, gradients and optimizer state into host memory."""

    STAGE_UPDATES = (1, 2, 3, 5, 10)

    def __init__(self) -> None:
        self._done: set[int] = set()

    def stage(self, name: str, trainer: L.Trainer | None = None) -> None:
        record_stage(name, trainer.global_rank if trainer is not None else None)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.stage("process group and device ready", trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.stage("model on the device, optimizer built", trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        update = trainer.global_step
        if update not in self.STAGE_UPDATES or update in self._done:
            return
        self._done.add(update)
        self.stage(f"update {update}", trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        """Runs after the export and the run record (callbacks run in order; this one is last).

        Lightning's teardown then copies the optimizer state and the module to the CPU, which for
        the reference model is 2 GiB of host memory per GPU process (weights, gradients, two AdamW
        moments) just before the process exits, the job's peak. On a GPU nothing
        is needed after this point, so the copy is made of nothing."""
        self.stage("training ended", trainer)
        if pl_module.device.type != "cuda":
            return
        for optimizer in trainer.optimizers:
            optimizer.state.clear()
        for parameter in pl_module.parameters():
            parameter.grad = None
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
