"""Training-step benchmark on the demo data: padded batches vs packed rows with varlen attention, Qwen2-VL.

Everything on the packed side is the product, end to end; the padded side is what a plain HF run does::

    demo shards (vlm_pack.demo) --read--> S samples per optimizer step, in data order
       |                                         |
       | forecast_length (headers only)          | process_sample: real images through the Qwen2-VL
       v                                         v image processor (pixel_values, image_grid_thw)
    packed   pack(lengths, capacity, "bfd") -> bins -> PackingCollator -> batch.model_inputs("sdpa")
             one row per micro-batch, no attention_mask, per-sample (4, 1, T) mRoPE position ids,
             model switched by use_varlen_attention(model, backend=--backend)
    padded   the same S samples in micro-batches of B, padded to the longest (right), attention_mask,
             the model's own attn_implementation="sdpa"

B defaults to the packed run's mean samples per row (rounded), so both modes take about as many
forward/backward calls per step, each holding as many real tokens on average; --batch-size overrides.
Both models are ``vlm_pack.offline.tiny_model("qwen2_vl")`` from the same seed (widths from the flags),
so the first step starts from identical weights on identical samples. The loss is HF's per-token loss with
``num_items_in_batch`` = label tokens of the whole step: summed over micro-batches it is the same number
in both modes (checked: the first-step losses must agree, else exit 1).

Timing runs both modes in one process, alternating step by step (each step --repeats times per mode, in
swapped order on odd repeats, the fastest counts), so that load from other processes on a shared machine
hits both alike. Peak memory comes from one fresh subprocess per mode, fed the same micro-batches (CUDA
max_memory_allocated; CPU peak RSS (VmHWM) above the RSS before the first step). Reported per mode: real
tokens/s (every non-pad token of the LLM sequence, text and vision, labels or not, over the timed steps),
peak memory, padding share (pad tokens / computed tokens), micro-batches per step, first-step loss.

Image cap: --max-pixels (default 512 * 28 * 28 = 401408 on CPU, i.e. <= 512 vision tokens per image, so
that a CPU run takes a few minutes; 1280 * 28 * 28 on CUDA, the max_pixels Qwen2-VL's model card suggests
for training; "checkpoint" for the released processor's 12845056, where samples longer than --capacity
are left out of both modes and reported).

    python benchmarks/bench_train_step.py --device cpu --capacity 4096 --steps 4
    python benchmarks/bench_train_step.py --device cpu --capacity 4096 --kernels   # attention alone
    python benchmarks/bench_train_step.py --device cuda --backend torch_varlen --capacity 8192
    python benchmarks/bench_train_step.py --device cuda --backend flash_attn --capacity 8192 --max-pixels checkpoint
    python benchmarks/bench_train_step.py --device cuda --backend torch_varlen --sync-debug --layers 2   # and 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import webdataset as wds

from vlm_pack.collate.collator import PackingCollator
from vlm_pack.data import image_fields, parse_text
from vlm_pack.demo import demo_shards
from vlm_pack.forward.attention import (
    available_backends,
    resolve_backend,
    use_varlen_attention,
    varlen_attention,
)
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model, tiny_model_config
from vlm_pack.packing import pack
from vlm_pack.processing import forecast_length, process_sample
from vlm_pack.vision import image_size, vision_spec_from_processor

IGNORE = -100
MAX_PIXELS = {"cpu": 512 * 28 * 28, "cuda": 1280 * 28 * 28}
MODEL_SIZES = {  # hidden, layers, heads, kv_heads, vision_hidden, vision_layers
    "cpu": (256, 4, 8, 4, 64, 1),
    "cuda": (1024, 8, 16, 4, 256, 2),
}
MODEL_FLAGS = ("hidden", "layers", "heads", "kv_heads", "vision_hidden", "vision_layers")


# ---------------------------------------------------------------------------------------------- data


def read_demo(urls: list[str]) -> list[dict[str, Any]]:
    """Raw demo samples: key, encoded image bytes (placeholder order), conversation. Nothing decoded."""
    return [
        {"key": s["__key__"], "images": [s[f] for f in image_fields(s)], "conversation": parse_text(s)}
        for s in wds.WebDataset(urls, shardshuffle=False)
    ]


def prepare_steps(args, tokenizer, image_proc) -> tuple[list[dict], dict]:
    """Per optimizer step (warm-up first): the processed samples, their forecast lengths and the pack plan.

    Samples longer than ``capacity`` are left out of both modes (printed with their keys); the rest are
    taken in data order, ``--samples-per-step`` per step.
    """
    raw = read_demo([str(p) for p in demo_shards()])
    spec = vision_spec_from_processor(image_proc)
    lengths = [
        forecast_length(
            s["conversation"],
            [image_size(b) for b in s["images"]],
            tokenizer=tokenizer,
            spec=spec,
            key=s["key"],
        )[0]
        for s in raw
    ]
    fits = [i for i, n in enumerate(lengths) if n <= args.capacity]
    skipped = [raw[i]["key"] for i, n in enumerate(lengths) if n > args.capacity]
    need = (args.steps + 1) * args.samples_per_step
    if len(fits) < need:
        raise SystemExit(
            f"the demo has {len(fits)} samples within capacity {args.capacity} but {args.steps + 1} steps x "
            f"{args.samples_per_step} samples need {need}: lower --steps / --samples-per-step"
        )
    steps = []
    for step in range(args.steps + 1):
        idx = fits[step * args.samples_per_step : (step + 1) * args.samples_per_step]
        lens = [lengths[i] for i in idx]
        samples = []
        for i in idx:
            s = raw[i]
            out = process_sample(
                s["images"], s["conversation"], tokenizer=tokenizer, image_processor=image_proc, key=s["key"]
            )
            if out["input_ids"].numel() != lengths[i]:  # the forecast is what packing relies on
                raise AssertionError(
                    f"{s['key']}: forecast {lengths[i]} != processed {out['input_ids'].numel()}"
                )
            samples.append({**out, "__key__": s["key"]})
        plan = pack(lens, args.capacity, strategy="bfd")
        steps.append(dict(samples=samples, lengths=lens, bins=plan.bins, efficiency=plan.efficiency))
    info = dict(
        demo_samples=len(raw),
        skipped=skipped,
        mean_length=float(np.mean([n for s in steps for n in s["lengths"]])),
        max_length=max(n for s in steps for n in s["lengths"]),
    )
    return steps, info


def packed_batches(step: dict, collator: PackingCollator) -> list[tuple[dict, int, int, int]]:
    """(model inputs, label tokens, real tokens, computed tokens) per row of the step's pack plan."""
    out = []
    for b in step["bins"]:
        batch = collator([step["samples"][i] for i in b])
        if batch.num_rows != 1:  # the plan's bins fit one row each: the forecast is exact
            raise AssertionError(f"bin {b} collated into {batch.num_rows} rows")
        out.append(
            (batch.model_inputs("sdpa"), batch.num_label_tokens, batch.num_real_tokens, batch.row_length)
        )
    return out


def padded_batches(step: dict, batch_size: int, pad_id: int) -> list[tuple[dict, int, int, int]]:
    """The step's samples in data order, ``batch_size`` per micro-batch, right-padded to the longest."""
    out = []
    samples = step["samples"]
    for a in range(0, len(samples), batch_size):
        group = samples[a : a + batch_size]

        def pad(key: str, value: int, group=group) -> torch.Tensor:
            return torch.nn.utils.rnn.pad_sequence(
                [s[key] for s in group], batch_first=True, padding_value=value
            )

        ids = pad("input_ids", pad_id)
        mask = pad("input_ids", -1) != -1  # (B, L): real tokens
        labels = pad("labels", IGNORE)
        inputs = dict(
            input_ids=ids,
            attention_mask=mask.long(),
            labels=labels,
            mm_token_type_ids=pad("mm_token_type_ids", 0),
            use_cache=False,
        )
        with_images = [s for s in group if s["tokens_per_image"].numel()]
        if with_images:
            inputs["pixel_values"] = torch.cat([s["pixel_values"] for s in with_images])
            inputs["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in with_images])
        # HF shifts labels by one inside each row: a row's first label is never a target.
        out.append((inputs, int((labels[:, 1:] != IGNORE).sum()), int(mask.sum()), ids.numel()))
    return out


def to_device(inputs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    def move(k: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        v = v.to(device)
        return v.to(dtype) if k == "pixel_values" else v

    return {k: move(k, v) for k, v in inputs.items()}


# ---------------------------------------------------------------------------------------------- memory


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


# ---------------------------------------------------------------------------------------------- training


class Trainer:
    """One mode: its model (same initial weights in every mode) and optimizer."""

    def __init__(self, mode: str, args, tokenizer) -> None:
        self.mode, self.args = mode, args
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        dims = {k: getattr(args, k) for k in MODEL_FLAGS}
        self.model = tiny_model(
            "qwen2_vl",
            tokenizer,
            seed=0,
            attn_implementation="sdpa",
            initializer_range=args.init_std,
            hidden_size=dims["hidden"],
            num_layers=dims["layers"],
            num_heads=dims["heads"],
            num_kv_heads=dims["kv_heads"],
            vision_hidden_size=dims["vision_hidden"],
            vision_layers=dims["vision_layers"],
        ).to(self.device, self.dtype)
        self.attention = "sdpa"
        if mode == "packed":
            use_varlen_attention(self.model, backend=args.backend)
            backend = args.backend
            if backend == "auto":  # what "auto" picks for this model's q (dtype, head_dim, grad)
                head_dim = args.hidden // args.heads
                q = torch.empty(
                    1, args.heads, head_dim, device=self.device, dtype=self.dtype, requires_grad=True
                )
                backend = resolve_backend("auto", q)
            self.attention = f"vlm_pack_varlen/{backend}"
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)

    def step(self, batches: list) -> tuple[float, float]:
        """One optimizer step over all micro-batches: (seconds, loss = token-loss sum / label tokens)."""
        n_items = sum(b[1] for b in batches)
        self.sync()
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        for inputs, *_ in batches:
            loss = self.model(**inputs, num_items_in_batch=n_items).loss
            loss.backward()
            loss_sum += loss.detach()  # on the device: no host sync per micro-batch
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0, float(loss_sum)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def build_batches(args, steps: list[dict], tokenizer, config) -> dict[str, list[list]]:
    """Micro-batches of every step for both modes (CPU tensors)."""
    collator = PackingCollator(
        args.capacity, tokenizer=tokenizer, model_config=config, pad_to_capacity=args.pad_rows
    )
    return {
        "padded": [padded_batches(s, args.batch_size, tokenizer.pad_token_id) for s in steps],
        "packed": [packed_batches(s, collator) for s in steps],
    }


def measure_memory(args) -> dict:
    """Peak memory of one mode alone in this process: the saved micro-batches, warm-up + --steps steps."""
    tokenizer = build_tokenizer("qwen2_vl")
    all_batches = torch.load(args.batches_file, weights_only=False)[args.mode]
    trainer = Trainer(args.mode, args, tokenizer)
    moved = [
        [(to_device(i, trainer.device, trainer.dtype), *rest) for i, *rest in step] for step in all_batches
    ]
    reset_peak_rss()
    rss0, peak = rss_bytes(), 0
    for batches in moved:
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.step(batches)
        if trainer.device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated())
    if trainer.device.type != "cuda":
        peak = peak_rss_bytes() - rss0
    return dict(mode=args.mode, peak_mem_mib=peak / 2**20)


def run_timing(args, all_batches: dict, tokenizer) -> dict:
    """Both modes in this process, alternated step by step (and repeat by repeat, in swapped order), so
    that load from other processes hits both alike; per step the fastest repeat counts."""
    trainers = {mode: Trainer(mode, args, tokenizer) for mode in ("padded", "packed")}
    stats = {m: dict(seconds=[], real=0, computed=0, micro=0) for m in trainers}
    first_loss, label_tokens = {}, {}
    for step in range(args.steps + 1):  # step 0: warm-up, gives the first-step loss
        batches = {
            m: [(to_device(i, t.device, t.dtype), *rest) for i, *rest in all_batches[m][step]]
            for m, t in trainers.items()
        }
        best = dict.fromkeys(trainers, float("inf"))
        for rep in range(args.repeats):
            for m in list(trainers)[:: 1 if rep % 2 == 0 else -1]:
                seconds, loss = trainers[m].step(batches[m])
                best[m] = min(best[m], seconds)
                if step == 0 and rep == 0:
                    first_loss[m] = loss
                    label_tokens[m] = sum(b[1] for b in batches[m])
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
            real_tokens=st["real"],
            step_seconds=[round(x, 3) for x in st["seconds"]],
            padding_share=1 - st["real"] / st["computed"],
            micro_batches=st["micro"] / args.steps,
            first_loss=first_loss[m],
            label_tokens=label_tokens[m],
        )
        for m, st in stats.items()
    }


def report_cuda_syncs(args, step_batches: list, tokenizer) -> None:
    """Host syncs CUDA reports (``torch.cuda.set_sync_debug_mode("warn")``) during one packed optimizer
    step, after a warm-up step. Run with two --layers values: the count must not change with the depth
    (the step's own two: reading the loss back and the timing synchronize)."""
    if torch.device(args.device).type != "cuda":
        sys.exit("--sync-debug needs --device cuda (CPU tensors never sync)")
    trainer = Trainer("packed", args, tokenizer)
    batches = [(to_device(i, trainer.device, trainer.dtype), *rest) for i, *rest in step_batches]
    trainer.step(batches)  # warm-up: kernel selection, allocator, caches
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step(batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    print(
        f"{trainer.attention}, {args.layers} layers: {len(syncs)} host syncs in one optimizer step of "
        f"{len(batches)} micro-batches ({len(syncs) / len(batches):.1f} per micro-batch)"
    )
    for where in sorted(set(syncs)):
        print(f"  {syncs.count(where)} x {where.splitlines()[0][:160]}")


# ---------------------------------------------------------------------------------------------- kernels


def bench_kernels(args, steps: list[dict]) -> None:
    """Attention alone on the fullest packed row of the warm-up step: every available backend, and the
    padded batch of the same samples through SDPA, best of --repeats x 3 calls."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim = args.heads, args.kv_heads, args.hidden // args.heads
    step = steps[0]
    row = max(step["bins"], key=lambda b: sum(step["lengths"][i] for i in b))
    row_lengths = [step["lengths"][i] for i in row]
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
        f"attention only: the fullest packed row of the demo warm-up step, {total} tokens ({len(row_lengths)} "
        f"samples, longest {longest}), {heads} heads / {kv_heads} kv, head_dim {dim}, {dtype}, {device}"
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


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--capacity", type=int, default=0, help="packed row length (default: 8192; CPU: 4096)")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps (after one warm-up step)")
    p.add_argument("--backend", default="auto", help="varlen backend of the packed mode")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each step per mode; the fastest counts")
    p.add_argument("--samples-per-step", type=int, default=16, help="demo samples per optimizer step")
    p.add_argument("--batch-size", type=int, default=0, help="padded micro-batch (default: samples per row)")
    p.add_argument(
        "--max-pixels",
        default="",
        help="image processor longest_edge (pixels); 'checkpoint' = the released processor's; "
        "default 401408 on CPU, 1003520 on CUDA",
    )
    p.add_argument("--pad-rows", action="store_true", help="pad packed rows to --capacity (static shapes)")
    p.add_argument("--hidden", type=int, default=0, help="text hidden size (default by device)")
    p.add_argument("--layers", type=int, default=0, help="text layers (default by device)")
    p.add_argument("--heads", type=int, default=0, help="attention heads (default by device)")
    p.add_argument("--kv-heads", type=int, default=0, help="KV heads (default by device)")
    p.add_argument("--vision-hidden", type=int, default=0, help="vision tower width (default by device)")
    p.add_argument("--vision-layers", type=int, default=0, help="vision tower blocks (default by device)")
    p.add_argument("--init-std", type=float, default=0.02, help="initializer_range of the model")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--kernels", action="store_true", help="time the attention backends alone and exit")
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: count the host syncs of one packed optimizer step (torch.cuda.set_sync_debug_mode) and exit",
    )
    p.add_argument("--mode", choices=["padded", "packed"], help=argparse.SUPPRESS)
    p.add_argument("--batches-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    kind = torch.device(args.device).type
    kind = kind if kind in MODEL_SIZES else "cuda"
    for name, default in zip(MODEL_FLAGS, MODEL_SIZES[kind], strict=True):
        if not getattr(args, name):
            setattr(args, name, default)
    if not args.capacity:
        args.capacity = 4096 if kind == "cpu" else 8192
    return args


def make_image_processor(args):
    if args.max_pixels == "checkpoint":
        return image_processor("qwen2_vl")
    cap = int(args.max_pixels) if args.max_pixels else MAX_PIXELS["cpu" if args.device == "cpu" else "cuda"]
    return image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": cap})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode:  # memory child
        print(json.dumps(measure_memory(args)))
        return

    tokenizer = build_tokenizer("qwen2_vl")
    image_proc = make_image_processor(args)
    t0 = time.perf_counter()
    steps, info = prepare_steps(args, tokenizer, image_proc)
    prep_s = time.perf_counter() - t0
    if args.kernels:
        bench_kernels(args, steps)
        return
    rows = sum(len(s["bins"]) for s in steps)
    if not args.batch_size:  # as many padded micro-batches as packed rows, on average
        args.batch_size = max(1, round(len(steps) * args.samples_per_step / rows))
    config = tiny_model_config(  # the collator reads ids, merge size and family from it
        "qwen2_vl",
        tokenizer,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vision_hidden_size=args.vision_hidden,
        vision_layers=args.vision_layers,
    )
    all_batches = build_batches(args, steps, tokenizer, config)
    if args.sync_debug:
        report_cuda_syncs(args, all_batches["packed"][0], tokenizer)
        return
    results = run_timing(args, all_batches, tokenizer)

    with tempfile.TemporaryDirectory() as tmp:  # memory: each mode alone in a fresh process
        path = os.path.join(tmp, "batches.pt")
        torch.save(all_batches, path)
        argv_child = list(sys.argv[1:] if argv is None else argv)
        for mode in results:
            cmd = [sys.executable, __file__, *argv_child, "--mode", mode, "--batches-file", path]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode:
                sys.exit(f"{mode} memory run failed:\n{proc.stderr[-4000:]}")
            results[mode].update(json.loads(proc.stdout.strip().splitlines()[-1]))

    dev = torch.device(args.device)
    if dev.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    else:
        print(f"device: cpu ({torch.get_num_threads()} threads), torch {torch.__version__}")
    longest = image_proc.size["longest_edge"]
    print(
        f"model: Qwen2-VL from config, text {args.hidden} x {args.layers} layers, {args.heads} heads / "
        f"{args.kv_heads} kv, vision {args.vision_hidden} x {args.vision_layers}, "
        f"{'bf16' if dev.type == 'cuda' else 'fp32'}, AdamW"
    )
    print(
        f"data: demo shards ({info['demo_samples']} samples), images capped at {longest} px "
        f"(<= {longest // 784} vision tokens), {len(info['skipped'])} samples > capacity left out; "
        f"{args.samples_per_step} samples/step, mean {info['mean_length']:.0f} tokens, "
        f"longest {info['max_length']}; prepared in {prep_s:.0f} s"
    )
    eff = np.mean([s["efficiency"] for s in steps])
    print(
        f"capacity {args.capacity} (bfd, mean fill {eff:.1%}{', rows padded to capacity' if args.pad_rows else ''}), "
        f"padded micro-batch {args.batch_size}, {args.steps} timed steps after 1 warm-up, modes alternated, "
        f"best of {args.repeats} repeats per step"
    )
    print(
        f"{'mode':7} {'attention':30} {'real tok/s':>11} {'peak MiB':>9} {'padding':>8} {'micro-b':>8} "
        f"{'first loss':>11}"
    )
    for r in results.values():
        print(
            f"{r['mode']:7} {r['attention']:30} {r['tokens_per_s']:11.0f} {r['peak_mem_mib']:9.0f} "
            f"{r['padding_share']:8.1%} {r['micro_batches']:8.1f} {r['first_loss']:11.6f}"
        )
    pad, pk = results["padded"], results["packed"]
    assert pad["real_tokens"] == pk["real_tokens"] and pad["label_tokens"] == pk["label_tokens"]
    print(f"packed / padded real tokens/s: {pk['tokens_per_s'] / pad['tokens_per_s']:.2f}x")
    print(f"packed / padded peak memory:   {pk['peak_mem_mib'] / pad['peak_mem_mib']:.2f}x")
    diff = abs(pk["first_loss"] - pad["first_loss"])
    tol = (2e-2 if dev.type == "cuda" else 1e-4) * max(1.0, pad["first_loss"])  # bf16 on CUDA, fp32 on CPU
    print(
        f"first-step loss |padded - packed| = {diff:.2e} over {pad['label_tokens']} label tokens "
        f"({'match' if diff <= tol else 'MISMATCH'}, tol {tol:.0e})"
    )
    print(f"step seconds: padded {pad['step_seconds']}, packed {pk['step_seconds']}")
    if diff > tol:
        sys.exit(1)


if __name__ == "__main__":
    main()
