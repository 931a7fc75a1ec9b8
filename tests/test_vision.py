"""vlm_pack.vision token rules against the real transformers processors (image_size: test_image_size.py).

Each family is checked two ways:
- a sweep of >= 1,000 sizes (1..8,000 px a side, extreme aspect ratios, rounding boundaries) against the
  processor's own pure size functions (``get_number_of_image_patches``, ``_get_num_multimodal_tokens``,
  ``select_best_resolution`` + ``_get_number_of_features``, ...), with the released checkpoint's parameters
  passed explicitly and with non-default ones; where the processor raises, the spec must raise ValueError;
- a smaller set of real PIL images run through the full preprocessing (and, where the processor can be
  built without torchvision, through ``processor(text=..., images=...)``), whose grid / crops / tokens in
  ``input_ids`` must equal the forecast.
"""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from transformers import (
    Gemma3ImageProcessorPil,
    Glm4vImageProcessorPil,
    GotOcr2ImageProcessorPil,
    LlavaImageProcessorPil,
    LlavaNextImageProcessorPil,
    LlavaOnevisionImageProcessorPil,
    PixtralImageProcessorPil,
    Qwen2VLImageProcessorPil,
)
from transformers.image_utils import ChannelDimension
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor
from transformers.models.idefics3.processing_idefics3 import Idefics3Processor
from transformers.models.llava.processing_llava import LlavaProcessor
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
from transformers.models.pixtral.image_processing_pil_pixtral import (
    get_resize_output_image_size as pixtral_resize,
)
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from vlm_pack._compat import pil_image_processor_class, processor_needs_torchvision
from vlm_pack.families import names
from vlm_pack.offline import build_tokenizer
from vlm_pack.vision import (
    Gemma3Spec,
    Idefics3Spec,
    InternVLSpec,
    MegatronSpec,
    Qwen2VLSpec,
    Qwen3VLSpec,
    smart_resize,
    vision_spec,
    vision_spec_from_processor,
)

# ----------------------------------------------------------------------------------------------------------
# Sizes and helpers
# ----------------------------------------------------------------------------------------------------------

# transformers 5.6 hides these two behind a torchvision stand-in at its top level
Idefics3ImageProcessorPil = pil_image_processor_class("Idefics3ImageProcessorPil")
SmolVLMImageProcessorPil = pil_image_processor_class("SmolVLMImageProcessorPil")


def sweep_sizes(seed: int, n: int = 1100) -> list[tuple[int, int]]:
    """``(width, height)`` pairs: uniform, log-uniform, extreme aspect ratios, ratio-200 and rounding edges."""
    rng = np.random.default_rng(seed)
    k = n // 4
    uniform = rng.integers(1, 8001, size=(k, 2))
    log = np.exp(rng.uniform(0, math.log(8000), size=(k, 2))).astype(int).clip(1, 8000)
    short = rng.integers(1, 65, size=k)
    long = rng.integers(1, 8001, size=k)
    extreme = np.stack([long, short], axis=1)
    extreme[::2] = extreme[::2, ::-1]
    s = rng.integers(1, 41, size=n - 3 * k)
    ratio200 = np.stack([s * 200 + rng.integers(-1, 2, size=len(s)), s], axis=1)
    ratio200[1::2] = ratio200[1::2, ::-1]
    fixed = [(1, 1), (8000, 8000), (1, 8000), (8000, 1), (200, 1), (201, 1), (1, 200), (14, 14), (15, 15)]
    # Multiples of half a Qwen / GLM factor hit round()'s half-to-even ties.
    ties = [(14 * a, 14 * b) for a in (1, 3, 5, 45, 77) for b in (1, 3, 7, 91)] + [
        (16 * a, 16 * b) for a in (1, 3, 5, 45, 77) for b in (1, 3, 7, 91)
    ]
    pairs = np.concatenate([uniform, log, extreme, ratio200]).clip(1, 8000)
    return [(int(w), int(h)) for w, h in pairs] + fixed + ties


def outcome(fn, *args):
    """The value of ``fn(*args)``, or "ValueError" if it raises one."""
    try:
        return fn(*args)
    except ValueError:
        return "ValueError"


def hf_patches(ip, height: int, width: int):
    """``ip.get_number_of_image_patches(height, width)`` with the processor's own settings on every release:
    transformers 5.6 requires ``images_kwargs`` (Idefics3) or fails on its ``None`` default (Qwen2-VL), and
    an empty one means the processor's own settings there (but the class defaults for GLM-4.1V)."""
    try:
        return ip.get_number_of_image_patches(height, width)
    except TypeError:
        return ip.get_number_of_image_patches(height, width, {})


def assert_all_equal(sizes, expected, got, what):
    mismatches = [(s, e, g) for s, e, g in zip(sizes, expected, got) if e != g]
    assert len(sizes) >= 1000
    assert not mismatches, f"{what}: {len(mismatches)} of {len(sizes)} sizes differ, e.g. {mismatches[:5]}"


def tokenizer_with(*tokens: str):
    tok = build_tokenizer("llava")
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tok


def rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


# Modest sizes for full preprocessing: tiny, odd, elongated, around tile / factor boundaries.
FULL_SIZES = [(1, 1), (3, 5), (27, 1000), (300, 1000), (640, 480), (448, 448), (1000, 57), (1337, 777),
              (56, 2000), (895, 897), (1920, 1080), (2200, 400), (500, 1500)]  # fmt: skip

# Released checkpoints' preprocessor parameters, passed explicitly (constructor defaults differ).
QWEN2_CKPT = dict(
    patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 3136, "longest_edge": 12845056}
)
QWEN3_CKPT = dict(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)
GLM4V_CKPT = dict(
    patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 12544, "longest_edge": 9633792}
)
LLAVA_CKPT = dict(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True)
NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
OV_PINPOINTS = [[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]
INTERNVL_CKPT = dict(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=12)
IDEFICS3_CKPT = dict(size={"longest_edge": 1456}, max_image_size={"longest_edge": 364})
SMOLVLM_CKPT = dict(size={"longest_edge": 1536}, max_image_size={"longest_edge": 384})
PIXTRAL_CKPT = dict(patch_size={"height": 16, "width": 16}, size={"longest_edge": 1024})  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4.1V
# ----------------------------------------------------------------------------------------------------------

QWEN_CASES = {
    "qwen2_vl-ckpt": (QWEN2_CKPT, "qwen2_vl"),
    "qwen2_vl-256tok": (dict(QWEN2_CKPT, size={"shortest_edge": 200704, "longest_edge": 200704}), "qwen2_vl"),
    "qwen2_vl-ctor-default": (dict(patch_size=14, merge_size=2, temporal_patch_size=2), "qwen2_vl"),
    "qwen3_vl-ckpt": (QWEN3_CKPT, "qwen3_vl"),
    "qwen3_vl-small": (dict(QWEN3_CKPT, size={"shortest_edge": 1024, "longest_edge": 1024 * 64}), "qwen3_vl"),
    "glm4v-ckpt": (GLM4V_CKPT, "glm4v"),
    "glm4v-small": (dict(GLM4V_CKPT, size={"shortest_edge": 784, "longest_edge": 784 * 100}), "glm4v"),
}


@pytest.mark.parametrize("case", list(QWEN_CASES))
def test_qwen_style_sweep_matches_processor(case):
    params, family = QWEN_CASES[case]
    cls = Glm4vImageProcessorPil if family == "glm4v" else Qwen2VLImageProcessorPil
    proc = cls(**params)
    spec = vision_spec_from_processor(proc)
    # a bare image processor reads with the rule of the one record naming its class (Family.image_processors),
    # whatever model it came with: it writes no text, and its counts are its own
    assert spec.family == ("glm4v" if family == "glm4v" else "qwen2_vl")
    sizes = sweep_sizes(zlib.crc32(case.encode()))
    expected = [outcome(hf_patches, proc, h, w) for w, h in sizes]
    assert_all_equal(sizes, expected, [outcome(spec.num_patches, w, h) for w, h in sizes], case)
    # tokens = patches / merge**2 (what Qwen2VLProcessor._get_num_multimodal_tokens returns)
    tokens = [e if e == "ValueError" else e // 4 for e in expected]
    assert_all_equal(sizes, tokens, [outcome(spec.num_tokens, w, h) for w, h in sizes], case)
    assert "ValueError" in expected  # the sweep reaches the aspect-ratio rule


def test_qwen_checkpoint_defaults_and_reference_values():
    assert vision_spec("qwen2_vl").grid(1920, 1080) == (1, 78, 138)
    assert vision_spec("qwen2_vl").num_tokens(1920, 1080) == 2691
    assert vision_spec("qwen2_5_vl").num_tokens(1920, 1080) == 2691
    assert vision_spec("qwen3_vl").grid(1920, 1080) == (1, 68, 120)
    assert vision_spec("qwen3_vl").num_tokens(1920, 1080) == 2040
    for fam in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"):
        assert vision_spec(fam).wrapper_tokens == 2
        assert vision_spec(fam).total_tokens(640, 480) == vision_spec(fam).num_tokens(640, 480) + 2
    # Non-default bounds: overrides reach the rule.
    assert vision_spec("qwen2_vl", max_pixels=200704).num_tokens(8000, 8000) <= 256
    assert smart_resize(1080, 1920, 28, 3136, 12845056) == (1092, 1932)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "glm4v"])
@pytest.mark.slow
def test_qwen_style_full_preprocessing(family):
    params = {"qwen2_vl": QWEN2_CKPT, "qwen3_vl": QWEN3_CKPT, "glm4v": GLM4V_CKPT}[family]
    cls = Glm4vImageProcessorPil if family == "glm4v" else Qwen2VLImageProcessorPil
    proc = cls(**params)
    spec = vision_spec(family)
    for i, (w, h) in enumerate(FULL_SIZES):
        out = proc(rgb(w, h, i), return_tensors="np")
        assert tuple(out["image_grid_thw"][0].tolist()) == spec.grid(w, h), (family, w, h)
        assert out["pixel_values"].shape[0] == spec.num_patches(w, h)
    # Where smart_resize raises, the processor raises on the real image too, and so does the spec.
    with pytest.raises(ValueError, match="aspect ratio"):
        proc(rgb(603, 3), return_tensors="np")
    with pytest.raises(ValueError, match="200"):
        spec.num_tokens(603, 3)


def test_qwen_processor_classes_pick_the_family():
    ip = Qwen2VLImageProcessorPil(**QWEN3_CKPT)
    video = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824})
    # Qwen3VLProcessor's constructor type-checks its video processor against a torchvision-only registry;
    # bypass only that check and give it the real image / video processors it would hold.
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    proc.image_processor, proc.video_processor = ip, video
    spec = vision_spec_from_processor(proc)
    assert isinstance(spec, Qwen3VLSpec)
    assert (spec.video_min_pixels, spec.video_max_pixels, spec.fps) == (4096, 25165824, 2)
    bare = vision_spec_from_processor(ip)  # 16 px patches: still the record naming the class, no guess
    assert isinstance(bare, Qwen2VLSpec) and bare.num_tokens(640, 480) == spec.num_tokens(640, 480)
    q2 = vision_spec_from_processor(Qwen2VLImageProcessorPil(**QWEN2_CKPT))
    assert isinstance(q2, Qwen2VLSpec) and q2.family == "qwen2_vl"
    assert vision_spec("qwen2_5_vl").family == "qwen2_5_vl"


# ----------------------------------------------------------------------------------------------------------
# Qwen video
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [False, True])
def test_qwen3_video_matches_video_processor(cap):
    vp = Qwen3VLVideoProcessor(
        size={"shortest_edge": 4096, "longest_edge": 25165824}, cap_pixels_per_frame=cap
    )
    if not hasattr(vp, "get_num_of_video_patches"):
        pytest.skip(
            "this transformers' Qwen3VLVideoProcessor has no get_num_of_video_patches, the oracle here"
        )
    spec = vision_spec("qwen3_vl", cap_pixels_per_frame=cap)
    rng = np.random.default_rng(7)
    cases = [(int(t), int(w), int(h)) for t, (w, h) in zip(rng.integers(1, 800, 1000), sweep_sizes(8))]
    cases += [(1, 64, 64), (2, 1, 1), (3, 10, 2000), (768, 1920, 1080)]
    for t, w, h in cases:
        expected = outcome(vp.get_num_of_video_patches, t, h, w, {})
        got = outcome(lambda t=t, w=w, h=h: math.prod(spec.video_grid(t, w, h)))
        assert got == expected, (t, w, h)
        if expected != "ValueError":
            assert spec.num_video_tokens(t, w, h) == expected // 4
    with pytest.raises(ValueError, match="temporal patch"):
        spec.video_grid(1, 640, 480)


def test_qwen3_video_frame_sampling_and_timestamps():
    vp = Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824})
    proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # only _calculate_timestamps is used
    spec = vision_spec("qwen3_vl")
    for total, video_fps in [(300, 30.0), (7, 24.0), (1, 25.0), (5000, 29.97), (61, 2.0), (100000, 60.0)]:
        meta = VideoMetadata(total_num_frames=total, fps=video_fps)
        indices = vp.sample_frames(meta)
        assert spec.sample_frame_indices(total, video_fps).tolist() == np.asarray(indices).tolist()
        assert spec.video_timestamps(total, video_fps) == proc._calculate_timestamps(indices, video_fps, 2)
        n = len(indices)
        if n >= 2:
            assert spec.video_grid(total, 640, 360, video_fps=video_fps) == spec.video_grid(n, 640, 360)
    # 3000 frames at 30 fps, 2 fps sampling -> 200 frames -> 100 temporal groups.
    assert spec.video_grid(3000, 640, 360, video_fps=30.0)[0] == 100


def test_qwen2_video_rule():
    # Qwen2VLVideoProcessor cannot be imported without torchvision; its get_num_of_video_patches is the
    # image smart_resize under the video bounds, with grid_t = ceil(frames / temporal_patch_size).
    spec = vision_spec("qwen2_vl", video_min_pixels=128 * 28 * 28, video_max_pixels=768 * 28 * 28)
    for t, w, h in [(1, 640, 480), (7, 1920, 1080), (16, 300, 3000), (2, 28, 28)]:
        rh, rw = smart_resize(h, w, 28, 128 * 28 * 28, 768 * 28 * 28)
        assert spec.video_grid(t, w, h) == (math.ceil(t / 2), rh // 14, rw // 14)
        assert spec.num_video_tokens(t, w, h) == math.ceil(t / 2) * rh * rw // (28 * 28)
    sampling = vision_spec("qwen2_vl", do_sample_frames=True)
    # 10 s at 30 fps sampled at 2 fps -> 20 frames -> grid_t 10.
    assert sampling.video_grid(300, 640, 480, video_fps=30.0)[0] == 10


# ----------------------------------------------------------------------------------------------------------
# LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision
# ----------------------------------------------------------------------------------------------------------

LLAVA_TOKENIZER = None


def llava_tokenizer():
    global LLAVA_TOKENIZER
    if LLAVA_TOKENIZER is None:
        LLAVA_TOKENIZER = build_tokenizer("llava")
    return LLAVA_TOKENIZER


LLAVA_CASES = {
    "llava-ckpt": (LlavaProcessor, LlavaImageProcessorPil, LLAVA_CKPT, dict(strategy="default", extra=1)),
    "llava-224-full": (
        LlavaProcessor,
        LlavaImageProcessorPil,
        dict(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, do_center_crop=True),
        dict(strategy="full", extra=0),
    ),
    "llava_next-ckpt": (
        LlavaNextProcessor,
        LlavaNextImageProcessorPil,
        dict(LLAVA_CKPT, image_grid_pinpoints=NEXT_PINPOINTS, do_pad=True),
        dict(strategy="default", extra=1),
    ),
    "llava_next-pinpoints-full": (
        LlavaNextProcessor,
        LlavaNextImageProcessorPil,
        dict(
            LLAVA_CKPT,
            image_grid_pinpoints=[
                [336, 336],
                [336, 1344],
                [1344, 336],
                [672, 1008],
                [1008, 672],
                [1344, 1344],
            ],
            do_pad=True,
        ),
        dict(strategy="full", extra=1),
    ),
}


def make_llava_processor(case):
    proc_cls, ip_cls, params, opts = LLAVA_CASES[case]
    return proc_cls(
        image_processor=ip_cls(**params),
        tokenizer=llava_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy=opts["strategy"],
        num_additional_image_tokens=opts["extra"],
    )


@pytest.mark.parametrize("case", list(LLAVA_CASES))
def test_llava_sweep_matches_processor(case):
    proc = make_llava_processor(case)
    spec = vision_spec_from_processor(proc)
    sizes = sweep_sizes(zlib.crc32(case.encode()))
    expected = proc._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])["num_image_tokens"]
    assert_all_equal(sizes, expected, [spec.num_tokens(w, h) for w, h in sizes], case)


@pytest.mark.parametrize("case", ["llava-ckpt", "llava_next-ckpt", "llava_next-pinpoints-full"])
@pytest.mark.slow
def test_llava_full_processor_call(case):
    proc = make_llava_processor(case)
    spec = vision_spec_from_processor(proc)
    tok = proc.tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    for i, (w, h) in enumerate(FULL_SIZES[2:]):
        out = proc(text="describe <image> please", images=[rgb(w, h, i)], return_tensors="np")
        assert (out["input_ids"][0] == image_id).sum() == spec.num_tokens(w, h), (case, w, h)
        pixel_values = out["pixel_values"]
        tiles = pixel_values.shape[1] if pixel_values.ndim == 5 else pixel_values.shape[0]
        assert tiles == spec.tiles(w, h)


def test_llava_reference_values():
    assert vision_spec("llava").num_tokens(123, 4567) == 576
    assert vision_spec("llava_next").num_tokens(640, 480) == 2340
    assert vision_spec("llava_next").num_tokens(1920, 1080) == 1948
    assert vision_spec("llava_next").tiles(640, 480) == 5


def onevision_processor(ip, num_image_tokens=729, aspect="anyres_max_9", strategy="full"):
    # LlavaOnevisionProcessor's constructor needs a torchvision video processor; the token rule
    # (_get_number_of_features, called by replace_image_token) only reads these attributes.
    proc = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    proc.image_processor = ip
    proc.num_image_tokens = num_image_tokens
    proc.vision_aspect_ratio = aspect
    proc.vision_feature_select_strategy = strategy
    return proc


OV_CASES = {
    "ov-ckpt": (dict(size={"height": 384, "width": 384}, image_grid_pinpoints=OV_PINPOINTS), "anyres_max_9"),
    "ov-max4-small-grid": (
        dict(
            size={"height": 384, "width": 384},
            image_grid_pinpoints=[p for p in OV_PINPOINTS if max(p) <= 1152],
        ),
        "anyres_max_4",
    ),
}


@pytest.mark.parametrize("case", list(OV_CASES))
def test_onevision_sweep_matches_processor(case):
    params, aspect = OV_CASES[case]
    proc = onevision_processor(LlavaOnevisionImageProcessorPil(**params), aspect=aspect)
    spec = vision_spec_from_processor(proc)
    assert spec.vision_aspect_ratio == aspect
    sizes = sweep_sizes(zlib.crc32(case.encode()))
    expected = [proc._get_number_of_features(h, w, 384, 384) for w, h in sizes]
    assert_all_equal(sizes, expected, [spec.num_tokens(w, h) for w, h in sizes], case)


@pytest.mark.slow
def test_onevision_full_preprocessing_and_multi_image():
    ip = LlavaOnevisionImageProcessorPil(
        size={"height": 384, "width": 384}, image_grid_pinpoints=OV_PINPOINTS
    )
    proc = onevision_processor(ip)
    spec = vision_spec("llava_onevision")
    for i, (w, h) in enumerate(FULL_SIZES[2:10]):
        out = ip(rgb(w, h, i), return_tensors="np")
        tiles = out["pixel_values"].shape[1]
        assert tiles == spec.tiles(w, h), (w, h)
        ph, pw = out["pixel_values"].shape[-2:]
        assert proc._get_number_of_features(h, w, ph, pw) == spec.num_tokens(w, h)
    # A two-image sample: no tiling, 729 + 1 (newline) each (replace_image_token's multi-image branch).
    out = ip([[rgb(640, 480), rgb(100, 1000)]], return_tensors="np")
    assert out["pixel_values"].shape[1] == 1 and list(out["batch_num_images"]) == [2]
    assert spec.sample_tokens([(640, 480), (100, 1000)]) == [730, 730]
    assert spec.sample_tokens([(640, 480)]) == [spec.num_tokens(640, 480)]
    assert spec.num_video_tokens(8, 640, 480) == 8 * 196 + 1


# ----------------------------------------------------------------------------------------------------------
# InternVL (GotOcr2 crop_to_patches)
# ----------------------------------------------------------------------------------------------------------

INTERNVL_CASES = {
    "internvl-ckpt": INTERNVL_CKPT,
    "internvl-2to6": dict(INTERNVL_CKPT, min_patches=2, max_patches=6),
    "internvl-no-crop": dict(INTERNVL_CKPT, crop_to_patches=False),
}


@pytest.mark.parametrize("case", list(INTERNVL_CASES))
def test_internvl_sweep_matches_processor(case):
    ip = GotOcr2ImageProcessorPil(**INTERNVL_CASES[case])
    spec = vision_spec_from_processor(ip)
    sizes = sweep_sizes(zlib.crc32(case.encode()))
    tiles = [hf_patches(ip, h, w) for w, h in sizes]
    assert_all_equal(sizes, tiles, [spec.tiles(w, h) for w, h in sizes], case)
    # InternVLProcessor._get_num_multimodal_tokens: 2 + image_seq_length * tiles (wrappers included).
    assert_all_equal(sizes, [2 + 256 * t for t in tiles], [spec.total_tokens(w, h) for w, h in sizes], case)


@pytest.mark.slow
def test_internvl_full_preprocessing():
    ip = GotOcr2ImageProcessorPil(**INTERNVL_CKPT)
    spec = vision_spec("internvl")
    for i, (w, h) in enumerate(FULL_SIZES):
        out = ip(rgb(w, h, i), return_tensors="np")
        assert list(out["num_patches"]) == [spec.tiles(w, h)], (w, h)
        assert out["pixel_values"].shape[0] == spec.tiles(w, h)
    assert spec.tiles(640, 480) == 13 and spec.total_tokens(640, 480) == 3330


# ----------------------------------------------------------------------------------------------------------
# Idefics3 / SmolVLM
# ----------------------------------------------------------------------------------------------------------

IDEFICS_TOKENS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]

IDEFICS_CASES = {
    "idefics3-ckpt": (Idefics3ImageProcessorPil, IDEFICS3_CKPT, 169),
    "smolvlm-ckpt": (SmolVLMImageProcessorPil, SMOLVLM_CKPT, 81),
    "smolvlm-512": (SmolVLMImageProcessorPil, dict(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}), 64),
    "idefics3-no-split": (Idefics3ImageProcessorPil, dict(IDEFICS3_CKPT, do_image_splitting=False), 169),
}  # fmt: skip


@pytest.mark.parametrize("case", list(IDEFICS_CASES))
def test_idefics3_sweep_matches_processor(case):
    ip_cls, params, seq = IDEFICS_CASES[case]
    ip = ip_cls(**params)
    proc = Idefics3Processor(image_processor=ip, tokenizer=tokenizer_with(*IDEFICS_TOKENS), image_seq_len=seq)
    spec = vision_spec_from_processor(proc)
    sizes = sweep_sizes(zlib.crc32(case.encode()))
    grids = [hf_patches(ip, h, w) for w, h in sizes]
    assert_all_equal(sizes, [(c, r) for _, r, c in grids], [spec.tile_grid(w, h) for w, h in sizes], case)
    count = proc._get_num_multimodal_tokens
    probe = proc(text="<image>", images=[rgb(300, 200)], add_special_tokens=False)["input_ids"][0]
    if count(image_sizes=[(200, 300)])["num_image_tokens"] != [len(probe)]:
        pytest.skip(
            "this transformers' Idefics3Processor._get_num_multimodal_tokens counts one token more than its "
            "own __call__ writes; the whole-processor tests are the reference there"
        )
    expected = count(image_sizes=[(h, w) for w, h in sizes])["num_image_tokens"]
    assert_all_equal(sizes, expected, [spec.total_tokens(w, h) for w, h in sizes], case)


@pytest.mark.slow
def test_idefics3_full_processor_call():
    tok = tokenizer_with(*IDEFICS_TOKENS)
    image_id = tok.convert_tokens_to_ids("<image>")
    text_only = len(tok("describe  please")["input_ids"])
    # longest_edge 1000 is not a multiple of 364: the real preprocessing is the reference here (the
    # processor's get_number_of_image_patches rounds the short side from the wrong value for such sizes).
    for params in (IDEFICS3_CKPT, dict(size={"longest_edge": 1000}, max_image_size={"longest_edge": 364})):
        proc = Idefics3Processor(
            image_processor=Idefics3ImageProcessorPil(**params), tokenizer=tok, image_seq_len=169
        )
        spec = vision_spec_from_processor(proc)
        for i, (w, h) in enumerate(
            [(640, 480), (700, 500), (2938, 2132), (100, 3000), (300, 200), (1456, 40)]
        ):
            out = proc(text="describe <image> please", images=[rgb(w, h, i)], return_tensors="np")
            ids = out["input_ids"][0]
            assert (ids == image_id).sum() == spec.num_tokens(w, h), (params, w, h)
            assert len(ids) - text_only == spec.total_tokens(w, h), (params, w, h)
            assert out["pixel_values"].shape[1] == spec.tiles(w, h)


# ----------------------------------------------------------------------------------------------------------
# Gemma 3, Pixtral, Megatron
# ----------------------------------------------------------------------------------------------------------


def lazy_image_array(w: int, h: int) -> np.ndarray:
    """A zero-copy (3, h, w) array: pan_and_scan only slices it."""
    return np.broadcast_to(np.zeros((1, 1, 1), dtype=np.float32), (3, h, w))


@pytest.mark.parametrize(
    "pas",
    [
        dict(do_pan_and_scan=False),
        dict(do_pan_and_scan=True),
        dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=128, pan_and_scan_max_num_crops=7,
             pan_and_scan_min_ratio_to_activate=2.5),
    ],
)  # fmt: skip
def test_gemma3_sweep_matches_processor(pas):
    ip = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    spec = vision_spec("gemma3", **pas)
    defaults = dict(
        pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2
    )
    args = {**defaults, **{k: v for k, v in pas.items() if k != "do_pan_and_scan"}}
    sizes = sweep_sizes(len(pas))
    if pas["do_pan_and_scan"]:
        crops = [len(ip.pan_and_scan(lazy_image_array(w, h), **args)) for w, h in sizes]
    else:
        crops = [0] * len(sizes)
    assert_all_equal(
        sizes, [256 * (1 + c) for c in crops], [spec.num_tokens(w, h) for w, h in sizes], str(pas)
    )


@pytest.mark.slow
def test_gemma3_full_processor_call():
    tok = tokenizer_with("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    tok.boi_token, tok.eoi_token, tok.image_token = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    tok.boi_token_id = tok.convert_tokens_to_ids(tok.boi_token)
    tok.image_token_id = tok.convert_tokens_to_ids(tok.image_token)
    proc = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}), tokenizer=tok
    )
    spec = vision_spec_from_processor(proc)
    assert isinstance(spec, Gemma3Spec) and not spec.do_pan_and_scan  # the processor's images_kwargs default
    pas = vision_spec("gemma3", do_pan_and_scan=True)
    for i, (w, h) in enumerate([(640, 480), (1000, 300), (300, 1400), (2000, 250), (100, 90)]):
        for do_pas, s in ((False, spec), (True, pas)):
            out = proc(
                text="hi <start_of_image> x",
                images=[rgb(w, h, i)],
                do_pan_and_scan=do_pas,
                return_tensors="np",
            )
            assert (out["input_ids"][0] == tok.image_token_id).sum() == s.num_tokens(w, h), (w, h, do_pas)
            assert out["pixel_values"].shape[0] == s.tiles(w, h)


PIXTRAL_CASES = {"pixtral-ckpt": (16, 1024), "pixtral-14-1540": (14, 1540)}


@pytest.mark.parametrize("case", list(PIXTRAL_CASES))
def test_pixtral_sweep_matches_processor(case):
    patch, longest = PIXTRAL_CASES[case]
    ip = PixtralImageProcessorPil(
        patch_size={"height": patch, "width": patch}, size={"longest_edge": longest}
    )
    spec = vision_spec_from_processor(ip)
    sizes = sweep_sizes(zlib.crc32(case.encode()))

    def expected(w, h):
        # The processor's own resize rule (PixtralImageProcessorPil.resize); explicit channel layout
        # because inference from an (h, w, 3) shape misreads h in (1, 3).
        rh, rw = pixtral_resize(
            np.broadcast_to(np.zeros((1, 1, 1)), (3, h, w)), size=(longest, longest), patch_size=(patch, patch),
            input_data_format=ChannelDimension.FIRST,
        )  # fmt: skip
        if rh == 0 or rw == 0:
            return "ValueError"  # the processor's resize rejects a 0 px side (checked below)
        return (rh // patch) * (rw // patch + 1)  # PixtralProcessor.replace_image_token

    assert_all_equal(
        sizes, [expected(w, h) for w, h in sizes], [outcome(spec.total_tokens, w, h) for w, h in sizes], case
    )


def test_pixtral_full_preprocessing():
    ip = PixtralImageProcessorPil(**PIXTRAL_CKPT)
    spec = vision_spec("pixtral")
    for i, (w, h) in enumerate(FULL_SIZES):
        out = ip(rgb(w, h, i), return_tensors="np")
        rh, rw = (int(v) for v in out["image_sizes"][0])
        assert (rw, rh) == spec.resized_size(w, h), (w, h)
        rows, cols = rh // 16, rw // 16
        assert spec.num_tokens(w, h) == rows * cols and spec.extra_tokens(w, h) == rows
    with pytest.raises(ValueError):
        ip(rgb(2000, 1), return_tensors="np")
    with pytest.raises(ValueError, match="0 px"):
        spec.num_tokens(2000, 1)


def test_megatron_get_num_image_embeddings():
    # clip_vit_model.get_num_image_embeddings: (336 // 14)**2 + class token.
    assert vision_spec("megatron").num_tokens(640, 480) == 577
    assert MegatronSpec(disable_vision_class_token=True).num_tokens(640, 480) == 576
    assert MegatronSpec(class_token_len=0).tokens_per_tile == 576  # SigLIP
    # InternViT 448 px with pixel shuffle and dynamic tiles: 1024 * 0.25 = 256 per tile, like InternVL.
    internvit = MegatronSpec(img_h=448, img_w=448, class_token_len=0, pixel_shuffle=True, max_tiles=12)
    for w, h in sweep_sizes(3, 200):
        assert internvit.num_tokens(w, h) == InternVLSpec().num_tokens(w, h)
        assert internvit.num_patches(w, h) == internvit.tiles(w, h) * 1024


# ----------------------------------------------------------------------------------------------------------
# API: registry, errors, validation, batch
# ----------------------------------------------------------------------------------------------------------


def test_registry_and_unknown_processor():
    for fam in names("vision"):
        spec = vision_spec(fam)
        assert spec.num_tokens(640, 480) > 0 and spec.num_patches(640, 480) > 0 and spec.tiles(640, 480) >= 1
        assert spec.total_tokens(640, 480) >= spec.num_tokens(640, 480)
        assert spec.to_dict()["family"] == spec.family
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "llava", "llava_next", "llava_onevision", "internvl",
            "idefics3", "smolvlm", "gemma3", "pixtral", "megatron"} <= set(names("vision"))  # fmt: skip
    assert vision_spec("Qwen2.5-VL").family == "qwen2_5_vl"
    with pytest.raises(ValueError, match="supported: qwen2_vl"):
        vision_spec("blip2")
    with pytest.raises(TypeError, match="qwen2_vl"):
        vision_spec("qwen2_vl", max_tiles=3)
    with pytest.raises(ValueError, match="Qwen2VLImageProcessor") as err:
        vision_spec_from_processor(SimpleNamespace(image_processor=object()))
    assert "PixtralImageProcessor" in str(err.value)
    for not_a_processor in (build_tokenizer("qwen2_vl"), Qwen2VLImageProcessorPil, "qwen2_vl", None):
        with pytest.raises(ValueError, match="not a supported image processor or processor instance"):
            vision_spec_from_processor(not_a_processor)
    with pytest.raises(ValueError, match="do_center_crop"):
        vision_spec_from_processor(LlavaImageProcessorPil(size={"shortest_edge": 336}, do_center_crop=False))


@pytest.mark.parametrize("family", names("vision"))
def test_invalid_sizes_name_the_family(family):
    spec = vision_spec(family)
    for w, h in [(0, 10), (10, 0), (-5, 10)]:
        with pytest.raises(ValueError, match=f"{spec.family}.*positive"):
            spec.num_tokens(w, h)
    for bad in (10.5, "10", True, None):
        with pytest.raises(TypeError, match=spec.family):
            spec.num_tokens(bad, 10)
    assert spec.num_tokens(np.int64(640), np.int32(480)) == spec.num_tokens(640, 480)


def test_batch_forecasts_equal_the_processors():
    """``*_batch`` against the processors' own size functions, repeated sizes included (one call per size)."""
    qwen = Qwen2VLImageProcessorPil(**QWEN2_CKPT)
    spec = vision_spec_from_processor(qwen)
    sizes = sweep_sizes(11, 400)
    ok = [(w, h) for w, h in sizes if max(w, h) / min(w, h) <= 200]
    ok = ok + ok[::3]  # repeats: each distinct size is computed once and scattered back in order
    w, h = np.array([s[0] for s in ok]), np.array([s[1] for s in ok])
    patches = [hf_patches(qwen, b, a) for a, b in ok]
    assert spec.num_patches_batch(w.tolist(), h.tolist()).tolist() == patches
    assert spec.num_tokens_batch(w, h).tolist() == [n // 4 for n in patches]  # 2x2 merge
    # Hand-computed: 1920x1080 -> 78 x 138 patches (test_qwen_checkpoint_defaults_and_reference_values).
    assert spec.num_tokens_batch(np.array([1920, 64, 1920]), np.array([1080, 64, 1080])).tolist() == [
        2691,
        hf_patches(qwen, 64, 64) // 4,
        2691,
    ]
    assert spec.num_tokens_batch([], []).shape == (0,)
    with pytest.raises(ValueError, match=r"image 1 \(500x2\).*aspect ratio"):
        spec.num_tokens_batch([1, 500, 3], [1, 2, 3])
    with pytest.raises(ValueError, match=r"image 2 \(0x5\).*positive"):
        spec.num_tokens_batch([1, 5, 0], [1, 5, 5])
    ov_proc = onevision_processor(
        LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384}, image_grid_pinpoints=OV_PINPOINTS)
    )
    ov = vision_spec_from_processor(ov_proc)
    expected = [ov_proc._get_number_of_features(b, a, 384, 384) for a, b in ok[:80]]
    assert ov.num_tokens_batch(w[:80], h[:80]).tolist() == expected


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Qwen2VLSpec(merge_size=0), "merge_size"),
        (lambda: Qwen3VLSpec(patch_size=16.0), "patch_size"),
        (lambda: MegatronSpec(patch_dim=0), "patch_dim"),
        (lambda: MegatronSpec(img_h=True), "img_h"),
        (lambda: InternVLSpec(max_tiles=-1), "max_tiles"),
        (lambda: Idefics3Spec(image_seq_len=0), "image_seq_len"),
    ],
)
def test_a_spec_with_a_count_that_is_not_a_positive_integer_names_the_field(make, field):
    # A zero patch or tile count would divide by zero (or forecast zero tokens) at the first image.
    with pytest.raises(ValueError, match=rf": {field} must be a positive integer, got "):
        make()


# ------------------------------------------------------------------ Gemma 4, GLM-4.5V / 4.6V (issue 31)


def _gemma4_resize(w: int, h: int, budget: int):
    """transformers' own ``get_aspect_ratio_preserving_size`` as ``(w, h)``, or the ValueError it raises."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    try:
        th, tw = get_aspect_ratio_preserving_size(h, w, patch_size=16, max_patches=budget * 9, pooling_kernel_size=3)
    except ValueError:
        return "refused"
    return tw, th


@pytest.mark.parametrize("budget", [70, 140, 280, 560, 1120])
def test_gemma4_sweep_matches_the_processors_resize(budget):
    spec = vision_spec("gemma4", max_soft_tokens=budget)
    sizes = sweep_sizes(budget)
    want = [_gemma4_resize(w, h, budget) for w, h in sizes]

    def mine(w, h):
        try:
            return spec.resized_size(w, h)
        except ValueError:
            return "refused"

    assert_all_equal(sizes, want, [mine(w, h) for w, h in sizes], f"max_soft_tokens={budget}")
    assert all(spec.num_tokens(w, h) <= budget for (w, h), r in zip(sizes, want) if r != "refused")


GEMMA4_SIZES = [(20, 20), (90, 60), (640, 480), (1000, 57), (57, 1000), (3000, 40), (40, 3000), (1337, 777),
                (48, 48), (4000, 3000)]  # fmt: skip


@pytest.mark.parametrize("budget", [70, 280])
def test_gemma4_forecast_is_the_processors_call(budget):
    """Oracle: Gemma4Processor.__call__ (the released PIL image processor), image tokens and wrappers."""
    from vlm_pack import offline

    if why := processor_needs_torchvision("gemma4"):
        pytest.skip(why)

    proc = offline.processor("gemma4", max_soft_tokens=budget)
    spec = vision_spec_from_processor(proc)
    assert spec == vision_spec("gemma4", max_soft_tokens=budget)
    base = len(proc.tokenizer("hi  x")["input_ids"])
    for i, (w, h) in enumerate(GEMMA4_SIZES):
        out = proc(text=f"hi {proc.image_token} x", images=[rgb(w, h, i)], return_tensors="np")
        ids = out["input_ids"][0]
        assert (ids == proc.image_token_id).sum() == spec.num_tokens(w, h), (w, h)
        assert len(ids) - base == spec.total_tokens(w, h), (w, h)
        assert out["pixel_values"].shape[1] == budget * 9  # patch rows padded to the budget
        assert (out["image_position_ids"][0, :, 0] >= 0).sum() == spec.num_patches(w, h)


@pytest.mark.parametrize("family", ["glm4v_moe", "glm46v"])
def test_glm45v_46v_forecast_is_the_processors_call(family):
    from vlm_pack import offline

    proc = offline.processor(family)
    spec = vision_spec_from_processor(proc)
    assert spec == vision_spec("glm4v" if family == "glm4v_moe" else family)  # GLM-4.5V: the GLM-4.1V classes
    assert spec.resized_size(640, 480) == vision_spec(family).resized_size(640, 480)
    image = proc.tokenizer.convert_tokens_to_ids("<|image|>")
    for i, (w, h) in enumerate(FULL_SIZES):
        out = proc(text="hi <|begin_of_image|><|image|><|end_of_image|> x", images=[rgb(w, h, i)], return_tensors="np")
        assert (out["input_ids"][0] == image).sum() == spec.num_tokens(w, h), (family, w, h)
