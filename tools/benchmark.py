"""Throughput, MFU and memory of the real Lightning trainer against a plain PyTorch loop, in one job.

Both runs read the same synthetic records through the same data pipeline, build the same model
(compiled trunk, varlen attention or SDPA for one-document rows, chunked loss), optimizer and
loss normalization; the Lightning run is `train.py` itself, fed on stdin as RunFab feeds it.
Throughput is target tokens over wall seconds of the normal region (after the warmup updates),
GPU synchronized; the Lightning figures come from the run record's summary.

Extra runs, in the same job:
  --observe       a Lightning run with a profiler window and a memory snapshot (issue 6): its normal
                  region excludes the observed updates, so its throughput must match the plain run's.
  --reference     with the one-doc layout, nanoGPT's recipe (whole model compiled, full-vocabulary
                  logits, random tokens) on the same GPU, for the Lightning / nanoGPT ratio of target 2.
  --workers       a Lightning run through the data-parallel worker path on the same device(s), and
                  the peak host memory (RSS and PSS summed over the process tree) of both paths.
  --memory-sweep  the probe (eager, as RunFab runs it) and the same probe compiled, at every
                  candidate microbatch: compiled peak memory must not exceed eager.
  --host-pipeline the data pipeline alone (stdin -> tokens -> rows -> updates), no GPU needed: the one
                  mode that runs on a CPU; every other one is refused at once there.
  --scaling       data parallelism: `train.py` on 1 GPU (microbatch x 2) then on 2 GPUs (microbatch x 1
                  each), the same job, each with a cold compile cache as on RunFab: tokens/s, scaling, peak
                  host memory (PSS summed over the tree, RSS beside it) and each process's memory by stage.
  --probe-timing  RunFab's probe of one candidate (`import train; train.probe_batch(K)` in a fresh
                  process on every visible GPU): whole-process seconds and peak host memory.

Usage (on a GPU machine): python -m tools.benchmark [--layouts realistic one-doc] [--microbatch 32]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtime import hostmem  # noqa: E402
from runtime import device_policy  # noqa: E402
from runtime import probe  # noqa: E402
import train  # noqa: E402
from runtime import training_run  # noqa: E402
from runtime.batch_split import BatchSplit  # noqa: E402
from callbacks.runfab_metrics import peak_memory  # noqa: E402
from config import load_config  # noqa: E402
from pipeline.feeder import UpdateFeeder  # noqa: E402
from pipeline.stages import ValidationPool  # noqa: E402
from lit_module import GPTTrainingModule  # noqa: E402
from model.flops import training_flops  # noqa: E402
from tools.check import dies_with_parent, process_family  # noqa: E402

LAYOUTS = {
    # Heavy-tailed document lengths with a mean near 1,000 tokens: many documents per row.
    "realistic": ["--mean-tokens", "1000", "--sigma", "1.0"],
    # One document spanning each 4096-token row (4095 tokens + EOS): nanoGPT's benchmark work.
    "one-doc": ["--mean-tokens", "4095", "--sigma", "0"],
}
OBSERVED = ["--observe.profile_update", "15", "--observe.profile_updates", "2", "--observe.memory_update", "18"]


def records_command(layout: str, docs: int) -> list[str]:
    return [sys.executable, str(ROOT / "tools/synthetic_records.py"), "--docs", str(docs), *LAYOUTS[layout]]


# ----------------------------------------------------------------------------- host memory


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, anonymous RSS) in bytes summed over a process and its descendants. PSS shares each
    shared page among the processes mapping it, which is what a memory cgroup charges once; RSS counts
    it in each; anonymous memory (heaps, not mapped files) is what every extra process adds for sure."""
    totals = hostmem.tree_memory(process_family(pid))
    return totals["Rss"], totals["Pss"], totals["Anonymous"]


class MemorySampler(threading.Thread):
    """Peak tree RSS and PSS of a process, sampled every half second until it ends; the timeline too."""

    def __init__(self, process: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.process = process
        self.peak_rss = self.peak_pss = self.peak_anonymous = 0
        self.timeline: list[tuple[float, int, int, int]] = []  # (time, PSS, RSS, processes)

    def run(self) -> None:
        while self.process.poll() is None:
            totals = hostmem.tree_memory(process_family(self.process.pid))
            rss, pss, anonymous = totals["Rss"], totals["Pss"], totals["Anonymous"]
            self.timeline.append((time.time(), pss, rss, totals["processes"]))
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_anonymous = max(self.peak_anonymous, anonymous)
            time.sleep(0.5)


# ----------------------------------------------------------------------------- runs


def run_lightning(layout: str, args, out: Path, name: str = "lightning", extra: tuple[str, ...] = ()) -> dict:
    """`python train.py` with the records on stdin; figures from its run record's summary."""
    output = out / f"{name}-{layout}"
    stages = out / f"{name}-{layout}-stages.jsonl"
    stages.unlink(missing_ok=True)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(output), **{hostmem.STAGE_LOG_ENV: str(stages)})
    if getattr(args, "cold", False):  # RunFab starts with no compile cache: train.py puts one under its output
        for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            env.pop(variable, None)
    overrides = [
        "--microbatch", str(args.microbatch), "--trainer.max_steps", str(args.steps), "--trainer.val_every_steps", "0",
        "--data.val_fraction", "0", "--metrics.interval_seconds", "1", "--optim.warmup_steps", "5",
        "--observe.warmup_updates", str(args.warmup), *as_flags(args.set), *extra,
    ]
    if args.records:  # written beforehand: no generator competing for the 2 cores the job is pinned to
        generator, source = None, args.records.open("rb")
    else:
        generator = subprocess.Popen(records_command(layout, args.docs), stdout=subprocess.PIPE,
                                     preexec_fn=dies_with_parent())
        source = generator.stdout
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *overrides], stdin=source, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=dies_with_parent())
    sampler = MemorySampler(process)
    sampler.start()
    stdout, stderr = process.communicate()
    sampler.join()
    if generator is not None:
        generator.kill()
    source.close()
    if process.returncode:
        raise RuntimeError(f"train.py {' '.join(extra)} failed:\n{stderr[-4000:]}")
    record = json.loads((output / "model/run_record.json").read_text())
    summary = record["summary"]
    (out / f"{name}-{layout}-stderr.log").write_text(stderr)
    write_timeline(out / f"{name}-{layout}-timeline.jsonl", sampler, started)
    return {
        "stages": read_stages(stages, started),
        "peak_pss_at_seconds": peak_time(sampler, started),
        "tokens_per_second": summary["tokens_per_second"],
        "mfu": summary["mfu"],
        "peak_allocated_gib": summary.get("peak_allocated_gib", 0.0),
        "peak_reserved_gib": summary.get("peak_reserved_gib", 0.0),
        "measured_seconds": summary["normal_region"]["seconds"],
        "normal_updates": summary["normal_region"]["updates"],
        "data_wait_seconds": record["input"]["training_wait_seconds"],
        "process_seconds": time.perf_counter() - started,
        "peak_host_rss_gib": sampler.peak_rss / 2**30,
        "peak_host_pss_gib": sampler.peak_pss / 2**30,
        "peak_host_anonymous_gib": sampler.peak_anonymous / 2**30,
        "observations": {f: (output / "run" / f).stat().st_size for f in record["observations"]},
        "metric_lines": len(stdout.splitlines()),
    }


def write_timeline(path: Path, sampler: MemorySampler, started: float) -> None:
    wall = time.time() - (time.perf_counter() - started)
    with path.open("w") as f:
        for t, pss, rss, processes in sampler.timeline:
            f.write(json.dumps({"seconds": round(t - wall, 1), "pss_gib": round(pss / 2**30, 3),
                                "rss_gib": round(rss / 2**30, 3), "processes": processes}) + "\n")


def peak_time(sampler: MemorySampler, started: float) -> float | None:
    """Seconds after the start at which the tree's PSS peaked."""
    if not sampler.timeline:
        return None
    wall = time.time() - (time.perf_counter() - started)
    return round(max(sampler.timeline, key=lambda s: s[1])[0] - wall, 1)


def read_stages(path: Path, started: float) -> list[dict]:
    """hostmem's stage records of every process of a run, in GiB, in time order."""
    if not path.is_file():
        return []
    wall = time.time() - (time.perf_counter() - started)
    rows = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        rows.append({"rank": entry["rank"], "stage": entry["stage"], "run_seconds": round(entry["time"] - wall, 1),
                     **{k.lower(): round(entry.get(k, 0) / 2**30, 3) for k in ("Pss", "Pss_Anon", "Pss_File", "Rss")}})
    return sorted(rows, key=lambda r: r["run_seconds"])


def scaling(args) -> dict:
    """The same microbatch per GPU on 1 GPU (accumulating 2) and on 2 GPUs, one job, cold compile caches
    unless --warm (then the job's one cache: same speed, less time, not RunFab's host memory)."""
    args.cold = not args.warm
    layout = args.layouts[0] if args.layouts else "realistic"
    runs = {}
    for gpus in args.scaling_gpus:
        extra = ("--trainer.devices", str(gpus), *(as_flags(sum(args.compare, [])) if gpus == 2 else ()))
        if gpus == 2 and args.trace:
            extra += ("--observe.profile_update", str(args.warmup + 3), "--observe.profile_updates", "1")
        runs[gpus] = run_lightning(layout, args, args.out, f"gpus{gpus}", extra)
        r = runs[gpus]
        print(f"{gpus} GPU(s): {r['tokens_per_second']:,.0f} tokens/s, host peak PSS {r['peak_host_pss_gib']:.2f} GiB "
              f"(RSS {r['peak_host_rss_gib']:.2f}) at {r['peak_pss_at_seconds']} s, "
              f"process {r['process_seconds']:.0f} s",
              file=sys.stderr, flush=True)
    result = {"layout": layout, "microbatch_per_gpu": args.microbatch, "runs": runs,
              "scaling": runs[2]["tokens_per_second"] / (2 * runs[1]["tokens_per_second"]) if len(runs) == 2 else None}
    return result


def print_stages(stages: list[dict]) -> None:
    for s in stages:
        print(f"  {s['run_seconds']:>6.1f} s rank {s['rank']} {s['stage']:<45} PSS {s['pss']:5.2f} "
              f"(anon {s['pss_anon']:5.2f}, file {s['pss_file']:5.2f}) RSS {s['rss']:5.2f} GiB")


def probe_timing(args) -> dict:
    """RunFab's probe of one candidate, as RunFab runs it: a fresh process, every visible GPU."""
    stages = args.out / f"probe-{args.probe_timing}-stages.jsonl"
    stages.unlink(missing_ok=True)
    env = dict(os.environ, **{hostmem.STAGE_LOG_ENV: str(stages)})
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", f"import train; train.probe_batch({args.probe_timing})"],
                               cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=dies_with_parent())
    sampler = MemorySampler(process)
    sampler.start()
    _, stderr = process.communicate()
    sampler.join()
    seconds = time.perf_counter() - started
    (args.out / f"probe-{args.probe_timing}-stderr.log").write_text(stderr)
    if process.returncode:
        raise RuntimeError(f"probe failed:\n{stderr[-4000:]}")
    result = {"microbatch": args.probe_timing, "seconds": seconds, "peak_host_pss_gib": sampler.peak_pss / 2**30,
              "peak_host_rss_gib": sampler.peak_rss / 2**30, "stages": read_stages(stages, started)}
    print(f"probe {args.probe_timing}: {seconds:.1f} s whole process, host peak PSS {result['peak_host_pss_gib']:.2f} "
          f"GiB (RSS {result['peak_host_rss_gib']:.2f})")
    print_stages(result["stages"])
    return result


def run_plain(layout: str, args) -> dict:
    """The same work in a hand-written loop: no Trainer, no callbacks, nothing between the steps."""
    cfg = load_config(overrides=["data.val_fraction=0", *args.set])
    accumulation = train.EFFECTIVE_BATCH_SIZE // args.microbatch
    encoder = training_run.load_encoder(cfg)
    generator = subprocess.Popen(records_command(layout, args.docs), stdout=subprocess.PIPE,
                                 preexec_fn=dies_with_parent())
    split = BatchSplit(args.microbatch, accumulation, 1, train.EFFECTIVE_BATCH_SIZE)
    settings = training_run.stream_settings(cfg, encoder, split)
    feeder = UpdateFeeder(lambda: (generator.stdout, "generator"), settings, encoder.encode_batch_arrays, ValidationPool(0))
    lit = device_policy.build_module(cfg, torch.device("cuda"))  # model.fp8 converts the blocks, as in training
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
    result = {
        "tokens_per_second": tokens / seconds,
        "mfu": flops / seconds / cfg.metrics.peak_flops,
        **peak_memory(lit.device),
        "measured_seconds": seconds,
    }
    del lit, optimizer
    release_gpu()
    return result


def run_reference(args) -> dict:
    """nanoGPT's recipe on the same GPU, for target 2's ratio in the same job: the 12/768/12 model
    with nanoGPT's padded vocabulary of 50,304, one fixed batch of random tokens (every row one
    4096-token document), the whole forward and a full-vocabulary cross-entropy compiled as one
    function, fused AdamW, bf16 autocast, gradient clipping. Throughput counts every input token,
    as nanoGPT's 305.1 ms per 32 x 4096 step (429,600 tokens/s) does. Its attention is PyTorch's
    fused causal SDPA, as nanoGPT's, whatever model.attention the other runs use."""
    # nanoGPT's attention is F.scaled_dot_product_attention(is_causal=True): PyTorch's kernels, never FA4.
    cfg = load_config(overrides=["model.vocab_size=50304", *args.set, "model.attention=varlen"])
    lit = GPTTrainingModule(cfg.model, cfg.optim).cuda()
    model = lit.model
    optimizer = lit.configure_optimizers()["optimizer"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.microbatch, 4097), device="cuda", generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    @torch.compile
    def loss_of(model, x, y):
        logits = model(x)  # positions None: one document per row, causal SDPA
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    measured = args.steps - args.warmup
    result = {
        "tokens_per_second": measured * inputs.numel() / seconds,
        "mfu": measured * training_flops(cfg.model, inputs.numel(), args.microbatch * 4096 * 4096)
        / seconds / cfg.metrics.peak_flops,
        **peak_memory(lit.device),
        "measured_seconds": seconds,
        "milliseconds_per_step": 1000 * seconds / measured,
    }
    del lit, model, optimizer, loss_of
    release_gpu()
    return result


def host_pipeline(args) -> dict:
    """Target tokens/s of stdin -> tokens -> packed rows -> updates alone (no model), for text
    records (the bundled sample, repeated) and for input_ids records; run it on 2 cores. The tokenizer
    is the config's (GPT-2's for conf/config.yaml); `--set data.tokenizer=conf/tokenizer.json` times the small one."""
    import io

    cfg = load_config(overrides=["data.val_fraction=0.005", *args.set])
    encoder = training_run.load_encoder(cfg)
    split = BatchSplit(args.microbatch, train.EFFECTIVE_BATCH_SIZE // args.microbatch, 1, train.EFFECTIVE_BATCH_SIZE)
    settings = training_run.stream_settings(cfg, encoder, split)
    text = (ROOT / "data/sample.jsonl").read_bytes() * 30
    ids = subprocess.run(records_command("realistic", 8_000), capture_output=True, check=True,
                         preexec_fn=dies_with_parent()).stdout
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
    return figures


def as_flags(assignments: list[str]) -> list[str]:
    """["model.x=1"] -> ["--model.x", "1"]: train.py's command-line form of config overrides."""
    return [part for item in assignments for part in ("--" + item.split("=", 1)[0], item.split("=", 1)[1])]


def release_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


def memory_sweep(args) -> list[dict]:
    """The probe at each candidate microbatch, eager (what RunFab runs) and compiled (what training runs)."""
    cfg = load_config(overrides=args.set)
    rows = []
    for microbatch in (1, 2, 4, 8, 16, 32):
        row = {"microbatch": microbatch}
        for compiled in (False, True):
            started = time.perf_counter()
            result = probe.run_probe_local(cfg, microbatch, 1, train.EFFECTIVE_BATCH_SIZE, compiled=compiled)
            name = "compiled" if compiled else "eager"
            row[f"{name}_peak_allocated_gib"] = result["peak_allocated_gib"]
            row[f"{name}_seconds"] = time.perf_counter() - started
            release_gpu()
        row["compiled_over_eager"] = row["compiled_peak_allocated_gib"] / row["eager_peak_allocated_gib"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- main


def print_table(results: dict, args) -> None:
    tokens_per_microbatch = 4096 * args.microbatch
    print(f"\n{torch.cuda.get_device_name()}  microbatch {args.microbatch}  steps {args.steps} (warmup {args.warmup})")
    print(f"{'layout':<10} {'run':<36} {'tokens/s':>10} {'MFU':>7} {'peak alloc GiB':>15} {'MiB/token':>10} "
          f"{'/plain':>7} {'data wait':>10} {'host RSS/PSS/anon GiB':>22}")
    for layout, runs in results.items():
        for name, r in runs.items():
            ratio = r["tokens_per_second"] / runs["plain"]["tokens_per_second"]
            per_token = r["peak_allocated_gib"] * 1024 / tokens_per_microbatch
            wait = f"{r['data_wait_seconds']:.2f} s" if "data_wait_seconds" in r else "-"
            host = (f"{r['peak_host_rss_gib']:.2f}/{r['peak_host_pss_gib']:.2f}/{r['peak_host_anonymous_gib']:.2f}"
                    if "peak_host_rss_gib" in r else "-")
            print(f"{layout:<10} {name:<36} {r['tokens_per_second']:>10,.0f} {r['mfu']:>7.1%} "
                  f"{r['peak_allocated_gib']:>15.2f} {per_token:>10.3f} {ratio:>7.3f} {wait:>10} {host:>22}")
        if "nanoGPT recipe" in runs:
            ratio = runs["lightning"]["tokens_per_second"] / runs["nanoGPT recipe"]["tokens_per_second"]
            print(f"{layout:<10} Lightning / nanoGPT recipe, same job: {ratio:.3f} (target 2: 1.15)")


def gpu_run(args) -> str | None:
    """What main would run that needs a CUDA GPU, in main's order; None for --host-pipeline alone, the CPU mode."""
    if args.probe_timing:
        return "--probe-timing"
    if args.scaling:
        return "--scaling"
    if args.host_pipeline:
        return None
    return "the Lightning and plain-loop runs (--layouts, --observe, --workers, --reference, --memory-sweep)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--microbatch", type=int, default=32, help="32 x 1 is what RunFab picks on an H200")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--docs", type=int, default=60_000)
    parser.add_argument("--observe", action="store_true", help="add a run with a profiler window and a memory snapshot")
    parser.add_argument("--reference", action="store_true",
                        help="with the one-doc layout: add nanoGPT's recipe (whole model compiled, full logits) on the same GPU")
    parser.add_argument("--workers", action="store_true", help="add a run through the data-parallel worker path")
    parser.add_argument("--memory-sweep", action="store_true", help="compiled against eager probe peaks")
    parser.add_argument("--host-pipeline", action="store_true", help="the data pipeline alone, no GPU (use 2 cores)")
    parser.add_argument("--scaling", action="store_true", help="1 GPU against 2 GPUs, same microbatch per GPU")
    parser.add_argument("--warm", action="store_true", help="with --scaling: share one compile cache (throughput only)")
    parser.add_argument("--scaling-gpus", type=int, nargs="+", default=[1, 2], help="with --scaling: GPU counts to run")
    parser.add_argument("--records", type=Path,
                        help="NDJSON records to feed instead of a generator running beside the job")
    parser.add_argument("--trace", action="store_true", help="with --scaling: a profiler trace of one update per rank")
    parser.add_argument("--probe-timing", type=int, metavar="K", help="time RunFab's probe of microbatch K")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--compare", nargs="*", action="append", default=[], metavar="KEY=VALUE",
                        help="add a Lightning run with these overrides on top of --set; repeat for more runs")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    args = parser.parse_args()
    needs_gpu = gpu_run(args)
    if needs_gpu and not device_policy.cuda_present():  # on a CPU they would run for hours and take all the RAM
        print(f"benchmark: {needs_gpu} cannot run without a CUDA GPU, and none is visible; on a CPU only "
              "--host-pipeline runs", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("BENCH_COMPILE_CACHE", args.out / "compile-cache"))
    device_policy.prepare_compile(cache, 1)  # shared by every run of the job: train.py keeps a folder the environment names
    results: dict = {}
    if args.probe_timing:
        (args.out / f"probe-{args.probe_timing}.json").write_text(json.dumps(probe_timing(args), indent=2))
        return 0
    if args.scaling:
        result = scaling(args)
        (args.out / "scaling.json").write_text(json.dumps(result, indent=2))
        for gpus, r in result["runs"].items():
            print(f"{gpus} GPU(s), microbatch {args.microbatch} per GPU: {r['tokens_per_second']:,.0f} tokens/s, "
                  f"MFU {(r['mfu'] or 0):.1%}, data wait {r['data_wait_seconds']:.2f} s, host peak PSS "
                  f"{r['peak_host_pss_gib']:.2f} GiB (RSS {r['peak_host_rss_gib']:.2f}) "
                  f"at {r['peak_pss_at_seconds']} s "
                  f"of {r['process_seconds']:.0f} s")
            print_stages(r["stages"])
        print(f"scaling: 2 GPUs = {result['scaling'] or 0:.1%} of twice 1 GPU (target 95 %); overrides "
              f"{' '.join(args.set) or 'none'}; 2 GPUs also {' '.join(sum(args.compare, [])) or 'nothing'}")
        return 0
    if args.host_pipeline:
        results["host_pipeline"] = host_pipeline(args)
        (args.out / "host_pipeline.json").write_text(json.dumps(results["host_pipeline"], indent=2))
        return 0
    for layout in args.layouts:
        runs = results[layout] = {"lightning": run_lightning(layout, args, args.out), "plain": run_plain(layout, args)}
        if args.observe:
            runs["lightning+observe"] = run_lightning(layout, args, args.out, "observe", tuple(OBSERVED))
        for number, overrides in enumerate(args.compare):
            runs["lightning " + " ".join(overrides)] = run_lightning(layout, args, args.out, f"compare{number}",
                                                                     tuple(as_flags(overrides)))
        if args.reference and layout == "one-doc":
            runs["nanoGPT recipe"] = run_reference(args)
        if args.workers:
            runs["lightning workers"] = run_lightning(layout, args, args.out, "workers", ("--trainer.worker_processes", "true"))
        print(json.dumps({layout: runs}), file=sys.stderr, flush=True)
    if args.memory_sweep:
        results["memory_sweep"] = memory_sweep(args)
    (args.out / "benchmark.json").write_text(json.dumps(results, indent=2))
    print_table({k: v for k, v in results.items() if k in LAYOUTS}, args)
    print(f"overrides: {' '.join(args.set) or 'none'}")
    for row in results.get("memory_sweep", []):
        print(f"probe microbatch {row['microbatch']:>2}: eager {row['eager_peak_allocated_gib']:6.2f} GiB "
              f"({row['eager_seconds']:.0f} s), compiled {row['compiled_peak_allocated_gib']:6.2f} GiB "
              f"({row['compiled_seconds']:.0f} s), ratio {row['compiled_over_eager']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
