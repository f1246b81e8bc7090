"""A process's memory as RunFab charges it (PSS over the process tree), and the stage records of a run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runfab import process_memory


def test_pss_of_a_tree_counts_a_child_and_shares_what_parent_and_child_map():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(1.5)
        alone = process_memory.read_rollup()
        tree = process_memory.tree_memory([child.pid, os.getpid()])
        child_alone = process_memory.read_rollup(child.pid)
        assert alone["Pss"] > 0 and alone["Pss"] <= alone["Rss"]
        assert child_alone["Anonymous"] >= 64 << 20  # the child's own heap
        assert tree["processes"] == 2 and tree["Pss"] >= child_alone["Pss"] + alone["Pss"] * 0.9
        assert tree["Pss"] <= tree["Rss"]  # shared library pages: split by PSS, counted per process by RSS
    finally:
        child.kill()
        child.wait()
    assert process_memory.read_rollup(child.pid) == {}  # a process that is gone adds nothing


@pytest.mark.parametrize("where", ["missing-folder", "folder"])
def test_an_unwritable_stage_log_costs_the_log_lines_not_the_run(tmp_path, monkeypatch, caplog, where):
    path = tmp_path / "no-such-folder" / "memory.jsonl" if where == "missing-folder" else tmp_path
    monkeypatch.setenv(process_memory.STAGE_LOG_ENV, str(path))
    for stage in ("model built", "update 1"):
        assert process_memory.record_stage(stage)["stage"] == stage  # was an OSError that ended training
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    said = f"${process_memory.STAGE_LOG_ENV} names {path}, which cannot be written"
    assert len(warnings) == 1 and said in warnings[0]
