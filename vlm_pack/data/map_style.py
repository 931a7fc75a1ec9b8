"""A map-style packed dataset over a ``datasets.Dataset``: forecast once, plan, then load packs by index.

::

    Dataset ──> forecast_sources ──> pack (bins) ──> balance_bins ──> plan ──> cache/plan-<digest>.npz
    (rows)      (headers only,       capacity,      equal bins per    rows of each bin, bins of each rank
                 num_proc workers)   vision budget  rank, by cost

    PackedMapDataset[i] ──> rows of one bin ──> process_sample (real processor) ──> PackingCollator
                                                                                    -> PackedBatch

Each item is one pack (a ``PackedBatch`` of one row): use ``DataLoader(ds, batch_size=None)``. Indexing::

    rank=r          item s is rank r's s-th pack of the epoch                  len = steps
    rank=None       item s * world_size + r is rank r's s-th pack              len = steps * world_size
                    (so a sequential sampler sharded by Accelerate / the HF Trainer
                     gives every rank exactly its balanced packs)

Every rank has the same number of packs (``balance_bins(equal_count=True)``; a bin is split in two when
the count does not divide), so ranks step in lock-step. ``config.shuffle_seed`` shuffles the order of
the packs per epoch (``set_epoch``); None keeps the plan order.

Resume: the order of an epoch is a pure function of the plan, the seed and the epoch, so the position in
it is the whole state. :class:`PackedSampler` yields ``(epoch, index)``, ``observe(batch)`` records what
was consumed, ``state_dict()`` / ``load_state_dict()`` continue at the next pack, with any number of
DataLoader workers.

The plan is cached: its file is named by a digest of the dataset fingerprint, the preprocessor's
:func:`fingerprint` (everything that changes a token: the vocabulary and added tokens, the processor's and
the tokenizer's settings and templates, the template the renderer actually uses - a Jinja string by its full
digest, a callable by its code, defaults, closure and globals -, the image processor's settings, the vision
spec) and the packing settings, and stores those parts; a file whose parts differ from the current ones (a
stale plan) is rebuilt, never reused, with a warning naming the parts that changed (``chat.template``,
``image_processor.size``...). A template callable holding what cannot be fingerprinted is planned anew each
time, never cached.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import re
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import PackingConfig, collator_options
from ..failures import FailureBudget, example, no_good_sample, skip_reason, tally
from .records import normalise_record
from .shards import SampleError
from .sources import open_sources
from .stats import BadSampleWarning

__all__ = [
    "PackedMapDataset",
    "PackedSampler",
    "Unfingerprintable",
    "changed_parts",
    "fingerprint",
    "fingerprint_value",
    "plan_info",
]

logger = logging.getLogger("vlm_pack.data")

_META = "__plan__"  # where a batch carries its plan metadata (see plan_info)
_CACHE_FORMAT = 2  # 2: the key holds the preprocessor's fingerprint parts
# PackingConfig fields that shape the plan (the rest are streaming knobs or per-epoch order).
_PLAN_FIELDS = (
    "capacity",
    "max_samples_per_bin",
    "vision_capacity",
    "vision_cost",
    "oversized",
    "pad_to_multiple_of",
    "on_error",
    "exif_transpose",
)


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
    from ..chat import _checkpoint_template, chat_format
    from ..families import DEFAULT_FAMILY
    from ..processing import _placeholder

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


def plan_info(batch: Any) -> dict[str, Any] | None:
    """The plan metadata a :class:`PackedMapDataset` batch carries (None for other batches): ``epoch``,
    ``rank``, ``step``, ``index`` (the item), ``bin`` (its pack in the plan), ``rows`` (dataset rows,
    in the pack's order; a row that failed to load under ``on_error="skip"`` is missing, with a
    ``BadSampleWarning``), ``left_out`` (``[row, reason]`` of those rows), ``lengths`` (processed) and
    ``plan`` (the plan's digest)."""
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, Mapping) and _META in metadata:
        return metadata[_META]
    return None


def _split_for_ranks(bins: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Split bins (largest first) until ``world_size`` divides their number: no sample dropped or repeated."""
    missing = (-len(bins)) % world_size
    order = sorted(range(len(bins)), key=lambda b: (-len(bins[b]), b))
    splittable = [b for b in order if len(bins[b]) >= 2][:missing]
    if len(splittable) < missing:
        raise ValueError(
            f"{len(bins)} packs cannot be dealt equally to {world_size} ranks: too few samples to split "
            f"packs further (need {missing} more packs); use fewer ranks or more data."
        )
    out = list(bins)
    for b in splittable:
        half = len(bins[b]) // 2
        out[b] = bins[b][:half]
        out.append(bins[b][half:])
    return out


class PackedMapDataset(torch.utils.data.Dataset):
    """Packs of a ``datasets.Dataset``, by index (see the module docstring).

    Args:
        dataset: a ``datasets.Dataset`` (or the folder ``save_to_disk`` wrote) in any record format of
            ``vlm_pack.data.RECORD_FORMATS``; image columns may be ``Image`` features (bytes or paths) or paths.
        config: a ``PackingConfig``; each of its settings can also be a keyword (``capacity=8192``), alone (a
            config is built, with the same defaults) or over ``config``: ``capacity``,
            ``max_samples_per_bin``, ``vision_capacity`` / ``vision_cost``, ``oversized`` ("raise", default,
            or "skip"; a plan never cuts a sample, so "truncate" is refused), ``pad_to_multiple_of``,
            ``on_error`` ("skip", default: unreadable records are listed in ``skipped``; "raise"),
            ``exif_transpose``, ``shuffle_seed`` (pack order per epoch; None keeps the plan's order),
            ``max_consecutive_failures``.
        processor / tokenizer + image_processor: the checkpoint's.
        family, template: the chat format (see ``processing.tokenize_conversation``).
        record_format, image_root: see ``records.normalise_record`` (default: detected per record).
        world_size, rank: data-parallel ranks; ``rank=None`` indexes every rank's packs interleaved.
        strategy: ``vlm_pack.pack`` strategy.
        cache: a folder (plans named by digest), a ``.npz`` file (one plan, rebuilt when stale), or None
            for no cache. Default: ``$VLM_PACK_CACHE`` or ``~/.cache/vlm_pack``, plus ``/plans``.
        num_proc: processes for the forecast.
        collator_kwargs: passed to ``PackingCollator`` (not packing settings: those are keywords here).
        progress: a tqdm bar over the forecast (None: only on a terminal).

    Attributes: ``skipped`` (``(key, where, reason)`` of samples left out), ``from_cache`` (the plan was
    read from the cache), ``plan_digest``, ``steps`` (packs per rank per epoch), ``num_samples``.
    """

    def __init__(
        self,
        dataset: Any,
        config: PackingConfig | None = None,
        *,
        processor: Any = None,
        tokenizer: Any = None,
        image_processor: Any = None,
        family: str | None = None,
        template: Callable[..., Any] | None = None,
        record_format: str | None = None,
        image_root: str | os.PathLike[str] | None = None,
        world_size: int = 1,
        rank: int | None = None,
        strategy: str = "bfd",
        cache: str | os.PathLike[str] | bool | None = True,
        num_proc: int = 1,
        collator_kwargs: dict[str, Any] | None = None,
        progress: bool | None = None,
        **knobs: Any,
    ) -> None:
        from ..preprocessor import Preprocessor

        config = PackingConfig.resolve("PackedMapDataset", config, refuse=("truncate",), **knobs)
        collator_kwargs = collator_options("PackedMapDataset", collator_kwargs)
        if processor is not None:
            tokenizer = tokenizer if tokenizer is not None else processor.tokenizer
            image_processor = image_processor if image_processor is not None else processor.image_processor
        if tokenizer is None or image_processor is None:
            raise ValueError("PackedMapDataset needs tokenizer= and image_processor= (or processor=).")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) or None, got {rank!r}")
        opened = open_sources([dataset], image_root=image_root)
        if len(opened) != 1 or opened[0].kind != "dataset":
            named = ", ".join(s.name for s in opened[:3]) + (", ..." if len(opened) > 3 else "")
            raise ValueError(
                f"PackedMapDataset({dataset!r}) found {len(opened)} source(s) that are not one dataset "
                f"({named}): it reads rows by index, so give one datasets.Dataset or save_to_disk folder "
                "(load parquet / JSON / shards with datasets.load_dataset first); for streaming use "
                "PackedWebDataset, for TRL integrations.trl.packed_dataset (it takes any source)."
            )
        (source,) = opened
        self.dataset = source.ref
        self.config, self.world_size, self.rank, self.strategy = config, world_size, rank, strategy
        self.preprocessor = Preprocessor(tokenizer, image_processor, processor, family, template)
        self.record_format, self.image_root = record_format, source.image_root
        if "return_style" in collator_kwargs:
            raise ValueError(
                "items are PackedBatch (they carry the plan metadata): use trainer_collator(style) for the HF "
                "Trainer, or batch.model_inputs(style) in a training loop, instead of return_style"
            )
        # max_rows=1: a pack of the plan is one row, or the collator raises naming its samples
        self.collator_kwargs = {
            "pad_to_multiple_of": config.pad_to_multiple_of, "max_rows": 1, **collator_kwargs
        }
        self.epoch = 0
        self._arrow: Any = None
        key = self._cache_key(cache)
        if key is None:  # a part cannot be fingerprinted: no cache, and the plan is named by its own content
            cache = None
        self.plan_digest = _digest(json.dumps(key, sort_keys=True))[:16] if key is not None else ""
        path = _cache_path(cache, self.plan_digest)
        plan = _load_plan(path, key) if path is not None and key is not None else None
        self.from_cache = plan is not None
        if plan is None:
            plan = self._build_plan(num_proc, progress)
            if path is not None and key is not None:
                _save_plan(path, key, plan)
        if key is None:
            arrays = b"".join(np.ascontiguousarray(plan[n]).tobytes() for n in ("rows", "bin_ptr", "rank_bins"))
            self.plan_digest = _digest(arrays)[:16]
        self._rows, self._bin_ptr, self._forecast = plan["rows"], plan["bin_ptr"], plan["lengths"]
        self._rank_bins = plan["rank_bins"].reshape(world_size, -1)
        self.skipped: list[tuple[str, str, str]] = [tuple(s) for s in plan["skipped"]]
        self.steps = int(self._rank_bins.shape[1])
        self.num_samples = int(self._rows.size)
        self._collator = self._make_collator()

    # ------------------------------------------------------------------ plan
    def _cache_key(self, cache: Any) -> dict[str, Any] | None:
        """What the plan is a function of: the dataset, the preprocessor's :func:`fingerprint` parts and the
        packing settings. None (with a warning where a cache was asked for) when the chat template cannot be
        fingerprinted."""
        try:
            _, parts = fingerprint(self.preprocessor)
        except Unfingerprintable as e:
            if cache is not None and cache is not False:
                warnings.warn(
                    f"vlm-pack: cannot fingerprint the chat template: {e}. A plan made with it cannot be "
                    "told from a plan made with another, so it is made anew and not cached. Hold only plain "
                    "values (strings, numbers, containers, functions) in the callable's closure, defaults "
                    "and globals, or pass cache=False.",
                    stacklevel=3,
                )
            return None
        return {
            "format": _CACHE_FORMAT,
            "dataset": {
                "fingerprint": getattr(self.dataset, "_fingerprint", None),
                "rows": len(self.dataset),
            },
            **parts,
            "packing": {
                **{f: getattr(self.config, f) for f in _PLAN_FIELDS},
                "strategy": self.strategy,
                "world_size": self.world_size,
                "record_format": self.record_format,
                "image_root": None if self.image_root is None else str(self.image_root),
            },
        }

    def _build_plan(self, num_proc: int, progress: bool | None) -> dict[str, Any]:
        from ..packing import balance_bins, padded_lengths
        from .forecast import forecast_sources

        cfg = self.config
        table = forecast_sources(
            self.dataset,
            preprocessor=self.preprocessor,
            record_format=self.record_format,
            image_root=self.image_root,
            exif_transpose=cfg.exif_transpose,
            on_error=cfg.on_error,
            num_workers=num_proc,
            progress=progress,
            max_consecutive_failures=cfg.max_consecutive_failures,
        )
        skipped = [list(s) for s in table.invalid]
        lengths = padded_lengths(table.lengths, cfg.pad_to_multiple_of)  # the spans the collator lays out
        over = np.flatnonzero(lengths > cfg.capacity)
        if over.size and cfg.oversized == "raise":
            i = int(over[0])
            raise ValueError(
                f"{table.sources[i]} (key {table.keys[i]!r}): {int(table.lengths[i])} tokens exceed capacity "
                f"{cfg.capacity}; raise capacity or pass PackingConfig(oversized='skip')."
            )
        # the plan keeps creation order: shuffle_seed orders its packs per epoch (set_epoch), not here
        result = table.pack(cfg.replace(oversized="skip", shuffle_seed=None), self.strategy, lengths=lengths)
        skipped += [[table.keys[u.index], table.sources[u.index], u.reason] for u in result.unpacked]
        if skipped:
            shown = "; ".join(f"{k} ({w}): {r}" for k, w, r in skipped[:3])
            warnings.warn(f"vlm-pack: {len(skipped)} sample(s) left out of the plan: {shown}", stacklevel=3)
        if result.num_bins == 0:  # the failure policy's epoch with no good sample (vlm_pack.failures)
            reasons = list(table.invalid_reasons)
            reasons += ["too_long" if lengths[u.index] > cfg.capacity else "vision_too_large" for u in result.unpacked]
            failures = [(reason, example(f"{w} (key {k!r})", r)) for reason, (k, w, r) in zip(reasons, skipped)]
            raise no_good_sample("PackedMapDataset plan", *tally(failures))
        bins = _split_for_ranks([np.asarray(b, dtype=np.int64) for b in result.bins], self.world_size)
        parts = balance_bins([lengths[b].tolist() for b in bins], self.world_size, equal_count=True)
        sizes = np.asarray([len(b) for b in bins], dtype=np.int64)
        members = np.concatenate(bins)
        return {
            "rows": table.index[members],
            "lengths": table.lengths[members],
            "bin_ptr": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "rank_bins": np.asarray(parts, dtype=np.int64).reshape(-1),
            "skipped": skipped,
        }

    # ------------------------------------------------------------------ items
    def __len__(self) -> int:
        return self.steps * (self.world_size if self.rank is None else 1)

    def set_epoch(self, epoch: int) -> None:
        """Use the pack order of ``epoch`` (items given as plain ints; ``PackedSampler`` passes its own)."""
        self.epoch = int(epoch)

    def order(self, epoch: int) -> np.ndarray:
        """int64 ``[steps]``: which of a rank's packs comes at each step of ``epoch``."""
        seed = self.config.shuffle_seed
        if seed is None:
            return np.arange(self.steps, dtype=np.int64)
        return np.random.default_rng([seed, epoch]).permutation(self.steps).astype(np.int64)

    def bin_of(self, index: int, epoch: int | None = None) -> tuple[int, int, int]:
        """``(rank, step, bin)`` of item ``index`` in ``epoch`` (default: the current one)."""
        if not 0 <= index < len(self):
            raise IndexError(f"pack index {index} out of range for {len(self)} packs")
        rank, step = (
            (index % self.world_size, index // self.world_size) if self.rank is None else (self.rank, index)
        )
        epoch = self.epoch if epoch is None else epoch
        return rank, step, int(self._rank_bins[rank, self.order(epoch)[step]])

    def rows_of(self, bin_index: int) -> np.ndarray:
        """int64: the dataset rows of pack ``bin_index`` of the plan."""
        return self._rows[self._bin_ptr[bin_index] : self._bin_ptr[bin_index + 1]]

    def lengths_of(self, bin_index: int) -> np.ndarray:
        """int64: the forecast (processed) lengths of the samples of pack ``bin_index``, as ``rows_of``."""
        return self._forecast[self._bin_ptr[bin_index] : self._bin_ptr[bin_index + 1]]

    def __getitem__(self, item: int | tuple[int, int]) -> Any:
        epoch, index = item if isinstance(item, tuple) else (self.epoch, item)
        rank, step, b = self.bin_of(int(index), int(epoch))
        rows = self.rows_of(b)
        forecast = self._forecast[self._bin_ptr[b] : self._bin_ptr[b + 1]]
        processed, kept, failed = [], [], {}
        for row, length in zip(rows.tolist(), forecast.tolist()):
            out = self._load(row, length)
            if isinstance(out, tuple):  # (reason, example): left out
                failed[row] = out
            else:
                processed.append(out)
                kept.append(row)
        if not processed:
            raise no_good_sample(f"PackedMapDataset pack {b} (rows {rows.tolist()})", *tally(failed.values()))
        batch = self._collator(processed)
        info = {
            "epoch": int(epoch),
            "rank": rank,
            "step": step,
            "index": int(index),
            "bin": b,
            "rows": kept,
            "left_out": [[row, reason] for row, (reason, _) in failed.items()],
            "lengths": [int(p["input_ids"].shape[0]) for p in processed],
            "plan": self.plan_digest,
        }
        batch.metadata[_META] = info  # a dataclass field: survives .to(device) and pin_memory()
        return batch

    def _load(self, row: int, forecast: int) -> dict[str, Any] | tuple[str, str]:
        """``_process``, or ``(reason, example)`` for a row with bad data: under ``on_error="skip"`` it is
        warned about, left out and counted in this process's failure budget (``vlm_pack.failures``); an
        error of code raises ``SampleCodeError`` naming the row."""
        sample = f"dataset row {row}"
        budget = self.__dict__.setdefault(
            "_budget", FailureBudget(self.config.max_consecutive_failures, "PackedMapDataset, loading packs")
        )
        try:
            out = self._process(row, forecast)
        except Exception as e:
            reason = skip_reason(e, "decode_error", sample, str(row))
            if self.config.on_error == "raise":
                raise
            detail = f"{type(e).__name__}: {e}"
            warnings.warn(f"vlm-pack: {sample} left out of its pack: {reason}: {detail}", BadSampleWarning, stacklevel=3)
            budget.failure(reason, sample, detail)
            return reason, example(sample, detail)
        budget.success()
        return out

    def _process(self, row: int, forecast: int) -> dict[str, Any]:
        if self._arrow is None:  # Arrow rows: image bytes stay encoded until process_sample decodes them
            self._arrow = self.dataset.with_format("arrow")
        (record,) = self._arrow[row : row + 1].to_pylist()
        sample = normalise_record(
            record, record_format=self.record_format, key=str(row), where=f"dataset[{row}]", image_root=self.image_root
        )
        images = [im if not isinstance(im, str) else Path(im) for im in sample.images]
        out = self.preprocessor.process(images, sample.conversation, sample.key)
        n = int(out["input_ids"].shape[0])
        if n != forecast:
            raise SampleError(
                "forecast_mismatch",
                f"{sample.label}: processed to {n} tokens but the plan forecast {forecast}: the data or the "
                "processor changed since the plan was made, or the vision spec does not match the processor.",
            )
        out["__key__"], out["__row__"] = sample.key, row
        return out

    def _make_collator(self) -> Callable[[list[dict[str, Any]]], Any]:
        return self.preprocessor.collator(self.config.capacity, **self.collator_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrow"] = None  # reopened lazily in each DataLoader worker
        return state

    def trainer_collator(self, style: str = "sdpa") -> Callable[[Sequence[Any]], dict[str, Any]]:
        """A ``data_collator`` for the HF ``Trainer`` (``per_device_train_batch_size=1``,
        ``train_sampling_strategy="sequential"``, ``remove_unused_columns=False``): one pack ->
        ``batch.model_inputs(style)``."""
        return _ModelInputs(style)


@dataclasses.dataclass(frozen=True)
class _ModelInputs:
    style: str

    def __call__(self, items: Sequence[Any]) -> dict[str, Any]:
        if len(items) != 1:
            raise ValueError(
                f"each item is already a pack: use batch size 1 (per_device_train_batch_size=1), got {len(items)}"
            )
        return items[0].model_inputs(self.style)


# ---------------------------------------------------------------------- cache
def _cache_path(cache: str | os.PathLike[str] | bool | None, digest: str) -> Path | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        cache = Path(os.environ.get("VLM_PACK_CACHE", Path.home() / ".cache" / "vlm_pack")) / "plans"
    path = Path(cache)
    return path if path.suffix == ".npz" else path / f"plan-{digest}.npz"


def _load_plan(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            stored = json.loads(str(f["meta"]))
            plan = {name: f[name] for name in ("rows", "lengths", "bin_ptr", "rank_bins")}
    except (OSError, ValueError, KeyError) as e:
        logger.warning("vlm-pack: plan cache %s is unreadable (%s); rebuilding it", path, e)
        return None
    if stored.get("key") != key:
        changed = changed_parts(stored.get("key"), key)
        shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
        warnings.warn(f"vlm-pack: the cached plan {path} is stale ({shown} changed); rebuilding it", stacklevel=4)
        return None
    plan["skipped"] = stored["skipped"]
    return plan


def _save_plan(path: Path, key: dict[str, Any], plan: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"key": key, "skipped": plan["skipped"]})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    arrays = {name: plan[name] for name in ("rows", "lengths", "bin_ptr", "rank_bins")}
    np.savez(tmp, meta=np.asarray(meta), **arrays)
    os.replace(tmp, path)  # atomic: a reader never sees half a plan


# ---------------------------------------------------------------------- sampler
class PackedSampler(torch.utils.data.Sampler):
    """The items of a :class:`PackedMapDataset` for one epoch, from where the last run stopped.

    Yields ``(epoch, index)`` (the dataset reads the epoch from it, so persistent DataLoader workers are
    fine). Call ``observe(batch)`` on every batch the training loop consumes; ``state_dict()`` then says
    where to continue and ``load_state_dict`` continues there, with any number of DataLoader workers.
    ``set_epoch(e)`` starts epoch ``e`` (as with ``DistributedSampler``); an iteration after an epoch observed
    to its end starts the next one.
    """

    def __init__(self, dataset: PackedMapDataset) -> None:
        self.dataset = dataset
        self.epoch = dataset.epoch
        self._next = 0

    def __len__(self) -> int:
        return len(self.dataset) - self._next

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._next = int(epoch), 0
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self._next >= len(self.dataset):  # the last epoch was consumed to its end
            self.set_epoch(self.epoch + 1)
        epoch = self.epoch
        for index in range(self._next, len(self.dataset)):
            yield epoch, index

    def observe(self, batch: Any) -> Any:
        """Record that ``batch`` was consumed; returns it."""
        info = plan_info(batch)
        if info is None:
            raise ValueError("observe() takes batches of a PackedMapDataset (they carry plan metadata)")
        if info["epoch"] == self.epoch:
            self._next = max(self._next, info["index"] + 1)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "next": self._next, "plan": self.dataset.plan_digest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("plan") != self.dataset.plan_digest:
            raise ValueError(
                f"the state was saved with plan {state.get('plan')!r} but the dataset's plan is "
                f"{self.dataset.plan_digest!r} (the data, processor or packing settings changed): the "
                "position in one plan means other packs in another."
            )
        self.epoch, self._next = int(state["epoch"]), int(state["next"])
        self.dataset.set_epoch(self.epoch)
