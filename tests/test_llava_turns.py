"""LLaVA turns ``{"from": "human" | "gpt", "value"}`` are a conversation at every entry point, text as written.

README "Data formats": a conversation is a list of ``{"role", "content"}`` turns, and LLaVA turns are
converted. The oracle is transformers: the checkpoint's chat template rendered by
``tokenizer.apply_chat_template`` on the equivalent role/content messages (the text after ``<image>`` kept as
written, its ``"\\n"`` included), expanded by the checkpoint's processor. The reader path (a LLaVA dataset
through a :class:`PackedMapDataset` epoch) gives the length of the same literal text.
"""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
from PIL import Image

from vlm_pack import Preprocessor, offline
from vlm_pack.config import PackingConfig
from vlm_pack.data.map_style import PackedMapDataset, plan_info

TEMPLATES = Path(__file__).parent / "templates"

LLAVA = [
    {"from": "human", "value": "<image>\nWhat is in the picture?"},
    {"from": "gpt", "value": "A red square."},
    {"from": "human", "value": "And here?\n<image>"},
    {"from": "gpt", "value": "A green one."},
]
# The same conversation as role/content turns, image parts where the markers are, text as written.
PARTS = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is in the picture?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
    {"role": "user", "content": [{"type": "text", "text": "And here?\n"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A green one."}]},
]
IMAGES = [Image.new("RGB", (96, 64), (200, 30, 30)), Image.new("RGB", (40, 120), (0, 90, 0))]


def _parts_with_strings() -> list[dict]:
    """PARTS with every content a string, ``<image>`` where images go (vlm-pack's string form)."""
    join = lambda parts: "".join("<image>" if p["type"] == "image" else p["text"] for p in parts)  # noqa: E731
    return [{"role": m["role"], "content": join(m["content"])} for m in PARTS]


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def checkpoint(request):
    family = request.param
    template = (TEMPLATES / f"{family}.jinja").read_text()
    tok = offline.build_tokenizer(family, chat_template=template)
    proc = offline.processor(family, tok, chat_template=template)
    return tok, proc


def _oracle(tok, proc, messages, images) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False)
    bos = tok.bos_token
    enc = proc(text=[text], images=[images], add_special_tokens=not (bos and text.startswith(bos)))
    return list(enc["input_ids"][0])


def test_preprocessor_takes_llava_turns_as_the_same_role_content_conversation(checkpoint):
    tok, proc = checkpoint
    expected = _oracle(tok, proc, PARTS, IMAGES)
    for pre in (Preprocessor(processor=proc), Preprocessor(tokenizer=tok, image_processor=proc.image_processor)):
        sample = pre.process(IMAGES, LLAVA, key="llava-0")
        assert sample["input_ids"].tolist() == expected
        as_strings = pre.process(IMAGES, _parts_with_strings(), key="llava-0")
        assert sample["input_ids"].tolist() == as_strings["input_ids"].tolist()
        assert sample["labels"].tolist() == as_strings["labels"].tolist()
        assert pre.forecast(LLAVA, [im.size for im in IMAGES], key="llava-0")[0] == len(expected)
        assert pre.render(LLAVA, 2) == pre.render(PARTS, 2)
        assert pre.tokenize(LLAVA, 2) == pre.tokenize(PARTS, 2)


def test_a_malformed_llava_turn_names_the_sample_and_the_fix():
    pre = Preprocessor(processor=offline.processor("qwen2_vl"))
    with pytest.raises(ValueError, match=r"sample 'k-3'.*speaker 'robot'.*human/gpt/system"):
        pre.forecast([{"from": "robot", "value": "hi"}], [], key="k-3")
    with pytest.raises(ValueError, match=r"sample 'k-4'.*'value' must be a string"):
        pre.forecast([{"from": "human", "value": None}], [], key="k-4")


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_a_llava_dataset_epoch_keeps_the_newline_after_the_image(checkpoint):
    """A LLaVA-Instruct style dataset (``image``, ``conversations``) through a map-style epoch: each sample is
    as long as transformers makes its literal text, ``"<image>\\n"`` and all."""
    tok, proc = checkpoint
    rows = [
        ([IMAGES[0]], [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "red"}]),
        ([IMAGES[1]], [{"from": "human", "value": "Look:\n<image>\n\nWhich colour?"}, {"from": "gpt", "value": "a"}]),
        (IMAGES, LLAVA),
    ]
    ds = datasets.Dataset.from_dict(
        {"image": [[_png(im) for im in images] for images, _ in rows], "conversations": [c for _, c in rows]}
    )
    ds = ds.cast_column("image", datasets.List(datasets.Image()))
    config = PackingConfig(capacity=4096, on_error="raise")
    packed = PackedMapDataset(ds, Preprocessor(processor=proc), config, cache=False)
    seen: dict[int, int] = {}
    for i in range(len(packed)):
        info = plan_info(packed[i])
        seen.update(zip(info["rows"], info["lengths"]))
    assert sorted(seen) == list(range(len(rows)))
    for row, (images, turns) in enumerate(rows):
        messages = []
        for turn in turns:  # the literal text: image parts where "<image>" is, every other character kept
            pieces = turn["value"].split("<image>")
            content: list[dict] = []
            for j, piece in enumerate(pieces):
                if j:
                    content.append({"type": "image"})
                if piece:
                    content.append({"type": "text", "text": piece})
            messages.append({"role": "user" if turn["from"] == "human" else "assistant", "content": content})
        assert seen[row] == len(_oracle(tok, proc, messages, images)), row
