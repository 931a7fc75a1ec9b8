"""LFM2-VL: the forecast is ``Lfm2VlProcessor``'s own length, its template's ids and spans, and packed = alone.

Runs where torchvision loads (``/work/venv-tv``; marker ``torchvision``): transformers has LFM2-VL's image
processor only as a torchvision class. Oracles: the real ``Lfm2VlProcessor.__call__`` (lengths, image tokens,
crops, patches) and the tiny ``Lfm2VlForConditionalGeneration`` run on each sample alone.

LFM2's text model mixes tokens in short-convolution layers (``Lfm2ShortConv``, kernel 3) besides attention:
restarted position ids and ``cu_seq_lens`` keep the attention layers apart, not the convolutions. Packed rows
are exact only with ``isolate_token_mixers`` (the control without it must fail).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("torchvision")
pytestmark = pytest.mark.torchvision

from transformers import ProcessorMixin  # noqa: E402

from vlm_pack import isolate_token_mixers, offline  # noqa: E402
from vlm_pack.collate.collator import PackingCollator  # noqa: E402
from vlm_pack.families import family  # noqa: E402
from vlm_pack.forward.mixers import find_token_mixers  # noqa: E402
from vlm_pack.processing import forecast_length, process_sample  # noqa: E402
from vlm_pack.testing import check_packed_equivalence, default_packed_forward, unguarded  # noqa: E402
from vlm_pack.vision import Lfm2VlSpec, vision_spec, vision_spec_from_processor  # noqa: E402

TEMPLATE = (Path(__file__).parent / "templates" / "lfm2_vl.jinja").read_text()
TOL, MAX_ABS = 1.0001, 1e-3

# (width, height): tiny, small, around one 512 px tile, the large threshold (724 is the first large square),
# large photos, and extreme aspect ratios on both sides of the threshold
SIZES = [
    (1, 1), (10, 10), (32, 32), (100, 75), (256, 256), (300, 200), (511, 512), (512, 512), (513, 513),
    (640, 480), (723, 723), (724, 724), (1024, 768), (1100, 700), (1400, 900), (1920, 1080), (4000, 3000),
    (3000, 50), (50, 3000), (10000, 20), (20, 10000), (2048, 64), (777, 333), (6000, 600), (600, 6000),
    (5000, 1000), (333, 2000),
]  # fmt: skip


@functools.cache
def _processor(**overrides) -> ProcessorMixin:
    tok = offline.build_tokenizer("lfm2_vl")
    return offline.processor("lfm2_vl", tok, chat_template=TEMPLATE, **overrides)


def _picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """Noisy pixels (a plain colour would give every image token the same features)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------ the forecast from the size


def test_the_record_and_the_processor_give_the_released_rule():
    record = family("LFM2-VL")
    assert record.name == "lfm2_vl" and record.token_mixers == ("short_conv",)
    assert record.wraps == "processor_markers" and not record.collapsed
    assert vision_spec_from_processor(_processor()) == vision_spec("lfm2_vl") == Lfm2VlSpec()
    assert Lfm2VlSpec().tokens_per_tile == 256


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"use_thumbnail": False},
        {"do_image_splitting": False},
        {"min_image_tokens": 32, "max_image_tokens": 128, "max_tiles": 4},
        {"min_tiles": 1, "max_tiles": 6},
    ],
    ids=["released", "no-thumbnail", "no-splitting", "fewer-tokens", "min-tiles-1"],
)
def test_forecast_is_the_processors_own_call_on_every_size(overrides):
    """Per size: ``processor(text=["<image>"], images=[[image]])`` against the spec (tokens, markers, crops,
    patches) and against ``forecast_length`` of a templated conversation (the processed length)."""
    proc = _processor(**overrides)
    spec = vision_spec_from_processor(proc)
    image_id = proc.image_token_id
    off = []
    for width, height in SIZES:
        enc = proc(text=["<image>"], images=[[Image.new("RGB", (width, height), (40, 90, 160))]])
        ids = list(enc["input_ids"][0])
        shapes = enc["spatial_shapes"]
        got = (len(ids), ids.count(image_id), int(shapes.shape[0]), int(shapes.prod(-1).sum()))
        forecast = (
            spec.total_tokens(width, height),
            spec.num_tokens(width, height),
            spec.tiles(width, height),
            spec.num_patches(width, height),
        )
        if got != forecast:
            off.append(f"{width}x{height}: processor {got}, forecast {forecast}")
    assert not off, "\n".join(off)
    large = [s for s in SIZES if spec.tiles(*s) > 1]
    if spec.do_image_splitting:
        assert len(large) >= 8  # the tiled rule is exercised, not only the single image
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "a blue square"},
    ]
    for width, height in [(100, 75), (1400, 900), (6000, 600)]:
        sample = process_sample([_picture(width, height)], conversation, processor=proc)
        assert forecast_length(conversation, [(width, height)], processor=proc) == (
            len(sample["input_ids"]),
            sample["tokens_per_image"].tolist(),
        )


def test_markers_are_counted_through_the_tokenizer():
    """1400x900: a 3 x 2 grid of 256-token tiles, each after its <|img_row_r_col_c|>, then the thumbnail."""
    proc = _processor()
    spec = vision_spec("lfm2_vl")
    assert spec.tile_grid(1400, 900) == (3, 2) and spec.num_tokens(1400, 900) == 6 * 256 + 228
    enc = proc(text=["<image>"], images=[[Image.new("RGB", (1400, 900))]])
    tokens = proc.tokenizer.convert_ids_to_tokens(list(enc["input_ids"][0]))
    markers = [t for t in tokens if t != "<image>"]
    rows = [f"<|img_row_{r}_col_{c}|>" for r in (1, 2) for c in (1, 2, 3)]
    assert markers == ["<|image_start|>", *rows, "<|img_thumbnail|>", "<|image_end|>"]
    assert spec.extra_tokens(1400, 900) == len(markers)


def test_a_tokenizer_that_splits_the_image_token_is_refused():
    """The expansion must open and close with whole special tokens, or its count would be a guess."""
    from vlm_pack.processing import _marker_extra_tokens

    tok = offline.build_tokenizer("qwen2_vl")  # has <image>, but no <|image_start|> / <|image_end|>
    with pytest.raises(ValueError, match=r"must keep '<\|image_start\|>', '<\|image_end\|>'"):
        _marker_extra_tokens(vision_spec("lfm2_vl"), tok, None, 1400, 900)


# ----------------------------------------------------------------------------- the released chat template

MULTI = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the dog?"}]},
    {"role": "assistant", "content": "the dog is left"},
    {"role": "user", "content": [{"type": "text", "text": "and this one"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "three cats"}]},
]


def test_the_released_template_gives_transformers_ids_and_the_assistant_spans():
    proc = _processor()
    tok = proc.tokenizer
    images = [_picture(1100, 700, 1), _picture(90, 160, 2)]  # a tiled image and a single one
    messages = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [dict(p, image=images[0 if i == 1 else 1]) if p["type"] == "image" else p for p in m["content"]],
        }
        for i, m in enumerate(MULTI)
    ]
    text = ProcessorMixin.apply_chat_template(proc, messages)
    assert text.startswith("<|startoftext|><|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n<image>")
    ref = list(proc(text=[text], images=[images])["input_ids"][0])  # the processor adds no second BOS
    s = process_sample(images, MULTI, processor=proc, key="k")
    assert s["input_ids"].tolist() == ref and ref.count(tok.bos_token_id) == 1
    trained = tok.decode([int(i) for i in s["labels"] if i != -100])
    assert trained == "the dog is left<|im_end|>three cats<|im_end|>"
    assert forecast_length(MULTI, [im.size for im in images], processor=proc)[0] == len(ref)
    assert s["tokens_per_image"].tolist() == [vision_spec("lfm2_vl").num_tokens(*im.size) for im in images]


# ---------------------------------------------------------------------------------------- packed == alone

# sample 0: a small image and a tiled one (3 x 2 tiles + thumbnail); sample 1: one image; sample 2: text only
ROW_SIZES = [[(90, 60), (1100, 700)], [(50, 140)], []]
_QUESTIONS = ["what is the red car near", "describe the picture", "count the people on the street"]
_ANSWERS = ["the dog is left of the tall building", "two people with a dog", "three cats and a house"]


def _conversation(k: int) -> list[dict]:
    content = [{"type": "image"}] * len(ROW_SIZES[k]) + [{"type": "text", "text": _QUESTIONS[k]}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": _ANSWERS[k]}]


@functools.cache
def _samples() -> tuple:
    proc = _processor()
    return tuple(
        process_sample([_picture(w, h, 10 * k + j) for j, (w, h) in enumerate(ROW_SIZES[k])], _conversation(k), processor=proc)
        for k in range(len(ROW_SIZES))
    )


def _model(attn: str, isolated: bool):
    # three text layers: short conv, attention, short conv (the leak reaches every layer after the first)
    model = offline.tiny_model(
        "lfm2_vl", _processor().tokenizer, attn_implementation=attn, initializer_range=0.2, seed=0, num_layers=3
    )
    return isolate_token_mixers(model) if isolated else model


def _row(model):
    samples = list(_samples())
    longest = sum(len(s["input_ids"]) for s in samples)
    batch = PackingCollator(longest, model_config=model.config, tokenizer=_processor())(samples)
    assert batch.num_rows == 1 and batch.num_samples == 3  # all three in one row
    return samples, batch


def test_vision_tensors_join_across_the_row_as_the_model_reads_them():
    samples, batch = _row(_model("sdpa", isolated=False))
    crops = [s["pixel_values"].shape[0] for s in samples if "pixel_values" in s]
    assert crops == [1 + 7, 1] and batch.pixel_values.shape[:2] == (9, 1024)
    assert torch.equal(batch.spatial_shapes, torch.cat([s["spatial_shapes"] for s in samples[:2]]))
    assert torch.equal(batch.pixel_attention_mask, torch.cat([s["pixel_attention_mask"] for s in samples[:2]]))
    assert set(batch.model_inputs("sdpa")) >= {"pixel_values", "pixel_attention_mask", "spatial_shapes"}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_matches_each_sample_alone(attn):
    model = _model(attn, isolated=True)
    assert [(m.kind, m.isolation) for m in find_token_mixers(model)] == [("short_conv", "per_sample")] * 2
    samples, batch = _row(model)
    report = check_packed_equivalence(
        model, samples, None, packed_batch=batch, style=attn, batch_size=1, tokenizer=_processor().tokenizer
    )
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)
    assert report.num_tokens == sum(len(s["input_ids"]) - 1 for s in samples)


def test_flash_style_inputs_through_varlen_attention_match_each_sample_alone():
    """``model_inputs("flash_attention_2")`` (one flat row, ``cu_seq_lens_q/k``) on vlm-pack's varlen attention,
    which isolates the token mixers too, against each sample alone through a plain sdpa model."""
    from vlm_pack.forward.attention import use_varlen_attention

    model = use_varlen_attention(_model("sdpa", isolated=False))
    sdpa = _model("sdpa", isolated=False)
    samples, batch = _row(model)
    report = check_packed_equivalence(
        model,
        samples,
        None,
        packed_batch=batch,
        batch_size=1,
        batched_forward=lambda _, inputs: sdpa(**inputs, use_cache=False).logits,
        packed_forward=default_packed_forward("flash_attention_2"),
    )
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_control_without_isolated_mixers_leaks(attn):
    """The same row with the boundaries given to attention only (transformers' own packed path): the short
    convolutions carry each sample's last tokens into the next one."""
    model = _model(attn, isolated=False)
    samples, batch = _row(model)
    report = check_packed_equivalence(model, samples, None, packed_batch=batch, style=attn, batch_size=1)
    assert not report.passed and report.metric > 1.001, str(report)


def test_an_image_the_processor_gives_more_patches_than_its_mask_is_refused_naming_the_sample():
    """10000x20 smart-resizes to 1428 patches, more than max_num_patches (1024): transformers writes a 1024-long
    mask beside 1428 patch rows. The forecast is still its length; the collator refuses the sample by name."""
    proc = _processor()
    conversation = [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "a line"}]
    sample = process_sample([_picture(10000, 20)], conversation, processor=proc)
    assert sample["pixel_values"].shape[1] == 1428 and sample["pixel_attention_mask"].shape[1] == 1024
    assert forecast_length(conversation, [(10000, 20)], processor=proc)[0] == len(sample["input_ids"])
    collator = PackingCollator(4096, model_config=_model("sdpa", isolated=False).config, tokenizer=proc)
    with pytest.raises(ValueError, match=r"sample 1 \(key 'wide'\).*max_num_patches"):
        collator([_samples()[1], {**sample, "key": "wide"}])


# ------------------------------------------------------------------------------ the README's route, no manual call


def _readme_route(tmp_path, model):
    """PackedMapDataset + Trainer(data_collator=ds.trainer_collator("sdpa")): LFM2-VL rows with images."""
    import io

    import datasets
    import transformers

    import vlm_pack as vp
    from vlm_pack.data import PackedMapDataset, build_plan

    def png(width, height, seed):
        out = io.BytesIO()
        _picture(width, height, seed).save(out, format="PNG")
        return out.getvalue()

    images = [[png(100, 75, 0)], [], [png(300, 200, 2)], []]
    messages = [[{"role": "user", "content": "<image>" * len(images[k]) + _QUESTIONS[k % len(_QUESTIONS)]},
                 {"role": "assistant", "content": _ANSWERS[k % len(_ANSWERS)]}] for k in range(4)]  # fmt: skip
    data = datasets.Dataset.from_dict({"images": images, "messages": messages})
    data = data.cast_column("images", datasets.List(datasets.Image()))
    pre = vp.Preprocessor(processor=_processor())
    config = vp.PackingConfig(capacity=1024)
    ds = PackedMapDataset(data, pre, config, plan=build_plan(data, pre, config))
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=1, train_sampling_strategy="sequential",
        remove_unused_columns=False, max_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        logging_steps=1, learning_rate=1e-2,
    )  # fmt: skip
    return transformers.Trainer(model, args, train_dataset=ds, data_collator=ds.trainer_collator("sdpa")), ds, data, pre


def test_readme_route_trains_unisolated_mixers_exactly_with_no_manual_call(tmp_path):
    """The README's route with images, no ``isolate_token_mixers``: the rows' ``seq_idx`` reaches the model's
    call, which isolates its short convolutions before any layer runs (on every release: before 5.24
    transformers' fallback would ignore the marker and leak). The first step's loss is each sample of the first
    pack alone; so is the same pack without the marker (recognised by its positions); the control (no marker, an
    un-isolated model past the guard) leaks."""
    model = _model("sdpa", isolated=False)
    trainer, ds, data, pre = _readme_route(tmp_path, model)
    assert ds[0].num_samples >= 2
    trainer.train()
    assert trainer.state.global_step == 1
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}
    reference = _model("sdpa", isolated=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in ds[0].metadata["__row__"]:
            record = data[int(row)]
            s = pre.process(record["images"], record["messages"])
            inputs = {k: v for k, v in s.items() if isinstance(v, torch.Tensor) and k != "labels"}
            inputs["input_ids"] = inputs["input_ids"][None]
            n = int((s["labels"][1:] != -100).sum())
            total += float(reference(**inputs, labels=s["labels"][None], use_cache=False).loss) * n
            count += n
        unmarked = {k: v for k, v in ds[0].model_inputs("sdpa").items() if k != "seq_idx"}
        recognised = float(_model("sdpa", isolated=False)(**unmarked).loss)  # by its restarting positions
        with unguarded():
            leaking = float(_model("sdpa", isolated=False)(**unmarked).loss)
    assert abs(recognised - total / count) < 5e-6
    assert abs(leaking - total / count) > 1e-4  # measured 5.4e-4 (the exact run: within 5e-6)
    assert abs(trainer.state.log_history[0]["loss"] - total / count) < 5e-6
