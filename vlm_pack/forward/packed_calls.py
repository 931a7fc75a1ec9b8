"""The packed-call guard: a model's token mixers are isolated at its first packed call, whatever route the rows
took, with no call for the user to remember (``mixers.py`` says what a token mixer is and how it is isolated).

    model(**rows)  ->  PreTrainedModel.__call__ (patched once)  ->  rows packed?  seq_idx, or positions that
                                                                     restart inside a row
                                                  new model   ->  isolate_token_mixers(model), or ValueError
                                                                     naming a mixer vlm-pack cannot split
                                                  then        ->  nn.Module.__call__ as before

Once vlm-pack hands out rows (a ``PackingCollator`` is built, or ``model_inputs``
runs: both, since a DataLoader worker's patch does not reach the main process), ``guard_packed_calls`` gives
``transformers.PreTrainedModel`` a ``__call__`` that runs ``isolate_token_mixers`` on a model not seen before
when the call's kwargs hold ``seq_idx`` or packed position ids (an unknown mixer: ValueError naming the layer,
before any layer runs), then ``nn.Module.__call__`` as before. Why there:

- ``seq_idx`` reaches the model's call on every release, but not the mixer: on 5.6 ``Qwen3_5DecoderLayer`` calls
  ``self.linear_attn(hidden_states, cache_params, attention_mask)`` without ``**kwargs`` (5.18 on passes them),
  and an isolated mixer needs the text model's pre-hook to capture the positions before its layers run. A guard
  on the mixer classes would see nothing on 5.6 and start too late on every release.
- torch's global hooks (``register_module_forward_pre_hook``) get no kwargs and take every module of every model
  off its fast call path; a class ``__call__`` on the one base class costs a dict look-up per model call (a few
  per forward), is inherited by models built before or after it (remote code, FSDP's dynamic subclasses, PEFT's
  inner models: ``LoraModel`` calls ``forward`` directly, the inner ``*Model`` is still called) and changes
  nothing for a call that is not packed, nor for any call once the model has been seen.
- Isolating rather than refusing, also on 5.24 on where transformers' own fallbacks refuse ``seq_idx`` ("can't
  keep packed sequences apart"): the refusal's only fix is the same call, the isolated forward equals the
  class's on a row of one sample, and parameters / state_dict are untouched. Unknown mixers stay refused.
- A hub kernel (transformers 5.25's ``kernelize``) that replaced a mixer's forward before the first packed call
  is overwritten there like any un-isolated forward; one that replaces it later is caught by
  the mixers' own guard (``mixers.py``, "Kept isolated").
- Rows with no marker (a ``PackingCollator`` without a family, for a model type with no record: LFM3-VL,
  MiniCPM-V 4.6, Nemotron-H Omni) are recognised by their position ids, as transformers recognises packed rows:
  a sample starting inside a row, with no cache and no 2-D padding mask (:func:`looks_packed`; a generation step
  never matches). The guard is armed whenever vlm-pack builds a collator or hands out rows.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..families import lookup
from .boundaries import sample_starts, text_positions
from .mixers import _STATES, _owner, find_token_mixers, isolate_token_mixers

__all__ = ["carries_mixer_marker", "guard_packed_calls", "looks_packed", "unguarded"]

logger = logging.getLogger(__name__)


def carries_mixer_marker(family: str | None) -> bool:
    """Whether the HF-style rows of ``family`` carry ``seq_idx``: its text model has token mixers (the record's
    ``token_mixers``), or checkpoints that share its processor do (``mixers_behind_processor``)."""
    record = lookup(family)
    return record is not None and bool(record.token_mixers or record.mixers_behind_processor)


def guard_packed_calls() -> bool:
    """From now on, a transformers model called with packed rows (their ``seq_idx`` marker, or position ids that
    restart inside a row: :func:`looks_packed`) has its token mixers isolated before its first such forward runs
    (see the module docstring). Idempotent; returns whether the guard is in place (False only without
    transformers)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # no transformers model to guard
        return False
    call = PreTrainedModel.__call__
    if getattr(call, "guards_packed_calls", False):
        return True

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self not in _SEEN and not _UNGUARDED:
            if kwargs.get("seq_idx") is not None:
                _isolate_on_packed_call(self)
            elif looks_packed(kwargs):
                _isolate_on_packed_call(self, marker=False)
        return call(self, *args, **kwargs)

    __call__.guards_packed_calls = True  # type: ignore[attr-defined]
    PreTrainedModel.__call__ = __call__
    return True


def looks_packed(kwargs: dict) -> bool:
    """Whether a model call's kwargs hold packed rows that carry no ``seq_idx``: a sample starting inside a row
    (``boundaries.sample_starts``: a position that is not its predecessor + 1, the rule of transformers'
    ``masking_utils.find_packed_sequence_indices`` and the one isolated mixers split by; Qwen's text row of
    ``(4, B, T)``; where all three ``(3, B, T)`` mRoPE rows are 0), with no cache and no 2-D padding mask. A
    generation step (a cache, or left padding spelled by a ``[B, T]`` attention mask) is never taken for one.
    Costs one device sync, paid until the model is seen."""
    positions = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (2, 3) or positions.shape[-1] < 2:
        return False
    if kwargs.get("past_key_values") is not None or (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        return False
    if positions.dim() == 3 and positions.shape[0] not in (3, 4):
        return False
    text = text_positions(positions, positions.shape[-2])
    return bool(sample_starts(text)[:, 1:].any())


def _isolate_on_packed_call(model: nn.Module, marker: bool = True) -> None:
    """Isolate the token mixers of a ``model`` never isolated before (ValueError naming any it cannot), once
    per model. A mixer isolated before whose forward or layer was replaced since is the ``_Guard``'s: it
    re-isolates a forward transformers popped and refuses a replacement by name, so nothing here overwrites
    a replacement that was made on purpose. ``marker=False``: the rows were recognised by their positions
    (:func:`looks_packed`), e.g. a ``PackingCollator`` built without a family for a model type with no record."""
    left = [m.name for m in find_token_mixers(model) if m.isolation == "none"]
    if left and not any(_was_isolated(model, name) for name in left):
        isolate_token_mixers(model)
        logger.info("vlm-pack: %s received packed rows (%s): its token mixers %s now run per sample",
                    type(model).__name__, "seq_idx" if marker else "position ids restarting in a row",
                    ", ".join(left))
    _SEEN.add(model)


def _was_isolated(model: nn.Module, name: str) -> bool:
    """Whether the text model owning layer ``name`` has had mixers isolated (it holds their guards)."""
    try:
        return _owner(model, name) in _STATES
    except ValueError:  # in no decoder stack: never isolated (isolate_token_mixers names it)
        return False


_SEEN: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_UNGUARDED: list[bool] = []  # one entry per open unguarded() block


@contextlib.contextmanager
def unguarded() -> Iterator[None]:
    """Model calls inside the block reach the model as it is: the packed-call guard isolates nothing (a mixer
    isolated before stays isolated). For negative controls, which measure what an un-isolated model does with
    packed rows; nothing in a training run needs it."""
    _UNGUARDED.append(True)
    try:
        yield
    finally:
        _UNGUARDED.pop()
