"""Time to quality: how much GPU time each candidate recipe needs to reach the reference recipe's final validation
cross-entropy, trained on the same rows of real text in one job.

The reference is the job's configuration (``--config FILE`` and ``--section.key VALUE``, conf/config.yaml by
default); each ``--candidate "OPTIONS"`` is train.py's options over it (``--config conf/fast-150m.yaml`` or single
keys). Every run is ``train.py`` fed the same records on stdin, as RunFab feeds ``train()``, for ``--steps`` updates
(a candidate's own ``--trainer.max_steps``, fewer, ends its schedule sooner) of ``--microbatch`` rows,
validating every ``--every`` updates on one validation file (``data.val_path``) held out of
the corpus, so every run is scored on the same documents.

Training seconds run from the end of the first update (so compilation counts for no run) to the end of an update,
by the run's history (callbacks/history.py), less the validation pauses: an update's interval that holds a periodic
validation counts as the run's median interval. A candidate reaches the target at the first validation whose
cross-entropy is at or below the reference's final one.

The corpus is real text: the Python sources installed with this interpreter (``python``), or C and C++ headers of
the system, CUDA and the installed packages (``headers``: PyTorch's among them), or a file of NDJSON records (``text`` or ``input_ids``), tokenized once with the
reference's tokenizer into ``input_ids`` records.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

import cli
from callbacks.history import read_history
from config import load_config
from pipeline.tokenizer import TextEncoder
from runfab import created_files
from tools import processes
from tools.bench import runs

CORPORA = {
    "python": lambda: sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}),
    "headers": lambda: ["/usr/include", "/usr/local/cuda/include", sysconfig.get_paths()["purelib"]],
}
SUFFIXES = {"python": (".py",), "headers": (".h", ".hpp", ".cuh")}
class RunFailed(RuntimeError):
    """A train.py run of the job exited with an error; the message names its log."""


VALIDATION_SHARE = 200  # one document in this many (by a hash of its path) is held out for validation


def parser() -> argparse.ArgumentParser:
    parser = runs.parser("time-to-loss", "GPU-seconds each candidate recipe needs to reach the reference's final "
                         "validation cross-entropy, on the same rows of real text", runs=False, layouts=False)
    parser.add_argument("--microbatch", type=int, default=32, help="rows per microbatch (default: 32)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer updates of every run (default: 150)")
    parser.add_argument("--candidate", action="append", default=[], metavar='"--config FILE --section.key VALUE ..."',
                        help="a recipe to race against the reference, train.py's options quoted as one argument "
                             "(its own --trainer.max_steps, at most --steps, ends its schedule sooner); repeat for "
                             "more. A candidate whose run fails is reported as failed and the others go on (exit 1)")
    parser.add_argument("--corpus", default="python",
                        help="python (the installed Python sources), headers (the C/C++ and CUDA headers of the system and the "
                             "installed packages), or a file of "
                             "NDJSON records (default: python)")
    parser.add_argument("--every", type=int, default=10, help="updates between validations (default: 10)")
    parser.add_argument("--val-tokens", type=int, default=1 << 20,
                        help="tokens of the validation file at most (default: 1048576)")
    return parser


def main(argv: list[str]) -> int:
    args = runs.parse(parser(), argv)
    if not args.candidate:
        print("python -m tools bench time-to-loss: give at least one --candidate", file=sys.stderr)
        return 2
    try:
        candidates = {f"candidate-{i + 1}": candidate_flags(args, text) for i, text in enumerate(args.candidate)}
    except runs.VariantError as error:
        print(f"python -m tools bench time-to-loss: {error}", file=sys.stderr)
        return 2
    runs.prepare(args)
    train_path, val_path = write_corpus(args)
    flags = {"reference": args.train_flags, **{n: list(f) for n, f in candidates.items()}}
    results, failed = {}, {}
    for name, options in [("reference", ()), *candidates.items()]:
        try:
            results[name] = train_run(args, name, options, train_path, val_path)
        except RunFailed as error:
            if name == "reference":  # no target to race to
                raise
            failed[name] = {"flags": flags[name], "error": str(error)}
            print(f"python -m tools bench time-to-loss: {name} failed, the others go on: {error}", file=sys.stderr)
            print(json.dumps({"run": name, **failed[name]}), flush=True)
            continue
        # After every run, so that a job stopped early keeps the runs it finished.
        summary = compare(results, flags) | {"failed": failed}
        created_files.write_text(args.out / "time-to-loss.json", json.dumps(summary, indent=2) + "\n")
        figures = summary["runs"][name]
        print(json.dumps({"run": name, **{k: v for k, v in figures.items() if k != "curve"}}), flush=True)
    created_files.write_text(args.out / "time-to-loss.json",
                             json.dumps(compare(results, flags) | {"failed": failed}, indent=2) + "\n")
    plot(results, args.out / "time-to-loss.png")
    return 1 if failed else 0


def candidate_flags(args, text: str) -> tuple[str, ...]:
    """A candidate's train.py options, checked as a --variant's (its own --config allowed); its tokenizer and
    vocabulary must be the reference's, since every run reads the same token ids. Its own ``--trainer.max_steps``
    (a shorter schedule) may be at most ``--steps``, which the corpus is sized for."""
    flags = runs.variant_flags(args, text, option="--candidate", own_file=True)
    command = cli.parse(list(flags))
    ours = load_config(command.config_path or args.config,
                       [*args.overrides, f"trainer.max_steps={args.steps}", *command.overrides])
    reference = runs.config(args)
    if (ours.data.tokenizer, ours.model.vocab_size) != (reference.data.tokenizer, reference.model.vocab_size):
        raise runs.VariantError(f"--candidate {text}: its tokenizer and vocabulary must be the reference's, since "
                                "every run reads the same token ids")
    if not 1 <= ours.trainer.max_steps <= args.steps:
        raise runs.VariantError(f"--candidate {text}: trainer.max_steps {ours.trainer.max_steps} must be from 1 to "
                                f"--steps ({args.steps}), the updates the corpus holds rows for")
    return flags


# ----------------------------------------------------------------------------- the corpus


def corpus_documents(corpus: str, encoder: TextEncoder):
    """(name, token ids) of every document of ``corpus`` in a fixed order: the installed files by sorted path, or a
    records file's lines (``input_ids`` as they are, ``text`` encoded)."""
    if corpus not in CORPORA:
        with open(corpus, encoding="utf-8") as lines:
            for number, line in enumerate(lines):
                if line.strip():
                    record = json.loads(line)
                    ids = record.get("input_ids") or encoder.encode_batch([record["text"]])[0]
                    yield f"{corpus}:{number}", ids
        return
    for root in CORPORA[corpus]():
        for path in sorted(Path(root).rglob("*")) if Path(root).is_dir() else []:
            if path.suffix in SUFFIXES[corpus] and path.is_file() and not path.is_symlink():
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if text.strip():
                    yield str(path), encoder.encode_batch([text])[0]


def write_corpus(args) -> tuple[Path, Path]:
    """The training records and the validation file every run reads, tokenized once: enough documents for
    ``--steps`` updates with half again to spare; one document in VALIDATION_SHARE (by a hash of its name) to the
    validation file, up to ``--val-tokens``."""
    cfg = runs.config(args)
    encoder = TextEncoder(cfg.data.tokenizer)
    needed = 1.5 * (args.steps + 2) * args.microbatch * cfg.model.max_seq_len
    train_path, val_path = args.out / "train.jsonl", args.out / "validation.jsonl"
    trained = held = 0
    with created_files.open_created(train_path, "w") as train, created_files.open_created(val_path, "w") as val:
        for name, ids in corpus_documents(args.corpus, encoder):
            line = json.dumps({"input_ids": ids[: 1 << 17]}) + "\n"  # well inside the 1 MiB record limit
            if int(hashlib.sha256(name.encode()).hexdigest(), 16) % VALIDATION_SHARE == 0:
                if held < args.val_tokens:
                    val.write(line)
                    held += len(ids)
                continue
            train.write(line)
            trained += len(ids)
            if trained >= needed and held >= min(args.val_tokens, needed / VALIDATION_SHARE):
                break
    if trained < needed / 1.5 or held == 0:
        raise SystemExit(f"python -m tools bench time-to-loss: the corpus {args.corpus} holds {trained:,} training "
                         f"and {held:,} validation tokens; {needed / 1.5:,.0f} and some are needed")
    print(f"corpus {args.corpus}: {trained:,} training tokens, {held:,} validation tokens", file=sys.stderr)
    return train_path, val_path


# ----------------------------------------------------------------------------- the runs


def train_run(args, name: str, flags: tuple[str, ...], train_path: Path, val_path: Path) -> dict:
    """One train.py run on the records; its validation curve and its training seconds by update."""
    output = args.out / name
    job = list(args.train_flags)
    if "--config" in flags and "--config" in job:  # the candidate's file replaces the job's; the job's keys still apply
        at = job.index("--config")
        del job[at:at + 2]
    # --steps before the candidate's options: a candidate may train fewer updates (its schedule ends sooner)
    options = ["--microbatch", str(args.microbatch), *job, "--trainer.max_steps", str(args.steps), *flags,
               "--trainer.val_every_steps", str(args.every), "--data.val_path", str(val_path.resolve())]
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(output))
    with train_path.open("rb") as source:
        process = processes.start([sys.executable, str(runs.ROOT / "train.py"), *options], stdin=source, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = process.communicate()
    created_files.write_text(args.out / f"{name}-stderr.log", stderr)
    if process.returncode:
        raise RunFailed(f"train.py {' '.join(options)} exited with {process.returncode} "
                        f"({args.out}/{name}-stderr.log): "
                        f"{stderr.strip().splitlines()[-1] if stderr.strip() else 'no message'}")
    record = json.loads((output / "model" / "run_record.json").read_text())
    history = read_history(output / "model" / "history.npz")
    validation = record["comparability"]["validation"]
    curve = {0: validation["ce_before"]}
    for line in stdout.splitlines():
        metrics = json.loads(line)
        if "val_loss" in metrics:
            curve[int(metrics["step"])] = metrics["val_loss"]
    curve[int(history["update"][-1])] = validation["ce_after"]
    seconds = training_seconds(history["update"], history["seconds"], args.every)
    return {"curve": sorted(curve.items()), "seconds": seconds, "updates": int(history["update"][-1]),
            "tokens_per_second": record["summary"]["tokens_per_second"], "mfu": record["summary"]["mfu"]}


def training_seconds(updates: np.ndarray, seconds: np.ndarray, every: int) -> dict[int, float]:
    """Seconds from the end of the first update to the end of each update, an interval that holds a periodic
    validation (the one after each ``every``-th update) counted as the median interval."""
    intervals = np.diff(seconds.astype(np.float64))
    after = updates[1:]
    paused = (after - 1) % every == 0 if every else np.zeros_like(after, dtype=bool)
    typical = float(np.median(intervals[~paused])) if (~paused).any() else 0.0
    elapsed = np.cumsum(np.where(paused, typical, intervals))
    return {int(updates[0]): 0.0, **{int(u): float(t) for u, t in zip(after, elapsed, strict=True)}}


def compare(results: dict, flags: dict) -> dict:
    """Each run's updates and training seconds to the reference's final validation cross-entropy, and its
    cross-entropy at the reference's last update."""
    reference = results["reference"]
    target = reference["curve"][-1][1]
    last = reference["updates"]
    summary = {"target_cross_entropy": target, "runs": {}}
    for name, result in results.items():
        reached = next((update for update, ce in result["curve"] if update > 0 and ce <= target), None)
        seconds = result["seconds"].get(reached) if reached is not None else None
        at_last = dict(result["curve"]).get(last)
        summary["runs"][name] = {
            "flags": flags[name], "updates_to_target": reached, "seconds_to_target": seconds,
            "speedup_in_seconds": (reference["seconds"][last] / seconds) if seconds else None,
            "cross_entropy_at_reference_updates": at_last,
            "tokens_per_second": result["tokens_per_second"], "mfu": result["mfu"], "curve": result["curve"],
        }
    return summary


def plot(results: dict, path: Path) -> None:
    """Validation cross-entropy against training seconds, one line a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        points = [(result["seconds"].get(update, 0.0), ce) for update, ce in result["curve"] if update in
                  result["seconds"] or update == 0]
        axes.plot(*zip(*points), marker="o", markersize=3, label=name)
    axes.axhline(results["reference"]["curve"][-1][1], color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("training seconds (from the end of the first update)")
    axes.set_ylabel("validation cross-entropy")
    axes.legend()
    figure.tight_layout()
    with created_files.open_created(path, "wb") as file:
        figure.savefig(file, format="png", dpi=120)
    plt.close(figure)
