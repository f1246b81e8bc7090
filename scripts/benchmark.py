"""Throughput, MFU and memory of the real Lightning trainer against a plain PyTorch loop, in one job.

Both runs read the same synthetic records through the same data pipeline, build the same model
(compiled trunk, varlen attention, chunked loss), optimizer and loss normalization; the Lightning
run is `train.py` itself, fed on stdin as RunFab feeds it. Throughput is target tokens over wall
seconds of the normal region (after the warmup updates), GPU synchronized.

Usage (on a GPU machine): python scripts/benchmark.py [--layouts realistic one-doc] [--steps 40] [--warmup 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train  # noqa: E402
from config import load_config  # noqa: E402
from datamodule import UpdateFeeder, ValidationPool  # noqa: E402
from lit_module import LitGPT  # noqa: E402
from model import training_flops  # noqa: E402

LAYOUTS = {
    # Heavy-tailed document lengths with a mean near 1,000 tokens: many documents per row.
    "realistic": ["--mean-tokens", "1000", "--sigma", "1.0"],
    # One document spanning each 4096-token row (4095 tokens + EOS): nanoGPT's benchmark work.
    "one-doc": ["--mean-tokens", "4095", "--sigma", "0"],
}


def records_command(layout: str, docs: int) -> list[str]:
    return [sys.executable, str(ROOT / "scripts/synthetic_records.py"), "--docs", str(docs), *LAYOUTS[layout]]


def run_lightning(layout: str, args, out: Path) -> dict:
    """`python train.py` with the records on stdin; figures from its own metric lines."""
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(out / f"lightning-{layout}"))
    overrides = [
        "--microbatch", str(args.microbatch), "--trainer.max_steps", str(args.steps), "--trainer.val_every_steps", "0",
        "--data.val_fraction", "0", "--metrics.interval_seconds", "1", "--optim.warmup_steps", "5",
    ]
    generator = subprocess.Popen(records_command(layout, args.docs), stdout=subprocess.PIPE)
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides], stdin=generator.stdout, env=env,
        capture_output=True, text=True,
    )
    generator.kill()
    if result.returncode:
        raise RuntimeError(f"train.py failed:\n{result.stderr[-4000:]}")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    intervals = [line for line in lines if "tokens_per_second" in line]
    tokens = seconds = flops_seconds = 0.0
    previous = None
    for line in intervals:
        if previous is not None and previous["step"] >= args.warmup:
            duration = line["elapsed_seconds"] - previous["elapsed_seconds"]
            tokens += line["tokens_per_second"] * duration
            flops_seconds += line["mfu"] * duration
            seconds += duration
        previous = line
    return {
        "tokens_per_second": tokens / seconds,
        "mfu": flops_seconds / seconds,
        "peak_allocated_gib": intervals[-1]["peak_allocated_gib"],
        "peak_reserved_gib": intervals[-1]["peak_reserved_gib"],
        "measured_seconds": seconds,
    }


def run_plain(layout: str, args) -> dict:
    """The same work in a hand-written loop: no Trainer, no callbacks, nothing between the steps."""
    cfg = load_config(overrides=["data.val_fraction=0"])
    accumulation = train.EFFECTIVE_BATCH_SIZE // args.microbatch
    encoder = train.load_encoder(cfg)
    generator = subprocess.Popen(records_command(layout, args.docs), stdout=subprocess.PIPE)
    settings = train.stream_settings(cfg, encoder, args.microbatch, accumulation, 1)
    feeder = UpdateFeeder(lambda: (generator.stdout, "generator"), settings, encoder.encode_batch, ValidationPool(0))
    lit = LitGPT(cfg.model, cfg.optim).cuda()
    lit.model.compile_trunk()
    optimizer = lit.configure_optimizers()["optimizer"]
    torch.cuda.reset_peak_memory_stats()
    step = microbatches = 0
    tokens = flops = 0.0
    start = None
    for batch in feeder.iterate():
        batch = {k: v.pin_memory().cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lit.model.loss_sum(batch) / batch["update_target_tokens"]
        loss.backward()
        microbatches += 1
        if start is not None:
            tokens += batch["target_tokens"]
            flops += training_flops(cfg.model, batch["input_ids"].numel(), batch["attention_pairs"])
        if microbatches % accumulation:
            continue
        torch.nn.utils.clip_grad_norm_(lit.parameters(), cfg.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        if step == args.steps:
            break
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    feeder.stop()
    generator.kill()
    return {
        "tokens_per_second": tokens / seconds,
        "mfu": flops / seconds / cfg.metrics.peak_flops,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "measured_seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--docs", type=int, default=60_000)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(args.out / "compile-cache" / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(args.out / "compile-cache" / "triton"))
    results = {}
    for layout in args.layouts:
        results[layout] = {"lightning": run_lightning(layout, args, args.out), "plain": run_plain(layout, args)}
        print(json.dumps({layout: results[layout]}), file=sys.stderr, flush=True)
    (args.out / "benchmark.json").write_text(json.dumps(results, indent=2))
    tokens_per_row = 4096 * args.microbatch
    print(f"\n{torch.cuda.get_device_name()}  microbatch {args.microbatch}  steps {args.steps} (warmup {args.warmup})")
    print(f"{'layout':<10} {'run':<10} {'tokens/s':>10} {'MFU':>7} {'peak alloc GiB':>15} {'MiB/token':>10} {'L/plain':>8}")
    for layout, runs in results.items():
        for name, r in runs.items():
            ratio = r["tokens_per_second"] / runs["plain"]["tokens_per_second"]
            per_token = r["peak_allocated_gib"] * 1024 / tokens_per_row
            print(f"{layout:<10} {name:<10} {r['tokens_per_second']:>10,.0f} {r['mfu']:>7.1%} "
                  f"{r['peak_allocated_gib']:>15.2f} {per_token:>10.3f} {ratio:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
