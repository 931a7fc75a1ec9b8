"""Throughput of ``vlm_pack.vision.image_size`` on in-memory bytes, against Pillow in the same run.

For each format, headers per second of:
- ``image_size(b)`` (hand-written header parsers, EXIF orientation honoured);
- ``PIL.Image.open(BytesIO(b)).size`` (Pillow's lazy open: parses the header, no pixels);
- a full decode, ``Image.open(BytesIO(b)).load()`` (what reading the size by decoding costs).
It also times the token forecast itself: ``spec.num_tokens(w, h)`` against the processor's own
``get_number_of_image_patches`` for Qwen2-VL.

Run: ``.venv/bin/python benchmarks/bench_image_size.py [--seconds 0.5] [--width 1280 --height 960]``
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image

from vlm_pack.vision import image_size, vision_spec


def rate(fn, items, seconds: float) -> float:
    """Calls per second of ``fn(item)`` cycling over ``items`` for about ``seconds``."""
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for item in items:
            fn(item)
        n += len(items)
        now = time.perf_counter()
        if now >= deadline:
            return n / (now - start)


def make_images(width: int, height: int, count: int) -> dict[str, list[bytes]]:
    rng = np.random.default_rng(0)
    exif = Image.Exif()
    exif[0x0112] = 6
    out: dict[str, list[bytes]] = {}
    specs = {
        "JPEG": dict(format="JPEG", quality=90),
        "JPEG+EXIF": dict(format="JPEG", quality=90, exif=exif),
        "PNG": dict(format="PNG"),
        "PNG+eXIf": dict(format="PNG", exif=exif),
        "GIF": dict(format="GIF"),
        "WebP lossy": dict(format="WEBP", quality=80),
        "WebP lossless": dict(format="WEBP", lossless=True),
        "WebP+EXIF": dict(format="WEBP", quality=80, exif=exif),
    }
    # Smooth gradients plus noise: photo-like sizes for the encoders, varied dimensions per image.
    for name, kw in specs.items():
        blobs = []
        for i in range(count):
            w, h = width - 7 * i, height - 5 * i
            y, x = np.mgrid[0:h, 0:w]
            arr = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (w + h))], axis=-1)
            arr = (arr + rng.integers(0, 24, size=arr.shape)).clip(0, 255).astype(np.uint8)
            im = Image.fromarray(arr)
            if name == "GIF":
                im = im.convert("P")
            buf = io.BytesIO()
            im.save(buf, **kw)
            blobs.append(buf.getvalue())
        out[name] = blobs
    return out


def pil_open_size(b: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(b)) as im:
        return im.size


def pil_decode(b: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(b)) as im:
        im.load()
        return im.size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=960)
    ap.add_argument("--count", type=int, default=4, help="distinct images per format")
    args = ap.parse_args()

    images = make_images(args.width, args.height, args.count)
    print(f"image_size on in-memory bytes, ~{args.width}x{args.height} images, {args.seconds}s per figure")
    header = f"{'format':<14} {'KiB':>6} {'image_size/s':>13} {'PIL open/s':>11} {'decode/s':>9} {'vs open':>8} {'vs decode':>10}"
    print(header)
    print("-" * len(header))
    ours_all = []
    for name, blobs in images.items():
        for b in blobs:  # correctness before speed
            with Image.open(io.BytesIO(b)) as im:
                assert image_size(b, exif_transpose=False) == im.size, name
        ours = rate(image_size, blobs, args.seconds)
        opened = rate(pil_open_size, blobs, args.seconds)
        decoded = rate(pil_decode, blobs, max(args.seconds, 0.2))
        ours_all.append(ours)
        kib = sum(map(len, blobs)) / len(blobs) / 1024
        print(
            f"{name:<14} {kib:>6.0f} {ours:>13,.0f} {opened:>11,.0f} {decoded:>9,.0f} "
            f"{ours / opened:>7.1f}x {ours / decoded:>9.0f}x"
        )
    print(f"slowest format: {min(ours_all):,.0f} headers/s (target >= 20,000)")

    # The forecast itself: vlm_pack spec vs the processor's own pure size function.
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 3136, "longest_edge": 12845056},
    )
    spec = vision_spec("qwen2_vl")
    rng = np.random.default_rng(1)
    sizes = [(int(w), int(h)) for w, h in rng.integers(64, 4000, size=(2000, 2))]
    ours = rate(lambda s: spec.num_tokens(*s), sizes, args.seconds)
    theirs = rate(lambda s: proc.get_number_of_image_patches(s[1], s[0]), sizes, args.seconds)
    w = np.array([s[0] for s in sizes] * 50)
    h = np.array([s[1] for s in sizes] * 50)
    start = time.perf_counter()
    spec.num_tokens_batch(w, h)
    batch = len(w) / (time.perf_counter() - start)
    print(
        f"qwen2_vl num_tokens: {ours:,.0f}/s; processor get_number_of_image_patches: {theirs:,.0f}/s "
        f"({ours / theirs:.1f}x); num_tokens_batch (2,000 distinct of {len(w):,}): {batch:,.0f}/s"
    )


if __name__ == "__main__":
    main()
