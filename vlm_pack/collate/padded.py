"""The padded batch: one sample per row, right-padded, with an attention mask.

What a model sees without packing. The equivalence harness (``vlm_pack.testing``) runs it as the reference
the packed rows must match, and TRL's collator gives it for ``packed=False`` (the same samples, unpacked)::

    samples  a0 a1 a2 a3 | b0 b1         input_ids       a0 a1 a2 a3      attention_mask  1 1 1 1
                                                          b0 b1 P  P                       1 1 0 0
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .vision_inputs import VISION_KEYS, join_vision

__all__ = ["TOKEN_KEYS", "pad_samples"]

#: Per-token keys padded to the longest sample by ``pad_samples``; vision keys are concatenated.
TOKEN_KEYS = ("input_ids", "mm_token_type_ids", "token_type_ids")


def pad_samples(samples: Sequence[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs for the padded reference batch: one sample per row, right padding, an attention mask.

    ::

        samples  a0 a1 a2 a3 | b0 b1         input_ids       a0 a1 a2 a3      attention_mask  1 1 1 1
                                                              b0 b1 P  P                       1 1 0 0

    Args:
        samples: dicts from ``process_sample`` (1-D ``input_ids`` (L,); optional ``mm_token_type_ids`` /
            ``token_type_ids`` (L,), and the vision tensors of ``vision_inputs.VISION_KEYS``).
        pad_token_id: id written in the padding (never attended to, never scored).

    Returns:
        ``input_ids`` (B, Lmax), ``attention_mask`` (B, Lmax), ``mm_token_type_ids`` / ``token_type_ids``
        (B, Lmax) when the samples have them, and the vision tensors joined in sample order as each model
        reads them (``vision_inputs.join_vision``; with one sample: the sample's own tensors).
    """
    if not samples:
        raise ValueError("pad_samples: no samples")
    for i, s in enumerate(samples):
        if "input_ids" not in s or s["input_ids"].ndim != 1 or len(s["input_ids"]) == 0:
            raise ValueError(f"sample {i}: needs a non-empty 1-D 'input_ids' (as process_sample returns)")
    out: dict[str, torch.Tensor] = {}
    for key in TOKEN_KEYS:
        have = [key in s for s in samples]
        if not any(have):
            continue
        if not all(have):
            missing = have.index(False)
            raise ValueError(f"sample {missing} lacks {key!r} that other samples have")
        pad = pad_token_id if key == "input_ids" else 0
        out[key] = torch.nn.utils.rnn.pad_sequence(
            [s[key] for s in samples], batch_first=True, padding_value=pad
        )
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    out["attention_mask"] = (torch.arange(out["input_ids"].shape[1]) < lengths[:, None]).long()
    out.update(join_vision([{k: v for k, v in s.items() if k in VISION_KEYS and v.numel()} for s in samples]))
    return out
