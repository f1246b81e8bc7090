"""The progress bar (callbacks/progress.py), through a tiny Lightning run on the CPU: it counts optimizer
updates out of ``trainer.max_steps`` with the time left, on stderr, and writes nothing on stdout."""

from __future__ import annotations

import re

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.progress import UpdateProgressBar

from tests.tiny_lightning import TinyRegression, microbatches


def fit(bar: UpdateProgressBar, updates_in_stream: int, max_steps: int, accumulate: int = 2,
        ckpt_path=None, saves: ModelCheckpoint | None = None) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=1,
                        accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=saves is not None, enable_model_summary=False,
                        callbacks=[bar, *([saves] if saves else [])])
    trainer.fit(TinyRegression(), train_dataloaders=microbatches(updates_in_stream * accumulate), ckpt_path=ckpt_path)
    return trainer


def last_render(stderr: str) -> str:
    """The last state the bar drew (tqdm redraws in place with carriage returns)."""
    return [part for part in re.split(r"[\r\n]", stderr) if part.strip().startswith("Training")][-1]


def test_the_bar_counts_updates_out_of_max_steps_with_the_time_left_on_stderr_never_stdout(capsys):
    """Three updates of two microbatches each: the bar ends at 3/3 updates (Lightning's own bar would count
    six microbatches), shows elapsed<remaining and a rate in updates, and stdout stays empty."""
    fit(UpdateProgressBar(), updates_in_stream=5, max_steps=3)
    out, err = capsys.readouterr()
    assert out == ""
    final = last_render(err)
    assert re.search(r"\| 3/3 \[\d\d:\d\d<\d\d:\d\d,\s+[\d.]+update/s", final), final
    assert "/6" not in err


def test_without_a_step_limit_the_bar_shows_the_count_and_the_rate_alone(capsys):
    fit(UpdateProgressBar(), updates_in_stream=2, max_steps=-1)
    out, err = capsys.readouterr()
    assert out == ""
    final = last_render(err)
    assert re.search(r"\| 2/\? \[\d\d:\d\d<\S+,\s+[\d.]+update/s", final), final  # no total to count down to
    assert not re.search(r"\| [34]/", err), err  # four microbatches, two updates: never counted past 2


def test_a_resumed_run_goes_on_from_its_update_not_from_zero(tmp_path, capsys):
    """A run resumed from the periodic checkpoint of update 2 to four updates: the bar starts at 2/4 and
    ends at 4/4, counting only the two updates this process trained in its rate."""
    saves = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    fit(UpdateProgressBar(), updates_in_stream=4, max_steps=4, saves=saves)
    checkpoint = tmp_path / "step=2.ckpt"
    capsys.readouterr()
    bar = UpdateProgressBar()
    second = fit(bar, updates_in_stream=4, max_steps=4, ckpt_path=checkpoint)
    out, err = capsys.readouterr()
    assert second.global_step == 4 and out == ""
    assert (bar.train_progress_bar.initial, bar.train_progress_bar.n) == (2, 4)
    assert re.search(r"\| 4/4 \[", last_render(err)), err
