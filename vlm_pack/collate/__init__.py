"""Collate: packed samples -> one row a model reads.

``collator`` (``PackingCollator``) joins processed samples into a ``PackedBatch`` (``batch``) in the expanded or
collapsed layout; ``samples`` / ``rows`` / ``settings`` are its steps and knobs; ``positions`` numbers each
sample from 0 (1-D or Qwen's mRoPE rows); ``labels`` shifts labels inside each sample; ``remap`` maps
``cu_seqlens`` between the collapsed and the expanded layout; ``vision_inputs`` joins each family's vision
tensors as its model reads them; ``padded`` is the one-sample-per-row batch the equivalence checks compare
against.
"""
