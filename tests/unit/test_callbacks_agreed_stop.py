"""The stop of a run from prepared shards (callbacks/agreed_stop.py), through tiny single-rank Lightning runs on
the CPU with the real per-update agreement (runtime/update_agreement.py), settled at each update's first
microbatch as the shards' data module settles it: a signal asks the agreement to stop, training ends after the
update the ranks agreed on with the checkpoint of that update written (a resume trains on from it), the
handlers from before are back afterwards, and a second signal runs ``before_exit()`` and ends the process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch

from callbacks.agreed_stop import StopAtAgreedUpdate
from runtime.update_agreement import UpdateAgreement
from tests.helpers import ROOT
from tests.tiny_lightning import ACCUMULATE, SignalAt, fit


class Settle(L.Callback):
    """Settles each update with the agreement when its first microbatch starts, as ShardDataModule does."""

    def __init__(self, agreement: UpdateAgreement) -> None:
        self.agreement = agreement

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % ACCUMULATE == 0:
            self.agreement.settle(trainer, rank_tokens=4, rank_digest=0)


@pytest.fixture
def handlers_before():
    """A handler of the test's own for both stop signals, which lists the signals it gets; restored afterwards."""
    got: list[int] = []

    def before(signum, frame):
        got.append(signum)

    saved = {sig: signal.signal(sig, before) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield got
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_training_after_the_agreed_update_with_its_checkpoint_written(signum, handlers_before,
                                                                                       tmp_path):
    """The signal comes in update 2, after the ranks settled it: they agree to stop after update 3, the next
    one settled. Training ends there without an exception, the checkpoint of update 3 is written and a resume
    from it trains updates 4 to 6."""
    agreement = UpdateAgreement(report_every_seconds=1e9)
    path = tmp_path / "stop.ckpt"
    stop = StopAtAgreedUpdate(agreement, path)
    trainer = fit(Settle(agreement), SignalAt(signum, batch_idx=ACCUMULATE + 1), stop)
    assert agreement.stop_signal == signal.Signals(signum).name and agreement.stop_after == 3
    assert trainer.global_step == 3 and stop.saved == str(path)
    assert torch.load(path, weights_only=False)["global_step"] == 3
    assert fit(ckpt_path=path).global_step == 6


def test_without_a_signal_no_checkpoint_is_written_and_a_signal_after_training_no_longer_asks_a_stop(
        handlers_before, tmp_path):
    """After ``fit`` the handlers from before are installed again, not Lightning's of the finished Trainer, and a
    SIGTERM reaches them, not the agreement."""
    agreement = UpdateAgreement(report_every_seconds=1e9)
    stop = StopAtAgreedUpdate(agreement, tmp_path / "stop.ckpt")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert fit(Settle(agreement), stop).global_step == 6
    assert stop.saved is None and not (tmp_path / "stop.ckpt").exists()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    signal.raise_signal(signal.SIGTERM)
    assert agreement.stop_signal is None and handlers_before == [signal.SIGTERM]


def test_a_second_signal_runs_before_exit_and_ends_the_process_as_the_signals_default_does(tmp_path):
    """In a process of its own: SIGTERM twice in one microbatch; the process dies of SIGTERM, after
    ``before_exit()`` wrote its mark, and no checkpoint is written."""
    mark, path = tmp_path / "before_exit", tmp_path / "stop.ckpt"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import signal
        from callbacks.agreed_stop import StopAtAgreedUpdate
        from runtime.update_agreement import UpdateAgreement
        from tests.unit.test_callbacks_agreed_stop import SignalAt, Settle, fit
        agreement = UpdateAgreement(report_every_seconds=1e9)
        stop = StopAtAgreedUpdate(agreement, Path({str(path)!r}),
                                  before_exit=lambda: Path({str(mark)!r}).write_text("x"))
        fit(Settle(agreement), SignalAt(signal.SIGTERM, batch_idx=3), SignalAt(signal.SIGTERM, batch_idx=3), stop)
        print("training went on after the second signal")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert mark.read_text() == "x" and "went on" not in done.stdout and not path.exists()
