"""Import cost of vlm_pack against its peer, ``import torch, transformers``, each in a fresh interpreter.

Every repetition starts a new ``python -c`` process per statement, alternating the statements so that load on
the machine affects them alike; the figure is the median wall time and the ratio of medians.

    python benchmarks/bench_import.py --repeat 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

STATEMENTS = {
    "peer: import torch, transformers": "import torch, transformers",
    "import vlm_pack": "import vlm_pack",
    "vlm-pack --help": "import sys; sys.argv = ['vlm-pack', '--help']; from vlm_pack.cli.main import main; main()",
    "training imports": "from vlm_pack import PackedWebDataset, PackingCollator",
    "megatron inputs (PackedSeqParams)": "from vlm_pack.collate.batch import PackedSeqParams",
}


def _once(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    probe = "import importlib.util as u; print(u.find_spec('megatron.core') is not None)"
    has_mcore = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    helped = subprocess.run([sys.executable, "-m", "vlm_pack.cli.main", "--help"], capture_output=True, text=True)
    print(f"megatron-core importable: {has_mcore}; `vlm-pack --help` stderr: {helped.stderr.strip()!r}")
    times: dict[str, list[float]] = {label: [] for label in STATEMENTS}
    for _ in range(args.repeat):
        for label, statement in STATEMENTS.items():
            times[label].append(_once(statement))
    peer = statistics.median(times["peer: import torch, transformers"])
    print(f"{'statement':36s} {'median s':>9s} {'min s':>7s} {'x peer':>7s}   ({args.repeat} fresh processes each)")
    for label, samples in times.items():
        median = statistics.median(samples)
        print(f"{label:36s} {median:9.2f} {min(samples):7.2f} {median / peer:7.2f}")


if __name__ == "__main__":
    main()
