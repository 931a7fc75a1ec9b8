"""A family name in any spelling names one family at every entry point, or is refused with the known names.

``"qwen2vl"``, ``"Qwen2-VL"`` and ``"QWEN2_VL"`` are ``"qwen2_vl"``: the collator, the Preprocessor, the
processing functions, the position ids and the CLI give what the canonical name gives (4-row mRoPE position
ids for Qwen, Gemma 3's packed masks). A name vlm-pack does not know raises a ValueError listing the known
ones; a config's ``model_type`` vlm-pack has no rule for keeps 1-D positions, as documented.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from vlm_pack import Preprocessor
from vlm_pack.cli.main import main
from vlm_pack.collate.collator import PackingCollator
from vlm_pack.collate.positions import packed_position_ids
from vlm_pack.families import FAMILIES, canonical
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.processing import forecast_length, process_sample, tokenize_conversation

QWEN_SPELLINGS = ["qwen2vl", "Qwen2-VL", "QWEN2_VL", " qwen2.vl ", "Qwen2_VL"]
CAPACITY = 128


def _conversation(answer: str, images: int) -> list[dict]:
    user = [{"type": "image"}] * images + [{"type": "text", "text": "what is this?"}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


@pytest.fixture(scope="module")
def qwen_samples(qwen):
    tok, ip = qwen
    images = [
        Image.effect_noise((70, 56), 40).convert("RGB"),
        Image.effect_noise((56, 84), 50).convert("RGB"),
    ]
    return [
        process_sample(images[:1], _conversation("a cat", 1), tokenizer=tok, image_processor=ip),
        process_sample(images, _conversation("two dogs and a ball", 2), tokenizer=tok, image_processor=ip),
        process_sample([], _conversation("nothing", 0), tokenizer=tok, image_processor=ip),
    ]


def _same_batch(a, b) -> None:
    assert a.family == b.family
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif f.name not in ("metadata",):
            assert x == y, f.name


@pytest.mark.parametrize("spelling", QWEN_SPELLINGS)
def test_the_collator_gives_qwen_mrope_for_every_spelling(qwen, qwen_samples, spelling):
    tok, _ = qwen
    canonical = PackingCollator(CAPACITY, family="qwen2_vl", tokenizer=tok)(qwen_samples)
    spelled = PackingCollator(CAPACITY, family=spelling, tokenizer=tok)(qwen_samples)
    assert canonical.position_ids.shape == (4, 1, CAPACITY)  # text row + 3 mRoPE rows
    _same_batch(spelled, canonical)
    assert spelled.family == "qwen2_vl"
    inputs = spelled.model_inputs("sdpa")
    assert inputs["position_ids"].shape == (4, 1, CAPACITY) and "mm_token_type_ids" in inputs


@pytest.mark.parametrize("spelling", QWEN_SPELLINGS)
def test_the_preprocessor_and_processing_functions_take_every_spelling(qwen, qwen_samples, spelling):
    tok, ip = qwen
    image = Image.effect_noise((70, 56), 40).convert("RGB")
    conversation = _conversation("a cat", 1)
    pre, ref = Preprocessor(tok, ip, family=spelling), Preprocessor(tok, ip, family="qwen2_vl")
    assert pre.family == "qwen2_vl"
    assert pre.forecast(conversation, [(70, 56)]) == ref.forecast(conversation, [(70, 56)])
    out = pre.process([image], conversation)
    assert torch.equal(out["input_ids"], ref.process([image], conversation)["input_ids"])
    _same_batch(pre.collator(CAPACITY)(qwen_samples), ref.collator(CAPACITY)(qwen_samples))
    # the functions, on a tokenizer that does not say its family: the name alone picks the chat format
    bare = build_tokenizer("qwen2_vl")
    del bare.vlm_pack_family
    assert tokenize_conversation(conversation, tokenizer=bare, family=spelling, num_images=1) == (
        tokenize_conversation(conversation, tokenizer=bare, family="qwen2_vl", num_images=1)
    )
    sample = process_sample([image], conversation, tokenizer=bare, image_processor=ip, family=spelling)
    assert torch.equal(sample["input_ids"], out["input_ids"])
    spec = pre.spec
    assert forecast_length(conversation, [(70, 56)], tokenizer=bare, spec=spec, family=spelling)[0] == len(
        out["input_ids"]
    )


@pytest.mark.parametrize("spelling", ["Gemma-3", "GEMMA3", "gemma_3"])
def test_gemma3_spelled_otherwise_still_gets_its_packed_masks(spelling):
    tok = build_tokenizer("gemma3")
    samples = [{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}]
    batch = PackingCollator(16, family=spelling, tokenizer=tok, sliding_window=4)(samples)
    assert batch.family == "gemma3" and batch.attention_masks() is not None
    with pytest.raises(ValueError, match="sliding_window"):  # Gemma 3's own check runs on any spelling
        PackingCollator(16, family=spelling, tokenizer=tok)


@pytest.mark.parametrize("spelling", ["Qwen2-VL", "qwen2vl"])
def test_position_ids_take_every_spelling(qwen, qwen_samples, spelling):
    tok, _ = qwen
    s = qwen_samples[1]
    cu = torch.tensor([0, s["input_ids"].numel()])
    kw = dict(image_grid_thw=s["image_grid_thw"], image_token_id=tok.image_token_id)
    spelled = packed_position_ids(s["input_ids"][None], cu, family=spelling, **kw)
    canonical = packed_position_ids(s["input_ids"][None], cu, family="qwen2_vl", **kw)
    assert spelled.shape[0] == 4 and torch.equal(spelled, canonical)


def test_the_cli_takes_every_spelling_and_refuses_unknown_names(tmp_path, capsys):
    from vlm_pack.demo import demo_shards

    shard = str(demo_shards()[0])
    outs = []
    for name in ("qwen2_vl", "qwen2vl", "Qwen2-VL"):
        code = main(["analyze", shard, "--family", name, "--capacity", "8192", "--json", "--no-plots",
                     "--out", str(tmp_path / name)])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        outs.append(json.loads(capsys.readouterr().out))
    assert {o["family"] for o in outs} == {"qwen2_vl"}
    assert outs[0]["capacities"] == outs[1]["capacities"] == outs[2]["capacities"]
    with pytest.raises(SystemExit) as exc:
        main(["analyze", shard, "--family", "qwen2_vll"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unknown VLM family 'qwen2_vll'" in err and "qwen2_5_vl" in err


@pytest.mark.parametrize(
    "make",
    [
        lambda tok, ip: PackingCollator(CAPACITY, family="qwen2_vll", tokenizer=tok),
        lambda tok, ip: Preprocessor(tok, ip, family="Qwen-2VL-Instruct"),
        lambda tok, ip: process_sample(
            [], _conversation("x", 0), tokenizer=tok, image_processor=ip, family="blip2"
        ),
        lambda tok, ip: tokenize_conversation(_conversation("x", 0), tokenizer=tok, family="qwen"),
        lambda tok, ip: packed_position_ids(torch.tensor([[1, 2]]), torch.tensor([0, 2]), family="qwen-vl"),
    ],
    ids=["collator", "preprocessor", "process_sample", "tokenize_conversation", "packed_position_ids"],
)
def test_an_unknown_name_is_refused_with_the_known_ones(qwen, make):
    with pytest.raises(
        ValueError, match=r"unknown VLM family .*known families: qwen2_vl, qwen2_5_vl, .*gemma3"
    ):
        make(*qwen)


def test_a_config_model_type_without_a_rule_keeps_1d_positions(qwen_samples):
    """The documented default: a model vlm-pack has no rule for (here a text model's config) is not refused."""
    tok = build_tokenizer("llava")
    samples = [{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}]
    batch = PackingCollator(16, model_config=SimpleNamespace(model_type="llama"), tokenizer=tok)(samples)
    assert batch.position_ids.shape == (1, 16) and batch.family == "llama"
    qwen_config = SimpleNamespace(model_type="qwen2_vl", image_token_id=None)
    assert PackingCollator(16, model_config=qwen_config, tokenizer=build_tokenizer("qwen2_vl")).mrope


def test_every_family_table_uses_the_canonical_names():
    """The registry (and the offline stand-ins' table) holds only canonical names, so one normaliser serves all."""
    from vlm_pack.offline.tokenizers import _FAMILY_TOKENS

    assert all(name == record.name for name, record in FAMILIES.items())
    assert set(_FAMILY_TOKENS) <= set(FAMILIES), set(_FAMILY_TOKENS) - set(FAMILIES)
    for name in FAMILIES:
        assert canonical(name) == name == canonical(name.upper().replace("_", "-"))
    assert canonical("Qwen2.5-VL") == "qwen2_5_vl" and canonical("llava-1.6") == "llava_next"
    assert canonical(None) is None


def _spellings(name: str) -> list[str]:
    """The canonical name, its release names and odd spellings of both: each must name the same family."""
    aliases = FAMILIES[name].aliases
    odd = [name.upper().replace("_", "-"), f" {name.replace('_', '.').title()} "]
    return [name, *odd, *aliases, *(a.lower().replace(".", "_").replace("-", " ") for a in aliases)]


def _experts_mask_mapping() -> bool:
    """Whether the installed transformers' MoE models take the mask mapping (``_compat.EXPERTS_MASK_MAPPING``)."""
    from vlm_pack._compat import EXPERTS_MASK_MAPPING, installed_transformers_version, release

    version = installed_transformers_version()
    return version is None or release(version)[:2] >= EXPERTS_MASK_MAPPING


def _input_keys(batch) -> object:
    """``model_inputs("sdpa")``'s keys, or the message of the error it raises (the same for every spelling)."""
    try:
        return batch.model_inputs("sdpa").keys()
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_and_alias_gives_the_same_at_every_entry_point(qwen, name):
    """Each registered family, by any name, reaches every entry point that takes a family as its record says:
    the canonical name, the vision spec, the chat format, 1-D or 4-row position ids, Gemma 3's masks."""
    from vlm_pack.cli.main import _family_name
    from vlm_pack.collate.positions import is_mrope_family
    from vlm_pack.families import family
    from vlm_pack.processing.chat import chat_format
    from vlm_pack.vision import vision_spec

    tok, _ = qwen
    record = FAMILIES[name]
    samples = [{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}]
    # Gemma 4 reads whether its images attend both ways from the model config (nothing else tells)
    config = SimpleNamespace(**dict([record.two_way_switch])) if record.two_way_switch else None
    reference = PackingCollator(16, family=name, sliding_window=4, model_config=config)(samples)
    rows = (4, 1, 16) if record.mrope else (1, 16)
    assert reference.position_ids.shape == rows
    if record.experts and not _experts_mask_mapping():  # its model takes no mask mapping: named, not deep inside
        with pytest.raises(ValueError, match=r"need transformers >= "):
            reference.attention_masks()
    else:
        assert (reference.attention_masks() is not None) == (record.two_way_images or record.experts)
    for spelling in _spellings(name):
        assert canonical(spelling) == name and family(spelling) is record and _family_name(spelling) == name
        assert Preprocessor(tok, family=spelling).family == name
        assert is_mrope_family(spelling) == (record.mrope is not None)
        batch = PackingCollator(16, family=spelling, sliding_window=4, model_config=config)(samples)
        _same_batch(batch, reference)
        respelled = dataclasses.replace(reference, family=spelling)  # a PackedBatch normalises its own
        assert respelled.family == name and _input_keys(respelled) == _input_keys(reference)
        ids, cu = torch.tensor([[1, 2, 3, 4]]), torch.tensor([0, 2, 4])
        positions = packed_position_ids(ids, cu, family=spelling, image_token_id=99)  # text only
        assert positions.shape == ((4, 1, 4) if record.mrope else (1, 4))
        if record.two_way_images:
            with pytest.raises(ValueError, match="sliding_window"):
                PackingCollator(16, family=spelling)
        if record.vision is not None:
            assert vision_spec(spelling) == record.vision() and vision_spec(spelling).family == name
        else:
            with pytest.raises(ValueError, match=f"no vision spec for family '{name}'"):
                vision_spec(spelling)
        if record.chat_format is not None:
            assert chat_format(spelling) is chat_format(name) and chat_format(name).name == record.chat_format
        else:
            with pytest.raises(ValueError, match=f"no chat format for family '{name}'"):
                chat_format(spelling)
