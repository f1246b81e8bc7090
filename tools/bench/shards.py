"""How fast one rank reads prepared rows, on one core, against what a GPU consumes.

``python -m tools bench shards [--path DIR] [--seconds 10] [--microbatch 32] [--gpu-tokens-per-second N]``

A rank of a run from prepared shards does this work for every update (pipeline/shards.py): LitData
reads its rows from the chunks, and GroupCollate turns them into microbatches (positions, targets,
document offsets, target-token counts). This measures that work alone, in this process pinned to
one core with one torch thread and no loader workers, so the figure is what one core gives one
rank. The reading must keep well ahead of what the rank's GPU trains: given that rate
(``--gpu-tokens-per-second``, from a run's metric lines or ``bench training``), the headroom is printed.

Without ``--path``, the bundled sample (real text) is repeated into a corpus of about ``--rows``
rows and prepared with ``python -m tools prepare`` and the reference configuration (rows of 4,096
tokens, GPT-2's tokenizer), all cores; its throughput is printed too, as context (preparing is done
once, before training). stdout carries one JSON object with the figures; stderr the same in words.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from runfab import created_files

ROOT = Path(__file__).resolve().parents[2]


def sample_corpus(path: Path, rows: int, seq_len: int) -> None:
    """The bundled sample repeated until it holds about ``rows`` rows of GPT-2 tokens (4.3 bytes a token)."""
    sample = (ROOT / "data" / "sample.jsonl").read_bytes()
    copies = max(1, round(rows * seq_len * 4.3 / len(sample)))
    with created_files.open_created(path, "wb") as out:
        for _ in range(copies):
            out.write(sample)


def prepare(corpus: Path, output: Path, config: str) -> dict:
    from tools.data import prepare as prepare_tool

    captured = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(captured):
        status = prepare_tool.main(["--input", str(corpus), "--output", str(output), "--config", config,
                                    "--range-mib", "16"])
    seconds = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"bench shards: preparing the corpus failed (exit {status})")
    summary = json.loads(captured.getvalue().strip().splitlines()[-1])
    workers = min(len(os.sched_getaffinity(0)), summary["ranges"])
    return {"seconds": round(seconds, 2), "workers": workers, "documents": summary["documents"],
            "document_tokens": summary["document_tokens"], "rows": summary["rows"],
            "tokens_per_second": round(summary["document_tokens"] / seconds),
            "tokens_per_second_per_worker": round(summary["document_tokens"] / seconds / workers)}


def read_rows(path: str, seq_len: int, microbatch: int, seconds: float, seed: int) -> dict:
    """One rank's reading on one core: every group the loader yields, pass after pass (each pass is
    another shuffled epoch), until ``seconds`` have passed."""
    import torch

    from pipeline.shards import GroupCollate, open_rows

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    loader = open_rows(path, seed, microbatch, workers=0, collate_fn=GroupCollate(seq_len, microbatch))
    started = time.perf_counter()
    updates = target_tokens = 0
    while time.perf_counter() - started < seconds:
        for group in loader:
            updates += 1
            target_tokens += group["target_tokens"]
            if time.perf_counter() - started >= seconds:
                break
    elapsed = time.perf_counter() - started
    rate = target_tokens / elapsed
    return {"updates": updates, "rows": updates * microbatch, "target_tokens": target_tokens,
            "seconds": round(elapsed, 3), "target_tokens_per_second": round(rate)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools bench shards", description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="prepared rows (a folder or URL); default: prepare the bundled sample")
    parser.add_argument("--config", default="conf/config.yaml", help="the configuration (row length, tokenizer, seed)")
    parser.add_argument("--rows", type=int, default=2000, help="rows to prepare when --path is not given")
    parser.add_argument("--microbatch", type=int, default=32, help="rows per update on the rank")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to read at most")
    parser.add_argument("--gpu-tokens-per-second", type=float,
                        help="target tokens/s the rank's GPU trains (a run's tokens_per_second): prints the headroom")
    args = parser.parse_args(argv)
    from config import load_config

    cfg = load_config(args.config)
    seq_len = cfg.model.max_seq_len
    result: dict = {"config": args.config, "seq_len": seq_len, "microbatch": args.microbatch}
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as folder:
        path = args.path
        if path is None:
            corpus, path = Path(folder) / "corpus.jsonl", str(Path(folder) / "rows")
            sample_corpus(corpus, args.rows, seq_len)
            result["prepare"] = prepare(corpus, Path(path), args.config)
            print(f"prepare: {result['prepare']['document_tokens']} tokens in {result['prepare']['seconds']} s with "
                  f"{result['prepare']['workers']} worker(s): {result['prepare']['tokens_per_second_per_worker']} "
                  "tokens/s per worker", file=sys.stderr)
        result["path"] = path
        result["read"] = read_rows(path, seq_len, args.microbatch, args.seconds, cfg.seed)
    read = result["read"]
    headroom = ""
    if args.gpu_tokens_per_second:
        read["gpu_target_tokens_per_second"] = args.gpu_tokens_per_second
        read["headroom"] = round(read["target_tokens_per_second"] / args.gpu_tokens_per_second, 2)
        headroom = f", {read['headroom']}x the {args.gpu_tokens_per_second:g} tokens/s the GPU trains"
    print(f"read: {read['target_tokens_per_second']} target tokens/s on one core ({read['updates']} updates of "
          f"{args.microbatch} x {seq_len}){headroom}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
