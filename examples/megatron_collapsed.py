"""Megatron-style packed batches in the collapsed layout: ``PackedSeqParams`` with *expanded* boundaries.

Megatron LLaVA keeps ONE placeholder per image in ``tokens`` and expands it to the image's embeddings
inside the model (``tokens_per_image``: 576 per 336 px tile, variable with anyres tiling). Attention runs
on the expanded sequence, so the ``cu_seqlens`` in ``PackedSeqParams`` must be the expanded ones: using the
collapsed offsets after expansion puts the sample boundaries in the middle of an earlier sample's image::

    collapsed   tokens      a0 a1 P a2 _ | b0 P b1 _ _ | ...        P = one placeholder per image
                cu_seqlens_padded  [0, 5, 10, ...]                  offsets in `tokens`
    expanded    (in the model)  a0 a1 I..(2340)..I a2 _ | b0 I..(1948)..I b1 _ _ | ...
                cu_seqlens_padded  [0, 2344, 4295, ...]             what PackedSeqParams carries

This example packs demo samples (LLaVA-NeXT rules: anyres tiles, so images differ in size) into the
collapsed layout with per-sample padding to ``2 * CP`` (context parallelism), prints the collapsed and the
expanded boundaries side by side, and checks them against an expanded-layout batch of the same samples
and against ``vlm_pack.collate.remap.remap_cu_seqlens_padded``. No Megatron installation is needed:
``PackedSeqParams`` is Megatron-Core's when importable, a dataclass with the same fields otherwise.

    python examples/megatron_collapsed.py --max-samples 6 --cp 2
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import webdataset as wds

from vlm_pack import Preprocessor, pad_multiple_for
from vlm_pack.collate.remap import remap_cu_seqlens_padded
from vlm_pack.data import image_fields, parse_text
from vlm_pack.demo import demo_shards
from vlm_pack.offline import build_tokenizer, image_processor


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-samples", type=int, default=8, help="demo samples with images to pack")
    p.add_argument("--capacity", type=int, default=16384, help="expanded tokens per pack")
    p.add_argument("--cp", type=int, default=2, help="context-parallel size: samples padded to 2 * cp")
    p.add_argument("--data-dir", default=None, help="where the demo shards go (default: a cache folder)")
    args = p.parse_args(argv)

    family = "llava_next"
    tokenizer = build_tokenizer(family)
    image_proc = image_processor(family)
    image_token_id = tokenizer.image_token_id
    layouts = ("collapsed", "expanded")
    parts = {layout: Preprocessor(tokenizer, image_proc, family=family, layout=layout) for layout in layouts}
    samples = {"collapsed": [], "expanded": []}
    keys = []
    for sample in wds.WebDataset([str(s) for s in demo_shards(args.data_dir)], shardshuffle=False):
        images = [sample[f] for f in image_fields(sample)]
        if not images:  # text-only samples have nothing to remap: this example shows image samples
            continue
        conversation = parse_text(sample)
        for layout, out in samples.items():
            out.append(parts[layout].process(images, conversation, key=sample["__key__"]))
        keys.append(sample["__key__"])
        if len(keys) == args.max_samples:
            break

    multiple = pad_multiple_for(cp=args.cp)
    capacity = -(-args.capacity // multiple) * multiple
    batches = {
        # max_rows=None: the samples are a list, not a planned bin; re-packed into the packs they need
        layout: parts[layout].collator(capacity, pad_to_multiple_of=multiple, max_rows=None)(items)
        for layout, items in samples.items()
    }
    collapsed, expanded = batches["collapsed"], batches["expanded"]
    inputs = collapsed.model_inputs("megatron")
    params = inputs["packed_seq_params"]

    print(
        f"{len(keys)} samples, {collapsed.num_rows} pack(s) of {capacity} expanded tokens, CP={args.cp}: "
        f"every sample padded to a multiple of {multiple}"
    )
    print(
        f"tokens {tuple(inputs['tokens'].shape)} (collapsed)   position_ids {tuple(inputs['position_ids'].shape)} "
        f"(expanded)   tokens_per_image {inputs['tokens_per_image'].tolist()}"
    )
    print(f"PackedSeqParams(qkv_format={params.qkv_format!r}, max_seqlen_q={params.max_seqlen_q})")
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        print(f"  {name:22s} {getattr(params, name).tolist()}")
    print("\nsample        images  collapsed [start, end) real/padded     expanded [start, end) real/padded")
    order = collapsed.sample_index.tolist()
    for j, i in enumerate(order):
        c0, c1 = int(collapsed.cu_seqlens_padded[j]), int(collapsed.cu_seqlens_padded[j + 1])
        e0, e1 = (
            int(collapsed.cu_seqlens_padded_expanded[j]),
            int(collapsed.cu_seqlens_padded_expanded[j + 1]),
        )
        n_img = int((samples["collapsed"][i]["input_ids"] == image_token_id).sum())
        print(
            f"{keys[i]:12s}  {n_img:6d}  [{c0:6d}, {c1:6d}) {int(collapsed.seq_lens[j]):5d}/{c1 - c0:<5d}"
            f"      [{e0:6d}, {e1:6d}) {int(collapsed.seq_lens_expanded[j]):5d}/{e1 - e0:<5d}"
        )

    # 1. The expanded boundaries are those of the same samples collated in the expanded layout (as HF has them).
    assert collapsed.sample_index.tolist() == expanded.sample_index.tolist()
    assert torch.equal(collapsed.cu_seqlens_padded_expanded, expanded.cu_seqlens_padded)
    assert torch.equal(collapsed.cu_seqlens_expanded, expanded.cu_seqlens)
    # 2. ... and the remap of the collapsed ones (one cumsum + one gather, no loop over tokens).
    real, padded = remap_cu_seqlens_padded(
        collapsed.cu_seqlens,
        collapsed.cu_seqlens_padded,
        collapsed.input_ids,
        image_token_id,
        collapsed.tokens_per_image,
    )
    assert torch.equal(real, params.cu_seqlens_q) and torch.equal(padded, params.cu_seqlens_q_padded)
    # 3. What the model does: expand each placeholder to its embeddings -> the expanded batch's tokens.
    flat = collapsed.input_ids.reshape(-1)
    repeats = torch.ones_like(flat)
    repeats[flat == image_token_id] = collapsed.tokens_per_image
    assert torch.equal(flat.repeat_interleave(repeats), expanded.input_ids.reshape(-1))
    # 4. Labels shift inside each sample: a sample's last real token never predicts the next sample's first.
    last_real = collapsed.cu_seqlens_padded[:-1] + collapsed.seq_lens - 1
    assert (inputs["labels"].reshape(-1)[last_real] == -100).all()
    print(
        "\nchecks passed: expanded boundaries == expanded-layout batch == remap_cu_seqlens_padded; "
        "expansion reproduces the expanded tokens; labels shifted per sample"
    )
    print(
        f"collapsed offsets used after expansion would start samples at {collapsed.cu_seqlens_padded[1:-1].tolist()}"
        f" instead of {params.cu_seqlens_q_padded[1:-1].tolist()}"
    )
    return {
        "cu_seqlens_collapsed": collapsed.cu_seqlens_padded.tolist(),
        "cu_seqlens_expanded": params.cu_seqlens_q_padded.tolist(),
        "keys": [keys[i] for i in order],
    }


if __name__ == "__main__":
    main()
