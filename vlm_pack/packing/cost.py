"""The compute cost of a pack, from its forecast: the language model over its tokens, the vision tower per image.

A transformer layer of width ``h`` over a sequence of ``s`` tokens costs, in forward FLOPs (backward is
about twice that, for every term alike, so it does not change which pack is dearer)::

    projections   2 s (2 h^2 + 2 h kv)           q, o: h x h; k, v: h x kv  (kv = kv_heads * head_dim)
    MLP           2 s m h f                       m = 3 gated (SwiGLU / GeGLU), 2 plain; f = intermediate
    attention     4 h s^2 * c                     QK^T and AV; c = 1/2 causal (varlen kernels skip the
                                                  masked half), 1 bidirectional (the ViT)

In a pack the attention term is per *sample* for the language model (varlen attention never crosses a
boundary) and per *image* for the vision tower (per *frame group* of a video: Qwen-VL's tower attends
within each of a video's ``t`` groups of ``h * w`` patches, transformers ``vision_utils.get_vision_cu_seqlens``,
so a video of grid ``(t, h, w)`` costs as ``t`` images of ``h * w`` patches, :func:`vision_patches`); where the tower attends in windows (Qwen2.5-VL: 112 px
windows = 64 patches, full attention only in ``fullatt_block_indexes``) a windowed layer costs
``4 d p min(p, window)`` instead of ``4 d p^2``. Plus the output head, ``2 s h V``. So a pack's cost is the sum
of its samples' costs::

    cost(sample) = L (2 s (2h^2 + 2h kv + m h f) + 2 h s^2) + 2 s h V
                 + sum_img [ L_v 2 p (4 d^2 + m_v d f_v) + 4 d p (L_full p + L_win min(p, w)) ]

:class:`PackCost` holds the widths and depths (``PackCost.from_config(model.config)`` reads them from a
transformers config, or its dict); :func:`pack_costs` costs packs, vectorised. A callable
``cost(lengths, patches) -> float`` (one pack's int64 sample lengths and per-image patch counts) replaces
the model anywhere a ``PackCost`` is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

import numpy as np

__all__ = ["CostFn", "PackCost", "image_patches", "pack_costs", "vision_patches"]

#: one pack's sample lengths (int64 ``[n]``) and its images' ViT patches (int64 ``[m]``) -> its cost
CostFn = Callable[[np.ndarray, np.ndarray], float]


def _get(obj: Any, *names: str) -> Any:
    """The first of ``names`` that ``obj`` (a config object or a dict) holds, not None; else None."""
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else default


@dataclass(frozen=True)
class PackCost:
    """Widths and depths of a VLM, for the cost of a pack (see the module docstring).

    The defaults are Qwen2-VL-7B's (language model 3584 wide, 28 layers, MLP 18944, 4 KV heads of 128,
    vocabulary 152,064; ViT 1280 wide, 32 layers, MLP 5120, full attention).

    Attributes: ``hidden_size``, ``num_layers``, ``intermediate_size``, ``kv_size`` (KV heads x head dim),
    ``vocab_size``, ``gated_mlp``; the vision tower's ``vision_hidden_size``, ``vision_layers``,
    ``vision_intermediate_size``, ``vision_gated_mlp``, ``vision_window`` (patches a windowed layer attends
    within, None: every layer attends over the whole image) and ``vision_full_layers`` (layers with full
    attention when ``vision_window`` is set).
    """

    hidden_size: int = 3584
    num_layers: int = 28
    intermediate_size: int = 18944
    kv_size: int = 512
    vocab_size: int = 152064
    gated_mlp: bool = True
    vision_hidden_size: int = 1280
    vision_layers: int = 32
    vision_intermediate_size: int = 5120
    vision_gated_mlp: bool = False
    vision_window: int | None = None
    vision_full_layers: int = 0

    @classmethod
    def from_config(cls, config: Any) -> PackCost:
        """The widths and depths of a transformers config (``model.config``) or its dict: the language
        model's from ``text_config`` (else the top level: ``hidden_size`` / ``d_model``, ``num_hidden_layers``
        / ``num_layers``, ``intermediate_size``, ``num_key_value_heads``, ``head_dim``, ``vocab_size``), the
        tower's from ``vision_config`` (``depth`` / ``num_hidden_layers``; ``embed_dim`` before
        ``hidden_size``, as Qwen2-VL's ``hidden_size`` there is the merger's output; ``mlp_ratio`` or
        ``intermediate_size``; ``window_size`` / ``patch_size`` and ``fullatt_block_indexes`` for windowed
        towers). A field the config lacks keeps the default."""
        d = cls()
        text = _get(config, "text_config") or config
        h = _int(_get(text, "hidden_size", "d_model", "n_embd"), d.hidden_size)
        heads = _int(_get(text, "num_attention_heads", "n_head"), max(1, h // 128))
        head_dim = _int(_get(text, "head_dim"), max(1, h // heads))
        kv = _int(_get(text, "num_key_value_heads"), heads) * head_dim
        vocab = _int(_get(text, "vocab_size") or _get(config, "vocab_size"), d.vocab_size)
        out = dict(
            hidden_size=h,
            num_layers=_int(_get(text, "num_hidden_layers", "num_layers", "n_layer"), d.num_layers),
            intermediate_size=_int(_get(text, "intermediate_size", "ffn_dim"), 4 * h),
            kv_size=kv,
            vocab_size=vocab,
        )
        vision = _get(config, "vision_config")
        if vision is None:
            return cls(**out)
        v = _int(_get(vision, "embed_dim", "hidden_size", "width"), d.vision_hidden_size)
        ratio = _get(vision, "mlp_ratio") if _get(vision, "embed_dim") is not None else None
        vf = int(v * ratio) if ratio else _int(_get(vision, "intermediate_size"), 4 * v)
        layers = _int(_get(vision, "depth", "num_hidden_layers", "num_layers"), d.vision_layers)
        window, full = None, 0
        window_px, patch = _get(vision, "window_size"), _get(vision, "patch_size")
        if isinstance(window_px, int) and window_px > 0 and patch:
            patch = patch[0] if isinstance(patch, Sequence) else patch
            window = max(1, (window_px // int(patch)) ** 2)
            full = len(_get(vision, "fullatt_block_indexes") or ())
        act = str(_get(vision, "hidden_act") or "")
        out.update(
            vision_hidden_size=v,
            vision_layers=layers,
            vision_intermediate_size=vf,
            vision_gated_mlp=act in ("silu", "swish"),
            vision_window=window,
            vision_full_layers=min(full, layers),
        )
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def sample_costs(self, lengths: np.ndarray, patches: np.ndarray, image_ptr: np.ndarray) -> np.ndarray:
        """float64 ``[N]``: the cost of each sample. ``lengths`` ``[N]`` tokens; ``patches`` ``[M]`` ViT patches
        (before merge) of each image; sample ``i``'s images are ``patches[image_ptr[i]:image_ptr[i+1]]``."""
        s = np.asarray(lengths, dtype=np.float64)
        h, f, m = float(self.hidden_size), float(self.intermediate_size), 3.0 if self.gated_mlp else 2.0
        per_token = self.num_layers * 2.0 * (2.0 * h * h + 2.0 * h * self.kv_size + m * h * f) + 2.0 * h * self.vocab_size
        out = s * per_token + self.num_layers * 2.0 * h * s * s
        p = np.asarray(patches, dtype=np.float64)
        if p.size:
            d, fv = float(self.vision_hidden_size), float(self.vision_intermediate_size)
            mv = 3.0 if self.vision_gated_mlp else 2.0
            linear = self.vision_layers * 2.0 * p * (4.0 * d * d + mv * d * fv)
            if self.vision_window is None:
                attention = self.vision_layers * 4.0 * d * p * p
            else:
                windowed = self.vision_layers - self.vision_full_layers
                attention = 4.0 * d * p * (self.vision_full_layers * p + windowed * np.minimum(p, self.vision_window))
            out = out + _segment_sum(linear + attention, np.asarray(image_ptr, dtype=np.int64))
        return out

    def __call__(self, lengths: np.ndarray, patches: np.ndarray) -> float:
        """The cost of one pack: its samples' lengths ``[n]`` and its images' patches ``[m]``."""
        lengths = np.asarray(lengths)
        ptr = np.zeros(lengths.size + 1, dtype=np.int64)
        ptr[-1] = np.asarray(patches).size
        return float(self.sample_costs(lengths, patches, ptr).sum())


def _segment_sum(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """float64 ``[len(ptr) - 1]``: ``values[ptr[i]:ptr[i+1]].sum()`` for each ``i`` (empty segments: 0)."""
    c = np.zeros(values.size + 1, dtype=np.float64)
    np.cumsum(values, out=c[1:])
    return c[ptr[1:]] - c[ptr[:-1]]


def image_patches(
    image_ptr: np.ndarray, image_tokens: np.ndarray, vision_tokens: np.ndarray, num_patches: np.ndarray
) -> np.ndarray:
    """int64 ``[M]``: ViT patches of each image, from a forecast that gives patches per *sample*
    (``num_patches [N]``) and placeholders per image (``image_tokens [M]``): a sample's patches are shared
    among its images as its placeholders are (exact where every image merges the same way)."""
    ptr = np.asarray(image_ptr, dtype=np.int64)
    owner = np.repeat(np.arange(ptr.size - 1), np.diff(ptr))
    tokens = np.asarray(vision_tokens, dtype=np.float64)[owner]
    share = np.divide(np.asarray(image_tokens, np.float64), tokens, out=np.zeros(owner.size), where=tokens > 0)
    return np.rint(share * np.asarray(num_patches, dtype=np.float64)[owner]).astype(np.int64)


def vision_patches(
    image_ptr: np.ndarray,
    image_tokens: np.ndarray,
    vision_tokens: np.ndarray,
    num_patches: np.ndarray,
    num_videos: np.ndarray | None = None,
    video_groups: np.ndarray | None = None,
    video_group_patches: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(patches int64 [U], ptr int64 [N + 1])``: the vision tower's attention units of each sample, sample
    ``i``'s being ``patches[ptr[i]:ptr[i+1]]``: its images' patches (:func:`image_patches` of the patches
    left after its videos'), then each video's ``t`` frame groups of ``h * w`` patches (``num_videos [N]``,
    ``video_groups [V]`` = ``t``, ``video_group_patches [V]`` = ``h * w``, ``V = num_videos.sum()``; a video
    without a grid, ``t = 0``, adds none). Without grids (None) a sample's patches go to its images."""
    iptr = np.asarray(image_ptr, dtype=np.int64)
    patches = np.asarray(num_patches, dtype=np.int64)
    if num_videos is None or video_groups is None or video_group_patches is None:
        return image_patches(iptr, image_tokens, vision_tokens, patches), iptr
    groups = np.asarray(video_groups, dtype=np.int64)
    per_group = np.asarray(video_group_patches, dtype=np.int64)
    vptr = np.concatenate([[0], np.cumsum(num_videos)]).astype(np.int64)
    if groups.shape != (vptr[-1],) or per_group.shape != groups.shape:
        raise ValueError(
            f"video_groups {groups.shape} / video_group_patches {per_group.shape}: give one entry per video "
            f"({int(vptr[-1])} = num_videos.sum())"
        )
    left = patches - np.rint(_segment_sum((groups * per_group).astype(np.float64), vptr)).astype(np.int64)
    if (left < 0).any():
        i = int(np.flatnonzero(left < 0)[0])
        raise ValueError(f"sample {i}: its videos' grids hold more patches than num_patches[{i}] = {patches[i]}")
    images = image_patches(iptr, image_tokens, vision_tokens, left)
    units = np.repeat(per_group, groups)  # [G]: one entry per frame group
    gptr = np.concatenate([[0], np.cumsum(np.rint(_segment_sum(groups.astype(np.float64), vptr)))]).astype(np.int64)
    n_img, n_grp = np.diff(iptr), np.diff(gptr)
    ptr = np.concatenate([[0], np.cumsum(n_img + n_grp)]).astype(np.int64)
    out = np.empty(int(ptr[-1]), dtype=np.int64)
    owner = np.repeat(np.arange(n_img.size), n_img)
    out[ptr[owner] + np.arange(images.size) - iptr[owner]] = images
    owner = np.repeat(np.arange(n_grp.size), n_grp)
    out[ptr[owner] + n_img[owner] + np.arange(units.size) - gptr[owner]] = units
    return out, ptr


def gather_ragged(values: np.ndarray, ptr: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``index`` ``[K]`` of a ragged array (``values [M]``, row ``i`` = ``values[ptr[i]:ptr[i+1]]``),
    in that order: ``(values [M'], ptr [K + 1])``."""
    ptr = np.asarray(ptr, dtype=np.int64)
    index = np.asarray(index, dtype=np.int64)
    sizes = ptr[index + 1] - ptr[index]
    out_ptr = np.zeros(index.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=out_ptr[1:])
    starts = np.repeat(ptr[index] - out_ptr[:-1], sizes)
    return np.asarray(values)[starts + np.arange(out_ptr[-1])], out_ptr


def pack_costs(
    lengths: np.ndarray,
    bin_ptr: np.ndarray,
    patches: np.ndarray | None = None,
    image_ptr: np.ndarray | None = None,
    cost: PackCost | CostFn | None = None,
) -> np.ndarray:
    """float64 ``[B]``: the cost of each pack.

    Args:
        lengths: int64 ``[N]`` sample lengths, pack by pack; pack ``b`` is ``lengths[bin_ptr[b]:bin_ptr[b+1]]``.
        bin_ptr: int64 ``[B + 1]``.
        patches: int64 ``[M]`` ViT patches of each image, sample by sample (None: no images).
        image_ptr: int64 ``[N + 1]``: sample ``i``'s images are ``patches[image_ptr[i]:image_ptr[i+1]]``.
        cost: a :class:`PackCost` (default ``PackCost()``) or a callable ``(lengths [n], patches [m]) -> float``
            called once per pack.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    bin_ptr = np.asarray(bin_ptr, dtype=np.int64)
    if patches is None:
        patches, image_ptr = np.zeros(0, np.int64), np.zeros(lengths.size + 1, np.int64)
    patches = np.asarray(patches, dtype=np.int64)
    image_ptr = np.asarray(image_ptr, dtype=np.int64)
    if image_ptr.shape != (lengths.size + 1,) or bin_ptr[-1] != lengths.size:
        raise ValueError(
            f"pack_costs: image_ptr has {image_ptr.size} entries and bin_ptr ends at {int(bin_ptr[-1])} for "
            f"{lengths.size} samples: give image_ptr [N + 1] and bin_ptr ending at N"
        )
    cost = PackCost() if cost is None else cost
    if isinstance(cost, PackCost):
        return _segment_sum(cost.sample_costs(lengths, patches, image_ptr), bin_ptr)
    if not callable(cost):
        raise TypeError(f"cost must be a PackCost or a callable (lengths, patches) -> float, got {cost!r}")
    img = image_ptr[bin_ptr]
    return np.array(
        [float(cost(lengths[a:b], patches[c:d])) for (a, b), (c, d) in zip(pairwise(bin_ptr), pairwise(img))],
        dtype=np.float64,
    )
