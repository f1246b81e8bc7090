"""The decoder and what it computes with.

``gpt`` is the GPT-2-shaped decoder; the kernels it can use sit behind the modules they speed up.
Imports torch and, optionally, kernel packages; never the pipeline, the runtime or Lightning.
"""
