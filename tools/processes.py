"""The processes a tool starts: each dies with the tool, is stopped with all it started, and the
host memory of its tree is read as RunFab charges it.

A tool starts its children in sessions of their own (so a terminal's Ctrl-C does not reach them
halfway through), which also takes them out of reach of whoever kills the tool: ``start`` binds
each to the tool with the one parent-death helper, ``runfab.lifetime.exit_with_parent``. The
process table comes from psutil (the ``tools`` extra); memory from ``runfab.process_memory``, the one
reader of /proc/PID/smaps_rollup.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import threading
import time

import psutil

from runfab import process_memory
from runfab.lifetime import exit_with_parent

SAMPLE_SECONDS = 0.5


def start(command: list[str], **popen_options) -> subprocess.Popen:
    """``subprocess.Popen`` whose child the kernel kills when this tool ends, however it ends.
    Start children from the main thread: the signal comes when the starting thread ends."""
    return subprocess.Popen(command, preexec_fn=functools.partial(exit_with_parent, os.getpid()), **popen_options)


KILL_WAIT_SECONDS = 5.0


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (a child started with ``start_new_session`` and all it started), and wait up to
    KILL_WAIT_SECONDS until none of it runs: a killed process ends a moment later (on a busy machine, later
    still), and what the caller does next must not find it running."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


def running(processes) -> list[str]:
    """The running ones among ``processes`` (zombies have finished) as "pid command line"."""
    found = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{process.pid} {' '.join(process.cmdline()) or process.name()}"[:140])
        except psutil.Error:  # gone meanwhile
            continue
    return found


def group_members(pgid: int) -> list[str]:
    """The processes still running in process group ``pgid``, as "pid command line"."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return running(sorted(members, key=lambda p: p.pid))


def family(pid: int) -> list[int]:
    """A process and all its descendants; [] when it is gone."""
    try:
        process = psutil.Process(pid)
        return [pid, *(child.pid for child in process.children(recursive=True))]
    except psutil.Error:
        return []


def tree_memory(pid: int) -> dict[str, int]:
    """runfab.process_memory's figures (Pss, Rss, Anonymous, ... in bytes; ``processes``) summed over ``pid``'s tree."""
    return process_memory.tree_memory(family(pid))


class MemorySampler(threading.Thread):
    """Samples a process tree's host memory until the process ends: the peaks of PSS (what a memory
    cgroup, and so RunFab's RAM budget, counts), RSS and anonymous memory, and the timeline
    ``(unix time, PSS, RSS, processes)``. ``check(totals)`` runs after each sample when given."""

    def __init__(self, process: subprocess.Popen, check=None) -> None:
        super().__init__(daemon=True)
        self.process = process
        self.check = check
        self.peak_pss = self.peak_rss = self.peak_anonymous = 0
        self.timeline: list[tuple[float, int, int, int]] = []

    def run(self) -> None:
        while self.process.poll() is None:
            totals = tree_memory(self.process.pid)
            self.timeline.append((time.time(), totals["Pss"], totals["Rss"], totals["processes"]))
            self.peak_pss = max(self.peak_pss, totals["Pss"])
            self.peak_rss = max(self.peak_rss, totals["Rss"])
            self.peak_anonymous = max(self.peak_anonymous, totals["Anonymous"])
            if self.check is not None:
                self.check(totals)
            time.sleep(SAMPLE_SECONDS)
