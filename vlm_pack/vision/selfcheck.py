"""Fast rules that check themselves: a record's fast rule against the installed processor, at start-up.

A fast rule (``smart_resize.py``, ``tiles.py``, ...) re-implements what one family's processor does, on the
releases it was written against. A new transformers release, or a processor set up in a way the rule does not
model (an image processor subclass, a setting no reader reads), makes it wrong while every sample still looks
fine: only the packs overflow. So when a :class:`~vlm_pack.Preprocessor` reads a fast rule off a processor,
:func:`check_fast_rule` forecasts a few one-image samples (and one two-image sample) of fixed sizes with it,
and compares them with the exact route (``oracle.py``: the processor's own image step on blank canvases,
its text put in the same rendered prompt by the processor's own ``get_text_with_replacements``)::

    sizes   640x480  333x1000  1280x720  64x64  1001x257  [640x480 + 333x1000]
    clips   40 frames 160x96 at 10 fps, 9 frames 64x120 at 3 fps (where the family processes videos)
    each    forecast (fast rule) == exact route's length and per-image / per-video counts, else FastRuleMismatch

A difference raises :class:`FastRuleMismatch` before any sample is read (chosen over a fallback with a warning:
a warning scrolls past in a training log, while a plan made with another rule than the one the run then
uses would be silently slower): it names the family, the installed transformers release and the size, and the
fix (``spec=exact_spec(processor)``: exact whatever the processor does). Each processor instance is checked
once per rule, template and family (memoized); a Preprocessor given ``spec=`` is not checked (its spec is the
caller's), and neither is one on a release without ``replace_image_token`` (transformers < 5.18: nothing to
compare with).
"""

from __future__ import annotations

import weakref
from typing import Any

from .._compat import video_step_missing
from ..failures import InternalCheckError
from ..families import lookup
from .oracle import drives, exact_spec
from .video.header import VideoHeader

__all__ = ["CHECK_SAMPLES", "FastRuleMismatch", "check_fast_rule"]

#: The samples (each its images' ``(width, height)``) every fast rule is checked on: landscape, portrait,
#: HD, tiny, odd sides (rounding), and two images in one sample (LLaVA-OneVision counts those otherwise).
CHECK_SAMPLES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((640, 480),),
    ((333, 1000),),
    ((1280, 720),),
    ((64, 64),),
    ((1001, 257),),
    ((640, 480), (333, 1000)),
)

#: The clips (header facts: frames, rate, size) every fast video rule is checked on, where the processor has a
#: video processor and the family's record processes videos: a short clip at 10 fps, a portrait one at 3 fps.
CHECK_CLIPS: tuple[VideoHeader, ...] = (
    VideoHeader(frames=40, fps=10.0, duration=4.0, width=160, height=96, how="header"),
    VideoHeader(frames=9, fps=3.0, duration=3.0, width=64, height=120, how="header"),
)

_CHECKED: weakref.WeakKeyDictionary[Any, set[tuple[str, ...]]] = weakref.WeakKeyDictionary()


class FastRuleMismatch(ValueError):
    """A family's fast rule forecasts other lengths than the installed processor makes (see the module)."""


def _conversation(num_images: int, num_videos: int = 0) -> list[dict[str, Any]]:
    images = [{"type": "image"} for _ in range(num_images)] + [{"type": "video"} for _ in range(num_videos)]
    return [
        {"role": "user", "content": [*images, {"type": "text", "text": "Describe the picture."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A quiet street at noon."}]},
    ]


def _exact(pre: Any, exact: Any, rendering: Any, sizes: tuple[tuple[int, int], ...]) -> tuple[int, list[int]]:
    """The sample's length and per-image counts by the exact route: the ``rendering`` of its prompt with the
    processor's own text for each image, as its ``__call__`` writes it, tokenized as the forecast tokenizes."""
    (text,), _ = pre.processor.get_text_with_replacements([rendering.text], exact.sample_replacements(sizes))
    ids = pre.tokenizer(text, add_special_tokens=rendering.add_special_tokens)["input_ids"]
    return len(ids), exact.sample_tokens(sizes)


def check_fast_rule(pre: Any) -> None:
    """Compare ``pre``'s fast rule (``pre.spec``, read off ``pre.processor``) with the exact route on
    :data:`CHECK_SAMPLES`; :class:`FastRuleMismatch` at the first difference. A no-op where there is nothing
    to check (no processor, the caller's own spec, an exact spec, a release without ``replace_image_token``)
    or the one-image prompt cannot be rendered (the forecast itself says why, at its first sample)."""
    processor, spec = pre.processor, pre.spec
    if processor is None or spec is None or getattr(spec, "family", None) is None or drives(processor):
        return
    key = (repr(spec), repr(pre.template), str(pre.family))
    try:
        seen = _CHECKED.setdefault(processor, set())
    except TypeError:  # a processor that cannot be weakly referenced: checked every time
        seen = set()
    if key in seen:
        return
    exact = exact_spec(processor)
    rows = [(_conversation(len(sizes)), list(sizes), f"selfcheck {i}") for i, sizes in enumerate(CHECK_SAMPLES)]
    try:
        renderings = [pre._rendering(row[0], len(row[1]), row[2], spans=False) for row in rows]
    except Exception:  # the template cannot render an image prompt: the forecast will say so, per sample
        return
    wanted = [_exact(pre, exact, r, sizes) for r, sizes in zip(renderings, CHECK_SAMPLES)]
    for sizes, got, want in zip(CHECK_SAMPLES, pre.forecast_rows(rows), wanted):
        forecast = got if isinstance(got, Exception) else (got.length, list(got.counts))
        if forecast != want:
            raise _mismatch(spec.family, processor, " + ".join(f"{w}x{h}" for w, h in sizes), forecast, want)
    record = lookup(spec.family)
    if record is not None and record.video_wraps and not video_step_missing(processor):
        _check_clips(pre, exact)
    seen.add(key)


def _check_clips(pre: Any, exact: Any) -> None:
    """:func:`check_fast_rule` for videos: each of :data:`CHECK_CLIPS` alone in a sample, the fast rule's
    forecast (``forecast_video`` and the family's video text) against the processor's own video step."""
    from ..processing.render import _render

    conversation = _conversation(0, 1)
    try:
        rendering = _render(conversation, pre.tokenizer, pre.processor, pre.family, pre.template, 0,
                            "selfcheck clip", spans=False, placeholder=pre._placeholder, num_videos=1)  # fmt: skip
    except Exception:  # a template without videos: the forecast says so at a video sample
        return
    for i, header in enumerate(CHECK_CLIPS):
        replaced = [exact.video_replacement(header)]
        (text,), _ = pre.processor.get_text_with_replacements([rendering.text], [], replaced)
        ids = pre.tokenizer(text, add_special_tokens=rendering.add_special_tokens)["input_ids"]
        want = (len(ids), [exact.video_forecast(header).tokens])
        (got,) = pre.forecast_rows([(conversation, [], f"selfcheck clip {i}", [header])])
        forecast = got if isinstance(got, Exception) else (got.length, list(got.video_counts))
        if forecast != want:
            clip = f"a {header.frames}-frame {header.width}x{header.height} clip at {header.fps:g} fps"
            raise _mismatch(pre.spec.family, pre.processor, clip, forecast, want, "video")


def check_exact_route(pre: Any) -> None:
    """Where ``pre.spec`` is the exact route (a processor no record names), compare its forecast of one
    blank 640x480 image with the length the processor's own ``__call__`` writes for it: a processor whose call
    adds text of its own beyond its replacement API (PaliGemma's prefix, Chameleon's separator) would be
    forecast short on every sample, so it is refused by name before the first one. A no-op where the prompt
    cannot be rendered (the forecast says why, per sample)."""
    from PIL import Image

    processor, spec = pre.processor, pre.spec
    if processor is None or getattr(spec, "family", "") is not None or not hasattr(spec, "sample_replacements"):
        return
    try:
        seen = _CHECKED.setdefault(processor, set())
    except TypeError:
        seen = set()
    key = ("exact route", repr(pre.template), str(pre.family))
    if key in seen:
        return
    conversation, sizes = _conversation(1), [CHECK_SAMPLES[0][0]]
    try:
        text = pre.render(conversation, 1, "selfcheck")
    except Exception:
        return
    (forecast,) = pre.forecast_rows([(conversation, sizes, "selfcheck")])
    images = [Image.new("RGB", size) for size in sizes]
    try:
        own = len(processor(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")["input_ids"][0])
    except ValueError:  # a processor that takes no nested images (GOT-OCR2's): the one sample's, flat
        own = len(processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")["input_ids"][0])
    if isinstance(forecast, InternalCheckError) or (isinstance(forecast, Exception) and not isinstance(forecast, ValueError)):
        raise forecast  # vlm-pack's own check or a bug: as it is
    import transformers

    if isinstance(forecast, Exception):
        raise ValueError(
            f"{type(processor).__name__} (transformers {transformers.__version__}, no vlm-pack record): for one "
            f"{sizes[0][0]}x{sizes[0][1]} image its own call writes {own} tokens, and vlm-pack cannot read its "
            f"replacement text ({type(forecast).__name__}: {forecast}; e.g. its image token "
            f"{getattr(processor, 'image_token', None)!r} is not among the tokens the replacement writes). Nothing "
            "was packed; process and pack this model's samples yourself, or report it with the processor class."
        ) from forecast
    got = forecast.length
    if got != own:
        raise ValueError(
            f"{type(processor).__name__} (transformers {transformers.__version__}, no vlm-pack record): for one "
            f"{sizes[0][0]}x{sizes[0][1]} image its own call writes {own} tokens, its replacement text gives {got}: "
            "the processor adds text of its own around the prompt, which vlm-pack cannot forecast. Nothing was "
            "packed; process and pack this model's samples yourself, or report it with the processor class."
        )
    seen.add(key)


def _mismatch(
    family: str, processor: Any, shown: str, forecast: Any, want: tuple[int, list[int]], kind: str = "image"
) -> FastRuleMismatch:
    import transformers

    what = "image(s)" if kind == "image" else "video"
    said = (
        f"raises {type(forecast).__name__}: {forecast}"
        if isinstance(forecast, Exception)
        else f"forecasts {forecast[0]} tokens (per {kind} {forecast[1]})"
    )
    return FastRuleMismatch(
        f"the fast rule of family {family!r} disagrees with {type(processor).__name__} on transformers "
        f"{transformers.__version__}: for a sample with {what} {shown} it {said}, while the processor writes "
        f"{want[0]} tokens (per {kind} {want[1]}). Nothing was packed. Fix: Preprocessor(processor=processor, "
        "spec=vlm_pack.vision.oracle.exact_spec(processor)) forecasts with the processor itself (exact, "
        "slower), or install a transformers release the rule is tested on (docs/versions.md); please report it."
    )
