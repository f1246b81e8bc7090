"""Tests for tokenizer.py: the tiktoken fast path must be a drop-in for HF tokenizers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline import tokenizer
from pipeline.tokenizer import EOS_TOKEN, TextEncoder
from tools.data import train_tokenizer as tokenizer_tool  # trains the tokenizers these tests encode with
from tools.data.train_tokenizer import read_ndjson_texts, train_tokenizer

from tests.helpers import ROOT, tiktoken_encoder

SAMPLE = ROOT / "data" / "sample.jsonl"
SHIPPED_TOKENIZER = ROOT / "conf" / "tokenizer.json"

ADVERSARIAL = [
    "",
    " ",
    "a",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs\n\n\nnewlines",
    "windows\r\nline\r\nendings\r\n",
    " " * 37 + "x" + "\t \n" * 9,
    "\n",
    "\u00a0non-breaking\u2009thin\u3000ideographic\u2028line-sep\u0085nel",
    "digits 0123456789 3.14159 1e-10 -42 1,000,000 ١٢٣ ४५६",
    "naïve café façade Ærøskøbing Straße ПРИВЕТ мир Ελληνικά",
    "中文分词测试，日本語のテキスト、한국어 문장입니다.",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇩🇪 keycap 1️⃣",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "combining e\u0301 a\u0308 and \U0001d54f math \U0010ffff",
    "\x00\x01\x7f control bytes",
    EOS_TOKEN,
    f"before{EOS_TOKEN}after {EOS_TOKEN} <|endoftext|>>",
    "<|endoftext",
    "don't can't we're they've I'm you'll he'd 'S 'LL",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "\"quoted\" `backticks` <html>&amp;</html> ~~~ ==== ----",
]

TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "the lazy dog sleeps; the quick fox runs",
    "tokenizers turn text into tokens, tokens into ids",
] * 20


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    return list(read_ndjson_texts([SAMPLE]))


@pytest.fixture(scope="module")
def plain_encoder() -> TextEncoder:
    encoder = TextEncoder(SHIPPED_TOKENIZER, prefer_fast=False)
    assert encoder.backend == "tokenizers"
    return encoder


@pytest.fixture(scope="module")
def fast_encoder() -> TextEncoder:
    return tiktoken_encoder(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tokenizer.json"
    train_tokenizer(TINY_CORPUS, vocab_size=300, path=path)
    return path


def test_sample_is_a_few_thousand_real_documents(sample_texts):
    assert 1000 <= len(sample_texts) <= 20000
    assert 1e6 <= SAMPLE.stat().st_size <= 4.5e6
    assert len(set(sample_texts)) == len(sample_texts)
    assert all(text.strip() for text in sample_texts)


def test_shipped_tokenizer_shape(plain_encoder):
    assert plain_encoder.vocab_size == 8192
    assert plain_encoder.eos_id == 0


def test_backends_agree_on_every_sample_document(fast_encoder, plain_encoder, sample_texts):
    fast_ids = fast_encoder.encode_batch(sample_texts)
    plain_ids = plain_encoder.encode_batch(sample_texts)
    assert len(fast_ids) == len(sample_texts)
    mismatched = [i for i, (a, b) in enumerate(zip(fast_ids, plain_ids)) if a != b]
    assert not mismatched, f"{len(mismatched)} documents differ, first: {sample_texts[mismatched[0]][:80]!r}"
    # Real merges are used: English prose compresses well below one token per 3 bytes.
    total_bytes = sum(len(text.encode("utf-8")) for text in sample_texts)
    assert sum(map(len, fast_ids)) < total_bytes / 3


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_backends_agree_on_adversarial_text(fast_encoder, plain_encoder, text):
    [fast_ids] = fast_encoder.encode_batch([text])
    [plain_ids] = plain_encoder.encode_batch([text])
    assert fast_ids == plain_ids
    assert all(0 <= i < plain_encoder.vocab_size for i in fast_ids)
    assert (text == "") == (fast_ids == [])


def test_backends_agree_on_every_vocabulary_entry(fast_encoder, plain_encoder):
    """Each token's own text, alone and glued to neighbours, exercises every merge path."""
    pieces = [plain_encoder.decode([i]) for i in range(plain_encoder.vocab_size) if i != plain_encoder.eos_id]
    glued = ["".join(pieces[i : i + 7]) for i in range(0, len(pieces), 7)]
    assert fast_encoder.encode_batch(pieces) == plain_encoder.encode_batch(pieces)
    assert fast_encoder.encode_batch(glued) == plain_encoder.encode_batch(glued)


def test_the_array_path_training_uses_gives_the_same_ids(fast_encoder, plain_encoder, sample_texts):
    """encode_batch_arrays (tiktoken writing into arrays) against the HF list path, on the sample and
    adversarial text, a literal EOS included."""
    texts = ADVERSARIAL + sample_texts + [f"end{EOS_TOKEN}start"]
    expected = plain_encoder.encode_batch(texts)
    for encoder in (fast_encoder, plain_encoder):
        arrays = encoder.encode_batch_arrays(texts)
        assert all(a.dtype == np.int32 for a in arrays)
        assert [a.tolist() for a in arrays] == expected


@pytest.mark.parametrize("path", [SHIPPED_TOKENIZER, ROOT / "conf" / "gpt2" / "tokenizer.json"])
def test_text_tiktoken_gives_up_on_still_encodes_to_the_plain_backends_ids(path):
    """A record holding a run of about a million spaces (under RunFab's 1 MiB) exceeds tiktoken's backtracking
    regex; the encoder falls back to HF tokenizers, which encodes it promptly to the same ids."""
    fast, plain = tiktoken_encoder(path), TextEncoder(path, prefer_fast=False)
    spaces = "start" + " " * 1_000_500 + "end"
    texts = ["before", spaces, "after " + spaces[:1000] + "x"]
    expected = plain.encode_batch(texts)
    assert [a.tolist() for a in fast.encode_batch_arrays(texts)] == expected
    assert fast.encode_batch(texts) == expected
    assert [a.tolist() for a in plain.encode_batch_arrays(texts)] == expected  # the plain backend neither fails nor hangs
    assert fast.decode(expected[1]) == spaces


@pytest.mark.parametrize("backend", ["fast", "plain"])
def test_roundtrip(backend, request, sample_texts):
    encoder = request.getfixturevalue(f"{backend}_encoder")
    texts = ADVERSARIAL + sample_texts[::10]
    for text, ids in zip(texts, encoder.encode_batch(texts)):
        assert encoder.decode(ids) == text


@pytest.mark.parametrize("backend", ["fast", "plain"])
def test_literal_eos_text_is_not_the_eos_token(backend, request):
    encoder = request.getfixturevalue(f"{backend}_encoder")
    [ids] = encoder.encode_batch([f"end{EOS_TOKEN}start"])
    assert encoder.eos_id not in ids
    assert len(ids) > 3
    assert encoder.decode([encoder.eos_id]) == EOS_TOKEN


def test_eos_is_the_special_token():
    config = json.loads(SHIPPED_TOKENIZER.read_text(encoding="utf-8"))
    specials = {t["content"]: t["id"] for t in config["added_tokens"] if t["special"]}
    assert specials == {EOS_TOKEN: TextEncoder(SHIPPED_TOKENIZER, prefer_fast=False).eos_id}


def test_train_tiny_tokenizer(tiny_tokenizer):
    encoder = TextEncoder(tiny_tokenizer, prefer_fast=False)
    assert 257 < encoder.vocab_size <= 300  # 256 bytes + EOS + learned merges
    assert encoder.eos_id == 0
    [ids] = encoder.encode_batch(["the quick brown fox"])
    assert len(ids) < len("the quick brown fox")  # merges were learned
    unseen = "Unseen ✓ 漢字 😀"  # every byte is in the alphabet, so nothing is lost
    assert encoder.decode(encoder.encode_batch([unseen])[0]) == unseen


def test_tiny_tokenizer_backends_agree(tiny_tokenizer):
    pytest.importorskip("tiktoken")
    fast = TextEncoder(tiny_tokenizer)
    plain = TextEncoder(tiny_tokenizer, prefer_fast=False)
    assert fast.backend == "tiktoken"
    texts = TINY_CORPUS[:3] + ADVERSARIAL
    assert fast.encode_batch(texts) == plain.encode_batch(texts)


def _mutate(config: dict, change: str) -> dict:
    if change == "normalizer":
        config["normalizer"] = {"type": "NFKC"}
    elif change == "whitespace_pre_tokenizer":
        config["pre_tokenizer"] = {"type": "Whitespace"}
    elif change == "prefix_space":
        config["pre_tokenizer"]["add_prefix_space"] = True
    elif change == "swapped_merges":
        merges = config["model"]["merges"]
        merges[-1], merges[-2] = merges[-2], merges[-1]
    elif change == "non_special_added_token":
        config["added_tokens"][0]["special"] = False
    return config


@pytest.mark.parametrize(
    "change",
    ["normalizer", "whitespace_pre_tokenizer", "prefix_space", "swapped_merges", "non_special_added_token"],
)
def test_non_plain_byte_level_falls_back(tiny_tokenizer, tmp_path, change):
    pytest.importorskip("tiktoken")
    config = _mutate(json.loads(tiny_tokenizer.read_text(encoding="utf-8")), change)
    with pytest.raises(ValueError, match="not a plain byte-level BPE"):
        tokenizer.tiktoken_tables(config)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="not a plain byte-level BPE"):
        encoder = TextEncoder(path)
    assert encoder.backend == "tokenizers"
    assert encoder.encode_batch(["still encodes"])[0]


def test_without_tiktoken_uses_plain_backend(tiny_tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    assert TextEncoder(tiny_tokenizer).backend == "tokenizers"


def test_cli_trains_from_ndjson(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TINY_CORPUS)))
    output = tmp_path / "out" / "tokenizer.json"
    assert tokenizer_tool.main(["--input", str(corpus), "--vocab-size", "280", "--output", str(output)]) == 0
    assert TextEncoder(output, prefer_fast=False).vocab_size == 280
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "60 documents" in captured.err


@pytest.mark.parametrize("corpus, says", [
    ('{"text": "a document"}\n{"id": 3}\n', "corpus.jsonl:2: no string field 'text'"),
    ('{"text": "a document"}\nnot json\n', "corpus.jsonl:2: not a JSON record"),
    ("", "no documents in"),
    (None, "cannot read"),
])
def test_cli_refuses_an_unusable_corpus_in_one_line_and_keeps_the_old_tokenizer(tmp_path, capsys, corpus, says):
    path = tmp_path / "corpus.jsonl"
    if corpus is not None:
        path.write_text(corpus)
    output = tmp_path / "tokenizer.json"
    output.write_text("the tokenizer in use")
    assert tokenizer_tool.main(["--input", str(path), "--vocab-size", "280", "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "was not written" in err
    assert output.read_text() == "the tokenizer in use"
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"tokenizer.json", "corpus.jsonl"} - (set() if corpus is not None else {"corpus.jsonl"})  # no staging file


@pytest.mark.parametrize("argv, says", [
    (["--vocab-size", "10", "--output", "t.json"], "--vocab-size must be at least 257"),
    (["--vocab-size", "300"], "required: --output"),  # no default: it replaced the bundled conf/tokenizer.json
])
def test_cli_refuses_a_vocabulary_below_the_bytes_and_a_missing_output(capsys, argv, says):
    with pytest.raises(SystemExit) as exit:
        tokenizer_tool.main(["--input", str(SAMPLE), *argv])
    assert exit.value.code == 2 and says in capsys.readouterr().err
