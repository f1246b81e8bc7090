"""Signals and limits: an interrupted run keeps what it trained; an impossible output budget is refused early."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import train
from runtime.batch_split import BatchSplit
from config import ConfigError
from runtime import output_folder, training_run
from config import load_config

from tests.helpers import (ROOT, BrokenAfter, as_args, as_dotlist, signal_twice_during_the_export, tiny,
                           write_slow_export_script)

# The tiny model, training until stopped (the faults below stop it) at a constant rate.
RUN = tiny({"trainer.max_steps": 100000, "optim.schedule": "constant", "metrics.interval_seconds": 0.2,
            "trainer.val_every_steps": 0})
ARGS = ["--config", "conf/smoke.yaml", *as_args(RUN)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_training_exports_the_model_so_far_and_exits_non_zero(tmp_path, sig):
    records = tmp_path / "records.jsonl"
    records.write_bytes((ROOT / "data/sample.jsonl").read_bytes() * 20)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    with records.open("rb") as stdin:
        process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *ARGS], stdin=stdin, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        assert process.stdout.readline()  # a metric line: training is under way
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert signal.Signals(sig).name in stderr.decode()
    model = tmp_path / "out" / "model"
    record = json.loads((model / "run_record.json").read_text())
    assert record["status"] == f"partial: {signal.Signals(sig).name}" and record["optimizer_steps"] >= 1
    lines = [json.loads(line) for line in (tmp_path / "out" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == record["optimizer_steps"]  # both signals report the last interval
    assert all({"loss", "tokens_per_second"} <= line.keys() for line in lines)
    assert (model / "model.safetensors").stat().st_size > 0


def test_an_output_that_cannot_fit_the_budget_is_refused_before_training():
    cfg = load_config("conf/config.yaml", ["trainer.checkpoint_every_steps=100"])
    with pytest.raises(ConfigError, match="GiB") as error:
        output_folder.check_output_budget(cfg)
    assert "checkpoint" in str(error.value)
    output_folder.check_output_budget(load_config("conf/config.yaml"))  # the export alone (0.5 GB) fits
    output_folder.check_output_budget(load_config("conf/config.yaml", ["observe.profile_update=20", "observe.memory_update=30"]))
    endless_profile = load_config("conf/config.yaml", ["observe.profile_update=20", "observe.profile_updates=200"])
    with pytest.raises(ConfigError, match="observation files"):
        output_folder.check_output_budget(endless_profile)  # 200 profiled updates: about 3.2 GiB of traces


def test_max_time_keeps_the_export_reserve_out_of_the_training_loop():
    from datetime import timedelta

    from config import ConfigError

    cfg = load_config("conf/smoke.yaml", ["trainer.max_time=00:01:00:00", "trainer.export_reserve_seconds=90"])
    assert cfg.trainer.time_limit() == timedelta(minutes=58, seconds=30)
    assert load_config("conf/smoke.yaml").trainer.time_limit() is None
    with pytest.raises(ConfigError, match="leaves no training time"):
        load_config("conf/smoke.yaml", ["trainer.max_time=00:00:00:30"])
    with pytest.raises(ConfigError, match="DD:HH:MM:SS"):
        load_config("conf/smoke.yaml", ["trainer.max_time=an hour"])


def test_max_time_stops_training_and_the_model_is_still_exported(tmp_path):
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    records = (ROOT / "data/sample.jsonl").read_bytes() * 20
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *ARGS, "--trainer.max_time", "00:00:00:12",
         "--trainer.export_reserve_seconds", "4"],
        input=records, env=env, capture_output=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == "completed" and record["optimizer_steps"] >= 1
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    # 12 s less the 4 s reserve. Lightning looks at the clock after each update, so the last one may end past 8 s
    # by about an update's time, which on two busy cores (the tests' workers) can pass half a second; without the
    # reserve training would run to 12 s.
    update_seconds = max(((b["elapsed_seconds"] - a["elapsed_seconds"]) / (b["step"] - a["step"])
                          for a, b in zip(lines, lines[1:]) if b["step"] > a["step"]),
                         default=lines[-1]["elapsed_seconds"] / lines[-1]["step"])  # one line: its own mean
    assert lines[-1]["elapsed_seconds"] <= 8 + max(0.5, 2 * update_seconds), (lines[-1], update_seconds)


def test_max_time_ends_a_run_whose_input_went_silent_and_the_model_is_exported(tmp_path):
    """A few updates' worth of records, then stdin stays open and silent: Lightning waits inside its
    fetch, where it never checks max_time, so the feeder's own deadline must end the stream."""
    process = start_training(tmp_path, "--trainer.max_steps", "-1", "--optim.schedule", "constant",
                             "--trainer.max_time", "00:00:00:14", "--trainer.export_reserve_seconds", "4",
                             "--data.tokenize_batch_docs", "8")
    started = time.monotonic()
    Lines(process.stdout)  # drained, so that a full pipe never blocks the process
    stderr = Lines(process.stderr)
    process.stdin.write(sample(120))  # a few updates beyond what the shuffle and tokenizer buffers hold back
    process.stdin.flush()  # and left open: communicate() would close it
    returncode, text = wait_with_stdin_open(process, stderr, timeout=90)
    assert returncode == 0, text.decode()[-3000:]
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == "completed" and record["optimizer_steps"] >= 1
    # The run's own clock, not the interpreter's start on busy cores: 14 s, then the export.
    assert record["wall_seconds"] < 14 + 30 and time.monotonic() - started < 90
    # Records too few for one update, then silence: the time limit ends the run, which fails (no model).
    process = start_training(tmp_path, "--trainer.max_time", "00:00:00:10", "--trainer.export_reserve_seconds", "4",
                             output=tmp_path / "none")
    process.stdin.write(sample(3))
    process.stdin.flush()
    try:
        _, stderr = (stream.read() for stream in (process.stdout, process.stderr))
        assert process.wait(timeout=90) == 2
    finally:
        process.kill()
        process.stdin.close()
    assert b"before the input delivered one complete update" in stderr and b"3 records (" in stderr
    assert not (tmp_path / "none/model").exists()


# ----------------------------------------------------------------------------- driven adversarially


def start_training(tmp_path, *extra, output: Path | None = None) -> subprocess.Popen:
    """train.py on the tiny config with stdin a pipe the test writes to (and may leave open)."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(output or tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    # A small shuffle buffer, so that documents reach training while the pipe stays open.
    extra = ("--data.shuffle_buffer_docs", "16", *extra)
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *ARGS, *extra], stdin=subprocess.PIPE, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)


def sample(lines: int) -> bytes:
    with (ROOT / "data/sample.jsonl").open("rb") as f:
        return b"".join(line for _, line in zip(range(lines), f))


class Lines:
    """Collects a pipe's lines on a thread, so the test can wait for them without blocking."""

    def __init__(self, pipe) -> None:
        self.lines: list[bytes] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(pipe.readline, b"")), daemon=True)
        self.thread.start()

    def wait_until_quiet(self, quiet_seconds: float, timeout: float = 90) -> None:
        """Until at least one line came and none for ``quiet_seconds`` (training waits for input)."""
        deadline, seen, since = time.monotonic() + timeout, -1, time.monotonic()
        while time.monotonic() < deadline:
            if len(self.lines) != seen:
                seen, since = len(self.lines), time.monotonic()
            elif seen > 0 and time.monotonic() - since >= quiet_seconds:
                return
            time.sleep(0.1)
        raise AssertionError(f"no quiet moment within {timeout} s: {len(self.lines)} lines")


def wait_with_stdin_open(process: subprocess.Popen, stderr: Lines, timeout: float) -> tuple[int, bytes]:
    """The exit code of a process whose stdin is left open while it runs, and its whole stderr; it is
    killed and its stdin closed afterwards, whatever happened (a TimeoutExpired propagates)."""
    try:
        returncode = process.wait(timeout=timeout)
    finally:
        process.kill()
        process.stdin.close()
    stderr.thread.join(timeout=10)
    return returncode, b"".join(stderr.lines)


def test_a_hostile_deeply_nested_record_is_skipped_and_counted(tmp_path):
    hostile = b'{"text": "ok", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}\n"
    data = sample(400) + hostile + sample(400)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, "--trainer.max_steps", "-1"], input=data,
                            env=env, capture_output=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["input"]["rejected"] == {"nested_too_deeply": 1} and record["input"]["end_of_input"]
    assert record["status"] == "completed" and record["optimizer_steps"] == record["input"]["updates"] > 20


def test_leading_bad_records_and_one_the_fast_tokenizer_gives_up_on_cost_only_themselves(tmp_path):
    """100,000 empty texts, then a valid record holding a million spaces (tiktoken's regex gives up on
    it), then text: the run trains on everything usable and exits 0."""
    spaces = json.dumps({"text": "start" + " " * 1_000_500 + "end"}).encode() + b"\n"
    data = b'{"text": ""}\n' * 100_000 + spaces + sample(400)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="", RUST_BACKTRACE="0")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, "--trainer.max_steps", "3"], input=data,
                            env=env, capture_output=True, timeout=300, cwd=tmp_path)
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-3000:]
    assert "first usable record at line 100001, after 100000 skipped (100000 empty_text)" in stderr
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == "completed" and record["optimizer_steps"] == 3
    assert record["input"]["rejected"] == {"empty_text": 100_000}
    assert record["input"]["accepted"] == record["input"]["records"] - 100_000 > 0


WRITER = """
import sys, time
lines = open(sys.argv[1], "rb").readlines()
out = sys.stdout.buffer

def trickle(records):
    for line in records:
        out.write(line)
        out.flush()
        time.sleep(0.1)

trickle(lines[:1])
sys.stdin.readline()  # go: the trainer is reading
trickle(lines[1:30])
time.sleep(5)  # a pause, stdin open
trickle(lines[30:60])
sys.stdin.read()  # stdin stays open until the test closes this writer's input
"""


def test_a_slow_stream_trains_as_it_arrives_and_reports_its_waits(tmp_path):
    """Records trickle in from a writer process, then pause, then trickle again: metric lines come
    before the end of the input, and the time training waited for records is reported as waiting.
    Throughput is the contract's, work over the wall clock of each interval: over the lines it adds
    up to the tokens trained, waits included; the time computing has a figure of its own."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT / "data/sample.jsonl")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *ARGS, "--model.max_seq_len", "32",
                                "--trainer.max_steps", "-1"], stdin=writer.stdout, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    writer.stdout.close()  # the trainer's now
    try:
        stdout, stderr = Lines(process.stdout), Lines(process.stderr)
        deadline = time.monotonic() + 90
        while not any(b"reading records from stdin" in line for line in stderr.lines):
            assert time.monotonic() < deadline and process.poll() is None, b"".join(stderr.lines).decode()[-3000:]
            time.sleep(0.1)
        writer.stdin.write(b"go\n")
        writer.stdin.flush()
        while not any(json.loads(line).get("training_wait_seconds", 0) > 0 for line in stdout.lines):
            assert time.monotonic() < deadline and process.poll() is None, b"".join(stderr.lines).decode()[-3000:]
            time.sleep(0.1)
        assert writer.poll() is None  # the input has not ended: training went on while it trickled
        waited = [json.loads(line) for line in stdout.lines if json.loads(line)["training_wait_seconds"] > 0][0]
        writer.stdin.close()  # the writer exits: the end of the input
        assert process.wait(timeout=90) == 0, b"".join(stderr.lines).decode()[-3000:]
    finally:
        process.kill()
        writer.kill()
    assert waited["step"] >= 2 and waited["elapsed_seconds"] > waited["training_wait_seconds"] > 0
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == "completed" and record["input"]["records"] == 60
    assert record["input"]["training_wait_seconds"] >= waited["training_wait_seconds"] - 0.001  # rounded to ms
    lines = [json.loads(line) for line in stdout.lines]
    starts = [0.0] + [line["elapsed_seconds"] for line in lines[:-1]]
    delivered = sum(line["tokens_per_second"] * (line["elapsed_seconds"] - start) for line, start in zip(lines, starts))
    assert delivered == pytest.approx(record["summary"]["total_target_tokens"], rel=0.005), (delivered, len(lines))
    assert waited["tokens_per_compute_second"] > 1.2 * waited["tokens_per_second"]


def test_an_input_failure_after_training_started_exports_the_model_so_far(tmp_path, monkeypatch):
    from runtime import launcher

    monkeypatch.setattr("sys.stdout", io.StringIO())
    cfg = load_config("conf/smoke.yaml", [*as_dotlist(RUN), "trainer.max_steps=-1",
                                          "data.shuffle_buffer_docs=16", f"output.root={tmp_path / 'out'}"])
    stdin = io.BufferedReader(BrokenAfter(sample(1200)))
    with pytest.raises(launcher.InputFailed, match="Input/output error.*partial"):
        training_run.run_training(cfg, BatchSplit(4, 8, 1, train.EFFECTIVE_BATCH_SIZE), stdin=stdin)
    model = tmp_path / "out" / "model"
    record = json.loads((model / "run_record.json").read_text())
    assert record["status"].startswith("partial: input error: OSError") and record["optimizer_steps"] >= 1
    assert (model / "model.safetensors").stat().st_size > 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_input_is_silent_exports_and_exits(tmp_path, sig):
    process = start_training(tmp_path, "--trainer.max_steps", "1000")
    process.stdin.write(sample(600))
    process.stdin.flush()  # and left open: the producer has gone quiet
    stdout = Lines(process.stdout)
    stdout.wait_until_quiet(3.0)
    process.send_signal(sig)
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode not in (0, None)
    assert signal.Signals(sig).name in stderr.decode()
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == f"partial: {signal.Signals(sig).name}" and record["optimizer_steps"] >= 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_first_update_ends_the_wait_for_input(tmp_path, sig):
    """Lightning fetches the first batch before ``on_train_start``; a signal while that fetch waits
    on a silent input must still end the run, promptly and non-zero, with nothing exported."""
    process = start_training(tmp_path, "--trainer.max_steps", "1000")
    process.stdin.write(sample(3))  # too few records for one update; stdin stays open and silent
    process.stdin.flush()
    stderr = Lines(process.stderr)
    deadline = time.monotonic() + 90
    while not any(b"reading records from stdin" in line for line in stderr.lines):
        assert time.monotonic() < deadline and process.poll() is None, b"".join(stderr.lines).decode()[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # into the first fetch
    process.send_signal(sig)
    returncode, text = wait_with_stdin_open(process, stderr, timeout=30)
    message = text.decode()
    assert returncode not in (0, None) and signal.Signals(sig).name in message, message[-3000:]
    assert "nothing was trained" in message and not (tmp_path / "out" / "model").exists()


def test_a_run_that_ends_while_stdin_is_still_open_exits_zero(tmp_path):
    process = start_training(tmp_path, "--trainer.max_steps", "2", "--data.tokenize_batch_docs", "8")
    assert_exits_zero_with_stdin_open(process)
    assert json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())["status"] == "completed"


def assert_exits_zero_with_stdin_open(process: subprocess.Popen) -> None:
    """Records for more than two updates beyond what the shuffle and tokenizer buffers hold back, on a
    stdin that stays open: the reader then waits on a silent stdin while training ends, and the
    process must still exit 0 (no abort at shutdown)."""
    process.stdin.write(sample(120))
    process.stdin.flush()  # 51 kB fit the pipe's buffer; left open until the process has exited
    Lines(process.stdout)  # drained, so that a full pipe never blocks the process
    returncode, text = wait_with_stdin_open(process, Lines(process.stderr), timeout=120)
    assert returncode == 0, text.decode()[-3000:]
    assert b"Fatal Python error" not in text


@pytest.mark.parametrize("stdin", ["empty", "closed"])
def test_an_empty_or_closed_stdin_is_an_error_not_the_bundled_sample(tmp_path, stdin):
    """...and a run that trained nothing creates no output folder (nor the folders above it)."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "runs" / "out"), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *ARGS], stdin=subprocess.DEVNULL, env=env, capture_output=True,
        timeout=120, cwd=tmp_path, preexec_fn=(lambda: os.close(0)) if stdin == "closed" else None,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr[-3000:]
    assert f"stdin is {stdin}" in stderr and "--data.source sample" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "runs").exists()


def test_a_refused_run_leaves_no_output_folder_it_created_and_keeps_one_that_was_there(tmp_path):
    root = tmp_path / "runs" / "a"
    with pytest.raises(ConfigError, match="refused"):
        with output_folder.claimed_output(root):
            raise ConfigError("refused")
    assert not (tmp_path / "runs").exists()
    root.mkdir(parents=True)
    with output_folder.claimed_output(root):
        pass
    assert root.is_dir() and not any(root.iterdir())
    with output_folder.claimed_output(tmp_path / "runs" / "b"):
        (tmp_path / "runs" / "b" / "result").write_text("kept")
    assert (tmp_path / "runs" / "b" / "result").read_text() == "kept"


def test_a_second_run_on_the_same_output_is_refused(tmp_path):
    first = start_training(tmp_path, "--trainer.max_steps", "1000")
    first.stdin.write(sample(600))
    first.stdin.flush()
    Lines(first.stdout).wait_until_quiet(1.0)
    try:
        env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
        second = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS], input=sample(300), env=env,
                                capture_output=True, timeout=120, cwd=tmp_path)
        assert first.poll() is None  # untouched by the second
    finally:
        first.kill()
        first.wait()
    stderr = second.stderr.decode()
    assert second.returncode == 2 and f"another run (pid {first.pid})" in stderr and "Traceback" not in stderr
    assert second.stdout == b""


def test_a_failed_run_never_leaves_an_earlier_model_looking_like_its_result(tmp_path):
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, str(ROOT / "train.py"), *ARGS]
    first = subprocess.run([*command, "--trainer.max_steps", "2"], input=sample(1400), env=env, capture_output=True,
                           timeout=120, cwd=tmp_path)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    second = subprocess.run(command, input=sample(3), env=env, capture_output=True, timeout=120, cwd=tmp_path)
    assert second.returncode == 2 and b"before one complete update" in second.stderr
    out = tmp_path / "out"
    assert not (out / "model").exists()
    assert json.loads((out / "previous-model" / "run_record.json").read_text())["optimizer_steps"] == 2


@pytest.mark.parametrize("output, says", [("file", "a-file is a file"), ("under-file", "lies under {file}, which is a file"),
                                          ("/sys/runfab-output", "cannot write")])
def test_an_output_root_that_cannot_hold_the_output_is_refused_before_training(tmp_path, output, says):
    if output in ("file", "under-file"):
        file = tmp_path / "a-file"
        file.write_text("not a folder")
        output, says = (file if output == "file" else file / "out"), says.format(file=file)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(output), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS], input=sample(300), env=env,
                            capture_output=True, timeout=120, cwd=tmp_path)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and says in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "reading records" not in stderr  # refused before the input was touched


def test_malformed_yaml_is_a_clear_error(tmp_path):
    from config import ConfigError

    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  n_layer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(path)], stdin=subprocess.DEVNULL,
                            env=env, capture_output=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and b"not valid YAML" in result.stderr and b"Traceback" not in result.stderr


@pytest.mark.parametrize("microbatch, accumulation", [("8", 4), (8.0, 4.0), (True, 32), (8, None)])
def test_hook_arguments_of_the_wrong_type_are_refused_at_the_door(microbatch, accumulation):
    from config import ConfigError

    with pytest.raises(ConfigError, match="whole number"):
        BatchSplit(microbatch, accumulation, 1, train.EFFECTIVE_BATCH_SIZE)


def test_schedule_messages_name_what_the_user_set(tmp_path):
    from config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.warmup_steps \(3\).*optim.decay_steps \(2\) \(it follows "
                                          r"trainer.max_steps\)"):
        load_config("conf/smoke.yaml", ["trainer.max_steps=2"])
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cfg = load_config(empty)  # the defaults alone make a valid run: decay follows max_steps
    assert cfg.optim.decay_steps == cfg.trainer.max_steps


def test_the_hook_returns_and_the_process_exits_zero_while_stdin_is_still_open(tmp_path):
    from omegaconf import OmegaConf

    config = tmp_path / "tiny.yaml"  # the tiny command-line run as a config file, for the hook
    dotlist = as_dotlist(RUN) + ["trainer.max_steps=2", "data.shuffle_buffer_docs=16",
                                                          "data.tokenize_batch_docs=8"]
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(ROOT / "conf/smoke.yaml"), OmegaConf.from_dotlist(dotlist)), config)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="", RUNFAB_CONFIG=str(config))
    hook = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import train; train.train(4, 8)"
    process = subprocess.Popen([sys.executable, "-c", hook], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    assert_exits_zero_with_stdin_open(process)
    assert json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())["optimizer_steps"] == 2


@pytest.mark.parametrize("overrides, says", [
    (["compute.attention=bogus", "compute.loss_chunk_tokens=-1"], ["compute.attention must be one of auto, fa4",
                                                                 "compute.loss_chunk_tokens must be >= 0"]),
    (["model.n_embd=100", "model.n_head=3"], ["divisible by model.n_head"]),
    (["optim.schedule=linear"], ["optim.schedule must be one of cosine, constant, wsd"]),
    (["data.source=web", "metrics.interval_seconds=-1"], ["data.source must be one of auto, stdin, sample",
                                                         "metrics.interval_seconds must be >= 0"]),
])
def test_each_section_reports_its_problems_naming_the_choices(overrides, says):
    from config import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config("conf/smoke.yaml", overrides)
    for phrase in says:
        assert phrase in str(error.value)


@pytest.mark.parametrize("folder", ["model", "run", "checkpoints"])
def test_an_earlier_runs_results_are_moved_aside_and_never_deleted(tmp_path, caplog, folder):
    """Three runs on one output folder: the second run's model (or metric lines, or checkpoints) is in
    previous-<folder>/, the first's (with a file the user added to it) is kept as previous-<folder>.1/
    instead of being deleted or mixed with a later run's files."""
    from callbacks.owned_folders import mark
    from runtime.output_folder import claimed_output

    root = tmp_path / "out"
    for run in (1, 2, 3):
        with claimed_output(root):
            assert not (root / folder).exists()
            mark(root / folder)  # as a run does with each folder it writes
            (root / folder / "run.txt").write_text(str(run))
        if run == 1:
            (root / folder / "notes.txt").write_text("mine")
    assert (root / folder / "run.txt").read_text() == "3"
    assert (root / f"previous-{folder}" / "run.txt").read_text() == "2"
    assert (root / f"previous-{folder}.1" / "run.txt").read_text() == "1"
    assert (root / f"previous-{folder}.1" / "notes.txt").read_text() == "mine"
    assert caplog.records[-1].getMessage() == (  # the third run says where everything went, in one line
        f"an earlier run's results were moved aside, never deleted: {root}/previous-{folder} -> "
        f"{root}/previous-{folder}.1, {root}/{folder} -> {root}/previous-{folder}")


@pytest.mark.parametrize("devices", [1, 2])
def test_a_reader_of_stdout_that_goes_away_costs_the_metric_lines_not_the_run(tmp_path, devices):
    """`python train.py | head -1`: the pipe breaks after the first line. Training, the export and the
    exit code must not depend on it (before: a BrokenPipeError ended one process with nothing exported,
    and with workers rank 0 blocked on a full pipe, hanging every rank)."""
    process = start_training(tmp_path, "--trainer.max_steps", "60", "--optim.schedule", "constant",
                             "--metrics.interval_seconds", "0", "--trainer.devices", str(devices))
    stderr = Lines(process.stderr)

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(sample(1400))
            process.stdin.close()

    threading.Thread(target=feed, daemon=True).start()  # more than a pipe's buffer: written beside the reading
    try:
        assert process.stdout.readline().startswith(b"{")
        process.stdout.close()  # the reader is gone
        assert process.wait(timeout=120) == 0, b"".join(stderr.lines).decode()[-3000:]
    finally:
        process.kill()
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == "completed" and record["optimizer_steps"] == 60
    assert len((tmp_path / "out" / "run" / "metrics.jsonl").read_text().splitlines()) >= 60


@pytest.mark.parametrize("devices", [1, 2])
def test_a_probe_stopped_by_sigterm_during_fit_exits_non_zero(tmp_path, devices):
    """RunFab judges a probe by its exit status alone. Lightning turns a SIGTERM during fit into a
    SystemExit without a code (status 0), so a stopped probe looked like a microbatch that fits. With
    several devices the ranks are stopped (the probe process is signalled on its own elsewhere)."""
    import psutil
    from omegaconf import OmegaConf

    config = tmp_path / "probe.yaml"  # rows long enough that the second update runs for seconds on a CPU
    dotlist = ["model.max_seq_len=512", f"trainer.devices={devices}", "log_level=debug"]  # its stage lines mark time
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(ROOT / "conf/smoke.yaml"), OmegaConf.from_dotlist(dotlist)), config)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="", RUNFAB_CONFIG=str(config))
    hook = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import train; train.probe_batch({8 // devices})"
    process = subprocess.Popen([sys.executable, "-c", hook], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    stderr = Lines(process.stderr)
    Lines(process.stdout)
    try:
        deadline = time.monotonic() + 120
        while not any(b"rank 0, update 1:" in line for line in stderr.lines):  # fit is under way, one update left
            assert time.monotonic() < deadline and process.poll() is None, b"".join(stderr.lines).decode()[-3000:]
            time.sleep(0.05)
        targets = [process] if devices == 1 else psutil.Process(process.pid).children()
        assert len(targets) == devices
        for target in targets:
            target.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=60)
    finally:
        process.kill()
    stderr.thread.join(timeout=10)
    message = b"".join(stderr.lines).decode()
    assert returncode != 0, message[-3000:]
    assert "received SIGTERM during the probe" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_started_with_stdout_closed_trains_and_exports(tmp_path, devices):
    """fd 1 closed at start (sys.stdout is None): the first metric line raised AttributeError and the run
    ended with nothing exported. Now it is told once, like a reader that went away, and the lines stay
    in run/metrics.jsonl."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    records = tmp_path / "records.jsonl"
    records.write_bytes(sample(1400))
    with records.open("rb") as stdin:
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *ARGS, "--trainer.max_steps", "6", "--metrics.interval_seconds",
             "0", "--trainer.devices", str(devices)],
            stdin=stdin, stderr=subprocess.PIPE, env=env, timeout=180, cwd=tmp_path, preexec_fn=lambda: os.close(1),
        )
    stderr = result.stderr.decode()
    assert result.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("stdout is closed") == 1
    record = json.loads((tmp_path / "out" / "model" / "run_record.json").read_text())
    assert record["status"] == "completed" and record["optimizer_steps"] == 6
    assert len((tmp_path / "out" / "run" / "metrics.jsonl").read_text().splitlines()) == 6


# ----------------------------------------------------------------------------- the output root


@pytest.mark.parametrize("kind", ["folder", "file", "link", "previous"])
def test_what_no_run_wrote_is_refused_in_one_line_and_left_in_place(tmp_path, kind):
    """The set-aside moved whatever stood at model/ (a user's folder, a file, a link) and at
    previous-model/; only folders that carry a run's mark are moved now, and anything else is refused
    before anything moves."""
    from callbacks.owned_folders import mark
    from runtime.output_folder import claimed_output

    root = tmp_path / "out"
    root.mkdir()
    if kind == "folder":
        (root / "model").mkdir()
        (root / "model" / "weights.bin").write_text("the user's own")
    elif kind == "file":
        (root / "model").write_text("a file")
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        mark(tmp_path / "elsewhere")  # even a run's folder: the link is not
        (root / "model").symlink_to(tmp_path / "elsewhere")
    else:
        mark(root / "model")
        (root / "previous-model").mkdir()
    mark(root / "run")  # an earlier run's, which must not move either while model/ is refused
    before = sorted((p.relative_to(root).as_posix(), p.is_symlink()) for p in root.rglob("*"))
    with pytest.raises(ConfigError) as error:
        with claimed_output(root):
            pass
    message = str(error.value)
    refused = root / ("previous-model" if kind == "previous" else "model")
    assert message.startswith(f"{refused} is ") and "\n" not in message
    assert {"folder": "no run of train.py wrote", "file": "a file", "link": "a symbolic link",
            "previous": "no run of train.py wrote"}[kind] in message
    assert sorted((p.relative_to(root).as_posix(), p.is_symlink()) for p in root.rglob("*")) == before


def test_a_folder_in_the_way_is_refused_before_the_input_is_read(tmp_path):
    (tmp_path / "out" / "model").mkdir(parents=True)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS], input=sample(300), env=env,
                            capture_output=True, timeout=120, cwd=tmp_path)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {tmp_path / 'out' / 'model'} is a folder that no run of train.py wrote (it has no .train-py-output), "
        "and a run neither writes into nor moves what a run did not write: move it elsewhere, or set RUNFABRIC_OUTPUT "
        "(or output.root) to another folder"]
    assert "reading records" not in stderr and list((tmp_path / "out" / "model").iterdir()) == []


@pytest.mark.parametrize("root", ["bundle", "/", "/usr", "/etc", "/home", "home", "link to /"])
def test_the_bundle_or_a_system_folder_is_no_output_root(tmp_path, root):
    """Checked on the check itself: a run on such a root, were the check ever lost, would move things
    there (/run is one of the names a run sets aside)."""
    import pwd

    from runtime.output_folder import refuse_unsafe_root

    path = {"bundle": ROOT, "home": Path(pwd.getpwuid(os.getuid()).pw_dir)}.get(root, Path(root))
    if root == "link to /":
        path = tmp_path / "output"
        path.symlink_to("/")
    with pytest.raises(ConfigError, match="set RUNFABRIC_OUTPUT .* to a folder of its own") as error:
        refuse_unsafe_root(path)
    assert str(error.value).startswith(f"the output root {path} is ")
    refuse_unsafe_root(tmp_path / "output-of-its-own")  # an ordinary folder, and the bundle's default output/
    refuse_unsafe_root(ROOT / "output")


def test_an_export_killed_while_writing_is_removed_by_the_next_run(tmp_path):
    from callbacks.owned_folders import mark
    from runtime.output_folder import claimed_output

    root = tmp_path / "out"
    mark(root / ".model.tmp-killed")  # a run's staging folder, as export_model marks it before writing
    (root / ".model.tmp-killed" / "model.safetensors").write_bytes(b"half")
    (root / ".model.tmp-mine").mkdir()  # not a run's: left alone
    with claimed_output(root):
        assert sorted(p.name for p in root.iterdir()) == [".model.tmp-mine", ".run.lock"]


@pytest.mark.parametrize("new_in_place", [False, True])
def test_an_export_killed_between_its_two_renames_loses_no_model(tmp_path, new_in_place):
    """Killed after moving the previous model aside and before renaming the new one into place, an export
    leaves .model.old-*/model: the next run puts it back and sets it aside as previous-model as for any
    earlier model. Killed after the new one is in place, the folder aside is only removed."""
    from callbacks.owned_folders import mark
    from runtime.output_folder import claimed_output

    root = tmp_path / "out"
    mark(root / ".model.old-killed" / "model")  # the previous export, moved aside by export_model
    (root / ".model.old-killed" / "model" / "model.safetensors").write_bytes(b"previous")
    if new_in_place:
        mark(root / "model")
        (root / "model" / "model.safetensors").write_bytes(b"new")
    (root / ".model.old-mine").mkdir()
    (root / ".model.old-mine" / "notes.txt").write_text("not a run's: left alone")
    with claimed_output(root):
        names = sorted(p.name for p in root.iterdir())
        assert names == [".model.old-mine", ".run.lock", "previous-model"], names
        kept = (root / "previous-model" / "model.safetensors").read_bytes()
        assert kept == (b"new" if new_in_place else b"previous")


@pytest.mark.parametrize("devices", [1, 2])
def test_a_second_signal_during_the_export_leaves_no_half_written_model(tmp_path, devices):
    """SIGTERM, then SIGTERM again while the export writes: the run stops at once, and neither the staging
    folder it was writing nor the output folder's lock stays behind in the output root (with several
    devices the rank that exports is killed once trainer.stop_grace_seconds have passed)."""
    slow_export = write_slow_export_script(tmp_path / "slow_export.py")
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    process = subprocess.Popen(
        [sys.executable, str(slow_export), *ARGS, "--trainer.max_steps", "2", "--trainer.devices", str(devices),
         "--trainer.stop_grace_seconds", "5"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    stderr = Lines(process.stderr)
    process.stdin.write(sample(1400))
    process.stdin.close()
    returncode = signal_twice_during_the_export(process, tmp_path / "out",
                                                lambda: b"".join(stderr.lines).decode()[-3000:], 120)
    stderr.thread.join(timeout=10)
    assert returncode != 0, b"".join(stderr.lines).decode()[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")) == []  # the lock too
    assert not (tmp_path / "out" / "model").exists()


@pytest.mark.parametrize("stop", ["a second SIGTERM", "SIGKILL"])
def test_a_stop_while_the_run_record_is_made_leaves_no_model_without_its_record(tmp_path, stop):
    """The model's files are written and the run record is being made when the process stops: the
    model must not appear without its record (a partial model would then look finished). The model
    and run_record.json are published together, or neither is."""
    script = tmp_path / "stop_in_record.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import callbacks.run_record as run_record
        build = run_record.RunRecord.build
        def stopped_build(self, trainer, pl_module):
            if {stop!r} == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGTERM)  # the first asks for a graceful stop, the second for an end now
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            return build(self, trainer, pl_module)
        run_record.RunRecord.build = stopped_build
        import train
        sys.exit(train.main(sys.argv[1:]))
    """))
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(script), *ARGS, "--trainer.max_steps", "2", "--data.source", "sample"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode != 0, done.stderr.decode()[-3000:]
    out = tmp_path / "out"
    assert not (out / "model").exists(), sorted(p.name for p in (out / "model").iterdir())
    if stop == "a second SIGTERM":  # a stop it sees removes the staging folder and its lock itself
        assert not list(out.glob(".model*")) and not (out / output_folder.LOCK_NAME).exists()


def test_an_output_filesystem_without_room_is_refused_before_the_input_is_read(tmp_path, monkeypatch, capsys):
    """A full output filesystem failed the export with a raw ENOSPC traceback after all the training."""
    import shutil
    from collections import namedtuple

    import cli

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, (10 << 30) - (1 << 20), 1 << 20))
    monkeypatch.setattr(training_run, "open_input", lambda *args: pytest.fail("the input was opened"))
    monkeypatch.setenv("RUNFABRIC_OUTPUT", str(tmp_path / "out"))
    assert cli.main([*ARGS, "--data.source", "sample"], train.EFFECTIVE_BATCH_SIZE) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "has 0.00 GiB free but this run writes about" in errors[0], errors
    assert not (tmp_path / "out" / "model").exists()


@pytest.mark.parametrize("full_at", ["weights", "run record"])
def test_an_export_that_still_fails_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, full_at):
    """The disk fills while the weights are written (safetensors' own error, as it raises it) or while
    the run record is: either way one line, exit 2, and neither a model nor a record is left."""
    import errno

    import callbacks.export
    import cli

    def full_weights(*args, **kwargs):
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    from runfab import created_files

    write_text = created_files.write_text

    def full_record(path, *args, **kwargs):
        if Path(path).name == "run_record.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_text(path, *args, **kwargs)

    if full_at == "weights":
        monkeypatch.setattr(callbacks.export, "save_file", full_weights)
    else:
        monkeypatch.setattr(created_files, "write_text", full_record)
    monkeypatch.setenv("RUNFABRIC_OUTPUT", str(tmp_path / "out"))
    assert cli.main([*ARGS, "--data.source", "sample", "--trainer.max_steps", "2"], train.EFFECTIVE_BATCH_SIZE) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "failed after 2 optimizer steps: No space left on device" in errors[0]
    assert "nothing was exported" in errors[0]
    assert not (tmp_path / "out" / "model").exists() and not list((tmp_path / "out").glob(".model*"))


def test_the_loggers_get_the_configuration_and_nothing_they_print_reaches_stdout(tmp_path, monkeypatch, capfd):
    """A logger that prints on stdout whenever it is called, beside Lightning's CSV logger: stdout
    still holds metric lines only, and both loggers receive the run's configuration."""
    import lightning as L
    import yaml

    import cli

    class ChattyLogger(L.pytorch.loggers.Logger):
        name, version = "chatty", 0
        received: dict = {}

        def log_hyperparams(self, params, *args, **kwargs):
            print("chatty: hyperparameters")
            self.received.update(params)

        def log_metrics(self, metrics, step=None):
            print("chatty: metrics")

        def finalize(self, status):
            print("chatty: finalize")

    chatty = ChattyLogger()
    csv = L.pytorch.loggers.CSVLogger(tmp_path / "logs", name="csv")
    monkeypatch.setattr(training_run, "experiment_loggers", lambda cfg, folder: [csv, chatty])
    monkeypatch.setenv("RUNFABRIC_OUTPUT", str(tmp_path / "out"))
    assert cli.main([*ARGS, "--data.source", "sample", "--trainer.max_steps", "2"], train.EFFECTIVE_BATCH_SIZE) == 0
    stdout, stderr = capfd.readouterr()
    assert stdout and all(json.loads(line)["step"] >= 1 for line in stdout.splitlines()), stdout
    assert "chatty: metrics" in stderr and "chatty: finalize" in stderr
    assert chatty.received["config"]["model"]["n_layer"] == RUN["model.n_layer"] and chatty.received["seed"] == 1337
    hparams = yaml.safe_load((tmp_path / "logs/csv/version_0/hparams.yaml").read_text())
    assert hparams["config"]["model"]["n_layer"] == RUN["model.n_layer"] and "microbatch" in hparams["batch"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_gets_the_configuration_and_prints_nothing_on_stdout(tmp_path):
    """W&B prints its closing lines when its run finishes, at the interpreter's exit unless the run
    finishes it first: stdout must hold the metric lines only, to the end of the process."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="", WANDB_MODE="offline",
               WANDB_DIR=str(tmp_path / "wandb-home"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-home"))
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, "--trainer.max_steps", "2", "--data.source",
                           "sample", "--observe.loggers", "[wandb]"], capture_output=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout and all(json.loads(line)["step"] >= 1 for line in done.stdout.splitlines()), done.stdout[-2000:]
    assert b"wandb sync" in done.stderr  # what it printed went to stderr
    runs = list((tmp_path / "out/run/logs/wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and b"vocab_size" in runs[0].read_bytes()  # the configuration reached W&B


@pytest.mark.parametrize("level", [None, "debug", "warning"])
def test_log_level_sets_what_stderr_tells_and_the_memory_trace_is_debug(tmp_path, level):
    """The default tells the run's steps, its metric lines and its outcome, without the host-memory
    trace of every stage; debug adds the trace; warning keeps warnings and errors. stdout is the same."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *ARGS, "--trainer.max_steps", "2", "--data.source",
                           "sample", *(["--log_level", level] if level else [])],
                          capture_output=True, env=env, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    told = done.stderr.decode()
    assert [json.loads(line)["step"] for line in done.stdout.splitlines()][-1] == 2
    assert ("] host memory, rank 0, update 1: PSS" in told) == (level == "debug")
    assert ("] finished: 2 optimizer steps" in told) == ("] metrics: step=2" in told) == (level != "warning"), told


def test_an_unknown_log_level_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="log_level must be one of debug, info, warning, not 'loud'"):
        load_config("conf/smoke.yaml", ["log_level=loud"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_run_starts_removes_its_lock_and_the_folders_it_made(tmp_path, sig):
    """A stop signal after the output folder was claimed and before training's own handlers are in place
    (here: while the tokenizer loads) ends the run with one line and status 2, and the run takes back
    what it made: the lock, and the output folder it created."""
    script = tmp_path / "slow_start.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from runtime import training_run
        load = training_run.load_encoder
        def slow_load(cfg):
            pathlib.Path({str(tmp_path / "loading")!r}).touch()
            time.sleep(60)
            return load(cfg)
        training_run.load_encoder = slow_load
        import train
        sys.exit(train.main(sys.argv[1:]))
    """))
    out = tmp_path / "runs" / "out"
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(out), CUDA_VISIBLE_DEVICES="")
    process = subprocess.Popen([sys.executable, str(script), *ARGS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "loading").exists():
            assert time.monotonic() < deadline and process.poll() is None, process.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        assert (out / output_folder.LOCK_NAME).is_file()
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        process.stdin.close()
    message = stderr.decode()
    assert process.returncode == 2, message[-3000:]
    assert f"error: received {signal.Signals(sig).name}; stopped while the run was starting" in message
    assert "Traceback" not in message and stdout == b""
    assert not (tmp_path / "runs").exists()
