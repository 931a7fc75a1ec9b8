"""No route leaks: every way vlm-pack hands packed rows to a model whose text layers mix tokens without
attention (Qwen3.5's gated delta-net, LFM2's short convolutions) runs each mixer per sample or stops before
the first optimizer step; an isolated mixer whose ``forward`` is replaced afterwards is caught.

Routes: the README's (``PackedMapDataset`` + ``Trainer(..., data_collator=ds.trainer_collator("sdpa")).train()``),
a ``PackingCollator(return_style="sdpa")`` as the Trainer's collator, a torch loop on
``PackedBatch.model_inputs("sdpa")``, TRL's ``PackedSFTTrainer`` (``test_integrations_trl.py``). No manual
``isolate_token_mixers`` on any of them: where vlm-pack never sees the model, the rows carry ``seq_idx``, which an
un-isolated transformers mixer refuses; where it meets the model it isolates it.

Tiny genuine transformers models built from configs (``vlm_pack.offline``), fp32 CPU, the real Qwen3-VL
processor. Oracle: each sample of the first pack run alone through the same initial weights.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import vlm_pack as vp
from vlm_pack import offline
from vlm_pack._compat import mixers_refuse_packed_rows
from vlm_pack.forward.mixers import find_token_mixers

datasets = pytest.importorskip("datasets")

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_5.jinja").read_text()
CAP = dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32})
REFUSED = "can't keep packed sequences apart"

#: The refusal these routes rely on is transformers' own, 5.24 on (``_compat.mixers_refuse_packed_rows``).
REFUSES = pytest.mark.skipif(not mixers_refuse_packed_rows(), reason="transformers < 5.24: its mixers' PyTorch fallbacks ignore seq_idx (call vp.isolate_token_mixers; docs/versions.md)")
QUESTIONS = ["what is the red car near", "describe the picture", "count the people", "where is the dog",
             "what colour is the sky", "read the sign"]  # fmt: skip
ANSWERS = ["the tall building", "two people with a dog", "three", "under the table", "blue", "stop"]


@functools.cache
def _qwen_pre() -> vp.Preprocessor:
    tok = offline.build_tokenizer("qwen3_5")
    return vp.Preprocessor(processor=offline.processor("qwen3_5", tok, chat_template=TEMPLATE, **CAP))


def _qwen(**kwargs):
    return offline.tiny_model(
        "qwen3_5", _qwen_pre().tokenizer, num_layers=4, initializer_range=0.2, seed=0, **kwargs
    )


def _png(width: int, height: int, seed: int) -> bytes:
    import io

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _dataset():
    """Six samples: images on some, text only on others (as the README's data: "images" + "messages")."""
    images = [[_png(90, 60, 0)], [], [_png(50, 140, 2)], [], [_png(64, 64, 4)], []]
    messages = [
        [{"role": "user", "content": "<image>" * len(images[k]) + QUESTIONS[k]},
         {"role": "assistant", "content": ANSWERS[k]}]
        for k in range(6)
    ]  # fmt: skip
    data = datasets.Dataset.from_dict({"images": images, "messages": messages})
    return data.cast_column("images", datasets.List(datasets.Image()))


def _args(tmp_path, **overrides):
    settings = dict(per_device_train_batch_size=1, train_sampling_strategy="sequential", remove_unused_columns=False,
                    max_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
                    learning_rate=1e-2)  # fmt: skip
    return transformers.TrainingArguments(str(tmp_path / "out"), **(settings | overrides))


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _loss_alone(model, samples: list[dict]) -> float:
    """The first step's loss as each sample alone: label tokens' summed CE over their count (the packed row's
    mean, since every sample's first label is -100)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            inputs = {k: v for k, v in s.items() if isinstance(v, torch.Tensor) and k not in ("labels", "tokens_per_image")}
            inputs = {k: v[None] if k in ("input_ids", "mm_token_type_ids") else v for k, v in inputs.items()}
            n = int((s["labels"][1:] != -100).sum())
            total += float(model(**inputs, labels=s["labels"][None], use_cache=False).loss) * n
            count += n
    return total / count


# ------------------------------------------------------------------------------------------ the README's route


def _readme_route(tmp_path, model):
    from vlm_pack.data import PackedMapDataset, build_plan

    data, pre = _dataset(), _qwen_pre()
    config = vp.PackingConfig(capacity=400)
    ds = PackedMapDataset(data, pre, config, plan=build_plan(data, pre, config))
    assert len(ds) < len(data)  # packed: several samples per row
    trainer = transformers.Trainer(model, _args(tmp_path), train_dataset=ds, data_collator=ds.trainer_collator("sdpa"))
    return trainer, ds, data


@REFUSES
def test_readme_route_refuses_an_unisolated_qwen3_5_before_the_first_step(tmp_path):
    model = _qwen()
    assert {m.isolation for m in find_token_mixers(model)} == {"none"}
    before = _weights(model)
    trainer, ds, _ = _readme_route(tmp_path, model)
    assert ds[0].num_samples >= 2
    with pytest.raises(ValueError, match=REFUSED):
        trainer.train()
    assert trainer.state.global_step == 0 and _unchanged(model, before)


@REFUSES
def test_a_qwen3_5_checkpoint_read_as_its_processor_says_is_refused_too(tmp_path):
    """A Qwen3.5 checkpoint from the hub ships ``Qwen3VLProcessor`` and a tokenizer that knows nothing of
    vlm-pack: its Preprocessor reads family qwen3_vl (the processor's record). The packed rows still carry the
    mixers' marker (``Family.mixers_behind_processor``), so the un-isolated model on the README's route stops
    before the first step instead of training on leaked state; the same rows through a real Qwen3-VL model
    (no mixers) are exact."""
    from vlm_pack.data import PackedMapDataset, build_plan
    from vlm_pack.testing import check_packed_equivalence

    folder = tmp_path / "Qwen3.5-tiny"
    _qwen_pre().processor.save_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)  # as from the hub: no vlm_pack_family
    assert getattr(tok, "vlm_pack_family", None) is None
    proc = offline.processor("qwen3_5", tok, chat_template=TEMPLATE, **CAP)
    pre = vp.Preprocessor(processor=proc)
    assert pre.family == "qwen3_vl"  # all a processor can tell
    data, config = _dataset(), vp.PackingConfig(capacity=400)
    ds = PackedMapDataset(data, pre, config, plan=build_plan(data, pre, config))
    model = _qwen()
    before = _weights(model)
    trainer = transformers.Trainer(model, _args(tmp_path), train_dataset=ds, data_collator=ds.trainer_collator("sdpa"))
    with pytest.raises(ValueError, match=REFUSED):
        trainer.train()
    assert trainer.state.global_step == 0 and _unchanged(model, before)
    qwen3_vl = offline.tiny_model("qwen3_vl", tok, num_layers=2, initializer_range=0.2, seed=0)
    samples = [pre.process([im.convert("RGB") for im in data[k]["images"]], data[k]["messages"]) for k in range(3)]
    assert "seq_idx" in pre.collator(400).__call__(samples).model_inputs("sdpa")
    assert check_packed_equivalence(qwen3_vl, samples, pre.collator(400)).passed


def test_readme_route_with_the_named_fix_trains_exactly(tmp_path):
    """The fix the refusal names (vp.isolate_token_mixers): the first step's loss is each sample alone."""
    trainer, ds, data = _readme_route(tmp_path, vp.isolate_token_mixers(_qwen()))
    trainer.train()
    first = ds[0]
    assert first.num_samples >= 2
    pre = _qwen_pre()
    rows = [data[int(r)] for r in first.metadata["__row__"]]
    alone = [pre.process(r["images"], r["messages"]) for r in rows]
    expected = _loss_alone(_qwen(), alone)
    logged = trainer.state.log_history[0]["loss"]
    assert abs(logged - expected) < 5e-6, (logged, expected)


# ------------------------------------------------------------------------------------------ a loop of one's own


def _qwen_samples() -> list[dict]:
    data, pre = _dataset(), _qwen_pre()
    return [pre.process(r["images"], r["messages"]) for r in data]


@REFUSES
def test_a_torch_loop_on_model_inputs_refuses_an_unisolated_qwen3_5():
    model = _qwen().train()
    before = _weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _qwen_pre().collator(400)(_qwen_samples()[:3])
    assert batch.num_samples == 3
    with pytest.raises(ValueError, match=REFUSED):
        model(**batch.model_inputs("sdpa")).loss.backward()
        optimizer.step()
    assert _unchanged(model, before)
    # isolated, the same loop's loss is each sample alone
    with torch.no_grad():
        packed = float(vp.isolate_token_mixers(_qwen())(**batch.model_inputs("sdpa")).loss)
    assert abs(packed - _loss_alone(_qwen(), _qwen_samples()[:3])) < 5e-6


# ------------------------------------------------------------------------------------------ LFM2-VL, text rows


def _lfm2(**kwargs):
    return offline.tiny_model("lfm2_vl", offline.build_tokenizer("lfm2_vl"), num_layers=3, initializer_range=0.2,
                              seed=0, **kwargs)  # fmt: skip


def _text_samples(vocab: int, lengths=(37, 53, 29, 45)) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        ids = torch.randint(10, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[0] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


@REFUSES
def test_lfm2_vl_text_rows_through_a_trainer_collator_are_refused_unisolated_and_exact_isolated(tmp_path):
    model = _lfm2()
    assert [m.kind for m in find_token_mixers(model)] == ["short_conv", "short_conv"]
    samples = _text_samples(model.config.text_config.vocab_size)
    collator = vp.PackingCollator(sum(len(s["input_ids"]) for s in samples), family="lfm2_vl",
                                  model_config=model.config, return_style="sdpa")  # fmt: skip
    before = _weights(model)
    trainer = transformers.Trainer(model, _args(tmp_path), train_dataset=[samples], data_collator=lambda b: collator(b[0]))
    with pytest.raises(ValueError, match=REFUSED):
        trainer.train()
    assert trainer.state.global_step == 0 and _unchanged(model, before)
    # a torch loop on model_inputs: the same refusal; isolated, each sample alone
    inputs = collator(samples)
    with pytest.raises(ValueError, match=REFUSED), torch.no_grad():
        _lfm2()(**inputs)
    trainer = transformers.Trainer(vp.isolate_token_mixers(_lfm2()), _args(tmp_path), train_dataset=[samples],
                                   data_collator=lambda b: collator(b[0]))  # fmt: skip
    trainer.train()
    assert abs(trainer.state.log_history[0]["loss"] - _loss_alone(_lfm2(), samples)) < 5e-6


# ------------------------------------------------------------------------------------------ replaced forwards


def test_a_forward_replaced_after_isolation_is_refused_by_name():
    model = vp.isolate_token_mixers(_qwen())
    batch = _qwen_pre().collator(400)(_qwen_samples()[:3])
    layer = model.model.language_model.layers[1].linear_attn
    # what the kernels library does when kernelize finds a hub kernel for the layer (kernels' _replace_forward)
    layer.forward = types.MethodType(type(layer).forward, layer)
    with pytest.raises(RuntimeError, match=r"model\.language_model\.layers\.1\.linear_attn .*use_kernels=False"), torch.no_grad():
        model(**batch.model_inputs("sdpa"))
    # a replaced layer (another module in its place) is refused too
    model = vp.isolate_token_mixers(_qwen())
    decoder = model.model.language_model.layers[0]
    decoder.linear_attn = type(decoder.linear_attn)(model.config.text_config, 0)
    with pytest.raises(RuntimeError, match=r"layers\.0\.linear_attn was replaced"), torch.no_grad():
        model(**batch.model_inputs("sdpa"))
    vp.isolate_token_mixers(model)  # the named fix
    with torch.no_grad():
        model(**batch.model_inputs("sdpa"))


def test_isolation_survives_transformers_rekernelizing_on_train(tmp_path):
    """transformers 5.25 loads with use_kernels on and re-kernelizes on model.train(): on a device without a
    hub kernel that pops the isolated forward (measured: the instance forward is gone). The guard puts it back
    before the first layer runs, so the packed row is still each sample alone."""
    _qwen().save_pretrained(tmp_path / "m")
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "m")
    vp.isolate_token_mixers(model)
    model.train()  # kernelize (where the release does) on the mode change
    model.eval()
    batch = _qwen_pre().collator(400)(_qwen_samples()[:3])
    with torch.no_grad():
        packed = float(model(**batch.model_inputs("sdpa")).loss)
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}
    assert abs(packed - _loss_alone(_qwen(), _qwen_samples()[:3])) < 5e-6
