"""What runs inside the checked bundle's fresh interpreter: ``import train`` as RunFab does, maybe one
``probe_batch`` call, then a report of what was seen from inside.

The child is ``python -c BOOTSTRAP <this file> <spec.json>`` (sandbox.CHILD_BOOTSTRAP): this file is
loaded by its path, not as part of the tools package, so the bundle under test can never import
this project's modules by accident. Hence the standard library only, and nothing imported before
``train`` is: psutil, which lists the processes the bundle left, is imported after it.
``snapshot`` serves both sides: the checker compares the snapshots taken before and after.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import stat
import sys
import time
import traceback
from pathlib import Path


def child_main(spec_path: str) -> int:
    """Import ``train`` as RunFab does, maybe probe, and report.

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
    batch = spec["batch_name"]
    report["batch"] = {"found": hasattr(train, batch), "repr": repr(getattr(train, batch, None))[:80]}
    report["hooks"] = {name: describe_hook(train, name) for name in spec["hooks"]}
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


def live_descendants() -> list[str]:
    """This process's running descendants (zombies have finished), as "pid command line"."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{child.pid} {' '.join(child.cmdline()) or child.name()}"[:140])
        except psutil.Error:  # gone meanwhile
            continue
    return found


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
