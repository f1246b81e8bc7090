"""The stream from records to complete updates.

source (stdin or the bundled sample) -> records (NDJSON, validated, rejects counted) -> tokenizer
-> bounded seeded shuffle -> packing into rows -> complete updates -> the feeder's rank queues.
May import ``model`` for token bookkeeping constants; never the runtime or Lightning.
"""
