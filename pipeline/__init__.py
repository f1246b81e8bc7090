"""The stream from records to complete updates.

source (stdin or the bundled sample: sources.py) -> records (NDJSON, validated, rejects counted, then
tokenized: records.py) -> the validation split (validation_split.py) -> bounded seeded shuffle and
packing into rows (packing.py) -> complete updates dealt to ranks (stream.py, which composes them)
-> the feeder's rank queues (feeder.py). Their bounds are the ``data`` section (config.py).
May import ``model`` for token bookkeeping constants; never the runtime or Lightning.
"""
