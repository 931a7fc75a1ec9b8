"""Megatron-Energon with vlm-pack: prepare a dataset, stream packs, restart mid-epoch, check every sample once.

::

    demo records --write_shards--> part-00000.tar ...  --energon prepare--> .nv-meta/ (CrudeWebdataset)
        --VLMPackingTaskEncoder--> cooker: exact lengths from image headers (no decode)
                                   select_samples_to_pack: best fit over the packing buffer
                                   pack_selected_samples: decode, process, PackedBatch (+ PackedSeqParams)

Two checks, exit 1 if either fails:

1. one epoch (``repeat=False``) over ``--ranks`` data-parallel ranks yields every sample exactly once, each
   pack one row with its keys in ``batch.metadata["__key__"]`` (or reports it, longer than ``--capacity``, in
   a pack's ``left_out``: read in this process, also from worker processes); samples are padded to
   ``pad_multiple_for(cp=--cp)`` as context parallelism needs, and the packs are planned on those spans;
2. a run saved after ``--restart-after`` packs (``save_state_rank``) and restored in a new loader
   (``restore_state_rank``) yields exactly the packs of the uninterrupted run, on every rank.

Needs ``pip install 'vlm-pack[energon]'``::

    python examples/train_energon.py --samples 24 --ranks 2 --workers 2
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vlm_pack import Preprocessor, pad_multiple_for
from vlm_pack.data import write_shards
from vlm_pack.demo import demo_records
from vlm_pack.offline import build_tokenizer, image_processor


def energon_prepare(path: Path) -> None:
    """``energon prepare DIR --non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset``."""
    exe = shutil.which("energon", path=str(Path(sys.executable).parent)) or shutil.which("energon")
    if exe is None:
        raise SystemExit("the 'energon' command is missing: pip install 'vlm-pack[energon]'")
    cmd = [exe, "prepare", str(path), "--non-interactive", "--split-ratio", "1,0,0",
           "--sample-type", "CrudeWebdataset"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    print("$ " + " ".join(["energon", *cmd[1:]]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=24, help="demo samples to write")
    p.add_argument("--capacity", type=int, default=2048, help="tokens per pack")
    p.add_argument("--max-pixels", type=int, default=50176, help="image processor cap (50176: <= 64 tokens)")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (simulated in this process)")
    p.add_argument("--workers", type=int, default=0, help="loader worker processes per rank")
    p.add_argument("--cp", type=int, default=2, help="context parallel size: samples padded to pad_multiple_for(cp)")
    p.add_argument("--buffer", type=int, default=4, help="packing buffer size (samples)")
    p.add_argument("--restart-after", type=int, default=2, help="packs before saving the state")
    p.add_argument("--data-dir", default=None, help="where the dataset goes (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.restart_after < args.workers:  # Energon 7.4.1 answers an earlier save with "skip 1" (docs/integrations.md)
        p.error(f"--restart-after {args.restart_after} < --workers {args.workers}: save after every worker has "
                "yielded a pack")

    from megatron.energon import WorkerConfig, get_savable_loader

    from vlm_pack.integrations.energon import VLMPackingTaskEncoder, packed_train_dataset

    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": args.max_pixels})
    preprocessor = Preprocessor(tok, ip)  # the checkpoint's parts: the cooker's forecast and the packs share them
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.data_dir or tmp) / "energon-demo"
        path.mkdir(parents=True, exist_ok=True)
        keys = [r["key"] for r in demo_records(args.samples)]
        write_shards(demo_records(args.samples), str(path / "part-%05d.tar"), maxcount=8)
        energon_prepare(path)

        def make_encoder() -> Any:
            multiple = pad_multiple_for(cp=args.cp)
            # oversized="skip": a sample longer than capacity is reported on a pack (left_out), not fatal
            return VLMPackingTaskEncoder(preprocessor, args.capacity, pad_to_multiple_of=multiple, oversized="skip")

        def loader(rank: int, repeat: bool, encoder: Any = None) -> Any:
            encoder = encoder or make_encoder()
            wc = WorkerConfig(rank=rank, world_size=args.ranks, num_workers=args.workers)
            return get_savable_loader(packed_train_dataset(
                str(path), encoder, worker_config=wc, packing_buffer_size=args.buffer, repeat=repeat))

        # 1. one epoch over all ranks: every sample once in a one-row pack, or reported on a pack as left out.
        seen, left, packs = [], [], []
        for rank in range(args.ranks):
            for pack in loader(rank, repeat=False):
                seen += pack.keys
                left += [key for key, _ in pack.left_out]  # travels with the pack, also from workers
                packs.append(pack)
        fill = sum(pk.batch.num_real_tokens for pk in packs) / (len(packs) * args.capacity)
        print(f"{len(seen)} samples in {len(packs)} packs over {args.ranks} ranks, fill {fill:.1%}; "
              f"left out (reported): {left}")
        first = packs[0].batch.model_inputs("megatron")["packed_seq_params"]
        print(f"first pack {packs[0].keys}: cu_seqlens_q {first.cu_seqlens_q.tolist()}")
        one_row = all(pk.batch.num_rows == 1 and pk.batch.metadata["__key__"] == pk.keys for pk in packs)
        epoch_ok = sorted(seen + left) == sorted(keys) and len(set(seen)) == len(seen) and one_row

        # 2. restart mid-epoch: the restored loader continues with exactly the uninterrupted run's packs.
        total = len(packs) // args.ranks + 2
        restart_ok = True
        for rank in range(args.ranks):
            full = [pk.keys for pk in itertools.islice(loader(rank, repeat=True), total)]
            first_run = loader(rank, repeat=True)
            head = [pk.keys for pk in itertools.islice(first_run, args.restart_after)]
            state = first_run.save_state_rank()
            second_run = loader(rank, repeat=True)
            second_run.restore_state_rank(state)
            tail = [pk.keys for pk in itertools.islice(second_run, total - args.restart_after)]
            same = head + tail == full
            restart_ok &= same
            print(f"rank {rank}: {args.restart_after} packs, save, restore, {len(tail)} packs: "
                  f"{'same packs as the uninterrupted run' if same else 'MISMATCH'}")
    ok = epoch_ok and restart_ok
    print("PASS" if ok else f"FAIL: epoch {'ok' if epoch_ok else 'mismatch'}, restart {'ok' if restart_ok else 'mismatch'}")
    return {"ok": ok, "epoch_ok": epoch_ok, "restart_ok": restart_ok, "packs": len(packs), "seen": seen}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
