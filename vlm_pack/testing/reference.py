"""Reference models for the harness: a Megatron-style collapsed-placeholder LLaVA from real transformers parts.

Models that take Megatron-style *collapsed* input (one placeholder token per image, expanded inside
``forward``) plug into ``check_packed_equivalence`` through ``batched_forward=`` / ``packed_forward=``;
``CollapsedLlavaModel`` is such a model, with ``collapsed_batched_forward`` / ``collapsed_packed_forward``::

    collapsed input_ids   t0 t1 <I> t2 | u0 <J> u1                      cu_seqlens (collapsed)  0 4 7
    expanded embeddings   t0 t1 I0 I1 I2 t2 | u0 J0 J1 J2 J3 u1          cu_seqlens (expanded)   0 6 12
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import model_from_config, swap_attn_implementation

__all__ = [
    "CollapsedLlavaModel",
    "CollapsedLlavaOutput",
    "collapsed_batched_forward",
    "collapsed_packed_forward",
]


@dataclass
class CollapsedLlavaOutput:
    """``logits`` (R, Te, V) over the expanded sequence; ``token_index`` (R, Tc): for each collapsed
    position, the expanded position of its last slot (an image's last embedding), whose logits predict the
    next collapsed token. ``collapsed_logits()`` gathers them: (R, Tc, V)."""

    logits: torch.Tensor
    token_index: torch.Tensor

    def collapsed_logits(self) -> torch.Tensor:
        idx = self.token_index.unsqueeze(-1).expand(-1, -1, self.logits.shape[-1])
        return self.logits.gather(1, idx)


class CollapsedLlavaModel(torch.nn.Module):
    """A LLaVA / LLaVA-NeXT that takes Megatron-style collapsed input: one placeholder per image.

    Built around a real transformers ``LlavaForConditionalGeneration`` /
    ``LlavaNextForConditionalGeneration`` (CLIP vision tower, projector, Llama language model), it works
    like Megatron-LM's ``LLaVAModel``: ``forward`` runs the vision tower, expands each placeholder into that
    image's N_i embeddings (LLaVA-NeXT tiles make N_i vary per image) and runs the language model with the
    attention segments and positions taken from the ``cu_seqlens`` it is given, never recomputed::

        collapsed input_ids  t0 t1 <I> t2 u0 <J> u1                     cu_seqlens given: segment ids and
        expanded embeddings  t0 t1 I0 I1 I2 t2 u0 J0 J1 J2 J3 u1         positions restart at each entry
        expanded cu_seqlens  0 .............. 6 ................ 12      (varlen segments or a mask)
        collapsed cu_seqlens 0 ....... 4 ......... 7                    -> wrong boundaries: the bug

    Passed collapsed-space ``cu_seqlens`` (Megatron's bug, seed 004) it silently attends across samples
    and restarts positions at the wrong tokens; remapped ones (``vlm_pack.collate.remap.remap_cu_seqlens``) make it
    exact.

    How the language model attends within the given segments (``attention=``, per model or per call):

    - ``"varlen"`` (default, Megatron's THD path): ``vlm_pack.forward.attention`` varlen attention, registered as
      ``attn_implementation="vlm_pack_varlen"`` for the Llama language model only, fed
      ``cu_seq_lens_q/k`` and ``max_length_q/k`` built from the given ``cu_seqlens``, ``attention_mask=None``:
      no (T, T) mask, no work across segments. Exact: its logits match ``"mask"``'s to fp32 round-off.
    - ``"mask"``: a dense (1, 1, T, T) block-diagonal causal mask through the model's own
      ``attn_implementation`` (sdpa/eager): O(T^2), the independent cross-check of ``"varlen"``.

    Either way the boundaries are the given ``cu_seqlens``; tokens past its last entry form one more segment.
    The CLIP vision tower keeps its own ``attn_implementation``. Without ``cu_seqlens`` it runs a padded
    batch from ``attention_mask`` through the model's own ``attn_implementation`` (the reference forward).
    """

    def __init__(self, model: Any, attention: str = "varlen") -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.image_token_id = int(model.config.image_token_id)
        self.is_next = hasattr(model.config, "image_grid_pinpoints")
        self.attention = _check_attention(attention)

    @classmethod
    def tiny(
        cls,
        tokenizer: Any = None,
        *,
        family: str = "llava_next",
        image_size: int = 56,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        attention: str = "varlen",
        initializer_range: float = 0.2,
        **config_kwargs: Any,
    ) -> CollapsedLlavaModel:
        """A tiny random LLaVA(-NeXT) whose CLIP tower sees ``image_size`` tiles (patch 14).

        ``attn_implementation`` is the HF one (vision tower, padded reference, ``attention="mask"``);
        ``attention`` how packed rows attend (see the class docstring).

        LLaVA-NeXT's pinpoints are scaled to the tile (the released 336-px grid at ``image_size``), so an
        image becomes 3-5 tiles and (image_size/14)^2 base embeddings plus its unpadded grid; use
        ``image_processor_overrides()`` to build the matching image processor.
        """
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

        from vlm_pack import offline
        from vlm_pack.families import canonical, names

        family = str(canonical(family))  # any spelling: "LLaVA-1.6"
        model_name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(family)
        if model_name not in _MODELS:
            drives = [f for f in names() if MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(f) in _MODELS]
            raise ValueError(
                f"CollapsedLlavaModel.tiny: family must be one of {', '.join(drives)}, got {family!r}"
            )
        model_cls = getattr(transformers, model_name)
        if image_size % 14:
            raise ValueError(f"image_size must be a multiple of the patch size 14, got {image_size}")
        tok = tokenizer if tokenizer is not None else offline.build_tokenizer(family)
        config = offline.tiny_model_config(family, tok, initializer_range=initializer_range, **config_kwargs)
        config.vision_config.image_size = image_size
        config.image_seq_length = (image_size // 14) ** 2
        if model_name == "LlavaNextForConditionalGeneration":
            config.image_grid_pinpoints = _scaled_pinpoints(image_size)
        torch.manual_seed(seed)
        model = model_from_config(model_cls, config, attn_implementation=attn_implementation, dtype=torch.float32)
        return cls(model.eval(), attention=attention)

    def image_processor_overrides(self) -> dict[str, Any]:
        """``offline.image_processor(family, **overrides)`` arguments matching this model's tile size."""
        size = int(self.config.vision_config.image_size)
        out: dict[str, Any] = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}
        if self.is_next:
            out["image_grid_pinpoints"] = [list(p) for p in self.config.image_grid_pinpoints]
        return out

    def image_embeddings(
        self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Per-image embeddings, each (N_i, hidden), in image order."""
        inner = self.model.model
        if self.is_next:
            if image_sizes is None:
                raise ValueError("LLaVA-NeXT needs image_sizes (n_images, 2) with pixel_values")
            out = inner.get_image_features(pixel_values, image_sizes=image_sizes)
        else:
            out = inner.get_image_features(pixel_values)
        return list(out.pooler_output)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        tokens_per_image: torch.Tensor | None = None,
        attention: str | None = None,
    ) -> CollapsedLlavaOutput:
        """Expand the placeholders, then attend within the ``cu_seqlens`` segments (or the padded rows).

        Args:
            input_ids: (R, Tc) collapsed ids, one ``image_token_id`` per image; R must be 1 with
                ``cu_seqlens`` (Megatron's THD packing: one flattened row).
            pixel_values: LLaVA (n, 3, S, S) or LLaVA-NeXT (n, tiles, 3, S, S), images in placeholder order.
            image_sizes: (n, 2) LLaVA-NeXT original (height, width).
            attention_mask: (R, Tc) 1 = real token, for the padded reference batch (no ``cu_seqlens``).
            cu_seqlens: (S+1,) sample boundaries in the *expanded* row, used as given: attention never
                crosses them and positions restart at each.
            tokens_per_image: (n,) expected embeddings per image; checked against the vision tower.
            attention: ``"varlen"`` or ``"mask"`` for this call (default: the model's ``attention``).

        Returns:
            ``CollapsedLlavaOutput`` with expanded ``logits`` (R, Te, V) and ``token_index`` (R, Tc).
        """
        embeds, valid_slots, token_index = self._expand(
            input_ids, pixel_values, image_sizes, tokens_per_image
        )
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"with cu_seqlens, input_ids must be one flattened row (1, T); got {input_ids.shape[0]} rows"
                )
            mode = self.attention if attention is None else _check_attention(attention)
            hidden = self._segment_hidden(embeds, cu_seqlens.to(input_ids.device), mode)
        else:
            real = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            hidden = self._padded_hidden(embeds, valid_slots(real))
        logits = self.model.lm_head(hidden.last_hidden_state)
        return CollapsedLlavaOutput(logits=logits, token_index=token_index)

    def _expand(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        image_sizes: torch.Tensor | None,
        tokens_per_image: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        """Embeddings of the expanded rows (R, Te, hidden), a map of a collapsed (R, Tc) mask onto them, and
        ``token_index`` (R, Tc): the expanded slot of each collapsed token's last embedding."""
        rows, tc = input_ids.shape
        device = input_ids.device
        is_image = input_ids == self.image_token_id
        text = self.model.get_input_embeddings()(input_ids.masked_fill(is_image, 0))
        counts = torch.ones_like(input_ids)
        feats = None
        num_images = int(is_image.sum())
        if num_images:
            if pixel_values is None:
                raise ValueError(f"input_ids hold {num_images} image placeholder(s) but no pixel_values")
            per_image = self.image_embeddings(pixel_values, image_sizes)
            if len(per_image) != num_images:
                raise ValueError(f"{num_images} image placeholders but {len(per_image)} images")
            sizes = torch.tensor([f.shape[0] for f in per_image], device=device)
            if tokens_per_image is not None and not torch.equal(sizes.cpu(), tokens_per_image.cpu()):
                raise ValueError(
                    f"tokens_per_image {tokens_per_image.tolist()} disagrees with the vision tower's "
                    f"{sizes.tolist()} embeddings per image"
                )
            counts[is_image] = sizes
            feats = torch.cat(per_image).to(text.dtype)
        # expanded position e <- collapsed position src[e]; token t's last slot is cumsum(counts) - 1.
        row_len = counts.sum(1)
        te = int(row_len.max())
        src = torch.repeat_interleave(torch.arange(rows * tc, device=device), counts.flatten())
        row = torch.div(src, tc, rounding_mode="floor")
        row_start = torch.cumsum(row_len, 0) - row_len
        col = torch.arange(src.numel(), device=device) - row_start[row]
        embeds = text.new_zeros(rows, te, text.shape[-1])
        embeds[row, col] = text.flatten(0, 1)[src]
        if feats is not None:
            slot = is_image.flatten()[src]
            embeds[row[slot], col[slot]] = feats

        def valid_slots(collapsed_mask: torch.Tensor) -> torch.Tensor:
            valid = torch.zeros(rows, te, dtype=torch.long, device=device)
            valid[row, col] = collapsed_mask.flatten()[src].long()
            return valid

        return embeds, valid_slots, torch.cumsum(counts, 1) - 1

    def _segment_hidden(self, embeds: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> Any:
        """The language model on one expanded row (1, Te, hidden), attending within the given segments."""
        lm = self.model.model.language_model
        length = embeds.shape[1]
        if mode == "mask":
            mask, position_ids = _segment_mask_and_positions(cu_seqlens, length, embeds.dtype)
            return lm(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False)
        cu, position_ids = _segment_bounds_and_positions(cu_seqlens, length)
        longest = int((cu[1:] - cu[:-1]).max())
        # The names transformers' varlen path reads; no attention_mask, so no (T, T) mask is built.
        bounds = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        with _attn_implementation(lm.config, _varlen_implementation()):
            return lm(
                inputs_embeds=embeds,
                attention_mask=None,
                position_ids=position_ids,
                use_cache=False,
                **bounds,
            )

    def _padded_hidden(self, embeds: torch.Tensor, valid: torch.Tensor) -> Any:
        """The language model on padded expanded rows (R, Te, hidden); ``valid`` (R, Te) marks real slots."""
        position_ids = (valid.cumsum(1) - 1).clamp(min=0)
        lm = self.model.model.language_model
        return lm(inputs_embeds=embeds, attention_mask=valid, position_ids=position_ids, use_cache=False)


#: The transformers classes whose parts ``CollapsedLlavaModel`` drives: LLaVA, LLaVA-NeXT.
_MODELS = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")


def _scaled_pinpoints(image_size: int) -> list[list[int]]:
    # LLaVA-v1.6's pinpoints in units of its 336-px tile.
    return [[h * image_size, w * image_size] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


_ATTENTION_MODES = ("varlen", "mask")


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTION_MODES:
        raise ValueError(
            f"attention must be 'varlen' (vlm_pack.forward.attention varlen kernels) or 'mask' (dense block-diagonal "
            f"mask), got {attention!r}"
        )
    return attention


def _varlen_implementation() -> str:
    from vlm_pack.forward.attention import register_hf_attention

    return register_hf_attention()


@contextlib.contextmanager
def _attn_implementation(config: Any, name: str):
    """Run the language model (whose ``config`` this is) with attention ``name`` for one call, then restore.

    Only the text config changes: the vision tower reads its own ``vision_config``, and the padded reference
    forward keeps the model's implementation, so varlen packing is checked against an independent kernel.
    """
    before = swap_attn_implementation(config, name)
    try:
        yield
    finally:
        swap_attn_implementation(config, before)


def _segment_bounds_and_positions(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` (S+1,) closed over a row of ``length`` tokens -> (S+1 or S+2,) int32, and positions (1, T).

    Tokens past the last entry form one more segment (as in ``_segment_mask_and_positions``), so collapsed
    cu_seqlens (Megatron's bug) still run, wrongly, as they do in Megatron::

        cu_seqlens [0, 3, 5], length 6     ->     cu [0, 3, 5, 6]      pos  0 1 2 0 1 0
    """
    last = int(cu_seqlens[-1])
    if last > length:
        raise ValueError(
            f"cu_seqlens ends at {last} but the expanded row has {length} tokens; pass cu_seqlens of the "
            "expanded row (vlm_pack.collate.remap.remap_cu_seqlens) or the batch's cu_seqlens_padded_expanded"
        )
    cu = cu_seqlens.to(torch.int32)
    if last < length:
        cu = torch.cat([cu, cu.new_tensor([length])])
    t = torch.arange(length, device=cu.device)
    seg = (torch.searchsorted(cu, t.to(cu.dtype), right=True) - 1).clamp(min=0)
    return cu, (t - cu[seg])[None]


def _segment_mask_and_positions(
    cu_seqlens: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal causal additive mask (1, 1, T, T) and positions (1, T) from ``cu_seqlens`` (S+1,).

    ::

        cu_seqlens [0, 3, 5]      seg  0 0 0 1 1 2      (tokens past the last entry form one more segment)
        length 6                  pos  0 1 2 0 1 0
    """
    t = torch.arange(length, device=cu_seqlens.device)
    bounds = cu_seqlens.long()
    seg = torch.searchsorted(bounds, t, right=True) - 1
    seg = seg.clamp(min=0)
    positions = t - bounds[seg]
    allowed = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None])
    mask = torch.zeros(length, length, dtype=dtype, device=cu_seqlens.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None], positions[None]


def collapsed_batched_forward(model: CollapsedLlavaModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference forward of ``CollapsedLlavaModel`` on ``pad_samples`` inputs: logits (B, Tc, V)."""
    out = model(
        inputs["input_ids"],
        pixel_values=inputs.get("pixel_values"),
        image_sizes=inputs.get("image_sizes"),
        attention_mask=inputs["attention_mask"],
    )
    return out.collapsed_logits()


def collapsed_packed_forward(
    cu_seqlens: str = "remapped", attention: str | None = None
) -> Callable[[Any, Any], torch.Tensor]:
    """Packed forward of ``CollapsedLlavaModel`` on a collapsed-layout ``PackedBatch``: logits (1, Tc, V).

    The collapsed layout is one row (Megatron's THD format, micro batch 1). The model is given:

    - ``cu_seqlens="remapped"``: the batch's collapsed ``cu_seqlens_padded`` passed through
      ``vlm_pack.collate.remap.remap_cu_seqlens`` here (what a correct pipeline does);
    - ``"batch"``: the collator's own ``cu_seqlens_padded_expanded``;
    - ``"collapsed"``: ``cu_seqlens_padded`` as is, in the collapsed space (Megatron's bug, seed 004).

    ``attention`` ("varlen" / "mask") overrides the model's ``attention`` for these calls.
    """
    if cu_seqlens not in ("remapped", "batch", "collapsed"):
        raise ValueError(f"cu_seqlens must be 'remapped', 'batch' or 'collapsed', got {cu_seqlens!r}")
    if attention is not None:
        _check_attention(attention)

    def forward(model: CollapsedLlavaModel, batch: Any) -> torch.Tensor:
        ids = batch.input_ids
        if ids.shape[0] != 1:
            raise ValueError(f"a collapsed-layout batch is one row, got input_ids {tuple(ids.shape)}")
        tokens_per_image = batch.tokens_per_image
        if cu_seqlens == "collapsed":
            cu = batch.cu_seqlens_padded
        elif cu_seqlens == "batch":
            cu = batch.cu_seqlens_padded_expanded
        else:
            from vlm_pack.collate.remap import remap_cu_seqlens

            cu = batch.cu_seqlens_padded
            if tokens_per_image is not None:
                cu = remap_cu_seqlens(cu, ids, model.image_token_id, tokens_per_image)
        out = model(
            ids,
            pixel_values=batch.pixel_values,
            image_sizes=batch.image_sizes,
            cu_seqlens=cu,
            tokens_per_image=tokens_per_image,
            attention=attention,
        )
        return out.collapsed_logits()

    return forward
