"""Token mixers that are not attention: sample boundaries reach them too, on every route, by default.

Attention keeps packed samples apart through its mask or ``cu_seqlens``. Some layers mix tokens another way
and carry one sample into the next unless told where samples start::

    row          a0 a1 a2 b0 b1 b2 b3          (two samples packed in one row)
    short conv   b0 reads a1 a2                (kernel 4: the last 3 tokens)       leaks
    delta rule   b0 starts from a's state      (a recurrent state over the row)     leaks

Known (``KNOWN_MIXERS``, transformers 5.25): gated delta-nets (Qwen3.5 / 3.6 and their MoE, Qwen3-Next,
Qwen4-Exp, MiniCPM-V 4.6's ``qwen3_5_text``), short convolutions (LFM2, LFM2-MoE, LFM3), Mamba2 (Nemotron-H, the
text model of ``nemotron_h_omni``), Kimi delta attention (GLM-5-Next). transformers hands these layers the decoder
layer's ``**kwargs`` but not ``position_ids``; its PyTorch paths leak silently without boundaries (max |packed -
alone| 0.37 Qwen3.5, 0.495 LFM2) and, from 5.24, refuse ``cu_seqlens`` / ``seq_idx`` ("can't keep packed
sequences apart").

**Safe by default.** Every way vlm-pack hands rows to a model runs each mixer per sample or stops before the
first optimizer step, on every transformers release vlm-pack supports (5.6 on):

    route                                           what keeps the samples apart
    PackedSFTTrainer (TRL), use_varlen_attention    vlm-pack meets the model: it calls isolate_token_mixers
    Trainer(data_collator=ds.trainer_collator()),   vlm-pack never sees the model: the rows of a family with
    PackingCollator(return_style=...), Energon,     token mixers carry ``seq_idx`` (``PackedBatch.model_inputs``),
    a loop on batch.model_inputs(style),            other rows restart their positions per sample; the first
    TRL's own SFTTrainer with vlm-pack's collator   model call that receives either isolates the model's
                                                    mixers before any layer runs (the packed-call guard)
    isolate_token_mixers(model) by hand             every route, any transformers release

**The packed-call guard** (``packed_calls.py``) isolates a model's mixers at its first packed call, whatever
route the rows took.

``isolate_token_mixers(model)`` installs a boundary-respecting path in every known mixer: the layer runs on each
sample segment alone (segments of similar length batched into one call, right-padded: the layers are causal,
so the padding after a segment never reaches it), which is exact against each sample alone by construction::

    hidden [B, T, H]  --gather-->  [n, L, H] per group  --layer-->  [n, L, H']  --scatter-->  [B, T, H']

Boundaries come from ``cu_seq_lens_q`` in the layer's kwargs (flash-style ``[1, R*T]`` rows), else ``seq_idx``
(``[B, T]`` sample ordinals), else the position ids the text model received (a forward pre-hook on the module
owning the decoder layers; ``[B, T]``, Qwen's ``[4, B, T]`` with the text row first, or ``[3, B, T]`` where a
sample starts at the token whose three rows are all 0). They are worked out once per forward (``boundaries.py``
caches), not per layer. On CUDA with flash-linear-attention's ``fla-core`` installed (``pip install
'vlm-pack[kernels]'``), the layers with a recipe in ``mixer_kernels.py`` (Qwen3.5's delta-net, LFM2/LFM3's short
conv) run the whole row once through its Triton kernels with the segments' ``cu_seqlens`` (``isolation=
"kernel"``); the per-sample loop stays the exact path everywhere else.

**Kept isolated.** The same pre-hook checks, before any layer of each forward runs, that every isolated mixer
is still in place with vlm-pack's forward. transformers 5.25 loads models with ``use_kernels`` on and
re-kernelizes them on ``model.train()`` / ``.eval()`` (``integrations/hub_kernels.py``): where no hub kernel
exists for the device this pops the instance forward (measured on CPU: the isolation was gone after
``model.train()``), and the guard puts it back; where a hub kernel replaces the layer's forward (e.g.
``Qwen3_5GatedDeltaNet`` on some GPUs), or a layer was swapped for another module, the forward raises naming
the layer and the fix.

``find_token_mixers(model)`` lists every such layer, known ones by kind and unknown ones (a module holding an
``nn.Conv1d`` with kernel > 1, a Mamba/SSM/recurrent class, or a layer vlm-pack knows it cannot split, such as
Inkling2's short convolutions inside attention) with ``isolation="none"``, so a future model never passes
silently: ``isolate_token_mixers`` raises on those before the first step, naming them.
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from . import mixer_kernels
from .boundaries import (
    IdentityCache,
    Packing,
    host_copy,
    packing_from_cu,
    packing_from_positions,
    to_device,
)

__all__ = [
    "KNOWN_MIXERS",
    "TokenMixer",
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
    "Qwen4ExpTextGatedDeltaNet": "gated_delta_net",
    "Lfm2ShortConv": "short_conv",
    "Lfm2MoeShortConv": "short_conv",
    "Lfm3ShortConv": "short_conv",
    "NemotronHMamba2Mixer": "mamba2",
    "Glm5NextTextLinearAttention": "kimi_delta_attention",
}
#: Layers that mix tokens across packed samples and that vlm-pack cannot split per sample: refused by name.
_REFUSED: dict[str, str] = {
    "Glm5NextTextIndexer": "GLM-5-Next's indexed attention picks its keys over the whole row, across packed "
    "samples (transformers 5.25; measured max |packed - alone| 4.9 on a tiny model, restarted positions)",
    "Inkling2ShortConvolution": "Inkling2's short convolutions inside its attention blocks take a conv_mask and "
    "dynamic inputs that vlm-pack does not split per sample",
    "Inkling2DynamicShortConvolution": "Inkling2's dynamic short convolutions take per-token weights that "
    "vlm-pack does not split per sample",
}
#: Class names of layers that mix tokens without attention (an unknown model's, to refuse, not to run).
_MIXER_NAME = re.compile(
    r"(Mamba2?|SSM|Mixer|DeltaNet|ShortConv|ShortConvolution|Recurrent|Rglru|RWKV|LinearAttention|Hyena"
    r"|NGramEmbedding)$",
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
        why = _REFUSED.get(cls, "an unknown layer that mixes tokens")
        return TokenMixer(name, kind, "none", f"{cls}: {why}; vlm-pack cannot keep packed samples apart in it")
    if isinstance(module.__dict__.get("forward"), _IsolatedForward):
        if _device(module).type == "cuda" and mixer_kernels.kernel_forward(module) is not None:
            return TokenMixer(name, kind, "kernel", f"{cls}: the whole row through flash-linear-attention's "
                              "kernels with the samples' cu_seqlens")
        return TokenMixer(name, kind, "per_sample", f"{cls} run per sample segment (boundaries from "
                          "cu_seq_lens_q or seq_idx, else the text model's position_ids)")
    return TokenMixer(name, kind, "none", f"{cls} as transformers runs it: packed samples leak into each "
                      "other, or its PyTorch fallback refuses the batch's seq_idx")


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
        if kind is None and (type(module).__name__ in _REFUSED or _unknown_mixer(sub_name, module)):
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
                   "per row) or add its class to vlm_pack.forward.mixers.KNOWN_MIXERS with a tested path")
        else:
            fix = _FIX
        problems.append(f"{cls}: layer {m.name} mixes tokens without attention and keeps no sample "
                        f"boundaries ({m.how}); {fix}")
    return problems


# --------------------------------------------------------------------------------------------------------
# the boundaries of the current forward
# --------------------------------------------------------------------------------------------------------


class _Boundaries:
    """Owned by one text model: the position ids of its current forward, captured by a pre-hook, and the
    guard of its isolated mixers, checked by the same hook before any layer runs.

    Kept after the forward so that gradient checkpointing's recompute (in backward) sees the same ones;
    a later forward replaces them.
    """

    def __init__(self, owner: nn.Module) -> None:
        params = list(inspect.signature(owner.forward).parameters)
        self.position_index = params.index("position_ids") if "position_ids" in params else None
        self.position_ids: torch.Tensor | None = None
        self.guards: list[_Guard] = []
        self.handle = owner.register_forward_pre_hook(self.capture, with_kwargs=True)

    def capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for guard in self.guards:
            guard.check()
        pos = kwargs.get("position_ids")
        if pos is None and self.position_index is not None and len(args) > self.position_index:
            pos = args[self.position_index]
        self.position_ids = pos if isinstance(pos, torch.Tensor) else None


@dataclass
class _Guard:
    """One isolated mixer as installed: ``parent.<attr>`` is ``module`` and its ``forward`` is ``installed``.

    transformers (5.25, ``integrations/hub_kernels.py``) re-kernelizes a model loaded with
    ``from_pretrained`` (``use_kernels`` on by default) whenever ``model.train()`` / ``.eval()`` changes its
    mode: on a device with no hub kernel it pops the instance ``forward`` (the class's own returns, and
    with it the leak), on one with a kernel it installs the kernel layer's ``forward`` (which keeps no
    boundaries either). ``check`` re-installs over the class's own forward (the same computation, per sample)
    and refuses anything else by name, before the first layer of the forward runs."""

    name: str
    parent: nn.Module
    attr: str
    module: nn.Module
    installed: Any

    def check(self) -> None:
        current = self.parent._modules.get(self.attr)
        if current is not self.module:
            raise RuntimeError(
                f"token mixer {self.name} was replaced after vp.isolate_token_mixers(model) (now "
                f"{type(current).__name__}): the new layer keeps no sample boundaries; call "
                "vp.isolate_token_mixers(model) again after replacing layers"
            )
        forward = self.module.__dict__.get("forward")
        if forward is self.installed:
            return
        if forward is None:  # transformers' kernelize reverted to the class's forward: isolate it again
            self.module.forward = self.installed
            return
        origin = getattr(getattr(forward, "__func__", forward), "__qualname__", type(forward).__name__)
        raise RuntimeError(
            f"token mixer {self.name} ({type(self.module).__name__}) had its forward replaced by {origin} after "
            "vp.isolate_token_mixers(model) (transformers' hub kernels do this on model.train() / .eval() and "
            "kernelize()): it would run the packed row whole and carry one sample into the next. Load the "
            "model with use_kernels=False (or call model.set_use_kernels(False)), then "
            "vp.isolate_token_mixers(model) again"
        )


def packing_from_seq_idx(seq_idx: torch.Tensor, device: torch.device) -> Packing:
    """``seq_idx`` [B, T] (the sample ordinal of every token, ``PackedBatch.model_inputs``' marker) -> the
    samples' ``cu`` over the B*T tokens, read from its host copy once per forward (cached)::

        seq_idx [[0 0 0 1 1 2 2]]  ->  cu [0 3 5 7]
    """
    key = (tuple(seq_idx.shape), device)
    cached = _SEQ_IDX.get(seq_idx, key)
    if cached is not None:
        return cached
    flat = host_copy(seq_idx).reshape(-1).to(torch.int64)
    starts = (flat[1:] != flat[:-1]).nonzero().flatten() + 1
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), starts, torch.tensor([flat.numel()])]).to(torch.int32)
    lengths = cu[1:] - cu[:-1]
    packing = Packing(to_device(cu, device), int(lengths.max()) if lengths.numel() else 0, None)
    return _SEQ_IDX.put(seq_idx, key, packing)


_SEQ_IDX = IdentityCache()
_SEGMENTS = IdentityCache()


def _packing(state: _Boundaries | None, hidden: torch.Tensor, kwargs: dict) -> Packing | None:
    """Where the samples of ``hidden`` [B, T, H] lie, or None when nothing says (one sample per row).

    In order: ``cu_seq_lens_q`` (flash-style rows), ``seq_idx`` [B, T] (every HF style of a family with
    token mixers), the position ids the text model received."""
    batch, length = hidden.shape[:2]
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return packing_from_cu(cu, kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"), batch * length,
                               hidden.device)
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and seq_idx.numel() == batch * length:
        return packing_from_seq_idx(seq_idx, hidden.device)
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
    cu: torch.Tensor  # [S+1] int64 on the device: the segments over the flattened B*T tokens (kernels)
    cu_host: torch.Tensor  # the same on the host (the kernels take it too, to skip a device-to-host copy)


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
    cu_host = torch.tensor([*starts, batch * length], dtype=torch.int64)
    whole = len(starts) == batch
    out = _Segments(tuple(groups), to_device(inverse, device), whole, to_device(cu_host, device), cu_host)
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
    """Instance ``forward`` of an isolated mixer: the class's own forward per sample segment, or the whole
    row through flash-linear-attention's kernels with the segments' ``cu_seqlens`` (``mixer_kernels.py``).

    Lives in the module's ``__dict__`` (not its state_dict): parameters and buffers are untouched.
    """

    def __init__(self, module: nn.Module, kind: str, state: _Boundaries) -> None:
        self.module, self.kind, self.state = module, kind, state

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        forward = type(self.module).forward
        cache = kwargs.get("cache", kwargs.get("past_key_values", args[0] if args else None))
        if cache is not None or hidden_states.dim() != 3:  # decoding: one sample, its own state
            return forward(self.module, hidden_states, *args, **_plain(kwargs))
        packing = _packing(self.state, hidden_states, kwargs)
        plain = _plain(kwargs)
        if packing is None:
            return forward(self.module, hidden_states, *args, **plain)
        batch, length = hidden_states.shape[:2]
        segments = _segments(packing, batch, length, hidden_states.device)
        if segments.whole_rows:
            return forward(self.module, hidden_states, *args, **plain)
        whole_row = mixer_kernels.kernel_forward(self.module) if _kernel_device(hidden_states) else None
        if whole_row is not None:
            mask = plain.get("attention_mask", args[1] if len(args) > 1 else None)
            return whole_row(self.module, hidden_states, segments.cu, segments.cu_host, mask)
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


def _kernel_device(hidden: torch.Tensor) -> bool:
    """Whether flash-linear-attention's Triton kernels run where ``hidden`` is (CUDA)."""
    return hidden.is_cuda


def _plain(kwargs: dict) -> dict:
    """The kwargs without boundaries: transformers' PyTorch fallbacks refuse ``cu_seqlens`` / ``seq_idx``."""
    return {k: v for k, v in kwargs.items() if k not in _BOUNDARY_KWARGS}


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
    for mixer in mixers:
        module, owner = model.get_submodule(mixer.name), _owner(model, mixer.name)
        state = _STATES.get(owner)
        if state is None:  # one per text model, shared by its mixers (held here, never on the model's modules)
            state = _STATES[owner] = _Boundaries(owner)
        if isinstance(module.__dict__.get("forward"), _IsolatedForward):
            continue
        installed = _IsolatedForward(module, mixer.kind, state)
        module.forward = installed
        parent_name, _, attr = mixer.name.rpartition(".")
        guard = _Guard(mixer.name, model.get_submodule(parent_name), attr, module, installed)
        state.guards = [g for g in state.guards if g.name != mixer.name] + [guard]
    return model


_STATES: weakref.WeakKeyDictionary[nn.Module, _Boundaries] = weakref.WeakKeyDictionary()


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
