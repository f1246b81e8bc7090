"""Write NDJSON records of random token ids with realistic, heavy-tailed document lengths.

Lengths are lognormal (default mean near 1,000 tokens), like web documents, so packed rows hold
many documents of varied size. Used for benchmarks and GPU checks; streams, never holds the output.

Usage: python -m tools bench synthetic-records --docs 50000 [--mean-tokens 1000] [--vocab 50257] > records.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench synthetic-records", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, required=True, help="how many records")
    parser.add_argument("--mean-tokens", type=float, default=1000.0, help="mean document length (default: 1000)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal shape: larger is more heavy-tailed; 0: every document has mean-tokens")
    parser.add_argument("--max-tokens", type=int, default=100_000, help="longest document (default: 100000)")
    parser.add_argument("--vocab", type=int, default=50257, help="token ids are drawn from 1..VOCAB-1 (default: 50257)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    mu = math.log(args.mean_tokens) - args.sigma**2 / 2  # so the mean is mean_tokens
    out = sys.stdout
    for _ in range(args.docs):
        n = round(min(args.max_tokens, max(1, rng.lognormal(mu, args.sigma))))
        out.write(json.dumps({"input_ids": rng.integers(1, args.vocab, n).tolist()}) + "\n")
    out.flush()
    return 0
