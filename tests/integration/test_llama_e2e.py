"""A tiny Llama (conf/llama-smoke.yaml, and conf/fast-smoke.yaml's recipe; smaller rows) trained by train.py
in a fresh interpreter on the bundled sample, as a user runs it: its loss falls, it exports as a Llama (with
QK-norm: as a Qwen3), the run record names the family, and
``tools evaluate`` scores the export with the run's own final validation cross-entropy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, as_args


@pytest.mark.parametrize("preset, optimizers, architecture", [
    ("conf/llama-smoke.yaml", ["AdamW"], "LlamaForCausalLM"),
    ("conf/fast-smoke.yaml", ["Muon", "AdamW"], "Qwen3ForCausalLM"),  # model.qk_norm: Qwen3 is Llama with it
])
def test_a_tiny_llama_trains_on_the_cpu_its_loss_falls_and_it_exports_as_llama(tmp_path, preset, optimizers,
                                                                             architecture):
    overrides = {"model.max_seq_len": 64, "trainer.max_steps": 8, "trainer.val_every_steps": 4,
                 "optim.warmup_steps": 2, "metrics.interval_seconds": 0, "data.source": "sample"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNFAB", "HF_"))}
    env.update(CUDA_VISIBLE_DEVICES="", RUNFABRIC_OUTPUT=str(tmp_path / "out"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", preset,
                           *as_args(overrides)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in proc.stdout.splitlines() if '"loss"' in line]
    assert len(losses) >= 8 and losses[-1] < losses[0] - 0.5, losses

    model_dir = tmp_path / "out" / "model"
    settings = json.loads((model_dir / "config.json").read_text())
    assert settings["architectures"] == [architecture] and settings["num_key_value_heads"] == 2
    record = json.loads((model_dir / "run_record.json").read_text())
    assert record["model_family"] == "llama" and record["config"]["model"]["family"] == "llama"
    assert [optimizer["name"] for optimizer in record["optimizers"]] == optimizers
    validation = record["comparability"]["validation"]
    assert validation["ce_after"] < validation["ce_before"] - 0.5

    scored = subprocess.run([sys.executable, "-m", "tools", "evaluate", str(model_dir), "--data",
                             str(tmp_path / "out" / "run" / "validation.jsonl"), "--device", "cpu"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert abs(json.loads(scored.stdout)["cross_entropy"] - validation["ce_after"]) < 1e-6
