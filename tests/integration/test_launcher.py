"""Data parallelism on CPU (gloo): the feeder owns stdin, workers train, results equal one process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, as_args, tiny

# The tiny model on the command line, without validation.
TINY = ["--config", "conf/smoke.yaml", *as_args(tiny({
    "optim.warmup_steps": 1, "metrics.interval_seconds": 0.2, "trainer.val_every_steps": 0,
}))]


def sample_records(n: int | None = None) -> bytes:
    lines = (ROOT / "data/sample.jsonl").read_bytes().splitlines(keepends=True)
    return b"".join(lines[:n])


def run_train(tmp_path: Path, name: str, args: list[str], stdin: bytes, timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / name
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(out), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, *args], input=stdin, env=env,
                            capture_output=True, timeout=timeout, cwd=tmp_path)
    return result, out


@pytest.mark.parametrize("family", [[], ["--model.family", "llama", "--model.n_kv_head", "1"]], ids=["gpt2", "llama"])
def test_two_workers_reach_the_weights_of_one_process(tmp_path, family):
    records = sample_records(600)
    every_step = ["--trainer.max_steps", "3", "--metrics.interval_seconds", "0", *family]
    single, single_out = run_train(tmp_path, "single", [*every_step, "--microbatch", "8"], records)
    assert single.returncode == 0, single.stderr.decode()[-3000:]
    parallel, parallel_out = run_train(
        tmp_path, "parallel", [*every_step, "--microbatch", "4", "--trainer.devices", "2", "--log_level", "debug"],
        records)
    assert parallel.returncode == 0, parallel.stderr.decode()[-3000:]
    assert b"2 worker(s) started: forked from this process" in parallel.stderr  # trainer.worker_start: auto
    told = parallel.stderr.decode()  # the run's story once (rank 0), host memory per rank
    assert told.count("] finished: 3 optimizer steps") == told.count("] model: ") == 1
    assert "GLOBAL_RANK: 1" not in told  # Lightning's own per-rank line too
    assert "host memory, rank 1, update 1" in told
    # The feeder marks every update (interval 0): both ranks report each one, and rank 0's lines carry
    # the global loss of all its rows, as the single process's do.
    lines = {name: [json.loads(line) for line in run.stdout.splitlines()] for name, run in
             (("single", single), ("parallel", parallel))}
    assert [line["step"] for line in lines["parallel"]] == [1, 2, 3] == [line["step"] for line in lines["single"]]
    for one, two in zip(lines["single"], lines["parallel"]):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
    a = load_file(single_out / "model" / "model.safetensors")
    b = load_file(parallel_out / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    # Gradients summed in another order differ in the last bits, and Adam rescales small gradients,
    # so allow 1 % of one step (the smoke config's lr is 3e-3); a different batch moves weights ~100x more.
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=3e-5, msg=name)
    record = json.loads((parallel_out / "model" / "run_record.json").read_text())
    assert record["world_size"] == 2 and record["batch"]["microbatch"] == 4 and record["optimizer_steps"] == 3
    assert record["input"]["source"] == "stdin"
    # One device through the worker path (trainer.worker_processes), started as a fresh interpreter
    # rather than forked: the same computation, the same weights.
    worker, worker_out = run_train(
        tmp_path, "worker", [*every_step, "--microbatch", "8", "--trainer.worker_processes", "true",
                             "--trainer.worker_start", "exec"], records
    )
    assert worker.returncode == 0, worker.stderr.decode()[-3000:]
    assert b"1 worker(s) started: fresh interpreters" in worker.stderr
    c = load_file(worker_out / "model" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(c[name], a[name], rtol=0, atol=0, msg=name)
    def losses(result):
        return [(line["step"], line.get("loss")) for line in map(json.loads, result.stdout.splitlines())]

    assert losses(worker) == losses(single) and len(losses(single)) >= 3
    # Adam hides a wrongly scaled gradient from the weights; the reported global loss and
    # pre-clip gradient norm of every update do not.
    steps = {}
    for run in (single, parallel):
        lines = [json.loads(line) for line in run.stdout.decode().splitlines()]
        steps[run is parallel] = [(line["step"], line["loss"], line["grad_norm"]) for line in lines if "loss" in line]
    assert [s for s, _, _ in steps[True]] == [1, 2, 3] == [s for s, _, _ in steps[False]]
    for (_, loss_a, norm_a), (_, loss_b, norm_b) in zip(steps[False], steps[True]):
        assert loss_b == pytest.approx(loss_a, rel=1e-5) and norm_b == pytest.approx(norm_a, rel=1e-4)


@pytest.mark.parametrize("records", [130, 391])
def test_end_of_input_at_any_record_count_ends_every_rank_without_a_hang(tmp_path, records):
    result, out = run_train(tmp_path, "eoi", ["--trainer.max_steps", "-1", "--optim.schedule", "constant",
                                              "--microbatch", "4", "--trainer.devices", "2"],
                            sample_records(records), timeout=180)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    record = json.loads((out / "model" / "run_record.json").read_text())
    assert record["input"]["end_of_input"] and record["optimizer_steps"] == record["input"]["updates"] > 0


def test_a_worker_that_raises_fails_the_run_with_its_error(tmp_path):
    start = time.monotonic()
    # quack's MLP asked for by name in compiled CPU training passes the config's checks and fails where the
    # kernels are chosen, when each worker builds its model.
    result, out = run_train(tmp_path, "raises", ["--compute.mlp", "quack", "--trainer.compile", "true",
                                                 "--trainer.devices", "2", "--microbatch", "4"], sample_records(200),
                            timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 90
    stderr = result.stderr.decode()
    assert "worker rank" in stderr and "compute.mlp is 'quack' but it cannot run" in stderr
    assert not (out / "model").exists()


def _workers_of(process: psutil.Process) -> list[psutil.Process]:
    """Workers started either way: a fresh interpreter's command line says worker, a fork's name does."""
    return [c for c in process.children(recursive=True) if "worker" in c.cmdline() or c.name().endswith("-worker")]


def _training_on_two_workers(tmp_path, *extra) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """train.py on 2 CPU ranks with a long input, once training is under way (a metric line arrived)."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    args = [*TINY, "--trainer.max_steps", "100000", "--optim.schedule", "constant", "--microbatch", "4",
            "--trainer.devices", "2", *extra]
    records = tmp_path / "records.jsonl"
    records.write_bytes(sample_records() * 20)
    with records.open("rb") as stdin:
        feeder = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], stdin=stdin, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    if not feeder.stdout.readline():  # it ended before its first metric line: say why
        feeder.kill()
        pytest.fail(f"train.py ended before training, exit {feeder.wait()}: {feeder.stderr.read().decode()[-3000:]}")
    workers = _workers_of(psutil.Process(feeder.pid))
    assert len(workers) == 2
    return feeder, workers


@pytest.mark.parametrize("fault", ["kill-worker", "sigterm-feeder", "sigint-twice"])
def test_a_killed_worker_or_a_terminated_feeder_stops_everything_promptly(tmp_path, fault):
    feeder, workers = _training_on_two_workers(tmp_path)
    start = time.monotonic()
    if fault == "kill-worker":
        workers[1].kill()
    elif fault == "sigterm-feeder":
        feeder.send_signal(signal.SIGTERM)
    else:  # Ctrl-C, then again before the graceful stop is over: stop at once
        feeder.send_signal(signal.SIGINT)
        time.sleep(0.2)
        feeder.send_signal(signal.SIGINT)
    _, stderr = feeder.communicate(timeout=60)
    assert feeder.returncode != 0 and time.monotonic() - start < 30
    expected = {"kill-worker": "worker rank 1 exited", "sigterm-feeder": "SIGTERM",
                "sigint-twice": "error: received SIGINT; stopping the workers"}[fault]
    assert expected in stderr.decode()
    if fault == "sigint-twice":  # the ranks' reactions to being stopped (a lost peer) are not shown as errors
        assert "Traceback" not in stderr.decode()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    if fault == "sigterm-feeder":  # every rank stopped at the same update and rank 0 exported it
        record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
        assert record["status"] == "partial: SIGTERM" and record["optimizer_steps"] >= 1
        assert (tmp_path / "out" / "model" / "model.safetensors").stat().st_size > 0


def test_a_graceful_stop_that_a_stuck_rank_holds_up_ends_at_its_deadline(tmp_path):
    """SIGTERM asks every rank to finish its update; a rank that cannot (stopped here, as one blocked on
    a pipe or a device would be) must not hold the job: at trainer.stop_grace_seconds all are killed."""
    feeder, workers = _training_on_two_workers(tmp_path, "--trainer.stop_grace_seconds", "4")
    workers[1].suspend()
    start = time.monotonic()
    feeder.send_signal(signal.SIGTERM)
    try:
        _, stderr = feeder.communicate(timeout=60)
    finally:
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.resume()
    assert feeder.returncode != 0 and 4 <= time.monotonic() - start < 30
    assert "did not end within trainer.stop_grace_seconds: rank(s) " in stderr.decode()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_the_probe_runs_on_every_device_under_the_training_setup(tmp_path):
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "probe", *TINY, "--trainer.devices", "2", "--microbatch", "4"],
        stdin=subprocess.DEVNULL, env=env, capture_output=True, timeout=180, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    stderr = result.stderr.decode()
    assert stderr.count('probe figures: {"microbatch": 4, "steps": 2}') == 2  # one per rank, two optimizer steps each
    assert stderr.count("probe passed: microbatch 4 of worst-case rows trained 2 optimizer steps on rank ") == 2
    assert stderr.count("] kernels: attention: ") == 1  # the rest is said once, by rank 0
    assert result.stdout == b"" and not (tmp_path / "out").exists()


def test_workers_fork_only_from_a_process_that_has_not_initialized_cuda():
    from runtime import launcher

    assert not launcher.cuda_driver_initialized()  # this CPU process never loaded the driver
    assert launcher.resolve_start("auto") == "fork" and launcher.resolve_start("exec") == "exec"
    assert launcher.resolve_start("auto", cuda_initialized=True) == "exec"  # a process that has
    with pytest.raises(RuntimeError, match="already initialized CUDA"):
        launcher.resolve_start("fork", cuda_initialized=True)
    with pytest.raises(ValueError, match="worker_start"):
        launcher.resolve_start("spawn")


class _Exits:
    """A worker handle that reports the given exit codes on successive polls (the last one from then on)."""

    def __init__(self, *codes):
        self.codes = list(codes)

    def poll(self):
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]


@pytest.mark.parametrize("killed_seen", ["in the same poll", "a poll later"])
def test_a_failure_report_names_the_killed_rank_before_the_peers_it_brought_down(killed_seen):
    """A peer that loses its collective partner errors out too, sometimes before the killed rank's
    exit is visible: the report must lead with the rank killed by a signal, not with the lowest rank."""
    from collections import deque

    from runtime import launcher

    killed = _Exits(-signal.SIGKILL) if killed_seen == "in the same poll" else _Exits(None, -signal.SIGKILL)
    tails = [deque(["gloo: a remote worker crashed"]), deque([]), deque([])]
    with pytest.raises(launcher.WorkerFailed) as failure:
        launcher.wait_for_workers([_Exits(1), killed, _Exits(None)], tails)
    message = str(failure.value)
    assert message.startswith("worker rank 1 exited with code -9 (killed by SIGKILL)")
    assert message.endswith("then rank 0 exited with code 1")


def test_a_failure_report_names_the_rank_a_signal_stopped_before_the_peer_left_in_its_collective():
    """Both ranks of a probe get SIGTERM; one leaves fit at once and exits STOPPED_EXIT, while the other fails
    in the collective its peer left ("gloo: collective mismatch"). The report quotes the stopped rank."""
    from collections import deque

    from runtime import launcher

    tails = [deque(["RuntimeError: gloo: collective mismatch"]), deque(["error: rank 1: received SIGTERM during the probe"])]
    with pytest.raises(launcher.WorkerFailed) as failure:
        launcher.wait_for_workers([_Exits(1), _Exits(None, launcher.STOPPED_EXIT)], tails)
    message = str(failure.value)
    assert message.startswith("worker rank 1 exited with code 143:\nerror: rank 1: received SIGTERM during the probe")
    assert message.endswith("then rank 0 exited with code 1")
