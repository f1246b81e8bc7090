"""Resuming a run on stdin: ``--ckpt_path last`` with the same records on stdin reads them again, checks
the updates the checkpoint trained by their tokens' digests, skips them, and ends with the weights of an
uninterrupted run, bit for bit on a CPU, whether the checkpoint was a periodic one or the one a SIGTERM
wrote, in one process or through the data-parallel launcher. Another input is refused in one line naming
the first update that differs; another stream setting before anything moves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import ROOT, as_args, records, tiny

TIMEOUT = 300
INPUT = records(1280)
VALUES = tiny({
    "model.max_seq_len": 64, "optim.decay_steps": 8, "optim.warmup_steps": 1, "trainer.checkpoint_every_steps": 2,
    "trainer.val_every_steps": 3, "data.input_idle_seconds": 3600, "metrics.interval_seconds": 0,
})


def command(output: Path, max_steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "fit", "--config", "conf/smoke.yaml", *as_args(VALUES),
            "--trainer.max_steps", str(max_steps), "--output.root", str(output), *extra]


def train(output: Path, max_steps: int, *extra: str, data: bytes = INPUT) -> subprocess.CompletedProcess:
    return subprocess.run(command(output, max_steps, *extra), input=data, capture_output=True, cwd=ROOT,
                          timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def weights(output: Path) -> dict:
    return load_file(output / "model" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(bool((wa[k] == wb[k]).all()) for k in wa), "the resumed run's weights differ from the uninterrupted run's"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("stdin-resume") / "whole"
    done = train(output, 6)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return output


def test_a_run_stopped_by_sigterm_writes_a_checkpoint_and_resumes_on_the_same_stdin_to_the_same_weights(
        uninterrupted, tmp_path):
    output = tmp_path / "out"
    process = subprocess.Popen(command(output, 6), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    process.stdin.write(INPUT)  # all of it, with stdin left open: the run is stopped, not ended by its input
    process.stdin.flush()
    for _ in range(2):  # a metric line per update
        assert process.stdout.readline(), process.stderr.read().decode()[-3000:]
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT)
    stderr = stderr.decode()
    assert process.returncode == 2, stderr[-3000:]
    assert "resume with the same command, the same input and --ckpt_path last" in stderr
    assert (output / "checkpoints" / "stopped.ckpt").is_file()

    resumed = train(output, 6, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert "stopped.ckpt" in resumed.stderr.decode()
    assert_same_weights(uninterrupted, output)
    assert not (output / "checkpoints" / "stopped.ckpt").exists()  # the run completed: no longer needed


def test_a_periodic_checkpoint_resumes_through_the_data_parallel_launcher_to_the_same_weights(uninterrupted, tmp_path):
    output = tmp_path / "out"
    first = train(output, 3, "--trainer.worker_processes", "true")  # its newest checkpoint: update 2
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    resumed = train(output, 6, "--trainer.worker_processes", "true", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr.decode()[-3000:]
    assert "first 2 update(s), which the checkpoint trained, are read again" in resumed.stderr.decode()
    assert_same_weights(uninterrupted, output)


def test_another_input_is_refused_naming_the_first_update_that_differs(uninterrupted, tmp_path):
    output = tmp_path / "out"
    first = train(output, 3)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    lines = INPUT.splitlines(keepends=True)
    other = b"".join([*lines[:-400], *reversed(lines[-400:])])  # the same records, the later ones reordered
    refused = train(output, 6, "--ckpt_path", "last", data=other)
    stderr = refused.stderr.decode()
    assert refused.returncode == 2, stderr[-3000:]
    assert "the input differs from the one the checkpoint trained on: update" in stderr
    assert "Traceback" not in stderr
    assert (output / "checkpoints" / "epoch=0-step=2.ckpt").is_file()  # left for a resume with the right input


def test_a_resume_that_changes_how_the_stream_makes_updates_is_refused_before_training(uninterrupted, tmp_path):
    output = tmp_path / "out"
    first = train(output, 3)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    refused = train(output, 6, "--ckpt_path", "last", "--data.val_fraction", "0.05")
    stderr = refused.stderr.decode()
    assert refused.returncode == 2, stderr[-3000:]
    assert "it was trained with data.val_fraction 0.02, this run has 0.05" in stderr
    assert (output / "model").is_dir() and not (output / "previous-model").exists()  # nothing moved
