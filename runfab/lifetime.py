"""How a process of this project ends: on SIGTERM or SIGINT, and with the process that started it.

- ``on_stop_signals``: the one installer of SIGTERM/SIGINT handlers. The single-process trainer
  (callbacks/graceful_stop.py), the launcher of data-parallel workers and ``python -m tools`` each
  decide what a signal means; this installs their handler and puts the previous ones back
  (``stop_handlers_now`` notes them without installing anything).
- ``exit_with_parent``: the one parent-death helper. A data-parallel worker calls it for itself, and
  so does a DataLoader worker of a run from shards (pipeline/shards.py), which ignores the stop
  signals its process group receives and must still end with the trainer; the tools pass it as
  ``preexec_fn`` to the commands they start, which they cannot change.

Standard library only, so that the tools use the same mechanisms without importing torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def on_stop_signals(handler: Callable) -> Callable[[], None]:
    """Install ``handler(signum, frame)`` for SIGTERM and SIGINT; returns a function that restores the
    handlers found here. Python runs signal handlers in the main thread only, so from another thread
    nothing is installed and the returned function does nothing."""
    restore = stop_handlers_now()
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)
    return restore


def stop_handlers_now() -> Callable[[], None]:
    """A function that puts back the SIGTERM and SIGINT handlers installed now (nothing, outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    found = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def restore() -> None:
        for sig, old in found.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)  # None: a handler not set from Python

    return restore


def _find_prctl():
    """libc's prctl, looked up once at import: a ``preexec_fn`` runs in a forked child, where a lookup may block."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, TypeError):  # not Linux
        return None


_PRCTL = _find_prctl()


def exit_with_parent(parent: int | None = None) -> None:
    """From now on the kernel SIGKILLs this process when ``parent`` (default: its parent now) ends,
    however it ends, even by SIGKILL; a process whose parent has already gone is killed at once.

    Without it, a worker whose feeder vanished would wait in a collective forever, and a tool's
    child (started in a session of its own, out of reach of a terminal's Ctrl-C) would keep the
    machine's memory under PID 1. The kernel sends the signal when the thread that started this
    process ends, so start children from a thread that lives as long as its process (the main one).
    Does nothing where prctl is missing (not Linux).
    """
    if _PRCTL is None:
        return
    parent = os.getppid() if parent is None else parent
    _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the call: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
