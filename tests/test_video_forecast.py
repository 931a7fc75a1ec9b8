"""Video forecasts from the container header equal the family's own video processor on the decoded frames.

Every clip is encoded by the test with PyAV (tests/video_clips.py: MP4 h264 / mpeg4, WebM VP8 / VP9, MKV
h264 / mpeg4; 1-300 frames; 1-60 fps with 29.97; 64 px to 1920 px; odd and even counts and sizes;
variable-frame-rate MP4 and MKV).
The oracle is outside the code under test: each clip is decoded in full with PyAV, its metadata taken the
way transformers' ``read_video_pyav`` takes it (decoded count, ``stream.average_rate``), and the released
video processor class (or the full processor, for the token counts in ``input_ids``, Qwen2.5-VL's
``second_per_grid_ts`` and Qwen3-VL's timestamp text) runs on those frames with its own sampling.
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.torchvision

av = pytest.importorskip("av")
pytest.importorskip("torchvision")

from video_clips import clip_set  # noqa: E402

from vlm_pack import offline  # noqa: E402
from vlm_pack.failures import InternalCheckError  # noqa: E402
from vlm_pack.vision import VideoHeader, forecast_video, read_video_header, sampled_frames  # noqa: E402


@dataclass
class Clip:
    name: str
    data: bytes
    path: Any
    frames: np.ndarray
    """All decoded frames, ``(T, H, W, 3)`` uint8."""
    fps: float
    """``stream.average_rate``: what transformers' ``read_video_pyav`` tells the processor."""


def _decode(data: bytes) -> tuple[np.ndarray, float]:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


@pytest.fixture(scope="session")
def clips(tmp_path_factory) -> list[Clip]:
    root = tmp_path_factory.mktemp("clips")
    out = []
    for name, data in clip_set():
        ext = "mkv" if "matroska" in name or name.endswith("mkv") else "webm" if "webm" in name else "mp4"
        path = root / f"{name}.{ext}"
        path.write_bytes(data)
        frames, fps = _decode(data)
        out.append(Clip(name, data, path, frames, fps))
    return out


def _oracle_metadata(clip: Clip) -> Any:
    from transformers.video_utils import VideoMetadata

    t, h, w, _ = clip.frames.shape
    return VideoMetadata(total_num_frames=t, fps=clip.fps, width=w, height=h, duration=t / clip.fps)


@pytest.fixture(scope="session")
def headers(clips) -> dict[str, VideoHeader]:
    # Half from paths, half from bytes: both sources are read the same way.
    return {c.name: read_video_header(c.path if i % 2 else c.data) for i, c in enumerate(clips)}


def test_the_clip_set_covers_the_issue(clips):
    counts = [len(c.frames) for c in clips]
    sizes = [max(c.frames.shape[1:3]) for c in clips]
    assert len(clips) >= 60 and min(counts) == 1 and max(counts) == 300
    assert {n % 2 for n in counts} == {0, 1} and min(sizes) == 64 and max(sizes) == 1920
    assert {c.name.split("-")[0] for c in clips} >= {"mp4", "webm", "matroska", "vfr"}
    assert any(abs(c.fps - 30000 / 1001) < 1e-9 for c in clips) and {1.0, 60.0} <= {c.fps for c in clips}


def test_a_header_read_equals_a_full_decode_on_every_clip(clips, headers):
    for clip in clips:
        header = headers[clip.name]
        t, h, w, _ = clip.frames.shape
        assert (header.frames, header.width, header.height, header.fps) == (t, w, h, clip.fps), clip.name
        expected = "header" if clip.name.startswith(("mp4", "vfr-mp4", "rotated")) else "demux"  # edit list
        assert header.how == expected, clip.name
        assert header.duration is not None and header.duration > 0, clip.name
    vfr = headers["vfr-mp4"]
    # 40 frames over 2.5 s of irregular steps: the mean rate, not the 30 fps the frames were encoded at.
    assert vfr.fps == pytest.approx(16.0) and vfr.duration == pytest.approx(2.5)
    assert headers["editlist-mp4"].frames == 37  # 40 samples, 3 trimmed by the edit list
    # PyAV hands frames out as coded: the display matrix's 90 degrees are reported, not applied.
    with av.open(io.BytesIO(next(c.data for c in clips if c.name == "rotated-mp4"))) as container:
        assert next(container.decode(video=0)).rotation == 90
    assert (headers["rotated-mp4"].width, headers["rotated-mp4"].height) == (96, 64)


class _NoDecode:
    """A PyAV input container whose ``decode`` fails the test: the header path must never call it."""

    def __init__(self, container: Any) -> None:
        self._container = container

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the forecast decoded frames")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)


def test_a_clip_over_budget_is_refused_without_decoding_a_frame(clips, monkeypatch):
    proc = _full("qwen3_vl", _video_processor("Qwen3VLVideoProcessor", **_QWEN3))
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: _NoDecode(real_open(*a, **k)))
    capacity = 1024
    refused = []
    for clip in clips:
        header = read_video_header(clip.data)
        if len(clip.frames) >= 2 and forecast_video(header, proc).tokens > capacity:
            refused.append(clip.name)
    # At the released 25165824-pixel budget the 1080p and 720p clips are over 1024 tokens (4080, 2040,
    # 1760; test_qwen3_vl_tokens_grid_and_timestamps proves these counts); the rest fit.
    assert sorted(refused) == ["matroska-h264-5f-29.97fps-1280x720", "mp4-h264-3f-30fps-1920x1080",
                               "webm-libvpx-vp9-2f-25fps-1080x1920"]  # fmt: skip


def test_a_file_object_is_read_and_left_where_it_was(clips):
    clip = clips[3]
    fp = io.BytesIO(clip.data)
    fp.seek(7)
    assert read_video_header(fp).frames == len(clip.frames) and fp.tell() == 7


def _audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("pcm_s16le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def test_unreadable_and_videoless_containers_raise_errors_naming_the_video_and_the_fix(clips, tmp_path):
    with pytest.raises(ValueError, match=r"<4096 bytes of video>: not a readable video container .*drop"):
        read_video_header(bytes(range(256)) * 16)
    mp4 = next(c for c in clips if c.name.startswith("mp4") and len(c.frames) > 30)
    path = tmp_path / "cut.mp4"
    path.write_bytes(mp4.data[: len(mp4.data) // 3])  # the index (moov) is written last: lost
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: not a readable video container.*ffmpeg"):
        read_video_header(path)
    with pytest.raises(ValueError, match=r"clip-7: the container has no video stream .*'audio'"):
        read_video_header(_audio_only(), name="clip-7")
    with pytest.raises(ValueError, match="not a readable video container"):
        read_video_header(tmp_path / "missing.mp4")


def test_without_pyav_the_error_names_the_extra(monkeypatch, clips):
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ImportError, match=re.escape('pip install "vlm-pack[video]"')):
        read_video_header(clips[0].data)


# --- the families: released video processor settings, processors built offline ---------------------------

_QWEN2 = dict(size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14, merge_size=2,
              temporal_patch_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
              image_std=[0.26862954, 0.26130258, 0.27577711])  # fmt: skip
# Qwen/Qwen3-VL-*-Instruct video_preprocessor_config.json (Qwen3.5's is the same).
_QWEN3 = dict(size={"shortest_edge": 4096, "longest_edge": 25165824}, patch_size=16, merge_size=2,
              temporal_patch_size=2, fps=2, min_frames=4, max_frames=768, do_sample_frames=True,
              image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip


def _video_processor(cls_name: str, **params: Any) -> Any:
    import transformers

    return getattr(transformers, cls_name)(**params)


def _full(family: str, video_processor: Any) -> Any:
    proc = offline.processor(family)
    proc.video_processor = video_processor
    return proc


def _run(fn, *args, **kwargs) -> tuple[Any, BaseException | None]:
    try:
        return fn(*args, **kwargs), None
    except (ValueError, ZeroDivisionError, RuntimeError) as exc:
        return None, exc


def _project(fc: Any, key: str) -> Any:
    """A forecast field in the oracle's terms."""
    if key == "indices":
        return list(fc.indices)
    if key == "seconds":
        return [f"{t:.1f}" for t in fc.timestamps]
    if key == "second_per_grid_t":  # the processor returns it as a float32 tensor
        return float(np.float32(fc.second_per_grid_t))
    return {"grid": fc.grid_thw, "tokens": fc.tokens}[key]


def _compare(clips, headers, forecast, oracle, max_frames: int | None = None) -> dict:
    """Forecast vs oracle on every clip: {"compared": [...], "refused": [...], "mismatch": [...]}."""
    report: dict[str, list] = {"compared": [], "refused": [], "mismatch": []}
    for clip in clips:
        if max_frames is not None and len(clip.frames) > max_frames:
            continue
        expected, error = _run(oracle, clip)
        got, refusal = _run(forecast, headers[clip.name])
        if error is not None or refusal is not None:
            # The processor fails on the clip exactly where the forecast refuses it, with a ValueError.
            if error is None or not isinstance(refusal, ValueError):
                report["mismatch"].append((clip.name, repr(error), repr(refusal)))
            else:
                report["refused"].append(clip.name)
            continue
        report["compared"].append(clip.name)
        observed = {key: _project(got, key) for key in expected}
        if observed != expected:
            report["mismatch"].append((clip.name, expected, observed))
    return report


def _video_oracle(vp: Any, merge: int = 2):
    """The video processor alone on all decoded frames, its own sampling on: grid, tokens, kept frames."""

    def oracle(clip: Clip) -> dict:
        out = vp(videos=[clip.frames], video_metadata=[_oracle_metadata(clip)], return_metadata=True)
        grid = tuple(int(v) for v in out["video_grid_thw"][0])
        kept = out["video_metadata"][0].frames_indices
        indices = list(range(len(clip.frames))) if kept is None else [int(i) for i in kept]
        return {"indices": indices, "grid": grid, "tokens": grid[0] * grid[1] * grid[2] // merge**2}

    return oracle


_SECONDS = re.compile(r"<(\d+\.\d) seconds>")


def _processor_oracle(
    proc: Any, prompt: str, token: str, *, seconds: bool = False, spgt: bool = False, **call_kwargs: Any
):
    """The full processor: placeholder tokens counted in ``input_ids``, and what it prints or returns."""
    token_id = proc.tokenizer.convert_tokens_to_ids(token)

    def oracle(clip: Clip) -> dict:
        out = proc(text=[prompt], videos=[clip.frames], video_metadata=[_oracle_metadata(clip)],
                   return_tensors="pt", **call_kwargs)  # fmt: skip
        ids = np.asarray(out["input_ids"][0])
        result: dict[str, Any] = {"tokens": int((ids == token_id).sum())}
        if "video_grid_thw" in out:
            result["grid"] = tuple(int(v) for v in out["video_grid_thw"][0])
        if seconds:
            result["seconds"] = _SECONDS.findall(proc.tokenizer.decode(ids))
        if spgt:
            result["second_per_grid_t"] = float(out["second_per_grid_ts"][0])
        return result

    return oracle


def _assert_all_match(report: dict, at_least: int) -> None:
    assert not report["mismatch"], report["mismatch"][:5]
    assert len(report["compared"]) >= at_least, (len(report["compared"]), report["refused"])


_QWEN_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"


def test_qwen2_vl_released_settings_every_frame(clips, headers):
    vp = _video_processor("Qwen2VLVideoProcessor", **_QWEN2)  # released: do_sample_frames off
    report = _compare(clips, headers, lambda h: forecast_video(h, vp), _video_oracle(vp))
    _assert_all_match(report, at_least=60)
    assert report["refused"] == []


def test_qwen2_vl_sampling_at_2_fps_with_the_per_frame_pixel_cap(clips, headers):
    # A small max_video_tokens makes Qwen2-VL's cap (its own rule, not Qwen3-VL's) bind on most clips.
    vp = _video_processor("Qwen2VLVideoProcessor", **_QWEN2, do_sample_frames=True, fps=2,
                          cap_pixels_per_frame=True, max_video_tokens=300)  # fmt: skip
    report = _compare(clips, headers, lambda h: forecast_video(h, vp), _video_oracle(vp))
    _assert_all_match(report, at_least=50)
    one = next(c for c in clips if len(c.frames) == 1)
    assert one.name in report["refused"]  # sampling keeps 0 frames of 1: the processor fails, we refuse
    some = next(c for c in clips if len(c.frames) == 300)
    assert sampled_frames(headers[some.name], vp) == _video_oracle(vp)(some)["indices"]
    uncapped = forecast_video(headers[some.name], vp, cap_pixels_per_frame=False).tokens
    assert forecast_video(headers[some.name], vp).tokens < uncapped


def test_qwen2_5_vl_tokens_and_second_per_grid_ts(clips, headers):
    vp = _video_processor("Qwen2VLVideoProcessor", **_QWEN2, do_sample_frames=True, fps=2)
    proc = _full("qwen2_5_vl", vp)
    oracle = _processor_oracle(proc, _QWEN_PROMPT, "<|video_pad|>", spgt=True)
    report = _compare(clips, headers, lambda h: forecast_video(h, proc), oracle)
    _assert_all_match(report, at_least=50)


def test_qwen3_vl_tokens_grid_and_timestamps(clips, headers):
    proc = _full("qwen3_vl", _video_processor("Qwen3VLVideoProcessor", **_QWEN3))
    oracle = _processor_oracle(proc, _QWEN_PROMPT, "<|video_pad|>", seconds=True)
    report = _compare(clips, headers, lambda h: forecast_video(h, proc), oracle)
    _assert_all_match(report, at_least=60)
    assert report["refused"] == [c.name for c in clips if len(c.frames) == 1]  # 1 frame < temporal patch


def test_qwen3_5_with_the_per_frame_pixel_cap_passed_at_call_time(clips, headers):
    proc = _full("qwen3_5", _video_processor("Qwen3VLVideoProcessor", **_QWEN3))
    oracle = _processor_oracle(proc, _QWEN_PROMPT, "<|video_pad|>", seconds=True, cap_pixels_per_frame=True)
    report = _compare(clips, headers, lambda h: forecast_video(h, proc, cap_pixels_per_frame=True), oracle)
    _assert_all_match(report, at_least=60)
    big = headers["mp4-h264-3f-30fps-1920x1080"]
    # The cap matters: 4 kept frames of 1080p get 768 tokens' worth of pixels each instead of the clip budget.
    assert forecast_video(big, proc, cap_pixels_per_frame=True).tokens < forecast_video(big, proc).tokens


# LLaVA-OneVision and InternVL resize every frame to one size: the released settings (every frame) on the
# clips of up to 16 frames, then the processors' own uniform sampling of 8 frames on all.
_OV = dict(size={"height": 384, "width": 384}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
_INTERNVL = dict(size={"height": 448, "width": 448}, image_mean=[0.485, 0.456, 0.406],
                 image_std=[0.229, 0.224, 0.225])  # fmt: skip


@pytest.mark.parametrize("sample", [False, True], ids=["every-frame", "8-frames"])
def test_llava_onevision_tokens_per_frame_after_pooling(clips, headers, sample):
    extra = dict(do_sample_frames=True, num_frames=8) if sample else {}
    proc = _full("llava_onevision", _video_processor("LlavaOnevisionVideoProcessor", **_OV, **extra))
    oracle = _processor_oracle(proc, proc.video_token, proc.video_token)
    report = _compare(clips, headers, lambda h: forecast_video(h, proc), oracle, None if sample else 16)
    _assert_all_match(report, at_least=35)
    assert report["refused"] == [c.name for c in clips if sample and len(c.frames) < 8]
    assert forecast_video(headers["vfr-mp4"], proc).frame_tokens[0] == 14 * 14  # 27 x 27 patches, pooled
    _assert_same_frames(clips, headers, proc.video_processor, sample)


@pytest.mark.parametrize("sample", [False, True], ids=["every-frame", "8-frames"])
def test_internvl_frames_as_images(clips, headers, sample):
    extra = dict(do_sample_frames=True, num_frames=8) if sample else {}
    proc = _full("internvl", _video_processor("InternVLVideoProcessor", **_INTERNVL, **extra))
    oracle = _processor_oracle(proc, proc.video_token, proc.image_token)
    report = _compare(clips, headers, lambda h: forecast_video(h, proc), oracle, None if sample else 16)
    _assert_all_match(report, at_least=35)
    assert report["refused"] == [c.name for c in clips if sample and len(c.frames) < 8]
    _assert_same_frames(clips, headers, proc.video_processor, sample)


def _assert_same_frames(clips, headers, vp: Any, sample: bool) -> None:
    """The frames the decoder must hand over: ``sampled_frames`` = the indices the video processor kept."""
    if not sample:
        return
    for clip in (c for c in clips if len(c.frames) >= 8):
        out = vp(videos=[clip.frames], video_metadata=[_oracle_metadata(clip)], return_metadata=True)
        kept = [int(i) for i in out["video_metadata"][0].frames_indices]
        assert sampled_frames(headers[clip.name], vp) == kept, clip.name


def test_forecast_refusals_name_the_processor_and_the_fix(headers):
    header = headers["vfr-mp4"]
    with pytest.raises(InternalCheckError, match=r"Qwen2VLProcessor has no video processor: build the processor"):
        forecast_video(header, offline.processor("qwen2_vl"))  # the offline processor is built without one
    ov = _video_processor("LlavaOnevisionVideoProcessor", **_OV)
    with pytest.raises(ValueError, match=r"`num_image_tokens`; pass the full processor"):
        forecast_video(header, ov)
    assert forecast_video(header, ov, num_image_tokens=729).tokens == 40 * 196 + 1
    with pytest.raises(InternalCheckError, match=r"takes no video kwargs \['fsp'\]"):
        forecast_video(header, _video_processor("Qwen3VLVideoProcessor", **_QWEN3), fsp=1)
    with pytest.raises(InternalCheckError, match="no video forecast rule for SmolVLMVideoProcessor"):
        forecast_video(header, _video_processor("SmolVLMVideoProcessor"))
