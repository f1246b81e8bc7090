"""Signals and limits: an interrupted run keeps what it trained; an impossible output budget is refused early."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import train
from config import load_config

ROOT = Path(__file__).resolve().parent.parent
ARGS = [
    "--config", "conf/smoke.yaml", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
    "--model.max_seq_len", "64", "--trainer.max_steps", "100000", "--optim.schedule", "constant",
    "--metrics.interval_seconds", "0.2", "--trainer.val_every_steps", "0",
]


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
    assert (model / "model.safetensors").stat().st_size > 0


def test_an_output_that_cannot_fit_the_budget_is_refused_before_training():
    cfg = load_config("conf/config.yaml", ["trainer.checkpoint_every_steps=100"])
    with pytest.raises(train.ConfigError, match="GiB") as error:
        train.check_output_budget(cfg)
    assert "checkpoint" in str(error.value)
    train.check_output_budget(load_config("conf/config.yaml"))  # the export alone (0.5 GB) fits
    train.check_output_budget(load_config("conf/config.yaml", ["observe.profile_update=20", "observe.memory_update=30"]))
    endless_profile = load_config("conf/config.yaml", ["observe.profile_update=20", "observe.profile_updates=200"])
    with pytest.raises(train.ConfigError, match="observation files"):
        train.check_output_budget(endless_profile)  # 200 profiled updates: about 3.2 GiB of traces


def test_max_time_keeps_the_export_reserve_out_of_the_training_loop():
    from datetime import timedelta

    from config import ConfigError, training_time_limit

    cfg = load_config("conf/smoke.yaml", ["trainer.max_time=00:01:00:00", "trainer.export_reserve_seconds=90"])
    assert training_time_limit(cfg) == timedelta(minutes=58, seconds=30)
    assert training_time_limit(load_config("conf/smoke.yaml")) is None
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
    assert lines[-1]["elapsed_seconds"] <= 8.5  # 12 s less the 4 s reserve; the clock starts before the first step
