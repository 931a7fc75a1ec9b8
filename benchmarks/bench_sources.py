"""Forecast throughput on a parquet file with image bytes, against reading it with ``datasets`` alone.

The data: ``--rows`` rows (default 100,000) in the TRL / HF hub layout, ``images`` (an ``Image`` column
holding encoded bytes: small real JPEG/PNG images made with Pillow, 32 to 640 px a side, 1 or 2 per row,
500 distinct) + ``messages`` (content parts, 20-120 words), written once with ``Dataset.to_parquet`` into
``--data`` (default: a folder in the temp dir, reused by later runs).

Rows per second, all in the same run:

- floor: ``datasets`` reading the same columns into Python rows, images left encoded
  (``Dataset.from_parquet`` once, untimed; then ``ds.iter(batch_size=1024)`` with ``Image(decode=False)``);
- decode: ``datasets`` as most loaders use it, images decoded to PIL (on ``--decode-rows`` rows only);
- vlm-pack ``forecast_sources(source, num_proc=N)`` for each N of ``--workers``, on the parquet file
  (streamed as Arrow batches to the workers) and on the ``Dataset`` above (workers read its memory-mapped
  rows themselves): read the rows, normalise each record, read each image's size from its header bytes,
  tokenize the conversation with the chat format (offline Qwen2-VL tokenizer, one batched call per chunk)
  and count vision tokens with the Qwen2-VL spec.

Also printed: rows per CPU-second (this process and its worker processes), which a loaded machine does not
distort the way it distorts wall-clock rates: N processes scale wall-clock throughput by up to N only while
their rows per CPU-second stay those of one process.

Run: ``.venv/bin/python benchmarks/bench_sources.py [--rows 100000] [--workers 1 2]``
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def make_images(count: int, seed: int = 0) -> list[bytes]:
    """Small real images: gradients with a noise patch, 32 to 640 px a side, JPEG (2/3) and PNG (1/3)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        w, h = (int(v) for v in rng.integers(32, 641, size=2))
        image = Image.merge(
            "RGB",
            [Image.linear_gradient("L"), Image.radial_gradient("L"), Image.linear_gradient("L").rotate(90)],
        ).resize((w, h))
        image.paste(Image.effect_noise((16, 16), 40).convert("RGB"), (w // 3, h // 3))
        buf = io.BytesIO()
        image.save(buf, format="JPEG" if i % 3 else "PNG", quality=75, optimize=True)
        out.append(buf.getvalue())
    return out


def make_parquet(path: Path, rows: int) -> None:
    import datasets

    rng = np.random.default_rng(1)
    pool = make_images(500)
    words = (
        "the a photo of dog cat street sign chart table read describe what where is shown left right".split()
    )
    images, messages = [], []
    for i in range(rows):
        k = 1 + (i % 4 == 0)
        images.append([pool[j] for j in rng.integers(0, len(pool), size=k)])
        question = " ".join(rng.choice(words, size=int(rng.integers(5, 30))))
        answer = " ".join(rng.choice(words, size=int(rng.integers(15, 90))))
        user = [{"type": "image", "text": None}] * k + [{"type": "text", "text": question}]
        messages.append(
            [
                {"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
        )
    features = datasets.Features(
        {
            "images": datasets.List(datasets.Image()),
            "messages": [
                {
                    "role": datasets.Value("string"),
                    "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
                }
            ],
        }
    )
    ds = datasets.Dataset.from_dict({"images": images, "messages": messages}, features=features)
    tmp = path.with_suffix(".tmp")
    ds.to_parquet(str(tmp))
    os.replace(tmp, path)


def _cpu() -> float:
    t = os.times()  # children: the forecast's worker processes, counted once they have been joined
    return t.user + t.system + t.children_user + t.children_system


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process and its joined children, result) of ``fn()``."""
    wall, cpu = time.perf_counter(), _cpu()
    out = fn()
    return time.perf_counter() - wall, _cpu() - cpu, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--decode-rows", type=int, default=5_000)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "vlm-pack-bench-sources"))
    args = p.parse_args()

    import datasets

    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.offline import build_tokenizer, image_processor
    from vlm_pack.vision import vision_spec_from_processor

    datasets.disable_progress_bars()
    folder = Path(args.data)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"train-{args.rows}.parquet"
    if not path.exists():
        seconds, _, _ = timed(lambda: make_parquet(path, args.rows))
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {seconds:.0f}s")
    ds = datasets.Dataset.from_parquet(str(path), cache_dir=str(folder / "hf-cache"))
    raw = ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
    n = len(ds)

    def floor() -> int:
        return sum(len(batch["messages"]) for batch in raw.iter(batch_size=1024))

    def decode() -> int:
        sub = ds.select(range(min(args.decode_rows, n)))
        return sum(len(row["images"]) for row in sub)

    tok = build_tokenizer("qwen2_vl")
    spec = vision_spec_from_processor(image_processor("qwen2_vl"))
    rows: list[tuple[str, float, float]] = []  # (reader, rows per wall second, rows per CPU second)
    t, c, _ = timed(floor)
    rows.append(("datasets, images encoded (floor)", n / t, n / c))
    m = min(args.decode_rows, n)
    t, c, _ = timed(decode)
    rows.append((f"datasets, images decoded ({m:,} rows)", m / t, m / c))
    tokens = None
    for label, source in (("parquet file", str(path)), ("the Dataset", ds)):
        for w in args.workers:
            t, c, table = timed(
                lambda w=w, source=source: forecast_sources(
                    source, tokenizer=tok, spec=spec, num_proc=w, progress=False
                )
            )
            assert len(table) == n and not table.invalid
            tokens = table.lengths if tokens is None else tokens
            assert np.array_equal(tokens, table.lengths), "the forecast depends on the source or the workers"
            rows.append((f"vlm-pack forecast, {label}, {w} process{'es' if w > 1 else ''}", n / t, n / c))
    floor_rate = rows[0][1]
    print(
        f"\n{n:,} rows, {path.stat().st_size / 2**20:.0f} MiB parquet, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; mean length {tokens.mean():.0f} tokens"
    )
    print(f"{'reader':48s} {'rows/s':>9s} {'vs floor':>9s} {'rows/CPU-s':>11s}")
    print("-" * 80)
    for name, rate, per_cpu in rows:
        print(f"{name:48s} {rate:9,.0f} {rate / floor_rate:8.3f}x {per_cpu:11,.0f}")


if __name__ == "__main__":
    main()
