"""Host memory as RunFab charges it (PSS over the process tree) and the refusal of a GPU count that cannot fit."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

import hostmem
import train
from config import ConfigError, load_config
from contract_check import process_family


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
    cfg = load_config("conf/smoke.yaml", ["trainer.accelerator=gpu", "trainer.devices=8", "trainer.host_memory_budget_gib=8"])
    need = hostmem.projected_host_gib(8, True)
    assert need > 8  # the projection from the 2-GPU measurements: 8 worker processes do not fit
    stdin = io.BytesIO(b'{"text": "never read"}\n')
    with pytest.raises(ConfigError) as error:
        train.run_training(cfg, microbatch=4, accumulation=1, stdin=stdin)
    message = str(error.value)
    assert f"{need:.1f} GiB" in message and "8.0 GiB" in message and "trainer.host_memory_budget_gib" in message
    assert stdin.tell() == 0
    with pytest.raises(ConfigError, match="host memory"):
        train.run_probe(cfg, 4)
    fits = hostmem.host_budget_problem(8.0, 2, True)
    assert fits is None and hostmem.projected_host_gib(2, True) <= 6.0  # issue 13's goal for 2 GPUs
    assert hostmem.host_budget_problem(0, 64, True) is None  # 0 switches the check off
    assert hostmem.host_budget_problem(8.0, 1, False) is None  # one GPU trains in RunFab's own process


def test_freed_heap_goes_back_and_stages_are_logged(tmp_path, monkeypatch):
    log = tmp_path / "stages.jsonl"
    monkeypatch.setenv(hostmem.STAGE_LOG_ENV, str(log))
    hostmem.limit_malloc_arenas()
    blocks = [bytearray(100_000) for _ in range(3000)]  # ~300 MB in small heap chunks (not mmap'd)
    before = hostmem.record_stage("filled", rank=0)
    del blocks
    hostmem.release_freed_memory()
    after = hostmem.record_stage("trimmed", rank=0)
    assert before["Anonymous"] - after["Anonymous"] > 200 << 20
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and '"stage": "trimmed"' in lines[1] and '"Pss_Anon"' in lines[1]
