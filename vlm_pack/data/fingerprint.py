"""What a plan is a function of: the fingerprint of a :class:`~vlm_pack.Preprocessor`.

:func:`fingerprint` reads everything in a preprocessor that changes a token of a sample (the vocabulary and
added tokens, the processor's and the tokenizer's settings and templates, the template the renderer actually
uses - a Jinja string by its full digest, a callable by its code, defaults, closure and globals -, the image
processor's settings, the vision spec) as JSON parts; :func:`changed_parts` names the parts two fingerprints
differ in (``chat.template``, ``image_processor.size``...), so a stale plan says what changed. A value whose
content cannot be read (a lock in a template's closure) raises :class:`Unfingerprintable`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
import types
from typing import Any

import numpy as np
import torch

__all__ = ["Unfingerprintable", "changed_parts", "fingerprint", "fingerprint_value"]


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text if isinstance(text, bytes) else text.encode("utf-8")).hexdigest()


class Unfingerprintable(ValueError):
    """A part of a :class:`~vlm_pack.Preprocessor` (a template callable's closure, say) holds a value whose
    content cannot be fingerprinted: a plan made with it cannot be told apart from one made with another."""


def fingerprint(preprocessor: Any) -> tuple[str, dict[str, Any]]:
    """``(sha256 hex digest, parts)`` of everything in ``preprocessor`` that changes a token of a sample.

    ``parts`` (JSON values, so two fingerprints can be compared part by part, see :func:`changed_parts`):

    - ``tokenizer``: class, vocabulary and added tokens (digests), special tokens, its ``chat_template``;
    - ``processor``: its settings (``to_dict()`` without the sub-processors) and ``chat_template``, or None;
    - ``image_processor``: its settings (``to_dict()``), as they are;
    - ``chat``: the family, and the template the conversations are rendered with, chosen by the renderer's
      own rule (``template=``, else the processor's, else the tokenizer's ``chat_template``, else the family's
      format): a Jinja string by its full digest, a callable by its code, defaults, closure and the globals
      it reads (see :func:`fingerprint_value`), and the placeholder an image is written as;
    - ``spec`` (the vision spec's parameters), ``layout`` and the ``versions`` of vlm-pack and transformers.

    Raises :class:`Unfingerprintable` naming the value when a template callable holds something whose
    content cannot be fingerprinted (a lock, a tokenizer, an open file...).
    """
    from transformers import __version__ as transformers_version

    from .._version import __version__
    from ..families import DEFAULT_FAMILY
    from ..processing import _placeholder
    from ..processing.chat import _checkpoint_template, chat_format

    pre = preprocessor
    tok, proc = pre.tokenizer, pre.processor
    template, source = pre.template, "template="
    if template is None:
        template = _checkpoint_template(tok, proc)  # the rule render_conversation follows, not a copy of it
        owner = "processor" if proc is not None and template == _template(proc) else "tokenizer"
        source = f"{owner}.chat_template"
    if template is None:
        source = f"format of {pre.family or DEFAULT_FAMILY}"
        try:
            template = chat_format(pre.family)
        except ValueError:  # no format either: rendering any conversation raises, so no plan is made
            source = "none"
    try:
        placeholder = _placeholder(tok, proc, pre.family)
    except ValueError:  # the tokenizer has no image token: text-only data still plans
        placeholder = None
    parts = {
        "tokenizer": _tokenizer_parts(tok),
        "processor": None if proc is None else _processor_parts(proc),
        "image_processor": _settings(pre.image_processor),
        "chat": {
            "family": pre.family,
            "renders_with": source,
            "template": fingerprint_value(template, "template"),
            "placeholder": placeholder,
        },
        "spec": _jsonable(pre.spec.to_dict()) if pre.spec is not None else None,
        "layout": pre.layout,
        "versions": {"vlm_pack": __version__, "transformers": transformers_version},
    }
    return _digest(json.dumps(parts, sort_keys=True)), parts


def changed_parts(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the parts that differ between two fingerprints' parts, e.g. ``["chat.template"]``."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for name in sorted(set(old) | set(new)):
            if old.get(name) != new.get(name):
                out += changed_parts(old.get(name), new.get(name), f"{prefix}{name}.")
        return out
    return [prefix.rstrip(".")] if old != new else []


def _template(owner: Any) -> Any:
    template = getattr(owner, "chat_template", None) if owner is not None else None
    return template.get("default") if isinstance(template, dict) else template


def _text_id(text: Any) -> Any:
    """A template (str, a dict of named ones, None) by the full digest of its text."""
    if text is None:
        return None
    text = text if isinstance(text, str) else json.dumps(text, sort_keys=True, default=str)
    return "sha256:" + _digest(text)


def _jsonable(value: Any) -> Any:
    """``value`` through JSON (tuples become lists; enums, numpy values and other objects their ``str``)."""
    return json.loads(json.dumps(value, sort_keys=True, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return str(value)


def _settings(obj: Any) -> Any:
    """An image processor's (or processor's) settings as saved with it: ``to_dict()``."""
    if obj is None:
        return None
    settings = obj.to_dict() if hasattr(obj, "to_dict") else dict(vars(obj))
    return _jsonable({"class": type(obj).__name__, **settings})


def _processor_parts(proc: Any) -> dict[str, Any]:
    settings = proc.to_dict() if hasattr(proc, "to_dict") else {}
    # the sub-processors have parts of their own; the template is hashed whole, the rest is readable
    dropped = ("tokenizer", "image_processor", "video_processor", "feature_extractor", "chat_template")
    kept = {k: v for k, v in settings.items() if k not in dropped}
    return {
        "class": type(proc).__name__,
        "settings": _jsonable(kept),
        "chat_template": _text_id(getattr(proc, "chat_template", None)),
        "image_token": getattr(proc, "image_token", None),
    }


def _tokenizer_parts(tok: Any) -> dict[str, Any]:
    backend = getattr(tok, "backend_tokenizer", None)
    # the backend's JSON holds the vocabulary, merges, added tokens, normalizer and the BOS/EOS post-processor
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return {
        "class": type(tok).__name__,
        "vocab": "sha256:" + _digest(vocab),
        "added_tokens": "sha256:" + _digest(json.dumps(sorted((int(i), str(t)) for i, t in added.items()))),
        "special_tokens": _jsonable(dict(getattr(tok, "special_tokens_map", {}) or {})),
        "chat_template": _text_id(getattr(tok, "chat_template", None)),
        "image_token": getattr(tok, "image_token", None),
        "family": getattr(tok, "vlm_pack_family", None),
    }


_FINGERPRINT_BUDGET = 20_000  # values visited per fingerprint: a callable that reaches further is refused


def fingerprint_value(value: Any, path: str = "value") -> Any:
    """A JSON value that is equal for two values exactly when their content is (within what is followed).

    Followed: ``None``, bools, numbers, strings and bytes (long ones by digest), lists, tuples, dicts, sets,
    enums, numpy arrays, torch tensors, compiled regexes, dataclass instances (their fields), functions (their
    code, defaults, closure and the module globals their code reads; a function those reach is taken by its
    code, defaults and closure), ``functools.partial``, bound methods, classes and modules (by name), and
    other objects by their class and ``__dict__``. Never an ``id`` or a repr holding an address, so the value
    is the same in every process. Raises :class:`Unfingerprintable` naming ``path`` (e.g.
    ``"template.closure['lock']"``) for anything else.
    """
    return _Fingerprinter().value(value, path, depth=0)


class _Fingerprinter:
    def __init__(self) -> None:
        self.visits = 0
        self.active: set[int] = set()  # ids on the current path: a cycle is named, not followed

    def value(self, v: Any, path: str, depth: int) -> Any:
        self.visits += 1
        if self.visits > _FINGERPRINT_BUDGET:
            raise Unfingerprintable(f"{path}: reaches more than {_FINGERPRINT_BUDGET} values")
        if v is None or isinstance(v, bool | int | float):
            return v if not isinstance(v, float) else repr(v)
        if isinstance(v, str):
            return v if len(v) <= 120 else "sha256:" + _digest(v)
        if isinstance(v, bytes | bytearray):
            return "bytes:" + _digest(bytes(v))
        if isinstance(v, enum.Enum):
            return {"enum": _qualname(type(v)), "name": v.name}
        if isinstance(v, type):
            return {"class": _qualname(v)}
        if isinstance(v, types.ModuleType):
            return {"module": v.__name__}
        if isinstance(v, re.Pattern):
            pattern = v.pattern if isinstance(v.pattern, str) else _digest(v.pattern)
            return {"regex": pattern, "flags": v.flags}
        if isinstance(v, np.ndarray | np.generic):
            a = np.ascontiguousarray(v)
            return {"array": str(a.dtype), "shape": list(a.shape), "data": _digest(a.tobytes())}
        if isinstance(v, torch.Tensor):
            return self.value(v.detach().cpu().numpy(), path, depth)
        if id(v) in self.active:
            return {"cycle": type(v).__name__}
        self.active.add(id(v))
        try:
            return self._compound(v, path, depth)
        finally:
            self.active.discard(id(v))

    def _compound(self, v: Any, path: str, depth: int) -> Any:
        if isinstance(v, list | tuple):
            return {type(v).__name__: [self.value(x, f"{path}[{i}]", depth) for i, x in enumerate(v)]}
        if isinstance(v, set | frozenset):
            items = [json.dumps(self.value(x, f"{path}{{...}}", depth), sort_keys=True) for x in v]
            return {"set": sorted(items)}
        if isinstance(v, dict):
            items = [
                [self.value(k, f"{path}.keys()", depth), self.value(x, f"{path}[{k!r}]", depth)]
                for k, x in v.items()
            ]
            return {"dict": sorted(items, key=lambda kv: json.dumps(kv, sort_keys=True))}
        if isinstance(v, functools.partial):
            return {
                "partial": self.value(v.func, f"{path}.func", depth),
                "args": self.value(v.args, f"{path}.args", depth),
                "keywords": self.value(v.keywords, f"{path}.keywords", depth),
            }
        if isinstance(v, types.MethodType):
            return {
                "method": self.value(v.__func__, path, depth),
                "self": self.value(v.__self__, f"{path}.__self__", depth),
            }
        if isinstance(v, types.FunctionType):
            return self._function(v, path, depth)
        if isinstance(v, types.BuiltinFunctionType | types.BuiltinMethodType):
            owner = getattr(v, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType):
                raise Unfingerprintable(f"{path} is a method of a {type(owner).__name__}")
            return {"builtin": f"{getattr(v, '__module__', None)}.{v.__qualname__}"}
        if dataclasses.is_dataclass(v):
            state = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
            return {"dataclass": _qualname(type(v)), "fields": self.value(state, path, depth)}
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict) and not hasattr(type(v), "__slots__"):
            out = {"object": _qualname(type(v)), "state": self.value(state, path, depth)}
            call = next((k.__dict__["__call__"] for k in type(v).__mro__ if "__call__" in k.__dict__), None)
            if isinstance(call, types.FunctionType):  # a callable object: what it runs is its class's code
                out["call"] = self._function(call, f"{path}.__call__", depth)
            return out
        raise Unfingerprintable(f"{path} is a {type(v).__module__}.{type(v).__qualname__}")

    def _function(self, fn: types.FunctionType, path: str, depth: int) -> Any:
        code = fn.__code__
        cells = [c.cell_contents if _filled(c) else None for c in fn.__closure__ or ()]
        out = {
            "function": _qualname(fn),
            "code": _code_id(code),
            "defaults": self.value(fn.__defaults__, f"{path}.__defaults__", depth),
            "kwdefaults": self.value(fn.__kwdefaults__, f"{path}.__kwdefaults__", depth),
            "closure": {
                name: self.value(cell, f"{path}.closure[{name!r}]", depth)
                for name, cell in zip(code.co_freevars, cells)
            },
        }
        if depth == 0:  # the callable's own module globals; the functions they reach by their code
            module = fn.__globals__
            out["globals"] = {
                name: self.value(module[name], f"{path}.globals[{name!r}]", depth + 1)
                for name in sorted(_names(code))
                if name in module
            }
        return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell (a name assigned later) raises
    except ValueError:
        return False
    return True


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _names(code: types.CodeType) -> set[str]:
    """Global (and attribute) names a code object and the code nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _code_id(code: types.CodeType) -> str:
    """Digest of what a code object does: its bytecode, the names and constants it uses, nested code too."""
    consts = [_const_id(c) for c in code.co_consts]
    parts = [code.co_code.hex(), code.co_names, code.co_varnames, code.co_freevars, consts]
    return _digest(json.dumps(parts))


def _const_id(const: Any) -> Any:
    """A code constant as JSON: nested code by its digest, a frozenset (``x in {"a", "b"}``) sorted, since
    its repr's order changes with the string hash seed of each process."""
    if isinstance(const, types.CodeType):
        return _code_id(const)
    if isinstance(const, tuple):
        return [_const_id(c) for c in const]
    if isinstance(const, frozenset):
        return sorted(json.dumps(_const_id(c)) for c in const)
    return repr(const)
