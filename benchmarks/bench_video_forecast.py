"""Video token forecast from the container header against learning each video's length by decoding it.

Same clips (tests/video_clips.py: 69 PyAV-encoded MP4 / WebM / MKV clips, 1-300 frames, 1-60 fps, 64-1920 px,
variable frame rate, an edit list and a rotation included), same run, in-memory bytes, best of ``--repeats`` passes over all clips:

- ``forecast``: ``read_video_header`` (MP4 header, or a demux-only packet count for WebM / MKV) then
  ``forecast_video`` with Qwen3-VL's video processor (released settings: 2 fps sampling);
- ``decode``: PyAV decodes every frame to count them (how ms-swift and Megatron-Bridge learn lengths: they
  load the video before choosing packs);
- ``decode+process``: decode to RGB arrays, then the video processor itself (ms-swift's full encode pass).

Lengths must be identical: the header's frame count = the decoded count, and the forecast's tokens = the
processor's ``video_grid_thw`` on the decoded frames, for every clip (asserted).

The test clips are small (most 64-320 px, 1-300 frames), where a decode is cheap; a second table times
training-sized clips (10 s of 640x360 to 1920x1080, encoded here) against ``decode`` only (their RGB
frames would not fit the processor pass in memory on a small machine).

Run: ``/work/venv-tv/bin/python benchmarks/bench_video_forecast.py [--repeats 3]`` (needs av + torchvision).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from video_clips import _encode, clip_set

from vlm_pack.vision import forecast_video, read_video_header

QWEN3 = dict(size={"shortest_edge": 4096, "longest_edge": 25165824}, patch_size=16, merge_size=2,
             temporal_patch_size=2, fps=2, min_frames=4, max_frames=768, do_sample_frames=True,
             image_mean=[0.5] * 3, image_std=[0.5] * 3, cap_pixels_per_frame=False)  # fmt: skip


def decoded_count(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        return sum(1 for _ in container.decode(video=0))


def decode_and_process(data: bytes, vp) -> int | None:
    from transformers.video_utils import VideoMetadata

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames.shape[2], height=frames.shape[1])
    try:
        t, h, w = vp(videos=[frames], video_metadata=[meta])["video_grid_thw"][0].tolist()
    except ValueError:  # a 1-frame clip: fewer frames than the temporal patch
        return None
    return t * h * w // 4


def forecast(data: bytes, vp) -> tuple[int, int | None]:
    """(frames, tokens); tokens None where the processor refuses the clip (the forecast says so first)."""
    header = read_video_header(data)
    try:
        return header.frames, forecast_video(header, vp).tokens
    except ValueError:
        return header.frames, None


def best(fn: Callable[[bytes], object], items: list[bytes], repeats: int) -> tuple[float, list[object]]:
    """Best wall time in seconds of one pass of ``fn`` over ``items``, and the last pass's results."""
    times, out = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = [fn(item) for item in items]
        times.append(time.perf_counter() - start)
    return min(times), out


LONG = [
    ("mp4", "h264", 300, 30, 1280, 720),
    ("matroska", "h264", 300, Fraction(30000, 1001), 1280, 720),
    ("webm", "libvpx", 250, 25, 640, 360),
    ("mp4", "h264", 600, 60, 1920, 1080),
]


GROUPS = {
    "mp4": "MP4",
    "webm": "WebM",
    "matroska": "MKV",
    "vfr": "VFR",
    "editlist": "MP4 EL",
    "rotated": "MP4 rot",
}


def group(name: str) -> str:
    return GROUPS[name.split("-")[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import Qwen3VLVideoProcessor

    vp = Qwen3VLVideoProcessor(**QWEN3)
    clips = clip_set()
    rows: dict[str, dict[str, list]] = {}
    for name, data in clips:
        rows.setdefault(group(name), {"data": [], "names": []})
        rows[group(name)]["data"].append(data)
        rows[group(name)]["names"].append(name)
    print(f"# python {platform.python_version()}, av {av.__version__}, cpus {len(os.sched_getaffinity(0))}")
    print(f"{len(clips)} clips, best of {args.repeats} passes; rates in videos/s")
    print(f"{'clips':6} {'n':>3} {'frames':>7} {'forecast/s':>11} {'decode/s':>9} {'dec+proc/s':>11} "
          f"{'vs decode':>10} {'vs dec+proc':>12}")  # fmt: skip
    totals = {"forecast": 0.0, "decode": 0.0, "process": 0.0, "n": 0, "frames": 0}
    for label, row in rows.items():
        data = row["data"]
        t_fc, fc = best(lambda d: forecast(d, vp), data, args.repeats)
        t_dec, counts = best(decoded_count, data, args.repeats)
        t_proc, tokens = best(lambda d: decode_and_process(d, vp), data, 1)
        for name, (frames, fc_tokens), count, processed in zip(row["names"], fc, counts, tokens):
            assert frames == count, (name, frames, count)
            assert fc_tokens == processed, (name, fc_tokens, processed)
        n, frames_total = len(data), sum(counts)
        print(f"{label:6} {n:>3} {frames_total:>7} {n / t_fc:>11,.0f} {n / t_dec:>9,.1f} {n / t_proc:>11,.1f} "
              f"{t_dec / t_fc:>9.0f}x {t_proc / t_fc:>11.0f}x")  # fmt: skip
        for key, value in (("forecast", t_fc), ("decode", t_dec), ("process", t_proc)):
            totals[key] += value
        totals["n"] += n
        totals["frames"] += frames_total
    n = totals["n"]
    print(f"{'all':6} {n:>3} {totals['frames']:>7} {n / totals['forecast']:>11,.0f} {n / totals['decode']:>9,.1f} "
          f"{n / totals['process']:>11,.1f} {totals['decode'] / totals['forecast']:>9.0f}x "
          f"{totals['process'] / totals['forecast']:>11.0f}x")  # fmt: skip
    print("lengths identical: header frames = decoded frames, forecast tokens = processor tokens, every clip")
    long_table(vp, args.repeats)


def long_table(vp, repeats: int) -> None:
    """Training-sized clips: header forecast against a decode that counts the frames."""
    print(f"\ntraining-sized clips, best of {repeats} passes; ms per video")
    print(
        f"{'clip':38} {'MiB':>5} {'frames':>6} {'how':>6} {'forecast ms':>12} {'decode ms':>10} {'ratio':>7}"
    )
    for fmt, codec, n, rate, w, h in LONG:
        data = _encode(fmt, codec, n, Fraction(rate), w, h)
        t_fc, fc = best(lambda d: forecast(d, vp), [data], repeats)
        t_dec, counts = best(decoded_count, [data], repeats)
        assert fc[0][0] == counts[0], (fmt, codec, fc, counts)
        how = read_video_header(data).how
        name = f"{fmt}-{codec}-{n}f-{float(rate):g}fps-{w}x{h}"
        print(f"{name:38} {len(data) / 2**20:>5.1f} {counts[0]:>6} {how:>6} {t_fc * 1e3:>12.2f} "
              f"{t_dec * 1e3:>10.0f} {t_dec / t_fc:>6.0f}x")  # fmt: skip


if __name__ == "__main__":
    main()
