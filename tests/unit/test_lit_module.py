"""Loss normalization, optimizer groups and schedule, checked through the real Lightning Trainer."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pipeline.packing import Row
from pipeline.records import StreamStats
from pipeline.stream import split_update
from lit_module import DecoderTrainingModule, OptimConfig, lr_factor
from model.decoder import ModelConfig
from model.loss import IGNORE_INDEX, token_loss_sum

SEQ_LEN = 16
ROWS = 8


def uneven_rows(seed: int = 0) -> list[Row]:
    """Rows whose document layouts differ, so microbatches hold very different target counts."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(ROWS):
        cuts = sorted(rng.choice(np.arange(1, SEQ_LEN), size=i % 5, replace=False))
        bounds = [0, *cuts, SEQ_LEN]
        positions = np.concatenate([np.arange(b - a) for a, b in zip(bounds, bounds[1:])]).astype(np.int32)
        rows.append(Row(rng.integers(0, 61, SEQ_LEN).astype(np.int32), positions))
    return rows


def module(seed: int = 0, **optim) -> DecoderTrainingModule:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=61, n_layer=2, n_head=2, n_embd=16, max_seq_len=SEQ_LEN, init_std=0.1)
    return DecoderTrainingModule(config, OptimConfig(warmup_steps=1, schedule="constant", **optim))


class CaptureGradients(L.Callback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})


def fit(lit: DecoderTrainingModule, updates: list[list[Row]], microbatch: int, steps: int = 1,
        gradient_clip_val: float | None = None) -> CaptureGradients:
    accumulation = ROWS // microbatch
    batches = [mb for update in updates for mb in split_update(update, 1, microbatch, StreamStats())[0]]
    capture = CaptureGradients()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=steps, max_epochs=1,
        accumulate_grad_batches=accumulation, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[capture], gradient_clip_val=gradient_clip_val,
    )
    trainer.fit(lit, train_dataloaders=DataLoader(batches, batch_size=None))
    return capture


def reference_gradients(lit: DecoderTrainingModule, rows: list[Row]) -> dict[str, torch.Tensor]:
    """The definition: sum of every target token's loss in the update / the update's target count."""
    lit = copy.deepcopy(lit)
    tokens = torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64))
    positions = torch.from_numpy(np.stack([r.positions for r in rows]).astype(np.int64))
    targets = torch.from_numpy(np.stack([r.targets() for r in rows]))
    hidden = lit.model.hidden_states(tokens, positions)
    loss = token_loss_sum(hidden, lit.model.lm_head_weight, targets) / (targets != IGNORE_INDEX).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in lit.named_parameters()}


@pytest.mark.parametrize("microbatch", [1, 2, 4, 8])
def test_accumulated_gradient_equals_the_one_batch_gradient(microbatch):
    rows = uneven_rows()
    lit = module()
    expected = reference_gradients(lit, rows)
    got = fit(lit, [rows], microbatch).grads[0]
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_check_has_teeth_a_per_microbatch_mean_would_fail_it():
    """Averaging each microbatch's mean loss (the naive recipe) weights tokens unequally here."""
    rows = uneven_rows()
    lit = module()
    expected = reference_gradients(lit, rows)
    naive = copy.deepcopy(lit)
    for i in range(0, ROWS, 2):
        part = rows[i : i + 2]
        tokens = torch.from_numpy(np.stack([r.tokens for r in part]).astype(np.int64))
        positions = torch.from_numpy(np.stack([r.positions for r in part]).astype(np.int64))
        targets = torch.from_numpy(np.stack([r.targets() for r in part]))
        hidden = naive.model.hidden_states(tokens, positions)
        loss = token_loss_sum(hidden, naive.model.lm_head_weight, targets) / (targets != IGNORE_INDEX).sum()
        (loss / (ROWS // 2)).backward()
    difference = max((p.grad - expected[n]).abs().max().item() for n, p in naive.named_parameters())
    assert difference > 1e-4


def test_weights_after_several_updates_do_not_depend_on_the_split():
    updates = [uneven_rows(seed) for seed in range(3)]
    one_batch, split = module(), module()
    fit(one_batch, updates, microbatch=8, steps=3)
    fit(split, updates, microbatch=2, steps=3)
    for (name, a), b in zip(one_batch.named_parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_no_weight_decay_on_norms_biases_and_embeddings():
    lit = module()
    decay, no_decay = lit.parameter_groups()
    names = {id(p): n for n, p in lit.model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(n.endswith(("qkv.weight", "proj.weight", "fc.weight")) for n in decayed)
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"} <= {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(lit.model.parameters()))


def test_schedule_warms_up_linearly_then_follows_the_cosine_to_its_floor():
    cfg = OptimConfig(warmup_steps=10, decay_steps=110, min_lr_ratio=0.1, schedule="cosine")
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(110, cfg) == pytest.approx(0.1)
    assert lr_factor(500, cfg) == pytest.approx(0.1)
    assert lr_factor(50, OptimConfig(warmup_steps=10, schedule="constant")) == 1.0


def test_gradient_clipping_clips_to_the_trainers_value_and_reports_the_norm_before_clipping():
    rows = uneven_rows()
    lit = module()
    expected = reference_gradients(lit, rows)
    fit(lit, [rows], microbatch=4, gradient_clip_val=1e-3)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected.values()]))
    torch.testing.assert_close(lit.last_grad_norm, norm, rtol=1e-5, atol=0)
    assert norm > 1e-3
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in lit.parameters()]))
    torch.testing.assert_close(clipped, torch.tensor(1e-3), rtol=1e-4, atol=0)  # the gradients the step used


def test_wsd_warms_up_holds_its_plateau_then_decays_linearly_over_the_last_fraction():
    cfg = OptimConfig(warmup_steps=10, decay_steps=100, decay_fraction=0.2, min_lr_ratio=0.1, schedule="wsd")
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert [lr_factor(step, cfg) for step in (9, 10, 50, 80)] == pytest.approx([1.0] * 4)
    assert lr_factor(90, cfg) == pytest.approx(0.55)
    assert lr_factor(100, cfg) == pytest.approx(0.1) and lr_factor(400, cfg) == pytest.approx(0.1)
    assert OptimConfig(warmup_steps=10, decay_steps=100, schedule="wsd").problems(100) == []
    refused = OptimConfig(warmup_steps=90, decay_steps=100, decay_fraction=0.2, schedule="wsd").problems(100)
    assert len(refused) == 1 and "optim.decay_fraction" in refused[0]


def test_muon_holds_the_blocks_matrices_and_adamw_everything_else_once():
    lit = module(name="muon", muon_lr=0.05)
    optimizer = lit.configure_optimizers()["optimizer"]
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in lit.model.named_parameters()}
    held_by_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    held_by_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert held_by_muon == {n for n, p in lit.model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.ln_1.weight"} <= held_by_adamw
    assert not held_by_muon & held_by_adamw and len(held_by_muon | held_by_adamw) == len(names)
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 6e-4, 6e-4]


def test_muon_trains_through_lightning_and_its_state_round_trips():
    rows = uneven_rows()
    lit = module(name="muon")
    before = {n: p.detach().clone() for n, p in lit.named_parameters()}
    fit(lit, [rows, uneven_rows(1)], microbatch=4, steps=2)
    moved = {n for n, p in lit.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before)  # Muon's matrices and AdamW's rest all stepped
    optimizer = lit.trainer.optimizers[0]
    state = optimizer.state_dict()
    muon_state = state["optimizers"][0]["state"]
    assert muon_state and all("momentum_buffer" in s for s in muon_state.values())
    again = module(name="muon").configure_optimizers()["optimizer"]
    again.load_state_dict(state)
    assert torch.equal(again.optimizers[0].state_dict()["state"][0]["momentum_buffer"], muon_state[0]["momentum_buffer"])
    with pytest.raises(ValueError, match="optim.name muon"):
        again.load_state_dict(torch.optim.AdamW(lit.parameters()).state_dict())


def test_the_schedule_scales_muon_and_adamw_alike():
    lit = module(name="muon")
    lit.optim_config.schedule, lit.optim_config.warmup_steps = "constant", 4
    configured = lit.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    scheduler.step()
    muon, adamw = optimizer.optimizers
    assert muon.param_groups[0]["lr"] == pytest.approx(0.02 * 2 / 4)
    assert adamw.param_groups[0]["lr"] == pytest.approx(6e-4 * 2 / 4)


def llama_module(tie_embeddings: bool = False, **optim) -> DecoderTrainingModule:
    torch.manual_seed(0)
    config = ModelConfig(family="llama", vocab_size=61, n_layer=2, n_head=2, n_embd=16, max_seq_len=SEQ_LEN,
                         init_std=0.1, tie_embeddings=tie_embeddings)
    return DecoderTrainingModule(config, OptimConfig(warmup_steps=4, schedule="constant", **optim))


def test_under_muon_an_untied_head_goes_to_adamw_and_decays_as_a_matrix():
    lit = llama_module(name="muon")
    muon, adamw = lit.configure_optimizers()["optimizer"].optimizers
    head = lit.model.lm_head.weight
    assert all(p is not head for g in muon.param_groups for p in g["params"])
    decaying = [p for g in adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    assert len(decaying) == 1 and decaying[0] is head
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {
        id(p) for p in lit.model.blocks.parameters() if p.dim() == 2}


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_embedding_and_an_untied_head_take_their_own_lr_and_the_schedule_scales_every_group(name):
    lit = llama_module(name=name, lr=1e-3, embed_lr=1e-2, head_lr=2e-4, decay_embeddings=True)
    configured = lit.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    embedding, head = by_param[id(lit.model.wte.weight)], by_param[id(lit.model.lm_head.weight)]
    norm = by_param[id(lit.model.norm.weight)]
    assert (embedding["initial_lr"], embedding["weight_decay"]) == (1e-2, 0.1)
    assert (head["initial_lr"], head["weight_decay"]) == (2e-4, 0.1)
    assert (norm["initial_lr"], norm["weight_decay"]) == (1e-3, 0.0)
    peaks = [g["initial_lr"] for g in optimizer.param_groups]
    scheduler.step()  # warmup: every group at 2/4 of its own peak
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([lr * 2 / 4 for lr in peaks])
    assert set(peaks) == {1e-3, 1e-2, 2e-4} | ({0.02} if name == "muon" else set())
    from callbacks.run_record import optimizers_held  # the run record names every group's own peak
    held = optimizers_held(SimpleNamespace(optimizers=[optimizer]))
    assert sorted(g["lr"] for o in held for g in o["groups"]) == sorted(peaks)


def test_without_their_own_lr_the_groups_are_the_two_of_before_and_a_tied_head_is_the_embeddings():
    plain = llama_module(tie_embeddings=True).parameter_groups()
    assert [(len(g["params"]), g["weight_decay"], "lr" in g) for g in plain] == [(8, 0.1, False), (6, 0.0, False)]
    tied = llama_module(tie_embeddings=True, embed_lr=5e-3, head_lr=1e-4).parameter_groups()
    assert len(tied) == 3 and tied[2]["lr"] == 5e-3 and tied[2]["params"] == [tied[2]["params"][0]]
    assert OptimConfig(embed_lr=0.0).problems(100) == ["optim.embed_lr must be > 0, or null (optim.lr), not 0.0"]
