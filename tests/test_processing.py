"""process_sample / tokenize_conversation: the ids a VLM trains on, checked against real HF processors."""

import io

import pytest
import torch
from PIL import Image

from vlm_pack.offline import build_tokenizer, image_processor, processor
from vlm_pack.processing import chat_format, process_sample, tokenize_conversation

CONV = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
    {"role": "assistant", "content": "A red square."},
    {"role": "user", "content": "And the color?"},
    {"role": "assistant", "content": "Red."},
]


def _img(w, h, color=(200, 30, 30)):
    return Image.new("RGB", (w, h), color)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_qwen_expansion_matches_grid_and_labels_only_assistant(family):
    tok = build_tokenizer(family)
    s = process_sample([_img(300, 200)], CONV, tokenizer=tok, image_processor=image_processor(family))
    grid = s["image_grid_thw"]
    n = int(grid.prod() // 4)
    assert s["tokens_per_image"].tolist() == [n]
    assert int((s["input_ids"] == tok.image_token_id).sum()) == n
    assert torch.equal(s["mm_token_type_ids"], (s["input_ids"] == tok.image_token_id).long())
    trained = tok.decode(s["labels"][s["labels"] != -100])
    assert trained == "A red square.<|im_end|>Red.<|im_end|>"
    # the image sits between its wrappers
    ids = s["input_ids"].tolist()
    start = ids.index(tok.vision_start_token_id)
    assert ids[start + 1 : start + 1 + n] == [tok.image_token_id] * n
    assert ids[start + 1 + n] == tok.vision_end_token_id


@pytest.mark.parametrize("family", ["llava", "llava_next"])
@pytest.mark.parametrize("size", [(300, 200), (640, 480), (200, 900)])
@pytest.mark.slow
def test_llava_ids_equal_hf_processor(family, size):
    """The expansion must be exactly what the released HF processor produces for the same text."""
    tok = build_tokenizer(family)
    proc = processor(family, tok)
    img = _img(*size)
    s = process_sample([img], CONV, processor=proc, family=family)
    ids, _ = tokenize_conversation(CONV, tokenizer=tok, family=family, num_images=1)
    text = tok.decode(ids)  # the rendered template with one <image>
    ref = proc(images=[img], text=text, return_tensors="pt")
    assert s["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(s["pixel_values"], ref["pixel_values"])


def test_collapsed_layout_keeps_one_placeholder_per_image():
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl")
    imgs = [_img(300, 200), _img(100, 500)]
    conv = [
        {"role": "user", "content": "<image> and <image>: compare."},
        {"role": "assistant", "content": "Different."},
    ]
    e = process_sample(imgs, conv, tokenizer=tok, image_processor=ip)
    c = process_sample(imgs, conv, tokenizer=tok, image_processor=ip, layout="collapsed")
    assert int((c["input_ids"] == tok.image_token_id).sum()) == 2
    assert len(e["input_ids"]) == len(c["input_ids"]) - 2 + int(c["tokens_per_image"].sum())
    assert torch.equal(e["tokens_per_image"], c["tokens_per_image"])


def test_caption_puts_images_first_and_trains_on_caption():
    tok = build_tokenizer("qwen2_vl")
    s = process_sample(
        [_img(64, 64)], "a tiny picture", tokenizer=tok, image_processor=image_processor("qwen2_vl")
    )
    ids = s["input_ids"].tolist()
    assert ids[0] == tok.vision_start_token_id
    assert tok.decode(s["labels"][s["labels"] != -100]) == "a tiny picture<|im_end|>"


def test_placeholder_mismatch_names_the_sample():
    tok = build_tokenizer("llava")
    with pytest.raises(ValueError, match=r"sample 'shard-3/key-9'.*2 image placeholder\(s\) but 1 image"):
        process_sample(
            [_img(32, 32)], "<image> <image> two", processor=processor("llava", tok), key="shard-3/key-9"
        )


def test_bad_inputs_raise_clear_errors():
    tok = build_tokenizer("qwen2_vl")
    with pytest.raises(ValueError, match="role"):
        tokenize_conversation([{"role": "robot", "content": "hi"}], tokenizer=tok)
    with pytest.raises(ValueError, match="no chat format"):
        chat_format("unknown_family")
    with pytest.raises(ValueError, match="needs image_processor"):
        process_sample([_img(32, 32)], "x", tokenizer=tok)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava", "llava_next"])
@pytest.mark.slow
def test_forecast_from_header_equals_processed_length(family):
    """The packer's forecast (text + header sizes) is the length the sample really has after preprocessing."""
    import io
    import random

    from vlm_pack.processing import forecast_length
    from vlm_pack.vision import image_size, vision_spec_from_processor

    tok = build_tokenizer(family)
    ip = (
        image_processor(family, size={"shortest_edge": 3136, "longest_edge": 401408})
        if family.startswith("qwen")
        else image_processor(family)
    )
    spec = vision_spec_from_processor(ip)
    rng = random.Random(family)
    for n_images in (0, 1, 3):
        blobs = []
        for _ in range(n_images):
            buf = io.BytesIO()
            _img(rng.randint(20, 1500), rng.randint(20, 1500)).save(
                buf, format=rng.choice(["JPEG", "PNG", "WEBP"])
            )
            blobs.append(buf.getvalue())
        conv = [
            {"role": "user", "content": "<image>" * n_images + "Describe."},
            {"role": "assistant", "content": "x"},
        ]
        sizes = [image_size(b) for b in blobs]
        length, counts = forecast_length(conv, sizes, tokenizer=tok, spec=spec, family=family)
        s = process_sample(blobs, conv, tokenizer=tok, image_processor=ip, family=family)
        assert length == len(s["input_ids"])
        assert counts == s["tokens_per_image"].tolist()


def _rendered(conv, family, n_images, tok):
    """The family's prompt text with the tokenizer's image token: what one passes to the HF processor."""
    segments = chat_format(family).render(conv, n_images)
    return "".join(text for text, _ in segments).replace("<image>", tok.image_token)


MULTI = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "the dog?"}]},
    {"role": "assistant", "content": "the dog is left"},  # " the" merges with the space before it
    {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}, {"type": "image"}]},
    {"role": "assistant", "content": "three cats"},
]


@pytest.mark.parametrize("family", ["llava", "llava_next"])
@pytest.mark.slow
def test_multi_image_ids_equal_hf_processor_on_the_whole_prompt(family, tmp_path):
    """Tokens across segment boundaries merge as when the processor tokenizes the whole prompt."""
    tok = build_tokenizer(family)
    proc = processor(family, tok)
    imgs = [_img(300, 200), _img(640, 480, (0, 90, 0)), _img(120, 700, (0, 0, 200))]
    path = tmp_path / "a.png"
    imgs[0].save(path)
    buf = io.BytesIO()
    imgs[1].save(buf, format="PNG")
    s = process_sample([path, buf.getvalue(), imgs[2]], MULTI, processor=proc, family=family)
    ref = proc(images=imgs, text=_rendered(MULTI, family, 3, tok), return_tensors="pt")
    assert s["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(s["pixel_values"], ref["pixel_values"])
    assert tok.decode(s["labels"][s["labels"] != -100]) == " the dog is left</s> three cats</s>"
    assert int((s["input_ids"] == tok.image_token_id).sum()) == int(s["tokens_per_image"].sum())


def test_qwen_ids_equal_tokenizer_on_the_whole_prompt():
    tok = build_tokenizer("qwen2_vl")
    ids, mask = tokenize_conversation(MULTI, tokenizer=tok, family="qwen2_vl", num_images=3)
    assert ids == tok(_rendered(MULTI, "qwen2_vl", 3, tok), add_special_tokens=False)["input_ids"]
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "the dog is left<|im_end|>three cats<|im_end|>"


def _raw_tokenizer():
    """A fast tokenizer as loaded from a hub tokenizer.json: no image_token attribute set."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from vlm_pack.offline import _tokenizer_json

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(1024)))


@pytest.mark.parametrize(
    "family, token", [("qwen2_vl", "<|image_pad|>"), ("llava", "<image>"), ("llava_next", "<image>")]
)
def test_tokenizer_without_image_token_attribute_uses_the_family_token(family, token):
    """Vocabularies can hold several image tokens (LLaVA-OneVision's Qwen2 vocab has both)."""
    tok = _raw_tokenizer()
    assert getattr(tok, "image_token_id", None) is None
    ids, _ = tokenize_conversation(MULTI, tokenizer=tok, family=family, num_images=3)
    assert ids.count(tok.convert_tokens_to_ids(token)) == 3
    if family == "qwen2_vl":
        s = process_sample(
            [_img(64, 64)] * 3, MULTI, tokenizer=tok, image_processor=image_processor(family), family=family
        )
        image_id = tok.convert_tokens_to_ids(token)
        assert torch.equal(s["mm_token_type_ids"], (s["input_ids"] == image_id).long())
        assert int(s["mm_token_type_ids"].sum()) == int(s["tokens_per_image"].sum())


def test_image_token_typed_in_the_text_is_an_error_naming_the_sample():
    tok = build_tokenizer("qwen2_vl")
    conv = [
        {"role": "user", "content": "<image> what is <|image_pad|>?"},
        {"role": "assistant", "content": "x"},
    ]
    with pytest.raises(ValueError, match=r"sample 'k/5'.*<\|image_pad\|>"):
        tokenize_conversation(conv, tokenizer=tok, family="qwen2_vl", num_images=1, key="k/5")


def test_template_callable_and_collapsed_forecast():
    from vlm_pack.processing import forecast_length
    from vlm_pack.vision import vision_spec_from_processor

    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 200704})

    def template(conv, n):
        return [
            ("Q: " + "<image>" * n + conv[0]["content"] + "\nA:", False),
            (" " + conv[1]["content"], True),
        ]

    conv = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "two"}]
    imgs = [_img(500, 300), _img(90, 900)]
    s = process_sample(imgs, conv, tokenizer=tok, image_processor=ip, template=template, family="qwen2_vl")
    c = process_sample(imgs, conv, tokenizer=tok, image_processor=ip, template=template, layout="collapsed")
    n, counts = forecast_length(
        conv, [im.size for im in imgs], tokenizer=tok, spec=vision_spec_from_processor(ip), template=template
    )
    assert n == len(s["input_ids"]) and counts == s["tokens_per_image"].tolist()
    assert len(c["input_ids"]) == n - sum(counts) + 2
    assert tok.decode(s["labels"][s["labels"] != -100]) == " two"


def test_offline_tokenizer_is_identical_across_processes():
    """Token ids written into shards by one run must mean the same in the next (no training randomness)."""
    import hashlib
    import subprocess
    import sys

    from vlm_pack.offline import _tokenizer_json

    code = "import hashlib; from vlm_pack.offline import _tokenizer_json as t; print(hashlib.sha256(t(1024).encode()).hexdigest())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == hashlib.sha256(_tokenizer_json(1024).encode()).hexdigest()


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_forecast_takes_the_processor(family):
    """forecast_length(processor=...) shares process_sample's rendering: the same length and counts."""
    from vlm_pack.processing import forecast_length

    proc = processor(family, build_tokenizer(family))
    imgs = [_img(300, 200), _img(640, 480), _img(120, 700)]
    s = process_sample(imgs, MULTI, processor=proc)
    n, counts = forecast_length(MULTI, [im.size for im in imgs], processor=proc)
    assert n == len(s["input_ids"]) and counts == s["tokens_per_image"].tolist()


def test_preprocessor_forecast_collator_and_errors():
    """One Preprocessor: its header forecast is its processed length (counts against the image processor's own
    grid), its collator takes the processor's merge size, and bad parts are refused with the fix."""
    from vlm_pack import Preprocessor

    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 200704})
    pre = Preprocessor(tok, ip)
    assert pre.family == "qwen2_vl" and pre.spec.max_pixels == 200704
    images = [_img(300, 200), _img(90, 400, (0, 90, 0))]
    conv = [{"role": "user", "content": "<image><image>Compare."}, {"role": "assistant", "content": "Same."}]
    length, per_image = pre.forecast(conv, [im.size for im in images])
    sample = pre.process(images, conv)
    grid = ip(images=images, return_tensors="pt")["image_grid_thw"]
    assert per_image == (grid.prod(-1) // 4).tolist() == sample["tokens_per_image"].tolist()
    assert length == len(sample["input_ids"])
    ids, _ = pre.tokenize(conv, num_images=2)
    assert ids.count(tok.image_token_id) == 2 and len(ids) == length - sum(per_image) + 2
    assert tok(pre.render(conv, 2), add_special_tokens=False)["input_ids"] == ids
    collator = pre.collator(4096)
    assert collator.family == "qwen2_vl" and collator.spatial_merge_size == ip.merge_size
    collapsed_pre = Preprocessor(tok, ip, layout="collapsed")
    collapsed = collapsed_pre.process(images, conv)
    assert int((collapsed["input_ids"] == tok.image_token_id).sum()) == 2
    # Its collator lays rows out in the layout its samples are processed in: one placeholder per image, and
    # the expanded boundaries of the same sample alone.
    batch = collapsed_pre.collator(4096)([collapsed])
    assert batch.layout == "collapsed" and int((batch.input_ids == tok.image_token_id).sum()) == 2
    assert batch.cu_seqlens_expanded.tolist() == [0, length]
    with pytest.raises(ValueError, match="needs tokenizer="):
        Preprocessor(image_processor=ip)
    with pytest.raises(ValueError, match="layout must be 'expanded' or 'collapsed'"):
        Preprocessor(tok, ip, layout="packed")
