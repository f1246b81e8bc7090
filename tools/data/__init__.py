"""What builds the data the bundle ships.

    make_sample_data.py      data/sample.jsonl, the default training sample, from the standard library's docstrings
    build_gpt2_tokenizer.py  conf/gpt2/tokenizer.json and SOURCE.json, from OpenAI's GPT-2 encoding files

May import the training modules; ``python -m tools sample-data`` and ``python -m tools gpt2-tokenizer``
run them.
"""
