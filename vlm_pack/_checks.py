"""Checks shared across the package: a value that must be a whole count, a family name looked up in a table.

An image side (``vision/``) and a sample's length or vision cost (``packing/``) are the same kind of input:
an integer that came from someone else's data, where a float, a bool or a zero is a bug upstream. The error
names the value and where it came from (``what``) and says how to fix it (``fix``).

Per-family tables (chat formats, M-RoPE variants, vision specs, offline tokenizers) answer an unknown family
the same way: what is missing, for which family, and the families that have it. Every place that receives a
family name passes it through :func:`canonical_family` first, so ``"Qwen2-VL"`` is ``"qwen2_vl"`` everywhere
(a spelling that one entry point knew and another did not gave Qwen 1-D positions, silently).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any, TypeVar

_V = TypeVar("_V")


def checked_count(value: Any, what: str, fix: str, *, allow_zero: bool = False) -> int:
    """``value`` as an ``int`` > 0 (>= 0 with ``allow_zero``), else an error naming ``what`` and ``fix``.

    TypeError for a non-integer (bools included: ``True`` is a bug, not a count of one; numpy integers are
    accepted), ValueError for a zero or negative value, e.g. ``"sample 'a': length 0 is zero; <fix>"``.
    Callers test the common case (``type(value) is int and value > 0``) inline and call this on the rest.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} {value!r} ({type(value).__name__}) is not an integer; {fix}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} {value} is {'zero' if value == 0 else 'negative'}; {fix}")
    return value


def family_entry(table: Mapping[str, _V], family: str, what: str, fix: str = "") -> _V:
    """``table[family]``, else a ValueError naming ``what`` is missing, the families that have it and ``fix``.

    E.g. ``"no chat format for family 'blip2'; supported: qwen2_vl, llava. Give a tokenizer ..."``.
    """
    try:
        return table[family]
    except KeyError:
        message = f"no {what} for family {family!r}; supported: {', '.join(table)}."
        raise ValueError(f"{message} {fix}" if fix else message) from None


#: Every family name vlm-pack knows: the transformers ``model_type`` of each supported model (``megatron``:
#: Megatron-LM's LLaVA). Each per-family table is keyed by these names.
KNOWN_FAMILIES: tuple[str, ...] = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "glm4v",
    "glm4v_moe",
    "llava",
    "llava_next",
    "llava_onevision",
    "internvl",
    "idefics3",
    "smolvlm",
    "gemma3",
    "mistral3",
    "pixtral",
    "megatron",
)
# Other names of a family (release names), in the squashed form of _squash.
_ALIASES = {
    "glm41v": "glm4v",
    "llava15": "llava",
    "llava16": "llava_next",
    "llavaov": "llava_onevision",
    "internvl2": "internvl",
    "internvl25": "internvl",
    "internvl3": "internvl",
    "gotocr2": "internvl",
}


def _squash(name: str) -> str:
    return re.sub(r"[\s_.\-]", "", name.lower())


_BY_SQUASHED = {_squash(name): name for name in KNOWN_FAMILIES} | _ALIASES
_CANONICAL = frozenset(KNOWN_FAMILIES)


def canonical_family(name: str | None, *, strict: bool = True) -> str | None:
    """The canonical name of family ``name``: case, ``-``, ``_``, ``.`` and spaces do not matter.

    ``canonical_family("Qwen2-VL") == canonical_family("qwen2vl") == "qwen2_vl"``; ``"Qwen2.5-VL"`` is
    ``"qwen2_5_vl"``, ``"llava-1.6"`` is ``"llava_next"``; None (or ``""``) is None. A name that is not one of
    :data:`KNOWN_FAMILIES` raises a ValueError listing them, or with ``strict=False`` (a config's
    ``model_type``, which may be any model's) is returned as given.
    """
    if name is None or name == "":  # not given (callers read an empty name as none, as `family or ...` did)
        return None
    if not isinstance(name, str):
        raise TypeError(f"a family name must be a string, got {type(name).__name__} {name!r}")
    if name in _CANONICAL:  # the per-sample calls (processing._render) pass canonical names: no regex
        return name
    found = _BY_SQUASHED.get(_squash(name))
    if found is not None:
        return found
    if not strict:
        return name
    raise ValueError(
        f"unknown VLM family {name!r}; known families: {', '.join(KNOWN_FAMILIES)} (in any case, with or "
        "without '-', '_' or '.'). For another model pass its processor= (its chat template and image rules) "
        "or its config= (a model type vlm-pack has no rule for gets 1-D positions)."
    )
