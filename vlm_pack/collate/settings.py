"""What the collator needs to know about the model, read once from the explicit values, the model's config and
the tokenizer: :class:`CollatorSettings`.

Every setting is looked up in one table (:data:`SOURCES`): an explicit value wins, then the places listed,
first to last, then the default. The model's config comes before the tokenizer for token ids (a processor
may scatter features into another token than its tokenizer names) and after it for ``pad_token_id`` (the
tokenizer pads)::

    setting                 looked up in (first hit wins)                                       default
    image_token_id          config.image_token_id, config.image_token_index, tok.image_token_id   None
    video_token_id          config.video_token_id, tok.video_token_id                             None
    vision_start_token_id   config.vision_start_token_id, tok.vision_start_token_id               None
    pad_token_id            tok.pad_token_id, text_config.pad_token_id, config.pad_token_id       0
    spatial_merge_size      vision_config.spatial_merge_size, image_processor.merge_size          2
    tokens_per_second       vision_config.tokens_per_second                                       None
    image_seq_length        config.image_seq_length                                               None
    sliding_window          text_config.sliding_window, config.sliding_window                     None
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..families import canonical, lookup, names
from ..forward.packed_calls import guard_packed_calls
from ..model_types import check_not_refused
from .positions import is_mrope_family

__all__ = ["SOURCES", "CollatorSettings"]

# setting -> ((place, attribute), ...) in lookup order, and the default; places are resolved by ``_places``.
SOURCES: dict[str, tuple[tuple[tuple[str, str], ...], Any]] = {
    "image_token_id": (
        (("config", "image_token_id"), ("config", "image_token_index"), ("tokenizer", "image_token_id")),
        None,
    ),
    "video_token_id": ((("config", "video_token_id"), ("tokenizer", "video_token_id")), None),
    "vision_start_token_id": (
        (("config", "vision_start_token_id"), ("tokenizer", "vision_start_token_id")),
        None,
    ),
    "pad_token_id": (
        (("tokenizer", "pad_token_id"), ("text_config", "pad_token_id"), ("config", "pad_token_id")),
        0,
    ),
    "spatial_merge_size": ((("vision_config", "spatial_merge_size"), ("image_processor", "merge_size")), 2),
    "tokens_per_second": ((("vision_config", "tokens_per_second"),), None),
    "image_seq_length": ((("config", "image_seq_length"),), None),
    "sliding_window": ((("text_config", "sliding_window"), ("config", "sliding_window")), None),
}
_FLOATS = ("tokens_per_second",)  # kept as given; every other setting is an int


@dataclass(frozen=True)
class CollatorSettings:
    """The model facts a :class:`~vlm_pack.PackingCollator` lays rows out with (ints and strings: it pickles).

    ``family`` is canonical (``"Qwen2-VL"`` is ``"qwen2_vl"``); ``mrope``: 4-row multimodal RoPE position ids;
    ``two_way_layers``: the layer types whose packed masks let image tokens attend both ways (Gemma 3/4).
    """

    family: str | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    pad_token_id: int = 0
    spatial_merge_size: int = 2
    tokens_per_second: float | None = None
    image_seq_length: int | None = None
    sliding_window: int | None = None
    two_way_layers: tuple[str, ...] = ()
    mrope: bool = False

    @classmethod
    def resolve(
        cls, *, family: str | None = None, tokenizer: Any = None, model_config: Any = None, **explicit: Any
    ) -> CollatorSettings:
        """The settings from ``explicit`` values (a :data:`SOURCES` name each; None: not given), then
        ``model_config`` and ``tokenizer`` (a tokenizer or a processor) as :data:`SOURCES` orders them.

        Raises ``ValueError`` for a family whose packed masks need ``sliding_window`` or the text config's
        two-way switch without them, and for a Qwen-VL vocabulary (a ``vision_start_token_id``) without a
        family; ``TypeError`` for a name that is no setting.
        """
        unknown = sorted(set(explicit) - set(SOURCES))
        if unknown:
            raise TypeError(f"CollatorSettings.resolve: no such setting(s) {unknown}; settings: {sorted(SOURCES)}")
        places = _places(tokenizer, model_config)
        values = {name: _lookup(name, explicit.get(name), places) for name in SOURCES}
        # One spelling everywhere ("Qwen2-VL" is "qwen2_vl"); a config's model_type without a rule is kept.
        resolved = (
            canonical(family)
            or canonical(_attr(model_config, "model_type"), strict=False)
            or canonical(_attr(places["tokenizer"], "vlm_pack_family"))
        )
        check_not_refused(resolved)
        record = lookup(resolved)
        # Armed in the process building the collator, for every family (rows without seq_idx are recognised
        # by their positions): a DataLoader worker's patch (where model_inputs runs) misses the model's process.
        guard_packed_calls()
        if record is not None and record.two_way_images and values["sliding_window"] is None:
            raise ValueError(
                f"family {resolved!r} builds its packed attention masks from the text config's "
                "sliding_window: pass model_config=model.config (or sliding_window=)"
            )
        if resolved is None and values["vision_start_token_id"] is not None:
            # <|vision_start|> marks a Qwen-VL vocabulary: 1-D positions would silently disable the packed
            # mask (the model then sees no text row) and, for Qwen3-VL, the image mRoPE.
            raise ValueError(
                "the tokenizer/config has a vision_start_token_id (a Qwen-VL model) but no family: pass "
                f"model_config=model.config or family= one of {', '.join(names('mrope'))} so that position_ids "
                "get the 4-row multimodal RoPE"
            )
        two_way = _two_way_layers(record, resolved, model_config, places["text_config"])
        return cls(family=resolved, two_way_layers=two_way, mrope=is_mrope_family(resolved), **values)

    @property
    def unrecorded(self) -> bool:
        """A model type without a record (``vlm_pack.model_types``): its processor's outputs are the rule."""
        return self.family is not None and lookup(self.family) is None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _attr(obj: Any, *attributes: str) -> Any:
    """The first of ``obj``'s ``attributes`` that is set (not None); None without ``obj``."""
    for name in attributes:
        value = getattr(obj, name, None) if obj is not None else None
        if value is not None:
            return value
    return None


def _places(tokenizer: Any, model_config: Any) -> dict[str, Any]:
    """The objects :data:`SOURCES` names: a processor gives its tokenizer and image processor."""
    return {
        "tokenizer": getattr(tokenizer, "tokenizer", tokenizer),
        "image_processor": getattr(tokenizer, "image_processor", None),
        "config": model_config,
        "text_config": _attr(model_config, "text_config"),
        "vision_config": _attr(model_config, "vision_config"),
    }


def _lookup(name: str, given: Any, places: dict[str, Any]) -> Any:
    """Setting ``name``: ``given``, else its first set attribute in :data:`SOURCES`' places, else its default."""
    lookups, default = SOURCES[name]
    value = given
    for place, attribute in lookups:
        if value is not None:
            break
        value = _attr(places[place], attribute)
    if value is None:
        return default
    return value if name in _FLOATS else int(value)


def _two_way_layers(record: Any, family: str | None, model_config: Any, text_cfg: Any) -> tuple[str, ...]:
    """The layer types whose packed masks let image tokens attend both ways (``Family.two_way_layers``),
    none where the model's config switches that off (Gemma 4's ``use_bidirectional_attention``)."""
    if record is None or not record.two_way_images:
        return ()
    if record.two_way_switch is None:
        return record.two_way_layers
    name, value = record.two_way_switch
    if model_config is None:
        raise ValueError(
            f"family {family!r}: whether image tokens attend both ways is the text config's {name!r}: "
            "pass model_config=model.config"
        )
    setting = _attr(text_cfg, name) if text_cfg is not None else _attr(model_config, name)
    return record.two_way_layers if setting == value else ()
