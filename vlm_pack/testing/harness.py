"""The packed-vs-batched harness: run a model both ways on the same samples, report token by token.

::

    batched (reference: one sample per row)       packed (under test: the collator's rows)
    row 0  a0 a1 a2 a3 .  .                       row 0  a0 a1 a2 a3 b0 b1 b2 c0 c1 .
    row 1  b0 b1 b2 .  .  .        ---------->    positions  0 1 2 3 0 1 2 0 1 .   (restart per sample)
    row 2  c0 c1 .  .  .  .                       cu_seqlens 0       4     7   9
    attention_mask marks the pads                 attention: a | b | c blocks, never across

``check_packed_equivalence`` goes in three steps: (1) the reference log-probs from padded batches
(``pad_samples`` + ``batched_forward``), (2) the packed batch, checked to hold every sample intact where
its boundaries say, and its log-probs (``packed_forward``), (3) the comparison, sample by sample, with
``token_mult_prob_error`` (``metric.py``). The result is an ``EquivalenceReport``. It also names the
layers that mix tokens without attention (``vlm_pack.forward.mixers``) and how boundaries reached them, and fails
on a model where one of them keeps none, even when the metric happens to pass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collate.labels import IGNORE_INDEX
from ..collate.padded import TOKEN_KEYS, pad_samples
from ..forward.mixers import TokenMixer, find_token_mixers, summarize
from ..forward.packed_calls import unguarded
from .metric import next_token_logprobs, token_mult_prob_error
from .packed_run import _packed_batch, _run_packed

__all__ = [
    "EquivalenceReport",
    "PackedEquivalenceError",
    "SampleDiff",
    "TokenDiff",
    "check_packed_equivalence",
    "default_batched_forward",
    "default_packed_forward",
    "pad_samples",
]

# --------------------------------------------------------------------------------------------------------
# The batched reference (``pad_samples``: vlm_pack.collate.padded) and the default forwards
# --------------------------------------------------------------------------------------------------------


def default_batched_forward(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference forward of a Hugging Face model: ``model(**inputs, use_cache=False).logits`` (B, L, V).

    Qwen-VL models compute their own mRoPE positions from ``attention_mask``, ``mm_token_type_ids`` and
    ``image_grid_thw``; LLaVA models use ``arange`` positions (right padding keeps them right).
    """
    return model(**inputs, use_cache=False).logits


def default_packed_forward(
    style: str = "sdpa", use_cache: bool | None = False
) -> Callable[[Any, Any], torch.Tensor]:
    """Packed forward of a Hugging Face model: ``model(**batch.model_inputs(style), use_cache=...).logits``.

    ``use_cache=None`` leaves the model's default (``config.use_cache``, usually True): transformers then
    builds a ``DynamicCache`` and skips packed-sequence detection, so samples attend to each other. That is
    what the negative control checks; real runs keep ``False``.
    """

    def forward(model: Any, batch: Any) -> torch.Tensor:
        kwargs = dict(batch.model_inputs(style))
        leaking = _leaking_mixers(model)
        if leaking:
            # the packed-call guard would isolate the model at this call (packed_calls.guard_packed_calls); the leak of
            # the model as given is measured instead, and the report names the layer (mixer_problems)
            kwargs.pop("seq_idx", None)
        if use_cache is None:
            kwargs.pop("use_cache", None)
        else:
            kwargs["use_cache"] = use_cache
        with unguarded() if leaking else contextlib.nullcontext():
            logits = model(**kwargs).logits
        # flash styles flatten the rows to (1, R*T): give the logits back the rows of batch.input_ids.
        return logits.reshape(*batch.input_ids.shape, logits.shape[-1])

    return forward


def _leaking_mixers(model: Any) -> bool:
    """Whether ``model`` holds a token mixer that keeps no sample boundaries (not isolated)."""
    return isinstance(model, torch.nn.Module) and any(m.isolation == "none" for m in find_token_mixers(model))


# --------------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenDiff:
    """One scored token: position ``position`` of sample ``sample`` predicting ``token_id`` (at position+1)."""

    sample: int
    position: int
    token_id: int
    logp_batched: float
    logp_packed: float
    token: str | None = None

    @property
    def abs_diff(self) -> float:
        return abs(self.logp_batched - self.logp_packed)

    def __str__(self) -> str:
        name = f"{self.token!r} " if self.token is not None else ""
        return (
            f"sample {self.sample} position {self.position} -> {name}(id {self.token_id}): "
            f"logp batched {self.logp_batched:.6f} packed {self.logp_packed:.6f} "
            f"|d| {self.abs_diff:.3g}"
        )


@dataclass(frozen=True)
class SampleDiff:
    """Per-sample summary: its own metric, worst token and where it sat in the packed batch."""

    sample: int
    num_tokens: int
    metric: float
    max_abs_diff: float
    worst: TokenDiff | None
    row: int
    offset: int


@dataclass
class EquivalenceReport:
    """Result of ``check_packed_equivalence``; ``str(report)`` is a readable summary.

    ``passed`` is True when every sample was found intact in the packed batch, every token mixer that is
    not attention (``token_mixers``) keeps the sample boundaries, and ``metric <= tolerance``.
    """

    metric: float
    max_abs_diff: float
    tolerance: float
    num_samples: int
    num_tokens: int
    num_rows: int
    row_length: int
    style: str
    samples: list[SampleDiff] = field(default_factory=list)
    worst_tokens: list[TokenDiff] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    token_mixers: list[TokenMixer] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and math.isfinite(self.metric) and self.metric <= self.tolerance

    @property
    def message(self) -> str:
        """One line: PASS/FAIL and why."""
        if self.problems:
            return f"FAIL: {len(self.problems)} structural problem(s): {self.problems[0]}"
        if not math.isfinite(self.metric):
            return f"FAIL: token_mult_prob_error is {self.metric} (non-finite logits)"
        verdict = "PASS" if self.metric <= self.tolerance else "FAIL"
        cmp = "<=" if self.metric <= self.tolerance else ">"
        return (
            f"{verdict}: token_mult_prob_error {self.metric:.7f} {cmp} tolerance {self.tolerance:.6g} "
            f"(max |dlogp| {self.max_abs_diff:.3g} over {self.num_tokens} tokens)"
        )

    def raise_if_failed(self) -> None:
        """Raise ``PackedEquivalenceError`` (an ``AssertionError``) with the full report when not passed."""
        if not self.passed:
            raise PackedEquivalenceError(str(self))

    def __str__(self) -> str:
        lines = [
            f"packed-vs-batched equivalence ({self.style}): {self.message}",
            f"  {self.num_samples} samples packed into {self.num_rows} row(s) of {self.row_length} tokens",
            f"  token_mult_prob_error {self.metric:.7f}  (1.0 = identical; tolerance {self.tolerance:.6g})",
            f"  max |logp_batched - logp_packed| {self.max_abs_diff:.3g}",
        ]
        lines += [f"  problem: {p}" for p in self.problems]
        lines.append(f"  token mixers that are not attention: {len(self.token_mixers) or 'none'}")
        lines += [f"    {line}" for line in summarize(self.token_mixers)]
        if self.samples:
            ranked = sorted(self.samples, key=lambda s: -s.metric)[:5]
            lines.append("  worst samples:")
            lines += [
                f"    sample {s.sample:>3} (row {s.row}, offset {s.offset}, {s.num_tokens} tokens): "
                f"error {s.metric:.7f}, max |dlogp| {s.max_abs_diff:.3g}"
                for s in ranked
            ]
        if self.worst_tokens:
            lines.append("  worst tokens:")
            lines += [f"    {t}" for t in self.worst_tokens]
        if not self.passed and not self.problems:
            lines.append(
                "  usual causes: position_ids that do not restart at each sample (or 3-row instead of "
                "4-row mRoPE ids for Qwen-VL), use_cache not False (transformers then skips packed-mask "
                "detection), an attention_mask passed with packed rows, cu_seqlens left in the collapsed "
                "space (one token per image) while the model attends over expanded embeddings."
            )
        return "\n".join(lines)


class PackedEquivalenceError(AssertionError):
    """Raised by ``EquivalenceReport.raise_if_failed``; the message is the full report."""


# --------------------------------------------------------------------------------------------------------
# The harness, step by step
# --------------------------------------------------------------------------------------------------------


def _one_example(index: int, sample: Any) -> dict[str, Any]:
    """``sample`` with 1-D token tensors, as ``pad_samples`` takes it.

    HF processors return one example as ``[1, L]`` tensors with an ``attention_mask``: the batch dim is
    dropped, and so are the tokens the mask marks as padding (the collator drops them too).
    """
    if not hasattr(sample, "keys") or "input_ids" not in sample:
        raise ValueError(f"sample {index}: needs 'input_ids' (a dict from process_sample or an HF processor)")
    out = dict(sample)
    mask = out.pop("attention_mask", None)
    for key in ("input_ids", "labels", *TOKEN_KEYS[1:]):
        if out.get(key) is None:
            out.pop(key, None)
            continue
        t = torch.as_tensor(out[key])
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 1:
            raise ValueError(
                f"sample {index}: {key} must be [L] or [1, L] (one example), got shape {tuple(t.shape)}"
            )
        out[key] = t
    if mask is not None:
        keep = torch.as_tensor(mask).reshape(-1).bool()
        if keep.numel() != out["input_ids"].numel():
            raise ValueError(f"sample {index}: attention_mask and input_ids differ in length")
        if not bool(keep.all()):
            for key in ("input_ids", "labels", *TOKEN_KEYS[1:]):
                if key in out:
                    out[key] = out[key][keep]
    return out


def _gather_tokens(
    logp: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor | None,
    row: int,
    offset: int,
    length: int,
    targets: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L-1,) log-probs, next-token ids and the scoring mask of one sample's transitions."""
    lp = logp[row, offset : offset + length - 1]
    nxt = ids[row, offset + 1 : offset + length]
    if targets == "labels":
        if labels is None:
            raise ValueError("targets='labels' needs 'labels' in every sample")
        mask = labels[row, offset + 1 : offset + length] != IGNORE_INDEX
    else:
        mask = torch.ones_like(nxt, dtype=torch.bool)
    return lp, nxt, mask


def _checked_samples(
    samples: Sequence[Any], collator: Any, packed_batch: Any, targets: str
) -> tuple[list[Any], list[dict[str, Any]]]:
    """The samples as given (for the collator) and as 1-D token dicts (for the reference), checked."""
    if targets not in ("all", "labels"):
        raise ValueError(f"targets must be 'all' or 'labels', got {targets!r}")
    if not samples:
        raise ValueError("check_packed_equivalence: no samples")
    given = list(samples)  # what the collator gets, untouched
    checked = [_one_example(i, s) for i, s in enumerate(given)]
    for i, s in enumerate(checked):
        if len(s["input_ids"]) < 2:
            raise ValueError(f"sample {i}: needs at least 2 tokens (one next-token transition to compare)")
        if targets == "labels" and "labels" not in s:
            raise ValueError(f"sample {i} has no 'labels': targets='labels' scores the tokens they mark")
    if collator is None and packed_batch is None:
        raise ValueError("check_packed_equivalence needs a collator (or an already collated packed_batch=)")
    return given, checked


def _eval_device(model: Any, device: torch.device | str | None) -> torch.device | str:
    """Put ``model`` in eval mode; the device inputs go to (default: its first parameter's)."""
    with contextlib.suppress(AttributeError):
        model.eval()
    if device is not None:
        return device
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device if param is not None else torch.device("cpu")


_Scoring = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (L-1,) log-probs, next-token ids, scoring mask


def _reference_logprobs(
    model: Any,
    samples: list[dict[str, Any]],
    batched_forward: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor],
    batch_size: int | None,
    pad_token_id: int,
    targets: str,
    device: torch.device | str,
) -> list[_Scoring]:
    """Each sample's transitions scored by the padded reference forward, ``batch_size`` samples a call."""
    step = batch_size or len(samples)
    reference: list[_Scoring] = []
    for lo in range(0, len(samples), step):
        chunk = samples[lo : lo + step]
        inputs = {k: v.to(device) for k, v in pad_samples(chunk, pad_token_id).items()}
        logits = batched_forward(model, inputs)
        ids = inputs["input_ids"].to(logits.device)
        logp = next_token_logprobs(logits, ids)
        labels = (
            torch.nn.utils.rnn.pad_sequence(
                [s["labels"] for s in chunk], batch_first=True, padding_value=IGNORE_INDEX
            )
            if targets == "labels"
            else None
        )
        for row, sample in enumerate(chunk):
            reference.append(_gather_tokens(logp, ids, labels, row, 0, len(sample["input_ids"]), targets))
    return reference


@dataclass
class _Scored:
    """Every compared transition, concatenated over samples in sample order (K,), and per-sample diffs."""

    logp_batched: torch.Tensor
    logp_packed: torch.Tensor
    mask: torch.Tensor  # bool: scored (all, or label != -100)
    sample: torch.Tensor  # the sample each transition belongs to
    position: torch.Tensor  # its position in that sample
    token_id: torch.Tensor  # the token it predicts
    samples: list[SampleDiff]


def _score(
    reference: list[_Scoring],
    logp: torch.Tensor,
    packed_ids: torch.Tensor,
    labels: torch.Tensor | None,
    spans: list[tuple[int, int, int, int]],
    samples: list[dict[str, Any]],
    targets: str,
    tokenizer: Any,
) -> _Scored:
    """Pair each intact sample's packed transitions with its reference ones."""
    columns: list[tuple[torch.Tensor, ...]] = []
    sample_diffs: list[SampleDiff] = []
    for i, row, off, length in sorted(spans):
        if not 0 <= i < len(samples) or length != len(samples[i]["input_ids"]):
            continue
        lp_ref, next_ids, mask = reference[i]
        lp_pack, next_packed, _ = _gather_tokens(logp, packed_ids, labels, row, off, length, targets)
        if not torch.equal(next_ids.cpu(), next_packed.cpu()):
            continue  # already reported as a token mismatch
        lp_ref, lp_pack, mask = lp_ref.cpu(), lp_pack.cpu(), mask.cpu()
        owner = torch.full_like(next_ids, i).cpu()
        columns.append((lp_ref, lp_pack, mask, owner, torch.arange(length - 1), next_ids.cpu()))
        if mask.any():
            diff = torch.where(mask, (lp_ref - lp_pack).abs(), torch.zeros_like(lp_ref))
            worst = int(diff.argmax())
            metric = float(token_mult_prob_error(lp_ref, lp_pack, mask))
            worst_token = _token_diff(i, worst, int(next_ids[worst]), lp_ref[worst], lp_pack[worst], tokenizer)
            sample_diffs.append(
                SampleDiff(i, int(mask.sum()), metric, float(diff.max()), worst_token, row=row, offset=off)
            )
    if not columns:
        empty = torch.zeros(0, dtype=torch.long)
        return _Scored(
            torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), empty, empty, empty, []
        )
    return _Scored(*(torch.cat(column) for column in zip(*columns)), samples=sample_diffs)


def _summarise(
    scored: _Scored, top_k: int, tokenizer: Any, problems: list[str]
) -> tuple[float, float, list[TokenDiff]]:
    """The metric, the largest |dlogp| and the ``top_k`` worst tokens over every scored transition."""
    a, b, m = scored.logp_batched, scored.logp_packed, scored.mask
    num_tokens = int(m.sum())
    if num_tokens == 0:
        problems.append("no token to score (every sample missing or every label -100)")
        return float("nan"), float("nan"), []
    metric = float(token_mult_prob_error(a, b, m))
    diff = torch.where(m, (a - b).abs(), torch.full_like(a, -1.0))
    top = torch.topk(diff, min(top_k, num_tokens)).indices.tolist()
    worst = [
        _token_diff(
            int(scored.sample[j]), int(scored.position[j]), int(scored.token_id[j]), a[j], b[j], tokenizer
        )
        for j in top
    ]
    return metric, float(diff.max()), worst


@torch.no_grad()
def check_packed_equivalence(
    model: Any,
    samples: Sequence[dict[str, torch.Tensor]],
    collator: Callable[[Sequence[dict[str, torch.Tensor]]], Any] | None,
    *,
    tolerance: float = 1.0001,
    style: str = "sdpa",
    batch_size: int | None = None,
    use_cache: bool | None = False,
    targets: str = "all",
    pad_token_id: int = 0,
    batched_forward: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] | None = None,
    packed_forward: Callable[[Any, Any], torch.Tensor] | None = None,
    packed_batch: Any = None,
    tokenizer: Any = None,
    top_k: int = 5,
    device: torch.device | str | None = None,
) -> EquivalenceReport:
    """Run ``model`` batched (padded) and packed (through ``collator``) and compare per-token log-probs.

    Args:
        model: a model in the dtype to check (fp32 on CPU for an exact check), put in eval mode here.
        samples: processed samples (``process_sample`` dicts with ``input_ids``, ``labels`` and vision
            tensors), in the layout the collator expects.
        collator: ``PackingCollator`` (or any callable ``samples -> PackedBatch``) whose output must hold
            every sample; ignored when ``packed_batch`` is given.
        tolerance: pass when ``token_mult_prob_error <= tolerance``. 1.0001 fits fp32; bf16 needs more
            (see ``benchmarks/RESULTS.md``).
        style: ``batch.model_inputs(style)`` for the default packed forward ("sdpa", "eager",
            "flash_attention_2", ...).
        batch_size: samples per reference forward (None: all in one padded batch).
        use_cache: passed to the default packed forward; ``None`` leaves the model default (a negative
            control: transformers then ignores the packed position ids).
        targets: "all" scores every next-token transition inside each sample (the strictest check);
            "labels" only those whose label is not -100 (what the loss sees).
        pad_token_id: padding id of the reference batch (any id but an image token).
        batched_forward: ``(model, pad_samples(...)) -> logits (B, L, V)``; default
            ``default_batched_forward``.
        packed_forward: ``(model, packed_batch) -> logits (R, T, V)`` aligned with ``batch.input_ids``;
            default ``default_packed_forward(style, use_cache)``. Models that expand collapsed placeholders
            map their logits back to the collapsed positions (see ``collapsed_packed_forward``).
        packed_batch: an already collated batch of ``samples`` (skips ``collator``).
        tokenizer: when given, the report shows tokens as text.
        top_k: how many worst tokens the report lists.
        device: where the inputs go (default: the device of the model's first parameter).

    Returns:
        ``EquivalenceReport`` (``.passed``, ``.metric``, ``.max_abs_diff``, per-sample ``.samples``,
        ``.worst_tokens``, ``.raise_if_failed()``).
    """
    given, checked = _checked_samples(samples, collator, packed_batch, targets)
    batched_forward = batched_forward or default_batched_forward
    packed_forward = packed_forward or default_packed_forward(style, use_cache)
    device = _eval_device(model, device)

    # 1. Reference: padded batches, one sample per row.
    reference = _reference_logprobs(model, checked, batched_forward, batch_size, pad_token_id, targets, device)

    # 2. Packed: the collator's rows, each sample found intact where the batch says it is.
    batch = _packed_batch(collator, given, packed_batch, device)
    packed = _run_packed(model, batch, packed_forward, checked, targets)

    # 3. Compare sample by sample, then over every scored token.
    scored = _score(reference, packed.logp, packed.ids, packed.labels, packed.spans, checked, targets, tokenizer)
    metric, max_abs, worst_tokens = _summarise(scored, top_k, tokenizer, packed.problems)
    return EquivalenceReport(
        metric=metric,
        max_abs_diff=max_abs,
        tolerance=tolerance,
        num_samples=len(checked),
        num_tokens=int(scored.mask.sum()),
        num_rows=packed.ids.shape[0],
        row_length=packed.ids.shape[1],
        style=style,
        samples=scored.samples,
        worst_tokens=worst_tokens,
        problems=packed.problems,
        token_mixers=packed.mixers,
    )


def _token_text(tokenizer: Any, token_id: int) -> str | None:
    if tokenizer is None:
        return None
    try:
        return str(tokenizer.convert_ids_to_tokens(token_id))
    except Exception:  # a report must not fail on a tokenizer quirk
        return None


def _token_diff(
    sample: int, position: int, token_id: int, logp_batched: Any, logp_packed: Any, tokenizer: Any
) -> TokenDiff:
    text = _token_text(tokenizer, token_id)
    return TokenDiff(sample, position, token_id, float(logp_batched), float(logp_packed), text)
