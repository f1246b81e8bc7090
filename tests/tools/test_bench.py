"""``python -m tools bench NAME``: one experiment a name, the configuration as train.py takes it,
GPU experiments refused at once without a GPU, and the ones that run on a CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from runtime import device_policy
from tools.__main__ import main as tools
from tools.bench import EXPERIMENTS, runs

from tests.helpers import ROOT

GPU_EXPERIMENTS = ["trainer", "observe", "reference", "workers", "scaling", "probe-timing", "memory-sweep"]


@pytest.fixture
def no_gpu(monkeypatch):
    """No CUDA device, and nothing past the refusal may run: the test never starts a GPU run, fixed or not."""
    monkeypatch.setattr(device_policy, "cuda_present", lambda: False)

    def started(*args, **kwargs):
        raise AssertionError("a GPU experiment went on without a GPU")

    monkeypatch.setattr(runs, "prepare", started)


@pytest.mark.parametrize("name", GPU_EXPERIMENTS)
def test_a_gpu_experiment_is_refused_in_one_line_without_a_gpu(no_gpu, capsys, tmp_path, name):
    out = tmp_path / "bench-out"
    assert tools(["bench", name, "--out", str(out), "--model.n_layer", "2"]) == 2
    captured = capsys.readouterr()
    assert f"bench {name}: needs a CUDA GPU" in captured.err and "host-pipeline" in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--set", "model.n_layer=2"], "unrecognized option --set; configuration keys are given as --section.key VALUE"),
    (["--model.n_layer", "two"], "model.n_layer"),
    (["--model.no_such_key", "1"], "--model.no_such_key"),
    (["stray"], "unexpected 'stray'"),
    (["--variant", "--model.no_such_key 1"], "--variant --model.no_such_key 1: "),
    (["--variant", "--model.n_layer two"], "--variant --model.n_layer two: "),
    (["--variant", "model.n_layer=2"], "--variant 'model.n_layer=2': give train.py's options, --section.key VALUE"),
    (["--variant", "--config conf/smoke.yaml --model.n_layer 2"],
     "the configuration file and subcommand are the job's"),
])
def test_a_bad_override_is_refused_before_anything_runs(no_gpu, capsys, tmp_path, argv, says):
    out = tmp_path / "bench-out"
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", "trainer", "--out", str(out), *argv])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "needs a CUDA GPU" not in err, err
    assert not out.exists()


def test_a_variant_keeps_its_keys_together_in_train_py_form(no_gpu, capsys, tmp_path):
    args = runs.parse(runs.parser("trainer", "a variant"), ["--model.n_layer", "2"])
    flags = runs.variant_flags(args, "--compute.loss_chunk_tokens 32768 --compute.mlp=torch")
    assert flags == ("--compute.loss_chunk_tokens", "32768", "--compute.mlp=torch")
    out = tmp_path / "bench-out"
    variants = ["--variant", "--compute.loss_chunk_tokens 32768 --compute.mlp torch", "--variant=--model.n_layer=2"]
    assert tools(["bench", "trainer", "--out", str(out), *variants]) == 2  # accepted: only the GPU is missing
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_overrides_reach_the_runs_as_train_py_reads_them(tmp_path):
    """The host pipeline (the experiment that runs on a CPU) with the small tokenizer, set the way train.py takes it."""
    out = tmp_path / "bench-out"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "host-pipeline", "--copies", "1", "--docs", "300", "--out", str(out),
         "--data.tokenizer", "conf/tokenizer.json", "--model.vocab_size=8192"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((out / "host-pipeline.json").read_text())
    assert {figures[kind]["tokenizer_path"] for kind in ("text", "input_ids")} == {"conf/tokenizer.json"}
    assert all(figures[kind]["target_tokens"] > 0 for kind in ("text", "input_ids"))


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_experiment_describes_itself(name, capsys):
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", name, "--help"])
    assert exit_status.value.code == 0
    assert f"usage: python -m tools bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name, says", [("allreduce", "needs 2 or more CUDA GPUs; this machine has 0")])
def test_the_all_reduce_experiment_is_refused_without_its_gpus(monkeypatch, capsys, name, says):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert tools(["bench", name]) == 2  # refused, like every tool's usage error: not a crash (1)
    captured = capsys.readouterr()
    assert says in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_balancing_evens_out_the_ranks_attention_work_on_realistic_documents():
    records = subprocess.run([sys.executable, "-m", "tools", "bench", "synthetic-records", "--docs", "2500"], cwd=ROOT,
                             capture_output=True, check=True, timeout=120).stdout
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "rank-balance"], input=records, cwd=ROOT,
                            capture_output=True, check=True, timeout=120)
    found = re.search(rb"stream order ([0-9.]+), balanced ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    in_order, balanced = float(found[1]), float(found[2])
    assert 1.0 <= balanced < 1.01 and balanced < in_order  # the busiest rank within 1 % of the mean


def test_trace_summary_counts_overlapping_kernels_once_and_groups_them_by_family(tmp_path, capsys):
    events = [  # two streams overlap for 5 us; a CPU event is not GPU time
        {"cat": "kernel", "name": "nvjet_sm90_tst_192x192", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel", "ts": 5, "dur": 10},
        {"cat": "kernel", "name": "triton_red_fused_logsumexp_0", "ts": 30, "dur": 20},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
    ]
    for name, kept in (("gpu.json", events), ("cpu.json", events[3:])):
        (tmp_path / name).write_text(json.dumps({"traceEvents": kept}))
    assert tools(["bench", "trace-summary", str(tmp_path / "gpu.json"), "--top", "2"]) == 0
    text = capsys.readouterr().out
    first = text.splitlines()[0]
    assert "(70.0%), 3 kernels" in first  # busy 35 us of a 50 us window
    families = {line.split()[0] for line in text.splitlines()[1:4]}
    assert families == {"matmul", "attention", "compiled"}
    assert tools(["bench", "trace-summary", str(tmp_path / "cpu.json")]) == 0
    assert "no GPU kernels" in capsys.readouterr().out


def test_trace_summary_by_shape_finds_the_operator_that_launched_each_product(tmp_path, capsys):
    launch = {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 1}
    events = [  # thread 1: a module op around an aten::mm; thread 2 (autograd): an addmm with its bias first
        {"cat": "cpu_op", "name": "nn.Module: Linear", "tid": 1, "ts": 0, "dur": 50, "args": {}},
        {"cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 5, "dur": 20,
         "args": {"Input Dims": [[1024, 1024], [1024, 1024]]}},
        {**launch, "tid": 1, "ts": 10, "args": {"correlation": 1}},
        {**launch, "tid": 1, "ts": 30, "args": {"correlation": 2}},  # after the mm closed: no operator with shapes
        {"cat": "cpu_op", "name": "aten::addmm", "tid": 2, "ts": 10, "dur": 20,
         "args": {"Input Dims": [[1, 16], [2048, 4096], [4096, 16], [], []]}},
        {**launch, "tid": 2, "ts": 12, "args": {"correlation": 3}},
        {"cat": "cpu_op", "name": "runfab::fa4_forward", "tid": 2, "ts": 40, "dur": 20,
         "args": {"Input Dims": [[4096, 3, 12, 64], [3]]}},
        {**launch, "tid": 2, "ts": 45, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 100, "dur": 2, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 110, "dur": 2, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 120, "dur": 1, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "nvjet_sm90_tss_64x64", "ts": 130, "dur": 3, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "flash_fwd_sm90", "ts": 140, "dur": 9, "args": {"correlation": 4}},
    ]
    (tmp_path / "gpu.json").write_text(json.dumps({"traceEvents": events}))
    assert tools(["bench", "trace-summary", str(tmp_path / "gpu.json"), "--by-shape"]) == 0
    text = capsys.readouterr().out
    rows = text[text.index("matrix products by operator"):].splitlines()
    mm = next(r for r in rows if "aten::mm" in r)
    assert "x2" in mm and "0.002 ms a call" in mm and " 1074 TFLOP/s" in mm  # 2 * 1024^3 FLOP in 2 us
    addmm = next(r for r in rows if "aten::addmm" in r)
    assert " 268 TFLOP/s" in addmm  # 2 * 2048 * 4096 * 16 in 1 us: the bias is not an operand
    assert any("(no operator with shapes)" in r for r in rows)
    assert not any("fa4_forward" in r for r in rows)  # attention is not a matrix product here


def step_run(tokens_per_second: float, peak_gib: float = 20.0) -> dict:
    return {"tokens_per_second": tokens_per_second, "peak_allocated_gib": peak_gib}


def test_trainer_against_a_folder_without_train_py_is_refused_before_anything_runs(no_gpu, capsys, tmp_path):
    out = tmp_path / "bench-out"
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", "trainer", "--out", str(out), "--against", str(tmp_path)])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert f"--against {tmp_path}: no train.py there" in err and "needs a CUDA GPU" not in err
    assert not out.exists()


def test_trainer_against_another_checkout_runs_its_train_py_on_the_same_records(monkeypatch, tmp_path):
    from tools.bench import training

    calls = []
    monkeypatch.setattr(device_policy, "cuda_present", lambda: True)
    monkeypatch.setattr(runs, "prepare", lambda args: None)
    monkeypatch.setattr(runs, "run_plain", lambda layout, args: {"tokens_per_second": 1.0})
    monkeypatch.setattr(runs, "save", lambda *a: None)
    monkeypatch.setattr(runs, "print_table", lambda *a, **k: None)

    def run_lightning(layout, args, name="lightning", extra=(), cold=False, tree=runs.ROOT):
        calls.append((layout, name, tree))
        return {"tokens_per_second": 1.0}

    monkeypatch.setattr(runs, "run_lightning", run_lightning)
    other = tmp_path / "before"
    other.mkdir()
    (other / "train.py").write_text("")
    assert training.trainer(["--layouts", "realistic", "--out", str(tmp_path / "o"), "--against", str(other)]) == 0
    assert calls == [("realistic", "lightning", runs.ROOT), ("realistic", "against0", other.resolve())]


def fake_nvidia_smi(tmp_path, lines: list[str]):
    """An executable that prints ``lines`` as nvidia-smi's sampling loop would, then keeps looping (sleeps)."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines) + "exec sleep 60\n")
    script.chmod(0o755)
    return str(script)


def test_gpu_clocks_summarize_the_busy_samples_and_stop_the_sampling_loop(tmp_path):
    import time

    import psutil

    from tools.bench.gpu_clocks import GpuClocks

    lines = ["0, 345, 75.10, 31",  # idle before the run: left out
             "99, 1980, 690.5, 60", "100, 1830, 700.0, 66", "97, 1900, 695.2, 64",
             "[N/A], 1980, 700, 60",  # a field the GPU does not report: skipped
             "45, 1980, 300.0, 62"]  # compiling: left out
    with GpuClocks(command=fake_nvidia_smi(tmp_path, lines), gpu="3") as clocks:
        deadline = time.monotonic() + 10
        while len(clocks.samples) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        sampling = psutil.Process().children()  # the fake nvidia-smi, sleeping in its loop
    assert sampling and not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in sampling), \
        "the sampling loop outlived the block"
    assert clocks.argv[-1] == "--id=3" and len(clocks.samples) == 5
    assert clocks.summary() == {"sm_clock_mhz": 1900.0, "power_watts": 695.2, "max_temperature_c": 66.0,
                                "busy_samples": 3}


def test_gpu_clocks_give_no_figures_where_nvidia_smi_is_absent_or_nothing_was_busy(tmp_path):
    from tools.bench.gpu_clocks import GpuClocks

    with GpuClocks(command=str(tmp_path / "no-such-nvidia-smi")) as clocks:
        pass
    assert clocks.summary() == {}
    clocks.stop()  # stopping twice is harmless
    idle = GpuClocks(command=fake_nvidia_smi(tmp_path, ["3, 345, 75, 31"])).start()
    idle.stop()
    assert idle.summary() == {}


def test_gpu_clocks_name_the_first_visible_gpu(monkeypatch):
    from tools.bench.gpu_clocks import visible_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f1c, 2")
    assert visible_gpu() == "GPU-8f1c"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpu() == "0"


def test_the_trainer_table_shows_each_runs_clock_and_power_where_measured(monkeypatch, capsys):
    import argparse

    monkeypatch.setattr(runs.torch.cuda, "get_device_name", lambda: "a GPU")
    args = argparse.Namespace(microbatch=32, steps=25, warmup=8, train_flags=[])
    base = {"tokens_per_second": 500_000.0, "mfu": 0.5, "peak_allocated_gib": 37.5}
    runs.print_table({"one-doc": {"plain": base, "lightning": {**base, "sm_clock_mhz": 1830.0, "power_watts": 699.6}}},
                     args, baseline="plain")
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("one-doc")}
    assert "SM MHz/W" in out
    assert rows["lightning"].rstrip().endswith("1830/700") and rows["plain"].rstrip().endswith("-")


def test_trainer_runs_read_records_written_once_beforehand_enough_for_their_updates(tmp_path):
    """Every run of a layout reads one file written before the first run, holding at least the rows of --steps
    updates (and the feeder's read-ahead); one-doc records fill exactly one 4096-token row each."""
    import train
    from pipeline.packing import pack_rows
    from pipeline.records import StreamStats

    args = runs.parse(runs.parser("trainer", "records"), ["--steps", "3", "--out", str(tmp_path / "o")])
    needed_rows = (args.steps + 2) * train.EFFECTIVE_BATCH_SIZE
    for layout in ("realistic", "one-doc"):
        path = runs.records_for(layout, args)
        written = path.stat().st_mtime_ns
        assert runs.records_for(layout, args) == path and path.stat().st_mtime_ns == written  # written once
        docs = [np.array([*json.loads(line)["input_ids"], 0]) for line in path.read_text().splitlines()]
        rows = list(pack_rows(docs, 4096, StreamStats()))
        assert needed_rows <= len(rows) <= 2 * needed_rows, (layout, len(rows))
        if layout == "one-doc":
            assert {len(doc) for doc in docs} == {4096} and len(rows) == len(docs)
    given = tmp_path / "mine.jsonl"
    given.write_text('{"input_ids": [1, 2, 3]}\n')
    mine = runs.parse(runs.parser("trainer", "records"), ["--records", str(given), "--out", str(tmp_path / "p")])
    assert runs.records_for("realistic", mine) == given and not (tmp_path / "p").exists()


def test_time_to_loss_races_a_candidate_against_the_reference_on_one_validation_file(tmp_path):
    """On the CPU with the smoke presets: both runs validate on the same held-out documents, the reference's own
    target is reached at its last update, and the summary, the plot and a stdout line a run are written."""
    out = tmp_path / "ttl"
    proc = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "time-to-loss", "--corpus", "data/sample.jsonl", "--out", str(out),
         "--steps", "6", "--every", "2", "--microbatch", "8", "--config", "conf/smoke.yaml",
         "--model.max_seq_len", "64", "--candidate", "--config conf/fast-smoke.yaml"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "time-to-loss.json").read_text())
    reference, candidate = summary["runs"]["reference"], summary["runs"]["candidate-1"]
    assert [update for update, _ in reference["curve"]] == [0, 2, 4, 6]
    assert reference["curve"][-1][1] == summary["target_cross_entropy"] and reference["updates_to_target"] <= 6
    assert [update for update, _ in candidate["curve"]] == [0, 2, 4, 6]
    assert candidate["flags"] == ["--config", "conf/fast-smoke.yaml"]
    muon = json.loads((out / "candidate-1" / "model" / "run_record.json").read_text())
    assert [o["name"] for o in muon["optimizers"]] == ["Muon", "AdamW"] and muon["config"]["model"]["max_seq_len"] == 64
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["run"] for line in lines] == ["reference", "candidate-1"]
    assert (out / "time-to-loss.png").read_bytes().startswith(b"\x89PNG")
    validation = [json.loads((out / name / "model" / "run_record.json").read_text())["comparability"]["validation"]
                  for name in ("reference", "candidate-1")]
    assert validation[0]["sha256"] == validation[1]["sha256"] and validation[0]["documents"] > 0


def test_time_to_loss_honours_a_candidates_shorter_schedule_and_goes_on_past_a_failed_run(tmp_path):
    """A candidate's own --trainer.max_steps (fewer updates) is the one it trains, one beyond --steps is refused before
    any run, and a candidate whose run fails is reported as failed while the next one still runs (exit 1)."""
    job = [sys.executable, "-m", "tools", "bench", "time-to-loss", "--corpus", "data/sample.jsonl", "--steps", "4",
           "--every", "2", "--microbatch", "8", "--config", "conf/smoke.yaml", "--model.max_seq_len", "64"]
    refused = subprocess.run([*job, "--out", str(tmp_path / "refused"), "--candidate", "--trainer.max_steps 5"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "trainer.max_steps 5 must be from 1 to --steps (4)" in refused.stderr
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "ttl"
    proc = subprocess.run(
        [*job, "--out", str(out), "--candidate", "--output.root /dev/null/nowhere",
         "--candidate", "--config conf/fast-smoke.yaml --trainer.max_steps 2 --optim.warmup_steps 1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads((out / "time-to-loss.json").read_text())
    assert [update for update, _ in summary["runs"]["reference"]["curve"]] == [0, 2, 4]
    short = summary["runs"]["candidate-2"]
    assert [update for update, _ in short["curve"]] == [0, 2] and short["cross_entropy_at_reference_updates"] is None
    assert list(summary["failed"]) == ["candidate-1"] and "candidate-1-stderr.log" in summary["failed"]["candidate-1"][
        "error"]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["run"] for line in lines] == ["reference", "candidate-1", "candidate-2"] and "error" in lines[1]
