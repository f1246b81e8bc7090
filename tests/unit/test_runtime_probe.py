"""What RunFab's memory probe builds, on CPU: the model configuration it probes.

The probe's peak GPU memory and its time per candidate are measured on a GPU (docs/PERFORMANCE.md);
the probe as RunFab runs it, in a fresh process, is in tests/integration.
"""

from __future__ import annotations

import pytest
import torch

from config import load_config
from model.kernels import attention
from runtime import probe


class Built(Exception):
    """Raised by the stand-in for build_module: the probe got as far as building its model."""


@pytest.fixture
def varlen_available(monkeypatch):
    """PyTorch's varlen kernel as CUDA builds have it (some CPU builds lack the import)."""
    monkeypatch.setattr(attention, "varlen_attn", lambda *args, **kwargs: None)


def test_the_eager_probe_builds_pytorchs_attention_where_training_chooses_automatically(monkeypatch, varlen_available):
    built = []

    def build_module(cfg, device, compiled):
        built.append(cfg.compute.attention)
        raise Built

    monkeypatch.setattr(probe, "build_module", build_module)
    cfg = load_config("conf/smoke.yaml")
    assert cfg.compute.attention == "auto"
    for compiled in (False, True):
        with pytest.raises(Built):
            probe.run_probe_local(cfg, 2, 1, 32, compiled=compiled)
    assert built == ["varlen", "auto"]  # the compiled measurement (bench memory-sweep) keeps training's kernels
    assert cfg.compute.attention == "auto"  # the caller's configuration is left as it was


@pytest.mark.parametrize("requested", ["fa4", "varlen", "sdpa"])
def test_an_explicit_attention_kernel_is_probed_as_it_is(varlen_available, requested):
    cfg = load_config("conf/smoke.yaml", [f"compute.attention={requested}"])
    assert probe.probe_model_config(cfg).compute.attention == requested


def test_without_pytorchs_varlen_kernel_the_probe_keeps_the_automatic_choice(monkeypatch):
    monkeypatch.setattr(attention, "varlen_attn", None)  # packed rows would take SDPA's mask: more memory
    cfg = load_config("conf/smoke.yaml")
    assert probe.probe_model_config(cfg).compute.attention == "auto"


def test_the_probe_takes_its_steps_with_muons_state_allocated(monkeypatch):
    """Under optim.name muon the probe steps Muon as training does, the second step with its momentum held."""
    states = []
    step = torch.optim.Muon.step

    def counted(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        states.append(sum(len(s) for s in self.state.values()))
        return result

    monkeypatch.setattr(torch.optim.Muon, "step", counted)
    cfg = load_config("conf/smoke.yaml", ["optim.name=muon", "trainer.accelerator=cpu"])
    result = probe.run_probe_local(cfg, microbatch=4, world=1, effective=8)
    assert result["steps"] == 2 and len(states) == 2 and states[-1] > 0
