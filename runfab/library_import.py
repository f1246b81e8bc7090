"""Importing Lightning in a hook's process without leaving behind what the import writes.

A probe writes nothing and a run writes only under its output, but importing Lightning writes twice:
torchmetrics imports matplotlib where it is installed (RunFab's image has it), which writes a font cache
into HOME (or MPLCONFIGDIR), and torch's compiler makes its default cache folder,
TMPDIR/torchinductor_<user>, and names it in TORCHINDUCTOR_CACHE_DIR. ``import_lightning`` gives
matplotlib a temporary folder for the import and removes it afterwards (nothing reads that cache
again), removes the compiler's folder when the import created it and left it empty, and leaves
both variables as it found them, so that the processes a run starts do the same for themselves. A
compiling run names its own cache folders later (runtime/device_policy.prepare_compile).

A SIGTERM or SIGINT during the import ends the process as it would have, after that cleanup.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from runfab.lifetime import on_stop_signals

MATPLOTLIB_ENV = "MPLCONFIGDIR"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_DEFAULT_PREFIX = "torchinductor_"  # torch's default cache folder in the temp folder: torchinductor_<user>


def import_lightning() -> None:
    """Import ``lightning`` (and torch with it) once, leaving no file or folder behind."""
    if "lightning" in sys.modules:
        return
    residue = ImportResidue()

    def stop(signum, frame) -> None:  # clean up, then let the signal do what it did before
        residue.remove()
        restore()
        signal.raise_signal(signum)

    restore = on_stop_signals(stop)
    try:
        residue.begin()
        importlib.import_module("lightning")
    finally:
        restore()
        residue.remove()


class ImportResidue:
    """What one import of Lightning writes outside the output, and its removal."""

    def __init__(self) -> None:
        self.matplotlib_folder: str | None = None
        self.inductor_named = INDUCTOR_ENV in os.environ
        self.temp = Path(tempfile.gettempdir())
        self.inductor_before: set[Path] = set()

    def begin(self) -> None:
        if MATPLOTLIB_ENV not in os.environ:
            self.matplotlib_folder = tempfile.mkdtemp(prefix="trainer-matplotlib-")
            os.environ[MATPLOTLIB_ENV] = self.matplotlib_folder
        if not self.inductor_named:
            self.inductor_before = {p.absolute() for p in self.temp.glob(f"{INDUCTOR_DEFAULT_PREFIX}*")}

    def remove(self) -> None:
        """Remove what the import wrote (safe to call twice)."""
        if self.matplotlib_folder is not None:
            shutil.rmtree(self.matplotlib_folder, ignore_errors=True)
            if os.environ.get(MATPLOTLIB_ENV) == self.matplotlib_folder:
                del os.environ[MATPLOTLIB_ENV]
            self.matplotlib_folder = None
        if self.inductor_named:
            return
        named = os.environ.pop(INDUCTOR_ENV, None)  # the import named its default: the environment is as it was
        if named is not None and Path(named).absolute() not in self.inductor_before:
            with contextlib.suppress(OSError):  # not empty: a cache in use by another process
                Path(named).rmdir()
