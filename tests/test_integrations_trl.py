"""TRL SFTTrainer on packed VLM rows: config checks, TRL's loss on packed rows vs the padded batch, num_tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl", reason="needs the [trl] extra")
datasets = pytest.importorskip("datasets")

from trl import SFTConfig  # noqa: E402

from vlm_pack import Preprocessor  # noqa: E402
from vlm_pack.demo import demo_shards  # noqa: E402
from vlm_pack.integrations.trl import (  # noqa: E402
    PackedSFTTrainer,
    TRLPackingCollator,
    check_sft_config,
    packed_dataset,
    packed_sft_config,
)
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model  # noqa: E402

CAPACITY = 1536


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 50176})
    shards = demo_shards(tmp / "shards", num_samples=10, samples_per_shard=5)
    return tok, ip, shards, tmp


def _args(tmp, **kw):
    return packed_sft_config(
        str(tmp / "out"), report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        save_strategy="no", logging_steps=1, per_device_train_batch_size=1, seed=0, **kw,
    )


def test_config_helper_sets_and_check_names_every_problem(tmp_path):
    args = packed_sft_config(str(tmp_path), bf16=False, use_cpu=True)
    assert args.remove_unused_columns is False and args.max_length is None
    assert args.dataset_kwargs == {"skip_prepare_dataset": True} and not args.packing and not args.padding_free
    check_sft_config(args)  # no error
    with pytest.raises(ValueError) as err:
        check_sft_config(SFTConfig(str(tmp_path), bf16=False, use_cpu=True))
    message = str(err.value)
    assert "remove_unused_columns=True" in message and "skip_prepare_dataset" in message and "max_length=1024" in message
    with pytest.raises(ValueError, match="packing=True"):
        packed_sft_config(str(tmp_path), packing=True, bf16=False, use_cpu=True)


def test_dataset_rows_are_packs_within_capacity(parts):
    tok, ip, shards, tmp = parts
    ds = packed_dataset(shards, Preprocessor(tok, ip), capacity=CAPACITY, cache_dir=str(tmp / "c1"))
    assert isinstance(ds, datasets.Dataset)
    keys = [k for row in ds["keys"] for k in row]
    assert sorted(keys) == [f"demo-{i:06d}" for i in range(10)]  # every sample exactly once
    collator = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip, family="qwen2_vl"))
    with pytest.raises(TypeError, match=r"expected a vlm_pack.Preprocessor, got .*Preprocessor\(processor="):
        TRLPackingCollator(CAPACITY, tok)  # the old keywords' parts, not one Preprocessor
    for row in ds:
        samples = collator.samples([row])
        # The forecast lengths stored with the plan are the processed lengths (oracle: the real processor).
        assert row["lengths"] == [len(s["input_ids"]) for s in samples]
        assert sum(row["lengths"]) <= CAPACITY
    with pytest.raises(ValueError, match=r"sample 'demo-\d+': \d+ tokens > capacity 512"):
        packed_dataset(shards, Preprocessor(tok, ip), capacity=512, cache_dir=str(tmp / "c2"))


def test_trl_loss_on_packed_rows_equals_padded_batch(parts):
    """TRL's own compute_loss (fused LM head) on one packed row == on the same samples padded, one per row."""
    tok, ip, shards, tmp = parts
    ds = packed_dataset(shards, Preprocessor(tok, ip), capacity=CAPACITY, cache_dir=str(tmp / "c3"))
    row = max(ds, key=lambda r: len(r["keys"]))
    assert len(row["keys"]) >= 2
    model = tiny_model("qwen2_vl", tok, initializer_range=0.2)
    trainer = PackedSFTTrainer(model=model, args=_args(tmp, max_steps=1), train_dataset=ds, processing_class=tok,
                               data_collator=TRLPackingCollator(CAPACITY, Preprocessor(tok, ip),
                                                                config=model.config))
    model.train()
    packed = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip), config=model.config)([row])
    padded = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip), config=model.config, packed=False)([row])
    assert packed["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == len(row["keys"])
    assert "attention_mask" not in packed and packed["position_ids"].shape[:2] == (4, 1)
    with torch.no_grad():
        loss_packed = trainer.compute_loss(model, dict(packed))
        loss_padded = trainer.compute_loss(model, dict(padded))
        # Control: 1-D positions over the row (no per-sample restart) must change the loss visibly.
        broken = dict(packed)
        broken["position_ids"] = torch.arange(packed["input_ids"].shape[1]).expand(4, 1, -1)
        loss_broken = trainer.compute_loss(model, broken)
    assert abs(loss_packed.item() - loss_padded.item()) < 1e-5
    assert abs(loss_broken.item() - loss_padded.item()) > 1e-3


def test_streaming_dataset_trains_and_num_tokens_is_the_real_count(parts):
    tok, ip, shards, tmp = parts
    ds = packed_dataset(shards, Preprocessor(tok, ip), capacity=CAPACITY, streaming=True,
                        cache_dir=str(tmp / "c4"))
    assert isinstance(ds, datasets.IterableDataset)
    rows = list(ds)[:2]
    model = tiny_model("qwen2_vl", tok)
    collator = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip), config=model.config)
    # TRL's own formula, position_ids.size(1), counts rows for [4, R, T] mRoPE ids: the bug being corrected.
    assert collator([rows[0]])["position_ids"].size(1) == 1
    trainer = PackedSFTTrainer(model=model, args=_args(tmp, max_steps=2), train_dataset=ds,
                               data_collator=collator, processing_class=tok)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # Oracle: the lengths of the processed samples of the two packs consumed, padding excluded.
    real = [sum(len(s["input_ids"]) for s in collator.samples([r])) for r in rows]
    assert [h["num_tokens"] for h in logs] == [real[0], real[0] + real[1]]
    assert all(0 <= h["mean_token_accuracy"] <= 1 and h["entropy"] > 0 for h in logs)


def test_importing_vlm_pack_and_integrations_imports_neither_trainer_library():
    code = (
        "import sys, vlm_pack, vlm_pack.integrations; "
        "assert 'trl' not in sys.modules and 'megatron.energon' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", ["internvl", "gemma3"])
def test_any_family_through_its_processor_trains_on_packed_rows_as_on_padded(parts, family):
    """A checkpoint's processor (its released template, its image wrappers): the plan's forecasts are the
    processed lengths, and TRL's loss on a packed row equals the loss on the same samples padded."""
    from pathlib import Path

    from vlm_pack import offline

    _, _, shards, tmp = parts
    tok = build_tokenizer(family)
    template = (Path(__file__).parent / "templates" / f"{family}.jinja").read_text()
    proc = offline.processor(family, tok, chat_template=template, **({"max_patches": 2} if family == "internvl" else {}))
    capacity = 4096
    ds = packed_dataset(shards, Preprocessor(processor=proc), capacity=capacity, cache_dir=str(tmp / f"c-{family}"))
    row = max(ds, key=lambda r: len(r["keys"]))
    assert len(row["keys"]) >= 2
    model = tiny_model(family, tok, initializer_range=0.2)
    collator = TRLPackingCollator(capacity, Preprocessor(processor=proc), config=model.config)
    assert row["lengths"] == [len(s["input_ids"]) for s in collator.samples([row])]
    packed = collator([row])
    padded = TRLPackingCollator(capacity, Preprocessor(processor=proc), config=model.config, packed=False)([row])
    trainer = PackedSFTTrainer(model=model, args=_args(tmp, max_steps=1), train_dataset=ds, processing_class=tok,
                               data_collator=collator)
    model.train()
    with torch.no_grad():
        loss_packed = trainer.compute_loss(model, dict(packed))
        loss_padded = trainer.compute_loss(model, dict(padded))
    assert abs(loss_packed.item() - loss_padded.item()) < 1e-5
