"""What ships: the one definition of the files that make up the upload bundle.

``python -m tools package`` zips exactly these files, ``python -m tools check`` checks exactly these
when given a folder, and the run record hashes exactly these, so the three never disagree about the bundle.

The list is an allow-list of what training needs, not a deny-list of what it does not, so a new
kind of junk file stays out without anyone having to think of it:

    *.py                    root-level modules (train.py among them)
    callbacks/ model/ pipeline/ runfab/ runtime/ (**/*.py)   the packages train.py imports
    conf/**                 YAML configs and the tokenizer
    data/sample.jsonl       the bundled default sample (small local data, contract section 1)
    requirements.txt  README.md  pyproject.toml
    runfabric.dataset.json  when present: RunFab attaches the dataset it names (contract section 4)

``tools/``, ``tests/`` and ``docs/`` are left out: training never imports or opens them. Within the
allow-list, paths under a cache, test, run-output or virtual-environment folder are skipped all the
same.

In a git checkout only tracked files are candidates (``git ls-files``), read from the working tree,
so local scratch files, copied datasets and an ignored ``.env`` never sneak in. Outside git (an
unpacked bundle, RunFab's /workspace) the tree is walked instead.

Standard library only: the run record imports this at the end of training.
"""

from __future__ import annotations

import os
import re
import subprocess
from fnmatch import fnmatchcase
from pathlib import Path

# Full-path patterns (POSIX, relative to the root) of what training needs; see the module docstring.
ALLOWED = tuple(
    re.compile(pattern)
    for pattern in (
        r"[^/]+\.py",
        r"(?:callbacks|model|pipeline|runfab|runtime)/(?:[^/]+/)*[^/]+\.py",
        r"conf/.+",
        r"data/sample\.jsonl",
        r"requirements\.txt",
        r"README\.md",
        r"pyproject\.toml",
        r"runfabric\.dataset\.json",
    )
)

# Folders whose contents never ship, at any depth, even inside an allowed area.
NEVER_DIRS = frozenset({
    ".git", ".hg", ".svn", "tests", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
    ".ipynb_checkpoints", ".venv", "venv", "output", "dist", "checkpoints", "lightning_logs", "wandb",
})
NEVER_FILE_GLOBS = ("*.pyc", "*.pyo", "*.swp", "*~", ".DS_Store", "Thumbs.db")
VENV_MARKER = "pyvenv.cfg"


def shipped_files(root: Path) -> list[str]:
    """The root-relative POSIX paths of the bundle, sorted: allow-listed, never-rules applied.

    Only selection happens here; the packer refuses unsafe names, links, secrets and sizes afterwards.
    """
    return sorted(rel for rel in candidates(root) if is_allowed(rel) and not is_never(root, rel))


def untracked_matches(root: Path) -> list[str]:
    """Untracked, not ignored files the allow-list would take: in git mode they do not ship."""
    untracked = git_files(root, "--others", "--exclude-standard")
    return sorted(rel for rel in untracked or [] if is_allowed(rel) and not is_never(root, rel))


def is_allowed(rel: str) -> bool:
    """Whether the allow-list takes this root-relative POSIX path."""
    return any(pattern.fullmatch(rel) for pattern in ALLOWED)


def is_never(root: Path, rel: str) -> bool:
    """Whether the path lies in a cache, test, output or virtual-environment folder, or is editor/OS junk."""
    *folders, name = rel.split("/")
    if any(folder in NEVER_DIRS for folder in folders):
        return True
    if any(fnmatchcase(name, glob) for glob in NEVER_FILE_GLOBS):
        return True
    # A virtual environment may have any name; its marker file gives it away.
    return any((root.joinpath(*folders[: depth + 1]) / VENV_MARKER).exists() for depth in range(len(folders)))


def candidates(root: Path) -> list[str]:
    """Tracked files in a git checkout (deleted ones dropped), otherwise every file in the tree."""
    tracked = git_files(root)
    if tracked is None:
        return walk_files(root)
    return [rel for rel in tracked if os.path.lexists(root / rel)]


def source_commit(root: Path) -> dict | None:
    """The checkout's commit and the shipped files that differ from it, as the lab records "which
    implementation ran"; None outside a checkout (an unpacked bundle): sources_sha256 says it there."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, check=True,
                                text=True).stdout.strip()
        # --relative: paths from the root, as ls-files gives them, also when the root is a subfolder of the checkout
        changed = subprocess.run(["git", "-C", str(root), "diff", "--name-only", "--relative", "-z", "HEAD"],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    shipped = set(shipped_files(root))
    return {"commit": commit,
            "uncommitted_changes": sorted(n for n in map(os.fsdecode, changed.split(b"\0")) if n in shipped)}


def git_files(root: Path, *extra: str) -> list[str] | None:
    """`git ls-files` under the root (tracked files, or others with `extra` flags); None outside a checkout.

    -z keeps names byte-exact (no quoting), so odd names reach the packer's path checks instead of being mangled.
    """
    try:
        listing = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", *extra], capture_output=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [os.fsdecode(name) for name in listing.split(b"\0") if name]


def walk_files(root: Path) -> list[str]:
    """Every file and symlink under the root, without descending into never-shipped folders.

    Symlinked folders are returned as entries rather than followed, so the packer's link checks judge them.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        prefix = here.relative_to(root).parts
        kept = []
        for name in dirnames:
            if (here / name).is_symlink():
                filenames.append(name)
            elif name not in NEVER_DIRS and not (here / name / VENV_MARKER).exists():
                kept.append(name)
        dirnames[:] = kept
        found.extend("/".join((*prefix, name)) for name in filenames)
    return found


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under path (links not followed): what a size budget charges."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
