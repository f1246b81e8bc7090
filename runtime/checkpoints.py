"""The checkpoints of a run, on stdin or from prepared shards: how they are written, which one ``last``
is, and what a resume must keep.

- ``DurableCheckpointIO``: Lightning's CheckpointIO plugin for ``output/checkpoints/``. A checkpoint
  is written under a temporary name, synced to disk, renamed, and loaded back, so that a write cut
  short (a killed process, a full disk, a lost node) never carries a checkpoint's name. Once the new
  one loads, the checkpoints that earlier saves of this trainer wrote there are removed except the
  one before it: two are kept, across resumes too, so that a newest one damaged later still leaves
  a checkpoint to resume from (Lightning's ModelCheckpoint only tracks its own saves of the current
  run). What those saves wrote is listed in ``WRITTEN``, so nothing else in the folder is ever removed.
- Loading never unpickles code: ``torch.load(weights_only=True)`` takes tensors and plain values
  only, which is all a checkpoint of this trainer holds; a file that needs more is refused.
- ``newest_loadable``: ``--ckpt_path last``, skipping (and naming on stderr) a checkpoint that
  does not load; when checkpoints exist and none loads, the resume is refused and they stay.
- ``fingerprint``: what a resume must not change (the model's shape, the prepared rows, the seed, the
  batch, every ``optim.*`` key, the process count, the tokenizer), which callbacks/resume_fingerprint.py
  stores in every checkpoint; ``refuse_changes`` compares a checkpoint's with this run's before
  Lightning loads it, in one line naming the key.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from callbacks.resume_fingerprint import FINGERPRINT_KEY
from config import ConfigError
from pipeline import shards
from pipeline.resume import TrainedUpdates
from runfab import created_files

log = logging.getLogger("train")

STOP_CHECKPOINT = "stopped.ckpt"  # written when a signal stops the run; the periodic ones are Lightning's
WRITTEN = ".written-checkpoints"  # the checkpoint files this trainer's saves wrote in the folder, one name a line


def _partial_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _write_durably(path: Path, write) -> None:
    """``write(file)`` into a temporary name beside ``path``, fsync, rename over ``path``, fsync the folder."""
    partial = _partial_name(path)
    partial.unlink(missing_ok=True)  # a leftover of a write that was cut short: this trainer's own name
    try:
        with created_files.open_created(partial, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)  # the rename itself must survive a crash
    finally:
        os.close(folder)


def written(folder: Path) -> list[str]:
    """The names of the checkpoints this trainer's saves wrote in ``folder`` (some may be gone since)."""
    try:
        text = (folder / WRITTEN).read_text()
    except FileNotFoundError:
        return []
    return [name for name in text.splitlines() if name and "/" not in name]


def _record_written(folder: Path, names: list[str]) -> None:
    text = "".join(f"{name}\n" for name in dict.fromkeys(names))
    _write_durably(folder / WRITTEN, lambda file: file.write(text.encode()))


KEEP = 2  # checkpoints of this trainer kept in the folder: the newest, and the one before it in case it is damaged


class DurableCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint format, written so that a torn write is never the newest, and
    keeping the newest two of the checkpoints this trainer wrote in the folder (runs on global rank 0,
    where Lightning saves); loaded with ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        earlier = [name for name in written(path.parent) if name != path.name]
        _record_written(path.parent, [*earlier, path.name])  # listed before it exists: a crash leaks no file unlisted
        _write_durably(path, lambda file: torch.save(checkpoint, file))
        load_metadata(path)  # verified: it loads back; until then the earlier ones stay
        kept = [name for name in reversed(earlier) if _loads(path.parent / name)][:KEEP - 1]
        for name in earlier:
            if name not in kept:
                (path.parent / name).unlink(missing_ok=True)
        _record_written(path.parent, [*kept, path.name])

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)

    def remove_checkpoint(self, path) -> None:
        """Nothing: ModelCheckpoint would remove the one before the newest, which ``save_checkpoint``
        keeps until a newer one loads; what stays is decided there alone."""


def remove_written(folder: Path, name: str) -> None:
    """Remove ``name`` from ``folder`` if this trainer's saves wrote it (a stop checkpoint that a
    completed run no longer needs); a file of anyone else stays."""
    names = written(folder)
    if name in names:
        (folder / name).unlink(missing_ok=True)
        _record_written(folder, [kept for kept in names if kept != name])


def load_metadata(path: Path) -> dict:
    """The checkpoint without reading its tensors (memory-mapped); raises when the file does not load
    (cut short, or not a checkpoint)."""
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError("it holds no Lightning checkpoint")
    return checkpoint


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _loads(path: Path) -> bool:
    try:
        load_metadata(path)
    except Exception:  # missing, torn, foreign: not worth keeping as the one before
        return False
    return True


def newest_loadable(folder: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint in ``folder`` that loads, and its contents (memory-mapped); the ones
    newer than it that do not load are named on stderr and skipped. None when there is no checkpoint;
    a ConfigError when there are some and none loads (they stay: they may be all the run has), or
    when ``folder`` is a symbolic link (a resume reads and writes only the output's own folder)."""
    if folder.is_symlink():
        raise ConfigError(f"--ckpt_path last: {folder} is a symbolic link, expected the run's own folder; "
                          "move the checkpoints into a real folder there, or give one with --ckpt_path FILE")
    found = sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []
    for path in found:
        try:
            return path, load_metadata(path)
        except Exception as error:  # any way a file fails to load: a truncated zip, a foreign file, pickled code
            log.warning("--ckpt_path last: skipping %s, which does not load (%s); trying the one before it",
                        path, _first_line(error))
    if found:
        raise ConfigError(f"--ckpt_path last: none of the {len(found)} checkpoint(s) in {folder} loads (the newest: "
                          f"{found[0].name}); they are left in place: give one with --ckpt_path FILE, or start a "
                          "new run in another output.root")
    return None


def resolve(ckpt_path: str | None, folder: Path) -> tuple[str, dict] | None:
    """The checkpoint to resume from and its contents (memory-mapped, tensors not read), or None.

    ``last``: the newest checkpoint in ``folder`` that loads; a newer one that does not is named on
    stderr and skipped (None when there is none yet: the run starts from the beginning, so the same
    command serves the first start and every restart; refused when there are some and none loads).
    Else the file given, which must load."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        if Path(ckpt_path).is_symlink():
            raise ConfigError(f"--ckpt_path {ckpt_path} is a symbolic link; give the checkpoint file itself")
        if not Path(ckpt_path).is_file():
            raise ConfigError(f"--ckpt_path {ckpt_path} is not a file; give a checkpoint file, or last (the newest "
                              f"in {folder})")
        try:
            return ckpt_path, load_metadata(Path(ckpt_path))
        except Exception as error:  # cut short, or not a checkpoint
            raise ConfigError(f"--ckpt_path {ckpt_path} does not load ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); give another checkpoint, or "
                              f"last (the newest in {folder} that loads)") from None
    found = newest_loadable(folder)
    if found is None:
        log.info("--ckpt_path last: no checkpoint that loads in %s yet; training starts from the beginning", folder)
        return None
    log.info("resuming from %s", found[0])
    return str(found[0]), found[1]


def trained_updates(checkpoint: dict) -> TrainedUpdates:
    """The updates a checkpoint trained, with its history's digests of their tokens (callbacks/history.py),
    for a resumed run on stdin to check them as it reads them again (pipeline/resume.py)."""
    history = next((state for key, state in checkpoint.get("callbacks", {}).items() if key.split("{")[0] == "History"),
                   None)
    if history is None:
        raise ConfigError("the checkpoint holds no per-update history, which a resume on stdin needs to check its "
                          "input: resume it from prepared shards, or start a new run in another output.root")
    columns = history["columns"]
    return TrainedUpdates(int(checkpoint["global_step"]), np.array(columns["update"].numpy()),
                          np.array(columns["tokens_digest"].numpy()))


def fingerprint(cfg, split, input_identity: dict, tokenizer_sha256: str, processes: int) -> dict:
    """What a resume must not change, under the names a user sets them by: the input (``input_identity``:
    shards_identity or stream_identity), every ``optim.*`` key (a checkpoint's optimizer and schedule state
    hold the values it was trained with) and the process count (each rank's share of the rows depends on it)."""
    return {
        "model.vocab_size": cfg.model.vocab_size, "model.n_layer": cfg.model.n_layer,
        "model.n_head": cfg.model.n_head, "model.n_embd": cfg.model.n_embd,
        "model.max_seq_len": cfg.model.max_seq_len,
        **{f"model.{key}": getattr(cfg.model, key)
           for key in ("family", "n_kv_head", "intermediate_size", "rope_theta", "tie_embeddings",
                       "qk_norm")},
        **input_identity,
        "seed": cfg.seed, "trainer.global_batch_size (rows per update)": split.effective,
        "tokens per update": split.effective * cfg.model.max_seq_len,
        "tokenizer (sha256)": tokenizer_sha256,
        **{f"optim.{key}": value for key, value in dataclasses.asdict(cfg.optim).items()
           if key not in unread_optim_keys(cfg.optim, cfg.model.tie_embeddings)},
        "processes (trainer.devices x trainer.num_nodes)": processes,
    }


def shards_identity(cfg, data_fingerprint: str) -> dict:
    """The prepared rows a run from shards reads: where they are and the digest of their index."""
    return {"data.path": cfg.data.path if shards.is_url(cfg.data.path) else os.path.abspath(cfg.data.path),
            "data.path contents (sha256 of its index)": data_fingerprint}


STREAM_KEYS = ("source", "val_path", "val_fraction", "val_max_tokens", "shuffle_buffer_docs", "shuffle_buffer_tokens",
               "max_record_bytes")  # what decides which updates a stream's records make (the records are checked by
#                                    their tokens' digests as they are read again: pipeline/resume.py)


def stream_identity(cfg) -> dict:
    """The settings that turn a stream of records into updates; the records themselves are checked as
    they are read again (pipeline/resume.py)."""
    return {f"data.{key}": getattr(cfg.data, key) for key in STREAM_KEYS}


def unread_optim_keys(optim, tie_embeddings: bool) -> set[str]:
    """The ``optim`` keys this run's optimizer and schedule do not read, which a resume may therefore change (a
    constant schedule has no horizon, so training longer is a resume; a head tied to the embedding has no
    learning rate of its own)."""
    unread = {"constant": {"decay_steps", "decay_fraction", "min_lr_ratio"}, "cosine": {"decay_fraction"},
              "wsd": set()}[optim.schedule]
    if optim.name == "adamw":
        unread |= {key for key in dataclasses.asdict(optim) if key.startswith("muon_")}
    if tie_embeddings:
        unread.add("head_lr")
    return unread


def refuse_changes(path: Path | str, checkpoint: dict, expected: dict) -> None:
    """A ConfigError naming the first key whose value differs from the one ``checkpoint`` stored."""
    stored = checkpoint.get(FINGERPRINT_KEY)
    if stored is None:
        log.warning("%s stores no record of the run's configuration (an older trainer wrote it): the resume "
                    "cannot check that the model, the rows, the seed and the batch are unchanged", path)
        return
    for key, value in expected.items():
        if key in stored and stored[key] != value:
            raise ConfigError(f"cannot resume from {path}: it was trained with {key} {stored[key]!r}, this run has "
                              f"{value!r}; a resume keeps the model, the rows, the seed, the batch, the optimizer "
                              f"settings and the process count: resume with "
                              f"{stored[key]!r}, or start a new run in another output.root")

