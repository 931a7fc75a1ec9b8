"""Sample boundaries across the two layouts of a packed multimodal row, and the per-sample roll.

A packed row holds several samples back to back; ``cu_seqlens`` (int32, ``[num_samples + 1]``, starting
at 0) marks where each one starts. Vision-language models see that row in one of two layouts:

- **expanded** (what Hugging Face processors produce): every image placeholder is repeated once per
  vision embedding, so ``input_ids`` already has the length the language model runs on;
- **collapsed** (Megatron LLaVA, Energon-free pipelines): one placeholder ``P`` per image, which the
  model replaces by ``n_i`` embeddings *inside* its forward (videos alike: one placeholder per video, or
  per temporal group where the processor writes text between groups; pass both ids, see below).

::

    collapsed    a0 a1 P  a2 | b0 P  P  b1 b2 | c0            tokens_per_image = [3, 2, 4]
    position      0  1 2   3 |  4 5  6   7  8 |  9
    cu_seqlens   [0,           4,               9, 10]

    expanded     a0 a1 I I I a2 | b0 I I I I I I b1 b2 | c0
    position      0  1 2 3 4  5 |  6 7 8 9 ...  13 14  | 15
    cu_seqlens   [0,              6,                     15, 16]

A collapsed position ``p`` with ``k`` placeholders before it lands at ``p + sum_{i<k}(n_i - 1)``; the same
map moves every entry of ``cu_seqlens`` and of ``cu_seqlens_padded`` (Megatron-LM PR 3427 measured
``token_mult_prob_error`` 1.10-1.13 when a model attends with the *collapsed* boundaries after expanding,
1.000000 with the remapped ones). :func:`remap_cu_seqlens` applies the map with one ``cumsum`` and one
gather, and inverts it (``inverse=True``: expanded -> collapsed) with ``searchsorted``. It loops over
neither tokens nor samples, and reads no value back to the host unless asked to validate.

With per-sample padding (context parallelism needs every sample's expanded length to be a multiple of
``2 * CP``), the padded offsets and the real lengths are two different things::

    expanded, pad to 4     a0 a1 I I I a2 _ _ | b0 I I I I I I b1 b2 _ _ _ | c0 _ _ _
    cu_seqlens_padded      [0,                 8,                          20,       24]   offsets
    cu_seqlens             [0,             6,                     15,  16]               real lengths

:func:`remap_cu_seqlens_padded` remaps both at once. The per-sample shift of labels over these boundaries is
:func:`vlm_pack.collate.labels.roll_packed`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_offsets",
    "expansion_map",
    "remap_cu_seqlens",
    "remap_cu_seqlens_padded",
    "segment_ids",
]


PlaceholderIds = int | Sequence[int]
"""One placeholder id, or several (an image's and a video's): their placeholders are counted together, in the
order they stand in ``input_ids``."""


def _placeholders(ids: torch.Tensor, token_ids: PlaceholderIds) -> torch.Tensor:
    """Bool ``[L]``: where ``ids`` holds one of the placeholder ids."""
    if isinstance(token_ids, int):
        return ids == token_ids
    wanted = torch.tensor([int(t) for t in token_ids], dtype=ids.dtype, device=ids.device)
    return torch.isin(ids, wanted)


def _should_validate(validate: bool | None, *tensors: torch.Tensor) -> bool:
    # None: validate on the CPU (free), skip on accelerators (a check there costs a host sync).
    if validate is None:
        return all(t.device.type == "cpu" for t in tensors)
    return bool(validate)


def _flat_ids(input_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() == 0:
        raise ValueError("input_ids must have at least one dimension (a row of token ids)")
    # Several rows are one buffer, row after row: the offsets in cu_seqlens index that buffer.
    return input_ids.reshape(-1)


def _check_1d(cu: torch.Tensor, name: str) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of num_samples + 1 offsets")


def _ids_and_validation(
    cu_seqlens: torch.Tensor, input_ids: torch.Tensor, validate: bool | None
) -> tuple[torch.Tensor, bool]:
    """The flat ids ``[L]`` and whether to validate, once ``cu_seqlens`` is known to be 1-D."""
    _check_1d(cu_seqlens, "cu_seqlens")
    ids = _flat_ids(input_ids)
    return ids, _should_validate(validate, ids, cu_seqlens)


def _check_cu(cu: torch.Tensor, total: int, name: str, what: str) -> None:
    """Host-side checks (one sync): starts at 0, never decreases, ends at ``total``."""
    if cu.numel() == 0:
        raise ValueError(f"{name} is empty: it needs num_samples + 1 >= 1 entries, starting with 0")
    first, last = int(cu[0]), int(cu[-1])
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if cu.numel() > 1:
        steps = cu[1:] - cu[:-1]
        bad = torch.nonzero(steps < 0)
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(
                f"{name} decreases at entry {i + 1} ({int(cu[i])} -> {int(cu[i + 1])}): "
                "it must be the cumulative sum of sample lengths"
            )
    if last != total:
        raise ValueError(
            f"{name} ends at {last} but {what} holds {total} tokens: the last entry must be the total"
        )


def check_offsets(
    cu: torch.Tensor, total: int, name: str, what: str, *tensors: torch.Tensor, validate: bool | None = None
) -> None:
    """``cu`` is a 1-D ``[N + 1]`` tensor of offsets; with ``validate`` (``None``: when ``cu`` and ``tensors``
    are on the CPU, where the check is free; on an accelerator it would be a host sync) also that it starts
    at 0, never decreases and ends at ``total``, the length of ``what``. ValueError naming ``name`` if not."""
    _check_1d(cu, name)
    if _should_validate(validate, cu, *tensors):
        _check_cu(cu, total, name, what)


class _Expansion:
    """Where collapsed offsets land once every placeholder becomes its embeddings.

    ``seen[p]`` counts placeholders at positions ``<= p`` (an int32 cumsum: one pass over the tokens;
    an int64 cumsum of a bool tensor is ~15x slower on CPU); ``extra[k] = sum_{i<k}(n_i - 1)``, or the int
    ``n - 1`` when every image has ``n`` embeddings. Offset ``p`` lands at ``p + extra[seen[p - 1]]``, so
    mapping the ``N + 1`` boundaries touches only them.
    """

    def __init__(
        self, ids: torch.Tensor, image_token_id: PlaceholderIds, tokens_per_image: int | torch.Tensor, validate: bool
    ):
        is_image = _placeholders(ids, image_token_id)
        # int32 holds any count below 2**31 placeholders; larger buffers fall back to int64.
        dtype = torch.int32 if ids.numel() < 2**31 else torch.int64
        self.seen = torch.cumsum(is_image, 0, dtype=dtype)
        self.n_counts: int | None = None
        if isinstance(tokens_per_image, torch.Tensor) and tokens_per_image.dim() == 0:
            tokens_per_image = int(tokens_per_image)
        if not isinstance(tokens_per_image, torch.Tensor):
            n = int(tokens_per_image)
            if n < 1:
                raise ValueError(f"tokens_per_image must be >= 1 (embeddings per placeholder), got {n}")
            self.extra: torch.Tensor | int = n - 1
            return
        counts = tokens_per_image
        if counts.dim() != 1:
            raise ValueError(
                f"tokens_per_image must be an int or a 1-D tensor (one count per placeholder), got shape "
                f"{tuple(counts.shape)}"
            )
        if counts.numel() and (counts.dtype.is_floating_point or counts.dtype == torch.bool):
            raise TypeError(f"tokens_per_image must hold integers, got dtype {counts.dtype}")
        counts = counts.to(device=ids.device, dtype=torch.int64)
        if validate:
            n_placeholders = int(self.seen[-1]) if ids.numel() else 0
            if n_placeholders != counts.numel():
                raise ValueError(
                    f"tokens_per_image has {counts.numel()} count(s) but input_ids holds {n_placeholders} "
                    "image placeholder(s): give exactly one count per placeholder, in order"
                )
            if counts.numel() and int(counts.min()) < 1:
                i = int(torch.nonzero(counts < 1)[0, 0])
                raise ValueError(
                    f"tokens_per_image[{i}] = {int(counts[i])}: every image becomes >= 1 embedding"
                )
        extra = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=ids.device)
        extra[1:] = torch.cumsum(counts - 1, 0)
        self.extra = extra
        self.n_counts = counts.numel()

    def before(self, offs: torch.Tensor) -> torch.Tensor:
        """Placeholders strictly before each offset (int64)."""
        if self.seen.numel() == 0:
            return torch.zeros_like(offs)
        prev = self.seen[(offs - 1).clamp(min=0)].to(torch.int64)
        out = torch.where(offs > 0, prev, 0)
        if self.n_counts is not None:
            # Without validation a surplus of placeholders must not index past the counts.
            out = out.clamp(max=self.n_counts)
        return out

    def __call__(self, offsets: torch.Tensor) -> torch.Tensor:
        offs = offsets.to(device=self.seen.device, dtype=torch.int64)
        before = self.before(offs)
        if isinstance(self.extra, int):
            return offs + before * self.extra
        return offs + self.extra[before]


def expansion_map(
    input_ids: torch.Tensor,
    image_token_id: PlaceholderIds,
    tokens_per_image: int | torch.Tensor,
    *,
    validate: bool | None = None,
) -> torch.Tensor:
    """Expanded offset of every collapsed offset: int64 ``[L + 1]``.

    ``out[p]`` is where collapsed position ``p`` lands after expansion (``out[L]`` is the expanded total),
    i.e. ``p + sum(n_k - 1 for placeholders k before p)``. ``input_ids`` is ``[L]`` or ``[R, T]`` (rows are
    one buffer, row-major). ``tokens_per_image`` is one int for every image, or a 1-D tensor with one count
    per placeholder in order (tiles, multi-image samples).
    """
    ids = _flat_ids(input_ids)
    expand = _Expansion(ids, image_token_id, tokens_per_image, _should_validate(validate, ids))
    return expand(torch.arange(ids.numel() + 1, device=ids.device))


def remap_cu_seqlens(
    cu_seqlens: torch.Tensor,
    input_ids: torch.Tensor,
    image_token_id: PlaceholderIds,
    tokens_per_image: int | torch.Tensor,
    *,
    inverse: bool = False,
    validate: bool | None = None,
) -> torch.Tensor:
    """Collapsed -> expanded sample boundaries (``inverse=True``: expanded -> collapsed).

    Args:
        cu_seqlens: ``[N + 1]`` offsets (starting at 0) into the collapsed buffer ``input_ids``, ending at its
            length; with ``inverse``, offsets into the expanded buffer, ending at its length. Works for
            ``cu_seqlens_padded`` too (offsets of padded samples); for real lengths inside a padded buffer
            use :func:`remap_cu_seqlens_padded`.
        input_ids: ``[L]`` or ``[R, T]`` collapsed ids, one ``image_token_id`` per image (also with
            ``inverse``: adjacent images cannot be told apart once expanded).
        image_token_id: the placeholder id (Megatron LLaVA uses -200), or several, e.g. ``(image_id,
            video_id)``: then ``tokens_per_image`` counts every placeholder of either, in buffer order (a
            video's placeholder, or one per temporal group where Qwen3-VL writes timestamps between them).
        tokens_per_image: embeddings per placeholder: one int, or ``[num_placeholders]`` in order.
        inverse: map expanded offsets back to collapsed ones.
        validate: check the inputs (``None``: on CPU only, because on CUDA a check is a host sync).

    Returns:
        ``[N + 1]`` remapped offsets, same dtype and device as ``cu_seqlens``.

    Raises:
        ValueError: when ``cu_seqlens`` does not start at 0, decreases or does not end at the buffer
            length, when the counts do not match the placeholders, or (``inverse``) when a boundary falls
            inside an image's embeddings, which has no collapsed position (with ``validate``).
    """
    ids, check = _ids_and_validation(cu_seqlens, input_ids, validate)
    if not inverse:
        if check:
            _check_cu(cu_seqlens, ids.numel(), "cu_seqlens", "input_ids")
        return _Expansion(ids, image_token_id, tokens_per_image, check)(cu_seqlens).to(cu_seqlens.dtype)
    emap = expansion_map(ids, image_token_id, tokens_per_image, validate=check)
    if check:
        _check_cu(cu_seqlens, int(emap[-1]), "cu_seqlens", "the expanded buffer")
    target = cu_seqlens.to(device=emap.device, dtype=torch.int64)
    pos = torch.searchsorted(emap, target)
    if check:
        hit = emap[pos.clamp(max=emap.numel() - 1)] == target
        if not bool(hit.all()):
            i = int(torch.nonzero(~hit)[0, 0])
            raise ValueError(
                f"cu_seqlens[{i}] = {int(target[i])} falls inside an image's embeddings: a sample boundary "
                "must lie between tokens of the collapsed row"
            )
    return pos.to(cu_seqlens.dtype)


def remap_cu_seqlens_padded(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    input_ids: torch.Tensor,
    image_token_id: PlaceholderIds,
    tokens_per_image: int | torch.Tensor,
    *,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collapsed -> expanded ``(cu_seqlens, cu_seqlens_padded)`` of a buffer whose samples are padded.

    ``cu_seqlens_padded`` ``[N + 1]`` are offsets into the collapsed ``input_ids``; ``cu_seqlens`` ``[N + 1]``
    the cumulative *real* lengths (sample ``i`` occupies ``cu_seqlens[i+1] - cu_seqlens[i]`` tokens from
    ``cu_seqlens_padded[i]``, the rest is its padding). Returns the expanded pair, in the dtypes given.
    """
    _check_1d(cu_seqlens, "cu_seqlens")
    _check_1d(cu_seqlens_padded, "cu_seqlens_padded")
    if cu_seqlens.numel() != cu_seqlens_padded.numel():
        raise ValueError(
            f"cu_seqlens has {cu_seqlens.numel()} entries, cu_seqlens_padded {cu_seqlens_padded.numel()}: "
            "both need num_samples + 1"
        )
    ids = _flat_ids(input_ids)
    check = _should_validate(validate, ids, cu_seqlens, cu_seqlens_padded)
    if check:
        _check_cu(cu_seqlens_padded, ids.numel(), "cu_seqlens_padded", "input_ids")
        _check_cu(cu_seqlens, int(cu_seqlens[-1]), "cu_seqlens", "cu_seqlens")
        over = torch.nonzero(cu_seqlens.diff() > cu_seqlens_padded.diff())
        if over.numel():
            i = int(over[0, 0])
            raise ValueError(
                f"sample {i}: real length {int(cu_seqlens[i + 1] - cu_seqlens[i])} exceeds its padded "
                f"length {int(cu_seqlens_padded[i + 1] - cu_seqlens_padded[i])}"
            )
    expand = _Expansion(ids, image_token_id, tokens_per_image, check)
    padded = cu_seqlens_padded.to(device=ids.device, dtype=torch.int64)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=ids.device, dtype=torch.int64)
    starts = padded[:-1]
    # A sample's expanded real length: map its real end and its start (padding holds no placeholder).
    real_len = expand(starts + lengths) - expand(starts)
    real = torch.zeros_like(padded)
    real[1:] = torch.cumsum(real_len, 0)
    return real.to(cu_seqlens.dtype), expand(padded).to(cu_seqlens_padded.dtype)


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sample index of every position ``[total]`` (int64) from ``cu_seqlens`` ``[N + 1]``.

    Positions at or beyond ``cu_seqlens[-1]`` get index ``N`` (a tail outside every sample).
    """
    cu = cu_seqlens.to(torch.int64)
    marks = torch.zeros(total + 1, dtype=torch.int64, device=cu.device)
    # index_add (not index_put) counts repeated boundaries of empty samples.
    marks.index_add_(0, cu[1:].clamp(max=total), torch.ones_like(cu[1:]))
    return torch.cumsum(marks[:total], 0)
