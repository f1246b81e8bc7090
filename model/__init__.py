"""The decoder and what it computes with.

``decoder`` holds the ``model`` section (``ModelConfig``: the family and its shape) and what every family
shares (kernels chosen once, the compiled trunk, the loss); ``families.build_model`` builds the family the
config names: ``gpt`` (GPT-2) or ``llama`` (Llama: RMSNorm, rotary positions from ``rope``, SwiGLU,
grouped-query attention). ``kernels`` holds the ``compute`` section and chooses, once per device and dtype,
what runs each part; ``attention`` computes causal attention within documents (``flash4``: FlashAttention 4
as custom ops); ``fused_mlp`` runs GPT-2's MLP with its GELU in quack's GEMM epilogues (``quack_gelu``: the
exact GELU's formula there); ``loss`` is the LM head and the chunked cross-entropy (``triton_cross_entropy``:
its chunk softmax as Triton kernels; ``quack_lse``: the logits with each row's log-sum-exp from quack's GEMM
epilogue); ``flops`` counts parameters and training FLOPs; ``hf`` maps each family's weights to its Hugging Face
model's names and back. Imports torch and, optionally, kernel packages;
never the pipeline, the runtime, the config or Lightning.
"""
