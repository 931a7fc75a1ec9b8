"""Model types without a record (``vlm_pack.model_types``): packed = alone on tiny genuine models of the type's
own config with its real processor, refused types refused by name, and docs/families.md covering every
image-text-to-text model type of the installed transformers exactly once.

The oracle is each sample run alone through the model as its processor gave it (the model computing its own
positions, mRoPE included); the packed row is what ``PackingCollator`` makes of the processor's outputs. The
full sweep is ``scripts/families_table.py`` (every type, a process each); here a representative subset: a 1-D
type on the Qwen-VL image processor, a type whose model computes mRoPE (its own rope index per sample), and one
with its own processor and a tiled image layout.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from vlm_pack import PackingCollator
from vlm_pack._compat import installed_transformers_version, release
from vlm_pack.families import FAMILIES, lookup
from vlm_pack.model_types import REFUSED, RopeIndex, check_not_refused, find_rope_index, refused_on
from vlm_pack.offline.model_types import image_text_to_text_types, processor_for_type, tiny_model_for_type
from vlm_pack.testing.model_types import TOLERANCE, certify_model_type, type_samples

DOC = Path(__file__).parents[1] / "docs" / "families.md"


def _needs_types(*model_types: str) -> None:
    """Skip where the installed transformers has no such model type (the matrix's older releases)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    missing = [t for t in model_types if t not in CONFIG_MAPPING_NAMES]
    if missing:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no model type {', '.join(missing)}")


#: Types whose certificate (docs/families.md, transformers 5.25.0) holds from a release on: that release, and what
#: the matrix's older releases do instead (measured; each fails loudly there, never a silent pass).
CERTIFIED_FROM = {
    "qwen2_5_omni_thinker": ((5, 24), "5.6.0 / 5.18.0: Qwen2_5OmniProcessor does not process images without its "
                                      "video processor ('NoneType' object has no attribute 'merge_size')"),
    "got_ocr2": ((5, 18), "5.6.0: its processor writes 2 image tokens where its model gives 512 features "
                          "(the forward refuses: 'Image features and image tokens do not match')"),
    "granite4_vision": ((5, 24), "5.18.0: its text config there has no attention_multiplier (the tiny model does "
                                 "not build)"),
    "minicpmv4_6": ((5, 24), "5.18.0: its vision tower's reshape differs (the forward fails on the joined row)"),
    "ovis2": ((5, 18), "5.6.0: its processor writes no image token the tiny model's config names (the collator "
                       "refuses the samples: 'no image token in input_ids')"),
    "fast_vlm": ((5, 18), "5.6.0: the tiny model does not build (ValueError: Either a revision or a version must "
                          "be specified)"),
}
#: (type, release) pairs a type's certificate skips: a release that broke the model itself (loud, not packing's).
NOT_ON = {
    ("llama4", (5, 24)): "transformers 5.24.0's Llama4ForConditionalGeneration fails its own forward "
                         "('MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'); 5.18, 5.25 certify",
}


def _needs_certified_release(model_type: str) -> None:
    """Skip where the installed transformers is older than the release ``model_type``'s certificate holds from, or
    is one it skips (:data:`NOT_ON`)."""
    version = installed_transformers_version()
    if model_type in CERTIFIED_FROM:
        since, older = CERTIFIED_FROM[model_type]
        if release(version)[:2] < since:
            pytest.skip(f"{model_type} is certified from transformers {since[0]}.{since[1]} (installed {version}); {older}")
    if (model_type, release(version)[:2]) in NOT_ON:
        pytest.skip(NOT_ON[model_type, release(version)[:2]])


@pytest.mark.parametrize("model_type", ["exaone4_5", "paddleocr_vl", "lfm3_vl", "qwen4_exp"])
def test_a_model_type_without_a_record_packs_as_each_sample_alone(model_type):
    """sdpa and eager: three samples (two images, one, none) in one row, each scored against itself alone
    (LFM3-VL: its text model's short convolutions isolated at the first packed call by the packed-call guard,
    recognising the rows by their positions: no marker, no manual call; its tower's convolutions
    run on the row's three images in one call, each over its own patch grid, so they need no isolating: a tower
    that convolved the flat patch sequence would carry one image into the next and fail here. Qwen4-Exp: gated
    delta-net layers isolated, its indexed attention selecting within a budget below each sample's length)."""
    _needs_types(model_type)
    assert lookup(model_type) is None and refused_on(model_type) is None
    cert = certify_model_type(model_type)
    assert cert.exact, str(cert)
    assert set(cert.errors) == {"sdpa", "eager"} and all(e <= TOLERANCE for e in cert.errors.values())
    assert cert.tokens > 100
    if model_type == "lfm3_vl":
        assert cert.mixers and all("short_conv" in m for m in cert.mixers)
        from vlm_pack.offline.model_types import tiny_config_for_type

        assert "conv" in tiny_config_for_type("lfm3_vl").vision_config.layer_types  # the tower's convolutions ran
    if model_type == "qwen4_exp":
        assert cert.mixers and all("gated_delta_net" in m for m in cert.mixers)


# a representative subset of the types certified in docs/families.md (scripts/families_table.py certifies them all):
# Granite 4 Vision (a config the shrink completes: window Q-Former, deepstack), the Qwen2.5-Omni thinker (the
# omni processor its checkpoints ship, its own rope index), GOT-OCR2 (once read as InternVL by an alias: its own
# model, eager only), Granite-Docling (Idefics3's tiles with a mask entry per tile [1, N], joined on the tile axis),
# Mistral Large 3 (Pixtral images of different sizes, a 2 x 2 patch merger), Ovis2 (image atoms and visual indicator
# tokens; its forecast is refused by name at start-up: its image token is not in its own replacement text)
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["idefics2", "ernie4_5_vl_moe", "video_llava", "glm_ocr", "granite4_vision",
                                        "qwen2_5_omni_thinker", "got_ocr2", "granite_docling", "mistral_large4", "ovis2"])
def test_more_model_types_pack_as_each_sample_alone(model_type):
    _needs_types(model_type)
    _needs_certified_release(model_type)
    cert = certify_model_type(model_type)
    if not cert.built and "needs torchvision" in (cert.reason or ""):  # an older release's image processor
        pytest.skip(cert.reason)
    assert cert.exact, str(cert)


# Types whose image (or video) processor transformers ships as a torchvision class only. Nemotron-H Omni: Mamba2
# text layers isolated; MiniCPM-V 4.6: gated delta-net text layers isolated, its NaViT-packed pixel_values [1, C, p, p * patches] joined on the last axis
# (the model reads pixel_values[:1]); Molmo2: crops [N_i, P, D] of different N; Llama 4 and Step3.7: configs the
# shrink completes (the pixel-shuffle adapter; a sliding layer), Kimi-K2.5: multi-head latent attention; FastVLM:
# timm's FastViTHD tower as released (timm needs torchvision) behind the LlavaProcessor transformers' conversion
# ships (patch_size 64), no processor being mapped to the type.
@pytest.mark.torchvision
@pytest.mark.parametrize("model_type", ["minicpmv4_6", "nemotron_h_omni", pytest.param("molmo2", marks=pytest.mark.slow),
                                        pytest.param("llama4", marks=pytest.mark.slow),
                                        pytest.param("step3p7", marks=pytest.mark.slow),
                                        pytest.param("kimi_k25", marks=pytest.mark.slow),
                                        pytest.param("fast_vlm", marks=pytest.mark.slow)])
def test_model_types_with_torchvision_processors_pack_as_each_sample_alone(model_type):
    pytest.importorskip("torchvision")
    _needs_types(model_type)
    _needs_certified_release(model_type)
    if refused_on(model_type) is not None:  # before the release it packs exactly from
        with pytest.raises(ValueError, match=rf"does not pack model type '{model_type}'"):  # not packed silently
            check_not_refused(model_type)
        return
    cert = certify_model_type(model_type)
    assert cert.exact, str(cert)
    assert set(cert.errors) == {"sdpa", "eager"}
    if model_type == "minicpmv4_6":
        assert cert.mixers and all("gated_delta_net" in m for m in cert.mixers)
    if model_type == "nemotron_h_omni":  # Mamba2 text layers, isolated at the first packed call
        assert cert.mixers and all("mamba2" in m for m in cert.mixers)


@pytest.mark.parametrize("model_type", ["exaone4_5", "paddleocr_vl"])
def test_the_check_fails_when_the_positions_do_not_restart(model_type):
    """The negative control: the text row numbered across the whole row makes transformers see one sequence,
    so the samples attend to each other (1-D and mRoPE alike), and the certificate says so."""
    _needs_types(model_type)
    cert = certify_model_type(model_type, restart_positions=False)
    assert not cert.exact and min(cert.errors.values()) > 1.01, str(cert)
    assert "packed != alone" in (cert.reason or "")


def test_the_rope_index_is_the_models_own_per_sample_and_survives_a_worker():
    """PaddleOCR-VL's packed rows: a text arange per sample, then the rows its model's get_rope_index gives each
    sample alone; the RopeIndex pickled into a DataLoader worker (rebuilt on the meta device) gives the same."""
    _needs_types("paddleocr_vl")
    processor = processor_for_type("paddleocr_vl")
    model = tiny_model_for_type("paddleocr_vl", processor)
    owner = find_rope_index(model)
    assert owner is not None
    samples = type_samples(processor)
    total = sum(s["input_ids"].shape[-1] for s in samples)
    collator = PackingCollator(total + 7, model_config=model.config, tokenizer=processor, rope_index=RopeIndex(owner))
    batch = collator(samples)
    assert batch.position_ids.shape == (4, 1, total + 7)
    starts = batch.cu_seqlens_padded.tolist()
    for slot, k in enumerate(batch.sample_index.tolist()):
        s = samples[k]
        length = s["input_ids"].shape[-1]
        got = batch.position_ids[:, 0, starts[slot] : starts[slot] + length]
        own, _ = owner.get_rope_index(s["input_ids"], mm_token_type_ids=s["mm_token_type_ids"],
                                      image_grid_thw=s.get("image_grid_thw"))
        assert torch.equal(got[0], torch.arange(length))
        assert torch.equal(got[1:], own[:, 0])
    worker = pickle.loads(pickle.dumps(collator))
    assert torch.equal(worker(samples).position_ids, batch.position_ids)


@pytest.mark.parametrize("model_type", sorted(t for t, refusal in REFUSED.items() if refusal.packs_from is None))
def test_a_refused_model_type_is_refused_by_name_when_the_collator_is_built(model_type):
    _needs_types(model_type)
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match=rf"does not pack model type '{model_type}': .*docs/families.md"):
        PackingCollator(1024, model_config=config)
    with pytest.raises(ValueError, match=rf"'{model_type}'"):
        PackingCollator(1024, family=None, model_config=config, max_rows=None)


def test_a_model_type_is_refused_before_the_release_it_packs_exactly_from():
    """Molmo2 packs exactly on 5.25 and not on 5.24 (measured): a collator for it is refused by name there, with
    the release to move to, and built on 5.25."""
    since = REFUSED["molmo2"].packs_from
    older, newer = f"{since[0]}.{since[1] - 1}.0", f"{since[0]}.{since[1]}.0"
    with pytest.raises(ValueError, match=rf"'molmo2': .*installed: transformers {older}; upgrade to >= 5\.25"):
        check_not_refused("molmo2", version=older)
    check_not_refused("molmo2", version=newer)
    check_not_refused("qwen2_vl", version=older)  # a record: never refused here


def _table_rows() -> dict[str, list[str]]:
    text = DOC.read_text()
    begin = text.index("<!-- model-types:begin")
    end = text.index("<!-- model-types:end -->")
    rows: dict[str, list[str]] = {}
    for line in text[begin:end].splitlines():
        match = re.match(r"^\| `([^`]+)` \|", line)
        if match:
            rows.setdefault(match.group(1), []).append(line)
    return rows


def test_the_model_type_table_lists_every_image_text_to_text_type_of_the_installed_transformers_once():
    """The table is generated on the lock's release (constraints/ci.txt) and lists each of its types once; on
    another release (the compatibility matrix) the installed list differs and only the rest is checked."""
    import transformers

    rows = _table_rows()
    table = re.search(r"image-text-to-text model type of transformers (\S+) ", DOC.read_text()).group(1)
    lock = re.search(r"^transformers==(\S+)$", (DOC.parents[1] / "constraints" / "ci.txt").read_text(), re.M)
    assert table == lock.group(1), f"docs/families.md's table is for {table}, the lock's is {lock.group(1)}: " \
        "run scripts/families_table.py on the lock's release"
    if transformers.__version__ == table:
        assert sorted(rows) == sorted(image_text_to_text_types()), (
            "docs/families.md's model-type table is for another transformers release: run scripts/families_table.py"
        )
    assert all(len(lines) == 1 for lines in rows.values()), [t for t, lines in rows.items() if len(lines) > 1]
    for model_type, (line,) in rows.items():
        route = line.split("|")[3].strip()
        if model_type in FAMILIES:
            assert route.startswith("named record"), line
        elif refused_on(model_type, version=table) is not None:
            assert route == "refused", line
        else:
            assert route in ("generic, certified", "not certified here") or route.startswith("named record"), line
    certified = [t for t, (line,) in rows.items() if "generic, certified" in line]
    assert len(certified) >= 20, certified


def _example():
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "check_equivalence.py"
    spec = importlib.util.spec_from_file_location("example_check_equivalence", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_the_example_certifies_a_model_type_and_says_why_not(capsys):
    """``examples/check_equivalence.py --model-type TYPE``: exit 0 and EXACT for a certified type; exit 1 with
    the reason for a refused one (HunYuanVL: its model takes no text row beside its rope rows)."""
    _needs_types("exaone4_5", "hunyuan_vl", "lfm3_vl")
    example = _example()
    assert example.main(["--model-type", "exaone4_5"]) == 0
    out = capsys.readouterr().out
    assert "exaone4_5: EXACT" in out and "sdpa 1.0000" in out and "eager 1.0000" in out
    assert example.main(["--model-type", "hunyuan_vl"]) == 1
    out = capsys.readouterr().out
    assert "hunyuan_vl: NOT EXACT" in out and "does not pack model type 'hunyuan_vl'" in out
    assert example.main(["--model-type", "lfm3_vl"]) == 0  # its short convolutions isolated per sample (issue 40)
    out = capsys.readouterr().out
    assert "lfm3_vl: EXACT" in out and "short_conv" in out


def test_a_model_type_whose_model_computes_mrope_needs_its_rope_index():
    """Without ``rope_index=``, PaddleOCR-VL's rows would get 1-D ids (its images' mRoPE silently lost): refused,
    naming the model's function; EXAONE 4.5 (image grids, but 1-D positions: its get_rope_index only raises)
    and a record's own mRoPE family need none, and a record's family refuses one."""
    _needs_types("paddleocr_vl", "exaone4_5")
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=r"'paddleocr_vl' computes multimodal RoPE \(PaddleOCRVLModel.get_rope_index\)"):
        PackingCollator(1024, model_config=AutoConfig.for_model("paddleocr_vl"))
    PackingCollator(1024, model_config=AutoConfig.for_model("exaone4_5"))
    with pytest.raises(ValueError, match="has its own mRoPE"):
        PackingCollator(1024, family="qwen2_vl", rope_index=lambda ids, inputs: ids[None])
