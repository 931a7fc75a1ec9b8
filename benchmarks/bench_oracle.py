"""The exact route (``vlm_pack.vision.oracle``) against the fast rules and against decode + process.

One realistic mix (``vlm_pack.demo``: photos 640..4032 px, A4 documents at 150 / 300 dpi, screenshots up to
2880x1800, charts, icons; 0-3 images per sample), one processor (``--family``, its released image settings
and chat template, offline tokenizer), one run, the same rows for every route:

- ``fast rule``: ``Preprocessor(processor=...)`` (the family's rule read off the processor)
  ``forecast_rows`` over all rows in one call, as ``forecast_sources`` does per chunk;
- ``exact route, cold``: ``Preprocessor(processor=..., spec=exact_spec(processor))``, the memo empty at the
  start: each new size (each new tuple of a sample's sizes) runs the processor's image step on blank canvases;
  its hit rate is the memo's on this mix (as a dataset's first pass meets it);
- ``exact route, warm``: the same rows again, every size in the memo (a second epoch, or a dataset whose sizes
  repeat more than this sample of it);
- ``decode + process``: each sample's encoded images (drawn beforehand, untimed) decoded by Pillow and run
  through ``Preprocessor.process`` (the processor's ``__call__``): what learning lengths by preprocessing
  costs (ms-swift, LLaMA-Factory), on the first ``--process-rows`` rows.

Every route's lengths are checked equal to the fast rule's (and the processed lengths to the forecasts).
Rates are rows per second of wall time and per CPU-second of this process (a loaded machine shows in the
first, less in the second).

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_oracle.py [--rows 2000] [--process-rows 100]``
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlm_pack import Preprocessor, offline
from vlm_pack.demo import demo_plan, draw_image
from vlm_pack.vision.oracle import exact_spec, memo_stats

TEMPLATES = Path(__file__).parents[1] / "tests" / "templates"


def seen_size(image: Any) -> tuple[int, int]:
    """The size the processor sees (EXIF orientations 5-8 swap the stored sides)."""
    return (image.height, image.width) if image.orientation in (5, 6, 7, 8) else (image.width, image.height)


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--process-rows", type=int, default=100)
    p.add_argument("--family", default="qwen2_vl")
    args = p.parse_args()

    template = TEMPLATES / f"{args.family}.jinja"
    proc = offline.processor(args.family, chat_template=template.read_text() if template.exists() else None)
    plan = demo_plan(args.rows)
    rows = [(item["conversation"], [seen_size(im) for im in item["images"]], item["key"]) for item in plan]
    fast = Preprocessor(processor=proc)
    exact = Preprocessor(processor=proc, spec=exact_spec(proc))

    fast.forecast_rows(rows[:200])  # warm-up, untimed: the template compiled, the tokenizer's caches filled
    fast_out, fast_wall, fast_cpu = timed(lambda: fast.forecast_rows(rows))
    memo_stats(reset=True)
    cold_out, cold_wall, cold_cpu = timed(lambda: exact.forecast_rows(rows))
    cold = memo_stats()
    warm_out, warm_wall, warm_cpu = timed(lambda: exact.forecast_rows(rows))
    lengths = [f.length for f in fast_out]
    assert [f.length for f in cold_out] == lengths == [f.length for f in warm_out], "routes disagree"

    n_proc = min(args.process_rows, len(plan))
    encoded = [[draw_image(im) for im in item["images"]] for item in plan[:n_proc]]  # untimed

    def process_all() -> list[int]:
        return [len(fast.process(imgs, item["conversation"])["input_ids"]) for imgs, item in zip(encoded, plan)]

    processed, proc_wall, proc_cpu = timed(process_all)
    assert processed == lengths[:n_proc], "a processed length differs from its forecast"

    images = [size for _, sizes, _ in rows for size in sizes]
    with_images = [sizes for _, sizes, _ in rows if sizes]
    print(f"{args.rows:,} demo rows ({len(images):,} images, {len(set(images))} distinct sizes; "
          f"{len(with_images):,} rows with images, {len(set(map(tuple, with_images)))} distinct size tuples); "
          f"{args.family} released settings; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'route':<34}{'rows':>7}{'rows/s':>10}{'rows/CPU-s':>12}{'fast/this (CPU)':>17}")
    print("-" * 80)
    base = len(rows) / fast_cpu
    table = [
        ("fast rule", len(rows), fast_wall, fast_cpu),
        ("exact route, cold memo", len(rows), cold_wall, cold_cpu),
        ("exact route, warm memo", len(rows), warm_wall, warm_cpu),
        ("decode + process", n_proc, proc_wall, proc_cpu),
    ]
    for name, n, wall, cpu in table:
        print(f"{name:<34}{n:>7,}{n / wall:>10,.0f}{n / cpu:>12,.0f}{base / (n / cpu):>16,.1f}x")
    hits = cold["hits"] / max(1, cold["hits"] + cold["misses"])
    print(f"memo on the cold pass: {cold['misses']} image steps run, {cold['hits']} hits ({hits:.1%} hit rate; "
          f"one entry per distinct sample size tuple)")  # fmt: skip
    per_image = 1 - len(set(images)) / max(1, len(images))
    print(f"(keyed per image instead, the mix would hit {per_image:.1%}: a sample's images run together, as "
          "the processor's __call__ runs them)")


if __name__ == "__main__":
    main()
