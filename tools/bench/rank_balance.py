"""How evenly data-parallel ranks share an update's attention work, with and without balance_ranks.

Packs records through the training pipeline into updates of ranks x microbatch rows, then splits
each update two ways: in stream order (rank r takes the r-th block of rows) and by
``pipeline.stream.balance_ranks``. Prints the busiest rank's attention work over the average, per
update (E[max] / E[mean]): every rank waits for the busiest at each gradient all-reduce.
Needs no GPU.

Usage: python -m tools bench synthetic-records --docs 6000 | python -m tools bench rank-balance [--ranks 2]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from config import load_config
from pipeline.packing import attention_pairs, pack_rows, shuffle_documents
from pipeline.records import StreamStats, encode_documents, read_records
from pipeline.stream import assemble_updates, balance_ranks
from pipeline.validation_split import ValidationPool, split_validation
from runtime import training_run
from runtime.batch_split import BatchSplit


def busiest_over_mean(updates: list[list[list[int]]]) -> float:
    """``updates[u][r]``: the attention pairs of rank r's rows in update u."""
    loads = np.array([[sum(rows) for rows in ranks] for ranks in updates], dtype=float)
    return float(loads.max(axis=1).mean() / loads.mean())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench rank-balance", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (default: 2)")
    parser.add_argument("--microbatch", type=int, default=16, help="rows per rank and update (default: 16)")
    args = parser.parse_args(argv)
    cfg = load_config(overrides=["data.val_fraction=0"])
    encoder = training_run.load_encoder(cfg)
    rows_per_update = args.ranks * args.microbatch
    split = BatchSplit(rows_per_update, 1, 1, rows_per_update)  # one rank: the updates' rows in stream order
    settings = training_run.stream_settings(cfg, encoder, split)
    s, d, stats = settings, settings.data, StreamStats()
    docs = read_records(sys.stdin.buffer, stats, s.vocab_size, d.max_record_bytes, d.give_up_after)
    tokens = encode_documents(docs, encoder.encode_batch_arrays, s.eos_id, stats, d.tokenize_batch_docs,
                              d.tokenize_batch_bytes)
    shuffled = shuffle_documents(split_validation(tokens, ValidationPool(0), 0.0, stats), d.shuffle_buffer_docs,
                                 d.shuffle_buffer_tokens, s.seed)
    in_order, balanced = [], []
    for update in assemble_updates(pack_rows(shuffled, s.seq_len, stats), rows_per_update, stats):
        costs = [attention_pairs(row) for row in update]
        in_order.append([costs[r * args.microbatch:(r + 1) * args.microbatch] for r in range(args.ranks)])
        balanced.append([[attention_pairs(row) for row in share] for share in balance_ranks(update, args.ranks)])
    print(f"{len(in_order)} updates of {args.ranks} x {args.microbatch} rows: busiest rank's attention work over "
          f"the mean, stream order {busiest_over_mean(in_order):.4f}, balanced {busiest_over_mean(balanced):.4f}")
    return 0
