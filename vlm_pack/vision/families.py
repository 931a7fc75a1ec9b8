""":func:`vision_spec`: a family's vision rule by name, with its released checkpoint's defaults.

Which rule and which defaults each family has is the family registry's (``vlm_pack.families``: each record's
``vision``); the rules themselves are the other files of this package.
"""

from __future__ import annotations

from typing import Any

from ..families import canonical, require
from .spec import VisionSpec


def vision_spec(family: str, **overrides: Any) -> VisionSpec:
    """The spec of ``family`` (any spelling: ``"Qwen2.5-VL"``, see :func:`vlm_pack.families.canonical`)
    with its released checkpoint's parameters, ``overrides`` replacing some.

    >>> vision_spec("qwen2_vl").num_tokens(1920, 1080)
    2691
    >>> vision_spec("qwen2_vl", max_pixels=200704).num_tokens(1920, 1080)  # capped at 256 tokens
    252
    """
    key = canonical(family, strict=False)  # the one normaliser every entry point uses
    spelled = "" if key == family else f"({family!r} reads as {key!r}.)"
    factory = require(key, "vision", "vision spec", spelled).vision
    assert factory is not None  # require() returns only families that have one
    try:
        return factory(**overrides)
    except TypeError as e:
        raise TypeError(f"vision_spec({family!r}): {e}") from None
