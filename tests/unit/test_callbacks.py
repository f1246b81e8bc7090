"""The metrics feed, divergence handling, checkpoints and the run record, with real Lightning runs."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import train
from runtime.batch_split import BatchSplit
from config import ConfigError
from runtime import device_policy
from runtime import training_run
from callbacks.runfab_metrics import NonFiniteLossError, RunFabMetrics
from config import load_config
from pipeline.packing import Row
from pipeline.records import StreamStats
from pipeline.stream import split_update
from lit_module import DecoderTrainingModule, OptimConfig
from model.decoder import ModelConfig
from tests.helpers import IN_PROCESS_RUN, Stdin, as_dotlist, records

IN_PROCESS = as_dotlist(IN_PROCESS_RUN)


def test_interval_loss_is_token_weighted_and_steps_are_counted_once_per_update():
    """Two updates of two microbatches each; the reported loss weights microbatches by their tokens."""
    stream = io.StringIO()
    metrics = RunFabMetrics(interval_seconds=3600, stream=stream, flops=lambda tokens, pairs: 1000.0 * tokens + pairs,
                            peak_flops=1e6)
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.5}])
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, world_size=1, optimizers=[optimizer], sanity_checking=False)
    module = SimpleNamespace(device=torch.device("cpu"), last_grad_norm=None, val_loss=None)
    metrics.on_train_start(trainer, module)
    batch = {"input_ids": torch.zeros(3, 4), "attention_pairs": 7}
    microbatches = [(10.0, 5), (40.0, 20), (3.0, 1), (7.0, 4)]  # (summed loss, target tokens)
    for i, (loss_sum, tokens) in enumerate(microbatches):
        metrics.on_train_batch_start(trainer, module, batch, i)
        if i % 2:
            trainer.global_step += 1
            module.last_grad_norm = torch.tensor(float(trainer.global_step))
        metrics.on_train_batch_end(trainer, module, {"loss_sum": torch.tensor(loss_sum), "target_tokens": tokens}, batch, i)
    metrics.report(trainer, module)
    record = json.loads(stream.getvalue())
    assert record["step"] == 2
    assert record["loss"] == pytest.approx(60 / 30)  # not the mean of the four microbatch means
    assert record["grad_norm"] == pytest.approx(1.5)
    assert record["lr"] == 0.5
    assert record["tokens_per_second"] > 0 and record["samples_per_second"] > 0
    assert record["tokens_per_second"] / record["samples_per_second"] == pytest.approx(30 / 12)
    flops = 4 * (1000.0 * 12 + 7)  # four microbatches of 3 x 4 tokens
    assert record["mfu"] * 1e6 / record["tokens_per_second"] == pytest.approx(flops / 30, rel=1e-4)


def test_throughput_is_over_the_wall_clock_and_the_time_computing_is_a_figure_of_its_own(monkeypatch):
    """Two updates of 30 target tokens, one second of training each, and 9 s waiting for input
    between them (a slow input): 60 tokens were delivered in 11 s, as the contract counts throughput,
    and computed in 2 s, which tokens_per_compute_second says."""
    import callbacks.runfab_metrics as runfab_metrics

    clock, waited = [100.0], [0.0]
    monkeypatch.setattr(runfab_metrics.time, "perf_counter", lambda: clock[0])
    stream = io.StringIO()
    metrics = RunFabMetrics(interval_seconds=3600, stream=stream, input_wait=lambda: waited[0])
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, world_size=1, sanity_checking=False,
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 0.5}])])
    module = SimpleNamespace(device=torch.device("cpu"), last_grad_norm=None, val_loss=None)
    metrics.on_train_start(trainer, module)
    batch = {"input_ids": torch.zeros(3, 4)}
    for update in range(2):
        if update:
            clock[0] += 9.0  # training waits for the next update to arrive
            waited[0] += 9.0
        metrics.on_train_batch_start(trainer, module, batch, update)
        clock[0] += 1.0
        trainer.global_step += 1
        metrics.on_train_batch_end(trainer, module, {"loss_sum": torch.tensor(3.0), "target_tokens": 30}, batch, update)
    metrics.report(trainer, module)
    record = json.loads(stream.getvalue())
    assert record["elapsed_seconds"] == 11.0 and record["training_wait_seconds"] == 9.0
    assert record["tokens_per_second"] == pytest.approx(60 / 11) and record["samples_per_second"] == pytest.approx(6 / 11)
    assert record["steps_per_second"] == pytest.approx(2 / 11)
    assert record["tokens_per_compute_second"] == pytest.approx(60 / 2)
    summary = metrics.summary(trainer, module)
    assert summary["normal_region"]["seconds"] == pytest.approx(11.0)
    assert summary["normal_region"]["input_wait_seconds"] == pytest.approx(9.0)
    assert summary["tokens_per_second"] == pytest.approx(60 / 11)
    assert summary["tokens_per_compute_second"] == pytest.approx(60 / 2) == summary["tokens_per_compute_second_per_gpu"]


class PoisonWeights(L.Callback):
    """Turns the embedding into NaN before the given microbatch, as a diverging run would."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            with torch.no_grad():
                pl_module.model.wte.weight.fill_(float("nan"))


def test_a_non_finite_loss_stops_the_run_naming_the_update_and_reports_no_nan():
    rng = np.random.default_rng(0)
    rows = [Row(rng.integers(0, 50, 16).astype(np.int32), np.arange(16, dtype=np.int32)) for _ in range(16)]
    batches = [mb for i in range(0, 16, 4) for mb in split_update(rows[i : i + 4], 1, 2, StreamStats())[0]]
    torch.manual_seed(0)
    lit = DecoderTrainingModule(ModelConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, max_seq_len=16),
                                OptimConfig(warmup_steps=1))
    stream = io.StringIO()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=8, max_epochs=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RunFabMetrics(interval_seconds=0.0, stream=stream), PoisonWeights(batch_idx=5)],
    )
    with pytest.raises(NonFiniteLossError, match="optimizer step 3"):
        trainer.fit(lit, train_dataloaders=DataLoader(batches, batch_size=None))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(v) for line in lines for v in line.values())


def test_training_in_process_writes_metrics_model_record_and_checkpoints_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("conf/smoke.yaml", [*IN_PROCESS, f"output.root={tmp_path / 'out'}", "trainer.checkpoint_every_steps=2"])
    stdout = io.StringIO()
    monkeypatch.setattr("sys.stdout", stdout)
    result = training_run.run_training(cfg, BatchSplit(8, 4, 1, train.EFFECTIVE_BATCH_SIZE), stdin=Stdin(io.BytesIO(records())))
    assert result["steps"] == 4
    lines = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert lines and all(set(line) >= {"step", "elapsed_seconds"} for line in lines)
    assert any("val_loss" in line for line in lines)
    assert lines[-1]["step"] == 4 and [line["step"] for line in lines] == sorted(line["step"] for line in lines)
    model_dir, checkpoints = tmp_path / "out" / "model", tmp_path / "out" / "checkpoints"
    assert {p.name for p in model_dir.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json", "run_record.json"}
    assert list(checkpoints.glob("*.ckpt")) and not list(model_dir.glob("*.ckpt"))
    record = json.loads((model_dir / "run_record.json").read_text())
    assert record["batch"] == {"effective": 32, "microbatch": 8, "accumulation": 4, "world_size": 1, "tokens_per_update": 1024}
    assert record["optimizer_steps"] == 4 and record["input"]["source"] == "stdin"
    assert record["input"]["accepted"] == record["input"]["records"] <= 400
    assert len(record["input"]["input_sha256"]) == 64
    assert record["config"]["model"]["n_layer"] == 1 and record["seed"] == cfg.seed
    assert record["tokenizer"]["vocab_size"] == 8192 and record["environment"]["libraries"]["torch"]
    assert "train.py" in record["sources_sha256"] and "conf/smoke.yaml" in record["sources_sha256"]
    head = subprocess.run(["git", "-C", str(training_run.BUNDLE_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert (record["git"] or {}).get("commit") == (head.stdout.strip() if head.returncode == 0 else None)
    assert record["compile_cache"] is None  # CPU training does not compile


def test_the_run_record_reports_the_compile_caches_where_the_environment_puts_them(tmp_path, monkeypatch):
    from callbacks.run_record import RunRecord

    sizes = {"inductor": (1000, 24), "triton": (4096,)}
    for name, files in sizes.items():
        for i, size in enumerate(files):
            path = tmp_path / name / f"level{i}" / f"kernel{i}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * size)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    usage = RunRecord(tmp_path, {}, None, compiled=True).compile_cache_usage()
    assert usage == {name: {"path": str(tmp_path / name), "bytes": sum(files)} for name, files in sizes.items()}
    assert RunRecord(tmp_path, {}, None, compiled=False).compile_cache_usage() is None


def test_a_model_smaller_than_the_tokenizer_vocabulary_is_refused():
    cfg = load_config("conf/smoke.yaml", ["model.vocab_size=100"])
    with pytest.raises(ConfigError, match="at least the tokenizer"):
        training_run.load_encoder(cfg)


def test_a_batch_split_that_does_not_make_the_effective_batch_is_refused():
    with pytest.raises(ConfigError, match="EFFECTIVE_BATCH_SIZE"):
        BatchSplit(3, 5, 1, train.EFFECTIVE_BATCH_SIZE)
    with pytest.raises(ConfigError, match=r"microbatch \(-8\) and accumulation \(-4\) must each be at least 1"):
        BatchSplit(-8, -4, 1, train.EFFECTIVE_BATCH_SIZE)  # their product is 32: the product's message would mislead
    BatchSplit(4, 8, 1, train.EFFECTIVE_BATCH_SIZE)


def test_compile_caches_go_under_the_output_even_after_imports_wrote_the_tmp_default(tmp_path, monkeypatch):
    # What a run sees once its hooks import Lightning: that import already put inductor's /tmp default
    # into the environment, so a setdefault would have kept the caches in RunFab's 256 MiB /tmp.
    probe = "import os, lightning; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    after_import = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env,
                                  cwd=Path(train.__file__).parent).stdout.strip()
    assert Path(after_import) == device_policy.inductor_default_cache()

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", after_import)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache

    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):  # put back afterwards
        monkeypatch.setattr(codecache, name, getattr(codecache, name))

    # prepare_compile also sets the compile thread count; config.patch puts it back afterwards (a
    # monkeypatch would delete it on undo, and inductor then reports the setting as missing).
    with inductor_config.patch(compile_threads=inductor_config.compile_threads):
        device_policy.prepare_compile(tmp_path / "out/data/compile-cache", world=1)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "out/data/compile-cache/inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "out/data/compile-cache/triton")
        # the precompiled C++ headers (150 MB on a CPU compile) follow, though inductor fixed them under /tmp
        assert codecache._HEADER_DIR == str(tmp_path / "out/data/compile-cache/inductor/precompiled_headers")

        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # a folder someone chose is kept
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
        device_policy.prepare_compile(tmp_path / "out/data/compile-cache", world=1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "my-triton")
    assert codecache._HEADER_DIR == str(tmp_path / "mine" / "precompiled_headers")


def test_the_run_record_names_each_loggers_folder_and_the_wandb_runs_page(tmp_path, monkeypatch):
    import sys
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from callbacks.run_record import logger_locations

    csv = CSVLogger(tmp_path, name="csv")
    wandb_logger = WandbLogger.__new__(WandbLogger)  # W&B itself need not be installed: its run is faked below
    run = SimpleNamespace(url="https://wandb.ai/lab/runfab/runs/abc123", dir=str(tmp_path / "wandb/run-abc123/files"))
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(run=run))
    found = logger_locations(SimpleNamespace(loggers=[csv, wandb_logger]))
    assert found == {"CSVLogger": {"folder": csv.log_dir},
                     "wandb": {"url": run.url, "folder": str(tmp_path / "wandb/run-abc123")}}
    run.url = None  # offline: no page, the folder that `wandb sync` uploads
    assert logger_locations(SimpleNamespace(loggers=[wandb_logger]))["wandb"]["url"] is None
