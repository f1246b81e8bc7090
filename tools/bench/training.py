"""The trainer's experiments, one function each (``python -m tools bench NAME``); each needs a CUDA GPU.

    trainer       train.py against the same work in a plain PyTorch loop, per document layout;
                  --variant adds train.py runs with other settings, --against runs of another
                  checkout's train.py (another revision) on the same records
    observe       a run with a profiler window and a memory snapshot against one without: its normal
                  region leaves the observed updates out, so both must show one pace
    reference     train.py against nanoGPT's recipe on one-document rows, on the same GPU
    workers       train.py through the data-parallel worker path against one process: speed and the
                  peak host memory of each process tree
    scaling       train.py on 1 GPU against 2 GPUs, the same microbatch per GPU, each with a cold
                  compile cache as on RunFab: tokens/s, scaling, host memory, each process's stages
    probe-timing  RunFab's probe of one microbatch (a fresh process on every visible GPU): seconds
                  and peak host memory
    memory-sweep  the probe's peak GPU memory at each microbatch, eager (as RunFab probes) against
                  compiled (as training runs): compiled must not exceed eager

Results go to ``--out`` as JSON, with each run's stderr, memory timeline and stages beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

import train
from runfab import process_memory
from config import CONFIG_ENV, as_dict
from runfab import created_files
from runtime import probe
from tools import processes
from tools.bench import runs

OBSERVED = ("--observe.profile_update", "15", "--observe.profile_updates", "2", "--observe.memory_update", "18")
WORKERS = ("--trainer.worker_processes", "true")


def trainer(argv: list[str]) -> int:
    parser = runs.parser("trainer", "train.py against the same work in a plain PyTorch loop.")
    parser.add_argument("--variant", action="append", default=[], metavar='"--section.key VALUE ..."',
                        help="add a train.py run with these settings, train.py's options quoted as one argument "
                             '(e.g. --variant "--compute.loss_chunk_tokens 32768 --compute.mlp torch", or '
                             "--variant=--section.key=VALUE for one key); repeat for more runs")
    parser.add_argument("--against", type=Path, action="append", default=[], metavar="CHECKOUT",
                        help="add a run of the train.py in CHECKOUT, another revision of this project (for example "
                             "`git worktree add ../before REV`), on the same records in the same job; repeatable")
    args = runs.parse(parser, argv)
    for checkout in args.against:
        if not (checkout / "train.py").is_file():
            parser.error(f"--against {checkout}: no train.py there (a checkout of this project is expected)")
    try:
        variants = {text: runs.variant_flags(args, text) for text in args.variant}
    except runs.VariantError as error:
        parser.error(str(error))
    if not runs.require_gpu("trainer"):
        return 2
    runs.prepare(args)
    results = {}
    for layout in args.layouts:
        found = results[layout] = {"lightning": runs.run_lightning(layout, args), "plain": runs.run_plain(layout, args)}
        for number, (text, flags) in enumerate(variants.items()):
            found[f"lightning {text}"] = runs.run_lightning(layout, args, f"variant{number}", flags)
        for number, checkout in enumerate(args.against):
            found[f"lightning at {checkout}"] = runs.run_lightning(layout, args, f"against{number}",
                                                                   tree=checkout.resolve())
        print(json.dumps({layout: found}), file=sys.stderr, flush=True)
    runs.save(args, "trainer", results)
    runs.print_table(results, args, baseline="plain")
    return 0


def observe(argv: list[str]) -> int:
    return against_lightning(argv, "observe", "A run with a profiler window and a memory snapshot against one "
                             "without: both must show one pace.", "lightning+observe", OBSERVED)


def reference(argv: list[str]) -> int:
    args = runs.parse(runs.parser("reference", "train.py against nanoGPT's recipe on one-document rows, on the "
                                               "same GPU.", layouts=False), argv)
    if not runs.require_gpu("reference"):
        return 2
    runs.prepare(args)
    results = {"one-doc": {"lightning": runs.run_lightning("one-doc", args), "nanoGPT recipe": runs.run_reference(args)}}
    runs.save(args, "reference", results)
    runs.print_table(results, args, baseline="nanoGPT recipe")
    return 0


def workers(argv: list[str]) -> int:
    return against_lightning(argv, "workers", "train.py through the data-parallel worker path against one "
                             "process: speed and peak host memory.", "lightning workers", WORKERS)


def against_lightning(argv: list[str], name: str, description: str, label: str, flags: tuple[str, ...]) -> int:
    """train.py as configured against train.py with ``flags``, in each layout, in one job."""
    args = runs.parse(runs.parser(name, description), argv)
    if not runs.require_gpu(name):
        return 2
    runs.prepare(args)
    results = {layout: {"lightning": runs.run_lightning(layout, args),
                        label: runs.run_lightning(layout, args, name, flags)}
               for layout in args.layouts}
    runs.save(args, name, results)
    runs.print_table(results, args, baseline="lightning")
    return 0


def scaling(argv: list[str]) -> int:
    parser = runs.parser("scaling", "train.py on 1 GPU against 2 GPUs, the same microbatch per GPU, in one job.",
                         layouts=False)
    parser.add_argument("--layout", choices=list(runs.LAYOUTS), default="realistic",
                        help="document layout of the synthetic records (default: realistic)")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts to run (default: 1 2)")
    parser.add_argument("--warm", action="store_true",
                        help="share one compile cache: the same speed in less time, but not RunFab's host memory")
    parser.add_argument("--trace", action="store_true", help="a profiler trace of one update per rank, largest count")
    args = runs.parse(parser, argv)
    if not runs.require_gpu("scaling"):
        return 2
    runs.prepare(args)
    found = {}
    for gpus in args.gpus:
        extra = ("--trainer.devices", str(gpus))
        if args.trace and gpus == max(args.gpus):
            extra += ("--observe.profile_update", str(args.warmup + 3), "--observe.profile_updates", "1")
        found[gpus] = runs.run_lightning(args.layout, args, f"gpus{gpus}", extra, cold=not args.warm)
    fewest = min(found)
    result = {"layout": args.layout, "microbatch_per_gpu": args.microbatch, "runs": found,
              "scaling": {gpus: r["tokens_per_second"] / (gpus / fewest * found[fewest]["tokens_per_second"])
                          for gpus, r in found.items() if gpus != fewest}}
    runs.save(args, "scaling", result)
    for gpus, r in found.items():
        print(f"{gpus} GPU(s), microbatch {args.microbatch} per GPU: {r['tokens_per_second']:,.0f} tokens/s, "
              f"MFU {(r['mfu'] or 0):.1%}, data wait {r['data_wait_seconds']:.2f} s, host peak PSS "
              f"{r['peak_host_pss_gib']:.2f} GiB (RSS {r['peak_host_rss_gib']:.2f}) at {r['peak_pss_at_seconds']} s "
              f"of {r['process_seconds']:.0f} s")
        runs.print_stages(r["stages"])
    for gpus, ratio in result["scaling"].items():
        print(f"scaling on {gpus} GPUs against {fewest}: {ratio:.1%} of linear; "
              f"overrides: {' '.join(args.train_flags) or 'none'}")
    return 0


def probe_timing(argv: list[str]) -> int:
    parser = runs.parser("probe-timing", "RunFab's probe of one microbatch: a fresh process on every visible GPU.",
                         runs=False, layouts=False)
    parser.add_argument("--microbatch", type=int, default=32, help="the microbatch probed (default: 32)")
    args = runs.parse(parser, argv)
    if not runs.require_gpu("probe-timing"):
        return 2
    runs.prepare(args)
    name = f"probe-{args.microbatch}"
    stages = args.out / f"{name}-stages.jsonl"
    stages.unlink(missing_ok=True)
    env = dict(os.environ, **{process_memory.STAGE_LOG_ENV: str(stages)})
    if args.train_flags:  # the hooks read their configuration from the file RUNFAB_CONFIG names
        merged = args.out / f"{name}-config.yaml"
        created_files.write_text(merged, yaml.safe_dump(as_dict(runs.config(args)), sort_keys=False))
        env[CONFIG_ENV] = str(merged.resolve())
    started = time.perf_counter()
    process = processes.start([sys.executable, "-c", f"import train; train.probe_batch({args.microbatch})"],
                              cwd=runs.ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = processes.MemorySampler(process)
    sampler.start()
    _, stderr = process.communicate()
    sampler.join()
    seconds = time.perf_counter() - started
    created_files.write_text(args.out / f"{name}-stderr.log", stderr)
    if process.returncode:
        raise RuntimeError(f"probe failed:\n{stderr[-4000:]}")
    result = {"microbatch": args.microbatch, "seconds": seconds, "peak_host_pss_gib": sampler.peak_pss / runs.GIB,
              "peak_host_rss_gib": sampler.peak_rss / runs.GIB, "stages": runs.read_stages(stages, started)}
    runs.save(args, name, result)
    print(f"probe {args.microbatch}: {seconds:.1f} s whole process, host peak PSS {result['peak_host_pss_gib']:.2f} "
          f"GiB (RSS {result['peak_host_rss_gib']:.2f})")
    runs.print_stages(result["stages"])
    return 0


def memory_sweep(argv: list[str]) -> int:
    parser = runs.parser("memory-sweep", "The probe's peak GPU memory at each microbatch, eager against compiled.",
                         runs=False, layouts=False)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="the microbatches probed (default: 1 2 4 8 16 32)")
    args = runs.parse(parser, argv)
    if not runs.require_gpu("memory-sweep"):
        return 2
    runs.prepare(args)
    cfg = runs.config(args)
    rows = []
    for microbatch in args.microbatches:
        row = {"microbatch": microbatch}
        for compiled in (False, True):
            started = time.perf_counter()
            result = probe.run_probe_local(cfg, microbatch, 1, train.EFFECTIVE_BATCH_SIZE, compiled=compiled)
            name = "compiled" if compiled else "eager"
            row[f"{name}_peak_allocated_gib"] = result["peak_allocated_gib"]
            row[f"{name}_seconds"] = time.perf_counter() - started
            runs.release_gpu()
        row["compiled_over_eager"] = row["compiled_peak_allocated_gib"] / row["eager_peak_allocated_gib"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    runs.save(args, "memory-sweep", rows)
    for row in rows:
        print(f"probe microbatch {row['microbatch']:>2}: eager {row['eager_peak_allocated_gib']:6.2f} GiB "
              f"({row['eager_seconds']:.0f} s), compiled {row['compiled_peak_allocated_gib']:6.2f} GiB "
              f"({row['compiled_seconds']:.0f} s), ratio {row['compiled_over_eager']:.3f}")
    return 0
