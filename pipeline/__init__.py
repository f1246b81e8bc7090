"""The stream from records to complete updates: what a run reads, in plain Python, numpy and torch.

source (stdin or the bundled sample: sources.py) -> records (NDJSON, validated, rejects counted, then
tokenized: records.py, with tokenizer.py) -> the validation split (validation_split.py) -> bounded seeded
shuffle and packing into rows (packing.py) -> complete updates dealt to ranks (stream.py, which composes
them) -> the feeder's rank queues (feeder.py) and, to data-parallel workers, its socket (feeder_wire.py).
Their bounds are the ``data`` section (data_section.py). Beside the stream: which updates end with a metric line
(report_marks.py), the updates a resume skips (resume.py), the digests that make runs comparable
(fingerprints.py), and prepared rows read back as LitData shards (shards.py).

Not Lightning's DataModules (datamodule.py, at the root, wraps this stream for the Trainer), not the
bundled data (data/sample.jsonl) and not the tools that build data (tools/data/: the sample, GPT-2's
tokenizer, prepared shards). May import ``model`` for token bookkeeping constants and ``runfab``; never
the runtime, the callbacks, Lightning or torch.distributed (the ranks' agreement is the runtime's).
"""
