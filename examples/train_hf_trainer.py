"""Fine-tune a tiny Qwen2-VL with the Hugging Face ``Trainer`` and vlm-pack's collator (in-batch packing).

``per_device_train_batch_size`` keeps counting *samples*, exactly as in a padded run; the collator lays each
micro-batch's samples end to end in as few rows of ``capacity`` tokens as fit, and the model keeps them apart
from the position-id restarts (no attention mask, ``use_cache=False``)::

    padded (B = 4)                          packed by PackingCollator(capacity, max_rows=None, ...)
    |s0 ......|############|                |s0 ......|s2 ..|s3 .......|#|      2 rows instead of 4,
    |s1 ..................|                 |s1 ..................|######|      same 4 samples, same
    |s2 ..|################|                                                    labels, same loss
    |s3 .......|###########|

So samples per optimizer update, learning rate and schedule stay those of the padded run; only padding
goes. The Trainer counts label tokens over the whole accumulation (``num_items_in_batch``), so the loss
stays per token. The data are the embedded demo shards; the model is built from a config (no download).
Needs ``accelerate`` (the Trainer requires it).

    python examples/train_hf_trainer.py --steps 4 --max-samples 32
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
import webdataset as wds

from vlm_pack import Preprocessor, image_size
from vlm_pack.data import image_fields, parse_text
from vlm_pack.demo import demo_shards
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model


class DemoDataset(torch.utils.data.Dataset):
    """Samples of WebDataset shards, processed (decoded, resized, tokenized) on access."""

    def __init__(self, urls: list[str], pre: Preprocessor, max_samples: int) -> None:
        self.raw = []
        for sample in wds.WebDataset(urls, shardshuffle=False):
            images = [sample[f] for f in image_fields(sample)]
            self.raw.append((sample["__key__"], images, parse_text(sample)))
            if len(self.raw) == max_samples:
                break
        self.pre = pre

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        key, images, conversation = self.raw[i]
        return self.pre.process(images, conversation, key=key)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (max_steps)")
    p.add_argument("--max-samples", type=int, default=64, help="demo samples to use")
    p.add_argument("--batch-size", type=int, default=4, help="samples per device per micro step")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--capacity", type=int, default=2048, help="tokens per packed row")
    p.add_argument("--max-pixels", type=int, default=50176, help="image processor cap (50176: <= 64 tokens)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data-dir", default=None, help="where the demo shards go (default: a cache folder)")
    p.add_argument("--output-dir", default=None, help="Trainer output_dir (default: a temporary folder)")
    args = p.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    tokenizer = build_tokenizer("qwen2_vl")
    image_proc = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": args.max_pixels})
    pre = Preprocessor(tokenizer, image_proc)
    dataset = DemoDataset([str(s) for s in demo_shards(args.data_dir)], pre, args.max_samples)
    # A row must hold the longest sample: drop (and name) longer ones, forecast from headers, no decode.
    lengths = [pre.forecast(conv, [image_size(b) for b in images], key=key)[0] for key, images, conv in dataset.raw]
    keep = [i for i, n in enumerate(lengths) if n <= args.capacity]
    for i in sorted(set(range(len(dataset))) - set(keep)):
        print(f"skipped {dataset.raw[i][0]}: {lengths[i]} tokens > capacity {args.capacity}")
    train = torch.utils.data.Subset(dataset, keep)

    model = tiny_model("qwen2_vl", tokenizer).train()
    # max_rows=None: the Trainer hands the collator per_device_train_batch_size samples, not a planned bin;
    # in-batch packing (an opt-in) lays them out in as many rows as they need
    collator = pre.collator(args.capacity, model_config=model.config, return_style="sdpa", max_rows=None)
    rows: list[int] = []

    def data_collator(samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        inputs = collator(samples)
        rows.append(inputs["input_ids"].shape[0])
        return inputs

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            remove_unused_columns=False,  # keep tokens_per_image, mm_token_type_ids for the collator
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train, data_collator=data_collator)
        result = trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(
        f"{len(train)} samples, micro-batches of {args.batch_size} samples packed into "
        f"{sum(rows) / max(1, len(rows)):.2f} rows of {args.capacity} tokens on average (padded: {args.batch_size})"
    )
    print(f"losses: {[round(x, 4) for x in losses]}  train_loss {result.training_loss:.4f}")
    return {"losses": losses, "rows": rows, "train_loss": result.training_loss}


if __name__ == "__main__":
    main()
