"""What the trainer experiments share: their command line, the runs they compare, and their output.

A Lightning run is ``train.py`` itself, fed on stdin as RunFab feeds it, with its figures from the
run record's summary; the plain run is the same work in a hand-written loop; the reference run is
nanoGPT's recipe. Throughput is target tokens over wall seconds of the normal region (after the
warmup updates), GPU synchronized.

Every experiment takes the configuration as train.py does: ``--config FILE`` and any
``--section.key VALUE``, checked by train.py's own parser and applied to every run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import cli
import train
from runfab import process_memory
from callbacks.runfab_metrics import peak_memory
from config import ConfigError, RunConfig, load_config
from model.flops import training_flops
from pipeline.feeder import UpdateFeeder
from pipeline.validation_split import ValidationPool
from runfab import created_files
from runfab.limits import GIB
from runtime import device_policy, training_run
from runtime.batch_split import BatchSplit
from tools import processes
from tools.bench.gpu_clocks import GpuClocks

ROOT = Path(__file__).resolve().parents[2]
MEAN_TOKENS = {
    "realistic": 1000,  # heavy-tailed document lengths (lognormal, sigma 1): many documents per row
    "one-doc": 4095,  # every document 4095 tokens, + EOS: one document a 4096-token row, nanoGPT's benchmark work
}
LAYOUTS = {
    "realistic": ["--mean-tokens", str(MEAN_TOKENS["realistic"]), "--sigma", "1.0"],
    "one-doc": ["--mean-tokens", str(MEAN_TOKENS["one-doc"]), "--sigma", "0"],
}


# ----------------------------------------------------------------------------- command line


def parser(name: str, description: str, runs: bool = True, layouts: bool = True) -> argparse.ArgumentParser:
    """The options the trainer experiments share: ``runs`` adds those of train.py runs on synthetic
    records, ``layouts`` the choice of their document layouts; the experiment adds its own."""
    parser = argparse.ArgumentParser(
        prog=f"python -m tools bench {name}", description=description, allow_abbrev=False,
        epilog="--config FILE and any --section.key VALUE (as train.py takes them) configure every run.")
    if runs:
        parser.add_argument("--microbatch", type=int, default=32, help="rows per microbatch (default: 32)")
        parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default: 40)")
        parser.add_argument("--warmup", type=int, default=10, help="updates left out of the figures (default: 10)")
        parser.add_argument("--docs", type=int,
                            help="synthetic documents to write for each layout (default: enough for --steps updates, "
                                 "with half again to spare)")
        parser.add_argument("--records", type=Path,
                            help="NDJSON records to feed every run instead of synthetic ones")
    if layouts:
        parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                            help="document layouts of the synthetic records (default: all)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the results (default: bench-out)")
    parser.add_argument("--compile-cache", type=Path, metavar="DIR",
                        help="compile cache shared by the runs (default: OUT/compile-cache)")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The experiment's options; what is left must be train.py's configuration options, which become
    ``args.config``, ``args.overrides`` (typed values by dotted key) and ``args.train_flags`` (as typed)."""
    args, rest = parser.parse_known_args(argv)
    for index, token in enumerate(rest):
        name = token.split("=", 1)[0]
        if token.startswith("-") and not is_number(token):
            if name != "--config" and not (name.startswith("--") and "." in name):
                parser.error(f"unrecognized option {token}; configuration keys are given as --section.key VALUE")
        elif index == 0 or not rest[index - 1].startswith("--") or "=" in rest[index - 1]:
            parser.error(f"unexpected {token!r}; configuration keys are given as --section.key VALUE")
    try:
        command = cli.parse(rest)
        load_config(command.config_path, command.overrides)  # refused now rather than after the first run
    except (cli.CommandLineError, ConfigError) as error:
        parser.error(one_line(error))
    args.config, args.overrides, args.train_flags = command.config_path, command.overrides, rest
    return args


def one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def config(args, *overrides: str, forced: tuple[str, ...] = ()) -> RunConfig:
    """The experiment's configuration: its ``overrides`` (``key=value`` text), then the user's, then
    what the experiment cannot do without (``forced``)."""
    return load_config(args.config, [*overrides, *args.overrides, *forced])


def require_gpu(name: str) -> bool:
    """Whether a CUDA GPU is visible; if not, says so in one line: on a CPU these runs would take hours
    and all the host memory."""
    if device_policy.cuda_present():
        return True
    print(f"python -m tools bench {name}: needs a CUDA GPU and none is visible; on a CPU, host-pipeline, "
          "rank-balance, synthetic-records and trace-summary run", file=sys.stderr)
    return False


def prepare(args) -> None:
    """The output folder, and one compile cache for every run of the job (train.py keeps a cache folder
    the environment names)."""
    args.out.mkdir(parents=True, exist_ok=True)
    device_policy.prepare_compile(args.compile_cache or args.out / "compile-cache", 1)


class VariantError(ValueError):
    """A --variant that train.py would refuse; the message names the variant and what is wrong."""


def variant_flags(args, text: str, option: str = "--variant", own_file: bool = False) -> tuple[str, ...]:
    """A --variant's train.py options, as typed (``"--compute.x 0 --data.y false"``), refused now if
    train.py would refuse them after the job's own configuration, rather than after the first run.
    ``own_file``: the options may name a --config file of their own, which replaces the job's."""
    flags = tuple(shlex.split(text))
    if not flags or not flags[0].startswith("--"):
        raise VariantError(f"{option} {text!r}: give train.py's options, --section.key VALUE ...")
    try:
        command = cli.parse(list(flags))
        if command.name != cli.DEFAULT_SUBCOMMAND or (command.config_path is not None and not own_file):
            raise VariantError(f"{option} {text}: a variant changes single keys (--section.key VALUE); the "
                               "configuration file and subcommand are the job's")
        load_config(command.config_path or args.config, [*args.overrides, *command.overrides])
    except (cli.CommandLineError, ConfigError) as error:
        raise VariantError(f"{option} {text}: {one_line(error)}") from None
    return flags


# ----------------------------------------------------------------------------- runs


def records_command(layout: str, docs: int, vocab: int) -> list[str]:
    """synthetic-records writing ``docs`` records of ids below ``vocab`` (model.vocab_size) in ``layout``."""
    return [sys.executable, "-m", "tools", "bench", "synthetic-records", "--docs", str(docs), "--vocab", str(vocab),
            *LAYOUTS[layout]]


def records_for(layout: str, args) -> Path:
    """The records that every run of ``layout`` in this job reads: ``--records`` if given, else synthetic records
    written into OUT before the first run. Written beforehand rather than generated beside each run, so that the
    runs compared read the same bytes and no generator shares the host with the run it feeds."""
    if args.records:
        return args.records
    written = vars(args).setdefault("records_written", {})
    if layout not in written:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"records-{layout}.jsonl"
        model = config(args).model
        docs = args.docs or documents_needed(layout, args.steps, model.max_seq_len)
        with created_files.open_created(path, "wb") as f:
            subprocess.run(records_command(layout, docs, model.vocab_size), cwd=ROOT, stdout=f, check=True)
        written[layout] = path
    return written[layout]


def documents_needed(layout: str, steps: int, seq_len: int) -> int:
    """Documents enough for ``steps`` updates of train.EFFECTIVE_BATCH_SIZE rows of ``seq_len`` tokens, with half
    again to spare: the feeder reads an update or two ahead, and lognormal lengths stray from their mean."""
    tokens = (steps + 2) * train.EFFECTIVE_BATCH_SIZE * seq_len
    return math.ceil(1.5 * tokens / (MEAN_TOKENS[layout] + 1))  # + 1: the EOS that ends each document


def run_lightning(layout: str, args, name: str = "lightning", extra: tuple[str, ...] = (), cold: bool = False,
                  tree: Path = ROOT) -> dict:
    """`python train.py` with the records on stdin; figures from its run record's summary. ``cold``: no
    compile cache, as on RunFab (train.py then keeps one under its output). ``tree``: the checkout
    whose train.py runs (another revision, for a comparison in one job); the records stay this one's."""
    out = args.out
    output = out / f"{name}-{layout}"
    stages = out / f"{name}-{layout}-stages.jsonl"
    stages.unlink(missing_ok=True)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(output), **{process_memory.STAGE_LOG_ENV: str(stages)})
    if cold:
        for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            env.pop(variable, None)
    options = [
        "--microbatch", str(args.microbatch), "--trainer.max_steps", str(args.steps), "--trainer.val_every_steps", "0",
        "--data.val_fraction", "0", "--metrics.interval_seconds", "1", "--optim.warmup_steps", "5",
        "--observe.warmup_updates", str(args.warmup), *args.train_flags, *extra,
    ]
    source = records_for(layout, args).open("rb")
    started = time.perf_counter()
    process = processes.start([sys.executable, str(tree / "train.py"), *options], stdin=source, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = processes.MemorySampler(process)
    sampler.start()
    with GpuClocks() as clocks:
        stdout, stderr = process.communicate()
    sampler.join()
    source.close()
    if process.returncode:
        raise RuntimeError(f"train.py {' '.join(extra)} failed:\n{stderr[-4000:]}")
    record = json.loads((output / "model/run_record.json").read_text())
    summary = record["summary"]
    created_files.write_text(out / f"{name}-{layout}-stderr.log", stderr)
    write_timeline(out / f"{name}-{layout}-timeline.jsonl", sampler, started)
    return {
        "stages": read_stages(stages, started),
        "peak_pss_at_seconds": peak_time(sampler, started),
        "tokens_per_second": summary["tokens_per_second"],  # the normal region's wall clock, input waits included
        "tokens_per_compute_second": summary.get("tokens_per_compute_second"),
        "mfu": summary["mfu"],
        "peak_allocated_gib": summary.get("peak_allocated_gib", 0.0),
        "peak_reserved_gib": summary.get("peak_reserved_gib", 0.0),
        "measured_seconds": summary["normal_region"]["seconds"],
        "normal_updates": summary["normal_region"]["updates"],
        "data_wait_seconds": record["input"]["training_wait_seconds"],
        "process_seconds": time.perf_counter() - started,
        "peak_host_rss_gib": sampler.peak_rss / GIB,
        "peak_host_pss_gib": sampler.peak_pss / GIB,
        "peak_host_anonymous_gib": sampler.peak_anonymous / GIB,
        "observations": {f: (output / "run" / f).stat().st_size for f in record["observations"]},
        "metric_lines": len(stdout.splitlines()),
        **clocks.summary(),
    }


def plain_steps(batches, lit, optimizer, cfg, args, accumulation: int) -> tuple[float, float, float]:
    """``args.steps`` updates of ``accumulation`` microbatches each, by hand; the target tokens, the
    FLOPs and the seconds of the updates after ``args.warmup``."""
    step = microbatches = 0
    tokens = flops = 0.0
    start = None
    for batch in batches:
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
        torch.nn.utils.clip_grad_norm_(lit.parameters(), cfg.trainer.gradient_clip_val, foreach=True)
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
    return tokens, flops, seconds


def run_plain(layout: str, args) -> dict:
    """The same work in a hand-written loop: no Trainer, no callbacks, nothing between the steps."""
    cfg = config(args, "data.val_fraction=0")
    accumulation = train.EFFECTIVE_BATCH_SIZE // args.microbatch
    encoder = training_run.load_encoder(cfg)
    records = records_for(layout, args).open("rb")
    split = BatchSplit(args.microbatch, accumulation, 1, train.EFFECTIVE_BATCH_SIZE)
    settings = training_run.stream_settings(cfg, encoder, split)
    feeder = UpdateFeeder(lambda: (records, records.name), settings, encoder.encode_batch_arrays, ValidationPool(0))
    lit = device_policy.build_module(cfg, torch.device("cuda"), compiled=True)  # as training builds it
    optimizer = lit.configure_optimizers()["optimizer"]
    torch.cuda.reset_peak_memory_stats()
    try:  # the feeder's reader thread and nvidia-smi end however the loop does
        with GpuClocks() as clocks:
            tokens, flops, seconds = plain_steps(feeder.iterate(), lit, optimizer, cfg, args, accumulation)
    finally:
        feeder.stop()
        records.close()
    result = {
        "tokens_per_second": tokens / seconds,
        "mfu": flops / seconds / cfg.metrics.peak_flops,
        **peak_memory(lit.device),
        "measured_seconds": seconds,
        **clocks.summary(),
    }
    del lit, optimizer
    release_gpu()
    return result


def run_reference(args) -> dict:
    """nanoGPT's recipe on the same GPU: the configured model with nanoGPT's padded vocabulary of
    50,304, one fixed batch of random tokens (every row one 4096-token document), the whole forward
    and a full-vocabulary cross-entropy compiled as one function, fused AdamW, bf16 autocast,
    gradient clipping. Throughput counts every input token, as nanoGPT's does. Its attention is
    PyTorch's fused causal SDPA, as nanoGPT's, whatever compute.attention the other runs use."""
    cfg = config(args, "model.vocab_size=50304", forced=("compute.attention=varlen",))  # causal SDPA, one document a row
    lit = device_policy.build_module(cfg, torch.device("cuda"))  # eager kernels: the whole step is compiled below
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
    with GpuClocks() as clocks:
        for step in range(args.steps):
            if step == args.warmup:
                torch.cuda.synchronize()
                start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(model, inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val, foreach=True)
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
        **clocks.summary(),
    }
    del lit, model, optimizer, loss_of
    release_gpu()
    return result


def release_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- what a run leaves


def write_timeline(path: Path, sampler: processes.MemorySampler, started: float) -> None:
    wall = time.time() - (time.perf_counter() - started)
    with created_files.open_created(path) as f:
        for t, pss, rss, count in sampler.timeline:
            f.write(json.dumps({"seconds": round(t - wall, 1), "pss_gib": round(pss / GIB, 3),
                                "rss_gib": round(rss / GIB, 3), "processes": count}) + "\n")


def peak_time(sampler: processes.MemorySampler, started: float) -> float | None:
    """Seconds after the start at which the tree's PSS peaked."""
    if not sampler.timeline:
        return None
    wall = time.time() - (time.perf_counter() - started)
    return round(max(sampler.timeline, key=lambda s: s[1])[0] - wall, 1)


def read_stages(path: Path, started: float) -> list[dict]:
    """runfab.process_memory's stage records of every process of a run, in GiB, in time order."""
    if not path.is_file():
        return []
    wall = time.time() - (time.perf_counter() - started)
    rows = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        rows.append({"rank": entry["rank"], "stage": entry["stage"], "run_seconds": round(entry["time"] - wall, 1),
                     **{k.lower(): round(entry.get(k, 0) / GIB, 3) for k in ("Pss", "Pss_Anon", "Pss_File", "Rss")}})
    return sorted(rows, key=lambda r: r["run_seconds"])


def print_stages(stages: list[dict]) -> None:
    for s in stages:
        print(f"  {s['run_seconds']:>6.1f} s rank {s['rank']} {s['stage']:<45} PSS {s['pss']:5.2f} "
              f"(anon {s['pss_anon']:5.2f}, file {s['pss_file']:5.2f}) RSS {s['rss']:5.2f} GiB")


def print_table(results: dict, args, baseline: str) -> None:
    """One row per run and layout; ``/base`` is the run's throughput over ``baseline``'s."""
    tokens_per_microbatch = 4096 * args.microbatch
    print(f"\n{torch.cuda.get_device_name()}  microbatch {args.microbatch}  steps {args.steps} (warmup {args.warmup})"
          f"  overrides: {' '.join(args.train_flags) or 'none'}")
    print(f"{'layout':<10} {'run':<36} {'tokens/s':>10} {'MFU':>7} {'peak alloc GiB':>15} {'MiB/token':>10} "
          f"{'/base':>7} {'data wait':>10} {'host RSS/PSS/anon GiB':>22} {'SM MHz/W':>11}")
    for layout, runs in results.items():
        for name, r in runs.items():
            ratio = r["tokens_per_second"] / runs[baseline]["tokens_per_second"]
            per_token = r["peak_allocated_gib"] * 1024 / tokens_per_microbatch
            wait = f"{r['data_wait_seconds']:.2f} s" if "data_wait_seconds" in r else "-"
            host = (f"{r['peak_host_rss_gib']:.2f}/{r['peak_host_pss_gib']:.2f}/{r['peak_host_anonymous_gib']:.2f}"
                    if "peak_host_rss_gib" in r else "-")
            clock = f"{r['sm_clock_mhz']:.0f}/{r['power_watts']:.0f}" if "sm_clock_mhz" in r else "-"
            print(f"{layout:<10} {name:<36} {r['tokens_per_second']:>10,.0f} {r['mfu']:>7.1%} "
                  f"{r['peak_allocated_gib']:>15.2f} {per_token:>10.3f} {ratio:>7.3f} {wait:>10} {host:>22} {clock:>11}")


def save(args, name: str, result) -> None:
    path = args.out / f"{name}.json"
    created_files.write_text(path, json.dumps(result, indent=2))
    print(f"bench: results in {path}", file=sys.stderr)
