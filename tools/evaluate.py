"""``python -m tools evaluate MODEL --data FILE.jsonl``: the cross-entropy of an exported model on NDJSON
records, computed as training validates.

The records go through the trainer's own rules (pipeline/records.py: what is accepted, what is
rejected and why), the model's own tokenizer (MODEL/tokenizer.json, EOS after every document), are
packed into rows of the model's length as validation packs them, and are scored by the trainer's
decoder and loss (the export's weights loaded back into the trainer's model of its family, GPT-2 or Llama): the exact
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


class NotThisModel(ValueError):
    """A folder this trainer's decoder cannot load; the message says why."""


def load_model(folder: Path):
    """The exported folder as this trainer's decoder of its family (config.json's model_type: gpt2 or llama)."""
    from safetensors.torch import load_file

    from callbacks.export import WEIGHTS_NAME

    try:
        config = json.loads((folder / "config.json").read_text())
        weights = load_file(str(folder / WEIGHTS_NAME))
    except (OSError, ValueError) as error:
        raise NotThisModel(f"{folder} is not an exported model ({error})") from None
    if config.get("model_type") == "llama":
        return load_llama(folder, config, weights)
    return load_gpt(folder, config, weights)


def load_gpt(folder: Path, config: dict, weights: dict):
    """The exported GPT-2 folder as this trainer's GPT: model.hf's table read backwards."""
    from model import hf
    from model.decoder import ModelConfig
    from model.families import build_model

    if config.get("model_type") != "gpt2" or config.get("activation_function") != "gelu":
        raise NotThisModel(f"{folder} holds a {config.get('model_type')} model with activation "
                           f"{config.get('activation_function')}; this scores models this trainer exported "
                           "(GPT-2 with gelu, or Llama)")
    model = build_model(ModelConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"], n_head=config["n_head"],
                                    n_embd=config["n_embd"], max_seq_len=config["n_positions"],
                                    layer_norm_eps=config["layer_norm_epsilon"]))
    try:
        hf.load_hf(model, weights)
    except (KeyError, RuntimeError) as error:  # a missing tensor, or one of another shape
        raise NotThisModel(f"{folder} has weights this trainer's GPT does not hold as they are ({error})") from None
    return model_holding_exactly(folder, model, hf.to_hf(model), weights, ignored={"lm_head.weight"})


def load_llama(folder: Path, config: dict, weights: dict):
    """The exported Llama folder as this trainer's Llama: model.hf's table read backwards."""
    from model import hf
    from model.decoder import ModelConfig
    from model.families import build_model

    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    heads, width = config["num_attention_heads"], config["hidden_size"]
    unlike = [what for what, differs in (
        (f"activation {config.get('hidden_act')}", config.get("hidden_act") != "silu"),
        ("biases", config.get("attention_bias") or config.get("mlp_bias")),
        (f"rotary scaling {rope.get('rope_type')}", rope.get("rope_type", "default") != "default"),
        (f"head dimension {config.get('head_dim')}", config.get("head_dim", width // heads) * heads != width))
        if differs]
    if unlike:
        raise NotThisModel(f"{folder} holds a Llama with {', '.join(unlike)}; this scores models this trainer "
                           "exported (silu, no biases, default rotary positions, hidden_size = heads x head_dim)")
    model = build_model(ModelConfig(
        family="llama", vocab_size=config["vocab_size"], n_layer=config["num_hidden_layers"], n_head=heads,
        n_kv_head=config.get("num_key_value_heads") or heads, n_embd=width,
        max_seq_len=config["max_position_embeddings"], intermediate_size=config["intermediate_size"],
        layer_norm_eps=config["rms_norm_eps"], rope_theta=rope["rope_theta"],
        tie_embeddings=config.get("tie_word_embeddings", False)))
    try:
        hf.load_hf(model, weights)
    except (KeyError, RuntimeError) as error:  # a missing tensor, or one of another shape
        raise NotThisModel(f"{folder} has weights this trainer's Llama does not hold as they are ({error})") from None
    return model_holding_exactly(folder, model, hf.to_hf(model), weights, ignored=set())


def model_holding_exactly(folder: Path, model, expected: dict, weights: dict, ignored: set):
    """``model`` when exporting it again gives exactly the folder's tensors (less ``ignored``), else NotThisModel."""
    import torch

    if expected.keys() != {k for k in weights if k not in ignored} or any(
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

    model = load_model(folder)
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
