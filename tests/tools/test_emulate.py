"""The local RunFab emulation: probes, the chosen split, the budgets' watchdog, the report."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import pytest

from tools.bundle import emulate

from tests.helpers import ROOT, as_yaml, tiny

# The tiny model as a config file of its own (no smoke.yaml under it): four updates, a validation every two.
RUN = tiny({
    "model.vocab_size": 8192, "data.tokenizer": "conf/tokenizer.json", "optim.warmup_steps": 1,
    "optim.decay_steps": 10, "trainer.max_steps": 4, "trainer.val_every_steps": 2, "metrics.interval_seconds": 0.2,
})


def test_candidates_are_the_divisors_of_the_batch_per_gpu():
    assert emulate.candidates(32, 1) == [1, 2, 4, 8, 16, 32]
    assert emulate.candidates(32, 4) == [1, 2, 4, 8]


def test_emulation_probes_takes_the_largest_fit_trains_and_reports(tmp_path, monkeypatch):
    config = tmp_path / "tiny.yaml"
    config.write_text(as_yaml(RUN))
    monkeypatch.setenv("RUNFAB_CONFIG", str(config))
    records = tmp_path / "records.jsonl"
    records.write_bytes((ROOT / "data/sample.jsonl").read_bytes())
    out, log = io.StringIO(), io.StringIO()
    with records.open("rb") as stdin:
        result = emulate.emulate(ROOT, tmp_path / "report", False, None, [2, 4], out, log, stdin=stdin)
    assert [p["microbatch"] for p in result.probes] == [2, 4] and all(p["fits"] for p in result.probes)
    assert (result.microbatch, result.accumulation) == (4, 8)
    assert result.train_exit_code == 0 and result.usage.exceeded is None
    assert 0 < result.usage.peak_rss_bytes < emulate.RAM_BUDGET
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines and lines[-1]["step"] == 4 and result.metric_lines == len(lines)
    report = tmp_path / "report"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["microbatch"] == 4 and "model.safetensors" in summary["model_files"]
    loss, throughput = (report / "loss.svg").read_text(), (report / "throughput.svg").read_text()
    assert 'id="line-loss"' in loss and "val_loss" in loss and 'id="line-tokens_per_second"' in throughput
    page = (report / "report.html").read_text()
    for plot in ("loss", "throughput", "mfu", "memory", "lr"):
        assert f'<figure class="plot" id="plot-{plot}">' in page
    for series in ("loss", "tokens_per_second", "lr"):
        assert f'id="line-{series}"' in page
    assert 'no metric line has "mfu"' in page  # a CPU run
    assert "run_record.json not found" not in page and "<caption>model</caption>" in page
    assert f"report {report / 'report.html'}" in log.getvalue().splitlines()[-1]


def test_a_run_over_a_budget_is_stopped_and_named(tmp_path, monkeypatch):
    config = tmp_path / "tiny.yaml"
    config.write_text(as_yaml({**RUN, "trainer.max_steps": 100000, "optim.decay_steps": 100000}))
    monkeypatch.setenv("RUNFAB_CONFIG", str(config))
    monkeypatch.setattr(emulate, "RAM_BUDGET", 64 << 20)
    records = tmp_path / "records.jsonl"
    records.write_bytes((ROOT / "data/sample.jsonl").read_bytes())
    with records.open("rb") as stdin:
        result = emulate.emulate(ROOT, tmp_path / "report", False, None, [4], io.StringIO(), io.StringIO(), stdin=stdin)
    assert result.usage.exceeded is not None and result.usage.exceeded.startswith("RAM")
    assert result.train_exit_code != 0


def test_probe_peaks_are_read_from_the_trainers_probe_line():
    line = ('[2026-11-29 10:00:00,000 runtime.probe] probe figures: {"microbatch": 8, "steps": 4, '
            '"peak_allocated_gib": 17.5, "peak_reserved_gib": 18.0}')
    assert emulate.probe_figures(["noise", line, "tail"]) == {"peak_allocated_gib": 17.5, "peak_reserved_gib": 18.0}
    assert emulate.probe_figures(['[x runtime.probe] probe figures: {"microbatch": 8, "steps": 4}']) == {}  # CPU
    assert emulate.probe_figures(["Traceback", "torch.OutOfMemoryError: CUDA out of memory"]) == {}


def test_cuda_without_a_visible_gpu_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(emulate.check, "visible_gpus", lambda: 0)
    assert emulate.main([str(ROOT), "--cuda", "--report", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible" in err and err.count("\n") == 1
    assert not (tmp_path / "report").exists()


def test_a_bundle_after_microbatches_is_named_with_the_fix(tmp_path, capsys):
    """--microbatches takes every word up to the next option: a bundle there gets a message saying where it goes."""
    with pytest.raises(SystemExit) as exit_status:
        emulate.main(["--microbatches", "8", "dist/x.zip"])
    err = capsys.readouterr().err
    assert exit_status.value.code == 2
    assert "'dist/x.zip' is not a microbatch" in err and "before --microbatches" in err and "with --" in err
    missing = tmp_path / "missing.zip"
    assert emulate.main(["--microbatches", "8", "--", str(missing)]) == 2  # after --, it is the bundle
    assert f"{missing} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "2"], "--gpus 2, but the children see 1 device(s): without --cuda they train on the CPU"),
    (["--microbatches", "3", "8"], "--microbatches 3: RunFab probes only microbatches that divide"),
])
def test_a_plan_the_trainer_would_refuse_is_refused_before_any_probe(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.setattr(emulate, "probe", lambda *args: pytest.fail("a probe ran for a plan that cannot train"))
    assert emulate.main([str(ROOT), "--report", str(tmp_path / "report"), *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not (tmp_path / "report").exists()


def test_stdin_reaches_the_child_through_a_pipe_written_beside_it(tmp_path):
    """As RunFab's worker streams the dataset: every byte of the given stdin arrives through a pipe, which is then
    closed (the end of input); a child that stops reading ends the copy without an error."""
    data = b"".join(b'{"input_ids": [%d]}\n' % i for i in range(100_000))
    records = tmp_path / "records.jsonl"
    records.write_bytes(data)
    with records.open("rb") as source:
        reads_a_fifo = ("import os, stat, sys; assert stat.S_ISFIFO(os.fstat(0).st_mode); "
                        "sys.stdout.buffer.write(sys.stdin.buffer.read())")
        child = subprocess.Popen([sys.executable, "-c", reads_a_fifo], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        copier = emulate.stream_into(source, child.stdin)
        watchdog = threading.Timer(60, child.kill)  # a pipe left open would hold the child's read forever
        watchdog.start()
        received = child.stdout.read()
        child.wait()
        watchdog.cancel()
        copier.join(timeout=10)
    assert child.returncode == 0 and received == data and not copier.is_alive()
    with records.open("rb") as source:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read(10)"], stdin=subprocess.PIPE)
        copier = emulate.stream_into(source, child.stdin)
        child.wait()
        copier.join(timeout=10)
    assert child.returncode == 0 and not copier.is_alive()
