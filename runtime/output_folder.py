"""The output folder of one run: held by one run at a time, an earlier run's results set aside (never
deleted), refused where a run must not write, and checked for room before any training.

What a run writes there: ``model/`` (the export and its run record), ``run/`` (metric lines, the
loggers' files, observations, the held-out documents), ``checkpoints/``, and ``data/`` (disposable:
the compile caches). This module names that layout once (``MODEL``... and ``model_folder``...); the
rest of the trainer asks it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pwd
import shutil
from pathlib import Path

from callbacks import owned_folders
from callbacks.export import displaced_exports, unfinished_exports
from config import BUNDLE_ROOT, ConfigError, RunConfig, bundle_path
from runfab import created_files
from runfab.limits import GIB, MIB
from runtime import host_budget

log = logging.getLogger("train")


LOCK_NAME = ".run.lock"


MODEL, RUN, CHECKPOINTS, DATA = "model", "run", "checkpoints", "data"  # the folders a run writes under the root
RUN_FOLDERS = (MODEL, RUN, CHECKPOINTS)  # what one run writes; an earlier run's are set aside, never mixed in
# Never an output root: a run writes model/, run/, checkpoints/ and data/ into it and sets earlier ones aside there.
SYSTEM_FOLDERS = tuple(Path(p) for p in ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64",
                                         "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/usr", "/usr/local",
                                         "/var"))


def model_folder(root: Path | str) -> Path:
    """The export: weights, config, tokenizer, the run record and history (callbacks/export.py)."""
    return Path(root) / MODEL


def run_folder(root: Path | str) -> Path:
    """The metric lines, the loggers' files, the observations and the held-out documents."""
    return Path(root) / RUN


def checkpoint_folder(root: Path | str) -> Path:
    """Lightning's periodic checkpoints and the one a stop writes (runtime/checkpoints.py)."""
    return Path(root) / CHECKPOINTS


def compile_folder(root: Path | str) -> Path:
    """The compile caches (inductor, Triton, FA4): in the output's disposable data/ folder, never /tmp."""
    return Path(root) / DATA / "compile-cache"


@contextlib.contextmanager
def claimed_output(root: Path, keep: tuple[str, ...] = ()):
    """Hold the output folder for one run: a second run on it is refused (its model and metrics
    would mix with this one's), and what an earlier run left in ``model/``, ``run/`` and
    ``checkpoints/`` is moved to ``previous-model/``, ``previous-run/`` and ``previous-checkpoints/``,
    so that those folders only ever hold this run's results, or nothing if this run fails early.

    Only folders a run wrote (owned_folders) are moved: anything else under those names, a link or a
    file, is refused before anything moves, as are the bundle and system folders as a root. The
    staging folders of an export that was killed while writing are removed, at the start and at the end.
    The folders named in ``keep`` stay where they are (a resumed run reads ``checkpoints/``).
    """
    refuse_unsafe_root(root)
    made = [folder for folder in (root, *root.parents) if not folder.exists()]  # removed again if left empty
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = created_files.open_created(root / LOCK_NAME, "a+")
    except created_files.NotCreatedHere as error:  # a planted link: neither written through nor removed
        raise ConfigError(f"the output root's lock file {error}") from None
    except (FileExistsError, NotADirectoryError):
        file = next(p for p in (root, *root.parents) if p.exists() and not p.is_dir())
        where = "is a file" if file == root else f"lies under {file}, which is a file"
        raise ConfigError(f"the output root {root} {where}, not a folder; set RUNFABRIC_OUTPUT (or output.root) "
                          "to a folder") from None
    except OSError as error:
        raise ConfigError(f"cannot write to the output root {root} ({error.strerror}); set RUNFABRIC_OUTPUT "
                          "(or output.root) to a writable folder") from None
    lock_file = os.fstat(lock.fileno())
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            raise ConfigError(f"another run (pid {holder}) is using the output folder {root}; give each run its own "
                              "RUNFABRIC_OUTPUT (or output.root), or wait until it ends") from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        _held[root] = lock_file
        try:
            remove_unfinished_exports(root)  # first: it may put back the model that an earlier run left aside
            moves = [move for name in RUN_FOLDERS if name not in keep for move in _set_aside_plan(root, name)]
            for source, target in moves:
                _move_aside(source, target)
            if moves:
                log.warning("an earlier run's results were moved aside, never deleted: %s",
                            ", ".join(f"{source} -> {target}" for source, target in moves))
            yield
        finally:
            _held.pop(root, None)
            _release(root, lock_file)
            remove_if_empty(made)


# The output roots this process holds, with their lock file: what a process that must end at once releases.
_held: dict[Path, os.stat_result] = {}


def release_now() -> None:
    """For a process about to end at once (a second stop signal), with no ``finally`` to run: remove
    the half-written export and the lock of every output folder it holds, so that neither stays."""
    for root, lock_file in list(_held.items()):
        _release(root, lock_file)


def _release(root: Path, lock_file: os.stat_result) -> None:
    remove_unfinished_exports(root)
    if created_files.is_same_file(root / LOCK_NAME, lock_file):  # never what replaced it meanwhile
        with contextlib.suppress(FileNotFoundError):  # released already, by release_now
            (root / LOCK_NAME).unlink()


def remove_if_empty(folders: list[Path]) -> None:
    """Remove the folders this run created (innermost first) that it left empty: a run that was refused or
    trained nothing leaves no output folder behind."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (or no longer there): kept, and so are the folders above it
            return


def unsafe_folder(folder: Path) -> str | None:
    """What ``folder`` is when no tool may write its own files into it: the bundle itself, a system
    folder or the home folder (``python -m tools prepare`` asks too); None for any other."""
    where = folder.resolve()
    try:
        home = Path(pwd.getpwuid(os.getuid()).pw_dir).resolve()  # the account's, not whatever $HOME says
    except KeyError:
        home = None
    return ("the bundle itself (the folder of train.py)" if where == BUNDLE_ROOT else
            "a system folder" if where in SYSTEM_FOLDERS else "the home folder itself" if where == home else None)


def refuse_unsafe_root(root: Path) -> None:
    """Refuse the bundle itself and system folders as the output root: a run writes its folders there."""
    if (what := unsafe_folder(root)) is not None:
        raise ConfigError(f"the output root {root} is {what}; a run writes model/, run/, checkpoints/ and data/ into "
                          "it: set RUNFABRIC_OUTPUT (or output.root) to a folder of its own")


def remove_unfinished_exports(root: Path) -> None:
    """Remove the half-written staging folders that a run's export left when it was killed; put back the
    previous export that one killed between its two renames left aside (model/ missing), or remove it
    where the new one is in place."""
    model = model_folder(root)
    for staging in unfinished_exports(model):
        if owned_folders.is_marked(staging):
            shutil.rmtree(staging, ignore_errors=True)
    for aside in displaced_exports(model):
        previous = aside / model.name
        if owned_folders.is_marked(previous) and not os.path.lexists(model):
            previous.rename(model)
            log.warning("an export was stopped while replacing %s: the previous model was put back", model)
        if not any(aside.iterdir()) or owned_folders.is_marked(previous):
            shutil.rmtree(aside, ignore_errors=True)


def _set_aside_plan(root: Path, name: str) -> list[tuple[Path, Path]]:
    """The moves that set an earlier run's ``name`` aside as ``previous-name``, and a ``previous-name``
    already there as ``previous-name.N``: it may hold the only copy of a model. Refuses (ConfigError)
    when either is not a folder a run wrote."""
    earlier, previous = root / name, root / f"previous-{name}"
    if not os.path.lexists(earlier):
        return []
    _refuse_unless_owned(earlier)
    moves = []
    if os.path.lexists(previous):
        _refuse_unless_owned(previous)
        suffixes = (p.name.removeprefix(f"{previous.name}.") for p in root.glob(f"{previous.name}.*"))
        older = root / f"{previous.name}.{max((int(s) for s in suffixes if s.isdigit()), default=0) + 1}"
        moves.append((previous, older))
    return [*moves, (earlier, previous)]


def _refuse_unless_owned(path: Path) -> None:
    if owned_folders.is_marked(path):
        return
    what = (f"a symbolic link (to {os.readlink(path)})" if path.is_symlink() else "a file" if not path.is_dir()
            else f"a folder that no run of train.py wrote (it has no {owned_folders.MARK})")
    raise ConfigError(f"{path} is {what}, and a run neither writes into nor moves what a run did not write: move it "
                      "elsewhere, or set RUNFABRIC_OUTPUT (or output.root) to another folder")


def _move_aside(source: Path, target: Path) -> None:
    try:
        source.rename(target)
    except OSError as error:
        raise ConfigError(f"cannot move the earlier run's {source} aside to {target} ({error.strerror}); move or "
                          "remove it yourself, or set RUNFABRIC_OUTPUT (or output.root) to another folder") from None


SMALL_FILES_BYTES = 16 * MIB  # beside the weights: configs, the run record, metric lines, the lock


def check_output_space(cfg: RunConfig, root: Path) -> None:
    """Refuse, before any training, a run whose output the filesystem under ``root`` has no room for,
    rather than fail at the export after all the training."""
    need, observed = host_budget.output_bytes(cfg), host_budget.observation_bytes(cfg)
    tokenizer = bundle_path(cfg.data.tokenizer)
    need += observed + SMALL_FILES_BYTES + (tokenizer.stat().st_size if tokenizer.is_file() else 0)
    free = shutil.disk_usage(root).free
    if free < need:
        raise ConfigError(
            f"the output root {root} has {free / GIB:.2f} GiB free but this run writes about {need / GIB:.2f} GiB "
            f"there (the model export{', two checkpoints' if cfg.trainer.checkpoint_every_steps > 0 else ''}"
            f"{', observation files' if observed else ''}); free some space, or set RUNFABRIC_OUTPUT (or "
            "output.root) to a folder with room")


def check_output_budget(cfg: RunConfig) -> None:
    """Refuse, before any training, a run whose deliverables cannot fit RunFab's output space (output_bytes)."""
    need, observed = host_budget.output_bytes(cfg), host_budget.observation_bytes(cfg)
    if need + observed > cfg.output.budget_bytes:
        raise ConfigError(
            f"the output would need about {(need + observed) / GIB:.2f} GiB (model export"
            f"{', two checkpoints' if cfg.trainer.checkpoint_every_steps > 0 else ''}"
            f"{', observation files' if observed else ''}) but output.budget_bytes allows "
            f"{cfg.output.budget_bytes / GIB:.2f} GiB; disable trainer.checkpoint_every_steps, profile fewer "
            "updates (observe.profile_updates) or shrink the model"
        )
