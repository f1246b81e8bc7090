"""Verdicts on what the import and probe children did, as seen from inside (their report) and from
outside (stdout, the snapshots of every folder, the processes left in their group).

``import``: quick and side-effect free: no stdin read, nothing on stdout, no files written, no CUDA
initialized, no process left. ``probe``: one ``probe_batch`` call as RunFab makes it, within RunFab's
limit for the whole process, with the same rules; what the import already did is not blamed on it.
"""

from __future__ import annotations

from tools.bundle.sandbox import ChildRun
from tools.bundle.static_checks import FAIL, PASS, SKIP, Result, listing

IMPORT_GRACE = 10.0  # on top of the import limit: interpreter start-up and the checks after the import
QUICK_PROBE_SECONDS = 0.1


def judge_import(run: ChildRun, import_limit: float) -> Result:
    report, problems, notes = run.report, [], []
    seconds = (report or {}).get("import_seconds")
    if run.timed_out:
        problems.append(f"`import train` did not finish within {run.timeout:.0f} s (limit {import_limit:g} s "
                        f"plus {IMPORT_GRACE:g} s for start-up); killed")
    elif report is None:
        problems.append(f"the child exited with status {run.returncode} before reporting: {run.stderr_tail()}")
    elif "import_error" in report:
        problems.append(f"importing train.py raised {report['import_error']}")
    else:
        if seconds > import_limit:
            problems.append(f"import took {seconds:.1f} s, over the {import_limit:g} s limit")
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
    return Result("import", PASS, f"`import train` took {seconds:.1f} s (limit {import_limit:g} s); stdin "
                                  f"untouched, stdout empty, no files, no CUDA, no processes", notes, seconds)


def judge_probe(run: ChildRun, cuda: bool, microbatch: int, import_result: Result) -> Result:
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
                            f"killed" + ("" if cuda else
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


def preview(data: bytes) -> str:
    first = data.decode("utf-8", errors="replace").strip().splitlines()
    return repr(first[0][:120]) if first else repr(data[:120])
