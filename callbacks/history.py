"""The per-update history of a run, and the digests that make two runs comparable (fingerprints.py):
the initial weights, taken before update 1, and the chain of the training tokens, update by update.

Every update's loss (token-weighted, over all ranks), learning rate, gradient norm (before
clipping), target tokens, the seconds since the run started (the host's clock when the update was
handed over, not synchronized with the GPU: the history costs no sync per update) and its tokens'
digest. The values stay on the device and are read, and the losses added up over ranks, once
every FLUSH_UPDATES updates, in one all-reduce on every rank at the same update.

The history survives resumption: it is part of the checkpoint (Lightning keeps a callback's
state_dict), so a resumed run's history is the whole run's, as an uninterrupted run's would be.
It is written as ``history.npz`` (numpy, no pickle) beside the exported model, where RunFab keeps
it. Rank 0 also hands every update to the Trainer's loggers, as it is read: its loss, learning rate,
gradient norm and tokens per second (its target tokens over the host's seconds since the previous
update ended, validation left out); ``flush`` is then also called before each metric line, so the
loggers are never more than a line behind and receive their points in update order. Bounded: a row per update up to MAX_ROWS rows (about 5 MB); beyond, adjacent rows are merged
in pairs and every row then covers ``stride`` updates (stated in the file): the loss is their
token-weighted mean, the gradient norm their mean, target tokens their sum, the learning rate,
update and seconds those of the last, the digest the sum of theirs (modulo 2**63).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from pipeline import fingerprints
from pipeline.fingerprints import DIGEST_MODULUS
from runfab import created_files

log = logging.getLogger(__name__)

HISTORY_FILE = "history.npz"
FLUSH_UPDATES = 64
MAX_ROWS = 1 << 17
COLUMNS = {"update": np.int64, "loss": np.float64, "lr": np.float32, "grad_norm": np.float32,
           "target_tokens": np.int64, "seconds": np.float32, "tokens_digest": np.int64}


def model_weights_digest(model) -> str:
    """The digest of a model's weights under the export's names: what anyone who loads the model sees."""
    from model import hf

    return fingerprints.weights_digest(hf.to_hf(model))


def merge_pairs(columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Halve the history's resolution: each pair of adjacent rows becomes one (the module says how)."""
    n = len(columns["update"]) // 2 * 2
    pair = {name: values[:n].reshape(-1, 2) for name, values in columns.items()}
    tokens = pair["target_tokens"].sum(axis=1)
    merged = {
        "update": pair["update"][:, 1], "lr": pair["lr"][:, 1], "seconds": pair["seconds"][:, 1],
        "loss": (pair["loss"] * pair["target_tokens"]).sum(axis=1) / np.maximum(tokens, 1),
        "grad_norm": pair["grad_norm"].mean(axis=1), "target_tokens": tokens,
        "tokens_digest": ((pair["tokens_digest"][:, 0].astype(object) + pair["tokens_digest"][:, 1])
                          % DIGEST_MODULUS).astype(np.int64),
    }
    return {name: np.concatenate([merged[name].astype(dtype), columns[name][n:]]) for name, dtype in COLUMNS.items()}


def read_history(path: Path) -> dict:
    """A history file's columns and its stride."""
    with np.load(path, allow_pickle=False) as data:
        return {**{name: data[name] for name in COLUMNS}, "stride": int(data["stride"])}


class History(L.Callback):
    """Keeps the per-update history, the initial weights' digest and the training tokens' chain."""

    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self.max_rows = max_rows
        self.columns = {name: np.zeros(0, dtype=dtype) for name, dtype in COLUMNS.items()}
        self.stride = 1
        self.initial_weights: str | None = None
        self.tokens_chain = fingerprints.TOKENS_CHAIN_START
        self.updates = 0  # in the chain
        self.seconds_before = 0.0  # of the segments before this one (a resumed run)
        self._pending: list[tuple] = []
        self._loss: torch.Tensor | None = None
        self._lr = 0.0
        self._steps_seen = 0
        self._start = time.perf_counter()
        self._update_start = self._start  # where the next update's seconds count from (for the loggers)
        self._first_batch = True

    # -- the updates ------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._steps_seen = trainer.global_step
        self._start = time.perf_counter()
        self._first_batch = True
        if trainer.global_step == 0 and self.initial_weights is None and trainer.is_global_zero:
            self.initial_weights = model_weights_digest(pl_module.model)  # before update 1: the same on every rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._first_batch:  # the first update's seconds start with its first microbatch
            self._first_batch = False
            self._update_start = time.perf_counter()
        if self._loss is None:  # an update's first microbatch: the learning rate it trains with
            self._lr = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss_sum"].detach().double()
        self._loss = loss if self._loss is None else self._loss + loss
        if trainer.global_step == self._steps_seen:
            return  # mid-accumulation
        self._steps_seen = trainer.global_step
        norm = pl_module.last_grad_norm
        now = time.perf_counter()
        self._pending.append((trainer.global_step, self._loss, norm.detach().double() if norm is not None else None,
                              self._lr, int(batch["update_target_tokens"]), int(batch.get("update_digest", 0)),
                              self.seconds_before + now - self._start, now - self._update_start))
        self._update_start = now
        self._loss = None
        if trainer.global_step % FLUSH_UPDATES == 0:
            self.flush(trainer)

    def flush(self, trainer: L.Trainer) -> None:
        """Read the pending updates off the device (losses added up over ranks) into the history.
        Every rank calls it at the same update."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        losses = torch.stack([p[1] for p in pending])
        if trainer.world_size > 1:
            torch.distributed.all_reduce(losses)
        norms = [float(p[2]) if p[2] is not None else float("nan") for p in pending]
        rows = {"update": [p[0] for p in pending], "loss": (losses.cpu().numpy() / [max(p[4], 1) for p in pending]),
                "grad_norm": norms, "lr": [p[3] for p in pending], "target_tokens": [p[4] for p in pending],
                "tokens_digest": [p[5] for p in pending], "seconds": [p[6] for p in pending]}
        for _, _, _, _, _, digest, _, _ in pending:
            self.tokens_chain = fingerprints.chain(self.tokens_chain, digest)
        if trainer.is_global_zero and trainer.loggers:
            self._log_points(trainer, rows, [p[7] for p in pending])
        self.updates += len(pending)
        if self.stride > 1:  # the new rows join at the history's resolution
            rows = self._at_stride(rows)
        self.columns = {name: np.concatenate([self.columns[name], np.asarray(rows[name], dtype=dtype)])
                        for name, dtype in COLUMNS.items()}
        while len(self.columns["update"]) > self.max_rows:
            self.columns = merge_pairs(self.columns)
            self.stride *= 2

    @staticmethod
    def _log_points(trainer: L.Trainer, rows: dict, seconds: list[float]) -> None:
        for i, update in enumerate(rows["update"]):
            point = {"loss": float(rows["loss"][i]), "lr": float(rows["lr"][i]),
                     "tokens_per_second": rows["target_tokens"][i] / max(seconds[i], 1e-9)}
            if not np.isnan(rows["grad_norm"][i]):
                point["grad_norm"] = float(rows["grad_norm"][i])
            for logger in trainer.loggers:
                logger.log_metrics(point, step=int(update))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._update_start = time.perf_counter()  # the next update's seconds leave validation out

    def _at_stride(self, rows: dict) -> dict:
        """Rows of single updates merged up to the history's stride (the last may be partial)."""
        columns = {name: np.asarray(rows[name], dtype=dtype) for name, dtype in COLUMNS.items()}
        stride = 1
        while stride < self.stride:
            columns = merge_pairs(columns)
            stride *= 2
        return columns

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.flush(trainer)

    # -- what the checkpoint keeps ------------------------------------------------------------

    def state_dict(self) -> dict:
        trainer = getattr(self, "_trainer", None)
        if self._pending and trainer is not None:  # a checkpoint is taken on every rank at the same update
            self.flush(trainer)
        last = float(self.columns["seconds"][-1]) if len(self.columns["seconds"]) else self.seconds_before
        return {"columns": {name: torch.from_numpy(values.copy()) for name, values in self.columns.items()},
                "stride": self.stride, "initial_weights": self.initial_weights, "tokens_chain": self.tokens_chain,
                "updates": self.updates, "seconds": last}

    def load_state_dict(self, state: dict) -> None:
        self.columns = {name: state["columns"][name].numpy().astype(dtype) for name, dtype in COLUMNS.items()}
        self.stride, self.initial_weights = state["stride"], state["initial_weights"]
        self.tokens_chain, self.updates, self.seconds_before = state["tokens_chain"], state["updates"], state["seconds"]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    # -- what the run keeps ------------------------------------------------------------------

    def summary(self) -> dict:
        return {"initial_weights_sha256": self.initial_weights,
                "training_tokens": {"sha256": self.tokens_chain,
                                    "updates": self.updates, "history": HISTORY_FILE,
                                    "history_stride": self.stride}}

    def write(self, folder: Path) -> Path:
        path = Path(folder) / HISTORY_FILE
        with created_files.open_created(path, "wb") as file:
            np.savez_compressed(file, stride=np.int64(self.stride), **self.columns)
        return path
