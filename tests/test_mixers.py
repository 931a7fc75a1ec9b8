"""Token mixers that are not attention (vlm_pack.forward.mixers): packed = each sample alone through Qwen3.5's gated
delta net and LFM2's short conv, the attention-only controls leak, the harness says so.

Tiny random models of the genuine transformers classes, built from configs, fp32 on CPU. The controls are
the same rows with boundaries reaching the attention layers only (what transformers does today).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch
from test_host_syncs import SyncCounter
from torch import nn

import vlm_pack as vp
from vlm_pack._compat import release
from vlm_pack.families import lookup
from vlm_pack.forward import boundaries, packed_calls
from vlm_pack.forward.attention import register_hf_attention
from vlm_pack.forward.boundaries import mrope_restarts
from vlm_pack.forward.mixers import find_token_mixers, isolate_token_mixers
from vlm_pack.forward.packed_calls import guard_packed_calls
from vlm_pack.testing import check_packed_equivalence, unguarded

transformers = pytest.importorskip("transformers")

LENGTHS = (37, 53, 29, 45)
TOL = 1.0001
_DENSE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.1, pad_token_id=0)  # fmt: skip
_DELTA = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])  # fmt: skip
_CONV = dict(layer_types=["conv", "conv", "full_attention", "conv"])
_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _config(name: str):
    """(config, model class) of a tiny text model with token mixers (shared with ``test_mixer_kernels.py``)."""
    if name == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**_DENSE, **_DELTA), transformers.Qwen3_5ForCausalLM
    if name == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(**_DENSE, **_DELTA, **_MOE, shared_expert_intermediate_size=32)
        return cfg, transformers.Qwen3_5MoeForCausalLM
    if name == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**_DENSE, **_DELTA, **_MOE, shared_expert_intermediate_size=32)
        return cfg, transformers.Qwen3NextForCausalLM
    if name == "lfm2":
        return transformers.Lfm2Config(**_DENSE, **_CONV), transformers.Lfm2ForCausalLM
    if name == "lfm2_moe":
        cfg = transformers.Lfm2MoeConfig(**_DENSE, **_CONV, **_MOE, num_dense_layers=1)
        return cfg, transformers.Lfm2MoeForCausalLM
    if name == "lfm3":  # transformers 5.21 on
        return transformers.Lfm3Config(**_DENSE, **_CONV), transformers.Lfm3ForCausalLM
    raise AssertionError(name)


def _model(name: str, attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    cfg, cls = _config(name)
    cfg._attn_implementation = attn
    return cls(cfg).eval()


def _samples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in LENGTHS:
        ids = torch.randint(1, 128, (n,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _collator(rows: int) -> vp.PackingCollator:
    capacity = sum(LENGTHS) if rows == 1 else 90  # 2 rows: (37, 53) and (29, 45)
    return vp.PackingCollator(capacity, pad_token_id=0, max_rows=rows)


def _check(model, rows: int, style: str):
    samples = _samples()
    collator = _collator(rows)
    assert collator(samples).num_rows == rows
    return check_packed_equivalence(model, samples, collator, style=style)


def _prepare(model, style: str, isolate: bool):
    """flash style: varlen attention on [1, R*T] rows with cu_seq_lens_q/k. isolate=False keeps the
    boundaries from the attention layers only (the control)."""
    if style == "flash_attention_2":
        if isolate:
            return vp.use_varlen_attention(model)
        model.set_attn_implementation(register_hf_attention())
        return model
    return isolate_token_mixers(model) if isolate else model


STYLES = ("sdpa", "eager", "flash_attention_2")


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_packed_equals_each_sample_alone(name, style, rows):
    model = _prepare(_model(name, "eager" if style == "eager" else "sdpa"), style, isolate=True)
    report = _check(model, rows, style)
    assert report.passed, str(report)
    assert report.metric <= TOL
    assert report.token_mixers and {m.isolation for m in report.token_mixers} == {"per_sample"}
    assert "per_sample" in str(report)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "lfm2_moe"])
def test_moe_and_next_variants(name):
    control = _check(_model(name), 2, "sdpa")
    assert control.metric > TOL and not control.passed, str(control)
    report = _check(isolate_token_mixers(_model(name)), 2, "sdpa")
    assert report.passed, str(report)


@pytest.mark.parametrize("style", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_attention_only_boundaries_leak_and_the_harness_names_the_layer(name, style):
    model = _prepare(_model(name, style), style, isolate=False)
    report = _check(model, 1, style)
    assert report.metric > TOL, str(report)
    assert not report.passed
    layer = report.token_mixers[0].name
    assert any(layer in p and "vp.isolate_token_mixers(model)" in p for p in report.problems), report.problems
    assert {m.isolation for m in report.token_mixers} == {"none"}


def _refuses_packed_fallback() -> bool:
    """Whether the installed transformers' PyTorch fallbacks of the mixer kernels refuse ``cu_seqlens``
    (5.24's integrations/hub_kernels.py raises "can't keep packed sequences apart"); 5.6-5.19's run the
    fallback over the whole row and leak silently."""
    from transformers.integrations import hub_kernels

    refuses = "can't keep packed sequences apart" in Path(hub_kernels.__file__).read_text()
    assert refuses or release(transformers.__version__)[:2] < (5, 24)  # 5.24 on: the refusal, never the leak
    return refuses


def test_flash_style_without_isolation_raises_or_leaks():
    # Qwen3.5: transformers' PyTorch delta rule refuses cu_seqlens (integrations/hub_kernels.py)
    qwen = _prepare(_model("qwen3_5"), "flash_attention_2", isolate=False)
    if _refuses_packed_fallback():
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            _check(qwen, 1, "flash_attention_2")
    else:  # before that refusal: the delta rule ignores cu_seqlens, the leak is silent
        report = _check(qwen, 1, "flash_attention_2")
        assert report.metric > TOL and not report.passed, str(report)
    # LFM2: its short conv never reads cu_seq_lens_q, the leak is silent
    report = _check(_prepare(_model("lfm2"), "flash_attention_2", isolate=False), 1, "flash_attention_2")
    assert report.metric > TOL and not report.passed, str(report)


def test_harness_fails_on_a_leaking_mixer_even_when_the_metric_passes():
    # one sample per row: nothing to leak, the metric passes, but the model would leak once packed
    samples = _samples()
    collator = vp.PackingCollator(max(LENGTHS), pad_token_id=0, max_rows=None)
    report = check_packed_equivalence(_model("lfm2"), samples, collator)
    assert report.metric <= TOL
    assert not report.passed and "model.layers.0.conv" in str(report)


def test_model_without_token_mixers_reports_none():
    cfg = transformers.LlamaConfig(**{k: v for k, v in _DENSE.items()})
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert find_token_mixers(model) == []
    assert isolate_token_mixers(model) is model
    report = _check(model, 1, "sdpa")
    assert report.passed and report.token_mixers == []
    assert "token mixers that are not attention: none" in str(report)


def _next_token_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits[:-1].log_softmax(-1).gather(-1, ids[1:, None]).sum()


def _gradients(name: str, packed: bool, isolate: bool = True, checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """Gradients of the next-token log-likelihood summed over the samples, packed in one row or alone."""
    samples = [s["input_ids"] for s in _samples()]
    model = _model(name).train()
    if checkpoint:  # the recompute in backward must see the same boundaries
        # transformers < 5.24 names it gradient_checkpointing_enable (5.24 keeps that as a deprecated alias)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    model = isolate_token_mixers(model) if isolate else model
    if packed:
        pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
        with contextlib.nullcontext() if isolate else unguarded():  # the control: the model as it is
            logits = model(input_ids=torch.cat(samples)[None], position_ids=pos, use_cache=False).logits[0]
        loss = sum(_next_token_logp(part, s) for part, s in zip(logits.split(LENGTHS), samples))
    else:
        loss = sum(_next_token_logp(model(input_ids=s[None], use_cache=False).logits[0], s) for s in samples)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _relative_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| of any parameter's gradient, relative to that gradient's largest entry."""
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in a)


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_gradients_equal_packed_and_alone(name):
    alone = _gradients(name, packed=False)
    assert any(".conv" in n or "linear_attn" in n for n in alone)  # the mixers' own weights are compared
    assert _relative_gap(_gradients(name, packed=True), alone) < 1e-4  # fp32 sums in another order
    assert _relative_gap(_gradients(name, packed=True, checkpoint=True), alone) < 1e-4
    assert _relative_gap(_gradients(name, packed=True, isolate=False), alone) > 1e-2  # the control leaks


def test_idempotent_and_state_dict_unchanged(tmp_path):
    model = _model("qwen3_5")
    keys = list(model.state_dict())
    attributes = {name: set(module.__dict__) for name, module in model.named_modules()}
    isolate_token_mixers(model)
    forward = model.model.layers[0].linear_attn.forward
    hooks = len(model.model._forward_pre_hooks)
    isolate_token_mixers(vp.use_varlen_attention(model))
    assert model.model.layers[0].linear_attn.forward is forward
    assert len(model.model._forward_pre_hooks) == hooks == 1
    # the mixers' own forward is the only thing installed on a module: no vlm-pack state on the text model
    added = {n: set(m.__dict__) - attributes[n] for n, m in model.named_modules() if set(m.__dict__) - attributes[n]}
    assert added and all(new == {"forward"} for new in added.values()), added
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert list(loaded.state_dict()) == keys
    ids = _samples()[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_four_row_mrope_positions_and_boundaries_once_per_forward(monkeypatch):
    samples = [s["input_ids"] for s in _samples()]
    text = torch.cat([torch.arange(len(s)) for s in samples])
    calls = []
    original = boundaries.cu_seqlens_from_position_ids
    monkeypatch.setattr(boundaries, "cu_seqlens_from_position_ids", lambda p: calls.append(1) or original(p))
    model = isolate_token_mixers(_model("qwen3_5"))
    with torch.no_grad():
        packed = model(input_ids=torch.cat(samples)[None], position_ids=text.expand(4, 1, -1), use_cache=False)
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for s in samples]
    assert len(calls) == 1  # three delta-net layers, one host read of the boundaries
    torch.testing.assert_close(packed.logits[0], torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_three_row_mrope_restarts_only_where_every_row_is_zero():
    # sample 0: text 0 1, an image standing still at t=2 (h, w move), text 4 5; sample 1: text 0 1 2
    t = [0, 1, 2, 2, 2, 2, 4, 5, 0, 1, 2]
    h = [0, 1, 2, 2, 3, 3, 4, 5, 0, 1, 2]
    w = [0, 1, 2, 3, 2, 3, 4, 5, 0, 1, 2]
    restarted = mrope_restarts(torch.tensor([t, h, w])[:, None])
    assert restarted.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]]


def _syncs(name: str, mixer_layers: int, counter: SyncCounter) -> list[str]:
    """Sync-forcing ops of one packed forward + backward with ``mixer_layers`` token mixers + 1 attention."""
    torch.manual_seed(0)
    cfg, cls = _config(name)
    mixer = cfg.layer_types[0]
    cfg.layer_types = [mixer] * mixer_layers + ["full_attention"]
    cfg.num_hidden_layers = mixer_layers + 1
    model = isolate_token_mixers(cls(cfg).train())
    samples = [s["input_ids"] for s in _samples()]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    ids = torch.cat(samples)[None]
    counter.calls.clear()
    with counter:
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
    return sorted(counter.calls)


@pytest.fixture
def sync_counter(monkeypatch) -> SyncCounter:
    counter = SyncCounter()
    tolist = torch.Tensor.tolist  # never reaches the dispatcher on CPU: counted by wrapping it
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: counter.calls.append("Tensor.tolist") or tolist(self))
    return counter


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_boundaries_are_read_back_once_per_forward_not_per_layer(name, sync_counter):
    one = _syncs(name, 1, sync_counter)
    assert "Tensor.tolist" in one  # the counter sees the one host read of the boundaries
    assert one == _syncs(name, 4, sync_counter)


class _ToyConvMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 8, kernel_size=3, groups=8, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class _ToyTextModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_ToyConvMixer(), nn.Linear(8, 8)])


def test_unknown_token_mixers_are_found_and_refused():
    toy = _ToyTextModel()
    assert [(m.name, m.kind, m.isolation) for m in find_token_mixers(toy)] == [("layers.0", "unknown", "none")]
    with pytest.raises(ValueError, match=r"_ToyTextModel: layer layers\.0 .*unpacked"):
        isolate_token_mixers(toy)
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=128, hidden_size=32, state_size=4, num_hidden_layers=2)
    )
    mixers = find_token_mixers(mamba)
    assert [m.name for m in mixers] == ["backbone.layers.0.mixer", "backbone.layers.1.mixer"]
    with pytest.raises(ValueError, match=r"MambaForCausalLM: layer backbone\.layers\.0\.mixer"):
        isolate_token_mixers(mamba)
    assert mamba.backbone.layers[0].mixer.__dict__.get("forward") is None  # refused before touching anything


def test_model_inputs_always_give_seq_idx_to_a_family_with_token_mixers(monkeypatch):
    record = dataclasses.replace(lookup("qwen2_vl"), token_mixers=("short_conv",))
    monkeypatch.setattr(packed_calls, "lookup", lambda name: record)  # the marker's one test of the record
    batch = _collator(2)(_samples())
    for style in ("sdpa", "eager", "flash_attention_2"):
        inputs = batch.model_inputs(style)
        seq_idx = inputs["seq_idx"]
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == inputs["input_ids"].shape
        flat = seq_idx.flatten().tolist()  # rows (37, 53) and (29, 45 + 16 padding: its sample's)
        assert flat == [0] * 37 + [1] * 53 + [2] * 29 + [3] * 61
    monkeypatch.setattr(packed_calls, "lookup", lambda name: lookup("qwen2_vl"))
    assert "seq_idx" not in batch.model_inputs("sdpa")  # attention-only families: no marker


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_isolated_mixers_take_their_samples_from_seq_idx_alone(name):
    """The rows of a family with mixers carry seq_idx: with no position restarts to read (plain arange
    positions) the isolated mixers still run per sample from it; an un-isolated model called with it (the
    packed-call guard armed, as vlm-pack's collators do) is isolated first: the same logits."""
    if release(transformers.__version__)[:2] < (5, 18):
        pytest.skip("transformers < 5.18's decoder layers hand no seq_idx to their mixers: isolated ones read the "
                    "position restarts the text model receives")
    samples = [s["input_ids"] for s in _samples()]
    seq_idx = torch.cat([torch.full((len(s),), k, dtype=torch.int32) for k, s in enumerate(samples)])[None]
    ids = torch.cat(samples)[None]
    model = isolate_token_mixers(_model(name))
    with torch.no_grad():
        mixed = model(input_ids=ids, seq_idx=seq_idx, use_cache=False).logits[0]
        plain = model(input_ids=ids, use_cache=False).logits[0]
    # attention here sees one sequence (no restarts): only the first sample is its own alone
    first = model(input_ids=samples[0][None], use_cache=False).logits[0]
    n = len(samples[0])
    torch.testing.assert_close(mixed[:n], first, rtol=1e-5, atol=1e-5)
    # the mixers read seq_idx: the later samples differ from the run without it
    assert (mixed[n:] - plain[n:]).abs().max() > 1e-3
    assert guard_packed_calls()
    unisolated = _model(name)
    with torch.no_grad():
        guarded = unisolated(input_ids=ids, seq_idx=seq_idx, use_cache=False).logits[0]
    torch.testing.assert_close(guarded, mixed, rtol=0, atol=0)
    assert {m.isolation for m in find_token_mixers(unisolated)} == {"per_sample"}


def test_the_packed_call_guard_is_installed_once_and_leaves_calls_without_the_marker_alone():
    """Armed twice, one ``PreTrainedModel.__call__``; a call without ``seq_idx`` (an unpacked batch, generation)
    runs transformers' own layers untouched, and the model is isolated by the first call that carries it."""
    assert guard_packed_calls()
    call = transformers.PreTrainedModel.__call__
    assert guard_packed_calls() and transformers.PreTrainedModel.__call__ is call
    model = _model("qwen3_5")
    ids = _samples()[0]["input_ids"][None]
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        assert {m.isolation for m in find_token_mixers(model)} == {"none"}
        marked = model(input_ids=ids, seq_idx=torch.zeros_like(ids, dtype=torch.int32), use_cache=False).logits
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}
    torch.testing.assert_close(marked, plain, rtol=1e-5, atol=1e-5)  # one sample: the isolated forward is the same
