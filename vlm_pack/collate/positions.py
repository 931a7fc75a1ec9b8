"""Position ids of packed samples, computed without the model (so it runs in DataLoader workers).

Every packed sample restarts its positions at 0. LLaVA-style models take one row per token::

    tokens        a0 a1 a2 a3 _  | b0 b1 b2 _  _          (_ = padding of the sample before it)
    position_ids   0  1  2  3 4  |  0  1  2 3  4          [R, T]

Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4.1V take four rows (transformers >= 5): row 0 is the plain per-sample
arange (transformers finds the sample boundaries from it: a new sample starts wherever consecutive
positions do not step by 1), rows 1-3 are the sample's own multimodal RoPE (temporal, height, width), as
``model.model.get_rope_index`` computes it for that sample alone::

    sample        t  t  <vs> I  I  I  I  I  I  <ve> t  t        one image, llm grid (1, 2, 3)
    row 0 text    0  1  2    3  4  5  6  7  8  9    10 11
    row 1 t       0  1  2    3  3  3  3  3  3  6    7  8
    row 2 h       0  1  2    3  3  3  4  4  4  6    7  8
    row 3 w       0  1  2    3  4  5  3  4  5  6    7  8

    text continues after an image at image_start + max(grid_h, grid_w) / merge (here 3 + 3 = 6).

The rules of transformers 5.23 (``get_rope_index`` + ``get_vision_position_ids``), reproduced here:

- a sample is cut into runs of equal ``mm_token_type_ids`` (0 text, 1 image, 2 video); a text run
  continues the arange; each vision run takes the next grid of its modality, in order;
- a vision run of llm grid ``(t, h, w)`` (``h``, ``w`` divided by the spatial merge size) gets
  ``t_pos = floor(t_index * interval) + start``, ``h_pos = h_index + start``, ``w_pos = w_index + start``,
  and the next run starts at ``start + max(h, w)`` (not ``t``);
- Qwen2-VL: ``interval = 1``; Qwen2.5-VL: ``interval = tokens_per_second * second_per_grid_ts`` for videos
  (float32, as in the model), 1 for images; Qwen3-VL: each video frame is its own run of ``t = 1``
  (timestamps separate the frames in the text).

Padding tokens are text: they continue their sample's positions on every row, exactly as
``get_rope_index`` would number them, so padding to a multiple for context parallelism never breaks
the 4-row ids. Everything is one pass of vectorised torch over the packed buffer: no Python loop over
tokens, runs or samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict, Unpack

import torch

from ..families import DEFAULT_FAMILY, canonical, lookup, names, require
from .remap import segment_ids

__all__ = [
    "MRopeOptions",
    "is_mrope_family",
    "mrope_position_ids",
    "packed_mrope_position_ids",
    "packed_position_ids",
    "text_position_ids",
]


class MRopeOptions(TypedDict, total=False):
    """The keyword arguments that find and number a sample's vision tokens (see
    :func:`packed_mrope_position_ids`); ``mrope_position_ids`` and ``packed_position_ids`` pass them on."""

    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    mm_token_type_ids: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    second_per_grid_ts: torch.Tensor | Sequence[float] | None
    spatial_merge_size: int
    tokens_per_second: float | None


def is_mrope_family(family: str | None) -> bool:
    """Whether ``family`` (a model_type, in any spelling: ``"Qwen2-VL"``) takes 4-row multimodal RoPE
    position ids (its registry record's ``mrope``); False for a model type vlm-pack has no rule for."""
    record = lookup(family)
    return record is not None and record.mrope is not None


def _variant(family: str) -> str:
    """The ``get_rope_index`` variant of ``family`` (``vlm_pack.families.Family.mrope``)."""
    return str(require(family, "mrope", "multimodal RoPE").mrope)


def text_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per-sample ``arange`` over a packed buffer: int64 ``[total]``.

    ``cu_seqlens`` ``[N + 1]`` are sample offsets (use ``cu_seqlens_padded`` so padding continues its
    sample); positions past ``cu_seqlens[-1]`` continue the last sample.
    """
    cu = cu_seqlens.to(torch.int64)
    n = cu.numel() - 1
    if n < 1:
        return torch.arange(total, dtype=torch.int64, device=cu.device)
    seg = segment_ids(cu, total).clamp_(max=n - 1)
    return torch.arange(total, dtype=torch.int64, device=cu.device) - cu[seg]


def _token_types(
    ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_token_id: int | None,
    video_token_id: int | None,
) -> torch.Tensor:
    if mm_token_type_ids is not None:
        types = mm_token_type_ids.reshape(-1).to(device=ids.device, dtype=torch.int64)
        if types.numel() != ids.numel():
            raise ValueError(
                f"mm_token_type_ids has {types.numel()} entries but input_ids {ids.numel()}: one per token"
            )
        if types.numel() and bool(((types < 0) | (types > 2)).any()):
            raise ValueError("mm_token_type_ids must hold 0 (text), 1 (image) or 2 (video)")
        return types
    if image_token_id is None:
        raise ValueError("give image_token_id (or mm_token_type_ids) to find the vision tokens")
    types = (ids == image_token_id).to(torch.int64)
    if video_token_id is not None:
        types = types + 2 * (ids == video_token_id).to(torch.int64)
    return types


def _as_grid(grid: torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor:
    if grid is None:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    grid = torch.as_tensor(grid).to(device=device, dtype=torch.int64)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ValueError(f"{name} must have shape (num, 3) of (t, h, w), got {tuple(grid.shape)}")
    return grid


def _video_intervals(
    variant: str,
    n_videos: int,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None,
    tokens_per_second: float | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Qwen2.5-VL temporal step per video (float tensor), or None where the step is 1."""
    if variant != "qwen2_5_vl" or n_videos == 0:
        return None
    if tokens_per_second is None:
        raise ValueError(
            "Qwen2.5-VL videos need tokens_per_second (config.vision_config.tokens_per_second, 2 in the "
            "released checkpoints) to space their temporal positions"
        )
    if second_per_grid_ts is None:
        # The model's default: one second per grid, so the step is tokens_per_second itself.
        return torch.full((n_videos,), tokens_per_second, dtype=torch.float64, device=device)
    if isinstance(second_per_grid_ts, torch.Tensor):
        spg = second_per_grid_ts.reshape(-1).to(device)
        if not spg.dtype.is_floating_point:
            spg = spg.to(torch.float32)
        iv = tokens_per_second * spg  # in the tensor's dtype, as the model multiplies it
    else:
        # A Python float list: the model multiplies in float64 and rounds to float32 on use.
        iv = torch.tensor(
            [tokens_per_second * float(x) for x in second_per_grid_ts], dtype=torch.float64, device=device
        ).to(torch.float32)
    if iv.numel() != n_videos:
        raise ValueError(
            f"second_per_grid_ts has {iv.numel()} entries for {n_videos} video(s): one per video"
        )
    return iv


def packed_mrope_position_ids(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    *,
    image_token_id: int | None = None,
    video_token_id: int | None = None,
    vision_start_token_id: int | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
    spatial_merge_size: int = 2,
    tokens_per_second: float | None = None,
    family: str = DEFAULT_FAMILY,
) -> torch.Tensor:
    """mRoPE rows 1-3 of a packed buffer: int64 ``[3, L]``, each sample numbered on its own.

    Args:
        input_ids: ``[L]`` or ``[R, T]`` (flattened row-major) token ids, expanded layout.
        cu_seqlens: ``[N + 1]`` sample offsets partitioning the buffer (``cu_seqlens_padded``); None for
            one sample. Padding inside a sample's span is text and continues its numbering.
        image_grid_thw: ``[num_images, 3]`` grids of every image, in buffer order.
        image_token_id / video_token_id: to find the vision tokens when ``mm_token_type_ids`` is not given.
        vision_start_token_id: if given, check that every vision run follows a ``<|vision_start|>``.
        mm_token_type_ids: ``[L]`` 0 text / 1 image / 2 video (what the model itself reads).
        video_grid_thw / second_per_grid_ts: videos' grids and (Qwen2.5-VL) seconds per temporal grid.
        spatial_merge_size: ``config.vision_config.spatial_merge_size`` (2 in all released Qwen-VL).
        tokens_per_second: Qwen2.5-VL ``config.vision_config.tokens_per_second`` (videos only).
        family: a family with mRoPE (``vlm_pack.families.names("mrope")``: Qwen2/2.5/3-VL, GLM-4.1V).

    Raises:
        ValueError: naming the sample when a vision run does not match its grid, or when the number of
            vision runs and grids differ.
    """
    variant = _variant(family)
    ids = input_ids.reshape(-1)
    length = ids.numel()
    device = ids.device
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, length], dtype=torch.int64, device=device)
    merge = int(spatial_merge_size)
    if merge < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {merge}")
    if length == 0:
        return torch.zeros(3, 0, dtype=torch.int64, device=device)
    types = _token_types(ids, mm_token_type_ids, image_token_id, video_token_id)
    runs = _Runs.of(types, segment_ids(cu_seqlens.to(device=device, dtype=torch.int64), length))
    images = _as_grid(image_grid_thw, "image_grid_thw", device)
    videos = _as_grid(video_grid_thw, "video_grid_thw", device)
    intervals = _video_intervals(variant, videos.shape[0], second_per_grid_ts, tokens_per_second, device)
    grid = _run_grids(runs, variant, images, videos)
    llm_grid = torch.stack([grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge], 1)
    _check_vision_runs(runs, grid, llm_grid, merge, ids, vision_start_token_id)
    return _run_positions(runs, llm_grid, intervals)


class _Runs:
    """Maximal stretches of one modality inside one sample of a packed buffer of ``L`` tokens.

    ``starts`` / ``lens`` / ``kind`` (0 text, 1 image, 2 video) / ``sample`` are ``[num_runs]``;
    ``of_token`` ``[L]`` is the run of every token.
    """

    def __init__(
        self,
        starts: torch.Tensor,
        length: int,
        kind: torch.Tensor,
        sample: torch.Tensor,
        of_token: torch.Tensor,
    ) -> None:
        self.starts, self.kind, self.sample, self.of_token = starts, kind, sample, of_token
        self.lens = torch.diff(starts, append=torch.tensor([length], device=starts.device))
        self.is_vision = kind > 0

    @classmethod
    def of(cls, types: torch.Tensor, seg: torch.Tensor) -> _Runs:
        new_run = torch.ones_like(types, dtype=torch.bool)
        new_run[1:] = (types[1:] != types[:-1]) | (seg[1:] != seg[:-1])
        starts = torch.nonzero(new_run).squeeze(1)
        return cls(starts, types.numel(), types[starts], seg[starts], torch.cumsum(new_run, 0) - 1)


def _run_grids(runs: _Runs, variant: str, img: torch.Tensor, vid: torch.Tensor) -> torch.Tensor:
    """The (t, h, w) grid of every run ``[num_runs, 3]`` (zeros for text), checked: one grid per run."""
    if variant == "qwen3_vl" and vid.numel():
        # Qwen3-VL: timestamps split a video into one run per temporal grid.
        vid = torch.repeat_interleave(vid, vid[:, 0], dim=0)
        vid[:, 0] = 1
    grid = torch.zeros(runs.starts.numel(), 3, dtype=torch.int64, device=runs.starts.device)
    for kind, name, grids in ((1, "image", img), (2, "video", vid)):
        of_kind = runs.kind == kind
        n_runs = int(of_kind.sum())
        if n_runs != grids.shape[0]:
            raise ValueError(
                f"the token ids hold {n_runs} {name} run(s) but {grids.shape[0]} {name} grid(s) were given: "
                f"every {name} needs its grid and its block of {name} tokens (between <|vision_start|> and "
                "<|vision_end|>), in the same order"
            )
        grid[of_kind] = grids
    return grid


def _check_vision_runs(
    runs: _Runs,
    grid: torch.Tensor,
    llm_grid: torch.Tensor,
    merge: int,
    ids: torch.Tensor,
    vision_start_token_id: int | None,
) -> None:
    """Every vision run holds ``t * h * w`` tokens of its llm grid and (if asked) follows <|vision_start|>."""
    tokens = llm_grid.prod(-1)
    bad = runs.is_vision & (runs.lens != tokens)
    if bool(bad.any()):
        r = int(torch.nonzero(bad)[0, 0])
        kind = "image" if int(runs.kind[r]) == 1 else "video"
        raise ValueError(
            f"sample {int(runs.sample[r])}: an {kind} block of {int(runs.lens[r])} tokens has grid "
            f"{tuple(grid[r].tolist())} (merge {merge}), which makes {int(tokens[r])} tokens: the "
            "placeholders were expanded for another image size or merge size"
        )
    if vision_start_token_id is None:
        return
    before = (runs.starts - 1).clamp(min=0)
    seg = runs.sample[runs.of_token[before]]
    bad = runs.is_vision & (
        (runs.starts == 0) | (ids[before] != vision_start_token_id) | (seg != runs.sample)
    )
    if bool(bad.any()):
        r = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"sample {int(runs.sample[r])}: a vision block at offset {int(runs.starts[r])} does not follow "
            "<|vision_start|>; the chat template wraps every image in <|vision_start|> ... <|vision_end|>"
        )


def _run_positions(runs: _Runs, llm_grid: torch.Tensor, intervals: torch.Tensor | None) -> torch.Tensor:
    """Rows 1-3 ``[3, L]``: text continues the arange, a vision run numbers its grid from the run start."""
    _, gh, gw = llm_grid.unbind(1)
    # Start position of every run, restarting at each sample.
    advance = torch.where(runs.is_vision, torch.maximum(gh, gw), runs.lens)
    before = torch.cumsum(advance, 0) - advance
    first_of_sample = torch.ones_like(runs.is_vision)
    first_of_sample[1:] = runs.sample[1:] != runs.sample[:-1]
    sample_base = torch.cummax(torch.where(first_of_sample, before, 0), 0).values  # `before` never decreases
    run_pos = before - sample_base

    tok_run = runs.of_token
    j = torch.arange(tok_run.numel(), device=tok_run.device) - runs.starts[tok_run]
    base = run_pos[tok_run]
    tok_vision = runs.is_vision[tok_run]
    w = gw[tok_run].clamp(min=1)
    h = gh[tok_run].clamp(min=1)
    t_idx = j // (h * w)
    is_video = runs.kind == 2
    if intervals is not None and bool(is_video.any()):
        # Qwen2.5-VL videos: floor(t_index * interval) in the interval's float dtype.
        run_iv = torch.ones(runs.starts.numel(), dtype=intervals.dtype, device=intervals.device)
        run_iv[is_video] = intervals
        t_scaled = (t_idx.to(intervals.dtype) * run_iv[tok_run]).long()
        t_idx = torch.where(runs.kind[tok_run] == 2, t_scaled, t_idx)
    text = base + j
    return torch.stack(
        [
            torch.where(tok_vision, base + t_idx, text),
            torch.where(tok_vision, base + (j // w) % h, text),
            torch.where(tok_vision, base + j % w, text),
        ]
    )


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    *,
    family: str = DEFAULT_FAMILY,
    **options: Unpack[MRopeOptions],
) -> torch.Tensor:
    """mRoPE position ids of ONE sample, int64 ``[3, L]``: equal to ``model.model.get_rope_index(...)[0]``.

    ``input_ids`` is ``[L]`` or ``[1, L]``; ``options`` as in :func:`packed_mrope_position_ids`.
    """
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(
            f"mrope_position_ids takes one sample ([L] or [1, L]), got {tuple(input_ids.shape)}; "
            "use packed_mrope_position_ids for a packed buffer"
        )
    return packed_mrope_position_ids(input_ids.reshape(-1), None, image_grid_thw, family=family, **options)


def packed_position_ids(
    input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    family: str | None = None,
    image_grid_thw: torch.Tensor | None = None,
    **options: Unpack[MRopeOptions],
) -> torch.Tensor:
    """Position ids of a packed batch in the shape the model takes.

    ``input_ids`` ``[R, T]`` (or ``[L]``); ``cu_seqlens_padded`` ``[N + 1]`` partitions the flattened
    buffer. Returns ``[R, T]`` per-sample aranges, or for a Qwen-VL ``family`` ``[4, R, T]`` (row 0 the
    arange, rows 1-3 :func:`packed_mrope_position_ids` of ``image_grid_thw`` and ``options``). ``family``
    in any spelling (``"Qwen2-VL"``); a name that is no known family raises ValueError listing them.
    """
    family = canonical(family)  # a misspelt name would silently give 1-D positions: refused
    shape = tuple(input_ids.shape)
    total = input_ids.numel()
    text = text_position_ids(cu_seqlens_padded.to(input_ids.device), total)
    if not is_mrope_family(family):
        if image_grid_thw is not None:
            raise ValueError(
                f"image_grid_thw was given but family {family!r} has no multimodal RoPE: pass one of "
                f"{', '.join(names('mrope'))} to get 4-row position ids"
            )
        return text.reshape(shape)
    rope = packed_mrope_position_ids(input_ids, cu_seqlens_padded, image_grid_thw, family=family, **options)
    return torch.cat([text[None], rope], 0).reshape((4, *shape))
