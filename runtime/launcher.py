"""Data parallelism with the feeder owning stdin: one worker process per device, started here.

Lightning's own ``ddp`` launcher re-runs ``sys.argv``, which under RunFab is RunFab's command,
and its children would race for stdin. So the process RunFab started stays the feeder: it reads
and packs the stream, starts ``python train.py worker`` once per rank with LOCAL_RANK,
NODE_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (Lightning then treats the processes as
created externally), and each rank receives its share of every update over a local socket
(pipeline/feeder_wire.py). Rank 0's metric lines come back on its stdout and are forwarded
unchanged. Any worker failing fails the run promptly with that worker's error, and no process is
left behind.

A worker is started one of two ways (``trainer.worker_start``), both running ``train.py worker``:

- **fork** (the default whenever it is safe): a copy of this process runs it. Torch, Lightning and
  the project are already imported here, so a worker starts in a fraction of a second instead of
  importing for 10-20 s on RunFab's 2 cores, and the imported modules' memory stays shared with
  this process instead of being paid once per GPU. Safe only while this process has not initialized
  the CUDA driver (a forked child cannot use a driver its parent initialized), which
  ``cuda_driver_initialized`` checks without initializing it.
- **exec**: a fresh interpreter (``python train.py worker``), whatever the parent did.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from callbacks.runfab_metrics import deliver
from config import WORKER_STARTS
from runfab.lifetime import on_stop_signals

log = logging.getLogger(__name__)

WORKER_SPEC_ENV = "RUNFAB_WORKER_SPEC"
POLL_SECONDS = 0.2
STDERR_TAIL_LINES = 40


class WorkerFailed(RuntimeError):
    """A data-parallel worker exited with an error; the message carries the end of its stderr."""


class Interrupted(RuntimeError):
    """A signal (SIGTERM or SIGINT) stopped the run; what was trained is exported when it can be."""


# A worker that a signal stopped (Interrupted) exits with the shell's status for a SIGTERM'd process. Its peers
# then often fail too, in the collective it left half done; this status lets the report name the cause first.
STOPPED_EXIT = 128 + signal.SIGTERM


class InputFailed(RuntimeError):
    """The input failed after training started; the model trained so far was exported."""


def raise_on_signals(first=None, stopping: str = "stopping the workers"):
    """SIGTERM/SIGINT: ``first(name)`` on the first one when given (a graceful stop: every rank ends
    at the same update and rank 0 exports), else and on any later one Interrupted ("received NAME;
    ``stopping``"), so ``finally`` blocks stop the workers, release the output folder and remove
    temporary folders at once. Returns a restore function."""
    received: list[str] = []

    def interrupt(signum, frame):
        name = signal.Signals(signum).name
        received.append(name)
        if first is not None and len(received) == 1:
            log.warning("%s received: every rank stops after the update in hand and the model trained so far is "
                        "exported; send it again to stop at once", name)
            first(name)
            return
        raise Interrupted(f"received {name}; {stopping}")

    return on_stop_signals(interrupt)


# ----------------------------------------------------------------------------- in a worker


PER_RANK_LOGGERS = ("runfab.process_memory", "runtime.probe")  # what each rank measures of its own process and device


def quiet_peer_rank(rank: int) -> None:
    """On ranks other than 0, stderr gets warnings, errors and what the rank measures of itself (host
    memory, its probe); the run's story (model, kernels, validation loss, finished) is told once, by rank 0."""
    if rank == 0:
        return

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name in PER_RANK_LOGGERS

    for name in ("", "lightning", "lightning.pytorch", "lightning.fabric"):  # Lightning's loggers have their own handlers
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(keep)


def worker_spec() -> dict:
    return json.loads(os.environ[WORKER_SPEC_ENV])


# ----------------------------------------------------------------------------- starting the workers


CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialized() -> bool:
    """Whether this process has called cuInit. Asks a driver that is already loaded (a driver call
    before cuInit answers CUDA_ERROR_NOT_INITIALIZED and changes nothing); never loads one."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return True  # cannot tell: assume it has
    if "libcuda.so" not in maps:
        return False
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # the library already mapped, not a second copy
    except OSError:
        return True
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def resolve_start(requested: str, cuda_initialized: bool | None = None) -> str:
    """``fork`` or ``exec`` for ``trainer.worker_start``; auto forks unless CUDA is initialized here
    (``cuda_initialized``; None: asked of this process, ``cuda_driver_initialized``)."""
    if requested not in WORKER_STARTS:
        raise ValueError(f"trainer.worker_start must be one of {', '.join(WORKER_STARTS)}, not {requested!r}")
    if requested == "exec":
        return "exec"
    if cuda_initialized is None:
        cuda_initialized = cuda_driver_initialized()
    if cuda_initialized:
        if requested == "fork":
            raise RuntimeError("trainer.worker_start is 'fork' but this process has already initialized CUDA, "
                               "which a forked worker cannot use; use 'auto' or 'exec'")
        return "exec"
    return "fork"


class ForkedWorker:
    """A worker forked from this process, with the part of ``subprocess.Popen`` WorkerGroup uses.

    The child gets its own session, /dev/null for stdin, the given pipes for stdout and stderr,
    default signal handlers and the worker's environment, runs ``train.py worker`` as
    ``python train.py worker`` would (its modules are already imported), and leaves with
    ``os._exit``: none of this process's ``finally`` blocks or exit handlers run twice.
    """

    def __init__(self, script: Path, env: dict[str, str], keep_stdout: bool, close_in_child: list[int]) -> None:
        out_read, out_write = os.pipe() if keep_stdout else (None, None)
        err_read, err_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        # Objects that exist now are left alone by both processes' collectors, which would otherwise write
        # to every tracked object's header and so copy the pages the child shares with this process.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            close = [fd for fd in (out_read, err_read, *close_in_child) if fd is not None]
            _run_forked_child(script, env, out_write, err_write, close)
        os.close(err_write)
        if out_write is not None:
            os.close(out_write)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = os.fdopen(out_read, "rb") if out_read is not None else None
        self.stderr = os.fdopen(err_read, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # negative for a signal, as Popen
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def pipes(self) -> list[int]:
        return [f.fileno() for f in (self.stdout, self.stderr) if f is not None]


def _run_forked_child(script: Path, env: dict[str, str], out_fd: int | None, err_fd: int, close: list[int]) -> None:
    """In the forked child: become ``python train.py worker`` and never return."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(out_fd if out_fd is not None else devnull, 1)
        os.dup2(err_fd, 2)
        for fd in (devnull, out_fd, err_fd, *close):
            if fd is not None and fd > 2:
                os.close(fd)
        old_stderr = sys.stderr
        sys.stdin = open(os.devnull)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True)
        loggers = [logging.root, *(x for x in list(logging.root.manager.loggerDict.values()) if isinstance(x, logging.Logger))]
        for handler in {h for logger in loggers for h in logger.handlers}:  # ours, Lightning's: they held the old stderr
            if isinstance(handler, logging.StreamHandler) and handler.stream is old_stderr:
                handler.setStream(sys.stderr)
        os.environ.update(env)
        _name_process(f"rank{env['LOCAL_RANK']}-worker")
        sys.argv = [str(script), "worker"]
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as done:  # as the interpreter treats it: a number is the status, anything else is printed
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
                code = 1
    except BaseException:  # noqa: BLE001 - report whatever ended the worker, as an interpreter would
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the reader may be gone
                pass
        os._exit(code)


def _name_process(name: str) -> None:
    """The name ps and top show (/proc/PID/comm): a forked worker keeps its parent's command line."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Starts one worker per rank, forwards rank 0's stdout, keeps each stderr's tail, stops them all."""

    def __init__(self, world_size: int, spec: dict, bundle_root: Path, start: str = "exec") -> None:
        self.world_size = world_size
        self.start = start
        port = free_port()
        self.processes: list[subprocess.Popen | ForkedWorker] = []
        self.tails = [deque(maxlen=STDERR_TAIL_LINES) for _ in range(world_size)]
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()  # set when we stop the workers: what they say after is its echo
        try:
            self._start(spec, bundle_root / "train.py", port)
        except BaseException:
            self.stop()  # the ranks already started would wait for the others forever
            raise
        # Only now the pump threads: a fork while one of them held a stream's lock would copy the held lock.
        for rank, process in enumerate(self.processes):
            self._follow(process.stderr, sys.stderr, self.tails[rank])
        self._follow(self.processes[0].stdout, sys.stdout, None)

    def _start(self, spec: dict, script: Path, port: int) -> None:
        world_size = self.world_size
        for rank in range(world_size):
            worker_env = dict(
                LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{WORKER_SPEC_ENV: json.dumps(spec | {"rank": rank})},
            )
            if self.start == "fork":
                inherited = [fd for worker in self.processes for fd in worker.pipes()]
                process = ForkedWorker(script, worker_env, keep_stdout=rank == 0, close_in_child=inherited)
            else:
                process = subprocess.Popen(
                    [sys.executable, str(script), "worker"], env=dict(os.environ, **worker_env), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                    start_new_session=True,  # so a signal to the feeder's group does not race our own shutdown
                )
            self.processes.append(process)

    def _follow(self, source, sink, tail: deque | None) -> None:
        def pump() -> None:
            delivering = True
            for raw in iter(source.readline, b""):  # read to the end whatever happens to the sink: a worker
                line = raw.decode("utf-8", "replace")  # blocked on a full pipe would hang every rank
                if tail is not None:
                    tail.append(line.rstrip("\n"))
                    if self._stopping.is_set():  # a rank that lost its killed peer prints a traceback: noise
                        continue
                if delivering:
                    delivering = deliver(sink, line)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        self._threads.append(thread)

    def wait(self, feeder_error=lambda: None, on_first_exit=lambda: None, stop_deadline=lambda: None) -> None:
        """``wait_for_workers`` on this group's workers, then the stderr pumps are drained."""
        wait_for_workers(self.processes, self.tails, feeder_error, on_first_exit, stop_deadline)
        for thread in self._threads:
            thread.join(timeout=5)

    def stop(self, grace_seconds: float = 5.0) -> None:
        """SIGTERM every worker still running, then SIGKILL what remains; nothing is left behind. From
        here their stderr only fills the tails: a rank whose peer was stopped first reports a lost peer."""
        alive = [p for p in self.processes if p.poll() is None]
        if alive:
            self._stopping.set()
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()



def wait_for_workers(processes, tails, feeder_error=lambda: None, on_first_exit=lambda: None,
                     stop_deadline=lambda: None) -> None:
    """Return when every worker exited 0; raise as soon as one fails (or the feeder fails).

    ``on_first_exit`` runs once as soon as any worker has ended (training is over: stop reading).
    ``stop_deadline()`` is the monotonic time by which a graceful stop must be over, or None: a
    rank that is stuck (stopped, or blocked on a pipe) must not hold the job past it. ``tails``
    holds each rank's last stderr lines, which a failure report quotes.
    """
    while True:
        codes = [p.poll() for p in processes]
        if any(code is not None for code in codes):
            on_first_exit()
        failed = _failures(codes)
        error = feeder_error()
        if error is not None and (failed or all(c is not None for c in codes)):
            raise error
        if failed:
            # The first failure ends the wait. Look again after a pause: the stderr pumps catch up,
            # and a rank killed by a signal, the cause, may still have been dying when its peer's
            # error ("a remote worker crashed"), the consequence, was seen.
            time.sleep(POLL_SECONDS)
            raise WorkerFailed(_failure_message(_failures([p.poll() for p in processes]), tails))
        if all(code == 0 for code in codes):
            return
        deadline = stop_deadline()
        if deadline is not None and time.monotonic() > deadline:
            stuck = [rank for rank, code in enumerate(codes) if code is None]
            raise Interrupted(f"the graceful stop did not end within trainer.stop_grace_seconds: rank(s) "
                              f"{', '.join(map(str, stuck))} still running, now stopped at once")
        time.sleep(POLL_SECONDS)

def _failures(codes: list[int | None]) -> list[tuple[int, int]]:
    """(rank, code) of the ranks that failed: those killed by a signal first, then those a signal stopped
    (STOPPED_EXIT), then the others, each by rank."""
    return sorted(((rank, code) for rank, code in enumerate(codes) if code not in (None, 0)),
                  key=lambda failure: (failure[1] >= 0, failure[1] != STOPPED_EXIT, failure[0]))


def _failure_message(failures: list[tuple[int, int]], tails: list[deque]) -> str:
    """Name the first failure with the end of its stderr, then any later ones by rank and code."""
    rank, code = failures[0]
    cause = f" (killed by {signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
    message = f"worker rank {rank} exited with code {code}{cause}:\n" + "\n".join(tails[rank])
    if len(failures) > 1:
        message += "\nthen " + ", ".join(f"rank {r} exited with code {c}" for r, c in failures[1:])
    return message


@contextlib.contextmanager
def worker_group(world_size: int, spec: dict, bundle_root: Path, start: str = "auto",
                 on_first_signal=None) -> Iterator[WorkerGroup]:
    """One worker per rank, for the length of a ``with`` block: started as ``start`` says
    (``trainer.worker_start``), SIGTERM/SIGINT handled as raise_on_signals says, and every worker
    gone when the block ends, however it ends."""
    how = resolve_start(start)
    restore_signals = raise_on_signals(first=on_first_signal)
    try:
        group = WorkerGroup(world_size, spec, bundle_root, how)
    except BaseException:
        restore_signals()
        raise
    log.info("%d worker(s) started: %s", world_size, "forked from this process" if how == "fork" else
             "fresh interpreters" + (" (this process had initialized CUDA)" if start != "exec" else ""))
    try:
        yield group
    finally:
        group.stop()
        restore_signals()


def _signal_group(process: subprocess.Popen | ForkedWorker, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
