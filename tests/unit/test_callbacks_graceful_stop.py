"""SIGTERM or SIGINT during a single-process run (callbacks/graceful_stop.py), through tiny Lightning runs on
the CPU: the first signal ends the input and stops training after the microbatch in hand, with no exception out
of ``fit`` (Lightning's own SIGTERM handler would raise one and skip the export); the handlers from before
are back once training is over; a second signal runs ``before_exit()`` and ends the process as the signal's
default does."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from callbacks.graceful_stop import GracefulStop
from tests.helpers import ROOT
from tests.tiny_lightning import ACCUMULATE, SignalAt, fit


@pytest.fixture
def handlers_before():
    """A handler of the test's own for both stop signals, restored to what it was afterwards."""

    def before(signum, frame):
        raise AssertionError(f"the handler from before the run got signal {signum} during training")

    saved = {sig: signal.signal(sig, before) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield before
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_input_and_training_stops_after_the_update_in_hand(signum, handlers_before):
    """The signal comes in the last microbatch of update 2: ``end_input`` is told its name once, ``fit``
    returns without an exception (Lightning's SIGTERM handler, left in place, raises one), update 2 is
    trained and no other starts, and the handlers from before are back."""
    ended = []
    stop = GracefulStop(end_input=ended.append)
    trainer = fit(SignalAt(signum, batch_idx=2 * ACCUMULATE - 1), stop)
    name = signal.Signals(signum).name
    assert ended == [name] and stop.signal_name == name
    assert trainer.global_step == 2
    assert signal.getsignal(signal.SIGTERM) is handlers_before
    assert signal.getsignal(signal.SIGINT) is handlers_before


def test_a_signal_inside_an_update_stops_after_the_microbatch_in_hand_and_applies_no_half_update(handlers_before):
    """SIGTERM in the first microbatch of update 2: training ends after that microbatch, update 1 is kept and
    update 2 is never stepped (a resume reads its microbatches again)."""
    trainer = fit(SignalAt(signal.SIGTERM, batch_idx=ACCUMULATE), GracefulStop(end_input=lambda name: None))
    assert trainer.global_step == 1
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == ACCUMULATE + 1


def test_without_a_signal_nothing_is_ended_and_the_handlers_from_before_are_back(handlers_before):
    ended = []
    stop = GracefulStop(end_input=ended.append)
    assert fit(stop).global_step == 6
    assert ended == [] and stop.signal_name is None
    assert signal.getsignal(signal.SIGTERM) is handlers_before


def test_a_second_signal_runs_before_exit_and_ends_the_process_as_the_signals_default_does(tmp_path):
    """In a process of its own: SIGTERM twice in one microbatch; the process dies of SIGTERM, after
    ``before_exit()`` wrote its mark, and ``fit`` never returns."""
    mark = tmp_path / "before_exit"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import signal
        from callbacks.graceful_stop import GracefulStop
        from tests.unit.test_callbacks_graceful_stop import SignalAt, fit
        stop = GracefulStop(end_input=lambda name: None, before_exit=lambda: Path({str(mark)!r}).write_text("x"))
        fit(SignalAt(signal.SIGTERM, batch_idx=3), SignalAt(signal.SIGTERM, batch_idx=3), stop)
        print("training went on after the second signal")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert mark.read_text() == "x" and "went on" not in done.stdout
