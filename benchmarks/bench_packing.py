"""Benchmark vlm_pack.packing against seqpacker (Rust) and binpacking on the same data, same run.

    python benchmarks/bench_packing.py                      # 10k, 100k, 1M (from the repository root)
    python benchmarks/bench_packing.py --sizes 10000 --repeats 20
    python benchmarks/bench_packing.py --install-seqpacker /tmp/seqpacker

seqpacker 0.1.3 ships only a ``cp38`` manylinux wheel that is really an abi3 build (its extension
uses only the stable ABI, so newer CPythons load it once it carries the abi3 name); it is never a
dependency of vlm-pack. ``--install-seqpacker DIR`` downloads that wheel with pip, unpacks it into
DIR and renames its extension to ``_core.abi3.so`` (``install_seqpacker`` below does exactly this);
the benchmark then imports it from DIR only (``--seqpacker-dir``, default /tmp/seqpacker). If it
cannot be had, the benchmark says why, leaves its columns as "-" and checks against our own exact
per-item BFD instead.

Distributions (seeded): uniform 1..2048 into 2048; lognormal (median 600, sigma 0.8, clipped)
into 8192; a VLM mix (text 50-1500 tokens plus 0-3 images of 64-1280 vision tokens) into 16384.
Reported: bins, the lower bound ceil(sum / capacity), best-of-N wall milliseconds, our time /
seqpacker obfd time, and whether our bins equal exact BFD (bin count equal to seqpacker's BFD,
which is tie-break independent, and bins identical to our independent per-item BFD).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from vlm_pack.packing import StreamPacker, pack

CAPACITY = {"uniform": 2048, "lognormal": 8192, "vlm": 16384}


def make(dist: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """Expanded lengths [n] (and, for the VLM mix, ViT patches before the 2x2 merge [n])."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return rng.integers(1, 2049, n), None
    if dist == "lognormal":
        return np.clip(rng.lognormal(np.log(600), 0.8, n).astype(np.int64), 1, 8192), None
    text = rng.integers(50, 1501, n)
    n_img = rng.integers(0, 4, n)
    img = rng.integers(64, 1281, (n, 3)) * (np.arange(3)[None, :] < n_img[:, None])
    return text + img.sum(1), 4 * img.sum(1)


def best_ms(fn, repeats: int) -> tuple[float, object]:
    out = None
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out


def install_seqpacker(target: Path) -> None:
    """pip-download seqpacker's cp38 abi3 wheel, unpack it into ``target``, fix the extension name."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--ignore-requires-python", "--python-version", "3.8", "--platform", "manylinux2014_x86_64"]
        cmd += ["seqpacker==0.1.3", "-d", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        (wheel,) = Path(tmp).glob("seqpacker-*.whl")
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    for so in (target / "seqpacker").glob("_core.cpython-*.so"):
        so.rename(so.with_name("_core.abi3.so"))


def load_seqpacker(path: str):
    if path and os.path.isdir(path):
        sys.path.insert(0, path)
    try:
        return importlib.import_module("seqpacker"), ""
    except Exception as e:  # not installed or not loadable: say why
        return None, f"{type(e).__name__}: {e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--dists", default="uniform,lognormal,vlm")
    ap.add_argument("--repeats", type=int, default=5, help="best of N (at least 200000 / n)")
    ap.add_argument("--seqpacker-dir", default=os.environ.get("SEQPACKER_DIR", "/tmp/seqpacker"))
    ap.add_argument("--install-seqpacker", metavar="DIR", help="download + unpack seqpacker into DIR first")
    ap.add_argument("--no-verify", action="store_true", help="skip the per-item exact-BFD check")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    dists = args.dists.split(",")

    if args.install_seqpacker:
        try:
            install_seqpacker(Path(args.install_seqpacker))
            args.seqpacker_dir = args.install_seqpacker
        except Exception as e:
            print(f"# seqpacker install failed: {type(e).__name__}: {e}")
    sp, why = load_seqpacker(args.seqpacker_dir)
    try:
        import binpacking
    except ImportError as e:
        binpacking, bp_why = None, str(e)
    print(f"# python {sys.version.split()[0]}, numpy {np.__version__}, cpus {os.cpu_count()}")
    print(
        f"# seqpacker: {sp.__version__ if sp else 'unavailable (' + why + ')'}; binpacking: "
        f"{'yes' if binpacking else 'unavailable (' + bp_why + ')'}"
    )

    print(f"\n## offline pack (best of {args.repeats}, ms)")
    hdr = f"{'dist':9s} {'n':>8s} {'LB':>7s} | {'ours bfd':>8s} {'ms':>7s} | {'sp obfd':>7s} {'ms':>7s} {'ratio':>6s}"
    hdr += f" | {'sp bfd':>7s} {'ms':>7s} | {'binpacking':>10s} {'ms':>8s} | exact BFD"
    print(hdr)
    for dist in dists:
        for n in sizes:
            L, _ = make(dist, n)
            C = CAPACITY[dist]
            reps = max(args.repeats, 200_000 // n)  # small inputs: more repeats against load noise
            t_ours, res = best_ms(lambda L=L, C=C: pack(L, C), reps)
            row = f"{dist:9s} {n:8d} {res.lower_bound:7d} | {res.num_bins:8d} {t_ours:7.2f} |"
            checks = []
            if sp is not None:
                packer = sp.Packer(C, "obfd")
                t_sp, (_items, offs) = best_ms(lambda p=packer, L=L: p.pack_flat(L), reps)
                packer_b = sp.Packer(C, "bfd")
                t_bfd, (_i2, offs_b) = best_ms(
                    lambda p=packer_b, L=L: p.pack_flat(L), max(1, args.repeats // 2)
                )
                # pack_flat returns np.split points: one fewer than the bins
                nb_sp, nb_bfd = len(offs) + 1, len(offs_b) + 1
                row += f" {nb_sp:7d} {t_sp:7.2f} {t_ours / t_sp:6.2f} | {nb_bfd:7d} {t_bfd:7.2f} |"
                checks.append("count==sp.bfd" if nb_bfd == res.num_bins else f"COUNT!=sp.bfd({nb_bfd})")
            else:
                row += f" {'-':>7s} {'-':>7s} {'-':>6s} | {'-':>7s} {'-':>7s} |"
            if binpacking is not None and n <= 10_000:
                t_bp, bp = best_ms(lambda L=L, C=C: binpacking.to_constant_volume(L.tolist(), C), 1)
                row += f" {len(bp):10d} {t_bp:8.1f} |"
            else:
                row += f" {'-':>10s} {'-':>8s} |"
            if not args.no_verify:
                # independent one-item-at-a-time BFD: the samples-per-bin path, with a cap of n that
                # never binds here (sum(L) > C, so no bin holds all n samples)
                ref = pack(L, C, max_samples_per_bin=n)
                same = np.array_equal(ref.order, res.order) and np.array_equal(
                    ref.bin_offsets, res.bin_offsets
                )
                checks.append("bins==per-item BFD" if same else "BINS DIFFER from per-item BFD")
            print(row + " " + ", ".join(checks))

    print("\n## other strategies and budgets, VLM mix, n=100000 (ms, one run)")
    L, patches = make("vlm", 100_000)
    C = CAPACITY["vlm"]
    for label, kw in [
        ("bfd", {}),
        ("ffd", {"strategy": "ffd"}),
        ("ff (data order)", {"strategy": "ff"}),
        ("nf", {"strategy": "nf"}),
        ("bfd + max 8 samples/bin", {"max_samples_per_bin": 8}),
        ("bfd + 24576 ViT patches/bin", {"vision": patches, "vision_capacity": 24576}),
    ]:
        t, r = best_ms(lambda kw=kw: pack(L, C, **kw), 1)
        print(
            f"{label:30s} bins {r.num_bins:6d}  lower bound {r.lower_bound:6d}  eff {r.efficiency:.4f}  {t:8.1f} ms"
        )

    print("\n## streaming (buffer 256 bins; us/sample wall, one pass; fill = tokens / (bins * capacity))")
    n_stream = max(sizes)
    for dist in dists:
        L, _ = make(dist, n_stream)
        C = CAPACITY[dist]
        keys = range(n_stream)
        parts = []
        for ratio in (0.7, 0.95, 1.0):

            def run_many(L=L, C=C, keys=keys, ratio=ratio):
                s = StreamPacker(C, buffer_size=256, min_fill_ratio=ratio)
                return s, s.add_many(keys, L) + s.flush()

            t_many, (s_many, _bins) = best_ms(run_many, 1)
            parts.append(
                f"min_fill {ratio}: {t_many * 1e3 / n_stream:.2f} us, fill {s_many.stats.fill_ratio:.4f}"
            )
        m = min(n_stream, 200_000)
        Ls = L[:m].tolist()

        def run_add(Ls=Ls, C=C):
            s = StreamPacker(C)
            out = []
            for i, x in enumerate(Ls):
                out += s.add(i, x)
            return out + s.flush()

        t_add, _ = best_ms(run_add, 1)
        parts.append(f"add() one by one {t_add * 1e3 / m:.2f} us")
        if sp is not None:
            Ll = L.tolist()
            for strat in ("nf", "hk"):

                def run_sp(Ll=Ll, C=C, strat=strat):
                    s = sp.StreamPacker(C, strat)
                    out = []
                    for x in Ll:
                        out += s.add(x)
                    return out + s.finish()

                t_sp, sbins = best_ms(run_sp, 1)
                fill = float(L.sum()) / (len(sbins) * C)
                parts.append(f"seqpacker {strat}: {t_sp * 1e3 / n_stream:.2f} us, fill {fill:.4f}")
        print(f"{dist:9s} n={n_stream}: " + " | ".join(parts))


if __name__ == "__main__":
    main()
