"""Fine-tune a tiny Qwen2-VL with TRL's ``SFTTrainer`` on packed rows, and check it against the unpacked run.

TRL refuses ``packing=True`` for vision data; vlm-pack packs instead, before TRL sees anything::

    demo shards --packed_dataset--> datasets.Dataset, one row per pack of samples (header forecasts + best fit)
                --TRLPackingCollator--> one packed row per pack: input_ids, labels, 4-row mRoPE position_ids,
                                        pixel_values, image_grid_thw (no attention_mask)
                --PackedSFTTrainer(args=packed_sft_config(...))--> TRL's loss / entropy / token accuracy,
                                        num_tokens corrected to the real token count

The unpacked run trains the same model from the same weights on the same rows in the same order, but its
collator pads each pack's samples into one row each with an ``attention_mask`` (TRL's usual layout, plain
``SFTTrainer``). Both losses are per token over the same label tokens, so the first step's loss must agree
to 1e-5, and TRL's ``num_tokens`` of the unpacked run (``attention_mask.sum()``) must equal the packed run's.
Exits 1 otherwise. Needs ``pip install 'vlm-pack[trl]'``; no download (the model is built from a config)::

    python examples/train_trl_sft.py --steps 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from vlm_pack import Preprocessor
from vlm_pack.demo import demo_shards
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model


def train(args: argparse.Namespace, dataset: Any, tokenizer: Any, image_proc: Any, packed: bool, out: str) -> Any:
    """One run of ``args.steps`` steps; returns the trainer (its ``state.log_history`` holds the logs)."""
    from trl import SFTConfig, SFTTrainer

    from vlm_pack.integrations.trl import PackedSFTTrainer, TRLPackingCollator, packed_sft_config

    model = tiny_model("qwen2_vl", tokenizer, initializer_range=0.2).train()
    # TRL turns checkpointing on by default; transformers 5.24 renamed it (and warns on the old name)
    name = "activation_checkpointing"
    no_checkpointing = {name if name in SFTConfig.__dataclass_fields__ else "gradient_checkpointing": False}
    config = packed_sft_config(
        out,
        max_steps=args.steps,
        per_device_train_batch_size=1,  # one pack per micro-batch
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16; the 1e-5 comparison needs fp32
        **no_checkpointing,
        dataloader_num_workers=0,
        seed=0,
    )
    collator = TRLPackingCollator(args.capacity, Preprocessor(tokenizer, image_proc), model_config=model.config, packed=packed)
    cls = PackedSFTTrainer if packed else SFTTrainer
    trainer = cls(
        model=model, args=config, train_dataset=dataset, data_collator=collator, processing_class=tokenizer
    )
    trainer.train()
    return trainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps of each run")
    p.add_argument("--max-samples", type=int, default=24, help="demo samples to pack")
    p.add_argument("--capacity", type=int, default=1024, help="tokens per packed row")
    p.add_argument("--max-pixels", type=int, default=50176, help="image processor cap (50176: <= 64 tokens)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tolerance", type=float, default=1e-5, help="allowed first-step loss difference")
    p.add_argument("--data-dir", default=None, help="where the demo shards go (default: a temporary folder)")
    args = p.parse_args(argv)

    from vlm_pack.integrations.trl import packed_dataset

    tokenizer = build_tokenizer("qwen2_vl")
    image_proc = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": args.max_pixels})
    with tempfile.TemporaryDirectory() as tmp:
        shards = demo_shards(args.data_dir or f"{tmp}/shards", num_samples=args.max_samples, samples_per_shard=8)
        dataset = packed_dataset(
            shards, Preprocessor(tokenizer, image_proc), capacity=args.capacity, oversized="skip",
            cache_dir=f"{tmp}/hf-cache",
        )
        print(f"{sum(len(r) for r in dataset['keys'])} samples in {len(dataset)} packs of <= {args.capacity} tokens")
        logs = {}
        for packed in (True, False):
            trainer = train(args, dataset, tokenizer, image_proc, packed, f"{tmp}/out-{packed}")
            logs[packed] = [h for h in trainer.state.log_history if "loss" in h]

    def first(packed: bool, name: str) -> float:
        return float(logs[packed][0][name])

    diffs = {name: abs(first(True, name) - first(False, name)) for name in ("loss", "entropy", "mean_token_accuracy")}
    tokens = (int(logs[True][-1]["num_tokens"]), int(logs[False][-1]["num_tokens"]))
    print(f"packed   losses {[round(h['loss'], 6) for h in logs[True]]}  num_tokens {tokens[0]}")
    print(f"unpacked losses {[round(h['loss'], 6) for h in logs[False]]}  num_tokens {tokens[1]}")
    print("first step |packed - unpacked|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    ok = diffs["loss"] <= args.tolerance and tokens[0] == tokens[1]
    print("PASS" if ok else f"FAIL: loss diff {diffs['loss']:.2e} > {args.tolerance} or num_tokens differ")
    return {"ok": ok, "diffs": diffs, "num_tokens": tokens, "logs": logs}


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
