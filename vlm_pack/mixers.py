"""Token mixers that are not attention: sample boundaries reach them too.

Attention keeps packed samples apart through its mask or ``cu_seqlens``. Some layers mix tokens another way
and carry one sample into the next unless told where samples start::

    row          a0 a1 a2 b0 b1 b2 b3          (two samples packed in one row)
    short conv   b0 reads a1 a2                (kernel 4: the last 3 tokens)       leaks
    delta rule   b0 starts from a's state      (a recurrent state over the row)     leaks

In transformers 5.24 (``models/qwen3_5/modeling_qwen3_5.py`` ``Qwen3_5GatedDeltaNet``,
``models/lfm2/modeling_lfm2.py`` ``Lfm2ShortConv``; the MoE and Qwen3-Next variants are copies) the decoder
layer hands these layers its ``**kwargs`` but not ``position_ids``; the layers read ``cu_seq_lens_q`` (delta
rule) and ``seq_idx`` (causal conv) only through the flash-linear-attention / causal-conv1d kernels. The
PyTorch fallbacks (``integrations/hub_kernels.py``) raise on ``cu_seqlens`` / ``seq_idx`` and leak silently
without them: max |packed - alone| 0.37 (Qwen3.5, sdpa), 0.495 (LFM2).

``isolate_token_mixers(model)`` installs a boundary-respecting path in every known mixer: the layer runs
on each sample segment alone (segments of similar length batched into one call, right-padded: the layers
are causal, so the padding after a segment never reaches it), which is exact against each sample alone by
construction::

    hidden [B, T, H]  --gather-->  [n, L, H] per group  --layer-->  [n, L, H']  --scatter-->  [B, T, H']

Boundaries come from ``cu_seq_lens_q`` in the layer's kwargs when present (flash-style ``[1, R*T]`` rows),
else from the position ids the text model received (a forward pre-hook on the module owning the decoder
layers; ``[B, T]``, Qwen's ``[4, B, T]`` with the text row first, or ``[3, B, T]`` where a sample starts at
the token whose three rows are all 0). They are worked out once per forward (``boundaries.py`` caches),
not per layer. Where the boundary-taking kernels are importable and the layer runs on CUDA with one row,
the layer gets ``cu_seq_lens_q`` / ``seq_idx`` and runs whole (``isolation="kernel"``; untested here: no
GPU, no flash-linear-attention in CI).

``find_token_mixers(model)`` lists every such layer, known ones by kind and unknown ones (a module holding
an ``nn.Conv1d`` with kernel > 1, or a Mamba/SSM/recurrent class) with ``isolation="none"``, so a future
model never passes silently: ``isolate_token_mixers`` raises on those before the first step.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .boundaries import IdentityCache, Packing, host_copy, packing_from_cu, packing_from_positions, to_device

__all__ = [
    "KNOWN_MIXERS",
    "TokenMixer",
    "boundary_kernels",
    "find_token_mixers",
    "isolate_token_mixers",
    "mixer_problems",
    "summarize",
]

#: Layer classes whose forward is ``(hidden_states [B, T, H], cache=None, attention_mask=None, **kwargs)``,
#: causal along T, by kind.
KNOWN_MIXERS: dict[str, str] = {
    "Qwen3_5GatedDeltaNet": "gated_delta_net",
    "Qwen3_5MoeGatedDeltaNet": "gated_delta_net",
    "Qwen3NextGatedDeltaNet": "gated_delta_net",
    "Lfm2ShortConv": "short_conv",
    "Lfm2MoeShortConv": "short_conv",
}
#: The importable modules each kind's boundary-taking kernels live in (transformers resolves them there).
_KERNEL_MODULES = {
    "gated_delta_net": ("fla.ops.gated_delta_rule", "causal_conv1d"),
    "short_conv": ("causal_conv1d",),
}
#: Class names of layers that mix tokens without attention (an unknown model's, to refuse, not to run).
_MIXER_NAME = re.compile(
    r"(Mamba2?|SSM|Mixer|DeltaNet|ShortConv|ShortConvolution|Recurrent|Rglru|RWKV|LinearAttention|Hyena)$",
    re.IGNORECASE,
)
_NOT_MIXER_NAME = re.compile(r"MLP|Expert|Router|Vision|Audio|Patch", re.IGNORECASE)
#: Sub-model paths that are encoders, not the text model (their convolutions run per image / clip).
_ENCODER_PATH = re.compile(r"vision|visual|audio|image|patch|speech", re.IGNORECASE)
#: Kwargs naming boundaries: stripped before a per-segment call (the PyTorch fallbacks raise on them).
_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")
_FIX = "call vp.isolate_token_mixers(model) before training"


@dataclass(frozen=True)
class TokenMixer:
    """A layer that mixes tokens without attention.

    ``name``: its module path; ``kind``: ``"gated_delta_net"``, ``"short_conv"`` or ``"unknown"``;
    ``isolation``: how packed samples are kept apart in it, ``"per_sample"`` (vlm-pack runs it per sample
    segment), ``"kernel"`` (boundary-taking kernels) or ``"none"`` (they are not: it leaks); ``how``: in words.
    """

    name: str
    kind: str
    isolation: str
    how: str

    def __str__(self) -> str:
        return f"{self.name} ({self.kind}): {self.isolation}, {self.how}"


# --------------------------------------------------------------------------------------------------------
# finding them
# --------------------------------------------------------------------------------------------------------


@functools.cache
def boundary_kernels(kind: str) -> bool:
    """Whether the kernels that take sample boundaries for ``kind`` import here (flash-linear-attention's
    ``chunk_gated_delta_rule`` and causal-conv1d for the delta net, causal-conv1d for the short conv)."""
    try:
        for module in _KERNEL_MODULES.get(kind, ("",)):
            importlib.import_module(module)
    except Exception:  # absent or a broken build: the PyTorch path it is
        return False
    return kind in _KERNEL_MODULES


def _text_scope(model: nn.Module) -> tuple[str, nn.Module]:
    """(prefix, module) of the text decoder: ``get_decoder()`` where it exists (a VLM's language model)."""
    getter = getattr(model, "get_decoder", None)
    try:
        decoder = getter() if callable(getter) else model
    except Exception:  # transformers raises for models without a decoder rule
        decoder = model
    for name, module in model.named_modules():
        if module is decoder:
            return name, module
    return "", model


def _unknown_mixer(name: str, module: nn.Module) -> bool:
    cls = type(module).__name__
    stack = any(isinstance(child, nn.ModuleList) for child in module.children())  # a model, not a layer
    if stack or _NOT_MIXER_NAME.search(cls) or _ENCODER_PATH.search(name):
        return False
    if _MIXER_NAME.search(cls):
        return True
    return any(
        isinstance(child, nn.Conv1d) and child.kernel_size[0] > 1 for child in module.children()
    )


def _device(module: nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _describe(name: str, module: nn.Module, kind: str) -> TokenMixer:
    cls = type(module).__name__
    if kind == "unknown":
        return TokenMixer(name, kind, "none", f"{cls}: an unknown layer that mixes tokens; vlm-pack cannot "
                          "keep packed samples apart in it")
    kernels = boundary_kernels(kind) and _device(module).type == "cuda"
    if isinstance(module.__dict__.get("forward"), _IsolatedForward):
        if kernels:
            return TokenMixer(name, kind, "kernel", f"{cls} with cu_seq_lens_q/seq_idx on one row, else run "
                              "per sample segment")
        return TokenMixer(name, kind, "per_sample", f"{cls} run per sample segment (boundaries from "
                          "cu_seq_lens_q, else the text model's position_ids)")
    if kernels:
        return TokenMixer(name, kind, "kernel", f"{cls} through transformers' kernels, only when the inputs "
                          "carry cu_seq_lens_q and seq_idx")
    return TokenMixer(name, kind, "none", f"{cls} on the PyTorch path: packed samples leak into each other "
                      "(no boundaries reach it)")


def find_token_mixers(model: nn.Module) -> list[TokenMixer]:
    """Every sub-module of ``model``'s text decoder that mixes tokens without attention, outermost only.

    Known classes (``KNOWN_MIXERS``) by kind; any other module whose class name says Mamba/SSM/mixer/
    recurrent, or that holds an ``nn.Conv1d`` with kernel > 1 along the sequence, as ``kind="unknown"``
    with ``isolation="none"``. Vision / audio towers are not searched (their convolutions run per image).
    """
    prefix, scope = _text_scope(model)
    found: list[TokenMixer] = []
    taken: list[str] = []
    for sub_name, module in scope.named_modules():
        name = f"{prefix}.{sub_name}".strip(".")
        if any(name.startswith(t + ".") for t in taken):
            continue
        kind = KNOWN_MIXERS.get(type(module).__name__)
        if kind is None and _unknown_mixer(sub_name, module):
            kind = "unknown"
        if kind is not None:
            taken.append(name)
            found.append(_describe(name, module, kind))
    return found


def mixer_problems(model: nn.Module, mixers: list[TokenMixer] | None = None) -> list[str]:
    """One problem per mixer that keeps no boundaries (``isolation="none"``), naming the layer and the fix."""
    mixers = find_token_mixers(model) if mixers is None else mixers
    cls = type(model).__name__
    problems = []
    for m in mixers:
        if m.isolation != "none":
            continue
        if m.kind == "unknown":
            fix = ("vlm-pack has no boundary-respecting path for it: train this model unpacked (one sample "
                   "per row) or add its class to vlm_pack.mixers.KNOWN_MIXERS with a tested path")
        else:
            fix = _FIX
        problems.append(f"{cls}: layer {m.name} mixes tokens without attention and keeps no sample "
                        f"boundaries ({m.how}); {fix}")
    return problems


# --------------------------------------------------------------------------------------------------------
# the boundaries of the current forward
# --------------------------------------------------------------------------------------------------------


class _Boundaries:
    """Owned by one text model: the position ids of its current forward, captured by a pre-hook.

    Kept after the forward so that gradient checkpointing's recompute (in backward) sees the same ones;
    a later forward replaces them.
    """

    def __init__(self, owner: nn.Module) -> None:
        params = list(inspect.signature(owner.forward).parameters)
        self.position_index = params.index("position_ids") if "position_ids" in params else None
        self.position_ids: torch.Tensor | None = None
        self.handle = owner.register_forward_pre_hook(self.capture, with_kwargs=True)

    def capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pos = kwargs.get("position_ids")
        if pos is None and self.position_index is not None and len(args) > self.position_index:
            pos = args[self.position_index]
        self.position_ids = pos if isinstance(pos, torch.Tensor) else None


_SEGMENTS = IdentityCache()


def _packing(state: _Boundaries | None, hidden: torch.Tensor, kwargs: dict) -> Packing | None:
    """Where the samples of ``hidden`` [B, T, H] lie, or None when nothing says (one sample per row)."""
    batch, length = hidden.shape[:2]
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return packing_from_cu(cu, kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"), batch * length,
                               hidden.device)
    pos = None if state is None else state.position_ids
    if pos is None:
        return None
    return packing_from_positions(pos, batch, length, hidden.device)


class _Segments(NamedTuple):
    """How to run one forward's tokens per sample: groups of segments, and the way back."""

    # per group: index [n, L] long (into the B*T tokens), valid [n, L] bool, keep [k] long (the flat [n*L]
    # entries that are valid; integer indexing: a boolean mask would size its output from device data)
    groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    inverse: torch.Tensor  # [B*T] long: where each token's output sits in the groups' concatenated outputs
    whole_rows: bool  # every row is one segment: run the layer as it is


def _group(lengths: list[int], slack: float = 1.5) -> list[list[int]]:
    """Segment indices, longest first, grouped while padding to the group's longest stays within ``slack``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            real = sum(lengths[j] for j in group) + lengths[i]
            if (len(group) + 1) * lengths[group[0]] <= slack * real:
                group.append(i)
                continue
        groups.append([i])
    return groups


def _segments(packing: Packing, batch: int, length: int, device: torch.device) -> _Segments:
    """Segments = samples split at row starts too (a flash-style ``cu`` over [1, R*T] never crosses a row
    of a [B, T] call this way). Built on the host once per forward, cached on ``packing.cu``."""
    key = (batch, length, device)
    cached = _SEGMENTS.get(packing.cu, key)
    if cached is not None:
        return cached
    bounds = set(host_copy(packing.cu).tolist()[:-1]) | set(range(0, batch * length, length))
    starts = sorted(bounds)
    ends = [*starts[1:], batch * length]
    lengths = [e - s for s, e in zip(starts, ends)]
    groups, order = [], []
    for members in _group(lengths):
        width = lengths[members[0]]
        start = torch.tensor([starts[i] for i in members])[:, None]
        size = torch.tensor([lengths[i] for i in members])[:, None]
        offsets = torch.arange(width)[None]
        valid = offsets < size
        index = torch.where(valid, start + offsets, torch.zeros_like(offsets))
        order.append(index[valid])
        keep = valid.flatten().nonzero().flatten()
        groups.append((to_device(index, device), to_device(valid, device), to_device(keep, device)))
    inverse = torch.empty(batch * length, dtype=torch.long)
    inverse[torch.cat(order)] = torch.arange(batch * length)
    out = _Segments(tuple(groups), to_device(inverse, device), len(starts) == batch)
    return _SEGMENTS.put(packing.cu, key, out)


def _seq_idx(packing: Packing, batch: int, length: int) -> torch.Tensor:
    """[B, T] int32 sample ordinal of every token (causal-conv1d's ``seq_idx``)."""
    tokens = torch.arange(batch * length, device=packing.cu.device, dtype=packing.cu.dtype)
    idx = torch.searchsorted(packing.cu[1:].contiguous(), tokens, right=True)
    return idx.to(torch.int32).reshape(batch, length)


# --------------------------------------------------------------------------------------------------------
# the isolated forward
# --------------------------------------------------------------------------------------------------------


class _IsolatedForward:
    """Instance ``forward`` of an isolated mixer: the class's own forward, per sample segment.

    Lives in the module's ``__dict__`` (not its state_dict): parameters and buffers are untouched.
    """

    def __init__(self, module: nn.Module, kind: str, state: _Boundaries) -> None:
        self.module, self.kind, self.state = module, kind, state

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        forward = type(self.module).forward
        cache = kwargs.get("cache", kwargs.get("past_key_values", args[0] if args else None))
        if cache is not None or hidden_states.dim() != 3:  # decoding: one sample, its own state
            return forward(self.module, hidden_states, *args, **kwargs)
        packing = _packing(self.state, hidden_states, kwargs)
        plain = {k: v for k, v in kwargs.items() if k not in _BOUNDARY_KWARGS}
        if packing is None:
            return forward(self.module, hidden_states, *args, **plain)
        batch, length = hidden_states.shape[:2]
        if batch == 1 and hidden_states.is_cuda and boundary_kernels(self.kind):
            plain.update(cu_seq_lens_q=packing.cu, seq_idx=_seq_idx(packing, batch, length))
            return forward(self.module, hidden_states, *args, **plain)
        segments = _segments(packing, batch, length, hidden_states.device)
        if segments.whole_rows:
            return forward(self.module, hidden_states, *args, **plain)
        return self._per_segment(forward, hidden_states, segments, args, plain)

    def _per_segment(self, forward, hidden: torch.Tensor, segments: _Segments, args: tuple, kwargs: dict):
        """hidden [B, T, H] -> the layer on each group [n, L, H] -> [B, T, H'] in the original order."""
        batch, length = hidden.shape[:2]
        flat = hidden.reshape(batch * length, -1)
        mask = kwargs.pop("attention_mask", args[1] if len(args) > 1 else None)
        args = args[:1]
        mask_flat = mask.reshape(-1) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        outputs = []
        for index, valid, keep in segments.groups:
            part = flat[index] * valid[..., None].to(flat.dtype)
            part_mask = None if mask_flat is None else mask_flat[index] * valid.to(mask_flat.dtype)
            out = forward(self.module, part, *args, attention_mask=part_mask, **kwargs)
            outputs.append(out.flatten(0, 1)[keep])
        return torch.cat(outputs)[segments.inverse].reshape(batch, length, -1)


# --------------------------------------------------------------------------------------------------------
# installing it
# --------------------------------------------------------------------------------------------------------


def _owner(model: nn.Module, name: str) -> nn.Module:
    """The module owning the decoder layers ``name`` sits in (the parent of its last ``nn.ModuleList``)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if isinstance(model.get_submodule(".".join(parts[:cut])), nn.ModuleList):
            return model.get_submodule(".".join(parts[: cut - 1]))
    raise ValueError(
        f"{type(model).__name__}: token mixer {name} sits in no nn.ModuleList of decoder layers, so vlm-pack "
        "cannot see the position ids its text model receives; pass cu_seq_lens_q/k with flattened rows."
    )


def isolate_token_mixers(model: nn.Module) -> nn.Module:
    """Make every token mixer of ``model`` keep packed samples apart (see the module docstring).

    Idempotent; parameters, buffers and state_dict keys are unchanged (``save_pretrained`` works). Raises
    ValueError, before touching anything, when the model holds a token mixer vlm-pack does not know.
    Returns the model.
    """
    mixers = find_token_mixers(model)
    unknown = [m for m in mixers if m.kind == "unknown"]
    if unknown:
        raise ValueError("; ".join(mixer_problems(model, unknown)))
    # one _Boundaries per text model, shared by its mixers: found through the mixers already isolated (a second
    # call), never stored on the model's modules
    states: dict[nn.Module, _Boundaries] = {}
    pending = []
    for mixer in mixers:
        module, owner = model.get_submodule(mixer.name), _owner(model, mixer.name)
        installed = module.__dict__.get("forward")
        if isinstance(installed, _IsolatedForward):
            states.setdefault(owner, installed.state)
        else:
            pending.append((module, mixer.kind, owner))
    for module, kind, owner in pending:
        if owner not in states:
            states[owner] = _Boundaries(owner)
        module.forward = _IsolatedForward(module, kind, states[owner])
    return model


def summarize(mixers: list[TokenMixer]) -> list[str]:
    """Report lines: the mixers grouped by kind and isolation, e.g.
    ``3 gated_delta_net layer(s), per_sample: model.layers.0.linear_attn, ... (how)``."""
    groups: dict[tuple[str, str], list[TokenMixer]] = {}
    for m in mixers:
        groups.setdefault((m.kind, m.isolation), []).append(m)
    lines = []
    for (kind, isolation), members in groups.items():
        names = ", ".join(m.name for m in members[:3]) + (", ..." if len(members) > 3 else "")
        lines.append(f"{len(members)} {kind} layer(s), {isolation}: {names} ({members[0].how})")
    return lines
