"""Observation windows, the run summary and the optional loggers, on real tiny CPU runs."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

import train
from runtime.batch_split import BatchSplit
from runtime import training_run
from callbacks.history import read_history
from callbacks.observe import ObserveConfig
from config import ConfigError, load_config
from tests.helpers import IN_PROCESS_RUN, Stdin, as_dotlist, records

MARKERS = {"zero_grad", "forward", "backward", "optimizer_step"}


def tiny_run(tmp_path, monkeypatch, *overrides: str) -> tuple[list[dict], dict]:
    monkeypatch.chdir(tmp_path)
    cfg = load_config("conf/smoke.yaml", [*as_dotlist(IN_PROCESS_RUN), f"output.root={tmp_path / 'out'}", "trainer.val_every_steps=0",
                                          *overrides])
    stdout = io.StringIO()
    monkeypatch.setattr("sys.stdout", stdout)
    training_run.run_training(cfg, BatchSplit(8, 4, 1, train.EFFECTIVE_BATCH_SIZE), stdin=Stdin(io.BytesIO(records(600))))
    lines = [json.loads(line) for line in stdout.getvalue().splitlines()]
    return lines, json.loads((tmp_path / "out/model/run_record.json").read_text())


def test_warmup_and_observed_updates_are_reported_apart_flagged_and_left_out_of_the_summary(tmp_path, monkeypatch):
    lines, record = tiny_run(
        tmp_path, monkeypatch, "trainer.max_steps=9", "metrics.interval_seconds=3600",
        "observe.warmup_updates=2", "observe.profile_update=4", "observe.profile_updates=2",
    )
    intervals = [line for line in lines if "loss" in line]
    # a long interval is still cut at each phase boundary: warmup | 3 | observed 4-5 | 6-9
    assert [(line["step"], line.get("warmup", 0), line.get("observed", 0)) for line in intervals] == [
        (2, 1, 0), (3, 0, 0), (5, 0, 1), (9, 0, 0)]
    summary = record["summary"]
    assert summary["excluded_updates"] == {"warmup": 2, "observed": [4, 5]}
    normal = summary["normal_region"]
    assert (normal["first_update"], normal["last_update"], normal["updates"]) == (3, 9, 5)
    per_update_tokens = {line["step"]: line["tokens_per_second"] for line in intervals}
    assert summary["tokens_per_second_per_gpu"] == pytest.approx(normal["target_tokens"] / normal["seconds"])
    assert min(per_update_tokens[3], per_update_tokens[9]) * 0.5 < summary["tokens_per_second"]
    # the saved metrics file holds exactly the stdout lines
    saved = (tmp_path / "out/run/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in saved] == lines


def test_the_profiler_window_writes_a_chrome_trace_with_the_phase_markers_outside_the_model(tmp_path, monkeypatch):
    _, record = tiny_run(tmp_path, monkeypatch, "trainer.max_steps=4", "observe.profile_update=2",
                         "observe.profile_updates=2", "observe.memory_update=3")
    assert record["observations"] == ["profile/trace-updates-2-3.json"]  # no CUDA: no memory snapshot
    trace = json.loads((tmp_path / "out/run/profile/trace-updates-2-3.json").read_text())
    names = [event.get("name") for event in trace["traceEvents"]]
    assert MARKERS <= set(names)
    assert names.count("optimizer_step") == 2 and names.count("forward") == 2 * 4  # two updates of four microbatches
    assert not any("trace" in p.name or "snapshot" in p.name for p in (tmp_path / "out/model").rglob("*"))


def test_without_observation_nothing_is_profiled_and_no_line_is_flagged(tmp_path, monkeypatch):
    lines, record = tiny_run(tmp_path, monkeypatch, "trainer.max_steps=3", "observe.warmup_updates=0")
    assert record["observations"] == [] and not (tmp_path / "out/run/profile").exists()
    assert not any("warmup" in line or "observed" in line for line in lines)
    assert record["summary"]["normal_region"]["updates"] == 3


def test_a_csv_logger_gets_a_point_per_update_and_the_validations_and_stdout_keeps_only_the_metric_lines(
        tmp_path, monkeypatch):
    """Metric lines every 10 updates at most (a long interval); the logger still gets every update's loss,
    lr, gradient norm and tokens per second, the validation of the initial weights at update 0, each
    periodic validation at its update and the final one at the last."""
    lines, record = tiny_run(tmp_path, monkeypatch, "trainer.max_steps=7", "trainer.val_every_steps=3",
                             "metrics.interval_seconds=3600", "observe.warmup_updates=0", "observe.loggers=[csv]")
    assert all(isinstance(line, dict) for line in lines) and len([line for line in lines if "loss" in line]) < 7
    [metrics_csv] = (tmp_path / "out/run/logs/csv").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics_csv.open()))
    points = {int(r["step"]): r for r in rows if r["loss"]}
    assert sorted(points) == list(range(1, 8))
    history = read_history(tmp_path / "out/model/history.npz")
    assert [float(points[u]["loss"]) for u in range(1, 8)] == pytest.approx(history["loss"].tolist(), rel=1e-6)
    assert all(float(points[u]["tokens_per_second"]) > 0 and points[u]["lr"] and points[u]["grad_norm"]
               for u in points)
    validations = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    validation = record["comparability"]["validation"]
    assert [step for step, _ in validations] == [0, 3, 6, 7]
    assert validations[0][1] == pytest.approx(validation["ce_before"], rel=1e-6)
    assert validations[-1][1] == pytest.approx(validation["ce_after"], rel=1e-6)
    assert [int(r["step"]) for r in rows] == sorted(int(r["step"]) for r in rows)  # in update order, as W&B needs
    assert record["loggers"]["CSVLogger"]["folder"] == str(metrics_csv.parent)


def test_unknown_or_missing_loggers_are_refused_before_training():
    with pytest.raises(ConfigError, match="observe.loggers must list only csv, tensorboard, wandb, not 'mlflow'"):
        load_config("conf/smoke.yaml", ["observe.loggers=[mlflow]"])
    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if importlib.util.find_spec(module) is None:  # not installed here: refused with the install command
            with pytest.raises(ConfigError, match=f"pip install {module}"):
                training_run.experiment_loggers(load_config("conf/smoke.yaml", [f"observe.loggers=[{name}]"]), Path("logs"))
    assert ObserveConfig(profile_update=5, profile_updates=3, memory_update=9).observed_updates() == {5, 6, 7, 9}
    assert ObserveConfig().observed_updates() == set()


def test_the_progress_bar_counts_updates_out_of_max_steps_with_the_time_left_on_stderr(tmp_path, monkeypatch, capsys):
    lines, _ = tiny_run(tmp_path, monkeypatch, "trainer.max_steps=5", "trainer.enable_progress_bar=true")
    bar = capsys.readouterr().err
    assert "5/5 [" in bar and "update/s" in bar  # accumulation 4: microbatches would count to 20
    assert re.search(r"[1-4]/5 \[\d\d:\d\d<\d\d:\d\d", bar)  # the time left, before the end
    assert lines and "Training" not in json.dumps(lines)
