"""The checkpoint's parts, held once: what every pipeline forecasts, processes and collates with.

A training job needs the same tokenizer, image processor (or HF processor), chat format and token layout in
three places: the forecast that plans the packs from image headers, the processing of the packed samples, and
the collator. :class:`Preprocessor` holds them once, so the three cannot drift apart (a plan made with one
image processor and rows made with another would silently overflow or underfill every pack)::

    pre = Preprocessor(processor=processor)                   # any family; or tokenizer= + image_processor=
    length, per_image = pre.forecast(conversation, [(640, 480)])   # header sizes only
    sample = pre.process([image], conversation)                    # len(sample["input_ids"]) == length
    collator = pre.collator(8192, model_config=model.config)             # PackingCollator for these parts

Every loader (streaming, map-style, TRL's collator, the Energon encoder; Ray only forecasts, and its plans
are loaded by the map-style dataset) runs the same sample contract: forecast -> process -> one length check,
:meth:`Preprocessor.checked_length`, which measures a processed sample in this preprocessor's layout (a
collapsed sample's placeholders count as the tokens they stand for) against the forecast it was packed on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .failures import SampleError, forecast_mismatch
from .families import canonical, lookup, names
from .processing import length
from .processing.chat import ChatFormat, Conversation, Template
from .processing.length import Forecast
from .processing.render import Prompt, _checked_ids, _embedding_token_id, _placeholder, _render

if TYPE_CHECKING:  # processing a sample needs torch, a forecast does not: a Ray forecast worker never loads it
    import torch

__all__ = ["Preprocessor"]


@dataclass(frozen=True)
class Preprocessor:
    """A checkpoint's text and image parts, held once: what every pipeline forecasts and processes with.

    Give an HF ``processor`` (any family), or ``tokenizer`` + ``image_processor`` (Qwen-style, LLaVA,
    LLaVA-NeXT). ``family`` / ``template`` pick the chat format as for :func:`process_sample` (default: the
    checkpoint's own template, else the tokenizer's ``vlm_pack_family``, else the image processor's family);
    ``layout``: ``"expanded"`` (HF models) or ``"collapsed"`` (one placeholder per image, Megatron style;
    refused for a processor that writes markers between an image's tokens: ``vlm_pack.families``' ``collapsed``).
    ``spec``: the vision spec forecasts use (default: read from the processor; a family's fast rule read so is
    compared with the processor itself on a few sizes first, ``vlm_pack.vision.selfcheck``, and a difference
    raises ``FastRuleMismatch`` naming the family, the transformers release and the size). A ``conversation`` is any
    format the readers take (``{"role", "content"}`` turns, LLaVA ``{"from", "value"}`` turns, a caption
    string): every method normalises it with :func:`vlm_pack.processing.chat.normalise_conversation`, text as written.

    ``forecast(...)`` equals the length ``process(...)`` gives, in the expanded space, for every family::

        pre = Preprocessor(tokenizer=tok, image_processor=ip)
        length, per_image = pre.forecast(conversation, [(640, 480)])   # header sizes only
        sample = pre.process([image], conversation)                    # len(sample["input_ids"]) == length
    """

    tokenizer: Any = None
    image_processor: Any = None
    processor: Any = None
    family: str | None = None
    template: str | ChatFormat | Template | None = None
    layout: str = "expanded"
    spec: Any = None

    def __post_init__(self) -> None:
        from .vision import vision_spec_from_processor

        proc = self.processor
        if proc is not None:
            if self.tokenizer is None:
                object.__setattr__(self, "tokenizer", proc.tokenizer)
            if self.image_processor is None:
                object.__setattr__(self, "image_processor", getattr(proc, "image_processor", None))
        if self.tokenizer is None:
            raise ValueError("Preprocessor needs tokenizer= (with image_processor=) or processor=")
        if self.layout not in ("expanded", "collapsed"):
            raise ValueError(f"layout must be 'expanded' or 'collapsed', got {self.layout!r}")
        read = self.spec is None and (proc is not None or self.image_processor is not None)
        if read:
            source = proc if proc is not None else self.image_processor
            object.__setattr__(self, "spec", vision_spec_from_processor(source))
        if self.family is None:
            family = getattr(self.tokenizer, "vlm_pack_family", None)
            object.__setattr__(self, "family", family or getattr(self.spec, "family", None))
        object.__setattr__(self, "family", canonical(self.family))  # any spelling; unknown: ValueError
        # the processor's image expansion is the spec's family (the chat format may be another's)
        expansion = lookup(getattr(self.spec, "family", None))
        if self.layout == "collapsed" and expansion is not None and not expansion.collapsed:
            raise ValueError(
                f"layout='collapsed' keeps one placeholder per image, but the {expansion.name} processor writes "
                "row or tile markers between an image's tokens: use layout='expanded' (collapsed works for "
                f"{', '.join(names('collapsed'))})"
            )
        if read:  # a rule read off the processor: checked against the processor itself, once
            from .vision.selfcheck import check_exact_route, check_fast_rule

            check_fast_rule(self)
            check_exact_route(self)

    @classmethod
    def check(cls, obj: Any) -> Preprocessor:
        """``obj`` when it is a :class:`Preprocessor`; else a TypeError saying how to build one (what an
        adapter taking one is given instead, a tokenizer or a processor, is no Preprocessor)."""
        if not isinstance(obj, cls):
            raise TypeError(
                f"expected a vlm_pack.Preprocessor, got {type(obj).__name__}: pass Preprocessor(tokenizer=tok, "
                "image_processor=ip) (with layout='collapsed' for Megatron) or Preprocessor(processor=processor)"
            )
        return obj

    @staticmethod
    def refuse_parts(who: str, given: Any) -> None:
        """A TypeError when ``given`` (the keyword names a dataset or adapter was called with) holds a part a
        Preprocessor owns: they took ``tokenizer=`` ... ``template=`` once and built their own (without
        ``layout`` or ``spec``); the Preprocessor now travels whole."""
        parts = [name for name in ("tokenizer", "image_processor", "processor", "family", "template") if name in given]
        if parts:
            raise TypeError(
                f"{who}: {', '.join(p + '=' for p in parts)} belong to the Preprocessor: build it once "
                "(Preprocessor(tokenizer=tok, image_processor=ip, family=..., template=...) or "
                f"Preprocessor(processor=processor)) and pass it: {who}(source, preprocessor, config)"
            )

    def collator(self, capacity: int, **options: Any) -> Any:
        """The :class:`~vlm_pack.PackingCollator` for these parts: ``options`` (its keyword arguments, e.g.
        ``model_config=model.config``) win; the tokenizer, the layout, the family, the token a processor scatters
        image features into and the image processor's ``merge_size`` fill in what they leave out. As the
        collator's own default, a call is one planned bin laid out as one row; ``max_rows=None`` opts into
        re-packing a list of samples (in-batch packing)."""
        from .collate.collator import PackingCollator

        options.setdefault("tokenizer", self.tokenizer)
        options.setdefault("layout", self.layout)  # rows in the layout its samples are processed in
        if options.get("model_config") is None:
            options.setdefault("family", self.family)
            if self.processor is not None:
                options.setdefault("image_token_id", _embedding_token_id(self.processor))
        merge = getattr(self.image_processor, "merge_size", None)
        if merge is not None:
            options.setdefault("spatial_merge_size", int(merge))
        return PackingCollator(capacity, **options)

    def render(self, conversation: Conversation, num_images: int = 0, key: Any = None) -> str:
        """The rendered prompt, images as the placeholder token and a BOS the tokenizer adds written out:
        ``tokenizer(text, add_special_tokens=False)`` gives the ids of :meth:`tokenize`, so many prompts can
        be tokenized in one batched call. Raises as :meth:`tokenize`."""
        rendering = self._rendering(conversation, num_images, key, spans=False)
        if rendering.add_special_tokens and rendering.text:
            return self._added_bos + rendering.text
        return rendering.text

    def _rendering(self, conversation: Conversation, num_images: int, key: Any, spans: bool) -> Any:
        return _render(
            conversation, self.tokenizer, self.processor, self.family, self.template, num_images, key, spans,
            self._placeholder,
        )

    @functools.cached_property
    def _placeholder(self) -> str:
        """The token the chat template writes once per image, asked once (a forecast renders every row)."""
        return _placeholder(self.tokenizer, self.processor, self.family)  # family: resolved in __post_init__

    @functools.cached_property
    def _added_bos(self) -> str:
        """The BOS token the tokenizer adds to a text (``""`` when it adds none), asked once."""
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        if not bos:
            return ""
        adds_bos = tok("", add_special_tokens=True)["input_ids"][:1] == [tok.convert_tokens_to_ids(bos)]
        return str(bos) if adds_bos else ""

    def tokenize(self, conversation: Conversation, num_images: int = 0, key: Any = None) -> tuple[list[int], list[bool]]:
        """Collapsed ids and trained mask: :func:`tokenize_conversation` with these parts."""
        rendering = self._rendering(conversation, num_images, key, spans=True)
        return _checked_ids(self.tokenizer, rendering, num_images, key)[:2]

    def forecast(
        self,
        conversation: Conversation,
        image_sizes: Sequence[tuple[int, int]],
        key: Any = None,
        videos: Sequence[Any] = (),
    ) -> tuple[int, list[int]]:
        """``(expanded length, tokens per image)`` from image ``(width, height)`` only (and each video's
        ``VideoHeader`` or ``VideoForecast``, ``vlm_pack.vision.video``): :meth:`forecast_rows` with one row."""
        return self.forecast_prompt(conversation, image_sizes, key, keep=False, videos=videos)[:2]

    def forecast_prompt(
        self,
        conversation: Conversation,
        image_sizes: Sequence[tuple[int, int]],
        key: Any = None,
        keep: bool = True,
        videos: Sequence[Any] = (),
    ) -> tuple[int, list[int], Prompt | None]:
        """:meth:`forecast` and the :class:`Prompt` it rendered, for ``process(..., prompt=)`` (``keep``)."""
        row = (conversation, image_sizes, key, videos) if videos else (conversation, image_sizes, key)
        (result,) = self.forecast_rows([row], keep=keep)
        if isinstance(result, Exception):
            raise result
        return result.length, result.counts, result.prompt

    def forecast_rows(
        self, rows: Sequence[tuple[Any, ...]], keep: bool = False
    ) -> list[Forecast | Exception]:
        """The :class:`~vlm_pack.processing.length.Forecast` (length, tokens per image, image starts) of each
        ``(conversation, image (width, height)s, key)`` row (``(..., key, videos)`` with videos: their
        ``VideoHeader`` or ``VideoForecast``), or the error it raised, the prompts tokenized in
        one batched call: vlm-pack's one forecast (:func:`vlm_pack.processing.length.forecast_rows`), which
        every planner, the Energon encoder and ``forecast_length`` use."""
        return length.forecast_rows(
            rows, tokenizer=self.tokenizer, spec=self.spec, processor=self.processor, family=self.family,
            template=self.template, placeholder=self._placeholder, keep=keep,
        )  # fmt: skip

    def process(
        self,
        images: Sequence[Any],
        conversation: Conversation,
        key: Any = None,
        prompt: Prompt | None = None,
        videos: Sequence[Any] = (),
    ) -> dict[str, torch.Tensor]:
        """One processed sample: :func:`process_sample` with these parts (``videos``: encoded videos, bytes
        or paths, decoded at the frames the forecast keeps)."""
        from .processing.sample import process_sample

        return process_sample(images, conversation, key=key, prompt=prompt, videos=videos, **self._options())

    def process_pack(
        self,
        samples: Sequence[tuple[Any, ...]],
        keys: Sequence[Any] | None = None,
        prompts: Sequence[Prompt | None] | None = None,
    ) -> list[dict[str, torch.Tensor] | SampleError]:
        """A pack's ``(images, conversation)`` (or ``(images, conversation, videos)``) samples:
        :func:`process_pack` with these parts (each sample's
        output, or its data error; an error of code raises ``SampleCodeError``; the images through one
        image-processor call where exact)."""
        from .processing.sample import process_pack

        return process_pack(samples, keys=keys, prompts=prompts, **self._options())

    def processed_length(self, sample: dict[str, Any]) -> int:
        """The length a processed ``sample`` (:meth:`process`'s output) takes in a row, the length its
        :meth:`forecast` predicts: ``len(input_ids)`` in the expanded layout; in the collapsed one each image
        (video) placeholder counts as the ``tokens_per_image`` (``tokens_per_video_placeholder``) it stands for
        (:func:`vlm_pack.processing.length.expanded_length`)."""
        return length.expanded_length(
            int(sample["input_ids"].shape[0]), sample.get("tokens_per_image"), self.layout,
            sample.get("tokens_per_video_placeholder"),
        )  # fmt: skip

    def checked_length(self, sample: dict[str, Any], forecast: int, name: str) -> int:
        """:meth:`processed_length` of ``sample``, checked against the ``forecast`` it was packed on: the one
        forecast-vs-processed check of every loader.

        Raises:
            SampleError: reason ``forecast_mismatch`` naming the sample (``name``) when they differ: bad data,
                left out and counted (``vlm_pack.failures.forecast_mismatch``), never packed at another length.
        """
        n = self.processed_length(sample)
        if n != int(forecast):
            raise forecast_mismatch(int(forecast), n, name)
        return n

    def _options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`process_sample` these parts stand for."""
        names = ("tokenizer", "image_processor", "processor", "family", "layout", "template")
        return {name: getattr(self, name) for name in names}
