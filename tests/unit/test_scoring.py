"""scoring.py: the validation cross-entropy on a tiny real decoder: the exact token-weighted mean over the set
packed into rows, whatever the microbatch, with its perplexity and target count, and the model left in the mode it
was in."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lit_module import DecoderTrainingModule, OptimConfig
from model.decoder import ModelConfig
from model.loss import IGNORE_INDEX
from pipeline.packing import pack_rows
from pipeline.records import StreamStats
from scoring import cross_entropy

SEQ_LEN = 16
VOCAB = 61


def decoder():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16, max_seq_len=SEQ_LEN, init_std=0.5)
    return DecoderTrainingModule(config, OptimConfig(warmup_steps=1)).model


def documents() -> list[np.ndarray]:
    """Eleven documents of very different lengths, some longer than a row: rows hold very different target
    counts, the last one padded."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in (3, 40, 5, 17, 2, 9, 30, 4, 11, 6, 21)]


def reference(model) -> tuple[float, int]:
    """The definition: every target token's loss over all rows, summed, over the number of target tokens."""
    rows = list(pack_rows(documents(), SEQ_LEN, StreamStats(), pad_last=True))
    tokens = torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64))
    positions = torch.from_numpy(np.stack([r.positions for r in rows]).astype(np.int64))
    targets = torch.from_numpy(np.stack([r.targets() for r in rows]))
    with torch.no_grad():
        logits = model.hidden_states(tokens, positions) @ model.lm_head_weight.T
        losses = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), targets.flatten(),
                                                   ignore_index=IGNORE_INDEX, reduction="sum")
    count = int((targets != IGNORE_INDEX).sum())
    return float(losses) / count, count


@pytest.mark.parametrize("microbatch", [1, 3, 64])
def test_it_is_the_token_weighted_mean_over_the_packed_set_whatever_the_microbatch(microbatch):
    """Rows of uneven target counts in microbatches of 1, 3 (the last one short) or all at once: the same
    number, the summed loss over the target count, not a mean of per-microbatch means."""
    model = decoder()
    expected, count = reference(model)
    got = cross_entropy(model, documents(), SEQ_LEN, microbatch, torch.device("cpu"))
    assert got["target_tokens"] == count
    assert got["cross_entropy"] == pytest.approx(expected, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["cross_entropy"]), rel=1e-9)


@pytest.mark.parametrize("training", [True, False])
def test_the_model_is_left_in_the_mode_it_was_in(training):
    model = decoder().train(training)
    cross_entropy(model, documents(), SEQ_LEN, 4, torch.device("cpu"))
    assert model.training is training


def test_an_empty_set_has_no_cross_entropy_rather_than_a_division_by_zero():
    got = cross_entropy(decoder(), [], SEQ_LEN, 4, torch.device("cpu"))
    assert got == {"cross_entropy": None, "perplexity": None, "target_tokens": 0}


def test_scoring_an_export_needs_no_lightning():
    """What ``tools evaluate`` imports to score an export (this module, the weights' names, the validation file)
    leaves Lightning unimported: the tool starts in half the time."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    heavy = "{'lightning', 'pytorch_lightning', 'torchmetrics'}"
    probe = ("import sys, scoring, model.hf, pipeline.validation_split; "
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy}))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
