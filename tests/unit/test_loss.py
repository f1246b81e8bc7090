"""The LM head + cross-entropy: the chunked loss against the plain one."""

from __future__ import annotations

import torch

from model.loss import IGNORE_INDEX, token_loss_sum


def test_chunked_loss_matches_the_plain_loss_and_its_gradients():
    torch.manual_seed(4)
    hidden = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(53, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 53, (2, 37))
    targets[0, 5:9] = IGNORE_INDEX
    plain = token_loss_sum(hidden, weight, targets)
    plain_grads = torch.autograd.grad(3.0 * plain, (hidden, weight))
    for chunk in (1, 8, 36, 100):  # 100: the whole batch is one chunk
        chunked = token_loss_sum(hidden, weight, targets, chunk_tokens=chunk)
        torch.testing.assert_close(chunked, plain)
        for got, expected in zip(torch.autograd.grad(3.0 * chunked, (hidden, weight)), plain_grads):
            torch.testing.assert_close(got, expected)
    with torch.no_grad():
        torch.testing.assert_close(token_loss_sum(hidden, weight, targets, chunk_tokens=8), plain)
