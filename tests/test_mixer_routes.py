"""No route leaks: every way vlm-pack hands packed rows to a model whose text layers mix tokens without
attention (Qwen3.5's gated delta-net, LFM2's short convolutions) runs each mixer per sample or stops before
the first optimizer step, on every transformers release vlm-pack supports; an isolated mixer whose ``forward``
or layer is replaced afterwards is caught.

Routes: the README's (``PackedMapDataset`` + ``Trainer(..., data_collator=ds.trainer_collator("sdpa")).train()``,
also with DataLoader workers), a ``PackingCollator(return_style="sdpa")`` as the Trainer's collator, a torch loop
on ``PackedBatch.model_inputs("sdpa")``, TRL (``test_integrations_trl.py``). No manual ``isolate_token_mixers``
on any of them: the rows carry ``seq_idx`` and the first model call that receives it isolates the model's mixers
(``packed_calls.guard_packed_calls``), or refuses, naming it, a layer vlm-pack cannot split.

Tiny genuine transformers models built from configs (``vlm_pack.offline``), fp32 CPU, the real Qwen3-VL
processor. Oracle: each sample of the first pack run alone through the same initial weights; control: the
same pack without the marker through an un-isolated model (what it would train on) differs.
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
from vlm_pack.forward.mixers import find_token_mixers
from vlm_pack.testing import unguarded

datasets = pytest.importorskip("datasets")

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_5.jinja").read_text()
CAP = dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32})
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


def _first_step_alone(ds, data) -> float:
    """The first step's loss with each sample of the first pack alone, through fresh initial weights."""
    pre = _qwen_pre()
    rows = [data[int(r)] for r in ds[0].metadata["__row__"]]
    return _loss_alone(_qwen(), [pre.process(r["images"], r["messages"]) for r in rows])


def _leaking(model, ds) -> float:
    """Control: the first pack through ``model`` past vlm-pack's packed-call guard, without the marker (the
    boundaries reach attention only)."""
    inputs = {k: v for k, v in ds[0].model_inputs("sdpa").items() if k != "seq_idx"}
    with torch.no_grad(), unguarded():
        return float(model(**inputs).loss)


def test_readme_route_trains_an_unisolated_qwen3_5_exactly(tmp_path):
    """No manual call: the rows' ``seq_idx`` reaches the model's call, whose guard isolates its delta-nets
    before any layer runs, on every release (before 5.24 transformers' fallbacks would ignore the marker and
    leak; from 5.24 refuse it)."""
    model = _qwen()
    assert {m.isolation for m in find_token_mixers(model)} == {"none"}
    trainer, ds, data = _readme_route(tmp_path, model)
    assert ds[0].num_samples >= 2
    trainer.train()
    assert trainer.state.global_step == 1
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}
    expected, logged = _first_step_alone(ds, data), trainer.state.log_history[0]["loss"]
    assert abs(logged - expected) < 5e-6, (logged, expected)
    assert abs(_leaking(_qwen(), ds) - expected) > 1e-3  # what an un-isolated model trains on


def test_a_qwen3_5_checkpoint_read_as_its_processor_says_is_isolated_too(tmp_path):
    """A Qwen3.5 checkpoint from the hub ships ``Qwen3VLProcessor`` and a tokenizer that knows nothing of
    vlm-pack: its Preprocessor reads family qwen3_vl (the processor's record). The packed rows still carry the
    mixers' marker (``Family.mixers_behind_processor``), so the un-isolated model on the README's route has its
    mixers isolated at the first call: exact; the same rows through a real Qwen3-VL model (no mixers) are exact."""
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
    trainer = transformers.Trainer(_qwen(), _args(tmp_path), train_dataset=ds, data_collator=ds.trainer_collator("sdpa"))
    trainer.train()
    expected, logged = _first_step_alone(ds, data), trainer.state.log_history[0]["loss"]
    assert abs(logged - expected) < 5e-6, (logged, expected)
    qwen3_vl = offline.tiny_model("qwen3_vl", tok, num_layers=2, initializer_range=0.2, seed=0)
    samples = [pre.process([im.convert("RGB") for im in data[k]["images"]], data[k]["messages"]) for k in range(3)]
    assert "seq_idx" in pre.collator(400).__call__(samples).model_inputs("sdpa")
    assert check_packed_equivalence(qwen3_vl, samples, pre.collator(400)).passed


@pytest.mark.slow  # a fresh interpreter: 25-30 s on a loaded 2-core machine
def test_the_readme_route_with_dataloader_workers_in_a_fresh_process(tmp_path):
    """The rows are made in a DataLoader worker (a forked process): the guard must be armed in the main
    process, where the model runs, by building the dataset's collator. A fresh interpreter, so no earlier test
    armed it; the run trains the first step on each sample alone."""
    script = f"""
import sys, transformers, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_mixer_routes as t
from pathlib import Path
trainer, ds, data = t._readme_route(Path({str(tmp_path)!r}), t._qwen())
trainer.args.dataloader_num_workers = 1
trainer.train()
print("GAP", abs(trainer.state.log_history[0]["loss"] - t._first_step_alone(ds, data)))
"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    gap = float(run.stdout.split("GAP")[-1])
    assert gap < 5e-6, run.stdout


# ------------------------------------------------------------------------------------------ a loop of one's own


def _qwen_samples() -> list[dict]:
    data, pre = _dataset(), _qwen_pre()
    return [pre.process(r["images"], r["messages"]) for r in data]


def test_a_torch_loop_on_model_inputs_isolates_an_unisolated_qwen3_5():
    model = _qwen().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = _qwen_pre().collator(400)(_qwen_samples()[:3])
    assert batch.num_samples == 3
    loss = model(**batch.model_inputs("sdpa")).loss
    loss.backward()
    optimizer.step()
    assert abs(float(loss.detach()) - _loss_alone(_qwen(), _qwen_samples()[:3])) < 5e-6
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}


def test_a_mixer_vlm_pack_cannot_split_is_refused_at_the_first_packed_call():
    """A model holding a layer that mixes tokens and that vlm-pack does not know (here: a Conv1d along the
    sequence added to a decoder layer) stops at the first call with the rows' marker, naming the layer, before
    any layer runs; so do the same rows without the marker (their positions restart per sample); a call that
    is not packed runs as before."""
    model = _qwen().eval()
    layer = model.model.language_model.layers[0]
    layer.add_module("token_conv", torch.nn.Sequential(torch.nn.Conv1d(8, 8, 4)))
    batch = _qwen_pre().collator(400)(_qwen_samples()[:3])
    inputs = batch.model_inputs("sdpa")
    with pytest.raises(ValueError, match=r"layers\.0\.token_conv .*train this model unpacked"), torch.no_grad():
        model(**inputs)
    assert {m.isolation for m in find_token_mixers(model)} == {"none"}  # refused before touching anything
    with pytest.raises(ValueError, match=r"layers\.0\.token_conv .*train this model unpacked"), torch.no_grad():
        model(**{k: v for k, v in inputs.items() if k != "seq_idx"})
    with torch.no_grad():
        assert model(input_ids=inputs["input_ids"][:, :20], use_cache=False).logits.shape[1] == 20


def test_generation_is_never_taken_for_packed_rows():
    """Left-padded generation (a [B, T] padding mask, then a cache) passes the packed-call guard untouched: the
    mixers stay as transformers built them and the tokens are those generated past the guard."""
    vp.PackingCollator(64)  # arms the guard, as any collator does
    ids = torch.tensor([[7, 7, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=7)
    model = _qwen().eval()
    guarded = model.generate(**kwargs)
    assert {m.isolation for m in find_token_mixers(model)} == {"none"}
    with unguarded():
        assert torch.equal(guarded, _qwen().eval().generate(**kwargs))


def test_a_hybrid_model_type_without_a_record_trains_exactly_with_no_call(tmp_path):
    """LFM3-VL has no record, so its rows carry no ``seq_idx``: through ``Trainer(data_collator=PackingCollator(...,
    model_config=))`` with nothing isolated by hand, the first step's loss is each sample's alone (the packed-call
    guard recognised the rows by their restarting positions and isolated the short convolutions); past the guard
    the same row leaks."""
    from vlm_pack.offline.model_types import placeholder_for_type, processor_for_type, tiny_model_for_type
    from vlm_pack.testing.model_types import type_samples

    if "lfm3_vl" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no model type lfm3_vl")
    proc = processor_for_type("lfm3_vl")

    def model():
        return tiny_model_for_type("lfm3_vl", proc, seed=0, attn_implementation="sdpa")

    samples = [dict(s, labels=s["input_ids"].clone()) for s in type_samples(proc, placeholder_for_type("lfm3_vl", proc))]
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            n = s["input_ids"].shape[-1] - 1
            total += float(model()(**s, use_cache=False).loss) * n
            count += n
    collator = vp.PackingCollator(sum(s["input_ids"].shape[-1] for s in samples), model_config=model().config,
                                  tokenizer=proc, return_style="sdpa")  # fmt: skip
    rows = collator(samples)
    assert "seq_idx" not in rows
    trained = model()
    assert {m.isolation for m in find_token_mixers(trained)} == {"none"}
    trainer = transformers.Trainer(trained, _args(tmp_path), train_dataset=[samples], data_collator=lambda b: collator(b[0]))
    trainer.train()
    assert {m.isolation for m in find_token_mixers(trained)} == {"per_sample"}
    assert abs(trainer.state.log_history[0]["loss"] - total / count) < 5e-6, (trainer.state.log_history[0], total / count)
    with torch.no_grad(), unguarded():
        assert abs(float(model()(**rows).loss) - total / count) > 1e-3


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


def test_lfm2_vl_text_rows_through_a_trainer_collator_and_a_loop_are_exact_unisolated(tmp_path):
    model = _lfm2()
    assert [m.kind for m in find_token_mixers(model)] == ["short_conv", "short_conv"]
    samples = _text_samples(model.config.text_config.vocab_size)
    collator = vp.PackingCollator(sum(len(s["input_ids"]) for s in samples), family="lfm2_vl",
                                  model_config=model.config, return_style="sdpa")  # fmt: skip
    expected = _loss_alone(_lfm2(), samples)
    trainer = transformers.Trainer(model, _args(tmp_path), train_dataset=[samples], data_collator=lambda b: collator(b[0]))
    trainer.train()
    assert abs(trainer.state.log_history[0]["loss"] - expected) < 5e-6
    # a torch loop on model_inputs: the same
    inputs = collator(samples)
    assert inputs["seq_idx"].unique().numel() == 4
    with torch.no_grad():
        assert abs(float(_lfm2()(**inputs).loss) - expected) < 5e-6
        unmarked = float(_lfm2()(**{k: v for k, v in inputs.items() if k != "seq_idx"}).loss)
        with unguarded():
            leaking = float(_lfm2()(**{k: v for k, v in inputs.items() if k != "seq_idx"}).loss)
    assert abs(unmarked - expected) < 5e-6  # without the marker: recognised by the restarting positions
    assert abs(leaking - expected) > 1e-3  # the control: past the guard, nothing isolates it


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


# ------------------------------------------------------------------------------------------ TRL's own SFTTrainer


def test_trl_sft_trainer_with_vlm_packs_collator_trains_an_unisolated_qwen3_5_exactly(tmp_path):
    """TRL's plain ``SFTTrainer`` (not vlm-pack's ``PackedSFTTrainer``, which isolates its model itself) with
    ``TRLPackingCollator`` rows: vlm-pack never sees the model; the first step's loss is each sample alone."""
    pytest.importorskip("trl")
    import trl
    from test_integrations_trl import _args as sft_args
    from test_integrations_trl import _family_preprocessor, _Recording, _records

    from vlm_pack.data import write_shards
    from vlm_pack.integrations.trl import TRLPackingCollator, packed_dataset

    pre = _family_preprocessor("qwen3_5")
    shards = write_shards(_records(6, seed=3, max_images=1), tmp_path / "shards", maxcount=3)
    ds = packed_dataset(shards, pre, capacity=400, cache_dir=str(tmp_path / "hf"))
    model = offline.tiny_model("qwen3_5", pre.tokenizer, num_layers=4, initializer_range=0.2, seed=0)
    collator = _Recording(TRLPackingCollator(400, pre, model_config=model.config))
    trainer = trl.SFTTrainer(model=model, args=sft_args(tmp_path, max_steps=1, learning_rate=1e-3), train_dataset=ds,
                             data_collator=collator, processing_class=pre.tokenizer)  # fmt: skip
    assert {m.isolation for m in find_token_mixers(model)} == {"none"}
    trainer.train()
    first = collator.inner.samples(collator.rows[:1])
    assert len(first) >= 2
    fresh = offline.tiny_model("qwen3_5", pre.tokenizer, num_layers=4, initializer_range=0.2, seed=0)
    expected = _loss_alone(fresh, first)
    logged = next(h for h in trainer.state.log_history if "loss" in h)["loss"]
    assert abs(logged - expected) < 5e-6, (logged, expected)
