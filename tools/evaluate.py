"""``python -m tools evaluate MODEL --data FILE.jsonl``: the cross-entropy of an exported model on NDJSON
records, computed as training validates.

The records go through the trainer's own rules (pipeline/records.py: what is accepted, what is
rejected and why), the model's own tokenizer (MODEL/tokenizer.json, EOS after every document), are
packed into rows of the model's length as validation packs them, and are scored by the trainer's
decoder and loss (the export's weights loaded back into model/gpt.py's GPT): the exact
token-weighted mean, summed target-token loss over the target-token count, and its perplexity.
On the run's own validation set (``run/validation.jsonl``, or ``validation.jsonl`` beside prepared
shards) it gives the run's final validation cross-entropy (the run record's
``comparability.validation.ce_after``; the digests match too). Memory is bounded: the file is read
as a stream, a microbatch of rows at a time. On a GPU it computes in bf16 autocast, as training does.

stdout: one JSON object (the figures); stderr: one summary line. Exit 2 for a usage problem.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

PROG = "python -m tools evaluate"
LINEAR_LAYERS = {"attn.c_attn": ("attn", "qkv"), "attn.c_proj": ("attn", "proj"), "mlp.c_fc": ("mlp", "fc"),
                 "mlp.c_proj": ("mlp", "proj")}


class NotThisModel(ValueError):
    """A folder this trainer's decoder cannot load; the message says why."""


def load_gpt(folder: Path):
    """The exported GPT-2 folder as this trainer's GPT: the inverse of callbacks.export.gpt2_state_dict."""
    import torch
    from safetensors.torch import load_file

    from callbacks.export import WEIGHTS_NAME, gpt2_state_dict
    from model.gpt import GPT, GPTConfig

    try:
        config = json.loads((folder / "config.json").read_text())
        weights = load_file(str(folder / WEIGHTS_NAME))
    except (OSError, ValueError) as error:
        raise NotThisModel(f"{folder} is not an exported model ({error})") from None
    if config.get("model_type") != "gpt2" or config.get("activation_function") != "gelu":
        raise NotThisModel(f"{folder} holds a {config.get('model_type')} model with activation "
                           f"{config.get('activation_function')}; this scores models this trainer exported "
                           "(GPT-2, gelu)")
    gpt_config = GPTConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"], n_head=config["n_head"],
                           n_embd=config["n_embd"], max_seq_len=config["n_positions"],
                           layer_norm_eps=config["layer_norm_epsilon"])
    model = GPT(gpt_config)
    own = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
           "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias}
    for i, block in enumerate(model.blocks):
        for name, (part, layer) in LINEAR_LAYERS.items():
            own[f"transformer.h.{i}.{name}.weight"] = getattr(getattr(block, part), layer).weight
        for name in ("ln_1", "ln_2"):
            own[f"transformer.h.{i}.{name}.weight"] = getattr(block, name).weight
            own[f"transformer.h.{i}.{name}.bias"] = getattr(block, name).bias
    with torch.no_grad():
        for key, parameter in own.items():
            value = weights[key]
            parameter.copy_(value.t() if key.rsplit(".", 2)[-2] in {"c_attn", "c_proj", "c_fc"} else value)
    expected = gpt2_state_dict(model)
    if expected.keys() != {k for k in weights if k != "lm_head.weight"} or any(
            not torch.equal(expected[k], weights[k].float()) for k in expected):
        raise NotThisModel(f"{folder} has weights this trainer's decoder does not hold (biases in its linear layers, "
                           "or other tensors); it scores models this trainer exported")
    return model


def evaluate(folder: Path, data: Path, microbatch: int = 8, max_record_bytes: int | None = None,
             device: str = "auto") -> dict:
    import torch

    from pipeline.fingerprints import ValidationDigest
    from callbacks.fixed_validation import cross_entropy
    from pipeline.records import StreamStats, file_documents
    from pipeline.tokenizer import TextEncoder
    from runfab.limits import RECORD_BYTES

    model = load_gpt(folder)
    chosen = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    model.to(chosen)
    with warnings.catch_warnings():  # the export's tokenizer.json has a post-processor, which encoding leaves out
        warnings.filterwarnings("ignore", ".*slower HF tokenizers backend", RuntimeWarning)
        encoder = TextEncoder(folder / "tokenizer.json")
    stats = StreamStats(source=str(data))
    digest = ValidationDigest()  # built as the documents stream by: the same as the run record's for the same set

    def documents():
        with data.open("rb") as stream:
            for ids in file_documents(stream, stats, encoder.encode_batch_arrays, encoder.eos_id,
                                      model.config.vocab_size, max_record_bytes or RECORD_BYTES):
                digest.update(ids)
                yield ids

    context = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if chosen.type == "cuda"
               else contextlib.nullcontext)
    result = cross_entropy(model, documents(), model.config.max_seq_len, microbatch, chosen, context)
    return {**result, "documents": digest.result(), "records": stats.records,
            "rejected": dict(sorted(stats.rejected.items())), "device": str(chosen), "model": str(folder),
            "data": str(data)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Score an exported model on NDJSON records: the exact "
                                     "token-weighted cross-entropy and perplexity, as training validates.")
    parser.add_argument("model", type=Path, metavar="MODEL", help="an exported model folder (a run's model/)")
    parser.add_argument("--data", type=Path, required=True, metavar="FILE.jsonl",
                        help='NDJSON records with "text" or "input_ids", as training reads them')
    parser.add_argument("--microbatch", type=int, default=8, help="rows per forward pass (default 8)")
    parser.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu or cuda")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        print(f"{PROG}: --data {args.data} is not a file", file=sys.stderr)
        return 2
    problems = [message for bad, message in (
        (args.microbatch < 1, "--microbatch must be at least 1"),
        (not (args.model / "tokenizer.json").is_file(), f"{args.model} has no tokenizer.json: give an exported model"),
        (args.device not in ("auto", "cpu", "cuda"), f"--device is auto, cpu or cuda, not {args.device!r}"))
        if bad]
    if not problems and args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("--device cuda, but no CUDA GPU is visible")
    if problems:
        print(f"{PROG}: {problems[0]}", file=sys.stderr)
        return 2
    from pipeline.records import UnusableInputError

    try:
        result = evaluate(args.model, args.data, args.microbatch, device=args.device)
    except (NotThisModel, UnusableInputError) as error:
        print(f"{PROG}: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    if result["cross_entropy"] is None:
        print(f"{PROG}: {args.data} gave no token to score", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    print(f"{PROG}: cross-entropy {result['cross_entropy']:.4f} (perplexity {result['perplexity']:.2f}) over "
          f"{result['target_tokens']} target tokens of {result['documents']['documents']} documents on "
          f"{result['device']}",
          file=sys.stderr)
    return 0
