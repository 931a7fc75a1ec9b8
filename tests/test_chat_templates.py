"""The checkpoint's own chat template: ids, trained spans and forecast exact for ten released templates.

Each template in ``tests/templates/`` is the ``chat_template`` of a released checkpoint (named in
``tests/templates/README.md``), attached to the family's real transformers processor class built offline around
a locally trained tokenizer with the family's special tokens. The oracle for the ids is transformers itself:
``processor(text=ProcessorMixin.apply_chat_template(processor, messages), images=...)`` (no second BOS when the
template writes one). The oracle for the labels is a search, in those ids, of each assistant text's own token ids
followed by the template's end-of-turn token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import ProcessorMixin

from vlm_pack import offline
from vlm_pack._compat import processor_needs_torchvision, timm_tower_without_sdpa
from vlm_pack.processing import forecast_length, process_sample, tokenize_conversation

TEMPLATES = Path(__file__).parent / "templates"

# family -> the end-of-turn token its template writes right after assistant content ("" where it writes none:
# llava-1.5-hf ends an assistant turn with a space, llava-v1.6-mistral-hf with the literal text "<\s> ").
END_OF_TURN = {
    "qwen2_vl": "<|im_end|>",  # Qwen/Qwen2-VL-7B-Instruct
    "qwen2_5_vl": "<|im_end|>",  # Qwen/Qwen2.5-VL-7B-Instruct
    "llava": "",  # llava-hf/llava-1.5-7b-hf
    "llava_next": "",  # llava-hf/llava-v1.6-mistral-7b-hf
    "llava_onevision": "<|im_end|>",  # llava-hf/llava-onevision-qwen2-7b-ov-hf
    "idefics3": "<end_of_utterance>",  # HuggingFaceM4/Idefics3-8B-Llama3
    "smolvlm": "<end_of_utterance>",  # HuggingFaceTB/SmolVLM-Instruct
    "gemma3": "<end_of_turn>",  # google/gemma-3-4b-it
    "internvl": "<|im_end|>",  # OpenGVLab/InternVL3-1B-hf
    "mistral3": "</s>",  # mistralai/Mistral-Small-3.1-24B-Instruct-2503
    "lfm2_vl": "<|im_end|>",  # LiquidAI/LFM2-VL-1.6B (its image processor needs torchvision)
    "glm4v_moe": "",  # zai-org/GLM-4.5V format: the next turn's <|user|> ends a reply (tests/templates/README.md)
    "glm46v": "",  # zai-org/GLM-4.6V format
    "gemma4": "<turn|>",  # google/gemma-4-*-it rendering rules (tests/templates/README.md)
    "qwen3_5": "<|im_end|>",  # Qwen/Qwen3.5-27B (byte-identical to a quoted copy: tests/templates/README.md)
    "qwen3_5_moe": "<|im_end|>",  # Qwen/Qwen3.5-35B-A3B (the same template)
}
# Checkpoint image-processor parameters everywhere, except Qwen's pixel cap (fewer tokens, same rule).
OVERRIDES = {
    f: dict(size={"shortest_edge": 3136, "longest_edge": 200704}) for f in ("qwen2_vl", "qwen2_5_vl")
}
OVERRIDES.update({f: dict(size={"shortest_edge": 4096, "longest_edge": 256 * 32 * 32}) for f in ("qwen3_5", "qwen3_5_moe")})
_CACHE: dict[str, object] = {}


def _needs_torchvision(family, model=False):
    """LFM2-VL's image processor is a torchvision class, Gemma 3n's tower timm's: they run where those load.
    Gemma 4's processor imports torchvision on transformers 5.18-5.19 (``processor_needs_torchvision``)."""
    if family == "gemma4" and (why := processor_needs_torchvision(family)):
        pytest.skip(why)
    if family in offline.NEEDS_TORCHVISION or (model and family in offline.NEEDS_TIMM):
        pytest.importorskip("torchvision")
    if model and family in offline.NEEDS_TIMM:
        pytest.importorskip("timm")
        if why := timm_tower_without_sdpa():  # the tiny model is built with sdpa
            pytest.skip(why)


def _params(families):
    tv = (*offline.NEEDS_TORCHVISION, *offline.NEEDS_TIMM)
    return [pytest.param(f, marks=pytest.mark.torchvision) if f in tv else f for f in families]


def _processor(family):
    _needs_torchvision(family)
    if family not in _CACHE:
        template = (TEMPLATES / f"{family}.jinja").read_text()
        tok = offline.build_tokenizer(family)
        _CACHE[family] = offline.processor(family, tok, chat_template=template, **OVERRIDES.get(family, {}))
    return _CACHE[family]


def _img(w, h, color=(200, 30, 30)):
    return Image.new("RGB", (w, h), color)


IMAGES = [_img(300, 200), _img(90, 160, (0, 90, 0))]
MULTI = [  # system turn, two images in two user turns, plain-string contents
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the dog?"}]},
    {"role": "assistant", "content": "the dog is left"},
    {"role": "user", "content": [{"type": "text", "text": "and this one"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "three cats"}]},
]
SINGLE = [  # no system turn (Qwen's template adds its default one), one image, one turn
    {"role": "user", "content": "<image>Describe the picture."},
    {"role": "assistant", "content": "a red square on the left"},
]


def _oracle(proc, conversation, images):
    """transformers' ids for the conversation: its template rendering through the processor."""
    it = iter(images)
    messages = []
    for m in conversation:
        content = m["content"]
        if isinstance(content, str):
            pieces = content.split("<image>")
            content = [{"type": "image"}] * (len(pieces) - 1) + [{"type": "text", "text": pieces[-1]}]
        messages.append(
            {
                "role": m["role"],
                "content": [dict(p, image=next(it)) if p["type"] == "image" else p for p in content],
            }
        )
    text = ProcessorMixin.apply_chat_template(proc, messages)
    bos = proc.tokenizer.bos_token
    enc = proc(text=[text], images=[images], add_special_tokens=not (bos and text.startswith(bos)))
    return text, list(enc["input_ids"][0])


def _expected_labels(tok, ids, conversation, end_of_turn):
    """-100 except where each assistant text's own tokens (+ the end-of-turn token) are found in ``ids``."""
    labels = [-100] * len(ids)
    at = 0
    eot = [tok.convert_tokens_to_ids(end_of_turn)] if end_of_turn else []
    for m in conversation:
        if m["role"] != "assistant":
            continue
        text = m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
        for variant in (text, " " + text):  # the space before the text merges into its first token
            needle = tok(variant, add_special_tokens=False)["input_ids"] + eot
            hit = next(
                (i for i in range(at, len(ids) - len(needle) + 1) if ids[i : i + len(needle)] == needle), None
            )
            if hit is not None:
                break
        assert hit is not None, f"assistant text {text!r} not found in the oracle ids"
        labels[hit : hit + len(needle)] = needle
        at = hit + len(needle)
    return labels


FAMILIES = _params(END_OF_TURN)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_released_template_gives_the_processors_ids_spans_and_forecast(family):
    proc = _processor(family)
    tok = proc.tokenizer
    cases = [(MULTI if family != "llava_next" else MULTI[1:], IMAGES), (SINGLE, IMAGES[:1])]
    for conversation, images in cases:
        text, ref = _oracle(proc, conversation, images)
        s = process_sample(images, conversation, processor=proc, key="shard-0/k")
        assert s["input_ids"].tolist() == ref
        assert s["labels"].tolist() == _expected_labels(tok, ref, conversation, END_OF_TURN[family])
        length, counts = forecast_length(
            conversation, [im.size for im in images], processor=proc, key="shard-0/k"
        )
        assert length == len(ref)
        assert counts == s["tokens_per_image"].tolist()
        if family in ("qwen2_vl", "qwen2_5_vl") and conversation is SINGLE:
            assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
        if tok.bos_token and text.startswith(tok.bos_token):  # Idefics3, SmolVLM, Gemma 3, Mistral 3, LFM2-VL
            assert ref[0] == tok.bos_token_id and ref[1] != tok.bos_token_id


def test_qwen_tokenizer_template_with_image_processor_equals_the_processor_path():
    """A tokenizer carrying the template (no processor) renders the same prompt: same ids and labels."""
    proc = _processor("qwen2_vl")
    tok = offline.build_tokenizer("qwen2_vl", chat_template=proc.chat_template)
    a = process_sample(IMAGES, MULTI, processor=proc)
    b = process_sample(IMAGES, MULTI, tokenizer=tok, image_processor=proc.image_processor)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    n, _ = forecast_length(
        MULTI, [im.size for im in IMAGES], tokenizer=tok, image_processor=proc.image_processor
    )
    assert n == len(b["input_ids"])


def test_template_that_rewrites_earlier_turns_around_their_text_gets_spans_from_the_whole_rendering():
    # Like reasoning templates that rewrite earlier assistant turns: here they get an "(earlier) " mark, so
    # render(messages[:i]) is no prefix of the whole; the texts themselves are copied, and found there.
    template = (
        "{% for m in messages %}{% set is_last = loop.last %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not is_last %}(earlier) {% endif %}{% for p in m['content'] %}"
        "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
        "{% endfor %}<|im_end|>\n{% endfor %}"
    )
    tok = offline.build_tokenizer("qwen2_vl", chat_template=template)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
    ids, mask = tokenize_conversation(conv, tokenizer=tok, key="k/7")
    assert tok.decode(ids).count("(earlier) hello") == 1
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "hello<|im_end|>hello<|im_end|>"


def test_template_that_rewrites_earlier_texts_is_refused_naming_the_sample():
    # Earlier assistant texts written twice once later turns follow: no span is the text as given.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
        "{% if m['role'] == 'assistant' and not loop.last %} {{ m['content'][0]['text'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}"
    )
    tok = offline.build_tokenizer("qwen2_vl", chat_template=template)
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
    with pytest.raises(ValueError, match=r"sample 'k/7'.*not a prefix.*Pass template="):
        tokenize_conversation(conv, tokenizer=tok, key="k/7")


def test_template_that_drops_text_is_refused():
    """Mistral 3's template renders only the first text part of an assistant message: no silent loss."""
    proc = _processor("mistral3")
    conv = [
        {"role": "user", "content": "Describe."},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
    ]
    with pytest.raises(ValueError, match=r"sample 'x'.*drops text of message 1"):
        process_sample([], conv, processor=proc, key="x")


def test_string_content_is_given_to_parts_templates_as_parts():
    """llava-hf templates drop plain-string content; vlm-pack hands it over as a text part instead."""
    proc = _processor("llava")
    conv = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "a cat"}]
    s = process_sample([], conv, processor=proc)
    text = proc.tokenizer.decode(s["input_ids"])
    assert "What is it?" in text and "a cat" in text
    assert proc.tokenizer.decode(s["labels"][s["labels"] != -100]) == " a cat"


def test_text_only_template_takes_strings():
    """A tokenizer template that concatenates string content (ChatML) still gets its images and spans."""
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
    )
    tok = offline.build_tokenizer("qwen2_vl", chat_template=template)
    conv = [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "the cat"}]
    ids, mask = tokenize_conversation(conv, tokenizer=tok, num_images=1)
    expected = "<|im_start|>user\n<|image_pad|>Hi<|im_end|>\n<|im_start|>assistant\nthe cat<|im_end|>\n"
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "the cat<|im_end|>"


@pytest.mark.parametrize("family, ok", [("internvl", True), ("idefics3", False)])
@pytest.mark.slow
def test_collapsed_layout_keeps_one_token_per_image_where_the_family_has_one_run(family, ok):
    proc = _processor(family)
    if not ok:
        with pytest.raises(ValueError, match="layout='expanded'"):
            process_sample(IMAGES, MULTI, processor=proc, layout="collapsed")
        return
    e = process_sample(IMAGES, MULTI, processor=proc)
    c = process_sample(IMAGES, MULTI, processor=proc, layout="collapsed")
    image_id = proc.image_token_id
    assert int((c["input_ids"] == image_id).sum()) == len(IMAGES)
    assert len(c["input_ids"]) == len(e["input_ids"]) - int(e["tokens_per_image"].sum()) + len(IMAGES)
    assert torch.equal(c["labels"][c["labels"] != -100], e["labels"][e["labels"] != -100])


@pytest.mark.parametrize("family", _params(offline.FAMILIES))
@pytest.mark.slow
def test_offline_tiny_model_runs_a_processed_sample(family):
    """Every family's genuine transformers class, built from a tiny config, reads what process_sample gives."""
    _needs_torchvision(family, model=True)
    path = TEMPLATES / f"{family}.jinja"  # Qwen3-VL: vlm-pack's own Qwen format
    template = path.read_text() if path.exists() else None
    tok = offline.build_tokenizer(family)
    small = {  # fewer crops keep this forward quick; the rules are checked above at checkpoint settings
        "idefics3": dict(size={"longest_edge": 364}),
        "smolvlm": dict(size={"longest_edge": 384}),
        "internvl": dict(max_patches=2),
    }
    proc = offline.processor(family, tok, chat_template=template, **small.get(family, OVERRIDES.get(family, {})))
    model = offline.tiny_model(family, tok)
    conv = [
        {"role": "user", "content": "<image>What is it?"},
        {"role": "assistant", "content": "a red square"},
    ]
    s = process_sample([_img(100, 75)], conv, processor=proc)
    inputs = {k: v for k, v in s.items() if k not in ("labels", "tokens_per_image")}
    inputs = {
        k: v.unsqueeze(0) if k in ("input_ids", "mm_token_type_ids", "token_type_ids") else v
        for k, v in inputs.items()
    }
    with torch.no_grad():
        out = model(**inputs, labels=s["labels"].unsqueeze(0))
    assert out.logits.shape[:2] == (1, len(s["input_ids"]))
    assert torch.isfinite(out.loss)
    config = model.config
    image_id = getattr(config, "image_token_id", None) or config.image_token_index
    assert int((s["input_ids"] == image_id).sum()) == int(s["tokens_per_image"].sum())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_forecast_sources_with_the_processor_gives_the_processors_lengths(family, tmp_path):
    """A dataset forecast with the checkpoint's processor (its template, its image wrappers) before any pixel
    is decoded: every record's length is transformers' own, for families whose processor wraps each image
    in marker tokens (InternVL, Idefics3, SmolVLM, Gemma 3) as for the others."""
    import json

    from vlm_pack import Preprocessor, forecast_sources

    proc = _processor(family)
    for i, im in enumerate(IMAGES):
        im.save(tmp_path / f"{i}.png")
    cases = [(MULTI if family != "llava_next" else MULTI[1:], ["0.png", "1.png"]), (SINGLE, ["0.png"])]
    lines = [{"key": f"k{i}", "images": names, "conversation": conv} for i, (conv, names) in enumerate(cases)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = forecast_sources(str(tmp_path / "data.jsonl"), preprocessor=Preprocessor(processor=proc), progress=False)
    expected = [len(_oracle(proc, conv, [IMAGES[int(n[0])] for n in names])[1]) for conv, names in cases]
    assert table.lengths.tolist() == expected
    per_image = [process_sample(IMAGES[: len(names)], conv, processor=proc)["tokens_per_image"] for conv, names in cases]
    assert table.image_tokens.tolist() == torch.cat(per_image).tolist()


def test_qwen3_5_thinking_blocks_as_its_template_writes_them():
    """Qwen3.5's template writes an empty ``<think>`` block into the assistant turns after the last user query
    only (earlier turns lose theirs); the ids are transformers' rendering and only the answers are trained."""
    proc = _processor("qwen3_5")
    tok = proc.tokenizer
    text, ref = _oracle(proc, MULTI, IMAGES)
    assert text.count("<think>\n\n</think>\n\n") == 1 and text.endswith("<think>\n\n</think>\n\nthree cats<|im_end|>\n")
    assert "assistant\nthe dog is left<|im_end|>" in text  # the earlier turn: no think block
    s = process_sample(IMAGES, MULTI, processor=proc)
    assert s["input_ids"].tolist() == ref
    trained = tok.decode(s["labels"][s["labels"] != -100])
    assert trained == "the dog is left<|im_end|>three cats<|im_end|>"
    think = tok.convert_tokens_to_ids("<think>")
    assert think in ref and s["labels"][s["input_ids"] == think].eq(-100).all()  # the block is prompt


def test_gemma4_turns_as_its_template_writes_them():
    """Gemma 4's template (rules of the released file: tests/templates/README.md) puts ``<|think|>\\n`` at the
    top of a system turn when thinking is on, writes each image as ``\\n\\n<|image|>\\n\\n`` (which
    ``Gemma4Processor`` expands), and strips a ``<|channel>thought ...<channel|>`` block from model turns: such
    a reply's text would be rewritten, so vlm-pack refuses it naming the sample instead of training on it."""
    from vlm_pack.failures import SampleError

    proc = _processor("gemma4")
    tok = proc.tokenizer
    text, ref = _oracle(proc, MULTI, IMAGES)
    assert text.startswith("<bos><|turn>system\nYou are helpful.<turn|>\n<|turn>user\n\n\n<|image|>\n\nWhat is")
    s = process_sample(IMAGES, MULTI, processor=proc)
    assert s["input_ids"].tolist() == ref
    assert tok.decode(s["labels"][s["labels"] != -100]) == "the dog is left<turn|>three cats<turn|>"
    thinking = ProcessorMixin.apply_chat_template(proc, MULTI[1:2], enable_thinking=True)
    assert thinking.startswith("<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\n")
    thought = [MULTI[1], {"role": "assistant", "content": "<|channel>thought\nhm<channel|>the dog is left"}]
    with pytest.raises((ValueError, SampleError), match="shard-0/t"):
        process_sample(IMAGES[:1], thought, processor=proc, key="shard-0/t")
