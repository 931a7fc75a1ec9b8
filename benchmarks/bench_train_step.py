"""Training-step benchmark: padded batches vs packed rows with varlen attention, Qwen2-VL-shaped model.

The same samples go through both modes, one optimizer step per step, from the same initial weights::

    padded   micro-batches of --batch-size samples, each padded to its longest sample, attention_mask,
             attention --padded-attn (default "sdpa", what transformers runs by default)
    packed   rows of up to --capacity tokens (first-fit decreasing), micro-batch = 1 row, no padding,
             per-sample position ids (4, 1, T), attention "vlm_pack_varlen" with --backend

Samples follow the VLM SFT mix: text 50..1500 tokens, 0..3 images of 64..1280 vision tokens (plus
<|vision_start|>/<|vision_end|>), drawn with a fixed seed; the images are real inputs of the vision tower
(random pixel patches with a valid grid_thw). On CPU, --length-scale (default capacity / 8192) shrinks all
lengths so that the same mix fits the smaller capacity.

Timing runs both modes in one process, alternating step by step (each step --repeats times per mode, the
fastest counts), so that load from other processes on a shared machine hits both alike. Peak memory comes
from one fresh subprocess per mode (CUDA max_memory_allocated; CPU peak RSS above the RSS before the first
step). Reported per mode: real tokens/s (text + vision tokens in the LLM sequence, over the timed steps),
peak memory, padding share (padding / computed tokens), and the first-step loss (sum of token losses /
number of label tokens, before any update: must agree between modes).

    python benchmarks/bench_train_step.py --device cpu --capacity 2048 --steps 4
    python benchmarks/bench_train_step.py --device cpu --capacity 2048 --kernels   # attention alone
    python benchmarks/bench_train_step.py --device cuda --backend flash_attn --capacity 8192
    python benchmarks/bench_train_step.py --device cuda --backend torch_varlen --capacity 8192
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlm_pack.attention import available_backends, select_backend, use_varlen_attention, varlen_attention
from vlm_pack.offline import build_tokenizer, tiny_model_config

MERGE = 2  # Qwen2-VL spatial_merge_size: a vision token is a 2x2 block of 14x14 patches
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch

MODEL_SIZES = {  # (hidden, layers, heads, kv_heads, vision_hidden, vision_layers)
    "cpu": (256, 4, 8, 4, 64, 1),
    "cuda": (1024, 8, 16, 4, 256, 2),
}


@dataclass
class Sample:
    input_ids: torch.Tensor  # (L,)
    grids: list[tuple[int, int, int]]  # (t, h, w) patch grid per image
    pixel_values: torch.Tensor | None  # (sum t*h*w, PATCH_DIM), same pixels in both modes


def synth_samples(n: int, seed: int, scale: float, tok) -> list[Sample]:
    """The SFT length mix, lengths multiplied by ``scale`` (vision grids keep even sides)."""
    rng = np.random.default_rng(seed)
    pad, start, end = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    vocab = len(tok)
    out = []
    for _ in range(n):
        n_text = max(4, round(rng.integers(50, 1501) * scale))
        n_images = int(rng.choice(4, p=[0.25, 0.45, 0.2, 0.1]))
        cuts = np.sort(rng.integers(0, n_text + 1, n_images))
        text = rng.integers(20, vocab, n_text)
        ids, grids, prev = [], [], 0
        for cut in cuts:
            tokens = max(4, round(rng.integers(64, 1281) * scale))  # vision tokens of this image
            h = max(1, round(math.sqrt(tokens * rng.uniform(0.5, 2.0))))
            w = max(1, round(tokens / h))
            grids.append((1, MERGE * h, MERGE * w))
            ids += text[prev:cut].tolist() + [start] + [pad] * (h * w) + [end]
            prev = cut
        ids += text[prev:].tolist()
        n_patches = sum(t * h * w for t, h, w in grids)
        pixels = (
            torch.from_numpy(rng.standard_normal((n_patches, PATCH_DIM), dtype=np.float32)) if grids else None
        )
        out.append(Sample(torch.tensor(ids), grids, pixels))
    return out


def pack_ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: lists of sample indices per row (a sample longer than capacity raises)."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"sample {i} has {lengths[i]} tokens > capacity {capacity}; raise --capacity")
        j = next((j for j, f in enumerate(free) if f >= lengths[i]), None)
        if j is None:
            rows.append([i])
            free.append(capacity - lengths[i])
        else:
            rows[j].append(i)
            free[j] -= lengths[i]
    return rows


def labels_for(ids: torch.Tensor, starts: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """Next-token labels aligned to positions: -100 at a sample's last token and where the next token is
    a vision token (never predict across a sample boundary)."""
    labels = torch.full_like(ids, -100)
    labels[:-1] = ids[1:]
    last = torch.zeros_like(ids, dtype=torch.bool)
    last[starts[1:] - 1] = True
    last[-1] = True
    return labels.masked_fill(last | torch.isin(labels, special), -100)


def pixel_inputs(samples: list[Sample]):
    grids = [g for s in samples for g in s.grids]
    if not grids:
        return None, None
    return torch.cat([s.pixel_values for s in samples if s.grids]), torch.tensor(grids)


def build_padded(samples, batch_size, special, image_id):
    batches = []
    for b in range(0, len(samples), batch_size):
        group = samples[b : b + batch_size]
        longest = max(len(s.input_ids) for s in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for r, s in enumerate(group):
            n = len(s.input_ids)
            ids[r, :n], mask[r, :n] = s.input_ids, 1
            labels[r, :n] = labels_for(s.input_ids, torch.tensor([0, n]), special)
        pv, grid = pixel_inputs(group)
        inputs = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == image_id).int() * mask)
        if pv is not None:
            inputs.update(pixel_values=pv, image_grid_thw=grid)
        batches.append((inputs, labels, int(mask.sum()), ids.numel()))
    return batches


def build_packed(samples, capacity, special, image_id, model):
    rows = pack_ffd([len(s.input_ids) for s in samples], capacity)
    batches = []
    for row in rows:
        group = [samples[i] for i in row]
        ids = torch.cat([s.input_ids for s in group])
        lengths = torch.tensor([len(s.input_ids) for s in group])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        positions = []
        for s in group:  # (4, 1, L): text arange + the sample's own mRoPE rows
            grid = torch.tensor(s.grids) if s.grids else None
            mm = (s.input_ids[None] == image_id).int()
            rope = model.model.get_rope_index(s.input_ids[None], mm_token_type_ids=mm, image_grid_thw=grid)[0]
            positions.append(torch.cat([torch.arange(len(s.input_ids)).view(1, 1, -1), rope]))
        pv, grid = pixel_inputs(group)
        inputs = dict(input_ids=ids[None], position_ids=torch.cat(positions, -1))
        if pv is not None:
            inputs.update(pixel_values=pv, image_grid_thw=grid)
        batches.append((inputs, labels_for(ids, starts, special)[None], len(ids), len(ids)))
    return batches


def to_device(inputs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    out = {}
    for k, v in inputs.items():
        v = v.to(device)
        out[k] = v.to(dtype) if k == "pixel_values" else v
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Restart the kernel's RSS high-water mark (VmHWM) from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    # VmHWM, not getrusage's ru_maxrss: that one is inherited from the parent across fork/exec.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class Trainer:
    """One mode: its model (same initial weights in every mode), optimizer and micro-batch builder."""

    def __init__(self, mode: str, args, tok) -> None:
        from transformers import Qwen2VLForConditionalGeneration

        self.mode, self.args = mode, args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        hidden, layers, heads, kv_heads, v_hidden, v_layers = MODEL_SIZES[self.device.type]
        self.config = tiny_model_config(
            "qwen2_vl",
            tok,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            vision_hidden_size=v_hidden,
            vision_layers=v_layers,
            initializer_range=args.init_std,
        )
        self.attention = args.padded_attn if mode == "padded" else "sdpa"
        torch.manual_seed(0)  # same initial weights in both modes
        self.model = Qwen2VLForConditionalGeneration._from_config(
            self.config, attn_implementation=self.attention, dtype=self.dtype
        ).to(self.device)
        if mode == "packed":
            use_varlen_attention(self.model, backend=args.backend)
            backend = args.backend
            if backend == "auto":  # what "auto" picks for this model's q (dtype, head_dim, grad)
                q = torch.empty(
                    1, heads, hidden // heads, device=self.device, dtype=self.dtype, requires_grad=True
                )
                backend = select_backend(q)
            self.attention = f"vlm_pack_varlen/{backend}"
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        self.special = torch.tensor(
            tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
        )

    def batches(self, samples: list[Sample]) -> list:
        image_id = self.config.image_token_id
        if self.mode == "padded":
            out = build_padded(samples, self.args.batch_size, self.special, image_id)
        else:
            out = build_packed(samples, self.args.capacity, self.special, image_id, self.model)
        return [(to_device(i, self.device, self.dtype), lab.to(self.device), r, c) for i, lab, r, c in out]

    def step(self, batches: list) -> tuple[float, float]:
        """One optimizer step over all micro-batches: (seconds, loss = token-loss sum / label count)."""
        n_labels = sum(int((lab != -100).sum()) for _, lab, _, _ in batches)
        self.sync()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for inputs, labels, _, _ in batches:
            logits = self.model(**inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / n_labels
            loss.backward()
            loss_sum += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0, loss_sum

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def measure_memory(args) -> dict:
    """Peak memory of one mode alone in this process: warm-up step + --steps steps."""
    tok = build_tokenizer("qwen2_vl")
    trainer = Trainer(args.mode, args, tok)
    scale = args.length_scale or args.capacity / 8192
    reset_peak_rss()
    rss0, peak = rss_bytes(), 0
    for step in range(args.steps + 1):
        batches = trainer.batches(synth_samples(args.samples_per_step, args.seed + step, scale, tok))
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.step(batches)
        if trainer.device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated())
    if trainer.device.type != "cuda":
        peak = peak_rss_bytes() - rss0
    return dict(mode=args.mode, peak_mem_mib=peak / 2**20)


def run_timing(args) -> dict:
    """Both modes in this process, alternated step by step (and repeat by repeat, in swapped order), so
    that load from other processes hits both alike; per step the fastest repeat counts."""
    tok = build_tokenizer("qwen2_vl")
    trainers = {mode: Trainer(mode, args, tok) for mode in ("padded", "packed")}
    scale = args.length_scale or args.capacity / 8192
    stats = {m: dict(seconds=[], real=0, computed=0, micro=0) for m in trainers}
    first_loss = {}
    for step in range(args.steps + 1):  # step 0: warm-up, gives the first-step loss
        samples = synth_samples(args.samples_per_step, args.seed + step, scale, tok)
        batches = {m: t.batches(samples) for m, t in trainers.items()}
        best = dict.fromkeys(trainers, float("inf"))
        for rep in range(args.repeats):
            for m in list(trainers)[:: 1 if rep % 2 == 0 else -1]:
                seconds, loss = trainers[m].step(batches[m])
                best[m] = min(best[m], seconds)
                if step == 0 and rep == 0:
                    first_loss[m] = loss
        if step == 0:
            continue
        for m, b in batches.items():
            stats[m]["seconds"].append(best[m])
            stats[m]["real"] += sum(x[2] for x in b)
            stats[m]["computed"] += sum(x[3] for x in b)
            stats[m]["micro"] += len(b)
    return {
        m: dict(
            mode=m,
            attention=trainers[m].attention,
            tokens_per_s=st["real"] / sum(st["seconds"]),
            step_seconds=[round(x, 3) for x in st["seconds"]],
            padding_share=1 - st["real"] / st["computed"],
            micro_batches=st["micro"] / args.steps,
            first_loss=first_loss[m],
        )
        for m, st in stats.items()
    }


def bench_kernels(args) -> None:
    """Attention alone on one packed row of the mix: every available backend, and the padded batch of the
    same samples through SDPA (what the padded mode's attention computes), best of --repeats x 3 calls."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, _, heads, kv_heads, _, _ = MODEL_SIZES[device.type]
    dim = hidden // heads
    tok = build_tokenizer("qwen2_vl")
    scale = args.length_scale or args.capacity / 8192
    lengths = [len(s.input_ids) for s in synth_samples(args.samples_per_step, args.seed, scale, tok)]
    row = max(pack_ffd(lengths, args.capacity), key=lambda r: sum(lengths[i] for i in r))
    row_lengths = [lengths[i] for i in row]
    total = sum(row_lengths)
    cu = torch.tensor([0, *np.cumsum(row_lengths).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(total, h, dim, device=device, dtype=dtype, generator=gen)
        for h in (heads, kv_heads, kv_heads)
    )

    def timeit(fn) -> float:
        best = float("inf")
        for _ in range(max(1, args.repeats) * 3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    def fwd_bwd(run):
        def go():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            run(qq, kk, vv).sum().backward()

        return go

    # The padded batch: the row's samples, one per line, padded to the longest (key padding mask).
    longest = max(row_lengths)
    pad_mask = (
        torch.arange(longest, device=device)[None, :] < torch.tensor(row_lengths, device=device)[:, None]
    )
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    mask4 = (pad_mask[:, None, None, :] & causal) | ~pad_mask[:, None, :, None]  # pad queries see all: no NaN

    def padded(qq, kk, vv):
        def lay(x):  # (T, H, D) -> (B, H, Lmax, D)
            out = x.new_zeros(len(row_lengths), longest, x.shape[1], dim)
            out[pad_mask] = x
            return out.transpose(1, 2)

        groups = heads // kv_heads
        kk, vv = (lay(x).repeat_interleave(groups, 1) for x in (kk, vv))
        return F.scaled_dot_product_attention(lay(qq), kk, vv, attn_mask=mask4).transpose(1, 2)[pad_mask]

    print(
        f"attention only: one packed row of {total} tokens ({len(row_lengths)} samples, longest {longest}), "
        f"{heads} heads / {kv_heads} kv, head_dim {dim}, {dtype}, {device}"
    )
    print(f"{'attention':32} {'fwd ms':>9} {'fwd+bwd ms':>11}")
    print(
        f"{'padded batch, sdpa + mask':32} {timeit(lambda: padded(q, k, v)):9.2f} {timeit(fwd_bwd(padded)):11.2f}"
    )
    grad_ok = set(available_backends(device, dtype, dim, requires_grad=True))
    for name in available_backends(device, dtype, dim):

        def run(qq, kk, vv, name=name):
            return varlen_attention(qq, kk, vv, cu, longest, backend=name)

        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            fwd = timeit(lambda run=run: run(q, k, v))
        both = f"{timeit(fwd_bwd(run)):11.2f}" if name in grad_ok else f"{'n/a':>11}"
        label = f"varlen {name}" + (" (uncompiled)" if name == "flex" and device.type == "cpu" else "")
        print(f"{label:32} {fwd:9.2f} {both}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--capacity", type=int, default=8192, help="packed row length (CPU: 2048 is plenty)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    p.add_argument("--backend", default="auto", help="varlen backend of the packed mode")
    p.add_argument("--padded-attn", default="sdpa", help="attn_implementation of the padded mode")
    p.add_argument("--samples-per-step", type=int, default=0, help="default: about 4 rows' worth")
    p.add_argument("--batch-size", type=int, default=0, help="padded micro-batch (default: samples per row)")
    p.add_argument("--length-scale", type=float, default=0.0, help="default: capacity / 8192")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=3, help="repeats of each step per mode; the fastest counts")
    p.add_argument("--init-std", type=float, default=0.02, help="initializer_range of the model")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--kernels", action="store_true", help="time the attention backends alone and exit")
    p.add_argument("--mode", choices=["padded", "packed"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # The mix averages ~1550 tokens at scale 1 (8192 capacity): ~5 samples per row, 16 per step ~ 3-4 rows.
    if not args.samples_per_step:
        args.samples_per_step = 16
    if not args.batch_size:
        args.batch_size = 4
    if args.mode:
        print(json.dumps(measure_memory(args)))
        return
    if args.kernels:
        bench_kernels(args)
        return

    results = run_timing(args)
    for mode in results:  # memory: each mode alone in a fresh process
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.exit(f"{mode} memory run failed:\n{proc.stderr[-4000:]}")
        results[mode].update(json.loads(proc.stdout.strip().splitlines()[-1]))
    dev = torch.device(args.device)
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    else:
        print(f"device: cpu ({torch.get_num_threads()} threads), torch {torch.__version__}")
    scale = args.length_scale or args.capacity / 8192
    print(
        f"capacity {args.capacity}, length scale {scale:g}, {args.samples_per_step} samples/step, "
        f"padded micro-batch {args.batch_size}, {args.steps} timed steps after 1 warm-up, modes alternated, "
        f"best of {args.repeats} repeats per step"
    )
    header = f"{'mode':7} {'attention':30} {'real tok/s':>11} {'peak MiB':>9} {'padding':>8} {'micro-b':>8} {'first loss':>11}"
    print(header)
    for r in results.values():
        print(
            f"{r['mode']:7} {r['attention']:30} {r['tokens_per_s']:11.0f} {r['peak_mem_mib']:9.0f} "
            f"{r['padding_share']:8.1%} {r['micro_batches']:8.1f} {r['first_loss']:11.6f}"
        )
    pad, pk = results["padded"], results["packed"]
    print(f"packed / padded real tokens/s: {pk['tokens_per_s'] / pad['tokens_per_s']:.2f}x")
    print(f"packed / padded peak memory:   {pk['peak_mem_mib'] / pad['peak_mem_mib']:.2f}x")
    diff = abs(pk["first_loss"] - pad["first_loss"])
    tol = (2e-2 if dev.type == "cuda" else 1e-4) * max(1.0, pad["first_loss"])  # bf16 on CUDA, fp32 on CPU
    print(
        f"first-step loss |padded - packed| = {diff:.2e} ({'match' if diff <= tol else 'MISMATCH'}, tol {tol:.0e})"
    )
    print(f"step seconds: padded {pad['step_seconds']}, packed {pk['step_seconds']}")


if __name__ == "__main__":
    main()
