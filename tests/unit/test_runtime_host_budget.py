"""The host memory a run will need: the refusal of a GPU count over the job's budget, and of a CPU run that cannot
fit the machine."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from runfab.limits import GIB, TMP_BYTES
from runtime import host_budget
import train
from runtime.batch_split import BatchSplit
from runtime import probe
from runtime import training_run
from config import ConfigError, load_config
from tests.helpers import ROOT


def test_a_gpu_count_over_the_host_budget_is_refused_before_any_input_is_read(monkeypatch):
    monkeypatch.setattr("runtime.device_policy.cuda_present", lambda: True)  # the refusal comes before any CUDA call
    overrides = ["trainer.accelerator=gpu", "trainer.devices=8", "trainer.host_memory_budget_gib=4"]
    cfg = load_config("conf/smoke.yaml", overrides)
    need = host_budget.projected(8, host_budget.output_bytes(cfg))
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
    written = host_budget.output_bytes(reference)
    assert written == 4 * 126_716_160  # the fp32 export of the lab's model
    one, two = host_budget.projected(1, written), host_budget.projected(2, written)
    assert two.processes - one.processes == pytest.approx(host_budget.PER_ADDED_GPU_GIB)
    assert one.output == pytest.approx(written / GIB + host_budget.COMPILE_CACHE_GIB_PER_GPU)
    assert one.total == pytest.approx(one.processes + one.output + TMP_BYTES / GIB + host_budget.MARGIN_GIB)
    fitting = [n for n in range(1, 9) if host_budget.host_budget_problem(8.0, n, written) is None]
    assert fitting == [n for n in range(1, 9) if host_budget.projected(n, written).total <= 8.0]
    assert 4 in fitting and 8 not in fitting
    assert f"Use at most {max(fitting)} GPU(s)" in host_budget.host_budget_problem(8.0, 8, written)
    with_checkpoints = load_config("conf/config.yaml", ["trainer.checkpoint_every_steps=100"])
    assert host_budget.output_bytes(with_checkpoints) == 28 * 126_716_160
    assert host_budget.host_budget_problem(0, 64, written) is None  # 0 switches the check off


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
    estimate = host_budget.cpu_process_bytes(load_config(config).model, 4)
    assert 0.9 < estimate / measured < 1.1, (estimate, measured)


def test_a_cpu_run_that_cannot_fit_the_machine_is_refused_with_a_microbatch_that_fits(monkeypatch):
    cfg = load_config("conf/config.yaml", ["trainer.accelerator=cpu"])  # the reference model: 68 GiB at 8 rows
    need_8, need_1 = (host_budget.cpu_process_bytes(cfg.model, m) for m in (8, 1))
    assert need_8 > 60 * host_budget.GIB and need_1 < 16 * host_budget.GIB
    monkeypatch.setattr(host_budget, "available_host_bytes", lambda: 16 * host_budget.GIB)
    stdin = io.BytesIO(b'{"text": "never read"}\n')
    with pytest.raises(ConfigError) as error:
        training_run.run_training(cfg, BatchSplit(8, 4, 1, train.EFFECTIVE_BATCH_SIZE), stdin=stdin)
    message = str(error.value)
    assert f"{need_8 / host_budget.GIB:.1f} GiB" in message and "16.0 GiB are available" in message
    assert "--microbatch " in message and "conf/smoke.yaml" in message and stdin.tell() == 0
    assert host_budget.cpu_memory_problem(cfg.model, 1, 1, 16 * host_budget.GIB) is None
    assert host_budget.cpu_memory_problem(cfg.model, 1, 1, None) is None  # nothing known: no refusal
