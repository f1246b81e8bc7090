"""`python -m tools tokenizer`: train a GPT-2-style byte-level BPE tokenizer.json (HF `tokenizers`) on NDJSON
documents; data.tokenizer names the one training uses, and pipeline/tokenizer.py encodes with it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.tokenizer import EOS_TOKEN, TextEncoder
from runfab import created_files


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: str | Path) -> None:
    """Train a GPT-2-style byte-level BPE on `texts` and save it as tokenizer.json.

    All 256 bytes are in the initial alphabet, so any string encodes without
    an unknown token; `<|endoftext|>` is the only special token (id 0) and
    serves as EOS between documents.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # created_files raises an OSError that names the problem; tokenizers' own save does not.
    created_files.write_text(path, tokenizer.to_str(pretty=True))


class CorpusError(ValueError):
    """A training corpus the tokenizer tool cannot use; the message names the file and line."""


def read_ndjson_texts(paths: Iterable[str | Path], field: str = "text") -> Iterator[str]:
    """The `field` of every non-blank line of the NDJSON files, in order."""
    for path in paths:
        try:
            lines = open(path, encoding="utf-8")
        except OSError as error:
            raise CorpusError(f"cannot read {path}: {error.strerror}") from None
        with lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise CorpusError(f"{path}:{number}: not a JSON record") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise CorpusError(f"{path}:{number}: no string field {field!r} (--field names another)")
                yield text


SMALLEST_VOCABULARY = 257  # the 256 bytes and <|endoftext|>


def main(argv: list[str] | None = None) -> int:
    """`python -m tools tokenizer`: train tokenizer.json from NDJSON documents."""
    parser = argparse.ArgumentParser(
        prog="python -m tools tokenizer", description="Train a byte-level BPE tokenizer."
    )
    parser.add_argument("--input", nargs="+", required=True, help="NDJSON files with a text field")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help=f"at most this many tokens (at least {SMALLEST_VOCABULARY}: the 256 bytes and EOS)")
    parser.add_argument("--output", type=Path, required=True,
                        help="the tokenizer.json to write (replaced only once the new one is complete); "
                             "data.tokenizer names the one training uses")
    parser.add_argument("--field", default="text", help="JSON field holding the document")
    args = parser.parse_args(argv)
    if args.vocab_size < SMALLEST_VOCABULARY:
        parser.error(f"--vocab-size must be at least {SMALLEST_VOCABULARY} (the 256 bytes and EOS), "
                     f"got {args.vocab_size}")
    if args.output.is_dir():
        parser.error(f"--output {args.output} is a folder; name the file, e.g. {args.output / 'tokenizer.json'}")

    documents = 0

    def counted_texts() -> Iterator[str]:
        nonlocal documents
        for text in read_ndjson_texts(args.input, args.field):
            documents += 1
            yield text

    staging = args.output.with_name(f".{args.output.name}.tmp")
    try:
        train_tokenizer(counted_texts(), args.vocab_size, staging)
        if not documents:
            raise CorpusError(f"no documents in {', '.join(args.input)}")
        staging.replace(args.output)
    except (CorpusError, OSError) as error:
        print(f"tokenizer: {error}; {args.output} was not written", file=sys.stderr)
        return 2
    finally:
        staging.unlink(missing_ok=True)
    encoder = TextEncoder(args.output)
    print(
        f"trained on {documents} documents: {args.output} "
        f"(vocab {encoder.vocab_size}, eos id {encoder.eos_id}, backend {encoder.backend})",
        file=sys.stderr,
    )
    if encoder.vocab_size < args.vocab_size:
        print(f"note: corpus only supports {encoder.vocab_size} tokens", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
