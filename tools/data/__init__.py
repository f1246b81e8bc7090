"""What builds data: what the bundle ships, and prepared shards for runs beyond RunFab. Never shipped.

Not the stream a run reads (pipeline/), not the bundled data itself (data/sample.jsonl, which
make_sample_data.py writes) and not the DataModules (datamodule.py).

    make_sample_data.py      data/sample.jsonl, the default training sample, from the standard library's docstrings
    build_gpt2_tokenizer.py  conf/gpt2/tokenizer.json and SOURCE.json, from OpenAI's GPT-2 encoding files
    prepare.py               NDJSON files into packed rows as LitData chunks, for data.source litdata
    train_tokenizer.py       a byte-level BPE tokenizer.json trained on NDJSON documents

May import the training modules; ``python -m tools sample-data``, ``gpt2-tokenizer``, ``prepare`` and
``tokenizer`` run them.
"""
