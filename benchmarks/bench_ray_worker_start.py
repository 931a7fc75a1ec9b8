"""A Ray forecast worker's start-up, before and after it stopped importing torch (issue 34).

A ``forecast_ray`` actor starts by importing ``vlm_pack.integrations.ray`` (for ``_ChunkForecast``) and
unpickling the forecaster its constructor is given (the checkpoint's parts), then forecasts its first chunk.
Measured for two code trees, the ``--before`` git revision (extracted with ``git archive``) and this checkout:

- a fresh Python process doing exactly that on one chunk (1,024 rows of ``bench_sources.py``'s parquet), each
  tree shipping what its own ``forecast_ray`` ships: median of ``--repeats`` runs of the import, the unpickle,
  the first chunk, the process's whole wall time, and whether torch / transformers were imported;
- ``--ray``: ``forecast_ray`` of that one chunk with 1 worker on a local ``ray.init(num_cpus=1)`` cluster
  (started once, untimed), ``--repeats`` times: each call starts a new actor, so its wall time is an actor's
  start plus one chunk plus Ray Data's scheduling.

Parts: the offline Qwen2-VL tokenizer and image processor (what ``vlm-pack plan --family qwen2_vl`` plans
with).

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_ray_worker_start.py [--before bea1949] [--ray]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PREPARE = r"""
import pickle, sys
from dataclasses import replace
from pathlib import Path
from vlm_pack.data.forecast import make_forecaster
import vlm_pack.integrations.ray as vray
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
parquet, out = sys.argv[1], sys.argv[2]
pre = Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))
f = make_forecaster(parquet, preprocessor=pre)
ship = {"sources": [vray._shippable(s) for s in f.sources], "on_error": "skip"}
if hasattr(vray, "forecast_parts"):  # this tree's forecast_ray ships the forecast's parts only
    ship["pre"] = vray.forecast_parts(f.pre)
chunk = vray.ray_chunks(f.sources)[0]
Path(out).write_bytes(pickle.dumps((replace(f, **ship), chunk)))
"""

_WORKER = r"""
import json, pickle, sys, time
t0 = time.perf_counter()
from vlm_pack.integrations.ray import _ChunkForecast
t1 = time.perf_counter()
forecaster, chunk = pickle.loads(open(sys.argv[1], "rb").read())
actor = _ChunkForecast(forecaster)
t2 = time.perf_counter()
actor({"seq": [0], "chunk": [pickle.dumps(chunk)]})
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "unpickle": t2 - t1, "chunk": t3 - t2,
                  "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""

_RAY = r"""
import json, sys, time
import ray
from vlm_pack.integrations.ray import forecast_ray
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
parquet, repeats = sys.argv[1], int(sys.argv[2])
pre = Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
ray.data.DataContext.get_current().enable_progress_bars = False
walls = []
for _ in range(repeats):
    t = time.perf_counter()
    table = forecast_ray(parquet, preprocessor=pre, num_proc=1)
    walls.append(time.perf_counter() - t)
ray.shutdown()
print(json.dumps({"walls": walls, "rows": len(table)}))
"""


def run(code: str, tree: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def worker_starts(tree: Path, parquet: Path, repeats: int, tmp: Path) -> dict:
    import time

    blob = tmp / f"{tree.name}.pkl"
    run(_PREPARE, tree, str(parquet), str(blob))
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        report = json.loads(run(_WORKER, tree, str(blob)))
        report["process"] = time.perf_counter() - t
        runs.append(report)
    keys = ("import", "unpickle", "chunk", "process")
    return {**{k: statistics.median(r[k] for r in runs) for k in keys}, "torch": runs[0]["torch"],
            "transformers": runs[0]["transformers"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="bea1949", help="git revision before the change (default: bea1949, main "
                   "before issue 34)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ray", action="store_true", help="also time forecast_ray's actor start on a local cluster")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "vlm-pack-bench-sources"))
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_sources import make_parquet

    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    parquet = data / "train-1024.parquet"
    if not parquet.exists():
        make_parquet(parquet, 1024)
    commit = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(["git", "archive", args.before, "vlm_pack"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        trees = {f"before ({commit})": before, "after (this checkout)": ROOT}
        print(f"1 chunk of 1,024 rows; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; median of "
              f"{args.repeats} fresh processes")  # fmt: skip
        print(f"{'worker start':26s} {'import':>7s} {'unpickle':>9s} {'1st chunk':>10s} {'process':>8s}  torch")
        for name, tree in trees.items():
            r = worker_starts(tree, parquet, args.repeats, tmp)
            print(f"{name:26s} {r['import']:6.2f}s {r['unpickle']:8.2f}s {r['chunk']:9.2f}s "
                  f"{r['process']:7.2f}s  {'yes' if r['torch'] else 'no'}")  # fmt: skip
        if args.ray:
            print(f"\nforecast_ray, 1 chunk, 1 worker (a new actor each call), wall seconds of {args.repeats} calls")
            for name, tree in trees.items():
                r = json.loads(run(_RAY, tree, str(parquet), str(args.repeats)))
                walls = ", ".join(f"{w:.1f}" for w in r["walls"])
                print(f"{name:26s} median {statistics.median(r['walls']):5.1f}s  ({walls}; {r['rows']} rows)")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
