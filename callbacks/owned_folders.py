"""The folders a run writes into the output root carry a mark, so that a later run on the same root
moves aside only what a run of this trainer made, never a folder or file that someone else put there.

``model/`` is marked while its export is staged (callbacks/export.py), so it never exists unmarked;
``run/`` and ``checkpoints/`` are marked as training starts, on global rank 0.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from runfab import created_files

MARK = ".train-py-output"
MARK_TEXT = ("train.py wrote this folder. A later run on the same output root moves it aside (previous-NAME/) "
             "instead of mixing its results in; a folder without this file is never moved.\n")


def mark(folder: Path) -> None:
    """Create ``folder`` if needed and mark it as written by a run."""
    folder.mkdir(parents=True, exist_ok=True)
    created_files.write_text(folder / MARK, MARK_TEXT)


def is_marked(path: Path) -> bool:
    """Whether ``path`` is a folder (not a link to one) that a run wrote."""
    return not path.is_symlink() and (path / MARK).is_file()


class MarkRunFolders(L.Callback):
    """Marks the run's folders other than model/ as training starts (they are written from then on)."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            for folder in self.folders:
                mark(folder)
