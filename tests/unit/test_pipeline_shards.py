"""Prepared shards, piece by piece: byte ranges, the stored row, the preparation against the stdin
path's own stages, what training refuses, and the bundle without LitData.

LitData is a test requirement here (CI installs it without torchvision, .ci/run): the preparation
and the reads go through it, never around it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from config import ConfigError
from pipeline import shards
from pipeline.packing import Row, collate_rows, pack_rows, shuffle_documents
from pipeline.records import StreamStats, encode_documents, read_records
from pipeline.tokenizer import TextEncoder
from tools.data import prepare as prepare_tool

from tests.helpers import ROOT, as_yaml, records, tiny

SEQ_LEN = 32
SEED = 11
SMALL_TOKENIZER = ROOT / "conf" / "tokenizer.json"


def config_file(tmp_path, **overrides) -> str:
    values = tiny({"seed": SEED, "model.vocab_size": 8192, "model.max_seq_len": SEQ_LEN,
                   "data.tokenizer": "conf/tokenizer.json", "data.shuffle_buffer_docs": 16, **overrides})
    path = tmp_path / "prepare.yaml"
    path.write_text(as_yaml(values))
    return str(path)


# ----------------------------------------------------------------------------- byte ranges


def test_byte_ranges_give_every_record_to_exactly_one_range(tmp_path):
    lines = [b'{"text": "%s"}\n' % (b"x" * n) for n in (0, 1, 5, 40, 3, 120, 7, 7, 300, 2)] + [b'{"text": "no newline"}']
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(lines))
    for range_bytes in (1, 7, 16, 50, 1000):
        seen = []
        for file_path, start, end, _ in prepare_tool.byte_ranges([str(path)], range_bytes):
            with open(file_path, "rb") as file:
                reader = prepare_tool.RangeReader(file, start, end)
                while line := reader.readline(1 << 20):
                    seen.append(line)
        assert seen == lines, range_bytes


def test_a_record_longer_than_the_limit_is_skipped_whole_inside_its_range(tmp_path):
    """The record reader reads an oversize record in bounded pieces; they must not stop at the range end."""
    lines = [b'{"text": "a"}\n', b'{"text": "%s"}\n' % (b"y" * 5000), b'{"text": "b"}\n']
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(lines))
    stats = StreamStats()
    texts = []
    for file_path, start, end, _ in prepare_tool.byte_ranges([str(path)], 64):
        with open(file_path, "rb") as file:
            texts += [d.text for d in read_records(prepare_tool.RangeReader(file, start, end), stats, 8192,
                                                   max_record_bytes=100, give_up_after=1000)]
    assert texts == ["a", "b"]
    assert stats.rejected == {"record_too_large": 1}


# ----------------------------------------------------------------------------- one row


def test_a_stored_row_reads_back_with_the_same_positions_and_targets():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, n).astype(np.int32) for n in (5, 40, 3, 1, 17, 60)]
    for row in pack_rows(docs, SEQ_LEN, StreamStats()):
        back = shards.item_row(shards.row_item(row), SEQ_LEN)
        assert np.array_equal(back.tokens, row.tokens)
        assert np.array_equal(back.positions, row.positions)
        assert np.array_equal(back.targets(), row.targets())


def test_a_row_of_another_length_is_refused():
    row = Row(np.arange(SEQ_LEN, dtype=np.int32), np.arange(SEQ_LEN, dtype=np.int32))
    with pytest.raises(shards.ShardsError, match=f"has {SEQ_LEN} tokens but model.max_seq_len is 64"):
        shards.item_row(shards.row_item(row), 64)


def test_group_collate_gives_the_microbatches_and_their_target_tokens():
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 100, n).astype(np.int32) for n in rng.integers(1, 50, 30)]
    rows = list(pack_rows(docs, SEQ_LEN, StreamStats()))[:6]
    group = shards.GroupCollate(SEQ_LEN, microbatch=2)([shards.row_item(r) for r in rows])
    expected = [collate_rows(rows[i : i + 2]) for i in (0, 2, 4)]
    assert len(group["microbatches"]) == 3
    for got, want in zip(group["microbatches"], expected):
        assert got["target_tokens"] == want["target_tokens"]
        for key in ("input_ids", "positions", "targets", "cu_seqlens"):
            assert np.array_equal(got[key].numpy(), want[key].numpy())
    assert group["target_tokens"] == sum(b["target_tokens"] for b in expected)



def test_each_microbatch_carries_the_totals_the_ranks_settled_for_its_update():
    """ShardUpdates asks once per update, with this rank's share, and hands every microbatch of the update what
    the ranks settled (runtime/update_agreement.py in training; a plain function here, no process group)."""
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 100, n).astype(np.int32) for n in rng.integers(1, 50, 40)]
    rows = list(pack_rows(docs, SEQ_LEN, StreamStats()))[:8]
    collate = shards.GroupCollate(SEQ_LEN, microbatch=2)
    groups = [collate([shards.row_item(r) for r in rows[i : i + 4]]) for i in (0, 4)]
    asked = []

    def settle(rank_tokens: int, rank_digest: int) -> tuple[int, int]:
        asked.append((rank_tokens, rank_digest))
        return 3 * rank_tokens, rank_digest + len(asked)  # as if two more ranks held as many tokens

    updates = shards.ShardUpdates(groups, accumulation=2, settle=settle)
    batches = list(updates)
    assert len(updates) == len(batches) == 4
    assert asked == [(group["target_tokens"], group["rows_digest"]) for group in groups]
    for i, batch in enumerate(batches):
        group = groups[i // 2]
        assert batch["update_target_tokens"] == 3 * group["target_tokens"]
        assert batch["update_digest"] == group["rows_digest"] + 1 + i // 2


# ----------------------------------------------------------------------------- preparation


@pytest.fixture
def corpus(tmp_path):
    """Sample text with bad lines among it, each rejected for a different reason."""
    good = records(120).splitlines(keepends=True)
    bad = [b"not json\n", b'{"text": ""}\n', b"[1, 2]\n", b'{"image": "abc"}\n', b'{"input_ids": [1, 99999]}\n']
    lines = good[:40] + bad + good[40:]
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"".join(lines))
    return path


def run_prepare(capsys, *argv) -> tuple[int, dict | str]:
    """The exit status, and the summary on stdout (or, on failure, stderr's last line)."""
    status = prepare_tool.main([str(a) for a in argv])
    captured = capsys.readouterr()
    if status == 0:
        return status, json.loads(captured.out.strip().splitlines()[-1])
    return status, captured.err.strip().splitlines()[-1]


def test_prepare_stores_the_rows_the_stdin_stages_pack(tmp_path, corpus, capsys):
    """One byte range: the rows are read_records -> encode_documents -> shuffle_documents -> pack_rows
    of the stdin path, with the same tokenizer, in order; the summary counts as the stdin path does."""
    output = tmp_path / "rows"
    status, summary = run_prepare(capsys, "--input", corpus, "--output", output, "--config", config_file(tmp_path),
                                  "--workers", 1)
    assert status == 0
    stats = StreamStats()
    encoder = TextEncoder(SMALL_TOKENIZER)
    with corpus.open("rb") as stream:
        docs = read_records(stream, stats, 8192, 1 << 20, give_up_after=1000)
        tokens = encode_documents(docs, encoder.encode_batch_arrays, encoder.eos_id, stats, 256, 8 << 20)
        shuffled = shuffle_documents((ids for _, ids in tokens), 16, 8 << 20, prepare_tool.range_seed(SEED, 0))
        expected = list(pack_rows(shuffled, SEQ_LEN, stats))
    assert summary["rejected"] == dict(stats.rejected) == {"invalid_json": 1, "empty_text": 1, "not_an_object": 1,
                                                           "no_text_or_input_ids": 1, "input_ids_out_of_range": 1}
    assert (summary["records"], summary["documents"], summary["document_tokens"], summary["rows"],
            summary["tail_tokens_dropped"]) == (stats.records, stats.documents, stats.document_tokens, stats.rows,
                                                stats.tail_tokens_dropped)
    import litdata

    stored = [shards.item_row(item, SEQ_LEN) for item in litdata.StreamingDataset(str(output))]
    assert len(stored) == len(expected) == summary["rows"]
    for got, want in zip(stored, expected):
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.positions, want.positions)
    meta = json.loads((output / shards.SHARDS_META).read_text())
    assert (meta["format"], meta["seq_len"], meta["summary"]) == (shards.FORMAT, SEQ_LEN, summary)


def test_prepare_in_parallel_ranges_keeps_every_document(tmp_path, corpus, capsys):
    status, summary = run_prepare(capsys, "--input", corpus, "--output", tmp_path / "rows", "--config",
                                  config_file(tmp_path), "--workers", 2, "--range-mib", 0.004)
    assert status == 0 and summary["ranges"] > 2
    assert summary["documents"] == 120 and sum(summary["rejected"].values()) == 5
    assert summary["rows"] * SEQ_LEN + summary["tail_tokens_dropped"] == summary["document_tokens"]


def test_every_rank_reads_as_many_rows_on_a_parallel_filesystem_too(tmp_path, corpus, capsys, monkeypatch):
    """LitData's layout for parallel filesystems would hand whole chunks to readers: with two chunks
    and eight ranks, six would get no row (and the run would stop there). The rows are split the
    same way on every filesystem instead."""
    from litdata.streaming import dataset as litdata_dataset
    from litdata.streaming.posix_fast import PosixFastProfile

    output = tmp_path / "rows"
    status, summary = run_prepare(capsys, "--input", corpus, "--output", output, "--config", config_file(tmp_path),
                                  "--workers", 2, "--range-mib", 0.004)
    assert status == 0 and len(json.loads((output / "index.json").read_text())["chunks"]) == 2
    monkeypatch.setattr(litdata_dataset, "detect_posix_fast", lambda *args, **kwargs: PosixFastProfile(kind="lustre"))
    lengths = []
    for rank in range(8):
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("GLOBAL_RANK", str(rank))
        lengths.append(len(shards.open_rows(str(output), SEED, rows_per_batch=4)))
    assert lengths == [summary["rows"] // 32] * 8


def test_prepare_refuses_an_output_that_holds_rows_and_input_with_nothing_usable(tmp_path, corpus, capsys):
    cfg = config_file(tmp_path)
    assert run_prepare(capsys, "--input", corpus, "--output", tmp_path / "rows", "--config", cfg, "--workers", 1)[0] == 0
    status, message = run_prepare(capsys, "--input", corpus, "--output", tmp_path / "rows", "--config", cfg)
    assert status == 2 and "already holds prepared rows" in message
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b'{"image": "x"}\n' * 10)
    status, message = run_prepare(capsys, "--input", junk, "--output", tmp_path / "junk", "--config", cfg, "--workers", 1)
    assert status == 2 and "no complete row of 32 tokens: 0 usable documents" in message
    assert not (tmp_path / "junk" / shards.SHARDS_META).exists()  # training refuses it
    status, message = run_prepare(capsys, "--input", tmp_path / "none*.jsonl", "--output", tmp_path / "x", "--config", cfg)
    assert status == 2 and "no file matches" in message


# ----------------------------------------------------------------------------- what training refuses


META = {"format": shards.FORMAT, "seq_len": SEQ_LEN, "tokenizer": "conf/tokenizer.json", "tokenizer_sha256": "a" * 64,
        "vocab_size": 8192}


@pytest.mark.parametrize("change, message", [
    ({"seq_len": 64}, "holds rows of 64 tokens but model.max_seq_len is 32"),
    ({"tokenizer_sha256": "b" * 64}, "was tokenized with conf/tokenizer.json"),
    ({"vocab_size": 50257}, "holds token ids up to 50256 but model.vocab_size is 8192"),
    ({"format": "other/1"}, "holds rows in format 'other/1'"),
])
def test_training_refuses_rows_prepared_for_another_model(change, message):
    with pytest.raises(shards.ShardsError, match=message):
        shards.check_meta({**META, **change}, "DIR", SEQ_LEN, "a" * 64, "conf/tokenizer.json", 8192)
    shards.check_meta(META, "DIR", SEQ_LEN, "a" * 64, "conf/tokenizer.json", 8192)


def test_a_folder_that_was_not_prepared_is_refused(tmp_path):
    with pytest.raises(shards.ShardsError, match="was not written by `python -m tools prepare`"):
        shards.read_meta(str(tmp_path))


# ----------------------------------------------------------------------------- the bundle without LitData


HIDE_LITDATA = textwrap.dedent("""
    import importlib.machinery, sys
    class Hidden(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] == "litdata":
                return None
            return importlib.machinery.PathFinder.find_spec(name, path, target)
    sys.meta_path[:] = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
""")


def test_the_bundle_imports_and_refuses_shards_in_one_line_without_litdata(tmp_path):
    """RunFab's bundle does not carry LitData: importing the training modules never needs it, and a run
    from shards says how to install it."""
    script = HIDE_LITDATA + textwrap.dedent(f"""
        import train, cli, pipeline.shards, runtime.shard_run
        assert "litdata" not in sys.modules
        sys.exit(cli.main(["--config", {config_file(tmp_path)!r}, "--data.source", "litdata", "--data.path",
                           {str(tmp_path)!r}], 32))
    """)
    (tmp_path / "runfab-shards.json").write_text(json.dumps({**META, "tokenizer_sha256": _sha(SMALL_TOKENIZER)}))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: data.source litdata and `python -m tools prepare` "
                                                            "need LitData, which is not importable")
    assert done.stdout == ""


def test_no_shipped_module_imports_litdata_at_its_top():
    import ast

    from runfab import shipping

    for rel in shipping.shipped_files(ROOT):
        if rel.endswith(".py"):
            for node in ast.parse((ROOT / rel).read_text()).body:
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] == "litdata" for n in names), rel


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- what stays on stdin


def test_stdin_runs_refuse_what_only_a_run_from_shards_can_do(tmp_path, capsys, monkeypatch):
    import cli
    import train

    config = config_file(tmp_path)
    assert cli.main(["--config", config, "--trainer.global_batch_size", "64"], 32) == 2
    assert "trainer.global_batch_size (64) sets the batch of a run from prepared shards" in capsys.readouterr().err
    assert cli.main(["--config", config, "--data.source", "litdata"], 32) == 2
    assert "set data.path to its --output" in capsys.readouterr().err
    monkeypatch.setenv("RUNFAB_CONFIG", config_file(tmp_path, **{"data.source": "litdata", "data.path": str(tmp_path)}))
    with pytest.raises(ConfigError, match="RunFab's train\\(\\) reads stdin"):
        train.train(4, 8)


def test_prepare_never_writes_into_a_folder_whose_bin_files_litdata_would_delete(tmp_path, corpus, capsys):
    output = tmp_path / "weights"
    output.mkdir()
    (output / "pytorch_model.bin").write_bytes(b"someone's weights")
    status, message = run_prepare(capsys, "--input", corpus, "--output", output, "--config", config_file(tmp_path),
                                  "--workers", 1)
    assert status == 2 and f"--output {output} holds pytorch_model.bin, and no preparation wrote it" in message
    assert (output / "pytorch_model.bin").read_bytes() == b"someone's weights"


# ----------------------------------------------------------------------------- the ids the rows hold


def test_training_refuses_rows_holding_ids_beyond_its_vocabulary_in_one_line(tmp_path, capsys):
    """Rows prepared for a vocabulary of 65,536 (ids up to 60,000) passed the tokenizer's check and
    failed at the first update with an IndexError; the largest id is recorded and refused up front."""
    import cli

    corpus = tmp_path / "ids.jsonl"
    corpus.write_text("".join(json.dumps({"input_ids": [(i * 7919 + j) % 60000 for j in range(40)] + [60000]}) + "\n"
                              for i in range(50)))
    output = tmp_path / "rows"
    status, summary = run_prepare(capsys, "--input", corpus, "--output", output, "--config", config_file(tmp_path),
                                  "--workers", 1, "--model.vocab_size", 65536)
    assert status == 0 and summary["max_token_id"] == 60000
    assert json.loads((output / shards.SHARDS_META).read_text())["max_token_id"] == 60000
    assert cli.main(["--config", config_file(tmp_path), "--data.source", "litdata", "--data.path", str(output)], 32) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {output} holds token ids up to 60000 but model.vocab_size is 8192; train with "
                           "--model.vocab_size 60001 or more")
    meta = json.loads((output / shards.SHARDS_META).read_text())
    shards.check_meta(meta, "DIR", SEQ_LEN, meta["tokenizer_sha256"], "conf/tokenizer.json", 60001)


@pytest.mark.parametrize("change, named", [
    ({"data_format": ["pickle", "no_header_numpy:2"]}, "data_format 'pickle'"),
    ({"compression": "zstd"}, "compression 'zstd'"),
    ({"encryption": "fernet"}, "encryption 'fernet'"),
    ({"item_loader": "TokensLoader"}, "item_loader 'TokensLoader'"),
    ({"data_spec": json.dumps([1, {"type": "os.system", "context": None, "children_spec": []}])},
     "data_spec type 'os.system'"),
])
def test_chunks_in_a_format_prepare_does_not_write_are_refused_before_litdata_reads_one(tmp_path, corpus, capsys,
                                                                                        change, named):
    """index.json (which a shared data.path lets anyone write) decides how LitData decodes a chunk; "pickle"
    would run code. Only what `tools prepare` writes is read."""
    output = tmp_path / "rows"
    assert run_prepare(capsys, "--input", corpus, "--output", output, "--config", config_file(tmp_path))[0] == 0
    shards.check_chunk_format(str(output))
    index = json.loads((output / "index.json").read_text())
    index["config"].update(change)
    (output / "index.json").write_text(json.dumps(index))
    for read in (shards.check_chunk_format, lambda path: shards.open_rows(path, SEED)):
        with pytest.raises(shards.ShardsError) as refused:
            read(str(output))
        assert named in str(refused.value) and "\n" not in str(refused.value)
        assert "does not write" in str(refused.value)
