"""What builds data: what the bundle ships, and prepared shards for runs beyond RunFab.

    make_sample_data.py      data/sample.jsonl, the default training sample, from the standard library's docstrings
    build_gpt2_tokenizer.py  conf/gpt2/tokenizer.json and SOURCE.json, from OpenAI's GPT-2 encoding files
    prepare.py               NDJSON files into packed rows as LitData chunks, for data.source litdata

May import the training modules; ``python -m tools sample-data`` and ``python -m tools gpt2-tokenizer``
and ``python -m tools prepare`` run them.
"""
