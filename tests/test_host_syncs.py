"""Device-to-host syncs on the GPU code path, counted on CPU.

On a GPU every ``.item()``, ``int(tensor)``, ``torch.equal``, ``nonzero()``, ``.tolist()`` ... waits for the
launch queue to drain. This test runs one forward + backward of a tiny real LLaMA through the path a GPU
takes (``hf_varlen_attention_forward`` -> ``varlen_attention`` -> the torch varlen kernel, here a CPU
stand-in with the kernel's signature) under a ``TorchDispatchMode`` that counts the operations that force
such a sync. The boundaries are worked out once per forward, so the count must not grow with the number of
layers.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlm_pack.forward import varlen
from vlm_pack.forward.attention import use_varlen_attention
from vlm_pack.forward.loss import PerTokenLoss, token_cross_entropy

aten = torch.ops.aten
# Operations whose result size or value the host must read from the device.
SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t)
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
}


class SyncCounter(TorchDispatchMode):
    """Counts sync-forcing aten calls (plus boolean-mask indexing and repeat_interleave without
    output_size, which size their output from device data); ``Tensor.tolist`` never reaches the
    dispatcher on CPU, so the fixture below counts it by wrapping it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.calls.append(str(func))
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.calls.append("aten.index.Tensor(bool mask)")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.calls.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def count_syncs(monkeypatch):
    counter = SyncCounter()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.calls.append("Tensor.tolist")
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    return counter


@pytest.fixture
def gpu_path(monkeypatch):
    """Route attention through the torch varlen backend with a CPU stand-in kernel (same signature as
    torch's ``varlen_attn``; a block-diagonal SDPA that reads cu_seqlens only on the device)."""
    kernel_calls = []

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
    ):
        kernel_calls.append(max_q)
        doc = varlen._doc_ids(cu_seq_q, query.shape[0])
        mask = doc[:, None] == doc[None, :]
        if window_size == (-1, 0):
            mask &= torch.ones_like(mask).tril()
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out.transpose(0, 1)

    real_reason = varlen.backend_unavailable_reason
    monkeypatch.setattr(varlen, "_torch_varlen_attn", lambda: varlen_attn)
    monkeypatch.setattr(
        varlen,
        "backend_unavailable_reason",
        lambda name, *a, **kw: None if name == "torch_varlen" else real_reason(name, *a, **kw),
    )
    varlen._torch_varlen_keywords.cache_clear()
    yield kernel_calls
    varlen._torch_varlen_keywords.cache_clear()


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return use_varlen_attention(model.train(), backend="torch_varlen")


LENGTHS = [9, 1, 14, 6]


def packed_inputs(style: str) -> dict:
    """One packed row of LENGTHS (plus 4 padding tokens for style "mask"), the way a caller feeds it."""
    total = sum(LENGTHS)
    ids = torch.randint(0, 128, (1, total), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    if style.startswith("flash_kwargs"):  # PackedBatch.model_inputs("flash_attention_2")
        cu = torch.tensor([0, 9, 10, 24, 30], dtype=torch.int32)
        cu_k = cu.clone() if style == "flash_kwargs_k_copy" else cu  # an equal tensor, not the same one
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu_k, max_length_q=14, max_length_k=14)
        return dict(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, **extra)
    if style == "position_ids":  # PackedBatch.model_inputs("sdpa")
        return dict(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    pad = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.cat([torch.ones(1, total, dtype=torch.long), pad], 1)
    return dict(
        input_ids=torch.cat([ids, pad], 1),
        position_ids=torch.cat([pos, pad], 1),
        attention_mask=mask,
        labels=torch.cat([labels, pad - 100], 1),
        use_cache=False,
    )


def syncs_per_step(layers: int, style: str, counter: SyncCounter, kernel_calls: list) -> list[str]:
    model = tiny_llama(layers)
    inputs = packed_inputs(style)
    counter.calls.clear()
    kernel_calls.clear()
    with counter:
        model(**inputs).loss.backward()
    assert len(kernel_calls) == layers, "every layer must run the (stand-in) GPU kernel"
    assert set(kernel_calls) == {14}, "the kernel gets the longest sample as max_seqlen"
    return list(counter.calls)


@pytest.mark.parametrize("style", ["flash_kwargs", "flash_kwargs_k_copy", "position_ids", "mask"])
@pytest.mark.slow
def test_sync_count_does_not_grow_with_layers(style, count_syncs, gpu_path):
    two = syncs_per_step(2, style, count_syncs, gpu_path)
    eight = syncs_per_step(8, style, count_syncs, gpu_path)
    print(f"{style}: {len(two)} sync ops with 2 layers, {len(eight)} with 8: {sorted(set(eight))}")
    assert len(two) == len(eight), (two, eight)
    assert sorted(two) == sorted(eight)


def test_counter_sees_what_the_old_per_layer_code_did(count_syncs):
    """The counter is not blind: int(cu[-1]), torch.equal, nonzero and tolist each count once."""
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with count_syncs:
        int(cu[-1])
        torch.equal(cu, cu.clone())
        cu.nonzero()
        cu.tolist()
        cu[cu > 2]
    assert len(count_syncs.calls) == 5, count_syncs.calls


def test_per_token_loss_reads_nothing_back_per_micro_batch(count_syncs):
    logits = torch.randn(3, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    labels[1, :2] = -100
    ptl = PerTokenLoss()
    ptl.begin_step()
    with count_syncs:
        for mb_logits, mb_labels in zip(logits, labels, strict=True):
            loss_sum, num_tokens = token_cross_entropy(mb_logits, mb_labels)
            ptl.loss_for_backward(loss_sum, num_tokens).backward()
    assert count_syncs.calls == []
    step_loss = ptl.end_step([logits])
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 11).double(), labels.reshape(-1))
    torch.testing.assert_close(step_loss, want, atol=1e-6, rtol=0)
