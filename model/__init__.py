"""The decoder and what it computes with.

``gpt`` is the GPT-2-shaped decoder; ``kernels`` holds the ``compute`` section and chooses, once per
device and dtype, what runs each part; ``attention`` computes causal attention within documents
(``flash4``: FlashAttention 4 as custom ops); ``fused_mlp`` runs the MLP with its GELU in quack's GEMM
epilogues (``quack_gelu``: the exact GELU's formula there); ``loss`` is the LM head and the chunked
cross-entropy (``triton_cross_entropy``: its chunk softmax as Triton kernels; ``quack_lse``: the
logits with each row's log-sum-exp from quack's GEMM epilogue); ``flops`` counts parameters and
training FLOPs. Imports torch and, optionally, kernel packages; never the pipeline, the runtime,
the config or Lightning.
"""
