"""Pack processed image-text samples into rows a vision-language model trains on exactly as on each alone.

``PackingCollator(capacity)`` takes one planned bin, a list of processed samples (``process_sample``
output, or an HF processor's output for one example), and returns a :class:`PackedBatch` of one row in
the order given; ``max_rows=None`` opts into re-packing a list into the rows it needs (in-batch packing),
drawn here: two rows of ``capacity = 16``, ``pad_to_multiple_of = 4`` (every span a multiple of 4)::

    sample        0: a0 a1 I I I a2      1: b0 b1 b2 b3 b4 b5 b6      2: c0 c1 I I
    expanded len  6                      7                            4
    padded len    8                      8                            4

    row 0   input_ids   a0 a1 I  I  I  a2 _  _  | b0 b1 b2 b3 b4 b5 b6 _      (_ = pad_token_id)
            labels      -  a1 -  -  -  a2 -  -  | -  b1 b2 b3 b4 b5 b6 -      (- = -100; HF convention,
            position    0  1  2  3  4  5  6  7  | 0  1  2  3  4  5  6  7       unshifted: the model shifts)
    row 1   input_ids   c0 c1 I  I  _  _  _  _     _  _  _  _  _  _  _  _
            position    0  1  2  3  4  5  6  7     8  9  10 11 12 13 14 15

    sample_index        [0, 1, 2]             packed order (rows sorted by first sample, samples by index)
    row_of_sample       [0, 0, 1]
    seq_lens            [6, 7, 4]             real lengths, int32
    cu_seqlens          [0, 6, 13, 17]        cumulative real lengths (Transformer Engine "thd")
    cu_seqlens_padded   [0, 8, 16, 32]        offsets in the flattened R*T buffer: the tail of a row
                                              belongs to the row's last sample, so rows end on boundaries

- **labels**: -100 on each sample's *first* token (so the model's next-token shift never makes the last
  token of one sample predict the first of the next), on image tokens (as the processor set them) and on
  padding.
- **position_ids** restart at 0 in every sample; padding continues its sample's numbering, so the
  packed-sequence detection of transformers (a new sample wherever positions do not step by 1) keeps it
  inside that sample, where causal attention hides it from every real token. Qwen2/2.5/3-VL get 4 rows
  ``[4, R, T]``: the text arange, then the sample's own multimodal RoPE (``positions.py``).
- **vision tensors** are joined in packed order the way each model reads several samples' images
  (``vision_inputs.py``): concatenated (``image_grid_thw``, ``image_sizes``, OneVision's per-sample
  ``batch_num_images``, InternVL tiles ...), LLaVA-NeXT / OneVision tiles zero-padded to the most tiles,
  Idefics3 / SmolVLM crops and ``pixel_attention_mask`` joined as ``[1, sum N, ...]``, Pixtral images
  zero-padded to the largest height and width (the tower crops each by ``image_sizes``).
- **Gemma 3** keeps ``token_type_ids`` (packed like ``input_ids``) and gets its attention masks from
  ``batch.model_inputs`` (``masks.py``): each image attends to itself both ways, inside its sample only.

Collapsed layout (Megatron style: one placeholder ``P`` per image, the model expands it to
``tokens_per_image[i]`` embeddings; per video, or per temporal group for Qwen3-VL, to
``tokens_per_video_placeholder[j]``): the packs become consecutive segments of ONE row (Megatron's packed
format is "thd" with micro batch 1), each exactly ``T`` tokens long once expanded. Padding is placed in
collapsed space so that every sample's *expanded* span is a multiple of ``pad_to_multiple_of``::

    input_ids (collapsed)       a0 a1 P a2 _ _ | b0 b1 b2 b3 b4 b5 b6 _ | c0 c1 P _ _ _ _ ... _
    cu_seqlens                  [0, 4, 11, 14]        collapsed real lengths
    cu_seqlens_padded           [0, 6, 14, 29]        collapsed offsets
    cu_seqlens_expanded         [0, 6, 13, 17]        what attention must use after expansion
    cu_seqlens_padded_expanded  [0, 8, 16, 32]
    position_ids                expanded space [1, R*T] (or [4, 1, R*T]): what the language model sees

Out comes a ``PackedBatch`` (``batch.py``). Rooms: ``collate_settings`` (the model's facts), ``collate_samples``
(one sample read and checked), ``collate_rows`` (which row each sample lands in), this module (the tensors).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .batch import HF_STYLES, SAMPLE_KEY_NAMES, STYLES, PackedBatch, packed_seq_params_class
from .collate_rows import RowPlan, one_row, repack, row_plan
from .collate_samples import (
    SampleParts,
    TokenFields,
    cat_counts,
    check_video_tokens,
    collapsed_video_counts,
    concat_vision,
    frames_as_images,
    keys_of,
    num_images,
    packed_extras,
    placeholder_counts,
    rename_samples,
    split_fields,
)
from .collate_settings import CollatorSettings
from .families import names
from .labels import IGNORE_INDEX
from .model_types import check_rope_index, rope_index_position_ids
from .packing.bins import round_up
from .positions import MRopeOptions, packed_position_ids
from .processing import length as sample_length  # the one expanded length (and forecast)
from .remap import remap_cu_seqlens_padded
from .vision_inputs import check_patch_rows

if TYPE_CHECKING:
    from .config import PackingConfig

__all__ = [
    "HF_STYLES",
    "STYLES",
    "PackedBatch",
    "PackedSeqParams",  # noqa: F822 - resolved lazily by __getattr__
    "PackingCollator",
    "pad_multiple_for",
]

def __getattr__(name: str) -> Any:
    # ``from vlm_pack.collate import PackedSeqParams`` imports megatron-core here, on first use only.
    if name == "PackedSeqParams":
        return packed_seq_params_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pad_multiple_for(tp: int = 1, cp: int = 1, sequence_parallel: bool = False, fp8: bool = False) -> int:
    """The multiple every packed sample's (expanded) length must be padded to under Megatron parallelism.

    - context parallel (``cp > 1``): each sample is cut into ``2 * cp`` chunks (rank ``r`` holds chunks
      ``r`` and ``2*cp-1-r``), so ``2 * cp``;
    - sequence parallel: every CP chunk is split again over the TP ranks, so ``2 * cp * tp`` (``tp`` alone
      at ``cp == 1``), the rule Megatron Bridge documents and Megatron-LM's multimodal ``get_padding``
      applies. It is a multiple of the looser ``lcm(2*cp, cp*tp)``, so it satisfies both readings;
    - FP8 (Transformer Engine GEMMs need token counts divisible by 16): each rank's local share of the
      sample, ``length / (cp * tp_sp)``, must be a multiple of 16, so ``16 * cp * tp_sp``.

    ``pad_multiple_for(cp=2)`` is 4, ``pad_multiple_for(tp=4, cp=2, sequence_parallel=True)`` is 16; the
    result always passes ``vlm_pack.check_parallel_config``.
    """
    for name, v in (("tp", tp), ("cp", cp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    sp_tp = tp if sequence_parallel and tp > 1 else 1
    multiple = (2 * cp if cp > 1 else 1) * sp_tp
    if fp8:
        multiple = math.lcm(multiple, 16 * cp * sp_tp)
    return multiple


class PackingCollator:
    """Collate a list of processed samples into a :class:`PackedBatch` (or a model-input dict).

    Args:
        capacity: tokens per row, counted in *expanded* length (what the language model runs on).
        family: model type, a ``vlm_pack.families`` name in any spelling (``"qwen2_vl"``, ``"Gemma-3"``):
            its record's ``mrope`` gives Qwen-VL and GLM-4.1V 4-row mRoPE position ids, ``two_way_images``
            Gemma 3 its packed masks. Defaults to ``model_config.model_type`` or the tokenizer's
            ``vlm_pack_family``; without any, 1-D position ids.
        tokenizer: a tokenizer or processor; ids not given explicitly are read from it.
        model_config: the model's config (``model.config``); ids, ``spatial_merge_size``, ``tokens_per_second`` and LLaVA's
            ``image_seq_length`` not given explicitly are read from it (preferred over the tokenizer).
        image_token_id, video_token_id, vision_start_token_id, pad_token_id, spatial_merge_size,
            tokens_per_second, image_seq_length, sliding_window: explicit values (``sliding_window``:
            Gemma 3's text config value, which its packed masks need).
        layout: ``"expanded"`` (samples hold one token per vision embedding, as HF processors make them) or
            ``"collapsed"`` (one placeholder per image, per video or per Qwen3-VL temporal group; samples give
            ``tokens_per_image`` / ``tokens_per_video_placeholder``, or the grids / ``image_seq_length`` count).
        pad_to_multiple_of: every sample's expanded span becomes a multiple of this (see
            :func:`pad_multiple_for`); ``capacity`` must be a multiple of it.
        pad_to_capacity: rows are exactly ``capacity`` long (static shapes); else as long as the fullest row.
        strategy: how re-packing (``max_rows`` None or N, ``collate_rows.repack``) groups samples: ``"bfd"``
            (default, fewest rows), ``"ffd"``, ``"ff"`` (first fit in data order), ``"nf"`` (data order kept
            across rows); inside a row samples keep their input order, rows are sorted by their first sample.
        max_samples_per_bin: optional cap on samples per row (a bin of the plan; ``PackingConfig``'s name).
        max_rows: ``1`` (default): each call is one planned bin (``pack``, ``StreamPacker``, the datasets,
            Energon; :meth:`from_config`), laid out as exactly one row in the order given (``one_row``), or
            the call raises naming its samples (a plan made on other lengths than the rows') instead of
            quietly re-packing. Opt into in-batch packing (an HF ``Trainer``'s ``per_device_train_batch_size``
            samples) with ``max_rows=None`` (as many rows as needed) or ``N`` (at most ``N`` rows).
        return_style: None returns a :class:`PackedBatch`; a style of :data:`STYLES` returns
            ``batch.model_inputs(style)`` (use ``"sdpa"`` etc. as an HF ``Trainer`` ``data_collator``).
        rope_index: a model type without a record, with mRoPE: its model's own (``vlm_pack.model_types``).

    The model's facts (``family``, the token ids, ``spatial_merge_size`` ...) are read once into
    ``settings`` (:class:`~vlm_pack.collate_settings.CollatorSettings`: an explicit value, else the model's
    config, else the tokenizer, as its table says). The collator keeps only ints and strings, so it pickles
    into ``DataLoader`` workers.

    Raises (at call time) ``ValueError`` naming the sample for: a sample longer than ``capacity``, image
    placeholders that do not match the images, a labels/ids length mismatch, an empty sample.
    """

    def __init__(
        self,
        capacity: int,
        *,
        family: str | None = None,
        tokenizer: Any = None,
        model_config: Any = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        vision_start_token_id: int | None = None,
        pad_token_id: int | None = None,
        spatial_merge_size: int | None = None,
        tokens_per_second: float | None = None,
        image_seq_length: int | None = None,
        sliding_window: int | None = None,
        layout: str = "expanded",
        pad_to_multiple_of: int = 1,
        pad_to_capacity: bool = True,
        strategy: str = "bfd",
        max_samples_per_bin: int | None = None,
        max_rows: int | None = 1,
        return_style: str | None = None,
        rope_index: Any = None,
    ) -> None:
        _check_arguments(capacity, layout, pad_to_multiple_of, strategy, return_style)
        if max_rows is not None and (type(max_rows) is not int or max_rows < 1):
            raise ValueError(f"max_rows must be a positive int or None, got {max_rows!r}")
        self.settings = CollatorSettings.resolve(
            family=family,
            tokenizer=tokenizer,
            model_config=model_config,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
            vision_start_token_id=vision_start_token_id,
            pad_token_id=pad_token_id,
            spatial_merge_size=spatial_merge_size,
            tokens_per_second=tokens_per_second,
            image_seq_length=image_seq_length,
            sliding_window=sliding_window,
        )
        self.capacity = capacity
        self.layout = layout
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_to_capacity = bool(pad_to_capacity)
        self.strategy = strategy
        self.max_samples_per_bin = max_samples_per_bin
        self.max_rows = max_rows
        self.return_style = return_style
        check_rope_index(self.settings, rope_index)
        self.rope_index = rope_index

    @classmethod
    def from_config(cls, config: PackingConfig, *, max_rows: int | None = 1, **options: Any) -> PackingCollator:
        """The collator for the bins a plan of ``config`` makes: its ``capacity``, ``pad_to_multiple_of`` and
        ``max_samples_per_bin``, one planned bin per call (``max_rows=1``); ``options`` are the constructor's
        other keywords (``tokenizer=``, ``model_config=``, ``layout=``, ``return_style=`` ...)."""
        return cls(
            config.capacity,
            pad_to_multiple_of=config.pad_to_multiple_of,
            max_samples_per_bin=config.max_samples_per_bin,
            max_rows=max_rows,
            **options,
        )

    # The model's facts, read once into ``settings`` (``collate_settings.SOURCES`` says from where).
    family = property(lambda self: self.settings.family)
    mrope = property(lambda self: self.settings.mrope)
    two_way_layers = property(lambda self: self.settings.two_way_layers)
    image_token_id = property(lambda self: self.settings.image_token_id)
    video_token_id = property(lambda self: self.settings.video_token_id)
    vision_start_token_id = property(lambda self: self.settings.vision_start_token_id)
    pad_token_id = property(lambda self: self.settings.pad_token_id)
    spatial_merge_size = property(lambda self: self.settings.spatial_merge_size)
    tokens_per_second = property(lambda self: self.settings.tokens_per_second)
    image_seq_length = property(lambda self: self.settings.image_seq_length)
    sliding_window = property(lambda self: self.settings.sliding_window)

    def __repr__(self) -> str:
        return (
            f"PackingCollator(capacity={self.capacity}, family={self.family!r}, layout={self.layout!r}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of}, strategy={self.strategy!r})"
        )

    # ------------------------------------------------------------------ per sample
    def _normalise(self, index: int, sample: Mapping[str, Any]) -> SampleParts:
        """One sample checked and in the collator's terms: 1-D ids and labels, vision, extras, lengths."""
        if not isinstance(sample, Mapping):
            raise TypeError(f"sample {index}: expected a dict of tensors, got {type(sample).__name__}")
        key = next(
            (sample[k] for k in SAMPLE_KEY_NAMES if k in sample and not isinstance(sample[k], torch.Tensor)),
            None,
        )
        name = f"sample {index}" + (f" (key {key!r})" if key is not None else "")
        if "input_ids" not in sample:
            raise ValueError(f"{name} has no 'input_ids'")
        tokens = TokenFields(sample, name)
        ids = tokens.ids
        is_image = self._marks(ids, self.image_token_id)
        is_video = self._marks(ids, self.video_token_id)
        if sample.get("labels") is not None:
            labels = tokens(sample["labels"], "labels")
        else:
            labels = ids.masked_fill(is_image | is_video, IGNORE_INDEX)
        types = (
            tokens(sample["mm_token_type_ids"], "mm_token_type_ids")
            if sample.get("mm_token_type_ids") is not None
            else None
        )
        if types is None and self.mrope:
            types = is_image.long() + 2 * is_video.long()
        vision, token_extra, other_extra, metadata = split_fields(sample, tokens)
        check_patch_rows(vision, name)
        unrecorded = self.settings.unrecorded  # its processor's outputs are the rule (vlm_pack.model_types)
        if not self.mrope and not unrecorded and ("image_grid_thw" in vision or "video_grid_thw" in vision):
            raise ValueError(
                f"{name} has image_grid_thw/video_grid_thw (a Qwen-VL sample) but the collator's family is "
                f"{self.family!r}: pass model_config=model.config or family= one of {', '.join(names('mrope'))}; "
                "without the 4-row mRoPE position_ids the packed samples would attend to each other"
            )
        tpi, n_images, tpv, is_video = frames_as_images(
            self.family, *self._image_counts(name, sample, vision), sample, is_video, types
        )
        n_placeholders = int(is_image.sum())
        if n_images and self.image_token_id is None:
            raise ValueError(
                f"{name} has images but the collator knows no image_token_id: pass image_token_id=, "
                "tokenizer= or model_config="
            )
        if n_placeholders and not n_images and not unrecorded:  # its processor may name its images otherwise
            raise ValueError(
                f"{name}: input_ids hold {n_placeholders} image token(s) but the sample has no images "
                "(pixel_values / image_grid_thw): give the images or remove the placeholders"
            )
        expanded_len = self._expanded_length(name, ids, is_video, vision, tpi, n_images, n_placeholders, tpv)
        tpvp = None
        if self.layout == "collapsed":
            tpvp = collapsed_video_counts(name, is_video, vision, tpv, sample.get("tokens_per_video_placeholder"),
                                          self.spatial_merge_size, self.video_token_id)  # fmt: skip
            expanded_len += int(tpvp.sum()) - tpvp.numel() if tpvp is not None else 0
        return SampleParts(
            index=index,
            name=name,
            ids=ids,
            labels=labels,
            types=types,
            expanded_len=expanded_len,
            tokens_per_image=tpi if n_images else None,
            vision=vision,
            token_extra=token_extra,
            other_extra=other_extra,
            metadata=metadata,
            tokens_per_video_placeholder=tpvp,
        )

    @staticmethod
    def _marks(ids: torch.Tensor, token_id: int | None) -> torch.Tensor:
        """``ids == token_id`` (bool ``[L]``); all False when the collator knows no such token."""
        return ids == token_id if token_id is not None else torch.zeros_like(ids, dtype=torch.bool)

    def _image_counts(
        self, name: str, sample: Mapping[str, Any], vision: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, int]:
        """Embeddings per image (``[n]`` long, or None where the sample does not tell) and the image count."""
        tpi = sample.get("tokens_per_image")
        tpi = torch.as_tensor(tpi, dtype=torch.long).reshape(-1) if tpi is not None else None
        n_images, unrecorded = num_images(vision, tpi), self.settings.unrecorded
        grid = vision.get("image_grid_thw") if self.mrope else None  # a record's merge rule; else the processor's
        if grid is not None:
            grid = grid.reshape(-1, 3)
            vision["image_grid_thw"] = grid
            grid_counts = grid.prod(-1) // self.spatial_merge_size**2
            if tpi is not None and not torch.equal(tpi, grid_counts):
                raise ValueError(
                    f"{name}: tokens_per_image {tpi.tolist()} disagrees with image_grid_thw "
                    f"{grid.tolist()} / merge {self.spatial_merge_size}^2 = {grid_counts.tolist()}"
                )
            tpi = grid_counts
        if tpi is None and n_images and self.image_seq_length and "image_sizes" not in vision and not unrecorded:
            tpi = torch.full((n_images,), self.image_seq_length, dtype=torch.long)
        return tpi, n_images

    def _expanded_length(
        self,
        name: str,
        ids: torch.Tensor,
        is_video: torch.Tensor,
        vision: dict[str, torch.Tensor],
        tpi: torch.Tensor | None,
        n_images: int,
        n_placeholders: int,
        tokens_per_video: torch.Tensor | None = None,
    ) -> int:
        """The sample's length once expanded, after checking its placeholders against its images.

        Expanded layout: its own length, every image and video token accounted for by the grids;
        collapsed: one placeholder per image, each becoming its ``tokens_per_image`` (videos: ``_normalise``).
        """
        if self.layout == "expanded":
            if n_images and not n_placeholders:
                raise ValueError(
                    f"{name} has {n_images} image(s) but no image token in input_ids: the text needs a "
                    "placeholder per image (expanded by the processor)"
                )
            if tpi is not None and int(tpi.sum()) != n_placeholders:
                raise ValueError(
                    f"{name}: input_ids hold {n_placeholders} image tokens but its {n_images} image(s) make "
                    f"{int(tpi.sum())} ({tpi.tolist()}): the placeholders were expanded for other images, "
                    "another processor setting or another merge size"
                )
            if self.video_token_id is not None:
                check_video_tokens(name, is_video, vision, tokens_per_video, self.spatial_merge_size)
            return sample_length.expanded_length(ids.numel(), tpi, self.layout)
        if n_placeholders != n_images:
            raise ValueError(
                f"{name}: input_ids hold {n_placeholders} image placeholder(s) but the sample has "
                f"{n_images} image(s): the collapsed layout needs exactly one placeholder per image"
            )
        if n_images and tpi is None:
            raise ValueError(
                f"{name}: the collapsed layout needs tokens_per_image (embeddings each placeholder "
                "becomes); process_sample(..., layout='collapsed') returns it"
            )
        if tpi is not None and bool((tpi < 1).any()):
            raise ValueError(f"{name}: tokens_per_image must be >= 1, got {tpi.tolist()}")
        return sample_length.expanded_length(ids.numel(), tpi if n_images else None, self.layout)

    # ------------------------------------------------------------------ the batch
    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> PackedBatch | dict[str, Any]:
        batch = self.collate(samples)
        return batch if self.return_style is None else batch.model_inputs(self.return_style)

    def collate(self, samples: Sequence[Mapping[str, Any]]) -> PackedBatch:
        """Pack ``samples`` into as few rows as the strategy finds; never drops a sample."""
        if isinstance(samples, Mapping) or not isinstance(samples, Sequence):
            raise TypeError("PackingCollator takes a list of samples (dicts), one per example")
        if len(samples) == 0:
            raise ValueError("PackingCollator got an empty list of samples")
        items = [self._normalise(i, s) for i, s in enumerate(samples)]
        plan = self._plan(items)
        ordered = [items[i] for i in plan.order]
        flat_ids = plan.scatter([s.ids for s in ordered], self.pad_token_id)
        flat_labels = plan.scatter([s.labels for s in ordered], IGNORE_INDEX)
        flat_labels[plan.cu_padded[:-1]] = IGNORE_INDEX  # the next-token shift must not cross into a sample
        flat_types = None
        if any(s.types is not None for s in ordered):
            flat_types = plan.scatter(
                [s.types if s.types is not None else torch.zeros_like(s.ids) for s in ordered], 0
            )
        vision = concat_vision(ordered, self.family)
        tokens_per_image = cat_counts([s.tokens_per_image for s in ordered])
        tokens_per_video = cat_counts([s.tokens_per_video_placeholder for s in ordered])
        shape = (plan.num_rows, plan.row_length) if self.layout == "expanded" else (1, plan.total)
        exp_ids, exp_types, cu_exp, cu_padded_exp = self._expanded_view(
            flat_ids, flat_types, plan, tokens_per_image, tokens_per_video
        )
        position_ids = self._positions(exp_ids, exp_types, cu_padded_exp, vision, shape, plan.order)
        if self.rope_index is not None:  # a model type without a record: its own rope index, per sample
            inputs = [{**s.other_extra, **s.vision} for s in ordered]
            position_ids = rope_index_position_ids(self.rope_index, exp_ids.reshape(shape), cu_padded_exp, inputs,
                                                   position_ids, exp_types, self.layout)
        seq_exp = (cu_exp[1:] - cu_exp[:-1]).to(torch.int32)
        return PackedBatch(
            input_ids=flat_ids.reshape(shape),
            labels=flat_labels.reshape(shape),
            position_ids=position_ids,
            seq_lens=plan.lens.to(torch.int32),
            cu_seqlens=plan.cu_real.to(torch.int32),
            cu_seqlens_padded=plan.cu_padded.to(torch.int32),
            max_seqlen=int(plan.lens.max()),
            sample_index=torch.tensor(plan.order, dtype=torch.int64),
            row_of_sample=torch.tensor(plan.row_of, dtype=torch.int64),
            seq_lens_expanded=seq_exp,
            cu_seqlens_expanded=cu_exp.to(torch.int32),
            cu_seqlens_padded_expanded=cu_padded_exp.to(torch.int32),
            max_seqlen_expanded=int(seq_exp.max()),
            max_seqlen_padded_expanded=int((cu_padded_exp[1:] - cu_padded_exp[:-1]).max()),
            num_rows=plan.num_rows,
            row_length=plan.row_length,
            layout=self.layout,
            family=self.family,
            pad_to_multiple_of=self.pad_to_multiple_of,
            sliding_window=self.sliding_window,
            two_way_layers=self.two_way_layers,
            mm_token_type_ids=flat_types.reshape(shape) if flat_types is not None else None,
            tokens_per_image=tokens_per_image,
            tokens_per_video_placeholder=tokens_per_video,
            extra=packed_extras(ordered, plan, shape),
            metadata={k: [s.metadata.get(k) for s in ordered] for k in keys_of(s.metadata for s in ordered)},
            **vision,
        )

    def _plan(self, items: list[SampleParts]) -> RowPlan:
        """The samples as rows of one flat buffer (``collate_rows``): one planned bin as one row in its given
        order (``max_rows=1``, the default), else (opted in: ``max_rows`` None or N) re-packed into as few
        rows as ``strategy`` finds."""
        from .packing import padded_lengths

        multiple = self.pad_to_multiple_of
        expanded = [s.expanded_len for s in items]
        padded = padded_lengths(expanded, multiple).tolist()  # as every planner does
        for sample, padded_len in zip(items, padded):
            if padded_len > self.capacity:
                pad_note = (
                    f" (padded to {padded_len}, a multiple of {multiple})"
                    if padded_len != sample.expanded_len
                    else ""
                )
                raise ValueError(
                    f"{sample.name} is {sample.expanded_len} tokens long{pad_note} but a row holds capacity="
                    f"{self.capacity}: raise capacity, lower the images' max_pixels, or split/filter long "
                    "samples before collating (vlm_pack.packing.pack(..., oversized='skip') reports them)"
                )
        rows = one_row(padded, self.capacity, self.max_samples_per_bin) if self.max_rows == 1 else None
        if rows is None:
            rows = repack(padded, self.capacity, self.strategy, self.max_samples_per_bin)
            if self.max_rows is not None and len(rows) > self.max_rows:
                raise ValueError(self._too_many_rows(items, padded, len(rows)))
        row_length = self.capacity if self.pad_to_capacity else None
        return row_plan(rows, padded, expanded, [s.ids.numel() for s in items], row_length)

    def _too_many_rows(self, items: list[SampleParts], padded: list[int], num_rows: int) -> str:
        """Why a call of ``max_rows`` rows needs ``num_rows``: its samples, their spans and the fix."""
        multiple = self.pad_to_multiple_of
        names = ", ".join(s.name for s in items)
        spans = [s.expanded_len for s in items]
        padding = f", padded to multiples of {multiple}: {padded}" if padded != spans else ""
        cap = f" and at most {self.max_samples_per_bin} samples" if self.max_samples_per_bin else ""
        return (
            f"{names} need {num_rows} rows of capacity {self.capacity}{cap} (expanded lengths {spans}"
            f"{padding}; {sum(padded)} tokens) but this collator makes at most {self.max_rows} row(s) per call "
            f"(max_rows={self.max_rows}: each call is one planned bin). Plan the bins as the collator lays out "
            f"rows: with its padding (vlm_pack.pack(lengths, {self.capacity}, "
            f"pad_to_multiple_of={multiple}) / PackingConfig(pad_to_multiple_of={multiple})) and the same "
            "max_samples_per_bin; or, to pack a batch of samples inside the collator (in-batch packing, e.g. "
            "an HF Trainer's per_device_train_batch_size samples), opt in with PackingCollator(..., "
            "max_rows=None) (as many rows as the samples need) or max_rows=N (at most N rows)."
        )

    def _expanded_view(
        self,
        flat_ids: torch.Tensor,
        flat_types: torch.Tensor | None,
        plan: RowPlan,
        tokens_per_image: torch.Tensor | None,
        tokens_per_video: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The buffer as the language model sees it: ids, types, ``cu_seqlens``, ``cu_seqlens_padded``.

        The expanded layout already is; a collapsed buffer has each image placeholder repeated
        ``tokens_per_image`` times, each video one ``tokens_per_video`` (per placeholder), boundaries remapped.
        """
        if self.layout == "expanded" or (tokens_per_image is None and tokens_per_video is None):
            return flat_ids, flat_types, plan.cu_real, plan.cu_padded
        kinds = ((self.image_token_id, tokens_per_image), (self.video_token_id, tokens_per_video))
        token_ids, counts, repeats = placeholder_counts(flat_ids, kinds)
        cu_exp, cu_padded_exp = remap_cu_seqlens_padded(
            plan.cu_real, plan.cu_padded, flat_ids, token_ids, counts, validate=False
        )
        exp_ids = torch.repeat_interleave(flat_ids, repeats)
        exp_types = torch.repeat_interleave(flat_types, repeats) if flat_types is not None else None
        return exp_ids, exp_types, cu_exp, cu_padded_exp

    def _positions(
        self,
        exp_ids: torch.Tensor,
        exp_types: torch.Tensor | None,
        cu_padded_exp: torch.Tensor,
        vision: dict[str, torch.Tensor],
        shape: tuple[int, int],
        order: list[int],
    ) -> torch.Tensor:
        """Position ids in expanded space: ``[R, T]`` / ``[4, R, T]`` (collapsed: ``[1, R*T]`` / ``[4, 1, R*T]``)."""
        options: MRopeOptions = {}
        if self.mrope:
            options = MRopeOptions(
                video_grid_thw=vision.get("video_grid_thw"),
                second_per_grid_ts=vision.get("second_per_grid_ts"),
                mm_token_type_ids=exp_types,
                image_token_id=self.image_token_id,
                video_token_id=self.video_token_id,
                # Checks every vision block follows <|vision_start|>, as every Qwen-VL chat template has it.
                vision_start_token_id=self.vision_start_token_id,
                spatial_merge_size=self.spatial_merge_size,
                tokens_per_second=self.tokens_per_second,
            )
        pos_shape = shape if self.layout == "expanded" else (1, exp_ids.numel())
        try:
            return packed_position_ids(
                exp_ids.reshape(pos_shape),
                cu_padded_exp,
                family=self.family if self.mrope else None,
                image_grid_thw=vision.get("image_grid_thw") if self.mrope else None,
                **options,
            )
        except ValueError as e:
            # positions number samples in packed order; name the caller's index instead.
            raise ValueError(rename_samples(str(e), order)) from None


def _check_arguments(
    capacity: int, layout: str, pad_to_multiple_of: int, strategy: str, return_style: str | None
) -> None:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
    if capacity % pad_to_multiple_of:
        raise ValueError(
            f"capacity {capacity} is not a multiple of pad_to_multiple_of {pad_to_multiple_of}: use "
            f"capacity={round_up(capacity, pad_to_multiple_of)} or "
            f"{capacity // pad_to_multiple_of * pad_to_multiple_of}"
        )
    if layout not in ("expanded", "collapsed"):
        raise ValueError(f"layout must be 'expanded' or 'collapsed', got {layout!r}")
    from .packing import STRATEGIES

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if return_style is not None and return_style not in STYLES:
        raise ValueError(f"return_style must be None or one of {STYLES}, got {return_style!r}")
    if return_style in HF_STYLES and layout != "expanded":
        raise ValueError(f"return_style={return_style!r} needs layout='expanded' (HF models expand nothing)")
