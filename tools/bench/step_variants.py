"""The compiled training step under each LM-head/loss kernel and inductor setting, in one process.

The trunk compiles once and every loss kernel runs on the same rows from the same initial weights:
no process start, import or recompilation separates them, so their ratios are tight. Then:
  - each loss kernel alone (forward and backward of 32 x 4096 tokens), with its difference from
    the chunked loss; the chunk's softmax and gradient alone (16,384 x 50,304 bf16 logits), the
    Triton kernel at several block sizes against the compiled PyTorch function; quack's linear cross-entropy beside it at a vocabulary padded to 50,304, where
    it runs (timing only: it has no way to mask padding columns, so the model cannot use it);
  - with --compare (or --mlp K, short for --compare model.mlp_kernel=K), the step with those model
    settings (the loss as configured);
  - the same rows of real text (data/sample.jsonl, GPT-2 tokens) trained with each kernel and twice
    with the chunked loss (the run-to-run noise), and with each compared setting: per-update losses
    and a held-out loss;
  - inductor settings that need a recompilation (max-autotune GEMMs, whose Triton templates can take
    GELU into the fc product's epilogue; activation_memory_budget X), each with its first update's
    seconds (the compilation) beside its throughput.
Loss variants: chunked (Triton softmax, the default), chunked-compiled (inductor's softmax), liger, cce.
Writes step_variants.json under --out and prints a table last. Needs a CUDA GPU.

Usage: python -m tools bench step-variants [--kernels chunked chunked-compiled liger cce] [--mlp quack torch]
[--compare model.KEY=VALUE ...] [--compare ...]
[--inductor budget-1 budget-0.9 max-autotune max-autotune-triton]
[--config FILE] [--section.key VALUE ...]
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from config import ConfigError
from model import fused_mlp
from model import loss as loss_module
from model.flops import training_flops
from model.gpt import GPTConfig
from pipeline.feeder import UpdateFeeder
from pipeline.stages import ValidationPool
from runtime import created_files, device_policy, training_run
from runtime.batch_split import BatchSplit
from tools import processes
from tools.bench import runs as bench

ROOT = Path(__file__).resolve().parents[2]

STARTED = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - STARTED


def collect_batches(cfg, microbatch: int, count: int, records: bytes | None) -> list[dict]:
    """``count`` microbatches from the real pipeline, on the GPU: synthetic realistic records from
    tools/synthetic_records.py, or ``records`` (NDJSON bytes)."""
    encoder = training_run.load_encoder(cfg)
    split = BatchSplit(microbatch, 1, 1, microbatch)
    settings = training_run.stream_settings(cfg, encoder, split)
    generator = None
    if records is None:
        command = [sys.executable, "-m", "tools", "bench", "synthetic-records", "--docs", str(count * 160),
                   "--vocab", str(cfg.model.vocab_size), "--mean-tokens", "1000", "--sigma", "1.0"]
        generator = processes.start(command, stdout=subprocess.PIPE)
        source = (generator.stdout, "generator")
    else:
        source = (io.BytesIO(records), "records")
    feeder = UpdateFeeder(lambda: source, settings, encoder.encode_batch_arrays, ValidationPool(0))
    batches = []
    for item in feeder.iterate():
        if isinstance(item, dict):
            batches.append({k: v.cuda() if torch.is_tensor(v) else v for k, v in item.items()})
        if len(batches) == count:
            break
    feeder.stop()
    if generator is not None:
        generator.kill()
    return batches


LOSS_VARIANTS = ("chunked", "chunked-compiled", *[k for k in loss_module.CHOICES if k != "chunked"])


def loss_settings(variant: str) -> tuple[str, str]:
    """``model.loss_kernel`` and ``model.loss_softmax`` for a name of LOSS_VARIANTS: "chunked" takes the default
    softmax, "chunked-compiled" inductor's."""
    return ("chunked", "compiled") if variant == "chunked-compiled" else (variant, GPTConfig.loss_softmax)


def use_loss_variant(model_config, variant: str) -> None:
    model_config.loss_kernel, model_config.loss_softmax = loss_settings(variant)


def inductor_variant(name: str) -> str:
    """An --inductor value: max-autotune, max-autotune-triton or budget-X with X in [0, 1]."""
    if name in ("max-autotune", "max-autotune-triton"):
        return name
    if name.startswith("budget-"):
        try:
            if 0 <= float(name[len("budget-"):]) <= 1:
                return name
        except ValueError:
            pass
    raise ValueError(f"not an inductor variant: {name!r} (max-autotune, max-autotune-triton, budget-X)")


# Model settings read when the module is built or the trunk compiled, which --compare cannot vary on the built module.
FIXED_WHEN_BUILT = {"vocab_size", "n_layer", "n_head", "n_embd", "max_seq_len", "layer_norm_eps", "init_std", "fp8",
                    "activation_memory_budget", "compile_scope"}


def model_differences(configured, variant) -> dict:
    """The model settings (name -> value) in which ``variant`` differs from ``configured``."""
    return {f.name: getattr(variant, f.name) for f in dataclasses.fields(variant)
            if getattr(variant, f.name) != getattr(configured, f.name)}


@contextlib.contextmanager
def model_settings(model_config, settings: dict):
    """``settings`` on the built model's config for the duration, then the configured values again."""
    saved = {name: getattr(model_config, name) for name in settings}
    for name, value in settings.items():
        setattr(model_config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model_config, name, value)


def train_steps(lit, batches: list[dict], steps: int, warmup: int, grad_clip: float) -> dict:
    """``warmup`` + ``steps`` optimizer updates of one microbatch each over ``batches`` in order:
    the first update's seconds, then target tokens/s and ms per update over the last ``steps``."""
    optimizer = lit.configure_optimizers()["optimizer"]
    torch.cuda.reset_peak_memory_stats()
    losses, tokens, first, start = [], 0, None, None
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        began = time.perf_counter()
        batch = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lit.model.loss_sum(batch) / batch["update_target_tokens"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lit.parameters(), grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if i == 0:
            torch.cuda.synchronize()
            first = time.perf_counter() - began
        if i >= warmup:
            tokens += batch["target_tokens"]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"first_update_seconds": first, "tokens_per_second": tokens / seconds,
            "ms_per_update": 1000 * seconds / steps, "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "losses": [float(x) for x in losses], "kernel": lit.model.loss_kernel, "mlp": lit.model.mlp_kernel}


def held_out_loss(lit, batches: list[dict]) -> float:
    lit.eval()
    total = count = 0.0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for batch in batches:
            total += float(lit.model.loss_sum(batch))
            count += batch["target_tokens"]
    lit.train()
    return total / count


def time_cuda(fn, repeats: int = 8, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, device-timed."""
    return bench.cuda_median_ms(fn, repeats, warmup)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def isolated_losses(kernels: list[str], tokens: int, vocab: int) -> dict:
    """Each loss kernel's forward + backward alone on the same fp32 hidden states (what the trunk
    hands over under autocast), timed, with its loss and gradients against the chunked kernel's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, 768, device="cuda", generator=gen).requires_grad_()
    weight = (0.02 * torch.randn(vocab, 768, device="cuda", generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    targets[::50] = loss_module.IGNORE_INDEX
    results, reference = {}, None
    for variant in kernels:
        kernel, softmax = loss_settings(variant)

        def run():
            hidden.grad = weight.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                value = loss_module.token_loss_sum(hidden, weight, targets, 16384, kernel, compiled=True, softmax=softmax)
            value.backward()
            return value.detach()
        try:
            value = run()
            grads = (hidden.grad.clone(), weight.grad.clone())
            row = {"ms": time_cuda(run)}
            torch.cuda.reset_peak_memory_stats()
            run()
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if reference is None:
                reference = (value, *grads)
            row |= {"loss_vs_chunked": relative(value, reference[0]), "dhidden_vs_chunked": relative(grads[0], reference[1]),
                    "dweight_vs_chunked": relative(grads[1], reference[2])}
        except Exception as error:  # noqa: BLE001 - a kernel that fails is reported, the others still run
            row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        results[variant] = row
        print(f"isolated loss {variant}: {row}", file=sys.stderr, flush=True)
    return results


def isolated_softmax(vocab: int, rows: int = 16384) -> dict:
    """One chunk's loss and logits gradient alone: the compiled PyTorch function against the Triton
    kernel at several (columns per block, warps), with the Triton result's difference from PyTorch's."""
    from model import triton_cross_entropy

    padded = loss_module.padded_vocab_size(vocab)
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = (2 * torch.randn(rows, padded, device="cuda", generator=gen)).bfloat16()
    logits[:, vocab:] = 0
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[::50] = loss_module.IGNORE_INDEX
    compiled = loss_module.compiled_chunk_loss_and_grad()
    reference_loss, reference_grad = compiled(logits, targets, vocab, torch.bfloat16)
    work = logits.clone()
    results = {"compiled_ms": time_cuda(lambda: compiled(logits, targets, vocab, torch.bfloat16))}
    for block, warps in [(2048, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (16384, 16)]:
        try:
            work.copy_(logits)
            value = triton_cross_entropy.loss_and_gradient_in_place(work, targets, vocab, loss_module.IGNORE_INDEX, block, warps)
            row = {"loss_vs_compiled": relative(value, reference_loss), "grad_vs_compiled": relative(work, reference_grad)}
            # timed on the overwritten buffer: the same memory traffic, values no longer matter
            row["ms"] = time_cuda(lambda: triton_cross_entropy.loss_and_gradient_in_place(
                work, targets, vocab, loss_module.IGNORE_INDEX, block, warps))
        except Exception as error:  # noqa: BLE001
            row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        results[f"triton {block}x{warps}"] = row
    gigabytes = 3 * logits.numel() * logits.element_size() / 1e9  # two reads and one write of the chunk
    results["triton_bandwidth_tb_s"] = {k: gigabytes / r["ms"] for k, r in results.items()
                                        if isinstance(r, dict) and "ms" in r}
    print(f"isolated softmax ({rows} x {padded}): {results}", file=sys.stderr, flush=True)
    return results


def isolated_quack(tokens: int) -> dict:
    """quack's chunked linear cross-entropy and the chunked loss at vocabulary 50,304 (no padding columns)."""
    padded = 50304
    gen = torch.Generator(device="cuda").manual_seed(1)
    results = {}
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        x = torch.randn(tokens, 768, device="cuda", generator=gen).bfloat16().requires_grad_()
        w = (0.02 * torch.randn(padded, 768, device="cuda", generator=gen)).bfloat16().requires_grad_()
        targets = torch.randint(0, padded, (tokens,), device="cuda", generator=gen)

        def quack():
            x.grad = w.grad = None
            value = chunked_linear_cross_entropy(x, w, targets, chunk_size=16384, reduction="sum")
            value.backward()
            return value.detach()

        def chunked():
            x.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                value = loss_module.token_loss_sum(x, w, targets, 16384, "chunked", compiled=True)
            value.backward()
            return value.detach()

        ours = chunked()
        ours_grads = (x.grad.clone(), w.grad.clone())
        theirs = quack()
        results = {"quack_ms": time_cuda(quack), "chunked_ms": time_cuda(chunked),
                   "loss_vs_chunked": relative(theirs, ours), "dx_vs_chunked": relative(x.grad, ours_grads[0]),
                   "dw_vs_chunked": relative(w.grad.float(), ours_grads[1].float())}
    except Exception as error:  # noqa: BLE001
        results = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    print(f"isolated quack at vocabulary {padded}: {results}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str]) -> int:
    parser = bench.parser("step-variants", __doc__.splitlines()[0], runs=False, layouts=False)
    parser.add_argument("--microbatch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--kernels", nargs="*", default=["chunked", "chunked-compiled"], choices=LOSS_VARIANTS)
    parser.add_argument("--inductor", nargs="*", default=["budget-1", "max-autotune-triton"], type=inductor_variant,
                        help="max-autotune, max-autotune-triton (Triton templates only), budget-X (activation_memory_budget X)")
    parser.add_argument("--mlp", nargs="*", default=[], choices=fused_mlp.CHOICES[1:],
                        help="short for --compare model.mlp_kernel=K for each K (quack: GELU in the GEMM epilogues)")
    parser.add_argument("--compare", nargs="+", action="append", default=[], metavar="model.KEY=VALUE",
                        help="also run the step with these model settings, and train the real-text rows with them; "
                             "repeat for more")
    parser.add_argument("--learning-updates", type=int, default=24, help="0: no learning comparison")
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds; later phases are skipped past it")
    args = bench.parse(parser, argv)
    cfg = bench.config(args, "data.val_fraction=0")
    compared = {}  # name -> the model settings it changes
    for variant in [*args.compare, *[[f"model.mlp_kernel={k}"] for k in args.mlp]]:
        if any(not assignment.startswith("model.") for assignment in variant):
            parser.error(f"--compare {' '.join(variant)}: only model.* settings (the module is built once)")
        try:
            settings = model_differences(cfg.model, bench.config(args, "data.val_fraction=0", *variant).model)
        except ConfigError as error:
            parser.error(f"--compare {' '.join(variant)}: {bench.one_line(error)}")
        if fixed := sorted(set(settings) & FIXED_WHEN_BUILT):
            parser.error(f"--compare {' '.join(variant)}: model.{', model.'.join(fixed)} take effect when the model is built "
                         f"or compiled, once per run here (budgets: --inductor budget-X; others: another run)")
        compared[" ".join(variant)] = settings
    if not bench.require_gpu("step-variants"):
        return 2
    bench.prepare(args)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "microbatch": args.microbatch,
                    "loss_kernels": {}, "inductor": {}}

    def save() -> None:
        result["recommended_overrides"] = recommend(result, args.microbatch)
        created_files.write_text(args.out / "step_variants.json", json.dumps(result, indent=2))
        created_files.write_text(args.out / "recommended.txt", " ".join(result["recommended_overrides"]) + "\n")

    batches = collect_batches(cfg, args.microbatch, 8, None)
    pairs = sum(b["attention_pairs"] for b in batches) / len(batches)
    flops = training_flops(cfg.model, args.microbatch * cfg.model.max_seq_len, pairs)
    configured = (cfg.model.loss_kernel, cfg.model.loss_softmax)  # the inductor variants' loss (the loop below changes it)
    default_loss = "chunked-compiled" if configured == loss_settings("chunked-compiled") else cfg.model.loss_kernel
    result["inductor_loss"] = default_loss
    torch.manual_seed(cfg.seed)  # the same initial weights in every job and tree: learning rows compare across them
    lit = device_policy.build_module(cfg, torch.device("cuda"))
    initial = {k: v.clone() for k, v in lit.state_dict().items()}
    lit.model.compile_trunk()

    def timed_row(compile_first: bool = False) -> dict:
        """The step on the benchmark's rows from the initial weights, with its MFU; or the error that stopped it
        (a variant that fails is reported, the others still run)."""
        lit.load_state_dict(initial)
        try:
            if compile_first:
                lit.model.compile_trunk()
            row = train_steps(lit, batches, args.steps, args.warmup, cfg.trainer.gradient_clip_val)
            row["mfu"] = flops / (row["ms_per_update"] / 1000) / cfg.metrics.peak_flops
        except Exception as error:  # noqa: BLE001
            row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        return row

    for kernel in args.kernels:
        use_loss_variant(lit.model.config, kernel)
        row = result["loss_kernels"][kernel] = timed_row()
        print(f"[{elapsed():.0f} s] loss kernel {kernel}: {row}", file=sys.stderr, flush=True)
        save()
    result["compared"] = {}
    for name, settings in compared.items():
        use_loss_variant(lit.model.config, default_loss)
        with model_settings(lit.model.config, settings):
            row = result["compared"][name] = timed_row()
        print(f"[{elapsed():.0f} s] {name}: {row}", file=sys.stderr, flush=True)
        save()
    ran = {k: r for k, r in result["loss_kernels"].items() if "tokens_per_second" in r}
    fastest = max(ran, key=lambda k: ran[k]["tokens_per_second"]) if ran else "chunked"
    result["fastest_loss_kernel"] = fastest

    if elapsed() < args.time_limit - 60:
        result["isolated"] = isolated_losses(args.kernels, args.microbatch * 4096, cfg.model.vocab_size)
        result["isolated_softmax"] = isolated_softmax(cfg.model.vocab_size)
        if any(k in args.kernels for k in ("liger", "cce")):
            result["isolated_quack"] = isolated_quack(args.microbatch * 4096)
        save()

    if args.learning_updates and elapsed() < args.time_limit - 90:
        # About two updates of packed rows per copy of the sample (445,000 tokens) at microbatch 32, with room to spare.
        text = (ROOT / "data/sample.jsonl").read_bytes() * max(12, math.ceil((args.learning_updates + 2) * args.microbatch / 64))
        real = collect_batches(cfg, args.microbatch, args.learning_updates + 2, text)
        train_rows, held_out_rows = real[:-2], real[-2:]
        runs = {}
        compared_runs = {name: compared[name] for name, r in result["compared"].items() if "tokens_per_second" in r}
        loss_runs = {name: {} for name in ["chunked", "chunked (again)", *[k for k in args.kernels if k != "chunked" and k in ran]]}
        for name, settings in (loss_runs | compared_runs).items():
            lit.load_state_dict(initial)
            use_loss_variant(lit.model.config, "chunked" if name in compared_runs else name.split()[0])
            with model_settings(lit.model.config, settings):
                row = train_steps(lit, train_rows, len(train_rows) - 1, 1, cfg.trainer.gradient_clip_val)
                held_out = held_out_loss(lit, held_out_rows)
            runs[name] = {"losses": row["losses"], "held_out_loss": held_out, "kernel": row["kernel"], "mlp": row["mlp"]}
            print(f"[{elapsed():.0f} s] learning {name}: held-out {runs[name]['held_out_loss']:.4f}, "
                  f"last train {row['losses'][-1] * 1:.4f}", file=sys.stderr, flush=True)
        result["learning"] = {"updates": len(train_rows), "real_text_tokens_per_update": sum(b["target_tokens"] for b in train_rows) / len(train_rows),
                              "runs": runs}
        save()

    for variant in args.inductor:
        if elapsed() > args.time_limit - 150:
            result["inductor"][variant] = {"skipped": "time limit"}
            continue
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        saved = {k: getattr(inductor_config, k) for k in ("max_autotune_gemm", "max_autotune_gemm_backends")}
        if variant.startswith("max-autotune"):
            inductor_config.max_autotune_gemm = True
            if variant == "max-autotune-triton":
                inductor_config.max_autotune_gemm_backends = "TRITON"
        budget = lit.model.config.activation_memory_budget
        if variant.startswith("budget-"):
            lit.model.config.activation_memory_budget = float(variant[len("budget-"):])
        use_loss_variant(lit.model.config, default_loss)
        row = result["inductor"][variant] = timed_row(compile_first=True)
        for k, v in saved.items():
            setattr(inductor_config, k, v)
        lit.model.config.activation_memory_budget = budget
        print(f"[{elapsed():.0f} s] inductor {variant}: {row}", file=sys.stderr, flush=True)
        save()

    save()
    print_table(result, args)
    return 0


def variant_overrides(variant: str) -> list[str]:
    """The config overrides that select a loss variant (LOSS_VARIANTS)."""
    kernel, softmax = loss_settings(variant)
    return [f"model.loss_kernel={kernel}", f"model.loss_softmax={softmax}"]


def recommend(result: dict, microbatch: int) -> list[str]:
    """The overrides that paid: a loss variant at least 1 % faster than the chunked loss (default softmax)
    whose held-out loss is within three times the chunked runs' own difference (0.2 % at least); the
    fastest activation_memory_budget X that is 1 % faster than the run it varies and stays within
    0.30 MiB of peak memory per microbatch token."""
    kernels = {k: r for k, r in result["loss_kernels"].items() if "tokens_per_second" in r}
    chosen = variant_overrides("chunked")
    runs = result.get("learning", {}).get("runs", {})
    if "chunked" in kernels and "chunked" in runs:
        base, again = runs["chunked"]["held_out_loss"], runs["chunked (again)"]["held_out_loss"]
        tolerance = max(3 * abs(again - base), 0.002 * base)
        for kernel in sorted(kernels, key=lambda k: -kernels[k]["tokens_per_second"]):
            if kernel == "chunked":
                break
            faster = kernels[kernel]["tokens_per_second"] > 1.01 * kernels["chunked"]["tokens_per_second"]
            if faster and kernel in runs and abs(runs[kernel]["held_out_loss"] - base) <= tolerance:
                chosen = variant_overrides(kernel)
                break
    baseline = kernels.get(result.get("inductor_loss", "chunked"))
    budgets = {k: r for k, r in result["inductor"].items() if k.startswith("budget-") and "tokens_per_second" in r
               and r["peak_allocated_gib"] * 1024 / (microbatch * 4096) <= 0.30}
    if baseline and budgets:
        best = max(budgets, key=lambda k: budgets[k]["tokens_per_second"])
        if budgets[best]["tokens_per_second"] > 1.01 * baseline["tokens_per_second"]:
            chosen.append(f"model.activation_memory_budget={best[len('budget-'):]}")
    return chosen


def print_table(result: dict, args) -> None:
    per_microbatch = args.microbatch * 4096
    print(f"\n{result['gpu']}, torch {result['torch']}, microbatch {args.microbatch} x 4096, realistic documents")
    print(f"{'run':<34} {'tokens/s':>10} {'ms/update':>10} {'MFU':>6} {'first s':>8} {'peak GiB':>9} {'MiB/token':>9}")
    rows = [(f"loss {k}", r) for k, r in result["loss_kernels"].items()]
    rows += [(f"{k} (loss {r.get('kernel', '-')})", r) for k, r in result.get("compared", {}).items()]
    rows += [(f"inductor {k} (loss {r.get('kernel', '-')})", r) for k, r in result["inductor"].items()]
    for name, r in rows:
        if "tokens_per_second" not in r:
            print(f"{name:<34} {r.get('error') or r.get('skipped')}")
            continue
        print(f"{name:<34} {r['tokens_per_second']:>10,.0f} {r['ms_per_update']:>10.1f} {r['mfu']:>6.1%} "
              f"{r['first_update_seconds']:>8.1f} {r['peak_allocated_gib']:>9.2f} "
              f"{r['peak_allocated_gib'] * 1024 / per_microbatch:>9.3f}")
    for k, r in result.get("isolated", {}).items():
        print(f"isolated loss {k:<10} " + (f"{r['ms']:.2f} ms, peak {r['peak_allocated_gib']:.2f} GiB, loss/dh/dw vs chunked "
              f"{r['loss_vs_chunked']:.1e}/{r['dhidden_vs_chunked']:.1e}/{r['dweight_vs_chunked']:.1e}" if "ms" in r else r["error"]))
    softmax = result.get("isolated_softmax", {})
    for name, r in softmax.items():
        if isinstance(r, dict) and name != "triton_bandwidth_tb_s":
            print(f"chunk softmax {name:<16} " + (f"{r['ms']:.3f} ms ({softmax['triton_bandwidth_tb_s'][name]:.2f} TB/s), "
                  f"loss/grad vs compiled {r['loss_vs_compiled']:.1e}/{r['grad_vs_compiled']:.1e}" if "ms" in r else r["error"]))
    if "compiled_ms" in softmax:
        print(f"chunk softmax compiled PyTorch  {softmax['compiled_ms']:.3f} ms")
    if "isolated_quack" in result:
        print(f"isolated quack vs chunked at vocabulary 50304: {result['isolated_quack']}")
    for name, r in result.get("learning", {}).get("runs", {}).items():
        print(f"learning {name:<16} held-out {r['held_out_loss']:.4f}  train loss first/last {r['losses'][0]:.4f}/{r['losses'][-1]:.4f}")

