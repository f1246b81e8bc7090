"""Host memory as RunFab charges it (PSS over the process tree) and the refusal of a GPU count that cannot fit."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

import hostmem
import train
from batch_split import BatchSplit
import probe
import training_run
from config import ConfigError, load_config
from tools.check import process_family


def test_pss_of_a_tree_counts_a_child_and_shares_what_parent_and_child_map():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(1.5)
        alone = hostmem.read_rollup()
        tree = hostmem.tree_memory(process_family(child.pid) | {__import__("os").getpid()})
        child_alone = hostmem.read_rollup(child.pid)
        assert alone["Pss"] > 0 and alone["Pss"] <= alone["Rss"]
        assert child_alone["Anonymous"] >= 64 << 20  # the child's own heap
        assert tree["processes"] == 2 and tree["Pss"] >= child_alone["Pss"] + alone["Pss"] * 0.9
        assert tree["Pss"] <= tree["Rss"]  # shared library pages: split by PSS, counted per process by RSS
    finally:
        child.kill()
        child.wait()
    assert hostmem.read_rollup(child.pid) == {}  # a process that is gone adds nothing


def test_a_gpu_count_over_the_host_budget_is_refused_before_any_input_is_read():
    overrides = ["trainer.accelerator=gpu", "trainer.devices=8", "trainer.host_memory_budget_gib=8"]
    cfg = load_config("conf/smoke.yaml", overrides)
    need = hostmem.projected_host_gib(8)
    assert need > 8  # the projection from the 2-GPU measurements: 8 GPU processes do not fit
    stdin = io.BytesIO(b'{"text": "never read"}\n')
    with pytest.raises(ConfigError) as error:
        training_run.run_training(cfg, BatchSplit(4, 1, 8, train.EFFECTIVE_BATCH_SIZE), stdin=stdin)
    message = str(error.value)
    assert f"{need:.1f} GiB" in message and "8.0 GiB" in message and "trainer.host_memory_budget_gib" in message
    assert stdin.tell() == 0
    with pytest.raises(ConfigError, match="host memory"):
        probe.run_probe(cfg, 4, train.EFFECTIVE_BATCH_SIZE)
    assert hostmem.host_budget_problem(8.0, 2, True) is None  # measured: 4.27 GiB
    assert hostmem.host_budget_problem(8.0, 3, True) is None
    assert "Use at most 3 GPUs" in hostmem.host_budget_problem(8.0, 4, True)
    assert hostmem.host_budget_problem(0, 64, True) is None  # 0 switches the check off
    assert hostmem.host_budget_problem(8.0, 1, False) is None  # one GPU trains in RunFab's own process
