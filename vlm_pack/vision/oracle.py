"""The exact route: a vision spec read off a live processor by running it, for any processor.

Where vlm-pack has no fast rule for a processor (its class has no record in ``vlm_pack.families``, or it
overrides how its parent writes text), :class:`ProcessorSpec` asks the processor itself. Per sample's image
sizes it runs the processor's own image step (``ProcessorMixin._process_images``: the image processor, then
``replace_image_token`` per image, transformers >= 5.18) on blank canvases of those sizes, nothing decoded,
and keeps what the processor would write in place of each image::

    header sizes [(640, 480)] --Image.new--> canvas --processor's image step--> "<|image_pad|>" * 300
                                                                              (any text around it too)

Each result is memoized by (the processor's settings, the sample's sizes): a dataset's many photos of the
same camera cost one run. A sample's images are run together, as the processor's ``__call__`` runs them
(LLaVA-OneVision counts a multi-image sample's images otherwise than one alone).

Videos likewise (:meth:`ProcessorSpec.video_forecast` / ``video_replacement`` / ``video_stand_in``): the
processor's own frame sampling on the header's metadata, then its own video step on that many blank frames of
the header's size (one frame in memory, the others views of it), memoized by settings, header and call-time
``videos_kwargs``. Once per settings it runs a second time, on frames of a flat colour each: a processor whose
text differs then (its count depends on what the frames show: Video-LLaMA 3's token compression) raises
:class:`ContentDependent`.

The replacement text is exact by construction (it is the processor's own); ``stand_ins`` gives it with each
run of the embedding token collapsed to one, and the tokens that leaves out, for a forecast that tokenizes
the prompt with it (the runs themselves tokenize alone: they are special tokens).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._compat import image_step_missing, process_images, process_videos, video_step_missing
from .spec import VisionSpec, _check_size
from .video.header import VideoHeader
from .video.sampling import VideoForecast, sampled_frames

__all__ = ["ContentDependent", "ProcessorSpec", "drives", "exact_spec"]

#: Entries kept by the memo (each a sample's sizes): enough for every size of a large photo dataset at
#: a few hundred bytes each (runs are stored as counts, not written out).
MEMO_SIZE = 1 << 16


class _Image(NamedTuple):
    """One image as its processor writes it: ``pieces`` alternate text and run lengths of the embedding
    token (``("<|vision_start|>", 300, "<|vision_end|>")``: text, run, text, ...)."""

    pieces: tuple[str | int, ...]

    @property
    def count(self) -> int:
        return sum(p for p in self.pieces if isinstance(p, int))

    def text(self, token: str) -> str:
        return "".join(token * p if isinstance(p, int) else p for p in self.pieces)

    def stand_in(self, token: str) -> tuple[str, int]:
        runs = [p for p in self.pieces if isinstance(p, int)]
        return "".join(token if isinstance(p, int) else p for p in self.pieces), sum(runs) - len(runs)


def vision_runs(text: str, tokens: Sequence[str]) -> _Image:
    """``text`` (a processor's replacement) cut at its runs of ``tokens`` (its vision tokens; a run may mix
    them): ``"<a>VVV<b>VV"`` -> ``_Image(("<a>", 3, "<b>", 2, ""))``, whose ``stand_in`` writes each run as
    one token. Every vision token is one special token, so collapsing a run never changes how the text next to
    it tokenizes."""
    one = "|".join(re.escape(t) for t in sorted(set(tokens), key=len, reverse=True))
    token = re.compile(one)
    pieces = re.split(f"((?:{one})+)", text)
    return _Image(tuple(len(token.findall(p)) if i % 2 else p for i, p in enumerate(pieces)))


class _Alone(NamedTuple):
    """What one image alone makes: its encoder patches and crops."""

    patches: int
    tiles: int


# (settings, sizes) -> tuple of _Image, or _Alone under (settings, "alone", size). Shared by every spec of
# equal settings (a forecast pool builds one per worker); bounded, oldest entries dropped first.
_MEMO: dict[tuple[Any, ...], Any] = {}
_STATS = {"hits": 0, "misses": 0}
# (settings, videos_kwargs) whose video step writes the same text for differing frames as for identical ones
_CONTENT_CHECKED: set[tuple[Any, ...]] = set()


def memo_stats(reset: bool = False) -> dict[str, int]:
    """``{"hits", "misses", "entries"}`` of the exact route's memo since the last reset (benchmarks)."""
    out = {**_STATS, "entries": len(_MEMO)}
    if reset:
        _STATS.update(hits=0, misses=0)
        _MEMO.clear()
    return out


def _remember(key: tuple[Any, ...], make: Any) -> Any:
    found = _MEMO.get(key)
    if found is not None:
        _STATS["hits"] += 1
        return found
    _STATS["misses"] += 1
    value = make()
    if len(_MEMO) >= MEMO_SIZE:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):  # another thread dropped it first
            del _MEMO[next(iter(_MEMO))]
    _MEMO[key] = value
    return value


def _embedding_token(processor: Any) -> str:
    """The token the model scatters image features into: the processor's ``image_token``, except where the
    tokenizer names another one that the processor writes inside its expansion (Gemma 3: the template's
    ``<start_of_image>`` becomes ``<image_soft_token>`` runs; Aya Vision's ``<image>`` becomes ``<|IMG_PATCH|>``
    runs): the first of the processor's ``image_token_ids`` where the release has them."""
    ids = [i for i in (getattr(processor, "image_token_ids", None) or ()) if isinstance(i, int)]
    if ids:  # transformers' own answer (mm_token_type_ids are built from it), where the release has it
        token = processor.tokenizer.convert_ids_to_tokens(ids[0])
        if isinstance(token, str) and token:
            return token
    named = getattr(processor.tokenizer, "image_token", None)
    if isinstance(named, str) and named and named != processor.image_token:
        return named
    return str(processor.image_token)


def drives(processor: Any) -> str | None:
    """Why the exact route cannot drive ``processor`` (a sentence naming the fix), or None when it can."""
    name = type(processor).__name__
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        return f"{name} has no image processor and tokenizer to run"
    if not isinstance(getattr(processor, "image_token", None), str):
        return f"{name} names no image_token: vlm-pack cannot tell where its images go in the text"
    why = image_step_missing(processor)
    if why:
        return f"{name}: {why}"
    return None


def _settings(processor: Any) -> str:
    """A fingerprint of everything the processor's image step reads: its class, its own plain attributes
    (image tokens, sequence lengths, strategies) and its image processor's configuration."""
    own = {k: v for k, v in vars(processor).items() if isinstance(v, str | int | float | bool | type(None))}
    parts = [
        f"{type(processor).__module__}.{type(processor).__qualname__}",
        json.dumps(own, sort_keys=True, default=str),
        _embedding_token(processor),
    ]
    for part in (processor.image_processor, getattr(processor, "video_processor", None)):
        if part is not None:
            parts += [f"{type(part).__module__}.{type(part).__qualname__}", part.to_json_string()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class ProcessorSpec(VisionSpec):
    """The exact forecast of a live ``processor``: counts and the text it writes per image, from its own
    image step on blank canvases (memoized by settings and sizes). Any processor that implements
    ``replace_image_token`` (transformers >= 5.18); build it with :func:`exact_spec`.

    ``family`` is None: the processor's class has no record (or its text differs from its record's), so no
    family's rules apply to it; ``processor_class`` names it in messages.
    """

    processor: Any = field(repr=False)
    processor_class: str = ""
    image_token: str = ""
    """The embedding token: the one each image's runs consist of (``num_tokens`` counts it)."""
    placeholder: str = ""
    """The token a prompt holds per image, which the processor replaces (``processor.image_token``)."""
    settings: str = field(default="", repr=False)
    wrapper_tokens: int = field(default=0, repr=False)
    family = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ what the processor writes
    def _run(self, sizes: tuple[tuple[int, int], ...]) -> tuple[_Image, ...]:
        from PIL import Image

        canvases = [Image.new("RGB", size) for size in sizes]
        try:
            _, texts = process_images(self.processor, [canvases])  # one sample's images, as process_sample
        except ValueError as e:  # the processor refuses the size, as it would the image (its bugs raise as they are)
            shown = ", ".join(f"{w}x{h}" for w, h in sizes)
            raise ValueError(f"{self.processor_class} refuses image(s) {shown}: {e}") from None
        if len(texts) != len(sizes):
            raise ValueError(
                f"{self.processor_class}: its image step wrote {len(texts)} replacement(s) for {len(sizes)} images"
            )
        return tuple(vision_runs(str(text), [self.image_token]) for text in texts)

    def _images(self, sizes: Sequence[tuple[int, int]]) -> tuple[_Image, ...]:
        checked = tuple(_check_size(self.processor_class, w, h) for w, h in sizes)
        return _remember((self.settings, checked), lambda: self._run(checked))  # type: ignore[no-any-return]

    def sample_replacements(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """The exact text the processor writes in place of each image of ONE sample (``(width, height)``
        each), as ``processor(text=..., images=...)`` writes it: ``[n]`` strings."""
        return [image.text(self.image_token) for image in self._images(sizes)]

    def replacement(self, width: int, height: int) -> str:
        """The exact text the processor writes in place of one image alone (its ``image_token`` in the prompt)."""
        return self.sample_replacements([(width, height)])[0]

    def stand_ins(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[str, int]]:
        """Per image of ONE sample: its replacement with each run of :attr:`image_token` collapsed to one,
        and the tokens that leaves out (the runs' lengths less one each). The runs are special tokens, so the
        collapsed text tokenizes, in any prompt, to the replacement's ids less the left-out tokens."""
        return [image.stand_in(self.image_token) for image in self._images(sizes)]

    # ------------------------------------------------------------------ VisionSpec
    def sample_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        return [image.count for image in self._images(sizes)]

    def num_tokens(self, width: int, height: int) -> int:
        return self.sample_tokens([(width, height)])[0]

    def extra_tokens(self, width: int, height: int) -> int:
        """Tokens of the replacement besides its embedding tokens, tokenized alone (text that merges with the
        prompt around it, Gemma 3's ``"\\n\\n"``, counts otherwise in context: forecast with ``stand_ins``)."""
        collapsed, left = self.stand_ins([(width, height)])[0]
        ids = self.processor.tokenizer(collapsed, add_special_tokens=False)["input_ids"]
        return len(ids) + left - self.num_tokens(width, height)

    def _alone(self, width: int, height: int) -> _Alone:
        width, height = _check_size(self.processor_class, width, height)

        def make() -> _Alone:
            from PIL import Image

            out, _ = process_images(self.processor, [[Image.new("RGB", (width, height))]])
            return _encoder_inputs(out, self.processor.image_processor)

        return _remember((self.settings, "alone", (width, height)), make)  # type: ignore[no-any-return]

    def num_patches(self, width: int, height: int) -> int:
        """Encoder inputs of one image: the patch rows of its grid where the processor gives one
        (``image_grid_thw``, or ``pixel_values`` rows of patches), else its crops times the patches of the
        image processor's ``patch_size``; a processor that states neither counts its crops."""
        return self._alone(width, height).patches

    def tiles(self, width: int, height: int) -> int:
        return self._alone(width, height).tiles

    # ------------------------------------------------------------------ videos
    def _video(self, header: VideoHeader, videos_kwargs: dict[str, Any]) -> tuple[VideoForecast, _Image, str]:
        """One video's forecast and the text the processor writes for it (memoized by settings, header and
        call-time ``videos_kwargs``): the processor's own sampling on the header's metadata, then its own video
        step on that many blank frames of the header's size (one frame held: the others are views of it)."""
        why = video_step_missing(self.processor)
        if why:
            raise ValueError(f"{self.processor_class}: the exact route cannot forecast its videos: {why}")
        key = (self.settings, "video", header, tuple(sorted(videos_kwargs.items())))
        return _remember(key, lambda: self._run_video(header, videos_kwargs))  # type: ignore[no-any-return]

    def _run_video(self, header: VideoHeader, videos_kwargs: dict[str, Any]) -> tuple[VideoForecast, _Image, str]:
        import numpy as np

        indices = sampled_frames(header, self.processor, **videos_kwargs)
        if not indices:
            raise ValueError(f"{self.processor_class}: frame sampling keeps no frame of a {header.frames}-frame clip")
        shape = (len(indices), header.height, header.width, 3)
        blank = np.broadcast_to(np.zeros((1, 1, 1, 3), dtype=np.uint8), shape)
        # each frame another flat colour (views too): a processor whose count depends on what the frames show
        # (Video-LLaMA 3 drops patches equal to the previous frame's) writes other text for them than for blank ones
        # (once per settings: a later clip the check would catch differs from its forecast when processed, which
        # processing reports as vlm-pack's error, never silently)
        distinct = np.broadcast_to((np.arange(len(indices)) * 37 % 256).astype(np.uint8)[:, None, None, None], shape)
        checked = (self.settings, tuple(sorted(videos_kwargs.items())))
        with warnings.catch_warnings():  # torch's note that it reads the shared blank frame without copying
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out, (text,) = process_videos(self.processor, blank, self._metadata(header, indices), **videos_kwargs)
            other = text
            if checked not in _CONTENT_CHECKED:
                _, (other,) = process_videos(self.processor, distinct, self._metadata(header, indices), **videos_kwargs)
        # the embeddings are video tokens, or image tokens where the processor writes frames as images
        token = str(self.processor.video_token) if self.processor.video_token in text else self.image_token
        if other == text:
            _CONTENT_CHECKED.add(checked)
        else:
            raise ContentDependent(
                f"{self.processor_class}: its video step writes {text.count(token)} {token} tokens for "
                f"{len(indices)} identical {header.width}x{header.height} frames and {other.count(token)} for as "
                "many differing ones: a video's length depends on what its frames show, which no header says (a "
                "setting that drops repeated content, such as Video-LLaMA 3's use_token_compression, can be "
                "switched off on its video processor)"
            )
        image = vision_runs(text, [token])
        pieces = image.pieces
        grid = out.get("video_grid_thw")
        grid_thw = tuple(int(x) for x in np.asarray(grid)[0]) if grid is not None else None
        seconds = out.get("second_per_grid_ts")
        forecast = VideoForecast(
            indices=tuple(int(i) for i in indices),
            grid_thw=grid_thw,  # type: ignore[arg-type]
            frame_tokens=tuple(p for p in pieces if isinstance(p, int)),
            tokens=image.count,
            second_per_grid_t=float(np.asarray(seconds).reshape(-1)[0]) if seconds is not None else None,
            num_patches=int(np.prod(grid_thw)) if grid_thw is not None else None,
        )
        return forecast, image, token

    @staticmethod
    def _metadata(header: VideoHeader, indices: Sequence[int]) -> Any:
        metadata = header.metadata()
        metadata.frames_indices = list(indices)
        return metadata

    def video_forecast(self, header: VideoHeader, **videos_kwargs: Any) -> VideoForecast:
        """The video's kept frames, grid and tokens (``frame_tokens``: each run of its embedding tokens), as
        the processor makes them of the decoded clip (``timestamps`` None: they are in the replacement text)."""
        return self._video(header, videos_kwargs)[0]

    def video_replacement(self, header: VideoHeader, **videos_kwargs: Any) -> str:
        """The exact text the processor writes in place of the video's ``video_token``."""
        _, image, token = self._video(header, videos_kwargs)
        return image.text(token)

    def video_stand_in(self, header: VideoHeader, **videos_kwargs: Any) -> tuple[str, str, int]:
        """``(embedding token, text, left out)``: :meth:`video_replacement` with each run of the video's
        embedding token (``video_token``, or the image token where the processor writes frames as images:
        InternVL, GLM-4.1V) collapsed to one, and the tokens that leaves out (as :meth:`stand_ins`)."""
        _, image, token = self._video(header, videos_kwargs)
        return (token, *image.stand_in(token))

    def to_dict(self) -> dict[str, Any]:
        return {"family": None, "processor_class": self.processor_class, "settings": self.settings}


class ContentDependent(RuntimeError):
    """A processor whose video's tokens depend on its frames' pixels: the exact route cannot forecast it."""


def _encoder_inputs(out: Any, image_processor: Any) -> _Alone:
    """Patches and crops of ONE image from its image step's output (see :meth:`ProcessorSpec.num_patches`)."""
    import numpy as np

    grid = out.get("image_grid_thw")
    if grid is not None:
        return _Alone(int(np.prod(np.asarray(grid)[0])), 1)
    pixels = out.get("pixel_values")
    if isinstance(pixels, list | tuple):
        pixels = pixels[0]
    shape = tuple(np.asarray(pixels).shape) if pixels is not None else ()
    if len(shape) == 3 and shape[0] == 1:  # a batch of one image's patch rows
        shape = shape[1:]
    if len(shape) == 2:  # patch rows already (Gemma 4 flattens its own, padded to its budget)
        return _Alone(shape[0], 1)
    crops = int(np.prod(shape[:-3])) if len(shape) > 3 else 1
    patch = getattr(image_processor, "patch_size", None)
    patch = patch.get("height") if isinstance(patch, dict) else patch
    if isinstance(patch, int) and patch > 0 and len(shape) >= 2:
        return _Alone(crops * (shape[-2] // patch) * (shape[-1] // patch), crops)
    return _Alone(crops, crops)


def exact_spec(processor: Any) -> ProcessorSpec:
    """The exact route's spec for ``processor``; a ValueError naming the processor and the fix where it
    cannot be driven (see :func:`drives`)."""
    why = drives(processor)
    if why is not None:
        raise ValueError(
            f"vision_spec_from_processor: {why}. vlm-pack forecasts a processor without a record by running "
            "its own image step (replace_image_token, transformers >= 5.18): upgrade transformers, or give "
            "a spec= (vision_spec(family, ...)) that matches it."
        )
    token = _embedding_token(processor)
    return ProcessorSpec(
        processor=processor,
        processor_class=type(processor).__name__,
        image_token=token,
        placeholder=str(processor.image_token),
        settings=_settings(processor),
    )
