"""Host memory as RunFab charges it (PSS over the process tree) and the refusal of a GPU count that cannot fit."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from runfab import memory
from runfab.limits import GIB, TMP_BYTES
from runtime import hostmem
import train
from runtime.batch_split import BatchSplit
from runtime import probe
from runtime import training_run
from config import ConfigError, load_config
from tests.helpers import ROOT


def test_pss_of_a_tree_counts_a_child_and_shares_what_parent_and_child_map():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(1.5)
        alone = memory.read_rollup()
        tree = memory.tree_memory([child.pid, __import__("os").getpid()])
        child_alone = memory.read_rollup(child.pid)
        assert alone["Pss"] > 0 and alone["Pss"] <= alone["Rss"]
        assert child_alone["Anonymous"] >= 64 << 20  # the child's own heap
        assert tree["processes"] == 2 and tree["Pss"] >= child_alone["Pss"] + alone["Pss"] * 0.9
        assert tree["Pss"] <= tree["Rss"]  # shared library pages: split by PSS, counted per process by RSS
    finally:
        child.kill()
        child.wait()
    assert memory.read_rollup(child.pid) == {}  # a process that is gone adds nothing


def test_a_gpu_count_over_the_host_budget_is_refused_before_any_input_is_read(monkeypatch):
    monkeypatch.setattr("runtime.device_policy.cuda_present", lambda: True)  # the refusal comes before any CUDA call
    overrides = ["trainer.accelerator=gpu", "trainer.devices=8", "trainer.host_memory_budget_gib=4"]
    cfg = load_config("conf/smoke.yaml", overrides)
    need = hostmem.host_budget(8, hostmem.output_bytes(cfg))
    assert need.total > 4
    stdin = io.BytesIO(b'{"text": "never read"}\n')
    with pytest.raises(ConfigError) as error:
        training_run.run_training(cfg, BatchSplit(4, 1, 8, train.EFFECTIVE_BATCH_SIZE), stdin=stdin)
    message = str(error.value)
    assert f"= {need.total:.2f} GiB of 4.0 GiB" in message and "trainer.host_memory_budget_gib" in message
    assert "Use at most 1 GPU(s)" in message
    assert stdin.tell() == 0
    with pytest.raises(ConfigError, match="host memory"):
        probe.run_probe(cfg, 4, train.EFFECTIVE_BATCH_SIZE)


def test_the_host_budget_counts_processes_output_and_tmp_and_admits_what_fits():
    reference = load_config("conf/config.yaml")
    written = hostmem.output_bytes(reference)
    assert written == 4 * 126_716_160  # the fp32 export of the lab's model
    one, two = hostmem.host_budget(1, written), hostmem.host_budget(2, written)
    assert two.processes - one.processes == pytest.approx(hostmem.PER_ADDED_GPU_GIB)
    assert one.output == pytest.approx(written / GIB + hostmem.COMPILE_CACHE_GIB_PER_GPU)
    assert one.total == pytest.approx(one.processes + one.output + TMP_BYTES / GIB + hostmem.MARGIN_GIB)
    fitting = [n for n in range(1, 9) if hostmem.host_budget_problem(8.0, n, written) is None]
    assert fitting == [n for n in range(1, 9) if hostmem.host_budget(n, written).total <= 8.0]
    assert 4 in fitting and 8 not in fitting
    assert f"Use at most {max(fitting)} GPU(s)" in hostmem.host_budget_problem(8.0, 8, written)
    with_checkpoints = load_config("conf/config.yaml", ["trainer.checkpoint_every_steps=100"])
    assert hostmem.output_bytes(with_checkpoints) == 28 * 126_716_160
    assert hostmem.host_budget_problem(0, 64, written) is None  # 0 switches the check off


def test_the_cpu_estimate_matches_a_measured_probe_within_a_tenth(tmp_path):
    """The estimate a CPU run is refused by, against the peak RSS of a real probe (two fp32 steps)."""
    overrides = ["model.n_layer=3", "model.n_embd=96", "model.n_head=3", "model.max_seq_len=768"]
    config = tmp_path / "cpu.yaml"  # smoke.yaml with a model big enough for activations to dominate
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(ROOT / "conf/smoke.yaml"), OmegaConf.from_dotlist(overrides)), config)
    # The peak of the probe's own address space (VmHWM). Not getrusage's ru_maxrss: Linux carries the
    # parent's high-water mark across fork and exec into it, so under a test worker that had grown past
    # the probe's peak it reported the worker's.
    code = ("import train; train.probe_batch(4); "
            "print(next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmHWM:')))")
    # Only what the probe needs: a variable an earlier test left in this worker's environment must not move the peak.
    env = {name: value for name, value in __import__("os").environ.items() if name in ("PATH", "HOME", "LANG")}
    env |= {"RUNFAB_CONFIG": str(config), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = int(result.stdout.split()[-1])
    estimate = hostmem.cpu_process_bytes(load_config(config).model, 4)
    assert 0.9 < estimate / measured < 1.1, (estimate, measured)


def test_a_cpu_run_that_cannot_fit_the_machine_is_refused_with_a_microbatch_that_fits(monkeypatch):
    cfg = load_config("conf/config.yaml", ["trainer.accelerator=cpu"])  # the reference model: 68 GiB at 8 rows
    need_8, need_1 = (hostmem.cpu_process_bytes(cfg.model, m) for m in (8, 1))
    assert need_8 > 60 * hostmem.GIB and need_1 < 16 * hostmem.GIB
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: 16 * hostmem.GIB)
    stdin = io.BytesIO(b'{"text": "never read"}\n')
    with pytest.raises(ConfigError) as error:
        training_run.run_training(cfg, BatchSplit(8, 4, 1, train.EFFECTIVE_BATCH_SIZE), stdin=stdin)
    message = str(error.value)
    assert f"{need_8 / hostmem.GIB:.1f} GiB" in message and "16.0 GiB are available" in message
    assert "--microbatch " in message and "conf/smoke.yaml" in message and stdin.tell() == 0
    assert hostmem.cpu_memory_problem(cfg.model, 1, 1, 16 * hostmem.GIB) is None
    assert hostmem.cpu_memory_problem(cfg.model, 1, 1, None) is None  # nothing known: no refusal


@pytest.mark.parametrize("where", ["missing-folder", "folder"])
def test_an_unwritable_stage_log_costs_the_log_lines_not_the_run(tmp_path, monkeypatch, caplog, where):
    path = tmp_path / "no-such-folder" / "memory.jsonl" if where == "missing-folder" else tmp_path
    monkeypatch.setenv(memory.STAGE_LOG_ENV, str(path))
    for stage in ("model built", "update 1"):
        assert memory.record_stage(stage)["stage"] == stage  # was an OSError that ended training
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"${memory.STAGE_LOG_ENV} names {path}, which cannot be written" in warnings[0]
