"""Video samples through the processor: decoding only the kept frames, the processor's own output as the
oracle, the one forecast equal to the processed length, and bad videos counted with their reason.

Oracles from outside the code under test: PyAV decoding the whole clip, and the family's HF processor given
that whole clip to sample itself (``processor(text=..., videos=[all frames], video_metadata=...)``).
Conversation tests run anywhere; the rest need torchvision (transformers' video processors) and PyAV.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from vlm_pack.failures import InternalCheckError, SampleError, skip_reason
from vlm_pack.processing.chat import (
    VIDEO_MARKER,
    ChatFormat,
    chat_format,
    normalise_conversation,
    render_conversation,
)

_TEMPLATES = Path(__file__).parent / "templates"
_VIDEO = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    # sampling on (2 fps): the processor's own sample_frames chooses the frames, the decoder keeps only them
    "qwen2_5_vl": dict(
        size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28},
        cap_pixels_per_frame=False,
        do_sample_frames=True,
        fps=2,
    ),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32}, cap_pixels_per_frame=False),
    "llava_onevision": dict(do_sample_frames=True, num_frames=4),
    # Qwen3.5: Qwen3-VL's processor and timestamps (its tiny model needs flash-linear-attention to pack)
    "qwen3_5": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32}, cap_pixels_per_frame=False),
}
_IMAGE = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}),
    "llava_onevision": {},
    "qwen3_5": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}),
}
FAMILIES = tuple(_VIDEO)
_VIDEO_TURNS = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
    {"role": "assistant", "content": "A square."},
]


def _needs_video():
    pytest.importorskip("torchvision")
    pytest.importorskip("av")


# ------------------------------------------------------------------------ conversations (no torchvision)


def test_video_parts_and_markers_normalise_alike():
    parts = normalise_conversation([{"role": "user", "content": [{"type": "video_url"}, {"type": "text", "text": "Q"}]}])
    assert parts[0]["content"] == [{"type": "video"}, {"type": "text", "text": "Q"}]
    fmt = chat_format("qwen2_vl")
    marked = [{"role": "user", "content": f"{VIDEO_MARKER}Q"}, {"role": "assistant", "content": "A"}]
    listed = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": "A"},
    ]
    assert fmt.render(marked, 0, 1) == fmt.render(listed, 0, 1)
    text = "".join(t for t, _ in fmt.render(marked, 0, 1))
    assert "<|vision_start|><video><|vision_end|>Q" in text


def test_rendering_writes_the_video_placeholder_and_checks_counts():
    from vlm_pack import offline

    tok = offline.build_tokenizer("qwen2_vl")
    conversation = [
        {"role": "user", "content": "<image> then <video> and <video>"},
        {"role": "assistant", "content": "Yes."},
    ]
    rendering = render_conversation(
        conversation, tokenizer=tok, placeholder="<|image_pad|>", num_images=1, family="qwen2_vl",
        num_videos=2, video_placeholder="<|video_pad|>", key="k1",
    )  # fmt: skip
    assert rendering.text.count("<|video_pad|>") == 2 and rendering.video_placeholder == "<|video_pad|>"
    assert rendering.text.index("<|image_pad|>") < rendering.text.index("<|video_pad|>")
    with pytest.raises(SampleError, match=r"sample 'k2'.*2 video placeholder\(s\) but 1 video") as err:
        render_conversation(
            conversation, tokenizer=tok, placeholder="<|image_pad|>", num_images=1, family="qwen2_vl",
            num_videos=1, video_placeholder="<|video_pad|>", key="k2",
        )  # fmt: skip
    assert err.value.reason == "placeholder_mismatch"
    template = (_TEMPLATES / "qwen2_vl.jinja").read_text()
    with pytest.raises(SampleError, match=r"sample 'k3'.*1 video placeholder\(s\) but 0 video"):
        render_conversation(_VIDEO_TURNS, tokenizer=tok, placeholder="<|image_pad|>", num_images=0,
                            template=template, key="k3")  # a video part, but no video given
    # no video part anywhere: the videos open the first user turn, after the images
    plain = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    text = render_conversation(
        plain, tokenizer=tok, placeholder="<|image_pad|>", num_images=1, template=template,
        num_videos=1, video_placeholder="<|video_pad|>",
    ).text  # fmt: skip
    assert "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Q" in text
    with pytest.raises(ValueError, match="has no video"):
        ChatFormat("plain", "{role}: ", "\n", "<image>").render(plain, 0, 1)


# ------------------------------------------------------------------------------------ decoding (PyAV)


@functools.cache
def _clip(frames: int = 10, width: int = 96, height: int = 64, fps: float = 5.0, container: str = "mp4", seed: int = 0):
    from vlm_pack.testing import encode_clip

    return encode_clip(frames, width, height, fps, container, seed)


def _all_frames(clip: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(clip)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


@pytest.mark.torchvision
@pytest.mark.parametrize("container", ["mp4", "mkv", "webm"])
def test_decode_frames_keeps_only_the_asked_frames(container):
    pytest.importorskip("av")
    from vlm_pack.processing.videos import decode_frames

    clip = _clip(11, 64, 48, 6.0, container, 4)
    full = _all_frames(clip)
    indices = [0, 3, 3, 7, 10]
    got = decode_frames(clip, indices, "clip")
    assert got.shape == (5, 48, 64, 3) and got.dtype == np.uint8
    assert np.array_equal(got, full[indices])


@pytest.mark.torchvision
def test_decoding_holds_the_kept_frames_not_the_clip():
    """Peak traced memory (numpy reports its buffers to tracemalloc) while keeping 2 of 60 frames stays near
    2 frames; keeping all 60 costs 60 (so the measure sees frames at all)."""
    pytest.importorskip("av")
    import tracemalloc

    from vlm_pack.processing.videos import decode_frames

    clip = _clip(60, 128, 96, 10.0, "mp4", 8)
    frame = 128 * 96 * 3
    decode_frames(clip, [0], "warm-up")  # imports and codec set-up are not the frames
    peaks = {}
    for kept in ([0, 59], list(range(60))):
        tracemalloc.start()
        decode_frames(clip, kept, "clip")
        peaks[len(kept)] = tracemalloc.get_traced_memory()[1] / frame
        tracemalloc.stop()
    assert peaks[2] < 4 and peaks[60] > 55, peaks


@pytest.mark.torchvision
def test_a_truncated_clip_is_a_decode_error_naming_it():
    """Cut short: a plain MP4 loses its index (written last) and does not open; a "faststart" MP4 keeps its
    index up front, states 30 frames and yields fewer: both bad data, naming the video."""
    pytest.importorskip("av")
    from vlm_pack.processing.videos import decode_frames
    from vlm_pack.testing.clips import truncated_clip
    from vlm_pack.vision.video import read_video_header

    plain = _clip(30, 64, 48, 10.0, "mp4", 5)
    with pytest.raises(SampleError, match="clip 7 does not decode") as err:
        decode_frames(plain[: len(plain) * 2 // 3], [0, 29], "clip 7")
    assert err.value.reason == "decode_error"
    cut = truncated_clip(30, 64, 48)
    assert read_video_header(cut).frames == 30  # the header still says 30
    with pytest.raises(SampleError, match=r"clip 8 does not decode: it yields \d+ frame\(s\), but frame 29") as err:
        decode_frames(cut, [0, 29], "clip 8")
    assert err.value.reason == "decode_error"
    assert len(decode_frames(cut, [0, 5], "clip 8")) == 2  # the frames it holds still decode


# ------------------------------------------------------------------------- processing through HF processors


@functools.cache
def _processor(family: str):
    from vlm_pack.testing import processor_with_video

    template = _TEMPLATES / f"{family}.jinja"
    chat_template = template.read_text() if template.exists() else None
    return processor_with_video(family, chat_template=chat_template, image_overrides=_IMAGE[family], **_VIDEO[family])


@pytest.mark.torchvision
@pytest.mark.parametrize("family", FAMILIES)
def test_processed_video_is_the_processors_own_output(family):
    """Oracle: the processor given the WHOLE decoded clip and its metadata, sampling frames itself."""
    _needs_video()
    from vlm_pack import Preprocessor
    from vlm_pack.vision.video import read_video_header

    proc = _processor(family)
    pre = Preprocessor(processor=proc)
    clip = _clip(13, 96, 64, 5.0, "mkv", 6)
    sample = pre.process([], _VIDEO_TURNS, key="v0", videos=[clip])
    from vlm_pack.processing.render import _render

    text = _render(_VIDEO_TURNS, proc.tokenizer, proc, None, None, 0, "v0", num_videos=1).text
    metadata = read_video_header(clip).metadata()
    own = proc(text=[text], videos=[_all_frames(clip)], video_metadata=[metadata], return_tensors="pt")
    assert torch.equal(sample["input_ids"], own["input_ids"][0])
    assert torch.equal(sample["pixel_values_videos"], own["pixel_values_videos"])
    for name in ("video_grid_thw", "second_per_grid_ts", "mm_token_type_ids"):
        if name in own:
            torch.testing.assert_close(sample[name].reshape(-1), own[name].reshape(-1).to(sample[name].dtype))
    video_id = proc.video_token_id
    assert int(sample["tokens_per_video"].sum()) == int((sample["input_ids"] == video_id).sum())
    trained = sample["input_ids"][sample["labels"] != -100]
    assert proc.tokenizer.decode(trained).startswith("A square.")  # only the answer (and its end of turn)


@pytest.mark.torchvision
@pytest.mark.parametrize("family", FAMILIES)
def test_forecast_equals_processed_length_for_video_and_mixed_samples(family):
    """The one forecast (header only, no decode) against the processed sample, image starts included."""
    _needs_video()
    from PIL import Image

    from vlm_pack import Preprocessor
    from vlm_pack.vision.video import read_video_header

    pre = Preprocessor(processor=_processor(family))
    picture = Image.new("RGB", (90, 60), (20, 140, 60))
    clips = [_clip(9, 96, 64, 5.0, "mp4", 1), _clip(12, 64, 128, 6.0, "mkv", 2), _clip(8, 80, 80, 4.0, "webm", 3)]
    cases = [
        ([], clips[:1], _VIDEO_TURNS),
        ([picture], clips[:2], [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"},
                                         {"type": "text", "text": "then"}, {"type": "video"}]},
            {"role": "assistant", "content": "Both move."},
        ]),
        ([picture], clips[2:], [{"role": "user", "content": "<image>Look <video> now"},
                                {"role": "assistant", "content": "Ok."}]),
    ]  # fmt: skip
    rows = [(conv, [im.size for im in ims], k, [read_video_header(c) for c in vids]) for k, (ims, vids, conv) in enumerate(cases)]
    forecasts = pre.forecast_rows(rows)
    image_id = pre.processor.image_token_id
    for (images, videos, conversation), forecast, row in zip(cases, forecasts, rows):
        assert not isinstance(forecast, Exception), forecast
        sample = pre.process(images, conversation, videos=videos)
        length, _, prompt = pre.forecast_prompt(*row[:3], videos=row[3])  # rendered once, processed with it
        again = pre.process(images, conversation, prompt=prompt, videos=videos)
        assert length == forecast.length and torch.equal(again["input_ids"], sample["input_ids"])
        assert forecast.length == len(sample["input_ids"])
        assert forecast.video_counts == sample["tokens_per_video"].tolist()
        assert forecast.counts == sample["tokens_per_image"].tolist()
        if images:  # the image's block: its first image token (the template writes any wrapper)
            assert forecast.starts == [int((sample["input_ids"] == image_id).nonzero()[0])]


@pytest.mark.torchvision
def test_a_corrupt_video_is_bad_data_naming_the_sample():
    _needs_video()
    from vlm_pack import Preprocessor

    pre = Preprocessor(processor=_processor("qwen2_vl"))
    clip = _clip()
    broken = clip[:200] + bytes(len(clip) - 200)
    with pytest.raises(SampleError, match=r"sample 'shard-1/k7', video 0") as err:
        pre.process([], _VIDEO_TURNS, key="shard-1/k7", videos=[broken])
    assert err.value.reason == "decode_error"
    assert skip_reason(err.value, "decode_error", "k7") == "decode_error"
    # in a pack: that sample is its error, the other sample is processed
    out = pre.process_pack([([], _VIDEO_TURNS, [broken]), ([], _VIDEO_TURNS, [clip])], keys=["bad", "good"])
    assert isinstance(out[0], SampleError) and out[0].reason == "decode_error" and "'bad'" in str(out[0])
    assert isinstance(out[1], dict) and "pixel_values_videos" in out[1]


@pytest.mark.torchvision
def test_a_forecast_the_processor_disagrees_with_raises_as_a_bug():
    _needs_video()
    import dataclasses

    from vlm_pack.processing import videos as videos_module

    proc = _processor("qwen2_vl")
    (video,) = videos_module.load_videos([_clip()], proc, "k")
    wrong = videos_module.DecodedVideos([dataclasses.replace(video, forecast=dataclasses.replace(video.forecast, tokens=video.forecast.tokens + 4))])
    processed = {"tokens_per_video": torch.tensor([video.forecast.tokens]), "video_grid_thw": torch.tensor([video.forecast.grid_thw])}
    videos_module.check_processed(videos_module.DecodedVideos([video]), processed, "k")
    with pytest.raises(InternalCheckError, match=r"sample 'k', video 0.*disagrees"):
        videos_module.check_processed(wrong, processed, "k")


@pytest.mark.torchvision
def test_videos_need_a_video_processor_the_collapsed_layout_is_theirs_too():
    _needs_video()
    from vlm_pack import offline
    from vlm_pack.processing import process_sample

    # the collapsed layout (one placeholder per video) is tests/test_video_collapsed.py's
    collapsed = process_sample([], _VIDEO_TURNS, processor=_processor("qwen2_vl"), layout="collapsed", videos=[_clip()])
    assert int((collapsed["input_ids"] == _processor("qwen2_vl").video_token_id).sum()) == 1
    with pytest.raises(InternalCheckError, match=r"sample 'p'.*video processor"):
        process_sample([], _VIDEO_TURNS, processor=offline.processor("qwen2_vl"), key="p", videos=[_clip()])
    import transformers

    smolvlm = transformers.SmolVLMProcessor(
        image_processor=offline.image_processor("smolvlm"),
        tokenizer=offline.build_tokenizer("smolvlm"),
        video_processor=transformers.SmolVLMVideoProcessor(),
        image_seq_len=81,
    )  # its frames become image tokens with timestamp text: no rule here yet, so refused up front
    with pytest.raises(InternalCheckError, match=r"sample 'i'.*not those of SmolVLMVideoProcessor"):
        process_sample([], _VIDEO_TURNS, processor=smolvlm, key="i", videos=[_clip()])
