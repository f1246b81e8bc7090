"""The decoder and what it computes with.

``decoder`` holds the ``model`` section (``ModelConfig``: the family and its shape) and what every family
shares (kernels chosen once, the compiled trunk, the loss); ``families.build_model`` builds the family the
config names: ``gpt`` (GPT-2) or ``llama`` (Llama: RMSNorm, rotary positions from ``rope``, SwiGLU,
grouped-query attention). ``kernels/`` holds the ``compute`` section, the choice of what runs each part, the
fast paths and the GPU and compile-cache helper (``kernels.gpu``); ``loss`` is the LM head and the chunked
cross-entropy; ``flops`` counts parameters and training FLOPs; ``hf`` maps each family's weights to its Hugging
Face model's names and back. Imports torch and, optionally, kernel packages; never the pipeline, the runtime, the
config or Lightning.
"""
