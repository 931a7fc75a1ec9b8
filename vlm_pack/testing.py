"""Packed-vs-batched equivalence: the test that proves a packing setup right, as a library feature.

A packing setup is correct when every sample, packed into a row with others, gets exactly the per-token
log-probs it gets in an ordinary padded batch. ``check_packed_equivalence`` runs the model both ways on the
same samples and compares them token by token::

    batched (reference: one sample per row)       packed (under test: the collator's rows)
    row 0  a0 a1 a2 a3 .  .                       row 0  a0 a1 a2 a3 b0 b1 b2 c0 c1 .
    row 1  b0 b1 b2 .  .  .        ---------->    positions  0 1 2 3 0 1 2 0 1 .   (restart per sample)
    row 2  c0 c1 .  .  .  .                       cu_seqlens 0       4     7   9
    attention_mask marks the pads                 attention: a | b | c blocks, never across

    logp[t] = log_softmax(logits[t])[x[t+1]]      t = 0 .. L-2 of every sample, in both runs
    token_mult_prob_error = mean_t exp(|logp_batched[t] - logp_packed[t]|)          1.0 = identical

``token_mult_prob_error`` is NeMo-RL's metric (``nemo_rl/algorithms/loss/loss_functions.py``). In fp32
on CPU a correct setup gives 1.000000 (eager: bit-identical; sdpa: max |dlogp| ~1e-6); position ids that do
not restart, a KV cache left on or cu_seqlens left in the collapsed space give 1.01-3.

Models that take Megatron-style *collapsed* input (one placeholder token per image, expanded inside
``forward``) plug in through ``batched_forward=`` / ``packed_forward=``; ``CollapsedLlavaModel`` is such a
model built from real transformers parts, with ``collapsed_batched_forward`` / ``collapsed_packed_forward``::

    collapsed input_ids   t0 t1 <I> t2 | u0 <J> u1                      cu_seqlens (collapsed)  0 4 7
    expanded embeddings   t0 t1 I0 I1 I2 t2 | u0 J0 J1 J2 J3 u1          cu_seqlens (expanded)   0 6 12

Typical use, before a long run::

    from vlm_pack.testing import check_packed_equivalence
    report = check_packed_equivalence(model, samples[:16], collator)   # samples from process_sample
    print(report)
    report.raise_if_failed()
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CollapsedLlavaModel",
    "CollapsedLlavaOutput",
    "EquivalenceReport",
    "PackedEquivalenceError",
    "SampleDiff",
    "TokenDiff",
    "check_packed_equivalence",
    "collapsed_batched_forward",
    "collapsed_packed_forward",
    "default_batched_forward",
    "default_packed_forward",
    "next_token_logprobs",
    "pad_samples",
    "token_mult_prob_error",
]

#: Per-token keys padded to the longest sample by ``pad_samples``; vision keys are concatenated.
_TOKEN_KEYS = ("input_ids", "mm_token_type_ids")
_VISION_KEYS = ("pixel_values", "image_grid_thw", "image_sizes")


# --------------------------------------------------------------------------------------------------------
# The metric and log-prob extraction
# --------------------------------------------------------------------------------------------------------


def token_mult_prob_error(
    logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """NeMo-RL's ``token_mult_prob_error``: ``sum(mask * exp(|a - b|)) / sum(mask)``; 1.0 is exact.

    Args:
        logp_a, logp_b: per-token log-probs of the same tokens, any equal shapes.
        mask: weights of the same shape (1 = real token, 0 = ignore); ``None`` weighs every token 1.

    Returns:
        A float64 scalar tensor >= 1.0 (``exp(|dlogp|)`` averaged: 1.001 means probabilities off by ~0.1%).
    """
    if logp_a.shape != logp_b.shape:
        raise ValueError(f"logp_a {tuple(logp_a.shape)} and logp_b {tuple(logp_b.shape)} differ in shape")
    mask = torch.ones_like(logp_a, dtype=torch.float64) if mask is None else mask.to(torch.float64)
    if mask.shape != logp_a.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the log-probs {tuple(logp_a.shape)}")
    total = mask.sum()
    if total <= 0:
        raise ValueError("token_mult_prob_error: the mask selects no token")
    err = torch.exp((logp_a.double() - logp_b.double()).abs())
    # where() rather than a bare product: exp(inf) * 0 on an ignored token would be nan.
    return torch.where(mask != 0, err * mask, torch.zeros_like(err)).sum() / total


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob each position gives the token that follows it: ``out[..., t] = logp(x[t+1] | logits[t])``.

    Args:
        logits: (R, T, V) any float dtype (computed in float32).
        input_ids: (R, T) the tokens the logits were computed on.

    Returns:
        (R, T) float32; the last column (no next token) is 0. Sample boundaries are the caller's business:
        in a packed row, the last token of one sample "predicts" the first of the next and must be dropped.
    """
    if logits.shape[:-1] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    head = logits[..., :-1, :].float()
    target = input_ids[..., 1:].unsqueeze(-1).to(logits.device)
    # gather - logsumexp: no (R, T, V) log_softmax copy.
    logp = head.gather(-1, target).squeeze(-1) - torch.logsumexp(head, dim=-1)
    return F.pad(logp, (0, 1))


# --------------------------------------------------------------------------------------------------------
# The batched reference
# --------------------------------------------------------------------------------------------------------


def pad_samples(samples: Sequence[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs for the padded reference batch: one sample per row, right padding, an attention mask.

    ::

        samples  a0 a1 a2 a3 | b0 b1         input_ids       a0 a1 a2 a3      attention_mask  1 1 1 1
                                                              b0 b1 P  P                       1 1 0 0

    Args:
        samples: dicts from ``process_sample`` (1-D ``input_ids`` (L,); optional ``mm_token_type_ids`` (L,),
            ``pixel_values``, ``image_grid_thw`` (n, 3), ``image_sizes`` (n, 2)).
        pad_token_id: id written in the padding (never attended to, never scored).

    Returns:
        ``input_ids`` (B, Lmax), ``attention_mask`` (B, Lmax), ``mm_token_type_ids`` (B, Lmax) when the
        samples have it, and the vision tensors concatenated in sample order (LLaVA-NeXT's 5-D
        ``pixel_values`` zero-padded to the most tiles; the model drops the padding using ``image_sizes``).
    """
    if not samples:
        raise ValueError("pad_samples: no samples")
    for i, s in enumerate(samples):
        if "input_ids" not in s or s["input_ids"].ndim != 1 or len(s["input_ids"]) == 0:
            raise ValueError(f"sample {i}: needs a non-empty 1-D 'input_ids' (as process_sample returns)")
    out: dict[str, torch.Tensor] = {}
    for key in _TOKEN_KEYS:
        have = [key in s for s in samples]
        if not any(have):
            continue
        if not all(have):
            missing = have.index(False)
            raise ValueError(f"sample {missing} lacks {key!r} that other samples have")
        pad = pad_token_id if key == "input_ids" else 0
        out[key] = torch.nn.utils.rnn.pad_sequence(
            [s[key] for s in samples], batch_first=True, padding_value=pad
        )
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    out["attention_mask"] = (torch.arange(out["input_ids"].shape[1]) < lengths[:, None]).long()
    for key in _VISION_KEYS:
        parts = [s[key] for s in samples if key in s and s[key].numel()]
        if not parts:
            continue
        if key == "pixel_values" and parts[0].ndim == 5:
            most = max(p.shape[1] for p in parts)
            parts = [F.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
        out[key] = torch.cat(parts)
    return out


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
        if use_cache is None:
            kwargs.pop("use_cache", None)
        else:
            kwargs["use_cache"] = use_cache
        logits = model(**kwargs).logits
        # flash styles flatten the rows to (1, R*T): give the logits back the rows of batch.input_ids.
        return logits.reshape(*batch.input_ids.shape, logits.shape[-1])

    return forward


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

    ``passed`` is True when every sample was found intact in the packed batch and ``metric <= tolerance``.
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
# The harness
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
    for key in ("input_ids", "labels", "mm_token_type_ids"):
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
            for key in ("input_ids", "labels", "mm_token_type_ids"):
                if key in out:
                    out[key] = out[key][keep]
    return out


def _tensor(batch: Any, name: str) -> torch.Tensor:
    value = getattr(batch, name, None)
    if value is None and isinstance(batch, dict):
        value = batch.get(name)
    if value is None:
        raise TypeError(f"the packed batch has no {name!r}: pass a vlm_pack PackedBatch (collator output)")
    return torch.as_tensor(value)


def _packed_spans(batch: Any, num_samples: int) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """Where each original sample sits in the packed batch: (sample, row, offset, length) and problems."""
    input_ids = _tensor(batch, "input_ids")
    row_len = input_ids.shape[-1]
    starts = _tensor(batch, "cu_seqlens_padded")[:-1].tolist()
    lengths = _tensor(batch, "seq_lens").tolist()
    order = _tensor(batch, "sample_index").tolist()
    spans = [(int(i), s // row_len, s % row_len, int(n)) for i, s, n in zip(order, starts, lengths)]
    problems = []
    seen = [span[0] for span in spans]
    missing = sorted(set(range(num_samples)) - set(seen))
    if missing:
        problems.append(
            f"sample(s) {missing[:10]} are not in the packed batch (the collator dropped them: raise its "
            "capacity or give fewer samples)"
        )
    dupes = sorted({i for i in seen if seen.count(i) > 1})
    if dupes:
        problems.append(f"sample(s) {dupes[:10]} appear more than once in the packed batch")
    extra = sorted({i for i in seen if not 0 <= i < num_samples})
    if extra:
        problems.append(
            f"the packed batch holds sample index(es) {extra[:10]} but only {num_samples} samples were given: "
            "pass the same samples to the collator and to the harness"
        )
    return spans, problems


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
        mask = labels[row, offset + 1 : offset + length] != -100
    else:
        mask = torch.ones_like(nxt, dtype=torch.bool)
    return lp, nxt, mask


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
            default ``default_packed_forward(style, use_cache)``. Models that expand collapsed
            placeholders map their logits back to the collapsed positions (see
            ``collapsed_packed_forward``).
        packed_batch: an already collated batch of ``samples`` (skips ``collator``).
        tokenizer: when given, the report shows tokens as text.
        top_k: how many worst tokens the report lists.
        device: where the inputs go (default: the device of the model's first parameter).

    Returns:
        ``EquivalenceReport`` (``.passed``, ``.metric``, ``.max_abs_diff``, per-sample ``.samples``,
        ``.worst_tokens``, ``.raise_if_failed()``).
    """
    if targets not in ("all", "labels"):
        raise ValueError(f"targets must be 'all' or 'labels', got {targets!r}")
    if not samples:
        raise ValueError("check_packed_equivalence: no samples")
    given = list(samples)  # what the collator gets, untouched
    samples = [_one_example(i, s) for i, s in enumerate(given)]
    for i, s in enumerate(samples):
        if len(s["input_ids"]) < 2:
            raise ValueError(f"sample {i}: needs at least 2 tokens (one next-token transition to compare)")
        if targets == "labels" and "labels" not in s:
            raise ValueError(f"sample {i} has no 'labels': targets='labels' scores the tokens they mark")
    if collator is None and packed_batch is None:
        raise ValueError("check_packed_equivalence needs a collator (or an already collated packed_batch=)")
    batched_forward = batched_forward or default_batched_forward
    packed_forward = packed_forward or default_packed_forward(style, use_cache)
    with contextlib.suppress(AttributeError):
        model.eval()
    if device is None:
        param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = param.device if param is not None else torch.device("cpu")

    # 1. Reference: padded batches, one sample per row.
    n = len(samples)
    step = batch_size or n
    reference: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for lo in range(0, n, step):
        chunk = samples[lo : lo + step]
        inputs = {k: v.to(device) for k, v in pad_samples(chunk, pad_token_id).items()}
        logits = batched_forward(model, inputs)
        ids = inputs["input_ids"].to(logits.device)
        logp = next_token_logprobs(logits, ids)
        labels = (
            torch.nn.utils.rnn.pad_sequence(
                [s["labels"] for s in chunk], batch_first=True, padding_value=-100
            )
            if targets == "labels"
            else None
        )
        for r, s in enumerate(chunk):
            reference.append(_gather_tokens(logp, ids, labels, r, 0, len(s["input_ids"]), targets))

    # 2. Packed: the collator's rows.
    if packed_batch is not None:
        batch = packed_batch
    else:
        # A PackingCollator built with return_style= returns model kwargs; the check needs the PackedBatch.
        batch = getattr(collator, "collate", collator)(given)
        if isinstance(batch, dict):
            raise TypeError(
                "the collator returned a dict of model inputs; check_packed_equivalence needs the PackedBatch "
                "(a vlm_pack PackingCollator, or pass packed_batch=)"
            )
    if hasattr(batch, "to") and not isinstance(batch, dict):
        batch = batch.to(device)
    packed_ids = _tensor(batch, "input_ids")
    packed_labels = _tensor(batch, "labels") if targets == "labels" or hasattr(batch, "labels") else None
    spans, problems = _packed_spans(batch, n)
    for i, row, off, length in spans:
        if 0 <= i < n:
            got = packed_ids[row, off : off + length]
            want = samples[i]["input_ids"]
            if length != len(want) or not torch.equal(got.cpu(), want.cpu()):
                problems.append(
                    f"sample {i}: the tokens at row {row} offset {off} (length {length}) are not the "
                    f"sample's {len(want)} input_ids"
                )
            elif packed_labels is not None and "labels" in samples[i]:
                # HF convention: the sample's own labels, its first position -100 (the previous sample's
                # last token must not learn to predict it).
                want_labels = samples[i]["labels"].clone()
                want_labels[0] = -100
                if not torch.equal(packed_labels[row, off : off + length].cpu(), want_labels.cpu()):
                    problems.append(
                        f"sample {i}: packed labels differ from the sample's labels (with -100 at its first "
                        "token)"
                    )
    logits = packed_forward(model, batch)
    if logits.shape[:-1] != packed_ids.shape:
        raise ValueError(
            f"packed_forward returned logits {tuple(logits.shape)} for input_ids {tuple(packed_ids.shape)}; "
            "it must return (R, T, V) aligned with batch.input_ids"
        )
    packed_ids = packed_ids.to(logits.device)
    logp = next_token_logprobs(logits, packed_ids)
    labels = packed_labels.to(logits.device) if targets == "labels" else None

    # 3. Compare sample by sample.
    rows, cols = packed_ids.shape
    all_a, all_b, all_m, owner, pos, tok = [], [], [], [], [], []
    sample_diffs: list[SampleDiff] = []
    for i, row, off, length in sorted(spans):
        if not 0 <= i < n or length != len(samples[i]["input_ids"]):
            continue
        lp_ref, nxt_ref, mask = reference[i]
        lp_pack, nxt_pack, _ = _gather_tokens(logp, packed_ids, labels, row, off, length, targets)
        if not torch.equal(nxt_ref.cpu(), nxt_pack.cpu()):
            continue  # already reported as a token mismatch
        lp_ref, lp_pack, mask = lp_ref.cpu(), lp_pack.cpu(), mask.cpu()
        all_a.append(lp_ref)
        all_b.append(lp_pack)
        all_m.append(mask)
        owner.append(torch.full_like(nxt_ref, i).cpu())
        pos.append(torch.arange(length - 1))
        tok.append(nxt_ref.cpu())
        if mask.any():
            diff = torch.where(mask, (lp_ref - lp_pack).abs(), torch.zeros_like(lp_ref))
            worst = int(diff.argmax())
            sample_diffs.append(
                SampleDiff(
                    sample=i,
                    num_tokens=int(mask.sum()),
                    metric=float(token_mult_prob_error(lp_ref, lp_pack, mask)),
                    max_abs_diff=float(diff.max()),
                    worst=_token_diff(i, worst, nxt_ref, lp_ref, lp_pack, tokenizer),
                    row=row,
                    offset=off,
                )
            )
    if all_a:
        a, b, m = torch.cat(all_a), torch.cat(all_b), torch.cat(all_m)
        who, where, what = torch.cat(owner), torch.cat(pos), torch.cat(tok)
    else:
        a = b = torch.zeros(0)
        m = torch.zeros(0, dtype=torch.bool)
    num_tokens = int(m.sum())
    if num_tokens == 0:
        problems.append("no token to score (every sample missing or every label -100)")
        metric, max_abs = float("nan"), float("nan")
        worst_tokens: list[TokenDiff] = []
    else:
        metric = float(token_mult_prob_error(a, b, m))
        diff = torch.where(m, (a - b).abs(), torch.full_like(a, -1.0))
        max_abs = float(diff.max())
        top = torch.topk(diff, min(top_k, num_tokens)).indices.tolist()
        worst_tokens = [
            TokenDiff(
                sample=int(who[j]),
                position=int(where[j]),
                token_id=int(what[j]),
                logp_batched=float(a[j]),
                logp_packed=float(b[j]),
                token=_token_text(tokenizer, int(what[j])),
            )
            for j in top
        ]
    return EquivalenceReport(
        metric=metric,
        max_abs_diff=max_abs,
        tolerance=tolerance,
        num_samples=n,
        num_tokens=num_tokens,
        num_rows=rows,
        row_length=cols,
        style=style,
        samples=sample_diffs,
        worst_tokens=worst_tokens,
        problems=problems,
    )


def _token_text(tokenizer: Any, token_id: int) -> str | None:
    if tokenizer is None:
        return None
    try:
        return str(tokenizer.convert_ids_to_tokens(token_id))
    except Exception:  # a report must not fail on a tokenizer quirk
        return None


def _token_diff(
    sample: int, j: int, nxt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokenizer: Any
) -> TokenDiff:
    return TokenDiff(
        sample=sample,
        position=j,
        token_id=int(nxt[j]),
        logp_batched=float(a[j]),
        logp_packed=float(b[j]),
        token=_token_text(tokenizer, int(nxt[j])),
    )


# --------------------------------------------------------------------------------------------------------
# A Megatron-style collapsed-placeholder model, from real transformers parts
# --------------------------------------------------------------------------------------------------------


@dataclass
class CollapsedLlavaOutput:
    """``logits`` (R, Te, V) over the expanded sequence; ``token_index`` (R, Tc): for each collapsed
    position, the expanded position of its last slot (an image's last embedding), whose logits predict the
    next collapsed token. ``collapsed_logits()`` gathers them: (R, Tc, V)."""

    logits: torch.Tensor
    token_index: torch.Tensor

    def collapsed_logits(self) -> torch.Tensor:
        idx = self.token_index.unsqueeze(-1).expand(-1, -1, self.logits.shape[-1])
        return self.logits.gather(1, idx)


class CollapsedLlavaModel(torch.nn.Module):
    """A LLaVA / LLaVA-NeXT that takes Megatron-style collapsed input: one placeholder per image.

    Built around a real transformers ``LlavaForConditionalGeneration`` /
    ``LlavaNextForConditionalGeneration`` (CLIP vision tower, projector, Llama language model), it works
    like Megatron-LM's ``LLaVAModel``: ``forward`` runs the vision tower, expands each placeholder into that
    image's N_i embeddings (LLaVA-NeXT tiles make N_i vary per image) and runs the language model with the
    attention segments and positions taken from the ``cu_seqlens`` it is given, never recomputed::

        collapsed input_ids  t0 t1 <I> t2 u0 <J> u1                     cu_seqlens given: segment ids and
        expanded embeddings  t0 t1 I0 I1 I2 t2 u0 J0 J1 J2 J3 u1         positions restart at each entry
        expanded cu_seqlens  0 .............. 6 ................ 12      (varlen segments or a mask)
        collapsed cu_seqlens 0 ....... 4 ......... 7                    -> wrong boundaries: the bug

    Passed collapsed-space ``cu_seqlens`` (Megatron's bug, seed 004) it silently attends across samples
    and restarts positions at the wrong tokens; remapped ones (``vlm_pack.remap.remap_cu_seqlens``) make it
    exact.

    How the language model attends within the given segments (``attention=``, per model or per call):

    - ``"varlen"`` (default, Megatron's THD path): ``vlm_pack.attention`` varlen attention, registered as
      ``attn_implementation="vlm_pack_varlen"`` for the Llama language model only, fed
      ``cu_seq_lens_q/k`` and ``max_length_q/k`` built from the given ``cu_seqlens``, ``attention_mask=None``:
      no (T, T) mask, no work across segments. Exact: its logits match ``"mask"``'s to fp32 round-off.
    - ``"mask"``: a dense (1, 1, T, T) block-diagonal causal mask through the model's own
      ``attn_implementation`` (sdpa/eager): O(T^2), the independent cross-check of ``"varlen"``.

    Either way the boundaries are the given ``cu_seqlens``; tokens past its last entry form one more segment.
    The CLIP vision tower keeps its own ``attn_implementation``. Without ``cu_seqlens`` it runs a padded
    batch from ``attention_mask`` through the model's own ``attn_implementation`` (the reference forward).
    """

    def __init__(self, model: Any, attention: str = "varlen") -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.image_token_id = int(model.config.image_token_id)
        self.is_next = hasattr(model.config, "image_grid_pinpoints")
        self.attention = _check_attention(attention)

    @classmethod
    def tiny(
        cls,
        tokenizer: Any = None,
        *,
        family: str = "llava_next",
        image_size: int = 56,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        attention: str = "varlen",
        initializer_range: float = 0.2,
        **config_kwargs: Any,
    ) -> CollapsedLlavaModel:
        """A tiny random LLaVA(-NeXT) whose CLIP tower sees ``image_size`` tiles (patch 14).

        ``attn_implementation`` is the HF one (vision tower, padded reference, ``attention="mask"``);
        ``attention`` how packed rows attend (see the class docstring).

        LLaVA-NeXT's pinpoints are scaled to the tile (the released 336-px grid at ``image_size``), so an
        image becomes 3-5 tiles and (image_size/14)^2 base embeddings plus its unpadded grid; use
        ``image_processor_overrides()`` to build the matching image processor.
        """
        import transformers

        from vlm_pack import offline

        if family not in ("llava", "llava_next"):
            raise ValueError(
                f"CollapsedLlavaModel.tiny: family must be 'llava' or 'llava_next', got {family!r}"
            )
        if image_size % 14:
            raise ValueError(f"image_size must be a multiple of the patch size 14, got {image_size}")
        tok = tokenizer if tokenizer is not None else offline.build_tokenizer(family)
        config = offline.tiny_model_config(family, tok, initializer_range=initializer_range, **config_kwargs)
        config.vision_config.image_size = image_size
        config.image_seq_length = (image_size // 14) ** 2
        if family == "llava_next":
            config.image_grid_pinpoints = _scaled_pinpoints(image_size)
        model_cls = (
            transformers.LlavaForConditionalGeneration
            if family == "llava"
            else transformers.LlavaNextForConditionalGeneration
        )
        torch.manual_seed(seed)
        model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
        return cls(model.eval(), attention=attention)

    def image_processor_overrides(self) -> dict[str, Any]:
        """``offline.image_processor(family, **overrides)`` arguments matching this model's tile size."""
        size = int(self.config.vision_config.image_size)
        out: dict[str, Any] = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}
        if self.is_next:
            out["image_grid_pinpoints"] = [list(p) for p in self.config.image_grid_pinpoints]
        return out

    def image_embeddings(
        self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Per-image embeddings, each (N_i, hidden), in image order."""
        inner = self.model.model
        if self.is_next:
            if image_sizes is None:
                raise ValueError("LLaVA-NeXT needs image_sizes (n_images, 2) with pixel_values")
            out = inner.get_image_features(pixel_values, image_sizes=image_sizes)
        else:
            out = inner.get_image_features(pixel_values)
        return list(out.pooler_output)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        tokens_per_image: torch.Tensor | None = None,
        attention: str | None = None,
    ) -> CollapsedLlavaOutput:
        """Expand the placeholders, then attend within the ``cu_seqlens`` segments (or the padded rows).

        Args:
            input_ids: (R, Tc) collapsed ids, one ``image_token_id`` per image; R must be 1 with
                ``cu_seqlens`` (Megatron's THD packing: one flattened row).
            pixel_values: LLaVA (n, 3, S, S) or LLaVA-NeXT (n, tiles, 3, S, S), images in placeholder order.
            image_sizes: (n, 2) LLaVA-NeXT original (height, width).
            attention_mask: (R, Tc) 1 = real token, for the padded reference batch (no ``cu_seqlens``).
            cu_seqlens: (S+1,) sample boundaries in the *expanded* row, used as given: attention never
                crosses them and positions restart at each.
            tokens_per_image: (n,) expected embeddings per image; checked against the vision tower.
            attention: ``"varlen"`` or ``"mask"`` for this call (default: the model's ``attention``).

        Returns:
            ``CollapsedLlavaOutput`` with expanded ``logits`` (R, Te, V) and ``token_index`` (R, Tc).
        """
        rows, tc = input_ids.shape
        device = input_ids.device
        is_image = input_ids == self.image_token_id
        text = self.model.get_input_embeddings()(input_ids.masked_fill(is_image, 0))
        counts = torch.ones_like(input_ids)
        feats = None
        num_images = int(is_image.sum())
        if num_images:
            if pixel_values is None:
                raise ValueError(f"input_ids hold {num_images} image placeholder(s) but no pixel_values")
            per_image = self.image_embeddings(pixel_values, image_sizes)
            if len(per_image) != num_images:
                raise ValueError(f"{num_images} image placeholders but {len(per_image)} images")
            sizes = torch.tensor([f.shape[0] for f in per_image], device=device)
            if tokens_per_image is not None and not torch.equal(sizes.cpu(), tokens_per_image.cpu()):
                raise ValueError(
                    f"tokens_per_image {tokens_per_image.tolist()} disagrees with the vision tower's "
                    f"{sizes.tolist()} embeddings per image"
                )
            counts[is_image] = sizes
            feats = torch.cat(per_image).to(text.dtype)

        # expanded position e <- collapsed position src[e]; token t's last slot is cumsum(counts) - 1.
        row_len = counts.sum(1)
        te = int(row_len.max())
        flat_counts = counts.flatten()
        src = torch.repeat_interleave(torch.arange(rows * tc, device=device), flat_counts)
        row = torch.div(src, tc, rounding_mode="floor")
        row_start = torch.cumsum(row_len, 0) - row_len
        col = torch.arange(src.numel(), device=device) - row_start[row]
        embeds = text.new_zeros(rows, te, text.shape[-1])
        embeds[row, col] = text.flatten(0, 1)[src]
        if feats is not None:
            slot = is_image.flatten()[src]
            embeds[row[slot], col[slot]] = feats
        token_index = torch.cumsum(counts, 1) - 1

        lm = self.model.model.language_model
        if cu_seqlens is not None:
            if rows != 1:
                raise ValueError(
                    f"with cu_seqlens, input_ids must be one flattened row (1, T); got {rows} rows"
                )
            mode = self.attention if attention is None else _check_attention(attention)
            if mode == "mask":
                mask, position_ids = _segment_mask_and_positions(cu_seqlens.to(device), te, embeds.dtype)
                hidden = lm(
                    inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False
                )
            else:
                cu, position_ids = _segment_bounds_and_positions(cu_seqlens.to(device), te)
                longest = int((cu[1:] - cu[:-1]).max())
                with _attn_implementation(lm.config, _varlen_implementation()):
                    hidden = lm(
                        inputs_embeds=embeds,
                        attention_mask=None,
                        position_ids=position_ids,
                        use_cache=False,
                        cu_seq_lens_q=cu,
                        cu_seq_lens_k=cu,
                        max_length_q=longest,
                        max_length_k=longest,
                    )
        else:
            valid = torch.zeros(rows, te, dtype=torch.long, device=device)
            am = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            valid[row, col] = am.flatten()[src].long()
            position_ids = (valid.cumsum(1) - 1).clamp(min=0)
            hidden = lm(
                inputs_embeds=embeds, attention_mask=valid, position_ids=position_ids, use_cache=False
            )
        logits = self.model.lm_head(hidden.last_hidden_state)
        return CollapsedLlavaOutput(logits=logits, token_index=token_index)


def _scaled_pinpoints(image_size: int) -> list[list[int]]:
    # LLaVA-v1.6's pinpoints in units of its 336-px tile.
    return [[h * image_size, w * image_size] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


_ATTENTION_MODES = ("varlen", "mask")


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTION_MODES:
        raise ValueError(
            f"attention must be 'varlen' (vlm_pack.attention varlen kernels) or 'mask' (dense block-diagonal "
            f"mask), got {attention!r}"
        )
    return attention


def _varlen_implementation() -> str:
    from vlm_pack.attention import register_hf_attention

    return register_hf_attention()


@contextlib.contextmanager
def _attn_implementation(config: Any, name: str):
    """Run the language model (whose ``config`` this is) with attention ``name`` for one call, then restore.

    Only the text config changes: the vision tower reads its own ``vision_config``, and the padded reference
    forward keeps the model's implementation, so varlen packing is checked against an independent kernel.
    """
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _segment_bounds_and_positions(cu_seqlens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` (S+1,) closed over a row of ``length`` tokens -> (S+1 or S+2,) int32, and positions (1, T).

    Tokens past the last entry form one more segment (as in ``_segment_mask_and_positions``), so collapsed
    cu_seqlens (Megatron's bug) still run, wrongly, as they do in Megatron::

        cu_seqlens [0, 3, 5], length 6     ->     cu [0, 3, 5, 6]      pos  0 1 2 0 1 0
    """
    last = int(cu_seqlens[-1])
    if last > length:
        raise ValueError(
            f"cu_seqlens ends at {last} but the expanded row has {length} tokens; pass cu_seqlens of the "
            "expanded row (vlm_pack.remap.remap_cu_seqlens) or the batch's cu_seqlens_padded_expanded"
        )
    cu = cu_seqlens.to(torch.int32)
    if last < length:
        cu = torch.cat([cu, cu.new_tensor([length])])
    t = torch.arange(length, device=cu.device)
    seg = (torch.searchsorted(cu, t.to(cu.dtype), right=True) - 1).clamp(min=0)
    return cu, (t - cu[seg])[None]


def _segment_mask_and_positions(
    cu_seqlens: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal causal additive mask (1, 1, T, T) and positions (1, T) from ``cu_seqlens`` (S+1,).

    ::

        cu_seqlens [0, 3, 5]      seg  0 0 0 1 1 2      (tokens past the last entry form one more segment)
        length 6                  pos  0 1 2 0 1 0
    """
    t = torch.arange(length, device=cu_seqlens.device)
    bounds = cu_seqlens.long()
    seg = torch.searchsorted(bounds, t, right=True) - 1
    seg = seg.clamp(min=0)
    positions = t - bounds[seg]
    allowed = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None])
    mask = torch.zeros(length, length, dtype=dtype, device=cu_seqlens.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None], positions[None]


def collapsed_batched_forward(model: CollapsedLlavaModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference forward of ``CollapsedLlavaModel`` on ``pad_samples`` inputs: logits (B, Tc, V)."""
    out = model(
        inputs["input_ids"],
        pixel_values=inputs.get("pixel_values"),
        image_sizes=inputs.get("image_sizes"),
        attention_mask=inputs["attention_mask"],
    )
    return out.collapsed_logits()


def collapsed_packed_forward(
    cu_seqlens: str = "remapped", attention: str | None = None
) -> Callable[[Any, Any], torch.Tensor]:
    """Packed forward of ``CollapsedLlavaModel`` on a collapsed-layout ``PackedBatch``: logits (1, Tc, V).

    The collapsed layout is one row (Megatron's THD format, micro batch 1). The model is given:

    - ``cu_seqlens="remapped"``: the batch's collapsed ``cu_seqlens_padded`` passed through
      ``vlm_pack.remap.remap_cu_seqlens`` here (what a correct pipeline does);
    - ``"batch"``: the collator's own ``cu_seqlens_padded_expanded``;
    - ``"collapsed"``: ``cu_seqlens_padded`` as is, in the collapsed space (Megatron's bug, seed 004).

    ``attention`` ("varlen" / "mask") overrides the model's ``attention`` for these calls.
    """
    if cu_seqlens not in ("remapped", "batch", "collapsed"):
        raise ValueError(f"cu_seqlens must be 'remapped', 'batch' or 'collapsed', got {cu_seqlens!r}")
    if attention is not None:
        _check_attention(attention)

    def forward(model: CollapsedLlavaModel, batch: Any) -> torch.Tensor:
        ids = batch.input_ids
        if ids.shape[0] != 1:
            raise ValueError(f"a collapsed-layout batch is one row, got input_ids {tuple(ids.shape)}")
        tokens_per_image = batch.tokens_per_image
        if cu_seqlens == "collapsed":
            cu = batch.cu_seqlens_padded
        elif cu_seqlens == "batch":
            cu = batch.cu_seqlens_padded_expanded
        else:
            from vlm_pack.remap import remap_cu_seqlens

            cu = batch.cu_seqlens_padded
            if tokens_per_image is not None:
                cu = remap_cu_seqlens(cu, ids, model.image_token_id, tokens_per_image)
        out = model(
            ids,
            pixel_values=batch.pixel_values,
            image_sizes=batch.image_sizes,
            cu_seqlens=cu,
            tokens_per_image=tokens_per_image,
            attention=attention,
        )
        return out.collapsed_logits()

    return forward
