"""InternVL videos: each kept frame an image (``Frame{i}: <img>`` + 256 image tokens + ``</img>``, the frames
joined by newlines), forecast from the clip's header and packed = alone.

Oracles from outside the code under test: PyAV decoding the WHOLE clip, and transformers' InternVLProcessor
given all of it with its metadata, sampling frames itself (``processor(text=..., videos=[all frames],
video_metadata=...)``, models/internvl/processing_internvl.py, video_processing_internvl.py); and the tiny
random InternVL model (built from config) run on each sample alone.

Needs torchvision (transformers' video processors) and PyAV: ``scripts/test_torchvision.sh``.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("av")
pytestmark = pytest.mark.torchvision

from PIL import Image  # noqa: E402

from vlm_pack import Preprocessor, offline  # noqa: E402
from vlm_pack.testing import check_packed_equivalence, encode_clip, processor_with_video  # noqa: E402
from vlm_pack.vision.video import read_video_header  # noqa: E402

TOL = 1.0001
WRONG = 1.01
_TEMPLATE = (Path(__file__).parent / "templates" / "internvl.jinja").read_text()
_FRAME = {"size": {"height": 448, "width": 448}}  # OpenGVLab/InternVL3-1B-hf video_preprocessor_config
# The video processor's own modes: every frame (its default), 8 sampled frames, 2 frames per second
_MODES = {
    "all": {},
    "sampled8": dict(do_sample_frames=True, num_frames=8),
    "fps2": dict(do_sample_frames=True, fps=2),
}
# (frames, width, height, fps, container): odd and even counts, 64 px to 1920 px, 1 to 60 fps, three containers
_CLIPS = [
    (8, 64, 48, 1.0, "mp4"),
    (9, 96, 64, 5.0, "mkv"),
    (13, 160, 90, 24.0, "webm"),
    (16, 320, 240, 30.0, "mp4"),
    (21, 64, 128, 60.0, "mkv"),
    (30, 640, 360, 10.0, "mp4"),
    (1, 64, 64, 1.0, "mp4"),  # one frame: kept whole; fewer than 8, so the sampled mode refuses it
    (12, 1920, 1080, 25.0, "mp4"),
    (61, 854, 480, 30.0, "mkv"),
]
_TURNS = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
    {"role": "assistant", "content": "A square."},
]
_MIXED = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                                 {"type": "text", "text": "then"}, {"type": "video"}]},
    {"role": "assistant", "content": "Both move."},
]  # fmt: skip


@functools.cache
def _pre(mode: str) -> Preprocessor:
    return Preprocessor(processor=processor_with_video("internvl", chat_template=_TEMPLATE, **_FRAME, **_MODES[mode]))


@functools.cache
def _clip(frames: int, width: int, height: int, fps: float, container: str, seed: int = 0) -> bytes:
    return encode_clip(frames, width, height, fps, container, seed)


def _all_frames(clip: bytes) -> torch.Tensor:
    """``[T, H, W, 3]`` uint8, every frame. A tensor, not an array: transformers' ``sample_frames`` path
    indexes the clip with its indices tensor, and a numpy clip indexed by a one-element tensor loses its
    time axis (video_processing_utils.py ``video[indices]``), failing every one-frame sampling."""
    import av

    with av.open(io.BytesIO(clip)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    return torch.from_numpy(np.stack(frames))


def _picture(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def _own(pre: Preprocessor, images: list, clips: list[bytes], conversation: list) -> dict:
    """The processor's own output for the rendered prompt, given every frame of each clip to sample itself."""
    from vlm_pack.processing.render import _render

    proc = pre.processor
    text = _render(conversation, proc.tokenizer, proc, None, None, len(images), "own", num_videos=len(clips)).text
    metadata = [read_video_header(c).metadata() for c in clips]
    return proc(
        text=[text], images=[images] if images else None, videos=[_all_frames(c) for c in clips],
        video_metadata=metadata, return_tensors="pt",
    )  # fmt: skip


def _frames_in(ids: torch.Tensor, tokenizer) -> int:
    """``Frame{i}:`` lines the processor wrote (``<img>`` runs after the text ``Frame``)."""
    return tokenizer.decode(ids).count("Frame")


@pytest.mark.parametrize("mode", list(_MODES))
def test_forecast_is_the_processors_own_length_per_clip(mode):
    """Header only (no decode) against the processor's own output on the whole clip: input_ids length and
    image tokens; and the processed sample (kept frames only) is that output token for token."""
    pre = _pre(mode)
    seq = pre.processor.image_seq_length
    image_id = pre.processor.image_token_id
    checked = refused = 0
    for k, spec in enumerate(_CLIPS):
        if mode == "all" and spec[0] > 16:
            continue  # every frame of a long clip is slow on a CPU; the sampled modes cover them
        clip = _clip(*spec, seed=k)
        forecast = pre.forecast_rows([(_TURNS, [], k, [read_video_header(clip)])])[0]
        try:
            own = _own(pre, [], [clip], _TURNS)
        except (ValueError, ZeroDivisionError) as exc:  # 8 of 1 frame; fps=2 of a 0.35 s clip: none to keep
            assert isinstance(forecast, ValueError) and "cannot sample frames" in str(forecast), (spec, exc)
            refused += 1
            continue
        assert not isinstance(forecast, Exception), (spec, forecast)
        kept = int((own["input_ids"][0] == image_id).sum()) // seq
        assert forecast.length == own["input_ids"].shape[1], (mode, spec)
        assert forecast.video_counts == [kept * seq] and forecast.counts == []
        assert _frames_in(own["input_ids"][0], pre.tokenizer) == kept
        if mode == "sampled8":
            assert kept == 8
        if mode == "all":
            assert kept == spec[0]
        sample = pre.process([], _TURNS, key=f"c{k}", videos=[clip])
        assert torch.equal(sample["input_ids"], own["input_ids"][0])
        assert torch.equal(sample["pixel_values"], own["pixel_values"])
        assert sample["tokens_per_video"].tolist() == forecast.video_counts
        checked += 1
    print(f"internvl {mode}: {checked} clips forecast = the processor's own, {refused} refused by both")
    assert checked >= 3


@pytest.mark.parametrize("mode", ["sampled8", "all"])
def test_forecast_with_images_and_two_videos(mode):
    """A tiled image between two clips: lengths, counts, the image's block start, pixel rows in prompt order."""
    pre = _pre(mode)
    # every frame kept: equal counts (InternVL's processor takes a sample's videos only so, test below)
    clips = [_clip(9, 96, 64, 5.0, "mkv", 1), _clip(9 if mode == "all" else 12, 64, 128, 6.0, "mp4", 2)]
    picture = _picture(700, 300, 3)  # 448 px tiles: several crops and a thumbnail
    after = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "vs"}, {"type": "image"}]},
             {"role": "assistant", "content": "Ok."}]  # fmt: skip
    for images, videos, conversation in [
        ([picture], clips, _MIXED),
        ([picture], clips[1:], [{"role": "user", "content": "<image>Look <video> now"},
                                {"role": "assistant", "content": "Ok."}]),
        ([picture], clips[:1], after),  # the image's block starts past the video's frames
    ]:  # fmt: skip
        row = (conversation, [im.size for im in images], "m", [read_video_header(c) for c in videos])
        forecast = pre.forecast_rows([row])[0]
        assert not isinstance(forecast, Exception), forecast
        own = _own(pre, images, videos, conversation)
        sample = pre.process(images, conversation, key="m", videos=videos)
        assert forecast.length == own["input_ids"].shape[1] == len(sample["input_ids"])
        assert torch.equal(sample["input_ids"], own["input_ids"][0])
        assert torch.equal(sample["pixel_values"], own["pixel_values"])  # image tiles and frames, in order
        assert forecast.counts == sample["tokens_per_image"].tolist()
        assert forecast.video_counts == sample["tokens_per_video"].tolist()
        blocks = (sample["input_ids"] == pre.tokenizer.convert_tokens_to_ids("<img>")).nonzero()[:, 0].tolist()
        frames_before = 0
        if conversation is after:  # its <img> comes after the first video's frames' <img>s
            frames_before = sample["tokens_per_video"][0].item() // pre.processor.image_seq_length
        assert forecast.starts == [blocks[frames_before]]
        total = int((sample["input_ids"] == pre.processor.image_token_id).sum())
        assert total == sum(forecast.counts) + sum(forecast.video_counts)


def test_videos_keeping_different_frame_counts_are_refused_as_the_processor_refuses_them():
    """InternVLProcessor stacks a sample's videos and reads one frame count off them: with 9 and 12 frames it
    fails. The forecast and the processing refuse the sample up front (bad data, naming it and the fix)."""
    from vlm_pack.failures import SampleError

    pre = _pre("all")
    clips = [_clip(9, 96, 64, 5.0, "mkv", 1), _clip(12, 64, 128, 6.0, "mp4", 2)]
    conversation = [{"role": "user", "content": "<video><video>?"}, {"role": "assistant", "content": "."}]
    with pytest.raises(ValueError, match="stack expects each tensor to be equal size"):
        _own(pre, [], clips, conversation)
    forecast = pre.forecast_rows([(conversation, [], "two", [read_video_header(c) for c in clips])])[0]
    assert isinstance(forecast, SampleError) and "sample 'two': its videos keep [9, 12] frames" in str(forecast)
    with pytest.raises(SampleError, match=r"sample 'two'.*num_frames=N") as err:
        pre.process([], conversation, key="two", videos=clips)
    assert err.value.reason == "decode_error"


def test_a_clip_with_fewer_frames_than_asked_is_refused_before_decoding():
    """InternVL's sample_frames refuses num_frames > the clip's frames: the forecast says so, naming the fix,
    and processing counts it as bad data (decode_error), never decoding it."""
    from vlm_pack.failures import SampleError

    pre = _pre("sampled8")
    clip = _clip(5, 64, 64, 5.0, "mp4", 4)
    forecast = pre.forecast_rows([(_TURNS, [], "short", [read_video_header(clip)])])[0]
    assert isinstance(forecast, ValueError) and "cannot sample frames of a 5-frame clip" in str(forecast)
    with pytest.raises(SampleError, match=r"sample 'short', video 0.*5-frame clip") as err:
        pre.process([], _TURNS, key="short", videos=[clip])
    assert err.value.reason == "decode_error"


# ----------------------------------------------------------------------------- packed == alone (tiny model)


@functools.cache
def _model():
    return offline.tiny_model("internvl", _pack_pre().tokenizer, initializer_range=0.2, seed=0)


@functools.cache
def _pack_pre() -> Preprocessor:
    proc = processor_with_video("internvl", chat_template=_TEMPLATE, do_sample_frames=True, num_frames=3, **_FRAME)
    return Preprocessor(processor=proc)


@functools.cache
def _samples() -> tuple:
    """A video alone, a video after an image, text only, two videos around an image: one row's worth."""
    pre = _pack_pre()
    video_a, video_b = _clip(10, 96, 64, 5.0, "mp4", 1), _clip(12, 64, 128, 6.0, "mkv", 2)
    picture = _picture(90, 60, 3)
    cases = [
        ([], [video_a], _TURNS),
        ([picture], [video_b], [{"role": "user", "content": "<image>Compare it with <video> please."},
                                {"role": "assistant", "content": "The clip moves, the picture stays."}]),
        ([], [], [{"role": "user", "content": "Say something short."}, {"role": "assistant", "content": "Short."}]),
        ([picture], [video_b, video_a], _MIXED),
    ]  # fmt: skip
    out = []
    for k, (images, videos, conversation) in enumerate(cases):
        sample = pre.process(images, conversation, key=f"internvl/{k}", videos=videos)
        headers = [read_video_header(v) for v in videos]
        length, _ = pre.forecast(conversation, [im.size for im in images], key=k, videos=headers)
        assert length == len(sample["input_ids"]), k
        out.append(sample)
    return tuple(out)


def _report(**kwargs):
    samples = list(_samples())
    capacity = sum(len(s["input_ids"]) for s in samples)
    collator = _pack_pre().collator(capacity, model_config=_model().config, max_samples_per_bin=len(samples))
    batch = collator(samples)
    assert batch.num_rows == 1
    report = check_packed_equivalence(_model(), samples, None, packed_batch=batch, tokenizer=_pack_pre().tokenizer, **kwargs)
    return report, batch


def test_video_samples_packed_equal_alone():
    report, batch = _report()
    print(f"internvl video: token_mult_prob_error {report.metric:.7f}, max |diff| {report.max_abs_diff:.2e}")
    assert report.passed and report.metric <= TOL, str(report)
    frames = sum(len(s.get("pixel_values", ())) for s in _samples())  # the text-only sample has none
    assert batch.pixel_values.shape[0] == frames  # image tiles and video frames of every sample, in row order


def _positions_as_one_sequence(model, batch):
    kwargs = dict(batch.model_inputs("sdpa"))
    rows, length = batch.input_ids.shape
    kwargs["position_ids"] = torch.arange(length).expand(rows, length)
    return model(**kwargs).logits


def test_positions_not_restarted_fail():
    report, _ = _report(packed_forward=_positions_as_one_sequence)
    print(f"internvl video, positions not restarted: token_mult_prob_error {report.metric:.4f}")
    assert not report.passed and report.metric > WRONG, str(report)


def _frames_replaced(model, batch):
    kwargs = dict(batch.model_inputs("sdpa"))
    kwargs["pixel_values"] = torch.randn(kwargs["pixel_values"].shape, generator=torch.Generator().manual_seed(0))
    return model(**kwargs).logits


def test_the_frames_reach_the_logits():
    """Control: the same row with other pixels fails, so the frames' (and images') embeddings are in the check."""
    report, _ = _report(packed_forward=_frames_replaced)
    print(f"internvl video pixels replaced: token_mult_prob_error {report.metric:.4f}")
    assert not report.passed and report.metric > WRONG, str(report)
