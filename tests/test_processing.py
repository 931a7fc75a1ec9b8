"""process_sample / tokenize_conversation: the ids a VLM trains on, checked against real HF processors."""

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
