"""``python -m tools sample MODEL --prompt TEXT``: text from an exported model, through transformers.

The model and its tokenizer load with transformers' Auto classes, offline, as anyone would load
them (the config's model_type chooses the class: GPT-2 or Llama, the trainer's two families); ``generate`` continues the prompt greedily (``--temperature 0``, the default) or by sampling
with a temperature and top-k, from ``--seed``. stdout carries the text alone (the prompt and its
continuation, ``--continuation-only`` for the continuation); no progress, no warnings. On a GPU when
there is one.

The folder is checked first, as ``tools evaluate`` checks it (config.json against the weights' header,
nothing loaded). A model sees at most its positions (GPT-2's ``n_positions``, Llama's
``max_position_embeddings``): a longer prompt is cut to its last tokens for the model, and generation
stops when the positions are full; stderr says so.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

PROG = "python -m tools sample"
MIN_TEMPERATURE = 1e-3  # below it the scaled logits overflow float32: 0 is the greedy choice


def sample(folder: Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
           seed: int = 0, device: str = "auto") -> str:
    """The continuation of ``prompt``, decoded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    chosen = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).to(chosen).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:  # an empty prompt starts from the end of a document
        ids = torch.tensor([[tokenizer.eos_token_id]])
    positions = model.config.max_position_embeddings
    if ids.shape[1] >= positions:  # the model sees its last positions - 1 tokens and has room for one more
        print(f"{PROG}: the prompt is {ids.shape[1]} tokens, the model sees {positions} positions: it continues "
              f"from the prompt's last {positions - 1} tokens", file=sys.stderr)
        ids = ids[:, -(positions - 1):]
    if ids.shape[1] + max_new_tokens > positions:
        print(f"{PROG}: the model's {positions} positions hold {positions - ids.shape[1]} new tokens after the "
              f"prompt, not {max_new_tokens}: generation stops there", file=sys.stderr)
        max_new_tokens = positions - ids.shape[1]
    inputs = {"input_ids": ids.to(chosen), "attention_mask": torch.ones_like(ids).to(chosen)}
    torch.manual_seed(seed)
    options = {"do_sample": True, "temperature": temperature, "top_k": top_k or 0} if temperature > 0 else {
        "do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                **options)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Continue a prompt with an exported model (transformers); "
                                     "stdout carries the text only.")
    parser.add_argument("model", type=Path, metavar="MODEL", help="an exported model folder (a run's model/)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampling")
    parser.add_argument("--top-k", type=int, default=None, help="sampling: only the k most likely tokens")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument("--continuation-only", action="store_true", help="print the continuation without the prompt")
    parser.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu or cuda")
    args = parser.parse_args(argv)
    problems = [message for bad, message in (
        (not (args.model / "config.json").is_file() or not (args.model / "tokenizer.json").is_file(),
         f"{args.model} is not an exported model (no config.json or tokenizer.json)"),
        (args.max_new_tokens < 1, "--max-new-tokens must be at least 1"),
        (not math.isfinite(args.temperature) or args.temperature < 0 or 0 < args.temperature < MIN_TEMPERATURE,
         f"--temperature is 0 (greedy) or a finite number of at least {MIN_TEMPERATURE}, not {args.temperature}"),
        (args.top_k is not None and args.top_k < 1, "--top-k must be at least 1"),
        (args.device not in ("auto", "cpu", "cuda"), f"--device is auto, cpu or cuda, not {args.device!r}"),
        (not is_utf8(args.prompt), "--prompt is not valid UTF-8 text: give the prompt as UTF-8")) if bad]
    if not problems:
        import torch

        from tools.evaluate import NotThisModel, checked_export

        if args.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda, but no CUDA GPU is visible")
        try:
            checked_export(args.model)
        except NotThisModel as error:
            problems.append(" ".join(str(error).split()))
    if problems:
        print(f"{PROG}: {problems[0]}", file=sys.stderr)
        return 2
    text = sample(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, args.device)
    sys.stdout.write(text if args.continuation_only else args.prompt + text)
    sys.stdout.write("\n")
    return 0


def is_utf8(text: str) -> bool:
    """Whether ``text`` came from valid UTF-8: the command line hands over other bytes as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
