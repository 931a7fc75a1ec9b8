"""Check that packing leaves a model's per-token log-probs unchanged, on a tiny Qwen2-VL (or --family).

Runs ``vlm_pack.testing.check_packed_equivalence``: the model once on an ordinary padded batch (one sample
per row) and once on the packed rows of ``PackingCollator``, then compares the log-prob of every next
token. Prints the report; exits 1 when it fails.

    .venv/bin/python examples/check_equivalence.py                 # PASS, token_mult_prob_error 1.0000000
    .venv/bin/python examples/check_equivalence.py --mistake positions   # what a broken setup looks like
    .venv/bin/python examples/check_equivalence.py --family qwen3_5      # gated delta-net layers isolated too
    .venv/bin/python examples/check_equivalence.py --family qwen3_5 --mistake mixers  # ... and when they are not
    python examples/check_equivalence.py --video --family qwen2_5_vl   # video samples (needs the [video] extra)
    python examples/check_equivalence.py --video --family qwen3_5 --attn varlen   # videos + gated delta-net
    python examples/check_equivalence.py --video --family qwen3_vl --device cuda --dtype bfloat16 --attn varlen
    .venv/bin/python examples/check_equivalence.py --model-type paddleocr_vl   # a model type without a record

``--model-type TYPE`` certifies any image-text-to-text model type of the installed transformers on a tiny genuine
model built from its config with its real processor (``vlm_pack.testing.certify_model_type``): each sample's
log-probs in the packed row against the sample alone, sdpa and eager; exits 1 when not exact, saying why.

With a real checkpoint, replace the offline pieces by ``AutoProcessor`` / ``AutoModelForImageTextToText``
(fp32 for an exact check; see benchmarks/RESULTS.md for bf16 tolerances on GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from vlm_pack import Preprocessor, isolate_token_mixers, offline
from vlm_pack.testing import (
    check_packed_equivalence,
    default_packed_forward,
    next_token_logprobs,
    pad_samples,
    token_mult_prob_error,
)


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A small synthetic photo: a gradient sky, a ground and a few objects."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    sky = np.array([90, 150, 230]) * (1 - y) + np.array([200, 220, 250]) * y
    im = Image.fromarray(np.broadcast_to(sky, (height, width, 3)).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    draw.rectangle([0, int(height * 0.7), width, height], fill=(70, 120, 60))
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(height // 3, height - 8))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.ellipse([x0, y0, x0 + width // 5, y0 + height // 5], fill=color)
    return im


CONVERSATIONS = [
    ("What is in the picture?", "A red ball on the grass under a blue sky.", [(224, 160)]),
    ("Write a haiku about training loss.", "Loss falls like the rain, slowly, then all at once.", []),
    ("Compare the two images.", "The first shows one ball, the second three.", [(160, 224), (300, 120)]),
    ("Describe it in detail.", "Three round objects stand on a green field at noon.", [(256, 256)]),
    ("Count the objects.", "There are three.", [(120, 90)]),
    ("What colour is the sky?", "Blue, fading to white near the horizon.", [(200, 100)]),
]


def positions_not_restarting(model, batch):
    """A broken setup for --mistake: position ids numbered across the whole row (Qwen-VL: the model's own
    mRoPE of the whole row, videos' grids and time steps included)."""
    kwargs = dict(batch.model_inputs("sdpa"))
    rows, length = batch.input_ids.shape
    arange = torch.arange(length, device=batch.input_ids.device).expand(rows, length)
    if kwargs["position_ids"].dim() != 3:  # 1-D positions (LLaVA-OneVision)
        kwargs["position_ids"] = arange
        return model(**kwargs).logits
    videos = {"video_grid_thw": batch.video_grid_thw} if batch.video_grid_thw is not None else {}
    if batch.second_per_grid_ts is not None:
        videos["second_per_grid_ts"] = batch.second_per_grid_ts
    rope, _ = model.model.get_rope_index(
        batch.input_ids, mm_token_type_ids=batch.mm_token_type_ids, image_grid_thw=batch.image_grid_thw, **videos
    )
    kwargs["position_ids"] = torch.cat([arange[None].to(rope.device), rope])
    return model(**kwargs).logits


# --video: small frames (4-48 vision tokens per temporal group) so that a CPU run takes seconds; Qwen2/2.5-VL
# keep every frame (their checkpoints' default), Qwen3-VL samples 2 fps, OneVision 4 frames per clip (its
# model stacks a batch's videos: every clip needs as many frames).
VIDEO_SETTINGS = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32}, cap_pixels_per_frame=False),
    "llava_onevision": dict(do_sample_frames=True, num_frames=4),
    "qwen3_5": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32}, cap_pixels_per_frame=False),
}
IMAGE_SETTINGS = {
    "qwen2_vl": dict(size={"shortest_edge": 56 * 56, "longest_edge": 64 * 28 * 28}),
    "qwen2_5_vl": dict(size={"shortest_edge": 56 * 56, "longest_edge": 64 * 28 * 28}),
    "qwen3_vl": dict(size={"shortest_edge": 64 * 64, "longest_edge": 64 * 32 * 32}),
    "llava_onevision": {},
    "qwen3_5": dict(size={"shortest_edge": 64 * 64, "longest_edge": 64 * 32 * 32}),
}
# (question, answer, image sizes, clips as (frames, width, height, fps, container)); clip i is a video part.
VIDEO_CONVERSATIONS = [
    ("What moves in the clip?", "A square slides to the right.", [], [(10, 96, 64, 5.0, "mp4")]),
    ("Compare the clip with the picture.", "The clip moves, the picture stays.", [(224, 160)],
     [(12, 64, 128, 6.0, "mkv")]),
    ("Write a haiku about training loss.", "Loss falls like the rain, slowly, then all at once.", [], []),
    ("Order the clips.", "First the tall one, then the wide one.", [(120, 90)],
     [(12, 64, 128, 6.0, "mkv"), (8, 96, 64, 4.0, "mp4")]),
]  # fmt: skip


def video_samples(pre: Preprocessor, family: str) -> list[dict]:
    """Processed samples with videos (alone, with images, two in one sample) and a text-only one."""
    from vlm_pack.testing import encode_clip

    samples = []
    for k, (question, answer, sizes, clips) in enumerate(VIDEO_CONVERSATIONS):
        if family == "llava_onevision" and len(clips) > 1:
            continue  # ~800 tokens per clip already
        images = [picture(w, h, seed=10 * k + j) for j, (w, h) in enumerate(sizes)]
        videos = [encode_clip(*clip, seed=10 * k + j) for j, clip in enumerate(clips)]
        parts = [{"type": "video"}] * len(videos) + [{"type": "image"}] * len(images)
        conversation = [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]
        samples.append(pre.process(images, conversation, key=f"video-{k}", videos=videos))
    return samples


def bf16_noise_floor(reference: torch.nn.Module, model: torch.nn.Module, samples: list[dict]) -> float:
    """token_mult_prob_error of the padded batch run in ``model``'s dtype against fp32 ``reference``.

    Packing in bf16 cannot be held to a tighter bound than bf16 itself: this is that bound's scale.
    """
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in pad_samples(samples).items()}
    with torch.no_grad():
        lo = next_token_logprobs(model(**inputs, use_cache=False).logits, inputs["input_ids"])
        hi = next_token_logprobs(reference(**inputs, use_cache=False).logits, inputs["input_ids"])
    mask = inputs["attention_mask"].clone()
    mask[torch.arange(len(samples)), inputs["attention_mask"].sum(1) - 1] = 0  # last token: no successor
    return float(token_mult_prob_error(lo, hi, mask))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--attn",
        default="sdpa",
        choices=["sdpa", "eager", "flash_attention_2", "varlen"],
        help="attention of the packed run; 'varlen' is vlm_pack.forward.attention (flash-attn / torch varlen on "
        "CUDA, per-sample SDPA on CPU). The padded reference always runs sdpa.",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--capacity", type=int, default=None, help="tokens per packed row (512; --video 4096)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="pass threshold; default 1.0001 in fp32, and in bf16 1 + 3 * (noise floor - 1) with the noise "
        "floor measured here (bf16 batched vs fp32 batched), at least 1.001",
    )
    parser.add_argument(
        "--mistake",
        choices=["none", "positions", "use_cache", "mixers"],
        default="none",
        help="show the report of a broken setup: position ids that do not restart (qwen2_vl), use_cache "
        "left on, or token mixers that are not attention (gated delta-net, short convolutions) left to "
        "transformers' own path (--attn sdpa or eager)",
    )
    parser.add_argument(
        "--family",
        default="qwen2_vl",
        help="the tiny model's family (vlm_pack.offline stand-ins): qwen2_vl, qwen3_5, lfm2_vl, ...",
    )
    parser.add_argument(
        "--video",
        action="store_true",
        help="samples with videos (PyAV-encoded clips, alone and with images) through the family's video "
        f"processor: {', '.join(VIDEO_SETTINGS)}; needs the [video] extra (PyAV, torchvision)",
    )
    parser.add_argument(
        "--model-type",
        default=None,
        help="certify this transformers model type (any of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) on a tiny "
        "genuine model of its config and its real processor: packed vs each sample alone, sdpa and eager",
    )
    args = parser.parse_args(argv)
    if args.model_type is not None:
        from vlm_pack.testing.model_types import certify_model_type

        certificate = certify_model_type(args.model_type)
        print(certificate)
        return 0 if certificate.exact else 1
    dtype = getattr(torch, args.dtype)
    args.capacity = args.capacity or (4096 if args.video else 512)
    if args.mistake == "positions" and args.family != "qwen2_vl" and not args.video:
        parser.error("--mistake positions builds Qwen2-VL's mRoPE ids: use it with --family qwen2_vl (or --video)")
    if args.video and args.family not in VIDEO_SETTINGS:
        parser.error(f"--video runs {', '.join(VIDEO_SETTINGS)}; got --family {args.family}")
    if args.mistake == "mixers" and args.attn not in ("sdpa", "eager"):
        parser.error("--mistake mixers needs --attn sdpa or eager (varlen attention isolates the mixers)")

    family = args.family
    template = Path(__file__).resolve().parents[1] / "tests" / "templates" / f"{family}.jinja"
    if args.video:
        from vlm_pack.testing import processor_with_video

        processor = processor_with_video(
            family,
            chat_template=template.read_text() if template.exists() else None,
            image_overrides=IMAGE_SETTINGS[family],
            **VIDEO_SETTINGS[family],
        )
        pre = Preprocessor(processor=processor)
        tokenizer = pre.tokenizer
    elif family == "qwen2_vl":
        tokenizer = offline.build_tokenizer(family)
        # Real Qwen2-VL image processor, max_pixels capped so that these images give 16-64 vision tokens.
        image_processor = offline.image_processor(
            family, size={"shortest_edge": 56 * 56, "longest_edge": 64 * 28 * 28}
        )
        pre = Preprocessor(tokenizer, image_processor, family=family)
    else:  # the family's processor stand-in with the released checkpoint's chat template (tests/templates)
        chat_template = template.read_text() if template.exists() else None
        pre = Preprocessor(processor=offline.processor(family, chat_template=chat_template))
        tokenizer = pre.tokenizer

    def build(attn: str, dtype: torch.dtype) -> torch.nn.Module:
        # Same seed, same weights whatever the attention; the attention is switched after the cast
        # (flash-attn refuses fp32 weights).
        impl = "sdpa" if attn in ("varlen", "flash_attention_2") else attn
        m = offline.tiny_model(family, tokenizer, attn_implementation=impl, initializer_range=0.2, seed=0)
        m = m.to(device=args.device, dtype=dtype)
        if attn == "varlen":
            from vlm_pack.forward.attention import use_varlen_attention

            use_varlen_attention(m)  # isolates the token mixers too
        elif attn == "flash_attention_2":
            m.set_attn_implementation("flash_attention_2")
        if args.mistake != "mixers":
            isolate_token_mixers(m)  # no-op for a model whose text layers are all attention
        return m

    model = build(args.attn, dtype)
    reference = build("sdpa", dtype)

    samples = video_samples(pre, family) if args.video else []
    for k, (question, answer, sizes) in enumerate([] if args.video else CONVERSATIONS):
        images = [picture(w, h, seed=10 * k + j) for j, (w, h) in enumerate(sizes)]
        conversation = [
            {
                "role": "user",
                "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}],
            },
            {"role": "assistant", "content": answer},
        ]
        samples.append(pre.process(images, conversation))

    tolerance = args.tolerance
    if dtype == torch.float32:
        tolerance = tolerance or 1.0001
    else:
        noise = bf16_noise_floor(build("sdpa", torch.float32), reference, samples)
        print(f"{args.dtype} noise floor (padded batch, {args.dtype} vs float32): {noise:.6f}")
        tolerance = tolerance or max(1.001, 1 + 3 * (noise - 1))

    # max_rows=None: the samples are a list, not a planned bin; the collator packs them into rows (opt-in)
    collator = pre.collator(args.capacity, model_config=model.config, max_rows=None)
    style = "sdpa" if args.attn == "varlen" else args.attn  # model_inputs style of the packed rows
    packed_forward = {
        "none": None,
        "mixers": None,  # the model was built without isolate_token_mixers
        "positions": positions_not_restarting,
        "use_cache": default_packed_forward(style, use_cache=None),
    }[args.mistake]
    report = check_packed_equivalence(
        model,
        samples,
        collator,
        style=style,
        tolerance=tolerance,
        tokenizer=tokenizer,
        # the reference is an independent sdpa forward on the padded batch, in the same dtype
        batched_forward=lambda _model, inputs: reference(**inputs, use_cache=False).logits,
        packed_forward=packed_forward,
    )
    print(f"packed: {args.attn} attention, {args.dtype}, {args.device}; reference: padded batch, sdpa")
    print(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
