"""Packed-vs-batched equivalence: the test that proves a packing setup right, as a library feature.

An opt-in module (``import vlm_pack`` never loads it; nothing in the library imports it). A packing setup
is correct when every sample, packed into a row with others, gets exactly the per-token
log-probs it gets in an ordinary padded batch. ``check_packed_equivalence`` runs the model both ways on the
same samples and compares them token by token::

    batched (reference: one sample per row)       packed (under test: the collator's rows)
    row 0  a0 a1 a2 a3 .  .                       row 0  a0 a1 a2 a3 b0 b1 b2 c0 c1 .
    row 1  b0 b1 b2 .  .  .        ---------->    positions  0 1 2 3 0 1 2 0 1 .   (restart per sample)
    row 2  c0 c1 .  .  .  .                       cu_seqlens 0       4     7   9
    attention_mask marks the pads                 attention: a | b | c blocks, never across

    logp[t] = log_softmax(logits[t])[x[t+1]]      t = 0 .. L-2 of every sample, in both runs
    token_mult_prob_error = mean_t exp(|logp_batched[t] - logp_packed[t]|)          1.0 = identical

``token_mult_prob_error`` is NeMo-RL's metric (``nemo_rl/algorithms/loss/loss_functions.py``). In fp32
on CPU a correct setup gives 1.000000 (eager: bit-identical; sdpa: max |dlogp| ~1e-6); position ids that do
not restart, a KV cache left on or cu_seqlens left in the collapsed space give 1.01-3.

Models that take Megatron-style *collapsed* input (one placeholder token per image, expanded inside
``forward``) plug in through ``batched_forward=`` / ``packed_forward=``; ``CollapsedLlavaModel`` is such a
model built from real transformers parts, with ``collapsed_batched_forward`` / ``collapsed_packed_forward``::

    collapsed input_ids   t0 t1 <I> t2 | u0 <J> u1                      cu_seqlens (collapsed)  0 4 7
    expanded embeddings   t0 t1 I0 I1 I2 t2 | u0 J0 J1 J2 J3 u1          cu_seqlens (expanded)   0 6 12

Typical use, before a long run::

    from vlm_pack.testing import check_packed_equivalence
    report = check_packed_equivalence(model, samples[:16], collator)   # samples: Preprocessor.process
    print(report)
    report.raise_if_failed()

What lives where:

- ``metric.py``: ``token_mult_prob_error`` and ``next_token_logprobs``;
- ``harness.py``: ``check_packed_equivalence``, its ``EquivalenceReport`` (``TokenDiff``, ``SampleDiff``,
  ``PackedEquivalenceError``) and the default forwards of Hugging Face models, on the padded reference
  batch of ``vlm_pack.collate.padded.pad_samples`` (re-exported here);
- ``reference.py``: ``CollapsedLlavaModel``, a Megatron-like collapsed-placeholder LLaVA, and its forwards;
- ``unguarded()`` (from ``forward/mixers.py``): model calls inside reach the model as it is, past the packed-call
  guard that isolates token mixers at a first packed call: the negative control of a hybrid model;
- ``clips.py``: ``encode_clip`` (a clip PyAV encodes) and ``processor_with_video`` (a family's processor with
  its video processor), to run the same check on video samples (the ``[video]`` extra).
"""

from __future__ import annotations

from ..forward.packed_calls import unguarded
from .clips import encode_clip, processor_with_video
from .harness import (
    EquivalenceReport,
    PackedEquivalenceError,
    SampleDiff,
    TokenDiff,
    check_packed_equivalence,
    default_batched_forward,
    default_packed_forward,
    pad_samples,
)
from .metric import next_token_logprobs, token_mult_prob_error
from .reference import (
    CollapsedLlavaModel,
    CollapsedLlavaOutput,
    collapsed_batched_forward,
    collapsed_packed_forward,
)

__all__ = [
    "CollapsedLlavaModel",
    "CollapsedLlavaOutput",
    "EquivalenceReport",
    "PackedEquivalenceError",
    "SampleDiff",
    "TokenDiff",
    "check_packed_equivalence",
    "collapsed_batched_forward",
    "collapsed_packed_forward",
    "default_batched_forward",
    "default_packed_forward",
    "encode_clip",
    "next_token_logprobs",
    "pad_samples",
    "processor_with_video",
    "token_mult_prob_error",
    "unguarded",
]
