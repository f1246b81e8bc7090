"""The tools that build the bundled data: GPT-2's tokenizer.json from OpenAI's files, the sample, and
``prepare``'s output folder: what it writes into, what it removes, and how it stops."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.gpt2_reference import ENCODER_JSON, VOCAB_BPE, read_fixture
from tools.__main__ import main as tools

from tests.helpers import ROOT, as_yaml, records, tiny

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


# ----------------------------------------------------------------------------- prepare's output folder


def prepare(tmp_path, output, *extra, corpus=None) -> subprocess.CompletedProcess:
    if corpus is None:
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_bytes(records(120))
    config = tmp_path / "prepare.yaml"
    config.write_text(as_yaml(tiny({"model.max_seq_len": 32, "data.tokenizer": "conf/tokenizer.json"})))
    return subprocess.run([sys.executable, "-m", "tools", "prepare", "--input", str(corpus), "--output", str(output),
                           "--config", str(config), "--workers", "1", *map(str, extra)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def tree(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_prepare_never_writes_into_a_folder_it_did_not_write(tmp_path):
    """LitData empties a folder of *index.json, *.bin and .checkpoints/ before writing: a folder that holds
    anything and carries no preparation's mark is refused, with or without --overwrite, and left as it was."""
    output = tmp_path / "mine"
    (output / ".checkpoints").mkdir(parents=True)
    for name in ("model.safetensors.index.json", "search-index.json", "chunk-0-7.bin", ".checkpoints/important.txt"):
        (output / name).write_text(f"the user's {name}")
    before = tree(output)
    for extra in ((), ("--overwrite",)):
        done = prepare(tmp_path, output, *extra)
        assert done.returncode == 2
        assert one_line(done).startswith(f"python -m tools prepare: --output {output} holds .checkpoints, "
                                         "chunk-0-7.bin, model.safetensors.index.json, ... (4 in all), and no "
                                         "preparation wrote it")
        assert tree(output) == before


def test_overwrite_replaces_only_what_a_preparation_wrote(tmp_path):
    output = tmp_path / "rows"
    assert prepare(tmp_path, output).returncode == 0
    first = tree(output)
    assert ".prepare-output" in first and "index.json" in first and "runfab-shards.json" in first
    done = prepare(tmp_path, output)
    assert done.returncode == 2 and "already holds prepared rows (index.json, runfab-shards.json)" in one_line(done)
    (output / "notes.txt").write_text("mine")
    done = prepare(tmp_path, output, "--overwrite")
    assert done.returncode == 2
    assert one_line(done).startswith(f"python -m tools prepare: --output {output} holds notes.txt, which no "
                                     "preparation wrote")
    assert tree(output) == {**first, "notes.txt": b"mine"}
    (output / "notes.txt").unlink()
    assert prepare(tmp_path, output, "--overwrite").returncode == 0
    assert tree(output).keys() == first.keys()


@pytest.mark.parametrize("where, what", [("/usr", ("a system folder",)),
                                         ("~", ("the home folder itself", "a system folder"))])  # root's: /root
def test_prepare_refuses_system_and_home_folders(tmp_path, where, what):
    done = prepare(tmp_path, os.path.expanduser(where))
    assert done.returncode == 2 and any(f"is {w}; give a folder of its own" in one_line(done) for w in what)


def test_a_refused_input_leaves_nothing_that_blocks_the_next_preparation(tmp_path):
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b'{"image": "x"}\n' * 10)
    output = tmp_path / "rows"
    done = prepare(tmp_path, output, corpus=junk)
    assert done.returncode == 2 and "no complete row of 32 tokens" in one_line(done)
    assert not output.exists()
    output.mkdir()  # a folder of the user's, empty: it stays, empty
    assert prepare(tmp_path, output, corpus=junk).returncode == 2
    assert output.is_dir() and not any(output.iterdir())
    assert prepare(tmp_path, output).returncode == 0


# ----------------------------------------------------------------------------- stopping prepare


@pytest.fixture(scope="module")
def large_corpus(tmp_path_factory):
    """About 85 MB of text: LitData's workers take several seconds over it."""
    path = tmp_path_factory.mktemp("corpus") / "large.jsonl"
    sample = (ROOT / "data" / "sample.jsonl").read_bytes()
    with path.open("wb") as out:
        for _ in range(40):
            out.write(sample)
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("to_group", [False, True], ids=["process", "group"])
def test_a_stopped_prepare_ends_promptly_non_zero_and_leaves_nothing(tmp_path, large_corpus, sig, to_group):
    """SIGTERM or SIGINT to prepare, or to its whole process group (a terminal's Ctrl-C), while LitData's
    workers run: every process ends within 10 s, the status says it was stopped, one line says so, and the
    output folder it created is gone."""
    output = tmp_path / "rows"
    config = tmp_path / "prepare.yaml"
    config.write_text(as_yaml(tiny({"data.tokenizer": "conf/tokenizer.json"})))
    process = subprocess.Popen([sys.executable, "-m", "tools", "prepare", "--input", str(large_corpus), "--output",
                                str(output), "--config", str(config), "--workers", "2", "--range-mib", "1"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in process.stderr:
            lines.append(line)
            if "Starting data processing" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(lines)
        time.sleep(0.5)  # the workers are tokenizing
        family = psutil.Process(process.pid).children(recursive=True)
        assert len(family) >= 3  # LitData's process and its two workers
        sent = time.monotonic()
        (os.killpg if to_group else os.kill)(process.pid, sig)
        status = process.wait(timeout=10)
        gone, alive = psutil.wait_procs(family, timeout=max(0.1, 10 - (time.monotonic() - sent)))
        assert not alive, alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    reader.join(5)
    assert status == 128 + sig, "".join(lines)
    last = lines[-1].strip()
    assert last == (f"python -m tools prepare: stopped by {signal.Signals(sig).name}: its worker processes were "
                    f"ended and what it had written to {output} was removed"), "".join(lines)
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), "".join(lines)
    assert not output.exists()
