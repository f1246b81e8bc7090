"""``python -m tools check [BUNDLE.zip | DIR]``: check a bundle against the RunFab contract before uploading.

RunFab imports ``train.py`` from a read-only ``/workspace`` and runs each memory probe in a fresh
subprocess with a 120-second limit; a bundle that reads stdin, prints, writes files or leaves
processes at those moments breaks a run in ways that are hard to diagnose from the platform's side.
This command reproduces those moments locally, each in a fresh interpreter (``sys.executable``)
whose every possible side effect lands somewhere it can be inspected afterwards:

- the bundle is unpacked (a ZIP) or copied (a directory) into a temporary folder and made read-only;
- the working directory, ``RUNFABRIC_OUTPUT``, ``HOME`` and ``TMPDIR`` are empty temporary folders;
- stdin is a pipe carrying NDJSON records, which the child reads back from fd 0 afterwards: any
  byte missing was consumed (Python's buffered ``sys.stdin`` takes a whole chunk for one line);
- stdout goes to a file that must stay empty (RunFab reads metric lines from it);
- ``CUDA_VISIBLE_DEVICES=""`` hides GPUs unless ``--cuda`` is given, and ``PYTHONDONTWRITEBYTECODE=1``
  keeps the interpreter's own byte-code cache from counting as a write into the bundle (running as
  root, a read-only folder still accepts writes, so writes are found by comparing snapshots).

Checks, in order: ``layout`` (train.py at the root), ``archive`` (RunFab's size limits),
``batch`` (a literal ``EFFECTIVE_BATCH_SIZE`` in 1..65536, divisible by the GPU count), ``hooks``
(``probe_batch(microbatch)`` and ``train(microbatch, accumulation)``), ``import`` (quick and
side-effect free) and ``probe`` (one ``probe_batch`` call as RunFab makes it). Exit status 0 when
every check passes, 1 otherwise, 2 for a usage error.

Environment variables other than the ones above pass through to the children, so a project's
own switches work: this project reads ``RUNFAB_CONFIG``. On a machine without a GPU, check with the
small config, ``RUNFAB_CONFIG=conf/smoke.yaml python -m tools check``; the reference model of
``conf/config.yaml`` probed on a CPU can take longer than RunFab's 120 s although it fits a GPU easily.

A directory is checked as the files ``python -m tools package`` would ship from it
(``shipping.shipped_files``), so checking the project checks what the ZIP would hold.

The checker runs the bundle's code in child processes only; this module imports nothing but the
standard library at the top, because the children load it too (to share the snapshot code) and it
must not import anything before ``train`` does. The project's own modules (RunFab's limits, what
ships) are imported inside the functions that need them, which run in this process only.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import hashlib
import importlib
import inspect
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TextIO

PROJECT_ROOT = Path(__file__).resolve().parent.parent

BATCH_NAME = "EFFECTIVE_BATCH_SIZE"
BATCH_MIN, BATCH_MAX = 1, 65536
HOOKS = {"probe_batch": ["microbatch"], "train": ["microbatch", "accumulation"]}

DEFAULT_IMPORT_LIMIT = 60.0
IMPORT_GRACE = 10.0  # on top of the import limit: interpreter start-up and the checks after the import
STDIN_PAYLOAD_BYTES = 256 * 1024  # several pipe buffers, so even a partial read shows
QUICK_PROBE_SECONDS = 0.1

# Variables that would send a child's cache writes outside the folders this checker inspects, or let
# it import code that is not in the bundle. Without them, caches fall back to HOME or TMPDIR.
DROPPED_ENV = (
    "PYTHONPATH", "PYTHONSTARTUP", "PYTHONPYCACHEPREFIX",
    "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "MPLCONFIGDIR",
)

# The child is `python -c CHILD_BOOTSTRAP <this file> <spec.json>`: with -c, sys.path[0] is the
# (empty) working directory rather than this project's root, so the bundle under test can never
# import this project's modules by accident. child_main then puts the bundle first on sys.path.
CHILD_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('runfab_contract_child', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "sys.exit(module.child_main(sys.argv[2]))\n"
)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class UsageError(Exception):
    """The command line names something that cannot be checked; exit status 2."""


@dataclass
class Result:
    """One check's verdict. ``reason`` is the one line a user needs; ``notes`` are details worth knowing."""

    key: str
    verdict: str
    reason: str
    notes: list[str] = field(default_factory=list)
    seconds: float | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == PASS


@dataclass
class Options:
    gpus: int | None = None  # None: the GPUs visible on this machine (1 when none)
    microbatch: int | None = None  # None: 1, which divides every effective batch
    import_limit: float = DEFAULT_IMPORT_LIMIT
    probe_limit: float | None = None  # None: RunFab's (runfab_limits.PROBE_SECONDS)
    cuda: bool = False  # keep the caller's CUDA_VISIBLE_DEVICES in the children
    keep: bool = False  # leave the temporary folders for inspection


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
    from runtime.shipping import git_files, shipped_files

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


# ----------------------------------------------------------------------------- snapshots and processes


def snapshot(roots: dict[str, str]) -> dict[str, dict[str, list]]:
    """Every entry under each root: kind ("d", "f" or "l"), size and modification time.

    Comparing two snapshots finds writes even where permissions do not stop them (root ignores a-w).
    """
    result: dict[str, dict[str, list]] = {}
    for label, root in roots.items():
        entries: dict[str, list] = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                kind = "d" if stat.S_ISDIR(st.st_mode) else "l" if stat.S_ISLNK(st.st_mode) else "f"
                entries[os.path.relpath(path, root).replace(os.sep, "/")] = [kind, st.st_size if kind == "f" else 0,
                                                                             st.st_mtime_ns]
        result[label] = entries
    return result


def compare_snapshots(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """(files created, modified or removed; folders created that hold no files).

    Empty folders are reported apart: importing torch creates an empty ``TMPDIR/torchinductor_<user>``
    by itself, which costs nothing and is no doing of the bundle.
    """
    changes, empty_dirs = [], []
    for label, now in after.items():
        then = before.get(label, {})
        for rel, entry in now.items():
            old = then.get(rel)
            if entry[0] == "d":
                if old is None and not any(k.startswith(rel + "/") and v[0] != "d" for k, v in now.items()):
                    empty_dirs.append(f"{label}/{rel}")
            elif old is None:
                changes.append(f"created {label}/{rel}")
            elif old != entry:
                changes.append(f"modified {label}/{rel}")
        changes += [f"removed {label}/{rel}" for rel, entry in then.items() if entry[0] != "d" and rel not in now]
    return changes, empty_dirs


def process_table() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, process group, state letter, command line), read from /proc (Linux)."""
    table = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return table
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()  # the command name in parentheses may contain spaces
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0], cmdline or name)
    return table


def process_family(pid: int) -> set[int]:
    """A process and all its descendants, from one snapshot of the process table."""
    table = process_table()
    family, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, (ppid, *_rest) in table.items() if ppid == parent and child not in family]
        family.update(children)
        frontier.extend(children)
    return family


def live_descendants() -> list[str]:
    """This process's running descendants (zombies excluded: they have already finished), as "pid command"."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
            except psutil.Error:
                continue
        return found
    table = process_table()
    family, found = {os.getpid()}, []
    grew = True
    while grew:  # parents may have higher pids than children, so repeat until nothing joins
        grew = False
        for pid, (ppid, _, state, cmdline) in table.items():
            if ppid in family and pid not in family:
                family.add(pid)
                grew = True
                if state != "Z":
                    found.append(f"{pid} {cmdline[:120]}")
    return found


def group_survivors(pgid: int) -> list[str]:
    """Processes still running in the child's process group after the child itself exited."""
    return [f"{pid} {cmdline[:120]}" for pid, (_, group, state, cmdline) in sorted(process_table().items())
            if group == pgid and state != "Z"]


def new_processes(entries: list[str], exclude: list[str]) -> list[str]:
    """``entries`` ("pid command", seen from inside the child and from outside) once per pid, less ``exclude``."""
    seen = {int(entry.split()[0]) for entry in exclude}
    unique = []
    for entry in entries:
        pid = int(entry.split()[0])
        if pid not in seen:
            seen.add(pid)
            unique.append(entry)
    return unique


PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def dies_with_parent():
    """A ``preexec_fn`` that has the kernel SIGKILL the child when this process ends, however it ends.

    The tools start their children in sessions of their own, so neither a terminal's Ctrl-C nor a
    killed tool reaches them; without this a probe or a training run keeps the machine's memory
    under PID 1. (launcher.exit_with_parent does the same from inside the trainer's own workers; a
    tool's children run commands the tool does not write.) The signal comes when the thread that
    started the child ends, so start children from the main thread. None where prctl is missing
    (not Linux): the children then outlive a killed tool, as before.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stdin_payload() -> bytes:
    """Plausible NDJSON training records: what RunFab streams into train(), and must not be read earlier."""
    lines, size, index = [], 0, 0
    while size < STDIN_PAYLOAD_BYTES:
        line = json.dumps({"text": f"record {index}: bytes a probe or an import must leave for train()", "id": index})
        lines.append(line.encode() + b"\n")
        size += len(lines[-1])
        index += 1
    return b"".join(lines)


# ----------------------------------------------------------------------------- the child side


def child_main(spec_path: str) -> int:
    """Runs in the fresh interpreter: import ``train`` as RunFab does, maybe probe, and report.

    The report goes to a file outside every inspected folder, never to stdout, which must stay
    empty. In probe mode a second file marks the moment between import and probe, so writes and
    output can be attributed to the one or the other even when the probe is killed at the limit.
    """
    spec = json.loads(Path(spec_path).read_text())
    sys.path[0] = spec["bundle"]
    sys.argv = ["-c"]  # what `python -c "import train"` would show the bundle
    report: dict = {}

    def save(key: str, data: dict) -> None:
        Path(spec[key]).write_text(json.dumps(data))

    started = time.perf_counter()
    try:
        train = importlib.import_module("train")
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: RunFab's import would fail just the same
        report["import_seconds"] = time.perf_counter() - started
        report["import_error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        save("report", report)
        return 1
    report["import_seconds"] = time.perf_counter() - started
    report["batch"] = {"found": hasattr(train, BATCH_NAME), "repr": repr(getattr(train, BATCH_NAME, None))[:80]}
    report["hooks"] = {name: describe_hook(train, name) for name in HOOKS}
    if spec["mode"] == "import":
        torch = sys.modules.get("torch")
        report["cuda_initialized"] = None if torch is None else bool(torch.cuda.is_initialized())
        report["children"] = live_descendants()
    else:
        sys.stdout.flush()
        save("boundary", {"import_seconds": report["import_seconds"], "stdout_bytes": os.fstat(1).st_size,
                          "children": live_descendants(), "snapshot": snapshot(spec["roots"])})
        started = time.perf_counter()
        try:
            report["probe_returned"] = repr(train.probe_batch(spec["microbatch"]))[:200]
        except BaseException as error:
            report["probe_error"] = "".join(traceback.format_exception_only(type(error), error)).strip()[:1000]
            report["probe_error_type"] = type(error).__name__
        report["probe_seconds"] = time.perf_counter() - started
        report["children"] = live_descendants()
    data = read_fd0()
    report["stdin_bytes"] = len(data)
    report["stdin_sha256"] = hashlib.sha256(data).hexdigest()
    sys.stdout.flush()
    save("report", report)
    return 0


def describe_hook(module, name: str) -> dict:
    hook = getattr(module, name, None)
    if hook is None:
        return {"found": False}
    if not callable(hook):
        return {"found": True, "callable": False, "type": type(hook).__name__}
    try:
        return {"found": True, "callable": True, "params": signature_text(inspect.signature(hook))}
    except (TypeError, ValueError) as error:
        return {"found": True, "callable": True, "error": str(error)}


def signature_text(signature: inspect.Signature) -> list[str]:
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [marks.get(p.kind, "") + p.name for p in signature.parameters.values()]


def read_fd0() -> bytes:
    """Everything left on stdin, read from fd 0 itself: bytes that sys.stdin buffered are gone from here."""
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


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


def run_child(sandbox: Sandbox, mode: str, options: Options, microbatch: int, timeout: float) -> ChildRun:
    """Start a fresh interpreter in ``sandbox``, feed stdin, wait at most ``timeout`` seconds, then clean up.

    The child leads a new session, so everything it started can be found (and killed) by process
    group afterwards. Its streams go to files rather than pipes: a leftover grandchild holding a
    pipe open would otherwise keep this side waiting for end-of-file.
    """
    spec_path = sandbox.control / f"{mode}.spec.json"
    report_path, boundary_path = sandbox.control / f"{mode}.report.json", sandbox.control / f"{mode}.boundary.json"
    spec_path.write_text(json.dumps({
        "bundle": str(sandbox.bundle), "mode": mode, "microbatch": microbatch, "roots": sandbox.roots,
        "report": str(report_path), "boundary": str(boundary_path),
    }))
    stdout_path, stderr_path = sandbox.control / f"{mode}.stdout", sandbox.control / f"{mode}.stderr"
    payload = stdin_payload()
    before = snapshot(sandbox.roots)
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        started = time.monotonic()
        child = subprocess.Popen(
            [sys.executable, "-B", "-c", CHILD_BOOTSTRAP, str(Path(__file__).resolve()), str(spec_path)],
            cwd=sandbox.cwd, env=sandbox.env(options.cuda), stdin=subprocess.PIPE, stdout=out, stderr=err,
            start_new_session=True, preexec_fn=dies_with_parent(),
        )
    feeder = threading.Thread(target=feed, args=(child.stdin, payload), daemon=True)
    feeder.start()
    timed_out = False
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(child.pid)
        child.wait()
    wall = time.monotonic() - started
    survivors = [] if timed_out else group_survivors(child.pid)
    kill_group(child.pid)  # nothing the child started outlives the check
    feeder.join(5)
    after = snapshot(sandbox.roots)
    return ChildRun(
        returncode=child.returncode, timed_out=timed_out, wall_seconds=wall, timeout=timeout,
        report=load_json(report_path), boundary=load_json(boundary_path), stdout=stdout_path.read_bytes(),
        stderr=stderr_path.read_text(errors="replace"), before=before, after=after, survivors=survivors,
        payload=payload,
    )


def feed(pipe, payload: bytes) -> None:
    """Write the records and close stdin, as a finite source would; a child that exits early just ends it."""
    try:
        pipe.write(payload)
        pipe.close()
    except (BrokenPipeError, OSError, ValueError):
        pass


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- static checks


def check_layout(source: BundleSource) -> Result:
    if "train.py" in source.files:
        return Result("layout", PASS, "train.py is at the bundle root")
    nested = sorted(rel for rel in source.files if rel.endswith("/train.py") and rel.count("/") == 1)
    hint = (f"; found {nested[0]}: pack the folder's contents, not the folder" if nested else "")
    return Result("layout", FAIL, f"no train.py at the bundle root{hint}")


def check_archive(source: BundleSource) -> Result:
    from runtime.runfab_limits import EXPANDED_BYTES as EXPANDED_LIMIT, ZIP_BYTES as ZIP_LIMIT

    problems, facts = [], [f"{size_text(source.expanded_bytes)} expanded (limit {size_text(EXPANDED_LIMIT)})"]
    if source.expanded_bytes > EXPANDED_LIMIT:
        problems.append(f"expands to {size_text(source.expanded_bytes)}, over RunFab's {size_text(EXPANDED_LIMIT)}")
    if source.packed_bytes is not None:
        facts.insert(0, f"ZIP {size_text(source.packed_bytes)} (limit {size_text(ZIP_LIMIT)})")
        if source.packed_bytes > ZIP_LIMIT:
            problems.append(f"the ZIP is {size_text(source.packed_bytes)}, over RunFab's {size_text(ZIP_LIMIT)}")
    if source.unsafe:
        problems.append(f"members that would unpack outside the bundle root: {listing(source.unsafe)}")
    notes = [] if source.kind == "zip" else [
        f"a directory has no compressed size; check the ZIP to test the {size_text(ZIP_LIMIT)} limit"]
    if problems:
        return Result("archive", FAIL, "; ".join(problems), notes)
    return Result("archive", PASS, "; ".join(facts), notes)


def parse_train(bundle: Path) -> tuple[ast.Module | None, str | None]:
    try:
        source = (bundle / "train.py").read_text(encoding="utf-8")
        return ast.parse(source, filename="train.py"), None
    except SyntaxError as error:
        return None, f"train.py does not parse: line {error.lineno}: {error.msg}"
    except (OSError, UnicodeDecodeError) as error:
        return None, f"train.py cannot be read: {error}"


def batch_literal(tree: ast.Module) -> tuple[int | None, str]:
    """The value of the one module-level ``EFFECTIVE_BATCH_SIZE = <int>``, or None and why not.

    RunFab reads the number from the source, so it has to be written out: a computed value, an
    annotation, a second binding or a ``global`` rebinding in a function all fail here.
    """
    top_level = [node for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == BATCH_NAME for t in node.targets)]
    others = [node for node in ast.walk(tree) if binds_batch(node) and node not in top_level]
    if not top_level:
        if others:
            return None, (f"{BATCH_NAME} is only bound as `{ast.unparse(others[0]).splitlines()[0]}` (line "
                          f"{others[0].lineno}); write a plain module-level `{BATCH_NAME} = 32`")
        return None, f"no module-level `{BATCH_NAME} = <integer>` in train.py"
    if len(top_level) > 1 or others:
        lines = sorted(node.lineno for node in top_level + others)
        return None, (f"{BATCH_NAME} is bound more than once (lines {', '.join(map(str, lines))}); "
                      f"assign it once, literally")
    node = top_level[0]
    value = node.value
    if isinstance(value, ast.Constant) and type(value.value) is int:
        return value.value, f"line {node.lineno}"
    written = ast.unparse(value)
    if isinstance(value, ast.Constant):
        return None, f"{BATCH_NAME} = {written} is a {type(value.value).__name__}, not an integer literal"
    return None, f"{BATCH_NAME} = {written} is computed (line {node.lineno}); write the number itself"


def binds_batch(node: ast.AST) -> bool:
    if isinstance(node, ast.Global | ast.Nonlocal):
        return BATCH_NAME in node.names
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == BATCH_NAME
    if isinstance(node, ast.Assign):
        return any(isinstance(n, ast.Name) and n.id == BATCH_NAME for t in node.targets for n in ast.walk(t))
    if isinstance(node, ast.NamedExpr):
        return node.target.id == BATCH_NAME
    if isinstance(node, ast.alias):
        return (node.asname or node.name) == BATCH_NAME
    return False


def check_batch(tree: ast.Module | None, parse_error: str | None, gpus: int, gpus_from: str,
                child: ChildRun | None) -> Result:
    if tree is None:
        return Result("batch", FAIL, parse_error or "train.py cannot be read")
    value, where = batch_literal(tree)
    if value is None:
        return Result("batch", FAIL, where)
    problems = []
    if not BATCH_MIN <= value <= BATCH_MAX:
        problems.append(f"{BATCH_NAME} = {value} is outside {BATCH_MIN}..{BATCH_MAX}")
    elif value % gpus:
        problems.append(f"{BATCH_NAME} = {value} is not divisible by {gpus} GPU(s) ({gpus_from})")
    reported = (child.report or {}).get("batch") if child else None
    if reported and reported["found"] and reported["repr"] != repr(value):
        problems.append(f"the source says {value} but after import train.{BATCH_NAME} is {reported['repr']}")
    if problems:
        return Result("batch", FAIL, "; ".join(problems))
    return Result("batch", PASS, f"{BATCH_NAME} = {value} ({where}), an integer literal divisible by "
                                 f"{gpus} GPU(s) ({gpus_from})")


def check_hooks(tree: ast.Module | None, parse_error: str | None, child: ChildRun | None) -> Result:
    """Both hooks as module-level ``def`` statements with exactly the contract's parameters, and the same
    after import (a decorator or a later rebinding could change what RunFab actually calls)."""
    if tree is None:
        return Result("hooks", FAIL, parse_error or "train.py cannot be read")
    problems = []
    for name, expected in HOOKS.items():
        defs = [node for node in tree.body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name]
        if not defs:
            problems.append(f"no module-level `def {name}({', '.join(expected)})`")
            continue
        node = defs[-1]
        if isinstance(node, ast.AsyncFunctionDef):
            problems.append(f"{name} is `async def`; RunFab calls it as a plain function")
        found = ast_parameters(node.args)
        if found != expected:
            problems.append(f"{name}({', '.join(found)}) at line {node.lineno}; expected {name}({', '.join(expected)})")
    if problems:
        return Result("hooks", FAIL, "; ".join(problems))
    report = child.report if child else None
    if not report or "hooks" not in report:
        return Result("hooks", SKIP, "the source is right, but the signatures after import could not be checked: "
                                     "train.py did not import (see import)")
    for name, expected in HOOKS.items():
        seen = report["hooks"][name]
        if not seen["found"]:
            problems.append(f"after import train.{name} is missing")
        elif not seen.get("callable"):
            problems.append(f"after import train.{name} is a {seen['type']}, not a function")
        elif "error" in seen:
            problems.append(f"after import the signature of train.{name} cannot be read: {seen['error']}")
        elif seen["params"] != expected:
            problems.append(f"after import train.{name} takes ({', '.join(seen['params'])}), "
                            f"expected ({', '.join(expected)})")
    if problems:
        return Result("hooks", FAIL, "; ".join(problems))
    return Result("hooks", PASS, "probe_batch(microbatch) and train(microbatch, accumulation), in the source and "
                                 "after import")


def ast_parameters(args: ast.arguments) -> list[str]:
    return ([a.arg for a in args.posonlyargs + args.args] + ([f"*{args.vararg.arg}"] if args.vararg else [])
            + [a.arg for a in args.kwonlyargs] + ([f"**{args.kwarg.arg}"] if args.kwarg else []))


# ----------------------------------------------------------------------------- judging the children


def judge_import(run: ChildRun, options: Options) -> Result:
    report, problems, notes = run.report, [], []
    seconds = (report or {}).get("import_seconds")
    if run.timed_out:
        problems.append(f"`import train` did not finish within {run.timeout:.0f} s (limit {options.import_limit:g} s "
                        f"plus {IMPORT_GRACE:g} s for start-up); killed")
    elif report is None:
        problems.append(f"the child exited with status {run.returncode} before reporting: {run.stderr_tail()}")
    elif "import_error" in report:
        problems.append(f"importing train.py raised {report['import_error']}")
    else:
        if seconds > options.import_limit:
            problems.append(f"import took {seconds:.1f} s, over the {options.import_limit:g} s limit")
        if report.get("cuda_initialized"):
            problems.append("CUDA was initialized during import (leave devices alone until a hook runs)")
        elif report.get("cuda_initialized") is None:
            notes.append("torch was not imported, so CUDA initialization was not checked")
        if not run.stdin_intact:
            problems.append(run.stdin_problem("the import"))
    leftovers = new_processes((report or {}).get("children", []) + run.survivors, exclude=[])
    if leftovers:
        problems.append(f"the import left processes running: {listing(leftovers)}")
    if run.stdout:
        problems.append(f"the import printed {len(run.stdout)} bytes on stdout, which carries only metric lines: "
                        f"{preview(run.stdout)}")
    changes, empty_dirs = compare_snapshots(run.before, run.after)
    if changes:
        problems.append(f"the import wrote files: {listing(changes)}")
    if empty_dirs:
        notes.append(f"empty folders created and ignored (torch's own import makes TMPDIR/torchinductor_*): "
                     f"{listing(empty_dirs)}")
    if problems:
        return Result("import", FAIL, "; ".join(problems), notes, seconds)
    return Result("import", PASS, f"`import train` took {seconds:.1f} s (limit {options.import_limit:g} s); stdin "
                                  f"untouched, stdout empty, no files, no CUDA, no processes", notes, seconds)


def judge_probe(run: ChildRun, options: Options, microbatch: int, import_result: Result) -> Result:
    report, boundary, problems, notes = run.report, run.boundary, [], []
    call = f"probe_batch({microbatch})"
    import_seconds = (boundary or {}).get("import_seconds")
    seconds = (report or {}).get("probe_seconds")
    if run.timed_out:
        if report is not None:
            problems.append(f"{call} returned after {seconds:.1f} s, but the process was still alive at the "
                            f"{run.timeout:g} s limit (a non-daemon thread or an atexit handler?)")
        else:
            spent = f"import took {import_seconds:.1f} s" if import_seconds is not None else "the import never finished"
            problems.append(f"{call} did not finish within the {run.timeout:g} s limit per probe process ({spent}); "
                            f"killed" + ("" if options.cuda else
                                         " - on a CPU, check with a small config (this project: "
                                         "RUNFAB_CONFIG=conf/smoke.yaml)"))
    elif report is None:
        problems.append(f"the child exited with status {run.returncode} before reporting: {run.stderr_tail()}")
    elif "import_error" in report:
        return Result("probe", SKIP, f"not run: importing train.py raised {report['import_error']}")
    else:
        if "probe_error" in report:
            hint = (" - RunFab would reject this microbatch; try a smaller --microbatch"
                    if "OutOfMemory" in report["probe_error_type"] else "")
            problems.append(f"{call} raised {report['probe_error']}{hint}")
        elif seconds < QUICK_PROBE_SECONDS:
            notes.append(f"{call} returned in {seconds * 1000:.0f} ms: a real probe builds the model and runs "
                         f"optimizer steps, or it cannot measure memory")
        if run.stdin_intact is False:
            if import_result.verdict == FAIL and "stdin" in import_result.reason:
                notes.append("stdin was consumed, but the import already consumes it (see import)")
            else:
                problems.append(run.stdin_problem(call))
    stdout_before = (boundary or {}).get("stdout_bytes", 0)
    probe_stdout = run.stdout[stdout_before:]
    if probe_stdout:
        problems.append(f"{call} printed {len(probe_stdout)} bytes on stdout (a probe must emit no metrics): "
                        f"{preview(probe_stdout)}")
    if stdout_before:
        notes.append("the import printed on stdout too (see import)")
    reference = boundary["snapshot"] if boundary else run.before
    changes, empty_dirs = compare_snapshots(reference, run.after)
    if changes:
        problems.append(f"{call} wrote files: {listing(changes)}")
    if empty_dirs:
        notes.append(f"empty folders created and ignored: {listing(empty_dirs)}")
    from_import = (boundary or {}).get("children", [])
    leftovers = new_processes((report or {}).get("children", []) + run.survivors, exclude=from_import)
    if leftovers:
        problems.append(f"{call} left processes running: {listing(leftovers)}")
    if from_import:
        notes.append(f"processes the import started were still running (see import): {listing(from_import)}")
    total = import_seconds + seconds if import_seconds is not None and seconds is not None else run.wall_seconds
    if problems:
        return Result("probe", FAIL, "; ".join(problems), notes, total)
    return Result("probe", PASS, f"{call} took {seconds:.1f} s (+ {import_seconds:.1f} s import; whole process "
                                 f"{run.wall_seconds:.1f} s of the {run.timeout:g} s limit); nothing read from stdin, "
                                 f"nothing on stdout, no files, no processes left", notes, total)


# ----------------------------------------------------------------------------- driver


def check_bundle(path: str | Path, options: Options | None = None, out: TextIO | None = None) -> list[Result]:
    """Run every check on the bundle at ``path`` (a ZIP or a directory) and return the verdicts.

    Verdicts are printed on ``out`` as they are reached; a check whose prerequisite failed is
    SKIPped rather than failed again, so the first FAIL is the one to fix.
    """
    options = options or Options()
    if options.probe_limit is None:
        from runtime.runfab_limits import PROBE_SECONDS

        options = replace(options, probe_limit=PROBE_SECONDS)
    out = out or sys.stdout
    visible = cuda_gpus() if options.cuda else None  # refused before anything runs when there are none
    source = BundleSource.open(Path(path).resolve())
    gpus, gpus_from = ((options.gpus, "--gpus") if options.gpus
                       else (visible or max(1, visible_gpus()), "visible on this machine"))
    emit(out, f"RunFab contract check of {source.path} ({source.kind}, {len(source.files)} files"
              + (f"; {source.selection}" if source.selection else "") + ")")
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)") if options.cuda else '""'
    config = os.environ.get("RUNFAB_CONFIG")
    emit(out, f"  children: fresh {sys.executable}, read-only copy, empty cwd, HOME, TMPDIR and RUNFABRIC_OUTPUT, "
              f"CUDA_VISIBLE_DEVICES={devices}" + (f", RUNFAB_CONFIG={config}" if config else ""))
    results: list[Result] = []

    def record(result: Result) -> Result:
        results.append(result)
        show(out, result, len(results))
        return result

    layout = record(check_layout(source))
    record(check_archive(source))
    if not layout.passed:
        for key in ("batch", "hooks", "import", "probe"):
            record(Result(key, SKIP, "not run: no train.py at the bundle root"))
        return results

    with Sandbox(source, options.keep) as sandbox:
        tree, parse_error = parse_train(sandbox.bundle)
        progress(out, f"importing train.py in a fresh process (limit {options.import_limit:g} s) ...")
        import_run = run_child(sandbox, "import", options, 0, options.import_limit + IMPORT_GRACE)
        kept = [sandbox.base]
    batch = record(check_batch(tree, parse_error, gpus, gpus_from, import_run))
    record(check_hooks(tree, parse_error, import_run))
    import_result = record(judge_import(import_run, options))

    value, _ = batch_literal(tree) if tree is not None else (None, "")
    microbatch = options.microbatch or 1
    if options.microbatch and value and batch.passed and (value // gpus) % options.microbatch:
        record(Result("probe", SKIP, f"not run: --microbatch {options.microbatch} is not a split RunFab would try; "
                                     f"microbatch x accumulation x {gpus} GPU(s) must equal {value}"))
    elif import_run.report is None or "import_error" in import_run.report:
        record(Result("probe", SKIP, "not run: train.py did not import (see import)"))
    elif not import_run.report["hooks"]["probe_batch"].get("callable"):
        record(Result("probe", SKIP, "not run: train.py has no probe_batch function to call (see hooks)"))
    else:
        with Sandbox(source, options.keep) as sandbox:
            progress(out, f"calling probe_batch({microbatch}) in a fresh process (limit {options.probe_limit:g} s) ...")
            probe_run = run_child(sandbox, "probe", options, microbatch, options.probe_limit)
            kept.append(sandbox.base)
        record(judge_probe(probe_run, options, microbatch, import_result))
    if options.keep:
        emit(out, f"  kept for inspection: {', '.join(map(str, kept))}")
    return results


def visible_gpus() -> int:
    """GPUs CUDA shows this process (CUDA_VISIBLE_DEVICES honoured); 0 without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU here; the probe would tell the rest
        return 0


def cuda_gpus() -> int:
    """The GPUs ``--cuda`` hands to the children. None is a usage error: the children would run on
    the CPU, and their pass would be taken for the GPU run that was asked for."""
    gpus = visible_gpus()
    if not gpus:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if devices is None else f" (CUDA_VISIBLE_DEVICES={devices!r})"
        raise UsageError(f"--cuda: no CUDA GPU is visible on this machine{shown}; leave out --cuda to run on the CPU")
    return gpus


def show(out: TextIO, result: Result, index: int) -> None:
    emit(out, f"{result.verdict}  [{index}] {result.key}: {result.reason}")
    for note in result.notes:
        emit(out, f"        note: {note}")


def progress(out: TextIO, message: str) -> None:
    emit(out, f"  ... {message}")


def emit(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)


def summary(results: list[Result]) -> str:
    width = 100
    rows = [f"{'#':>2}  {'check':<8} {'verdict':<7} {'seconds':>7}  reason"]
    for index, result in enumerate(results, start=1):
        seconds = f"{result.seconds:7.1f}" if result.seconds is not None else f"{'-':>7}"
        reason = result.reason if len(result.reason) <= width else result.reason[:width - 3] + "..."
        rows.append(f"{index:>2}  {result.key:<8} {result.verdict:<7} {seconds}  {reason}")
    failed = [r.key for r in results if r.verdict == FAIL]
    skipped = [r.key for r in results if r.verdict == SKIP]
    if not failed and not skipped:
        rows.append(f"All {len(results)} checks passed.")
    else:
        rows.append(f"{len(results) - len(failed) - len(skipped)} of {len(results)} checks passed"
                    + (f"; failed: {', '.join(failed)}" if failed else "")
                    + (f"; skipped: {', '.join(skipped)}" if skipped else "") + ".")
    return "\n".join(rows)


def size_text(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def listing(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def preview(data: bytes) -> str:
    first = data.decode("utf-8", errors="replace").strip().splitlines()
    return repr(first[0][:120]) if first else repr(data[:120])


def parse_args(argv: list[str]) -> tuple[Path, Options]:
    from runtime.runfab_limits import PROBE_SECONDS

    parser = argparse.ArgumentParser(
        prog="python -m tools check",
        description="Check a bundle the way RunFab runs it: layout, sizes, the literal EFFECTIVE_BATCH_SIZE, the "
                    "hooks, a side-effect-free import and one probe, each in a fresh process from a read-only copy.",
        epilog="On a machine without a GPU use a small config so the probe fits the limit: "
               "RUNFAB_CONFIG=conf/smoke.yaml python -m tools check. Other environment variables pass through.",
    )
    parser.add_argument("bundle", nargs="?", default=str(PROJECT_ROOT),
                        help="a ZIP to upload or a directory (default: this project's root)")
    parser.add_argument("--gpus", type=positive_int,
                        help="GPU count the batch must divide by (default: the visible GPUs, 1 if none)")
    parser.add_argument("--microbatch", type=positive_int, help="microbatch to probe (default: 1)")
    parser.add_argument("--import-limit", type=positive_float, default=DEFAULT_IMPORT_LIMIT, metavar="SECONDS",
                        help=f"longest acceptable `import train` (default: {DEFAULT_IMPORT_LIMIT:g})")
    parser.add_argument("--probe-limit", type=positive_float, metavar="SECONDS",
                        help="limit for the whole probe process, import included "
                             f"(default: RunFab's {PROBE_SECONDS:g})")
    parser.add_argument("--cuda", action="store_true",
                        help="let the children see this machine's GPUs (default: CUDA_VISIBLE_DEVICES=\"\")")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders and print where they are")
    args = parser.parse_args(argv)
    return Path(args.bundle), Options(gpus=args.gpus, microbatch=args.microbatch, import_limit=args.import_limit,
                                      probe_limit=args.probe_limit, cuda=args.cuda, keep=args.keep)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tools check``: 0 when every check passes, 1 when any does not, 2 for usage."""
    bundle, options = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        results = check_bundle(bundle, options)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n" + summary(results), file=sys.stdout, flush=True)
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
