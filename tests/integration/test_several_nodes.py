"""Several nodes on one CPU machine: ``torchrun`` starts two "nodes" of two processes each (gloo), and
the trainer runs Lightning's own DDP over rows prepared with ``python -m tools prepare``.

torchrun and SLURM's tasks (their variables set as srun sets them, in one process group) are each
stopped by a signal at the default data.loader_workers and resumed.

Each run is checked against one process that accumulates the same rows: LitData's share for each
rank is read here as that rank reads it (LitData takes the rank and world size from WORLD_SIZE and
GLOBAL_RANK), update k is then every rank's k-th share, and a plain loop trains on it with the same
initial weights, optimizer, schedule, clipping and exact loss normalisation (summed target-token
loss over the update's target-token count). Losses and final weights must agree to fp32 precision:
an update normalised by each rank's own token count, a rank that trained other rows, or a resumed
run that skipped or repeated rows would not.

The model is tiny (one layer, 32 wide, rows of 32 tokens), so the processes' start-up is most of
the time. LitData is required (CI installs it, .ci/run).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from config import load_config
from lit_module import DecoderTrainingModule
from model.hf import to_hf
from pipeline import shards
from pipeline.packing import collate_rows
from tools.data import prepare as prepare_tool

from tests.helpers import ROOT, as_yaml, records, tiny, signal_twice_during_the_export, write_slow_export_script

SEQ_LEN = 32
GLOBAL_BATCH = 8  # rows per update, over all ranks
CHILD_TIMEOUT = 300


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    corpus = folder / "corpus.jsonl"
    corpus.write_bytes(records(300))
    config = folder / "prepare.yaml"
    config.write_text(as_yaml(run_values(folder / "unused", max_steps=1)))
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        assert prepare_tool.main(["--input", str(corpus), "--output", str(folder / "rows"), "--config", str(config),
                                  "--workers", "1"]) == 0
    return folder / "rows"


def run_values(output: Path, max_steps: int) -> dict:
    return tiny({
        "seed": 5, "model.vocab_size": 8192, "model.max_seq_len": SEQ_LEN, "data.tokenizer": "conf/tokenizer.json",
        "data.loader_workers": 0, "optim.lr": 3.0e-3, "optim.warmup_steps": 1, "optim.schedule": "cosine",
        "optim.decay_steps": 60, "trainer.max_steps": max_steps, "trainer.accelerator": "cpu",
        "trainer.global_batch_size": GLOBAL_BATCH, "metrics.interval_seconds": 0, "output.root": str(output),
    })


def write_config(folder: Path, max_steps: int, overrides: dict | None = None) -> Path:
    path = folder / f"run-{max_steps}.yaml"
    path.write_text(as_yaml(run_values(folder / "output", max_steps) | (overrides or {})))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(launch: list[str], config: Path, rows: Path, microbatch: int, log: Path, *extra: str) -> subprocess.Popen:
    """train.py under torchrun, through runtime.torchrun as docs/several-nodes.md starts it; stdout (the
    metric lines) is piped, stderr goes to ``log``."""
    command = [sys.executable, "-m", "runtime.torchrun", *launch, "train.py", "fit", "--config", str(config),
               "--data.source", "litdata", "--data.path", str(rows), "--microbatch", str(microbatch), *extra]
    with log.open("w") as stderr:
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})


def metric_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- the process that accumulates


def rank_rows(rows: Path, world: int, rows_per_rank: int, seed: int) -> list[list]:
    """Each rank's rows in the order it reads them: LitData's share of rank r of ``world``, opened as
    the training run opens it (its seed, shuffle, drop_last, batch of the rank's share, no workers)."""
    shares = []
    saved = {name: os.environ.get(name) for name in ("WORLD_SIZE", "GLOBAL_RANK")}
    try:
        for rank in range(world):
            os.environ.update(WORLD_SIZE=str(world), GLOBAL_RANK=str(rank))
            loader = shards.open_rows(str(rows), seed, rows_per_rank, workers=0)
            shares.append([shards.item_row(item, SEQ_LEN) for item in loader.dataset])
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    return shares


def accumulate_same_rows(config: Path, shares: list[list], updates: int) -> tuple[list[float], DecoderTrainingModule]:
    """One process, update k = every rank's k-th share: loss sum over the update's target tokens,
    clipping, AdamW and the schedule as the LightningModule configures them."""
    cfg = load_config(config)
    L.seed_everything(cfg.seed, verbose=False)
    module = DecoderTrainingModule(cfg.model, cfg.optim)
    optimizers = module.configure_optimizers()
    optimizer, schedule = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
    per_rank = GLOBAL_BATCH // len(shares)
    losses = []
    for k in range(updates):
        batch = collate_rows([row for share in shares for row in share[k * per_rank : (k + 1) * per_rank]])
        optimizer.zero_grad()
        loss_sum = module.model.loss_sum(batch)
        (loss_sum / batch["target_tokens"]).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val, foreach=True)
        optimizer.step()
        schedule.step()
        losses.append(loss_sum.item() / batch["target_tokens"])
    return losses, module


def assert_same_weights(model_dir: Path, module: DecoderTrainingModule) -> None:
    trained = load_file(model_dir / "model.safetensors")
    expected = to_hf(module.model)
    assert trained.keys() == expected.keys()
    # Adam divides each gradient by its own running size, so the last bits of a near-zero gradient summed over
    # ranks in another order move its weight by a sliver of a step (up to 6e-6 in the Llama's gated product);
    # a rank on other rows or another normalisation moves weights by whole steps (lr 3e-3).
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("family", [{}, {"model.family": "llama", "model.n_kv_head": 1}], ids=["gpt2", "llama"])
def test_two_nodes_of_two_processes_train_like_one_process_accumulating_the_same_rows(prepared, tmp_path, family):
    steps = 4
    config = write_config(tmp_path, steps, family)
    port = str(free_port())
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    nodes = [torchrun(["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr",
                       "127.0.0.1", "--master-port", port], config, prepared, 1, logs[node]) for node in (0, 1)]
    outputs = [node.communicate(timeout=CHILD_TIMEOUT)[0] for node in nodes]
    for node, log in zip(nodes, logs):
        assert node.returncode == 0, log.read_text()[-3000:]
    lines = metric_lines(outputs[0])
    assert outputs[1] == ""  # metric lines come from global rank 0 only
    assert [line["step"] for line in lines] == list(range(1, steps + 1))

    shares = rank_rows(prepared, world=4, rows_per_rank=GLOBAL_BATCH // 4, seed=5)
    losses, module = accumulate_same_rows(config, shares, steps)
    assert [line["loss"] for line in lines] == pytest.approx(losses, rel=1e-5)
    assert_same_weights(tmp_path / "output" / "model", module)
    record = json.loads((tmp_path / "output" / "model" / "run_record.json").read_text())
    assert (record["world_size"], record["batch"]["effective"], record["input"]["source"]) == (4, GLOBAL_BATCH, "litdata")


def test_a_run_stopped_by_sigterm_resumes_from_its_checkpoint_to_the_same_weights(prepared, tmp_path):
    """SIGTERM to torchrun: its agent signals each rank's whole process group (the loader workers of
    the default data.loader_workers: 1 included, which leave the stop to their rank), waits, then
    ends: one line and 128 + SIGTERM, no traceback. The ranks agree on one update to finish, write the
    checkpoint and stop, each with the stop's line. The same command with --ckpt_path last ends where an
    uninterrupted run ends, and only the newest checkpoint stays."""
    steps = 60
    default_workers = load_config(ROOT / "conf" / "config.yaml").data.loader_workers
    assert default_workers >= 1
    config = write_config(tmp_path, steps, {"data.loader_workers": default_workers,
                                            "trainer.checkpoint_every_steps": 50})
    launch = ["--standalone", "--nproc-per-node", "2"]
    log = tmp_path / "stopped.log"
    first = torchrun(launch, config, prepared, 2, log)
    seen = []
    for line in first.stdout:
        seen.append(json.loads(line))
        if len(seen) == 2:
            first.send_signal(signal.SIGTERM)
    first.wait(timeout=CHILD_TIMEOUT)
    stopped_at = seen[-1]["step"]
    err = log.read_text()
    assert "is killed by signal" not in err, err[-3000:]
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "torchrun: stopped by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    assert f"error: stopped by SIGTERM after optimizer step {stopped_at}; checkpoint " in err, err[-3000:]
    assert 2 <= stopped_at < steps
    assert (tmp_path / "output" / "checkpoints" / "stopped.ckpt").is_file()
    record = json.loads((tmp_path / "output" / "model" / "run_record.json").read_text())
    assert record["status"] == "partial: SIGTERM" and record["optimizer_steps"] == stopped_at

    log = tmp_path / "resumed.log"
    second = torchrun(launch, config, prepared, 2, log, "--ckpt_path", "last")
    out = second.communicate(timeout=CHILD_TIMEOUT)[0]
    assert second.returncode == 0, log.read_text()[-3000:]
    lines = metric_lines(out)
    assert [line["step"] for line in lines] == list(range(stopped_at + 1, steps + 1))
    assert sorted(p.name for p in (tmp_path / "output" / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=50.ckpt"]

    losses, module = accumulate_same_rows(config, rank_rows(prepared, 2, GLOBAL_BATCH // 2, seed=5), steps)
    assert [line["loss"] for line in seen + lines] == pytest.approx(losses, rel=1e-5)
    assert_same_weights(tmp_path / "output" / "model", module)


def slurm_tasks(config: Path, rows: Path, tmp_path: Path, name: str, *extra: str) -> list[subprocess.Popen]:
    """train.py as srun starts it on one node with two tasks (SLURM's variables, one process each), in
    one process group: what SLURM's --signal and a preemption signal."""
    port = str(free_port())
    tasks = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_NAME": "gpt", "SLURM_JOB_ID": "45",
               "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODELIST": "127.0.0.1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = [sys.executable, "train.py", "fit", "--config", str(config), "--data.source", "litdata",
                   "--data.path", str(rows), "--microbatch", "2", *extra]
        with (tmp_path / f"{name}-{rank}.log").open("w") as stderr:
            group = {"process_group": tasks[0].pid if tasks else 0}
            tasks.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                          env=env, **group))
    return tasks


def test_slurms_signal_to_every_process_of_the_step_stops_at_a_checkpoint_and_resumes_exactly(prepared, tmp_path):
    steps = 60
    config = write_config(tmp_path, steps, {"data.loader_workers": 1})
    tasks = slurm_tasks(config, prepared, tmp_path, "stopped")
    seen = []
    for line in tasks[0].stdout:
        seen.append(json.loads(line))
        if len(seen) == 2:
            os.killpg(tasks[0].pid, signal.SIGTERM)  # the tasks and their loader workers
    statuses = [task.wait(timeout=CHILD_TIMEOUT) for task in tasks]
    errs = [(tmp_path / f"stopped-{rank}.log").read_text() for rank in (0, 1)]
    assert statuses == [2, 2], errs[0][-3000:] + errs[1][-3000:]  # what srun reports: the highest
    assert f"error: stopped by SIGTERM after optimizer step {seen[-1]['step']}; checkpoint " in errs[0]
    assert (tmp_path / "output" / "checkpoints" / "stopped.ckpt").is_file()

    tasks = slurm_tasks(config, prepared, tmp_path, "resumed", "--ckpt_path", "last")
    outputs = [task.communicate(timeout=CHILD_TIMEOUT)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], (tmp_path / "resumed-0.log").read_text()[-3000:]
    lines = metric_lines(outputs[0])
    assert [line["step"] for line in lines] == list(range(seen[-1]["step"] + 1, steps + 1))
    losses, module = accumulate_same_rows(config, rank_rows(prepared, 2, GLOBAL_BATCH // 2, seed=5), steps)
    assert [line["loss"] for line in seen + lines] == pytest.approx(losses, rel=1e-5)
    assert_same_weights(tmp_path / "output" / "model", module)


def test_a_second_sigterm_during_the_export_leaves_neither_the_staging_folder_nor_the_lock(prepared, tmp_path):
    """One process from the prepared rows (Lightning's DDP path, no torchrun): SIGTERM, then SIGTERM again
    while the export writes. The second ends the process at once, as the signal's default does, and
    what a finished run would have removed (the export's staging folder, the output folder's lock) is
    removed first."""
    config = write_config(tmp_path, 2)
    script = write_slow_export_script(tmp_path / "slow_export.py")
    command = [sys.executable, str(script), "fit", "--config", str(config), "--data.source", "litdata",
               "--data.path", str(prepared), "--microbatch", "2"]
    output = tmp_path / "output"
    with (tmp_path / "run.log").open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    returncode = signal_twice_during_the_export(process, output, lambda: (tmp_path / "run.log").read_text()[-3000:],
                                                CHILD_TIMEOUT)
    assert returncode == -signal.SIGTERM, (tmp_path / "run.log").read_text()[-3000:]
    assert sorted(p.name for p in output.iterdir() if p.name.startswith(".")) == []
    assert not (output / "model").exists()
