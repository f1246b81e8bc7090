"""pipeline/records.py: reading NDJSON records, what is rejected and why, refusing unusable input, encoding."""

from __future__ import annotations

import io
import json
import time

import pytest

from pipeline.data_section import DataConfig
from pipeline.records import StreamStats, UnusableInputError, encode_documents, parse_record, read_records
from tests.pipeline_helpers import VOCAB, fake_encode, ndjson


def reader(data: bytes, max_bytes: int = 1 << 20, give_up_after: int = DataConfig.give_up_after) -> tuple[list, StreamStats]:
    stats = StreamStats(source="test")
    docs = list(read_records(io.BytesIO(data), stats, VOCAB, max_bytes, give_up_after))
    return docs, stats


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe{}", "invalid_utf8"),
        (b'{"text": "a\\ud800b"}', "invalid_utf8"),
        (b"[1, 2, 3]", "not_an_object"),
        (b'{"id": 7}', "no_text_or_input_ids"),
        (b'{"text": 5}', "text_not_a_string"),
        (b'{"text": "  \\n "}', "empty_text"),
        (b'{"input_ids": "1 2"}', "input_ids_not_int_list"),
        (b'{"input_ids": [1, 2.5]}', "input_ids_not_int_list"),
        (b'{"input_ids": [1, true]}', "input_ids_not_int_list"),
        (b'{"input_ids": []}', "empty_input_ids"),
        (b'{"input_ids": [1, 1000]}', "input_ids_out_of_range"),
        (b'{"input_ids": [-1]}', "input_ids_out_of_range"),
        (b'{"text": "ok", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested_too_deeply"),
    ],
)
def test_each_bad_record_is_rejected_with_its_reason(line, reason):
    assert parse_record(line, VOCAB) == reason


def test_good_records_keep_text_or_ids_and_ignore_other_fields():
    text = parse_record(b'{"text": "hello", "id": 3, "split": "train"}', VOCAB)
    ids = parse_record(b'{"input_ids": [0, 999], "text_len": 2}', VOCAB)
    assert text.text == "hello" and text.ids is None
    assert ids.ids.tolist() == [0, 999] and ids.text is None


def test_rejects_are_counted_by_reason_and_good_records_survive():
    big = json.dumps({"text": "x" * (2 << 20)}).encode()
    data = ndjson({"text": "one"}, b"{oops", {"image_b64": "AAAA"}, big, {"input_ids": [5, 6]}, b"", {"text": ""})
    docs, stats = reader(data + b'{"text": "trunc')
    assert [d.text or d.ids.tolist() for d in docs] == ["one", [5, 6]]
    assert stats.rejected == {"invalid_json": 2, "no_text_or_input_ids": 1, "record_too_large": 1, "empty_text": 1}
    assert stats.records == 7 and stats.accepted == 2 and stats.end_of_input


def test_a_record_just_at_the_size_limit_is_kept_and_one_byte_more_is_not():
    limit = 64
    exact = json.dumps({"text": "y" * (limit - 12)}).encode()
    assert len(exact) == limit
    over = json.dumps({"text": "y" * (limit - 11)}).encode()
    docs, stats = reader(ndjson(exact, over, {"text": "after"}), max_bytes=limit)
    assert [d.text for d in docs] == ["y" * (limit - 12), "after"]
    assert stats.rejected == {"record_too_large": 1}
    # The limit is the record's: the line ending does not count, CRLF or none at the very end.
    docs, stats = reader(exact + b"\r\n" + over + b"\r\n" + exact, max_bytes=limit)
    assert [d.text for d in docs] == ["y" * (limit - 12)] * 2 and stats.rejected == {"record_too_large": 1}
    # A byte-order mark opening the stream is no part of the first record's size.
    for ending in (b"\n", b"\r\n", b""):
        docs, stats = reader(b"\xef\xbb\xbf" + exact + ending, max_bytes=limit)
        assert [d.text for d in docs] == ["y" * (limit - 12)] and not stats.rejected, ending
    docs, stats = reader(b"\xef\xbb\xbf" + over + b"\n" + exact, max_bytes=limit)
    assert [d.text for d in docs] == ["y" * (limit - 12)] and stats.rejected == {"record_too_large": 1}


def test_a_byte_order_mark_opening_the_stream_does_not_cost_the_first_record():
    docs, stats = reader(b"\xef\xbb\xbf" + ndjson({"text": "first"}, {"text": "second"}))
    assert [d.text for d in docs] == ["first", "second"] and not stats.rejected
    assert stats.bytes_read == len(ndjson({"text": "first"}, {"text": "second"})) + 3  # the mark is still read and counted


def test_a_null_text_beside_input_ids_takes_the_ids():
    assert parse_record(b'{"text": null, "input_ids": [5, 6]}', VOCAB).ids.tolist() == [5, 6]
    assert parse_record(b'{"text": null}', VOCAB) == "text_not_a_string"
    assert parse_record(b'{"text": 3, "input_ids": [5, 6]}', VOCAB) == "text_not_a_string"


def test_an_image_stream_is_refused_quickly_naming_what_was_expected_and_found():
    record = {"image_b64": "A" * 200_000, "labels": [], "boxes": [], "class_ids": [], "id": "x", "split": "train"}
    line = json.dumps(record).encode() + b"\n"

    def endless():
        while True:
            yield line

    class Stream(io.RawIOBase):
        def __init__(self):
            self.lines = endless()

        def readline(self, size=-1):
            return next(self.lines)

    start = time.perf_counter()
    with pytest.raises(UnusableInputError) as error:  # under the default bound on rejected records
        list(read_records(Stream(), StreamStats(source="stdin"), VOCAB, 1 << 20, DataConfig().give_up_after))
    assert time.perf_counter() - start < 10
    message = str(error.value)
    assert '"text"' in message and '"input_ids"' in message and "image_b64" in message


def test_a_stream_without_any_usable_record_fails_at_its_end():
    with pytest.raises(UnusableInputError, match="no usable record"):
        reader(ndjson(b"{bad", {"foo": 1}))


def test_bad_records_before_the_first_good_one_are_read_past_and_reported_on_stderr(caplog):
    """100,000 empty texts, then good records: bad records never stop a run, however many lead."""
    good = [{"text": f"good record {i}"} for i in range(1500)]
    docs, stats = reader(ndjson({"text": ""}) * 100_000 + ndjson(*good))
    assert [d.text for d in docs] == [r["text"] for r in good]
    assert stats.rejected == {"empty_text": 100_000} and stats.accepted == 1500
    said = caplog.text
    assert "input: 1 skipped so far (1 empty_text), 0 accepted; reading on" in said  # as soon as a record is skipped
    assert "first usable record at line 100001, after 100000 skipped (100000 empty_text)" in said


def test_records_of_another_kind_are_refused_early_and_only_an_endless_run_of_bad_ones_later():
    image = {"image_b64": "AAAA", "labels": [], "boxes": [], "class_ids": [], "id": "x", "split": "train", "epoch": 0}
    after_blanks = ndjson({"text": " "}) * 5000 + ndjson(image) * 10_000 + ndjson({"text": "never reached"})
    with pytest.raises(UnusableInputError, match=r"first 5256 lines.*256 no_text_or_input_ids.*fields seen: .*image_b64"):
        reader(after_blanks)
    with pytest.raises(UnusableInputError, match="256 not_an_object"):  # valid JSON, but not records at all
        reader(ndjson([1, 2, 3]) * 1000)
    with pytest.raises(UnusableInputError, match="first 300 lines.*300 invalid_json"):  # the bound, set low
        reader(ndjson(b"{bad") * 1000 + ndjson({"text": "late"}), give_up_after=300)
    docs, stats = reader(ndjson(image) * 100 + ndjson({"text": "first"}, *([image] * 1000), {"text": "second"}))
    assert [d.text for d in docs] == ["first", "second"]  # once the stream has given text, any record is only skipped
    assert stats.rejected == {"no_text_or_input_ids": 1100}


def test_a_record_the_tokenizer_fails_on_is_rejected_alone_and_a_batch_that_encodes_costs_one_call(caplog):
    calls = []

    def encode(texts):
        calls.append(len(texts))
        if any("\x00" in t for t in texts):
            raise ValueError("Regex error while tokenizing")
        return fake_encode(texts)

    records = [{"text": f"doc {i}" + ("\x00" if i == 10 else "")} for i in range(20)] + [{"input_ids": [5, 6]}]
    docs, stats = reader(ndjson(*records))
    out = list(encode_documents(docs, encode, 0, stats, batch_docs=8, batch_bytes=1 << 20))
    assert calls == [8, 8, *[1] * 8, 4]  # only the batch that failed is encoded again, one document at a time
    assert [key for key, _ in out] == [f"doc {i}".encode() for i in range(20) if i != 10] + [out[-1][0]]
    assert out[-1][1].tolist() == [5, 6, 0]
    assert stats.rejected == {"untokenizable_text": 1} and stats.accepted == stats.documents == 20
    assert "the tokenizer failed on a record of 7 characters (ValueError: Regex error while tokenizing)" in caplog.text
