"""Where and how the checked bundle runs: an unpacked, read-only copy and empty folders around it,
each child a fresh interpreter in a session of its own, watched from outside.

``BundleSource`` is what would be uploaded: a ZIP's members, or the files a directory would ship
(``runfab.shipping.shipped_files``, exactly what ``python -m tools package`` packs). ``Sandbox`` is
one child's world; ``run_child`` starts ``child.py`` in it, feeds stdin, enforces the time limit
and kills whatever the child left behind. Emulate and the end-to-end tests use the same sandbox.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from runfab.shipping import git_files, shipped_files
from tools import processes
from tools.bundle import child
from runfab.hooks import BATCH_NAME, HOOKS

STDIN_PAYLOAD_BYTES = 256 * 1024  # several pipe buffers, so even a partial read shows

# Variables that would send a child's cache writes outside the folders this checker inspects, or let
# it import code that is not in the bundle. Without them, caches fall back to HOME or TMPDIR.
DROPPED_ENV = (
    "PYTHONPATH", "PYTHONSTARTUP", "PYTHONPYCACHEPREFIX",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH",
)

# The child is `python -c CHILD_BOOTSTRAP child.py <spec.json>`: with -c, sys.path[0] is the (empty)
# working directory rather than this project's root, so the bundle under test can never import this
# project's modules by accident. child_main then puts the bundle first on sys.path.
CHILD_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('runfab_contract_child', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "sys.exit(module.child_main(sys.argv[2]))\n"
)


class UsageError(Exception):
    """The command line names something that cannot be checked or run; exit status 2."""


# ----------------------------------------------------------------------------- the bundle


@dataclass
class BundleSource:
    """What would be uploaded: the member files of a ZIP, or the files a directory would ship."""

    path: Path
    kind: str  # "zip" or "directory"
    files: list[str]  # POSIX paths relative to the bundle root
    expanded_bytes: int
    packed_bytes: int | None = None  # the ZIP's own size
    unsafe: list[str] = field(default_factory=list)  # ZIP members that would land outside the root
    selection: str = ""  # how a directory's files were chosen
    members: dict[str, str] = field(default_factory=dict)  # a ZIP's normalized path -> its member name ("./x")

    @classmethod
    def open(cls, path: Path) -> BundleSource:
        if path.is_dir():
            files, selection = directory_files(path)
            size = sum((path / rel).stat().st_size for rel in files)
            return cls(path, "directory", files, size, selection=selection)
        if path.is_file():
            if not zipfile.is_zipfile(path):
                raise UsageError(f"{path} is neither a directory nor a ZIP archive")
            with zipfile.ZipFile(path) as archive:
                infos = [info for info in archive.infolist() if not info.is_dir()]
            unsafe = [info.filename for info in infos if not is_safe_member(info.filename)]
            members = {PurePosixPath(info.filename).as_posix(): info.filename
                       for info in infos if is_safe_member(info.filename)}
            return cls(path, "zip", sorted(members), sum(info.file_size for info in infos),
                       packed_bytes=path.stat().st_size, unsafe=unsafe, members=members)
        raise UsageError(f"{path} does not exist")

    def unpack_into(self, dest: Path) -> None:
        dest.mkdir(parents=True)
        if self.kind == "zip":
            with zipfile.ZipFile(self.path) as archive:
                for rel in self.files:
                    target = dest / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(self.members[rel]) as src, target.open("wb") as dst:
                        shutil.copyfileobj(src, dst)
        else:
            for rel in self.files:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.path / rel, target)


def is_safe_member(name: str) -> bool:
    """A member whose path stays inside the folder it is unpacked into."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return bool(parts) and not name.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0]


def directory_files(root: Path) -> tuple[list[str], str]:
    """The files a directory would ship: exactly what ``python -m tools package`` would pack from it."""
    files = [rel for rel in shipped_files(root) if (root / rel).is_file()]
    listing = "git ls-files, tracked files" if git_files(root) is not None else "every file in the tree"
    return files, f"what `python -m tools package` would ship: the allow-list over {listing}"


def set_writable(root: Path, writable: bool) -> None:
    """chmod the whole tree u+w (to clean up) or a-w (like RunFab's read-only /workspace)."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


# ----------------------------------------------------------------------------- running a child


class Sandbox:
    """One child's world: the read-only unpacked bundle and the empty folders it may or must not write to.

    Each child gets a fresh one, so what the probe run finds is not confused with the import run.
    """

    def __init__(self, source: BundleSource, keep: bool, base: Path | None = None, prepare=None) -> None:
        """``base``: an empty folder to build in (default: a new temporary one); ``prepare(bundle)``
        adds files to the unpacked bundle before it is made read-only (the tests add configs)."""
        self.keep = keep
        self.base = Path(base) if base is not None else Path(tempfile.mkdtemp(prefix="runfab-check-"))
        self.bundle = self.base / "workspace"
        self.cwd, self.output = self.base / "cwd", self.base / "output"
        self.home, self.tmp = self.base / "home", self.base / "tmp"
        self.control = self.base / "control"  # spec, reports and captured streams: outside every inspected folder
        source.unpack_into(self.bundle)
        if prepare is not None:
            prepare(self.bundle)
        for folder in (self.cwd, self.output, self.home, self.tmp, self.control):
            folder.mkdir()
        set_writable(self.bundle, False)
        self.roots = {"bundle": str(self.bundle), "cwd": str(self.cwd), "output": str(self.output),
                      "HOME": str(self.home), "TMPDIR": str(self.tmp)}

    def env(self, cuda: bool) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in DROPPED_ENV}
        env.update(RUNFABRIC_OUTPUT=str(self.output), HOME=str(self.home), TMPDIR=str(self.tmp), TMP=str(self.tmp),
                   TEMP=str(self.tmp), PYTHONDONTWRITEBYTECODE="1")
        if not cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        set_writable(self.bundle, True)
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class ChildRun:
    """What one child did, as seen from both sides."""

    returncode: int
    timed_out: bool
    wall_seconds: float
    timeout: float
    report: dict | None
    boundary: dict | None
    stdout: bytes
    stderr: str
    before: dict
    after: dict
    survivors: list[str]
    payload: bytes

    def stderr_tail(self, lines: int = 3) -> str:
        tail = [line for line in self.stderr.strip().splitlines() if line.strip()][-lines:]
        return " | ".join(tail)[-400:] if tail else "(no stderr)"

    @property
    def stdin_intact(self) -> bool | None:
        if not self.report or "stdin_bytes" not in self.report:
            return None
        return self.report["stdin_sha256"] == hashlib.sha256(self.payload).hexdigest()

    def stdin_problem(self, who: str) -> str:
        left = self.report["stdin_bytes"]
        return (f"{who} consumed stdin: {len(self.payload) - left if left <= len(self.payload) else '?'} of "
                f"{len(self.payload)} bytes were gone when train() would start (only train() may read stdin)")


def run_child(sandbox: Sandbox, mode: str, cuda: bool, microbatch: int, timeout: float) -> ChildRun:
    """Start child.py in a fresh interpreter in ``sandbox`` (``mode`` "import", or "probe" with
    ``microbatch``), feed stdin, wait at most ``timeout`` seconds, then clean up.

    The child leads a new session, so everything it started can be found (and killed) by process
    group afterwards. Its streams go to files rather than pipes: a leftover grandchild holding a
    pipe open would otherwise keep this side waiting for end-of-file.
    """
    spec_path = sandbox.control / f"{mode}.spec.json"
    report_path, boundary_path = sandbox.control / f"{mode}.report.json", sandbox.control / f"{mode}.boundary.json"
    spec_path.write_text(json.dumps({
        "bundle": str(sandbox.bundle), "mode": mode, "microbatch": microbatch, "roots": sandbox.roots,
        "report": str(report_path), "boundary": str(boundary_path), "batch_name": BATCH_NAME, "hooks": list(HOOKS),
    }))
    stdout_path, stderr_path = sandbox.control / f"{mode}.stdout", sandbox.control / f"{mode}.stderr"
    payload = stdin_payload()
    before = child.snapshot(sandbox.roots)
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        started = time.monotonic()
        process = processes.start(
            [sys.executable, "-B", "-c", CHILD_BOOTSTRAP, str(Path(child.__file__).resolve()), str(spec_path)],
            cwd=sandbox.cwd, env=sandbox.env(cuda), stdin=subprocess.PIPE, stdout=out, stderr=err,
            start_new_session=True,
        )
    feeder = threading.Thread(target=feed, args=(process.stdin, [payload]), daemon=True)
    feeder.start()
    timed_out = False
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        processes.kill_group(process.pid)
        process.wait()
    wall = time.monotonic() - started
    survivors = [] if timed_out else processes.group_members(process.pid)
    processes.kill_group(process.pid)  # nothing the child started outlives the check
    feeder.join(5)
    after = child.snapshot(sandbox.roots)
    return ChildRun(
        returncode=process.returncode, timed_out=timed_out, wall_seconds=wall, timeout=timeout,
        report=load_json(report_path), boundary=load_json(boundary_path), stdout=stdout_path.read_bytes(),
        stderr=stderr_path.read_text(errors="replace"), before=before, after=after, survivors=survivors,
        payload=payload,
    )


def feed(pipe, chunks: Iterable[bytes]) -> None:
    """Write the records and close stdin, as a finite source would; a child that exits early just ends it."""
    try:
        for chunk in chunks:
            pipe.write(chunk)
    except (OSError, ValueError):  # BrokenPipeError: the child stopped reading
        pass
    finally:
        try:
            pipe.close()
        except (OSError, ValueError):
            pass


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stdin_payload() -> bytes:
    """Plausible NDJSON training records: what RunFab streams into train(), and must not be read earlier."""
    lines, size, index = [], 0, 0
    while size < STDIN_PAYLOAD_BYTES:
        line = json.dumps({"text": f"record {index}: bytes a probe or an import must leave for train()", "id": index})
        lines.append(line.encode() + b"\n")
        size += len(lines[-1])
        index += 1
    return b"".join(lines)
