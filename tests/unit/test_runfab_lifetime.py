"""How a process ends: the one SIGTERM/SIGINT installer and the one parent-death helper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from runfab.lifetime import on_stop_signals

from tests.helpers import ROOT

# A parent that starts a sleeping child bound to it one of two ways; the child's pid is printed once bound.
PARENT = textwrap.dedent("""
    import functools, os, subprocess, sys, time
    from runfab.lifetime import exit_with_parent
    if sys.argv[1] == "preexec":  # as the tools start a command they cannot change
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                                 preexec_fn=functools.partial(exit_with_parent, os.getpid()))
        print(child.pid, flush=True)
    else:  # as a data-parallel worker binds itself
        code = ("import os, time; from runfab.lifetime import exit_with_parent; exit_with_parent(); "
                "print(os.getpid(), flush=True); time.sleep(60)")
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("how", ["preexec", "itself"])
def test_a_child_dies_with_its_parent_even_when_the_parent_is_killed(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], cwd=ROOT, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        parent.kill()
        parent.wait()
        gone, alive = psutil.wait_procs([child], timeout=10)
        for process in alive:
            process.kill()
        assert not alive, "the child outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_stop_signals_reach_the_handler_and_restore_puts_the_previous_ones_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    seen = []
    restore = on_stop_signals(lambda signum, frame: seen.append(signal.Signals(signum).name))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        restore()
    assert seen == ["SIGTERM", "SIGINT"]
    assert {sig: signal.getsignal(sig) for sig in before} == before
