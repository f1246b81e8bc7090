"""Host memory as RunFab's memory cgroup charges it: PSS (each shared page split among the processes
that map it), read from /proc, for one process or a process tree, and one process's memory at a
stage of a run.

RSS counts a shared library once per process that maps it and overstates a tree of several CUDA
processes by gigabytes; it is reported beside PSS, never instead of it. Standard library only: the
tools measure the processes they start with it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from runfab import created_files
from runfab.limits import GIB

log = logging.getLogger(__name__)

FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Anonymous")
STAGE_LOG_ENV = "RUNFAB_HOST_MEMORY_LOG"  # a file: one JSON line per stage, from every process (benchmarks)


def read_rollup(pid: int | str = "self") -> dict[str, int]:
    """The fields of FIELDS in bytes, from /proc/PID/smaps_rollup; {} when the process is gone."""
    found = dict.fromkeys(FIELDS, 0)
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in found:
            try:
                found[key] = int(rest.split()[0]) * 1024
            except (IndexError, ValueError):
                continue
    return found


def tree_memory(pids) -> dict[str, int]:
    """FIELDS summed over ``pids`` (a process and its descendants), plus how many were read."""
    totals = dict.fromkeys(FIELDS, 0)
    counted = 0
    for pid in pids:
        rollup = read_rollup(pid)
        if rollup:
            counted += 1
            for key in FIELDS:
                totals[key] += rollup[key]
    totals["processes"] = counted
    return totals


def _process_age() -> float:
    """Seconds since this process started (from /proc), so stages read as a timeline."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def record_stage(name: str, rank: int | None = None) -> dict:
    """This process's memory now: logged (a trace, at debug level: log_level), and appended to
    $RUNFAB_HOST_MEMORY_LOG when set."""
    rank = int(os.environ.get("LOCAL_RANK", 0)) if rank is None else rank
    rollup = read_rollup()
    entry = {"stage": name, "rank": rank, "pid": os.getpid(), "age_seconds": round(_process_age(), 2),
             "time": time.time(), **{k: v for k, v in rollup.items()}}
    log.debug("host memory, rank %d, %s: PSS %.2f GiB (anonymous %.2f, files %.2f), RSS %.2f GiB, %.1f s after start",
             rank, name, rollup.get("Pss", 0) / GIB, rollup.get("Pss_Anon", 0) / GIB, rollup.get("Pss_File", 0) / GIB,
             rollup.get("Rss", 0) / GIB, entry["age_seconds"])
    path = os.environ.get(STAGE_LOG_ENV)
    if path and path not in _UNWRITABLE:
        try:
            with created_files.open_created(path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as error:  # an observation, never a reason to lose the run
            _UNWRITABLE.add(path)
            log.warning("$%s names %s, which cannot be written (%s): host memory goes to this log only",
                        STAGE_LOG_ENV, path, error.strerror)
    return entry


_UNWRITABLE: set[str] = set()  # stage-log paths already reported as unwritable, once per process
