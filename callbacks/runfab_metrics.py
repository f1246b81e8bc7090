"""RunFab's graph feed: one JSON object per line on stdout, every few seconds and once at the end.

Per-step values stay on the device and are summed there; the host reads them (one sync)
only when it reports, so the metrics cost nothing between reports. Warmup updates and observed
updates (profiler, memory snapshot) are reported in intervals of their own, flagged, and left out
of the run summary, which gives the throughput of the normal region only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TextIO

import lightning as L
import torch

from runfab import created_files
from runfab.limits import GIB, METRIC_LINE_CHARS

log = logging.getLogger(__name__)

MAX_LINE_CHARS = METRIC_LINE_CHARS - 1  # RunFab wants each line below METRIC_LINE_CHARS
PER_UPDATE = frozenset({"step", "loss", "lr", "grad_norm", "tokens_per_second", "val_loss"})
"""A line's values that the loggers receive otherwise: for every update (history.py) and at each validation."""


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved memory of a CUDA device so far, in GiB; nothing elsewhere."""
    if device.type != "cuda":
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}


class NonFiniteLossError(FloatingPointError):
    """Training diverged; the run stops rather than report or export a broken model."""


def deliver(stream: TextIO, text: str) -> bool:
    """Write and flush ``text``; if the reader of ``stream`` has gone (``python train.py | head``, a
    platform that stopped reading), say so once and point the stream at /dev/null, so that training,
    the export and the interpreter's own exit go on. The lines stay in run/metrics.jsonl."""
    try:
        stream.write(text)
        stream.flush()
        return True
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        pass
    log.warning("%s is closed: lines are no longer delivered there (run/metrics.jsonl keeps the metric lines)",
                getattr(stream, "name", "the output stream"))
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
        stream.flush()  # what the failed write left in the buffer now goes nowhere, without an error at exit
    except (OSError, ValueError):
        pass
    return False


def ensure_stdout() -> None:
    """A process started with stdout closed has none (``sys.stdout`` is None), and the first metric line
    would end the run; it gets /dev/null instead, said once, as when a reader goes away (``deliver``):
    the lines stay in run/metrics.jsonl. /dev/null also takes fd 1 if it is free, so that no file
    opened later lands there and receives what is meant for stdout."""
    if sys.stdout is not None:
        return
    try:
        os.fstat(1)
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != 1:
            os.dup2(null, 1)
            os.close(null)
    sys.stdout = open(os.devnull, "w")
    log.warning("stdout is closed: metric lines are not delivered there (run/metrics.jsonl keeps them)")


class RunFabMetrics(L.Callback):
    """Token-weighted loss and synchronized throughput over each reporting interval (rank 0 writes)."""

    def __init__(
        self, interval_seconds: float = 5.0, stream: TextIO | None = None,
        flops: Callable[[int, int], float] | None = None, peak_flops: float | None = None,
        warmup_updates: int = 0, observed_updates: Collection[int] = (), log_path: Path | None = None,
        validate_every: int = 0, report_due: Callable[[int], bool] | None = None,
        input_wait: Callable[[], float] | None = None, before_line: Callable[[L.Trainer], None] | None = None,
    ) -> None:
        """``flops(tokens, attention_pairs)`` and ``peak_flops`` (per device) add ``mfu`` to the lines.

        Each line also goes to ``log_path`` (the run's metrics.jsonl), and what it has beyond the
        per-update values (loss, lr, grad_norm, tokens_per_second: the loggers get those for every
        update from ``before_line(trainer)``, called on every rank as an interval closes) to the
        trainer's loggers, at its update; so does each periodic validation's ``val_loss``.
        Every line carries loss and throughput: an interval with no update writes nothing, and
        ``val_loss`` rides on the line of the interval that validation (every ``validate_every``
        updates) closes. With several ranks ``report_due(update)`` (the feeder's marks) says when to
        report instead of the clock, so every rank reports at the same update.

        Throughput is the contract's: completed work over the interval's wall-clock seconds.
        ``input_wait()`` gives the seconds training has waited for input so far: a line reports them
        as ``training_wait_seconds``, and ``tokens_per_compute_second`` leaves them out, so that a
        slow input shows as waiting, not as a slow trainer.
        """
        self.interval_seconds = interval_seconds
        self.stream = stream if stream is not None else sys.stdout
        self.flops = flops
        self.peak_flops = peak_flops
        self.warmup_updates = warmup_updates
        self.observed_updates = frozenset(observed_updates)
        self.log_path = Path(log_path) if log_path is not None else None
        self.validate_every = validate_every
        self.report_due = report_due
        self.input_wait = input_wait
        self.before_line = before_line
        self._held: dict | None = None  # the interval closed when validation started, written with its val_loss
        self._pending_val_loss: float | None = None  # a validation loss waiting for the next training line
        self.validated_at: int | None = None  # the update of the last periodic validation
        self._log_file: TextIO | None = None
        self.last_record: dict = {}
        self.normal = {"seconds": 0.0, "input_wait_seconds": 0.0, "target_tokens": 0, "flops": 0.0, "updates": 0,
                       "first_update": None, "last_update": None}

    def phase(self, update: int) -> str:
        """warmup, observed or normal: updates of different phases are never reported together."""
        if update <= self.warmup_updates:
            return "warmup"
        return "observed" if update in self.observed_updates else "normal"

    # -- state ------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        self._zero = lambda: torch.zeros((), dtype=torch.float64, device=device)
        self._pending_loss, self._pending_tokens, self._pending_rows, self._pending_flops = self._zero(), 0, 0, 0.0
        self._interval_loss, self._interval_grad_norm = self._zero(), self._zero()
        self._interval_tokens = self._interval_rows = self._interval_steps = 0
        self._interval_flops = 0.0
        self._first_bad_step = torch.full((), -1, dtype=torch.long, device=device)
        self._steps_seen = trainer.global_step
        self.total_tokens = 0
        self.start_time: float | None = None
        self._interval_start = self._interval_wait = 0.0
        if self.log_path is not None and trainer.is_global_zero:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = created_files.open_created(self.log_path)

    def _now(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start_time is None:
            self._start_interval(pl_module.device)
            self.start_time = self._interval_start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss_sum = outputs["loss_sum"].double()
        update_completed = trainer.global_step != self._steps_seen
        this_update = trainer.global_step if update_completed else trainer.global_step + 1
        self._flag_nonfinite(loss_sum, torch.full((), this_update, device=loss_sum.device))
        self._pending_loss += loss_sum
        self._pending_tokens += outputs["target_tokens"]
        self._pending_rows += batch["input_ids"].shape[0]
        if self.flops is not None:
            self._pending_flops += self.flops(batch["input_ids"].numel(), batch.get("attention_pairs", 0))
        if not update_completed:
            return  # mid-accumulation: the update is not complete yet
        self._steps_seen = trainer.global_step
        if pl_module.last_grad_norm is not None:
            norm = pl_module.last_grad_norm.double()
            self._flag_nonfinite(norm, torch.full((), trainer.global_step, device=norm.device))
            self._interval_grad_norm += norm
        self._interval_loss += self._pending_loss
        self._interval_tokens += self._pending_tokens
        self._interval_rows += self._pending_rows
        self._interval_flops += self._pending_flops
        self._interval_steps += 1
        self._pending_loss, self._pending_tokens, self._pending_rows, self._pending_flops = self._zero(), 0, 0, 0.0
        if self.validate_every and trainer.global_step % self.validate_every == 0:
            return  # validation follows this update and closes the interval, so its line carries val_loss
        if self.phase(trainer.global_step + 1) != self.phase(trainer.global_step):
            self.report(trainer, pl_module)  # a phase boundary: the same update on every rank
        elif self.report_due is not None:
            if self.report_due(trainer.global_step):
                self.report(trainer, pl_module)
        elif time.perf_counter() - self._interval_start >= self.interval_seconds:
            self.report(trainer, pl_module)

    def _flag_nonfinite(self, value: torch.Tensor, step: torch.Tensor) -> None:
        first = (~torch.isfinite(value)) & (self._first_bad_step < 0)
        self._first_bad_step = torch.where(first, step, self._first_bad_step)

    # -- reporting --------------------------------------------------------------------------

    def report(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Close the interval and write its line; an interval without an update writes nothing."""
        record = self._close(trainer, pl_module)
        if record is not None:
            self._write(trainer, record)

    def _close(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict | None:
        """Check finiteness, end the interval and start the next; its line, or None if it had no update."""
        now = self._now(pl_module.device)
        if self.before_line is not None:
            self.before_line(trainer)
        bad_step = int(self._first_bad_step)
        if bad_step >= 0:
            raise NonFiniteLossError(
                f"loss or gradient norm became non-finite at optimizer step {bad_step}; stopping. "
                "Lower optim.lr, raise optim.warmup_steps, or check the input for corrupt token ids."
            )
        record: dict[str, float] | None = None
        if trainer.world_size > 1:
            self._sum_over_ranks(pl_module.device)
        if self._interval_steps:
            record = {"step": trainer.global_step, "elapsed_seconds": round(now - self.start_time, 3)}
            waited = self.input_wait() if self.input_wait is not None else 0.0
            seconds = max(now - self._interval_start, 1e-9)
            interval_wait = min(max(waited - self._interval_wait, 0.0), seconds)
            tokens = self._interval_tokens
            record |= {
                "loss": float(self._interval_loss) / max(tokens, 1),
                "tokens_per_second": tokens / seconds,
                "samples_per_second": self._interval_rows / seconds,
                "steps_per_second": self._interval_steps / seconds,
                "tokens_per_compute_second": tokens / max(seconds - interval_wait, 1e-9),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "grad_norm": float(self._interval_grad_norm) / self._interval_steps,
            }
            if self.flops is not None and self.peak_flops:
                record["mfu"] = self._interval_flops / seconds / (self.peak_flops * trainer.world_size)
            phase = self.phase(trainer.global_step)  # an interval's updates share one phase, its last one's
            if phase == "normal":
                self._count_normal(trainer.global_step, seconds, interval_wait, tokens)
            else:
                record[phase] = 1
            self.total_tokens += tokens
            if self.input_wait is not None:
                record["training_wait_seconds"] = waited
            record |= peak_memory(pl_module.device)
            if self._pending_val_loss is not None:
                record["val_loss"], self._pending_val_loss = self._pending_val_loss, None
        self._interval_loss, self._interval_grad_norm = self._zero(), self._zero()
        self._interval_tokens = self._interval_rows = self._interval_steps = 0
        self._interval_flops = 0.0
        self._start_interval(pl_module.device)
        return record

    def _start_interval(self, device: torch.device) -> None:
        self._interval_start = self._now(device)
        self._interval_wait = self.input_wait() if self.input_wait is not None else 0.0

    def _count_normal(self, last_update: int, seconds: float, waited: float, tokens: int) -> None:
        normal = self.normal
        if normal["first_update"] is None:
            normal["first_update"] = last_update - self._interval_steps + 1
        normal["last_update"] = last_update
        normal["seconds"] += seconds
        normal["input_wait_seconds"] += waited
        normal["target_tokens"] += tokens
        normal["flops"] += self._interval_flops
        normal["updates"] += self._interval_steps

    def normal_region(self) -> dict:
        """The updates the run's throughput is measured over (warmup and observed updates left out)."""
        return {k: self.normal[k] for k in ("first_update", "last_update", "updates")}

    def summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        """The run's figures over the normal region: warmup, observed updates and validation left out.

        Throughput and MFU are over its wall-clock seconds; ``tokens_per_compute_second`` (and per GPU)
        leaves out the time training waited for input, the trainer's own speed."""
        normal, world = self.normal, trainer.world_size
        seconds, tokens = normal["seconds"], normal["target_tokens"]
        computing = seconds - normal["input_wait_seconds"]
        result: dict = {
            "tokens_per_second_per_gpu": tokens / seconds / world if seconds else None,
            "tokens_per_second": tokens / seconds if seconds else None,
            "tokens_per_compute_second_per_gpu": tokens / computing / world if computing > 0 else None,
            "tokens_per_compute_second": tokens / computing if computing > 0 else None,
            "mfu": (normal["flops"] / seconds / (self.peak_flops * world)
                    if seconds and self.flops is not None and self.peak_flops else None),
            "normal_region": {k: normal[k] for k in ("first_update", "last_update", "updates", "seconds",
                                                     "input_wait_seconds", "target_tokens")},
            "excluded_updates": {"warmup": min(self.warmup_updates, trainer.global_step),
                                 "observed": sorted(u for u in self.observed_updates if u <= trainer.global_step)},
            "total_target_tokens": self.total_tokens,
            "world_size": world,
        }
        return result | peak_memory(pl_module.device)

    def _sum_over_ranks(self, device: torch.device) -> None:
        """Global interval totals: one small all-reduce, at report time only (every rank reports together)."""
        totals = torch.stack([
            self._interval_loss,
            torch.tensor(float(self._interval_tokens), dtype=torch.float64, device=device),
            torch.tensor(float(self._interval_rows), dtype=torch.float64, device=device),
            torch.tensor(self._interval_flops, dtype=torch.float64, device=device),
        ])
        torch.distributed.all_reduce(totals)
        self._interval_loss = totals[0]
        self._interval_tokens, self._interval_rows = int(totals[1]), int(totals[2])
        self._interval_flops = float(totals[3])

    def _write(self, trainer: L.Trainer, record: dict) -> None:
        record = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()}
        if not all(math.isfinite(v) for v in record.values()):
            raise NonFiniteLossError(f"refusing to report a non-finite metric: {record}")
        if not trainer.is_global_zero:
            return
        line = json.dumps(record, allow_nan=False, separators=(",", ":"))
        if len(line) > MAX_LINE_CHARS:
            raise ValueError(f"metrics line of {len(line)} characters exceeds RunFab's {METRIC_LINE_CHARS:,}")
        deliver(self.stream, line + "\n")
        if self._log_file is not None:
            self._log_file.write(line + "\n")
            self._log_file.flush()
        for logger in getattr(trainer, "loggers", ()):
            logger.log_metrics({k: v for k, v in record.items() if k not in PER_UPDATE}, step=record["step"])
        self.last_record = record
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
        log.info("metrics: %s", shown)

    # -- validation and end -----------------------------------------------------------------

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.start_time is None:
            return
        self._held = self._close(trainer, pl_module)  # keeps validation time out of the training throughput

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.start_time is None:
            return
        held, self._held = self._held, None
        if pl_module.val_loss.update_count:
            val_loss = round(float(pl_module.val_loss.compute()), 6)
            pl_module.val_loss.reset()
            log.info("validation loss %.4f after optimizer step %d", val_loss, trainer.global_step)
            self.validated_at = trainer.global_step
            for logger in trainer.loggers:
                logger.log_metrics({"val_loss": val_loss}, step=trainer.global_step)
            if held is not None:
                held["val_loss"] = val_loss
            else:
                self._pending_val_loss = val_loss  # no update since the last line: the next line carries it
        if held is not None:
            self._write(trainer, held)
        self._start_interval(pl_module.device)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.start_time is not None:
            self.report(trainer, pl_module)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
