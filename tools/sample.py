"""``python -m tools sample MODEL --prompt TEXT``: text from an exported model, through transformers.

The model and its tokenizer load with transformers' Auto classes, offline, as anyone would load
them (the config's model_type chooses the class: GPT-2 or Llama, the trainer's two families); ``generate`` continues the prompt greedily (``--temperature 0``, the default) or by sampling
with a temperature and top-k, from ``--seed``. stdout carries the text alone (the prompt and its
continuation, ``--continuation-only`` for the continuation); no progress, no warnings. On a GPU when
there is one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PROG = "python -m tools sample"


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
    inputs = tokenizer(prompt, return_tensors="pt").to(chosen)
    if inputs["input_ids"].shape[1] == 0:  # an empty prompt starts from the end of a document
        inputs = {"input_ids": torch.tensor([[tokenizer.eos_token_id]], device=chosen),
                  "attention_mask": torch.ones(1, 1, dtype=torch.long, device=chosen)}
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
        (args.temperature < 0, "--temperature must be >= 0"),
        (args.top_k is not None and args.top_k < 1, "--top-k must be at least 1")) if bad]
    if problems:
        print(f"{PROG}: {problems[0]}", file=sys.stderr)
        return 2
    text = sample(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, args.device)
    sys.stdout.write(text if args.continuation_only else args.prompt + text)
    sys.stdout.write("\n")
    return 0
