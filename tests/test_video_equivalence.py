"""Packed forward == each sample alone, token by token, with video samples (alone and mixed with images).

CPU, fp32, tiny random models built from config (init std 0.2, so that a packing mistake moves the log-probs
visibly), the offline tokenizers and image processors, transformers' own video processors, and clips that
PyAV encodes here (64-128 px, 8-12 frames; MP4 and Matroska). Every family packs all its samples into ONE
row; ``check_packed_equivalence`` compares that row's log-probs with a padded batch of the samples one per
row (the model's own ``get_rope_index`` with each sample's ``video_grid_thw`` / ``second_per_grid_ts``).
Each positive case must reach token_mult_prob_error <= 1.0001; each control must fail it clearly.

Needs torchvision (transformers' video processors) and PyAV: ``scripts/test_torchvision.sh``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("av")
pytestmark = pytest.mark.torchvision

from PIL import Image  # noqa: E402

from vlm_pack import Preprocessor, offline  # noqa: E402
from vlm_pack.testing import (  # noqa: E402
    check_packed_equivalence,
    encode_clip,
    processor_with_video,
)

TOL = 1.0001
WRONG = 1.01  # every control must be clearly off, not merely above the tolerance
_TEMPLATES = Path(__file__).parent / "templates"

# Frames small enough for a CPU run: Qwen 4-16 vision tokens per temporal group. Qwen2/2.5-VL keep every frame
# (their checkpoints' default), Qwen3-VL samples at 2 fps, OneVision keeps 4 frames per clip (its model stacks
# the videos of a batch, so every clip must have as many frames).
_VIDEO = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32}, cap_pixels_per_frame=False),
    "llava_onevision": dict(do_sample_frames=True, num_frames=4),
}
_IMAGE = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}),
    "llava_onevision": {},
}
FAMILIES = tuple(_VIDEO)


def _turns(parts: list[dict], question: str, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer},
    ]


@functools.cache
def _pre(family: str) -> Preprocessor:
    template = _TEMPLATES / f"{family}.jinja"
    chat_template = template.read_text() if template.exists() else None
    proc = processor_with_video(family, chat_template=chat_template, image_overrides=_IMAGE[family], **_VIDEO[family])
    return Preprocessor(processor=proc)


@functools.cache
def _model(family: str):
    return offline.tiny_model(family, _pre(family).tokenizer, initializer_range=0.2, seed=0)


@functools.cache
def _clip(frames: int, width: int, height: int, fps: float, container: str, seed: int) -> bytes:
    return encode_clip(frames, width, height, fps, container, seed)


def _picture(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@functools.cache
def _samples(family: str) -> tuple:
    """A video alone, a video with an image (the image after it), text only, and (Qwen) two videos around an
    image: processed by the family's processor, the forecast checked on each."""
    pre = _pre(family)
    video_a = _clip(10, 96, 64, 5.0, "mp4", 1)  # 5 fps: Qwen2.5-VL's second_per_grid_ts 0.4
    video_b = _clip(12, 64, 128, 6.0, "mkv", 2)  # no frame count in the header: demuxed
    picture = _picture(90, 60, 3)
    cases = [
        ([], [video_a], _turns([{"type": "video"}], "What moves?", "A square slides to the right.")),
        ([picture], [video_b], [
            {"role": "user", "content": "<video>Compare it with <image> please."},
            {"role": "assistant", "content": "The clip moves, the picture stays."},
        ]),
        ([], [], _turns([], "Say something short.", "Short.")),
    ]
    if family != "llava_onevision":  # OneVision: 785 tokens per clip already
        parts = [{"type": "video"}, {"type": "image"}, {"type": "video"}]
        cases.append(([picture], [video_b, video_a], _turns(parts, "Order them.", "First the tall clip.")))
    out = []
    for k, (images, videos, conversation) in enumerate(cases):
        sample = pre.process(images, conversation, key=f"{family}/{k}", videos=videos)
        length, _ = pre.forecast(conversation, [im.size for im in images], key=k, videos=_headers(videos))
        assert length == len(sample["input_ids"]), (family, k)
        out.append(sample)
    return tuple(out)


def _headers(videos: list[bytes]) -> list:
    from vlm_pack.vision.video import read_video_header

    return [read_video_header(video) for video in videos]


def _report(family: str, packed_samples=None, **kwargs):
    """The harness on the family's samples packed into one row (``packed_samples``: what the collator gets
    instead, the reference still runs the samples as processed)."""
    samples = list(_samples(family))
    packed_samples = list(packed_samples if packed_samples is not None else samples)
    capacity = sum(len(s["input_ids"]) for s in samples)
    collator = _pre(family).collator(capacity, model_config=_model(family).config, max_samples_per_bin=len(samples))
    batch = collator(packed_samples)
    assert batch.num_rows == 1  # every sample in one row
    report = check_packed_equivalence(
        _model(family), samples, None, packed_batch=batch, tokenizer=_pre(family).tokenizer, **kwargs
    )
    return report, batch


@pytest.mark.parametrize("family", FAMILIES)
def test_video_samples_packed_equal_alone(family):
    report, batch = _report(family)
    print(f"{family}: token_mult_prob_error {report.metric:.7f}, max |diff| {report.max_abs_diff:.2e}")
    assert report.passed and report.metric <= TOL, str(report)
    assert batch.pixel_values_videos is not None
    if family != "llava_onevision":
        assert batch.video_grid_thw.shape[0] == sum(len(s.get("video_grid_thw", [])) for s in _samples(family))
    if family == "qwen2_5_vl":  # the time step of each video travels with it
        torch.testing.assert_close(batch.second_per_grid_ts, torch.tensor([0.4, 1 / 3, 1 / 3, 0.4]))


def _positions_as_one_sequence(model, batch):
    """Position ids computed for the whole row as if it were one sample (the model's own rope over the row)."""
    kwargs = dict(batch.model_inputs("sdpa"))
    rows, length = batch.input_ids.shape
    arange = torch.arange(length).expand(rows, length)
    if kwargs["position_ids"].dim() == 3:
        rope, _ = model.model.get_rope_index(
            batch.input_ids,
            mm_token_type_ids=batch.mm_token_type_ids,
            image_grid_thw=batch.image_grid_thw,
            video_grid_thw=batch.video_grid_thw,
            **({"second_per_grid_ts": batch.second_per_grid_ts} if batch.second_per_grid_ts is not None else {}),
        )
        kwargs["position_ids"] = torch.cat([arange[None], rope])
    else:
        kwargs["position_ids"] = arange
    return model(**kwargs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_not_restarted_fail(family):
    report, _ = _report(family, packed_forward=_positions_as_one_sequence)
    print(f"{family} positions not restarted: token_mult_prob_error {report.metric:.4f}")
    assert not report.passed and report.metric > WRONG, str(report)


def test_qwen2_5_vl_without_second_per_grid_ts_fails():
    """Collated without each video's seconds per temporal grid, the packed time positions step as if a grid
    were 1 s (not 0.4 s / 0.33 s): the reference, the model's own rope with them, disagrees."""
    samples = [{k: v for k, v in s.items() if k != "second_per_grid_ts"} for s in _samples("qwen2_5_vl")]
    report, batch = _report("qwen2_5_vl", samples)
    print(f"qwen2_5_vl without second_per_grid_ts: token_mult_prob_error {report.metric:.4f}")
    assert batch.second_per_grid_ts is None
    assert not report.passed and report.metric > WRONG, str(report)


def _example():
    import importlib.util

    path = Path(__file__).parents[1] / "examples" / "check_equivalence.py"
    spec = importlib.util.spec_from_file_location("example_check_equivalence_video", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_gpu_check_runs_video_samples(capsys):
    """``examples/check_equivalence.py --video`` (what runs on a GPU in bf16): PASS, and FAIL on its control."""
    example = _example()
    assert example.main(["--video", "--family", "qwen2_5_vl"]) == 0
    assert "PASS: token_mult_prob_error 1.00000" in capsys.readouterr().out
    assert example.main(["--video", "--family", "qwen2_5_vl", "--mistake", "positions"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_qwen3_5_video_samples_need_their_delta_net_isolated(capsys):
    """Qwen3.5 (Qwen3-VL's processor and timestamps, gated delta-net text layers): exact through varlen
    attention, which isolates the delta-net per sample; left to transformers' PyTorch path it leaks."""
    example = _example()
    assert example.main(["--video", "--family", "qwen3_5", "--attn", "varlen"]) == 0
    out = capsys.readouterr().out
    assert "PASS: token_mult_prob_error 1.00000" in out
    assert example.main(["--video", "--family", "qwen3_5", "--mistake", "mixers"]) == 1
    out = capsys.readouterr().out
    metric = float(out.split("token_mult_prob_error ")[1].split()[0])
    print(f"qwen3_5 video, delta-net not isolated: token_mult_prob_error {metric:.4f}")
    assert "mixes tokens without attention" in out and metric > WRONG
