"""Resuming a run from prepared shards in one process: which checkpoint ``--ckpt_path last`` takes
(never one that does not load; none at all when some exist and none loads), which ones stay in
``checkpoints/`` (the newest two this trainer wrote, nothing else), and the changes of configuration
a resume refuses in one line, exit 2.

A first run (four updates, a checkpoint every two) is made once per module; the resume tests each
resume a copy of its output. Then a stop by SIGTERM to the whole process group (as SLURM's --signal
and Ctrl-C send it) at the default data.loader_workers, and the loader worker's own lifetime.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cli
from runtime import checkpoints
from tools.data import prepare as prepare_tool

from tests.helpers import ROOT, as_yaml, records, tiny

CHILD_TIMEOUT = 300
EFFECTIVE = 8


def values(output: Path, max_steps: int) -> dict:
    return tiny({
        "seed": 5, "model.vocab_size": 8192, "model.max_seq_len": 32, "data.tokenizer": "conf/tokenizer.json",
        "data.loader_workers": 0, "optim.lr": 3.0e-3, "optim.warmup_steps": 1, "optim.schedule": "cosine",
        "optim.decay_steps": 60, "trainer.max_steps": max_steps, "trainer.accelerator": "cpu",
        "trainer.global_batch_size": EFFECTIVE, "trainer.checkpoint_every_steps": 2,
        "metrics.interval_seconds": 0, "output.root": str(output),
    })


def prepare(corpus: bytes, folder: Path, output: Path, *extra: str) -> Path:
    source = folder / f"corpus-{len(corpus)}.jsonl"
    source.write_bytes(corpus)
    config = folder / "prepare.yaml"
    config.write_text(as_yaml(values(folder / "unused", 1)))
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        assert prepare_tool.main(["--input", str(source), "--output", str(output), "--config", str(config),
                                  "--workers", "1", *extra]) == 0
    return output


def train(config: Path, rows: Path, *extra: str, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "fit", "--config", str(config), "--data.source", "litdata",
                           "--data.path", str(rows), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


def write_config(folder: Path, output: Path, max_steps: int) -> Path:
    path = folder / f"run-{max_steps}.yaml"
    path.write_text(as_yaml(values(output, max_steps)))
    return path


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("resume")
    rows = prepare(records(300), folder, folder / "rows")
    other = prepare(records(200), folder, folder / "other-rows")  # another corpus: fewer documents
    done = train(write_config(folder, folder / "output", 4), rows)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (folder / "output" / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=2.ckpt",
                                                                                         "epoch=0-step=4.ckpt"]
    return {"folder": folder, "rows": rows, "other": other, "output": folder / "output"}


def copy_output(first_run: dict, tmp_path: Path) -> Path:
    output = tmp_path / "output"
    shutil.copytree(first_run["output"], output, symlinks=True)
    return output


def resume(first_run: dict, tmp_path: Path, capsys, *extra: str, rows: Path | None = None) -> tuple[int, str]:
    output = copy_output(first_run, tmp_path)
    config = write_config(tmp_path, output, 8)
    status = cli.main(["fit", "--config", str(config), "--data.source", "litdata", "--data.path",
                       str(rows or first_run["rows"]), "--ckpt_path", "last", *extra], EFFECTIVE)
    return status, capsys.readouterr().err


# ----------------------------------------------------------------------------- a change of configuration


@pytest.mark.parametrize("change, key, stored, given", [
    (["--model.n_layer", "3"], "model.n_layer", "1", "3"),
    (["--model.n_embd", "64"], "model.n_embd", "32", "64"),
    (["--seed", "7"], "seed", "5", "7"),
    (["--model.family", "llama"], "model.family", "'gpt2'", "'llama'"),
    (["--trainer.global_batch_size", "16"], "trainer.global_batch_size (rows per update)", "8", "16"),
    (["--optim.lr", "0.001"], "optim.lr", "0.003", "0.001"),
    (["--optim.warmup_steps", "2"], "optim.warmup_steps", "1", "2"),
    (["--optim.schedule", "constant"], "optim.schedule", "'cosine'", "'constant'"),
    (["--trainer.devices", "2", "--microbatch", "4"], "processes (trainer.devices x trainer.num_nodes)", "1", "2"),
])
def test_a_resume_with_another_model_seed_batch_optimizer_or_process_count_is_refused_in_one_line(
        first_run, tmp_path, capsys, change, key, stored, given):
    status, err = resume(first_run, tmp_path, capsys, *change)
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"it was trained with {key} {stored}, this run has {given}" in lines[0]
    assert not (tmp_path / "output" / "previous-model").exists()  # refused before anything moved


def test_a_resume_on_other_rows_is_refused_in_one_line(first_run, tmp_path, capsys):
    status, err = resume(first_run, tmp_path, capsys, rows=first_run["other"])
    assert status == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert f"it was trained with data.path '{first_run['rows']}', this run has '{first_run['other']}'" in line


def test_a_resume_on_rows_prepared_again_from_another_corpus_in_the_same_place_is_refused(first_run, tmp_path,
                                                                                          capsys):
    rows = tmp_path / "rows"
    shutil.copytree(first_run["rows"], rows)
    output = tmp_path / "output"
    done = train(write_config(tmp_path, output, 2), rows)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in os.listdir(rows):  # prepared again, from another corpus, into the same folder
        os.unlink(rows / name)
    for name in os.listdir(first_run["other"]):
        shutil.copy(first_run["other"] / name, rows / name)
    status = cli.main(["fit", "--config", str(write_config(tmp_path, output, 8)), "--data.source", "litdata",
                       "--data.path", str(rows), "--ckpt_path", "last"], EFFECTIVE)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "it was trained with data.path contents (sha256 of its index) '" in line


# ----------------------------------------------------------------------------- which checkpoint, which stay


def test_last_skips_a_newest_checkpoint_that_does_not_load_and_the_newest_two_are_kept(first_run, tmp_path):
    output = copy_output(first_run, tmp_path)
    folder = output / "checkpoints"
    valid = folder / "epoch=0-step=4.ckpt"
    torn = folder / "epoch=0-step=6.ckpt"  # as if this trainer's write of step 6 had been cut in half
    data = valid.read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    (folder / checkpoints.WRITTEN).write_text(f"epoch=0-step=2.ckpt\n{valid.name}\n{torn.name}\n")
    mine = folder / "mine.ckpt"  # a user's file: never removed
    mine.write_bytes(data)
    os.utime(mine, (time.time() - 3600,) * 2)
    os.utime(valid, (time.time() - 60,) * 2)
    os.utime(folder / "epoch=0-step=2.ckpt", (time.time() - 120,) * 2)

    done = train(write_config(tmp_path, output, 8), first_run["rows"], "--ckpt_path", "last")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"skipping {torn}, which does not load" in done.stderr
    steps = [json.loads(line)["step"] for line in done.stdout.splitlines()]
    assert steps == [5, 6, 7, 8]
    record = json.loads((output / "model" / "run_record.json").read_text())
    assert record["input"]["resumed_from"] == str(valid)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["epoch=0-step=6-v1.ckpt",
                                                                                       "epoch=0-step=8.ckpt",
                                                                                       "mine.ckpt"]


def test_last_refuses_when_checkpoints_exist_and_none_loads_and_leaves_them(first_run, tmp_path, capsys):
    output = copy_output(first_run, tmp_path)
    folder = output / "checkpoints"
    for path in folder.glob("*.ckpt"):
        path.write_bytes(path.read_bytes()[:1000])
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    status = cli.main(["fit", "--config", str(write_config(tmp_path, output, 8)), "--data.source", "litdata",
                       "--data.path", str(first_run["rows"]), "--ckpt_path", "last"], EFFECTIVE)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"none of the 2 checkpoint(s) in {folder} loads" in lines[0]
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    assert not (output / "previous-model").exists()


def test_last_refuses_a_checkpoints_folder_that_is_a_symbolic_link(first_run, tmp_path, capsys):
    output = copy_output(first_run, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (output / "checkpoints").rename(elsewhere)
    (output / "checkpoints").symlink_to(elsewhere)
    status = cli.main(["fit", "--config", str(write_config(tmp_path, output, 8)), "--data.source", "litdata",
                       "--data.path", str(first_run["rows"]), "--ckpt_path", "last"], EFFECTIVE)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and "is a symbolic link" in err, err


def test_a_given_checkpoint_that_does_not_load_is_refused_in_one_line(first_run, tmp_path, capsys):
    output = copy_output(first_run, tmp_path)
    torn = output / "checkpoints" / "torn.ckpt"
    torn.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    status = cli.main(["fit", "--config", str(write_config(tmp_path, output, 8)), "--data.source", "litdata",
                       "--data.path", str(first_run["rows"]), "--ckpt_path", str(torn)], EFFECTIVE)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"error: --ckpt_path {torn} does not load" in err


# ----------------------------------------------------------------------------- a stop that reaches every process


def test_sigterm_to_the_whole_process_group_at_the_default_loader_workers_stops_at_a_checkpoint(first_run, tmp_path):
    """As SLURM's --signal and Ctrl-C do, the signal reaches the loader's worker too: the run still
    finishes the update, writes stopped.ckpt and exits 2; the completed resume removes stopped.ckpt,
    which it no longer needs."""
    output = tmp_path / "output"
    config = tmp_path / "run.yaml"
    config.write_text(as_yaml(values(output, 60) | {"data.loader_workers": 1, "trainer.checkpoint_every_steps": 50}))
    command = [sys.executable, "train.py", "fit", "--config", str(config), "--data.source", "litdata", "--data.path",
               str(first_run["rows"])]
    with (tmp_path / "stopped.log").open("w") as log:
        run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        seen = []
        for line in run.stdout:
            seen.append(json.loads(line))
            if len(seen) == 2:
                os.killpg(run.pid, signal.SIGTERM)
        run.wait(timeout=CHILD_TIMEOUT)
    err = (tmp_path / "stopped.log").read_text()
    assert run.returncode == 2, err[-3000:]
    assert f"error: stopped by SIGTERM after optimizer step {seen[-1]['step']}; checkpoint " in err, err[-3000:]
    assert (output / "checkpoints" / "stopped.ckpt").is_file()

    done = train(config, first_run["rows"], "--ckpt_path", "last")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[0])["step"] == seen[-1]["step"] + 1
    assert sorted(p.name for p in (output / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=50.ckpt"]


@pytest.mark.parametrize("trainer_ends", ["by SIGKILL", "by exiting"])
def test_a_loader_worker_ignores_the_groups_stop_signals_and_ends_with_its_trainer(first_run, trainer_ends):
    """SIGTERM and SIGINT from elsewhere (torchrun's agent, SLURM, a terminal) leave a worker running;
    it ends when its trainer is killed, and a trainer that exits with a worker alive does not hang
    (multiprocessing terminates it by SIGTERM, from the trainer, and waits)."""
    script = f"""
import os, signal, sys
import psutil
from pipeline import shards
batches = iter(shards.open_rows({str(first_run['rows'])!r}, 5, 2, workers=1))
next(batches)
(worker,) = [child.pid for child in psutil.Process().children()]
print(worker, flush=True)
sys.stdin.readline()
if {trainer_ends == "by SIGKILL"}:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(0)
"""
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        worker = int(trainer.stdout.readline())
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(worker, sig)
        time.sleep(1)
        assert _alive(worker) and trainer.poll() is None
        trainer.stdin.write("end\n")
        trainer.stdin.flush()
        assert trainer.wait(timeout=60) == (-signal.SIGKILL if trainer_ends == "by SIGKILL" else 0)
    finally:
        trainer.kill()
    deadline = time.monotonic() + 3  # the kernel's parent-death signal, not PyTorch's 5 s watchdog poll
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.05)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie has exited
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return False
    return True
