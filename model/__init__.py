"""The decoder and what it computes with.

``gpt`` is the GPT-2-shaped decoder; ``attention`` computes causal attention within documents and
picks its kernel (``flash4``: FlashAttention 4 as custom ops); ``fused_mlp`` runs the MLP with its
GELU in quack's GEMM epilogues where it can (``quack_gelu``: the exact GELU's formula there), and
``quack_linear`` qkv's product and the head's logits through quack's GEMM; ``loss`` is the LM head and
the cross-entropy (``triton_cross_entropy``: its chunk softmax as one Triton kernel; ``quack_lse``: the
logits with each row's log-sum-exp from quack's GEMM epilogue, for a single pass); ``flops`` counts
parameters and training FLOPs; ``fp8`` converts the blocks' Linear layers for float8 training. Imports torch and,
optionally, kernel packages; never the pipeline, the runtime or Lightning.
"""
