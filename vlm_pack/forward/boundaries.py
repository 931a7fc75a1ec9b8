"""Where the samples of a packed batch lie: ``cu_seqlens`` / ``max_seqlen`` (and the kept tokens when a
padding mask is given), validated and worked out once per forward on the host, then shared by every layer.

On a GPU each read of a device tensor's values (``.item()``, ``int(t)``, ``.tolist()``, ``nonzero()``,
``torch.equal``) stalls the launch queue. The functions here read host copies only (``host_copy``: none to
make for a tensor already on the CPU, such as the collator's ``cu_seqlens_padded``, one per device tensor
object otherwise) and cache their results keyed on the input tensors' identity and version, so an attention
function called by every layer pays for the boundaries once per forward::

    position_ids  [[0 1 2 0 1 0 1 2 3]]          ->  cu_seqlens [0 3 5 9], max_seqlen 4
    position_ids  [[0 1 2 0 1 0 0]]  mask [[1 1 1 1 1 0 0]]  ->  kept tokens 0..4, cu_seqlens [0 3 5]
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch

from .._compat import tensor_version

__all__ = [
    "IdentityCache",
    "Packing",
    "check_cu_seqlens",
    "covers",
    "cu_seqlens_from_position_ids",
    "host_copy",
    "packing_from_cu",
    "packing_from_mask",
    "packing_from_positions",
    "to_device",
]


class IdentityCache:
    """Tiny cache keyed by tensors' identity and version (the same ``cu_seqlens`` / ``position_ids`` /
    ``attention_mask`` objects reach every layer of a forward; recomputing from them per layer would cost a
    host sync each on a GPU).

    ``tensors`` is one tensor or a tuple of tensors and Nones. The version counters make an in-place edit
    of a key a miss. Inference tensors have no version counter (an in-place edit could not be seen), so a
    key holding one is never cached.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: list[tuple[tuple, tuple, Any, Any]] = []

    @staticmethod
    def _key(tensors: Any) -> tuple | None:
        tensors = tensors if isinstance(tensors, tuple) else (tensors,)
        if any(t is not None and t.is_inference() for t in tensors):
            return None
        return tensors, tuple(None if t is None else tensor_version(t) for t in tensors)

    def get(self, tensors: Any, key: Any) -> Any:
        found = self._key(tensors)
        if found is None:
            return None
        tensors, versions = found
        for refs, vers, k, value in self.entries:
            if (
                vers == versions
                and k == key
                and all(_deref(r) is t for r, t in zip(refs, tensors, strict=True))
            ):
                return value
        return None

    def put(self, tensors: Any, key: Any, value: Any) -> Any:
        found = self._key(tensors)
        if found is None:
            return value
        tensors, versions = found
        live = [e for e in self.entries if all(r is None or r() is not None for r in e[0])]
        self.entries = live[-(self.size - 1) :]
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self.entries.append((refs, versions, key, value))
        return value


def _deref(ref: weakref.ref | None) -> Any:
    return None if ref is None else ref()


_CHECKED = IdentityCache()
_HOST_COPIES = IdentityCache(16)
_PACKINGS = IdentityCache()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU: itself when it is there, else one device-to-host copy per tensor object
    (cached, so every layer of a forward shares the first layer's copy)."""
    if tensor.device.type == "cpu":
        return tensor
    host = _HOST_COPIES.get(tensor, None)
    if host is None:
        host = _HOST_COPIES.put(tensor, None, tensor.cpu())
    return host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` moved to ``device`` with its host copy remembered (so ``host_copy`` of the result never syncs)."""
    if host.device == device:
        return host
    moved = host.to(device, non_blocking=True)
    _HOST_COPIES.put(moved, None, host)
    return moved


def check_cu_seqlens(cu_seqlens: Any, total_tokens: int, max_seqlen: Any) -> tuple[torch.Tensor, int]:
    """Validate ``cu_seqlens`` (N+1,) against ``total_tokens``; return it as int32 and the max length.

    Raises ValueError/TypeError that say what is wrong and how to build a correct one. The checks run on
    the host copy (``_host``) and the result is cached per tensor object, so a device ``cu_seqlens`` costs
    one device-to-host copy per forward, not one per layer, and a host one costs none.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a torch.Tensor of shape (num_samples + 1,), got {type(cu_seqlens).__name__}; "
            "build it with torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)."
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cu_seqlens must be an integer tensor (int32), got dtype {cu_seqlens.dtype}; "
            "convert it with cu_seqlens.to(torch.int32)."
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with num_samples + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}; "
            "for one row of samples with lengths L_i it is [0, L_0, L_0+L_1, ..., total_tokens]."
        )
    key = (total_tokens, None if isinstance(max_seqlen, torch.Tensor) else max_seqlen)
    cached = _CHECKED.get(cu_seqlens, key)
    if cached is not None:
        return cached
    longest = check_bounds(host_copy(cu_seqlens).tolist(), total_tokens)
    if max_seqlen is None:
        max_seqlen = longest
    else:
        max_seqlen = int(max_seqlen)
        if max_seqlen < longest:
            raise ValueError(
                f"max_seqlen = {max_seqlen} is smaller than the longest sample ({longest} tokens); pass "
                "max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max())."
            )
    return _CHECKED.put(cu_seqlens, key, (cu_seqlens.to(torch.int32), max_seqlen))


def check_bounds(bounds: list[int], total_tokens: int) -> int:
    """Check host-side boundaries [0, ..., total_tokens] (non-decreasing); return the longest sample."""
    if bounds[0] != 0:
        raise ValueError(
            f"cu_seqlens must start at 0, got cu_seqlens[0] = {bounds[0]}; prepend a 0 "
            "(cu_seqlens = [0, *cumsum(lengths)])."
        )
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    bad = next((i for i, n in enumerate(lengths) if n < 0), None)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}] = {bounds[bad + 1]} < "
            f"cu_seqlens[{bad}] = {bounds[bad]} (sample {bad} has negative length); build it as a cumulative "
            "sum of the sample lengths."
        )
    if bounds[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens[-1] = {bounds[-1]} must equal the number of packed tokens q.shape[0] = {total_tokens}; "
            "cu_seqlens and q/k/v must describe the same packed row (pad the row with a last sample "
            "of padding tokens instead of leaving tokens outside cu_seqlens)."
        )
    return max(lengths)


def text_positions(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, T) text positions from (B, T), (T,), (1, T) shared by ``batch`` rows, Qwen-VL's (4, B, T) (row 0),
    or the bare (3, B, T) mRoPE rows that GLM-4.5V's text model hands its layers (:func:`mrope_restarts`)."""
    if position_ids.dim() == 3:
        if position_ids.shape[0] == 3:
            return mrope_restarts(position_ids)
        if position_ids.shape[0] != 4:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)}: a 3-D input must be Qwen-VL's (4, B, T) "
                "layout with the text positions (arange per sample) in row 0, or the (3, B, T) mRoPE rows. "
                "Pass one of those or the (B, T) text positions."
            )
        position_ids = position_ids[0]
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (B, T) or (R, B, T), got shape {tuple(position_ids.shape)}.")
    if position_ids.shape[0] == 1 and batch > 1:
        position_ids = position_ids.expand(batch, -1)
    return position_ids


_MROPE_TEXT = IdentityCache()


def mrope_restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions restarting where the (3, B, T) mRoPE ids are all 0.

    ``get_rope_index`` starts every sample at (0, 0, 0), and no later token of a sample is there again (an
    image's rows stand still on one axis but not on all three), so the all-zero tokens are exactly the sample
    starts; row 0 alone could not tell them (it stands still over an image)::

        mRoPE rows  t [0 1 1 1 1 2 0 1]     (an image of 2 x 2 at 1..4, a second sample at 6)
                    h [0 1 1 2 2 3 0 1]
                    w [0 1 2 1 2 3 0 1]   ->  [0 1 2 3 4 5 0 1]
    """
    cached = _MROPE_TEXT.get(position_ids, None)
    if cached is not None:
        return cached
    host = host_copy(position_ids)
    starts = (host == 0).all(0)
    starts[:, 0] = True
    arange = torch.arange(host.shape[-1]).expand_as(starts)
    last_start = torch.where(starts, arange, torch.zeros_like(arange)).cummax(-1).values
    return _MROPE_TEXT.put(position_ids, None, arange - last_start)


def sample_starts(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True at each row start and wherever a position is not its predecessor + 1."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    return starts


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sample boundaries of packed rows from their position ids: a sample starts wherever a position does
    not follow its predecessor by exactly 1, and at the start of every row.

    position_ids: (B, T), (4, B, T) with row 0 the text positions (Qwen2-VL's packed layout), or the bare
    (3, B, T) mRoPE rows (a sample starts where all three are 0: :func:`mrope_restarts`).
    Returns cu_seqlens (N+1,) int32 over the B*T flattened tokens and max_seqlen (int). This is the rule
    ``transformers.masking_utils.find_packed_sequence_indices`` uses, so sdpa packed and varlen agree::

        position_ids  [[0 1 2 0 1 0 1 2 3]]  ->  cu_seqlens [0 3 5 9], max_seqlen 4

    Row 0 of bare mRoPE rows alone is not used: it stands still over an image, which would read as one
    sample per image token.
    """
    pos = text_positions(position_ids, 1)
    starts = sample_starts(pos)
    idx = starts.flatten().nonzero().flatten()
    cu = torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


class Packing(NamedTuple):
    """Where the samples of a packed forward lie, computed once per forward and shared by its layers."""

    cu: torch.Tensor  # (N+1,) int32 on the attention's device, over the kept tokens
    max_seqlen: int
    index: torch.Tensor | None  # (n_kept,) int64 flat positions of the kept (non-padding) tokens, or None


def packing_from_cu(cu_q, cu_k, max_length, total: int, device: torch.device) -> Packing:
    """The flash-style kwargs: validated on their host copy (none to make when the caller keeps them on
    the host), moved to ``device`` once."""
    key = (total, None if isinstance(max_length, torch.Tensor) else max_length, device)
    cached = _PACKINGS.get((cu_q, cu_k), key)
    if cached is not None:
        return cached
    cu, max_seqlen = check_cu_seqlens(cu_q, total, max_length)
    if cu_k is not None and cu_k is not cu_q and not torch.equal(host_copy(cu_k), host_copy(cu_q)):
        raise NotImplementedError(
            "varlen attention handles self-attention only: cu_seq_lens_k must equal cu_seq_lens_q."
        )
    cu = cu if cu.device == device else to_device(host_copy(cu), device)
    return _PACKINGS.put((cu_q, cu_k), key, Packing(cu, max_seqlen, None))


def packing_from_mask(mask, position_ids, batch: int, length: int, device: torch.device) -> Packing:
    """A (B, T) padding mask, with or without packed ``position_ids``: the mask drops the padding, the
    positions keep the sample boundaries inside each row (a sample starts at a row start, after padding,
    and wherever a position is not its predecessor + 1)::

        position_ids  [[0 1 2 0 1 0 0]]   mask [[1 1 1 1 1 0 0]]   ->  kept 0..4, cu_seqlens [0 3 5]
    """
    key = (batch, length, device)
    cached = _PACKINGS.get((mask, position_ids), key)
    if cached is not None:
        return cached
    real = host_copy(mask).bool().reshape(batch, length)
    starts = torch.ones_like(real)
    starts[:, 1:] = ~real[:, :-1]
    if position_ids is not None:
        starts |= sample_starts(text_positions(host_copy(position_ids), batch).reshape(batch, length))
    index = real.flatten().nonzero().flatten()
    first = starts.flatten()[index].nonzero().flatten()
    cu = torch.cat([first, first.new_tensor([index.numel()])]).to(torch.int32)
    if cu.numel() < 2:  # every token is padding
        cu = cu.new_zeros(2)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    packing = Packing(to_device(cu, device), max_seqlen, to_device(index, device))
    return _PACKINGS.put((mask, position_ids), key, packing)


def packing_from_positions(position_ids, batch: int, length: int, device: torch.device) -> Packing:
    """Restarts of the (text) ``position_ids``, read from their host copy once per forward."""
    key = (batch, length, device)
    cached = _PACKINGS.get(position_ids, key)
    if cached is not None:
        return cached
    cu, max_seqlen = cu_seqlens_from_position_ids(text_positions(host_copy(position_ids), batch))
    total = int(cu[-1])
    if total != batch * length:
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} cover {total} tokens but attention got {batch} rows "
            f"of {length}; pass position ids of shape (B, T) (Qwen-VL: (4, B, T)) for the packed rows."
        )
    return _PACKINGS.put(position_ids, key, Packing(to_device(cu, device), max_seqlen, None))


def covers(cu_seqlens: Any, total: int) -> bool:
    """Whether ``cu_seqlens`` spans exactly ``total`` tokens (a non-causal call's own boundaries, not the
    text's boundaries handed on to a vision tower through ``**kwargs``). Reads the cached host copy."""
    return (
        isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.numel() >= 2
        and int(host_copy(cu_seqlens)[-1]) == total
    )
