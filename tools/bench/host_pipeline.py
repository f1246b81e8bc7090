"""Target tokens per second of the data pipeline alone: stdin -> tokens -> packed rows -> updates, no
model, no GPU, for text records (the bundled sample, repeated) and for input_ids records.

Run it on the cores RunFab grants (``taskset -c 0,1``). The tokenizer is the configuration's (GPT-2's
for conf/config.yaml); ``--data.tokenizer conf/tokenizer.json`` times the small one.
"""

from __future__ import annotations

import io
import os
import subprocess
import time

import train
from pipeline.feeder import UpdateFeeder
from pipeline.validation_split import ValidationPool
from runtime import training_run
from runtime.batch_split import BatchSplit
from tools import processes
from tools.bench import runs


def main(argv: list[str]) -> int:
    parser = runs.parser("host-pipeline", "Target tokens/s of the data pipeline alone, no model, no GPU.",
                         runs=False, layouts=False)
    parser.add_argument("--microbatch", type=int, default=32, help="rows per microbatch (default: 32)")
    parser.add_argument("--copies", type=int, default=30, help="copies of data/sample.jsonl as text records (default: 30)")
    parser.add_argument("--docs", type=int, default=8_000, help="input_ids records to generate (default: 8000)")
    args = runs.parse(parser, argv)
    cfg = runs.config(args, "data.val_fraction=0.005")
    encoder = training_run.load_encoder(cfg)
    split = BatchSplit(args.microbatch, train.EFFECTIVE_BATCH_SIZE // args.microbatch, 1, train.EFFECTIVE_BATCH_SIZE)
    settings = training_run.stream_settings(cfg, encoder, split)
    text = (runs.ROOT / "data/sample.jsonl").read_bytes() * args.copies
    generator = processes.start(runs.records_command("realistic", args.docs, cfg.model.vocab_size), cwd=runs.ROOT,
                                stdout=subprocess.PIPE)
    ids, _ = generator.communicate()
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {}
    for name, records in (("text", text), ("input_ids", ids)):
        feeder = UpdateFeeder(lambda: (io.BytesIO(records), name), settings, encoder.encode_batch_arrays,
                              ValidationPool(cfg.data.val_max_tokens))
        started, tokens = time.perf_counter(), 0
        for item in feeder.iterate():
            tokens += item["target_tokens"] if isinstance(item, dict) else 0
        seconds = time.perf_counter() - started
        figures[name] = {"target_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                         "tokenizer": encoder.backend, "tokenizer_path": cfg.data.tokenizer}
        print(f"host pipeline, {name} records: {tokens:,} target tokens in {seconds:.1f} s = "
              f"{tokens / seconds:,.0f} tokens/s (tokenizer {cfg.data.tokenizer} via {encoder.backend}, "
              f"{len(os.sched_getaffinity(0))} cores)")
    runs.save(args, "host-pipeline", figures)
    return 0
