"""The checkpoint of a run ended early (callbacks/stop_checkpoint.py), through tiny Lightning runs on the CPU:
written only when the run says it stopped early, with the loop counters of the last completed update, so that
a resume from it trains on where a checkpoint taken after the ended epoch would train nothing more."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.stop_checkpoint import StopCheckpoint

from tests.tiny_lightning import fit


class StopAfterUpdate(L.Callback):
    """Asks training to stop at the boundary of update ``n``, as GracefulStop does on a signal."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.n:
            trainer.should_stop = True


def test_a_run_stopped_early_writes_a_checkpoint_that_a_resume_trains_on_from(tmp_path):
    """Stopped after two of six updates, the run says why: the checkpoint holds update 2, and a run resumed
    from it trains updates 3 to 6, where one resumed from a checkpoint taken as that run ended (the epoch
    over) trains nothing. (Without the loops of the update boundary, the first resume trains nothing too.)"""
    path = tmp_path / "stop.ckpt"
    stopped = fit(StopAfterUpdate(2), StopCheckpoint(path, lambda: "SIGTERM"))
    assert stopped.global_step == 2
    assert torch.load(path, weights_only=False)["global_step"] == 2
    stopped.save_checkpoint(tmp_path / "epoch_over.ckpt")

    assert fit(ckpt_path=path).global_step == 6
    assert fit(ckpt_path=tmp_path / "epoch_over.ckpt").global_step == 2


def test_it_is_the_checkpoint_the_periodic_save_wrote_at_the_same_update(tmp_path):
    path = tmp_path / "stop.ckpt"
    periodic = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    fit(StopAfterUpdate(2), periodic, StopCheckpoint(path, lambda: "SIGTERM"))
    stop = torch.load(path, weights_only=False)
    at_update_2 = torch.load(tmp_path / "step=2.ckpt", weights_only=False)
    assert stop["loops"]["fit_loop"] == at_update_2["loops"]["fit_loop"]
    assert stop["state_dict"].keys() == at_update_2["state_dict"].keys()
    assert all(torch.equal(stop["state_dict"][k], v) for k, v in at_update_2["state_dict"].items())


def test_a_run_that_did_not_stop_early_writes_none(tmp_path):
    """Stopped at the same update without a reason (``stopped_early()`` gives None, as when the input ended
    of itself): no file, though the callback was asked."""
    path = tmp_path / "stop.ckpt"
    asked = []

    def stopped_early():
        asked.append(True)
        return None

    fit(StopAfterUpdate(2), StopCheckpoint(path, stopped_early))
    assert asked and not path.exists()
