"""`python -m tools.benchmark` without a GPU: the GPU runs are refused at once, the host pipeline still runs."""

from __future__ import annotations

import sys

import pytest

from tools import benchmark


@pytest.fixture
def no_gpu(monkeypatch):
    """No CUDA device, and every GPU run replaced by a failure: the test never starts one, fixed or not."""
    monkeypatch.setattr(benchmark.device_policy, "cuda_present", lambda: False)

    def started(*args, **kwargs):
        raise AssertionError("a GPU run started on a machine without a GPU")

    monkeypatch.setattr(benchmark.device_policy, "prepare_compile", started)
    for run in ("probe_timing", "scaling", "run_lightning", "run_plain", "run_reference", "memory_sweep"):
        monkeypatch.setattr(benchmark, run, started)


@pytest.mark.parametrize("argv, named", [
    (["--probe-timing", "16"], "--probe-timing"),
    (["--scaling"], "--scaling"),
    (["--host-pipeline", "--scaling"], "--scaling"),  # main runs --scaling first, so it is the one refused
    ([], "--layouts"),
    (["--observe", "--workers"], "--observe"),
    (["--memory-sweep"], "--memory-sweep"),
])
def test_gpu_runs_are_refused_in_one_line_without_a_gpu(no_gpu, monkeypatch, capsys, tmp_path, argv, named):
    out = tmp_path / "bench-out"
    monkeypatch.setattr(sys, "argv", ["benchmark", *argv, "--out", str(out)])
    assert benchmark.main() == 2
    captured = capsys.readouterr()
    assert "cannot run without a CUDA GPU" in captured.err and named in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert not out.exists()


def test_the_host_pipeline_still_runs_without_a_gpu(no_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(benchmark.device_policy, "prepare_compile", lambda *args: None)
    monkeypatch.setattr(benchmark, "host_pipeline", lambda args: {"text": {"tokens_per_second": 1.0}})
    out = tmp_path / "bench-out"
    monkeypatch.setattr(sys, "argv", ["benchmark", "--host-pipeline", "--out", str(out)])
    assert benchmark.main() == 0
    assert (out / "host_pipeline.json").is_file()


@pytest.mark.parametrize("tool, says", [("kernel_bench", "needs a CUDA device"),
                                        ("allreduce_bench", "needs 2 or more CUDA GPUs; this machine has 0")])
def test_the_kernel_and_all_reduce_benchmarks_are_refused_without_their_gpus(monkeypatch, capsys, tool, says):
    import importlib

    import torch

    module = importlib.import_module(f"tools.{tool}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", [tool])
    assert module.main() == 2  # refused, like every tool's usage error: not a crash (1)
    captured = capsys.readouterr()
    assert says in captured.err and captured.err.count("\n") == 1 and captured.out == ""
