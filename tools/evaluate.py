"""``python -m tools evaluate MODEL --data FILE.jsonl``: the cross-entropy of an exported model on NDJSON
records, computed as training validates.

The records go through the trainer's own rules (pipeline/records.py: what is accepted, what is
rejected and why), the model's own tokenizer (MODEL/tokenizer.json, EOS after every document), are
packed into rows of the model's length as validation packs them, and are scored by the trainer's
decoder and loss (the export's weights loaded back into the trainer's model of its family, GPT-2 or Llama, a Llama
with model.qk_norm exported as Qwen3): the exact
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
import math
import sys
import warnings
from pathlib import Path

PROG = "python -m tools evaluate"


class NotThisModel(ValueError):
    """A folder this trainer's decoder cannot load; the message says why."""


CONFIG_BYTES = 1 << 20  # a config.json is a few kilobytes
FLOAT_DTYPES = {"F32", "F16", "BF16"}
LLAMA_TYPES = ("llama", "qwen3")  # the model_type of a Llama's export: qwen3 where it has model.qk_norm
MAX_POSITIONS = 1 << 17  # a Llama's positions are in no tensor: its rows' length is bounded here instead


def checked_export(folder: Path) -> dict:
    """``config.json``, once every value the model is built from agrees with the tensors' names and shapes in
    the weights file's header (read without loading a tensor). A model built from the config then holds no
    more than the file: a config that claims 100000 layers or a vocabulary of 10**12 is refused here, before
    anything is allocated. NotThisModel, one line, for what does not agree."""
    from safetensors import SafetensorError, safe_open

    from model.hf import WEIGHTS_NAME

    config_path, weights_path = folder / "config.json", folder / WEIGHTS_NAME
    try:
        if config_path.stat().st_size > CONFIG_BYTES:
            raise NotThisModel(f"{config_path} is over {CONFIG_BYTES} bytes: not the config.json of an export")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        with safe_open(str(weights_path), framework="pt") as weights:
            shapes = {name: (weights.get_slice(name).get_dtype(), weights.get_slice(name).get_shape())
                      for name in weights.keys()}
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, SafetensorError) as error:
        what = "nested too deeply" if isinstance(error, RecursionError) else " ".join(str(error).split())
        raise NotThisModel(f"{folder} is not an exported model: {config_path.name} or {WEIGHTS_NAME} cannot be read "
                           f"({what})") from None
    if not isinstance(config, dict):
        raise NotThisModel(f"{config_path} is not a JSON object")
    not_float = sorted(name for name, (dtype, _) in shapes.items() if dtype not in FLOAT_DTYPES)
    if not_float:
        raise NotThisModel(f"{weights_path}: tensor {not_float[0]} is {shapes[not_float[0]][0]}, expected floating "
                           f"point ({', '.join(sorted(FLOAT_DTYPES))}) as the export writes")
    llama = config.get("model_type") in LLAMA_TYPES
    expected = (expected_shapes_llama if llama else expected_shapes_gpt)(config, folder, len(shapes))
    for name, shape in expected.items():
        found = shapes.get(name, (None, None))[1]
        if found is None:
            raise NotThisModel(f"{weights_path} has no tensor {name}, which config.json implies; give the folder an "
                               "export wrote, its config.json unchanged")
        if list(found) != list(shape):
            raise NotThisModel(f"{weights_path}: tensor {name} has shape {list(found)}, config.json implies "
                               f"{list(shape)}; give the folder an export wrote, its config.json unchanged")
    return config


def config_int(config: dict, key: str, folder: Path, low: int = 1, high: int | None = None) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise NotThisModel(f"{folder}/config.json: {key} should be a whole number {bound}, found {value!r}")
    return value


def config_positive(config: dict, key: str, folder: Path, default: float | None = None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise NotThisModel(f"{folder}/config.json: {key} should be a finite number above 0, found {value!r}")
    return value


def layer_count(config: dict, key: str, folder: Path, tensors: int) -> int:
    """``config[key]``, at most the file's tensor count (each layer has several): checked before the layers'
    expected names are listed, so nothing grows with an absurd value."""
    return config_int(config, key, folder, high=tensors)


def expected_shapes_gpt(config: dict, folder: Path, tensors: int) -> dict[str, tuple]:
    vocab, width = config_int(config, "vocab_size", folder), config_int(config, "n_embd", folder)
    heads, positions = config_int(config, "n_head", folder), config_int(config, "n_positions", folder, low=2)
    config_positive(config, "layer_norm_epsilon", folder)
    if width % heads:
        raise NotThisModel(f"{folder}/config.json: n_embd {width} is not a multiple of n_head {heads}")
    shapes = {"transformer.wte.weight": (vocab, width), "transformer.wpe.weight": (positions, width),
              "transformer.ln_f.weight": (width,)}
    for i in range(layer_count(config, "n_layer", folder, tensors)):
        shapes[f"transformer.h.{i}.attn.c_attn.weight"] = (width, 3 * width)
        shapes[f"transformer.h.{i}.mlp.c_fc.weight"] = (width, 4 * width)
    return shapes


def expected_shapes_llama(config: dict, folder: Path, tensors: int) -> dict[str, tuple]:
    vocab, width = config_int(config, "vocab_size", folder), config_int(config, "hidden_size", folder)
    heads = config_int(config, "num_attention_heads", folder)
    kv_heads = config_int(config, "num_key_value_heads", folder) if "num_key_value_heads" in config else heads
    inner = config_int(config, "intermediate_size", folder)
    config_int(config, "max_position_embeddings", folder, low=2, high=MAX_POSITIONS)
    config_positive(config, "rms_norm_eps", folder)
    rope = config.get("rope_parameters")
    for where in (rope if isinstance(rope, dict) else {}, config):  # the one transformers reads, and the older key
        if "rope_theta" in where:
            config_positive(where, "rope_theta", folder)
    if width % heads or heads % kv_heads:
        raise NotThisModel(f"{folder}/config.json: hidden_size {width}, num_attention_heads {heads} and "
                           f"num_key_value_heads {kv_heads} do not divide as a Llama's must")
    head_dim = width // heads
    shapes = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,)}
    for i in range(layer_count(config, "num_hidden_layers", folder, tensors)):
        prefix = f"model.layers.{i}."
        shapes |= {prefix + "self_attn.q_proj.weight": (width, width),
                   prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, width),
                   prefix + "mlp.gate_proj.weight": (inner, width)}
        if config.get("model_type") == "qwen3":
            shapes |= {prefix + "self_attn.q_norm.weight": (head_dim,), prefix + "self_attn.k_norm.weight": (head_dim,)}
    return shapes


def load_model(folder: Path):
    """The exported folder as this trainer's decoder of its family (config.json's model_type: gpt2, llama, or qwen3
    for a Llama with qk_norm)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from model.hf import WEIGHTS_NAME

    config = checked_export(folder)
    try:
        weights = load_file(str(folder / WEIGHTS_NAME))
    except (OSError, SafetensorError) as error:
        raise NotThisModel(f"{folder} is not an exported model ({error})") from None
    if config.get("model_type") in LLAMA_TYPES:
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
        raise NotThisModel(f"{folder} has weights this trainer's GPT-2 model does not hold as they are "
                           f"({error})") from None
    return model_holding_exactly(folder, model, hf.to_hf(model), weights, ignored={"lm_head.weight"})


def load_llama(folder: Path, config: dict, weights: dict):
    """The exported Llama folder (a Qwen3 one: with qk_norm) as this trainer's Llama: model.hf's table read
    backwards."""
    from model import hf
    from model.decoder import ModelConfig
    from model.families import build_model

    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    heads, width = config["num_attention_heads"], config["hidden_size"]
    unlike = [what for what, differs in (
        (f"activation {config.get('hidden_act')}", config.get("hidden_act") != "silu"),
        ("biases", config.get("attention_bias") or config.get("mlp_bias")),
        (f"rotary scaling {rope.get('rope_type')}", rope.get("rope_type", "default") != "default"),
        (f"head dimension {config.get('head_dim')}", config.get("head_dim", width // heads) * heads != width),
        ("sliding-window attention", config.get("use_sliding_window")))
        if differs]
    if unlike:
        raise NotThisModel(f"{folder} holds a Llama with {', '.join(unlike)}; this scores models this trainer "
                           "exported (silu, no biases, default rotary positions, hidden_size = heads x head_dim)")
    model = build_model(ModelConfig(
        family="llama", vocab_size=config["vocab_size"], n_layer=config["num_hidden_layers"], n_head=heads,
        n_kv_head=config.get("num_key_value_heads") or heads, n_embd=width,
        max_seq_len=config["max_position_embeddings"], intermediate_size=config["intermediate_size"],
        layer_norm_eps=config["rms_norm_eps"], rope_theta=rope["rope_theta"],
        tie_embeddings=config.get("tie_word_embeddings", False), qk_norm=config.get("model_type") == "qwen3"))
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
    from scoring import cross_entropy
    from model.kernels import Target
    from pipeline.records import StreamStats, file_documents
    from pipeline.tokenizer import TextEncoder
    from runfab.limits import RECORD_BYTES

    model = load_model(folder)
    chosen = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                          "cpu" if device == "auto" else device)
    model.to(chosen)
    model.use_target(Target(chosen, torch.bfloat16 if chosen.type == "cuda" else torch.float32))  # as it runs below
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
    if not math.isfinite(result["cross_entropy"]):
        print(f"{PROG}: the cross-entropy of {args.model} is {result['cross_entropy']}: its weights give no finite "
              "loss (a NaN or infinite weight); nothing to report", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    print(f"{PROG}: cross-entropy {result['cross_entropy']:.4f} (perplexity {result['perplexity']:.2f}) over "
          f"{result['target_tokens']} target tokens of {result['documents']['documents']} documents on "
          f"{result['device']}",
          file=sys.stderr)
    return 0
