"""The tools that build the bundled data: GPT-2's tokenizer.json from OpenAI's files, and the sample."""

from __future__ import annotations

import hashlib
import json

from tests.gpt2_reference import ENCODER_JSON, VOCAB_BPE, read_fixture
from tools.__main__ import main as tools

from tests.helpers import ROOT

GPT2 = ROOT / "conf" / "gpt2"


def gpt2_files(folder):
    for name, fixture in (("encoder.json", ENCODER_JSON), ("vocab.bpe", VOCAB_BPE)):
        (folder / name).write_bytes(read_fixture(fixture))
    return str(folder / "encoder.json"), str(folder / "vocab.bpe")


def test_gpt2_tokenizer_rebuilds_the_bundled_file_and_its_record(tmp_path):
    out = tmp_path / "gpt2" / "tokenizer.json"
    assert tools(["gpt2-tokenizer", *gpt2_files(tmp_path), "--output", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == json.loads((GPT2 / "tokenizer.json").read_text(encoding="utf-8"))
    written, shipped = (json.loads((folder / "SOURCE.json").read_text()) for folder in (out.parent, GPT2))
    assert {k: written[k] for k in ("source", "built_by")} == {k: shipped[k] for k in ("source", "built_by")}
    assert written["sha256"]["encoder.json"] == shipped["sha256"]["encoder.json"]
    assert written["built_by"] == "python -m tools gpt2-tokenizer"  # how to run it again


def test_gpt2_tokenizer_refuses_other_files(tmp_path, capsys):
    encoder_json, vocab_bpe = gpt2_files(tmp_path)
    with open(encoder_json, "rb") as f:
        altered = f.read().replace(b'"!": 0', b'"!": 1')
    with open(encoder_json, "wb") as f:
        f.write(altered)
    out = tmp_path / "tokenizer.json"
    assert tools(["gpt2-tokenizer", encoder_json, vocab_bpe, "--output", str(out)]) == 1
    assert "encoder.json differ" in capsys.readouterr().err and not out.exists()
    assert hashlib.sha256(altered).hexdigest() not in (GPT2 / "SOURCE.json").read_text()


def test_sample_data_writes_unique_prose_records(tmp_path):
    out = tmp_path / "sample.jsonl"
    assert tools(["sample-data", "--output", str(out), "--min-chars", "2000"]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(records) > 50
    assert all(set(record) == {"source", "text"} and len(record["text"]) >= 2000 for record in records)
    assert len({record["text"] for record in records}) == len(records)
