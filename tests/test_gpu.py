"""The CUDA fast paths against the plain ones: same function, within bf16 rounding. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from model import GPT, IGNORE_INDEX, GPTConfig, document_offsets, token_loss_sum, varlen_attn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def packed_batch(rows: int, seq_len: int, vocab: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    positions = []
    for _ in range(rows):
        row, filled = [], 0
        while filled < seq_len:
            n = min(seq_len - filled, int(torch.randint(1, seq_len // 2, (1,), generator=generator)))
            row.append(torch.arange(n))
            filled += n
        positions.append(torch.cat(row))
    positions = torch.stack(positions)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    targets = torch.where(torch.roll(positions, -1, 1) != 0, torch.roll(tokens, -1, 1), IGNORE_INDEX)
    targets[:, -1] = IGNORE_INDEX
    batch = {"input_ids": tokens, "positions": positions, "targets": targets, "cu_seqlens": document_offsets(positions)}
    return {k: v.cuda() for k, v in batch.items()}


def twin_models(**config) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    base = dict(vocab_size=512, n_layer=2, n_head=4, n_embd=128, max_seq_len=256, init_std=0.05)
    fast = GPT(GPTConfig(**base, attention="varlen", loss_chunk_tokens=128, **config)).cuda()
    plain = GPT(GPTConfig(**base, attention="sdpa", loss_chunk_tokens=0, **config)).cuda()
    plain.load_state_dict(fast.state_dict())
    return fast, plain


@pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen is not in this PyTorch")
def test_varlen_and_chunked_loss_match_the_plain_path_forward_and_backward():
    fast, plain = twin_models()
    batch = packed_batch(rows=4, seq_len=256, vocab=512, seed=1)
    losses, grads = [], []
    for model in (fast, plain):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss_sum(batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert relative_error(losses[0], losses[1]) < 1e-3
    for name, expected in grads[1].items():
        assert relative_error(grads[0][name], expected) < 2e-2, name


@pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen is not in this PyTorch")
def test_varlen_attention_never_crosses_documents():
    fast, _ = twin_models()
    batch = packed_batch(rows=2, seq_len=256, vocab=512, seed=2)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = fast(batch["input_ids"], batch["positions"]).float()
        starts = batch["cu_seqlens"].tolist()
        flat_ids = batch["input_ids"].flatten()
        flat_logits = packed.flatten(0, 1)
        for a, b in zip(starts, starts[1:]):
            alone = fast(flat_ids[a:b][None]).float()[0]
            assert relative_error(flat_logits[a:b], alone) < 1e-2


def test_chunked_loss_under_autocast_matches_the_plain_loss():
    torch.manual_seed(3)
    hidden = torch.randn(3000, 256, device="cuda", requires_grad=True)
    weight = (0.05 * torch.randn(50257, 256, device="cuda")).requires_grad_()
    targets = torch.randint(0, 50257, (3000,), device="cuda")
    targets[::7] = IGNORE_INDEX
    results = []
    for chunk in (0, 1024):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = token_loss_sum(hidden, weight, targets, chunk_tokens=chunk)
        results.append((loss.detach(), *torch.autograd.grad(loss, (hidden, weight))))
    for got, expected in zip(results[1], results[0]):
        assert relative_error(got, expected) < 1e-2
