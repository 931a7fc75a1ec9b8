"""What keeps packed samples apart inside the model's forward.

``varlen`` / ``attention``: varlen attention over ``cu_seqlens`` and the transformers attention function that
routes a model to it; ``masks``: packed 4-D masks (two-way image blocks, sliding windows); ``boundaries``: the
sample boundaries of a forward, read once; ``mixers`` / ``mixer_kernels``: token mixers that are not attention
(gated delta-net, short convolutions, Mamba2) isolated per sample; ``routers``: MoE auxiliary losses over real
tokens; ``loss``: per-token loss across ranks and micro-batches; ``context_parallel``: sharding a packed row
over context-parallel ranks.
"""
