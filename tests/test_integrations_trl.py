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
from vlm_pack.data import SampleError  # noqa: E402
from vlm_pack.demo import demo_shards  # noqa: E402
from vlm_pack.integrations.trl import (  # noqa: E402
    NUM_TOKENS_KEY,
    PackedSFTTrainer,
    TRLPackingCollator,
    check_sft_config,
    packed_dataset,
    packed_sft_config,
)
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model  # noqa: E402
from vlm_pack.testing import unguarded  # noqa: E402

CAPACITY = 1536


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 50176})
    shards = demo_shards(tmp / "shards", num_samples=10, samples_per_shard=5)
    return tok, ip, shards, tmp


# transformers 5.24 renamed gradient_checkpointing (TRL's default: True) activation_checkpointing and warns on the old
NO_CHECKPOINTING = {
    "activation_checkpointing" if "activation_checkpointing" in SFTConfig.__dataclass_fields__ else
    "gradient_checkpointing": False
}


def _args(tmp, **kw):
    return packed_sft_config(
        str(tmp / "out"), report_to="none", use_cpu=True, bf16=False, **NO_CHECKPOINTING,
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
    with pytest.raises(ValueError, match=r"key 'demo-\d+'\): \d+ tokens exceed capacity 512"):
        packed_dataset(shards, Preprocessor(tok, ip), capacity=512, cache_dir=str(tmp / "c2"))


@pytest.mark.slow
def test_trl_loss_on_packed_rows_equals_padded_batch(parts):
    """TRL's own compute_loss (fused LM head) on one packed row == on the same samples padded, one per row."""
    tok, ip, shards, tmp = parts
    ds = packed_dataset(shards, Preprocessor(tok, ip), capacity=CAPACITY, cache_dir=str(tmp / "c3"))
    row = max(ds, key=lambda r: len(r["keys"]))
    assert len(row["keys"]) >= 2
    model = tiny_model("qwen2_vl", tok, initializer_range=0.2)
    trainer = PackedSFTTrainer(model=model, args=_args(tmp, max_steps=1), train_dataset=ds, processing_class=tok,
                               data_collator=TRLPackingCollator(CAPACITY, Preprocessor(tok, ip),
                                                                model_config=model.config))
    model.train()
    packed = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip), model_config=model.config)([row])
    padded = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip), model_config=model.config, packed=False)([row])
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


@pytest.mark.slow
def test_streaming_dataset_trains_and_num_tokens_is_the_real_count(parts):
    tok, ip, shards, tmp = parts
    ds = packed_dataset(shards, Preprocessor(tok, ip), capacity=CAPACITY, streaming=True,
                        cache_dir=str(tmp / "c4"))
    assert isinstance(ds, datasets.IterableDataset)
    rows = list(ds)[:2]
    model = tiny_model("qwen2_vl", tok)
    collator = TRLPackingCollator(CAPACITY, Preprocessor(tok, ip), model_config=model.config)
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
@pytest.mark.slow
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
    collator = TRLPackingCollator(capacity, Preprocessor(processor=proc), model_config=model.config)
    assert row["lengths"] == [len(s["input_ids"]) for s in collator.samples([row])]
    packed = collator([row])
    padded = TRLPackingCollator(capacity, Preprocessor(processor=proc), model_config=model.config, packed=False)([row])
    trainer = PackedSFTTrainer(model=model, args=_args(tmp, max_steps=1), train_dataset=ds, processing_class=tok,
                               data_collator=collator)
    model.train()
    with torch.no_grad():
        loss_packed = trainer.compute_loss(model, dict(packed))
        loss_padded = trainer.compute_loss(model, dict(padded))
    assert abs(loss_packed.item() - loss_padded.item()) < 1e-5


# ------------------------------------------------------------------------- train() end to end, any source

_WORDS = "the a cat dog sky red blue big small house tree car road sits runs on under near and of".split()
_SMALL = {"shortest_edge": 3136, "longest_edge": 50176}


def _png(width: int, height: int, seed: int) -> bytes:
    import io
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    im = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(im)
    for _ in range(6):  # some structure, so that images differ in more than their colour
        x, y = rng.randrange(width), rng.randrange(height)
        draw.rectangle((x, y, x + 12, y + 9), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _records(n: int, *, seed: int = 0, max_images: int = 2) -> list[dict]:
    """Messages-layout records {"key", "images" (PNG bytes), "messages"}, 0..max_images small images each."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(0, max_images) if i else max_images  # the first has the most images
        sizes = [(rng.randrange(40, 200), rng.randrange(40, 160)) for _ in range(k)]
        images = [_png(w, h, seed * 1000 + i * 10 + j) for j, (w, h) in enumerate(sizes)]
        question = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 20)))
        answer = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(2, 30)))
        out.append({
            "key": f"s-{i:03d}",
            "images": images,
            "messages": [
                {"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": question}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ],
        })
    return out


def _hf_dataset(records: list[dict], *, pil: bool = False) -> datasets.Dataset:
    import io

    from PIL import Image

    part = {"type": datasets.Value("string"), "text": datasets.Value("string")}
    features = datasets.Features({
        "key": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(part)}),
    })
    if pil:  # decoded images, as a user who built the dataset from PIL images has them
        records = [{**r, "images": [Image.open(io.BytesIO(b)) for b in r["images"]]} for r in records]
    return datasets.Dataset.from_list(records, features=features)


def _family_preprocessor(family: str) -> Preprocessor:
    from pathlib import Path

    from vlm_pack import offline

    tok = build_tokenizer(family)
    if family in ("qwen2_vl", "llava"):  # tokenizer + image processor, vlm-pack's own chat format
        overrides = {"size": _SMALL} if family == "qwen2_vl" else {}
        return Preprocessor(tok, image_processor(family, **overrides))
    template = (Path(__file__).parent / "templates" / f"{family}.jinja").read_text()
    return Preprocessor(processor=offline.processor(family, tok, chat_template=template))


class _Recording:
    """A data_collator that records the keys of every row it collates (what the trainer trained on)."""

    def __init__(self, inner: TRLPackingCollator) -> None:
        self.inner, self.keys, self.rows = inner, [], []

    def __call__(self, rows):
        self.rows += list(rows)
        self.keys += [k for row in rows for k in row["keys"]]
        return self.inner(rows)


def _train_one_epoch(ds, pre: Preprocessor, family: str, capacity: int, tmp) -> tuple[_Recording, list[dict]]:
    model = tiny_model(family, pre.tokenizer)
    collator = _Recording(TRLPackingCollator(capacity, pre, model_config=model.config))
    trainer = PackedSFTTrainer(model=model, args=_args(tmp, num_train_epochs=1, learning_rate=1e-3),
                               train_dataset=ds, data_collator=collator, processing_class=pre.tokenizer)
    trainer.train()
    return collator, [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(("family", "capacity"), [("qwen2_vl", 256), ("gemma3", 1024), ("llava", 2048)])
@pytest.mark.slow
def test_train_runs_every_family_on_packed_rows(tmp_path, family, capacity):
    """PackedSFTTrainer.train() end to end (accelerate moves each batch to the device: Gemma 3's mask mapping
    must survive it), one epoch: every sample trained on exactly once, num_tokens the real token count."""
    from vlm_pack.data import write_shards

    pre = _family_preprocessor(family)
    records = _records(6, seed=1, max_images=1)
    shards = write_shards(records, tmp_path / "shards", maxcount=3)
    ds = packed_dataset(shards, pre, capacity=capacity, cache_dir=str(tmp_path / "hf"))
    assert len(ds) >= 2
    seen, logs = _train_one_epoch(ds, pre, family, capacity, tmp_path)
    assert sorted(seen.keys) == [r["key"] for r in records]  # each exactly once
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs) and len(logs) == len(ds)
    # Oracle: the processed samples of every row trained on, padding excluded.
    real = sum(len(s["input_ids"]) for s in seen.inner.samples(seen.rows))
    assert logs[-1]["num_tokens"] == real


def test_gemma3_mask_mapping_survives_device_moves_copies_and_pickling():
    import copy
    import pickle

    from accelerate.utils import send_to_device

    from vlm_pack.forward.masks import TOKENS_KEY, MaskMapping

    masks = {"full_attention": torch.ones(1, 1, 3, 3, dtype=torch.bool), "sliding_attention": torch.eye(3)[None]}
    tokens = torch.tensor([[1, 1, 0]])
    mapping = MaskMapping(masks, **{TOKENS_KEY: tokens})
    for moved in (
        send_to_device({"attention_mask": mapping}, "cpu")["attention_mask"],
        copy.copy(mapping),
        copy.deepcopy(mapping),
        pickle.loads(pickle.dumps(mapping)),
    ):
        assert type(moved) is MaskMapping and int(moved.sum()) == 2  # SFTTrainer's token count
        assert all(torch.equal(moved[k], v) for k, v in masks.items())
        assert torch.equal(moved[:, -2:], tokens[:, -2:])  # transformers <= 5.16's Gemma 3 loss reads it so
        assert set(moved) == {*masks, TOKENS_KEY}


def _left_out_keys(ds) -> list[str]:
    return sorted(key for key, _, _ in ds.left_out)


@pytest.mark.parametrize("source", ["dataset-bytes", "dataset-pil", "parquet"])
@pytest.mark.slow
def test_datasets_and_parquet_train_every_sample_once_or_report_it(tmp_path, source):
    """A TRL user's own data (a datasets.Dataset, images as bytes or PIL, or a parquet file) through
    packed_dataset and trainer.train(): each sample is trained on exactly once per epoch, or reported."""
    records = _records(14, seed=2)
    long_text = " ".join(["word"] * 600)  # longer than the capacity: left out (oversized="skip"), reported
    records[5]["messages"][1]["content"] = [{"type": "text", "text": long_text}]
    expected_out = ["s-005"]
    if source != "dataset-pil":  # (a PIL image cannot hold bytes that are no image)
        records[0]["images"][0] = b"not an image at all"  # a corrupt image: left out, reported
        expected_out = ["s-000", "s-005"]
    data = _hf_dataset(records, pil=source == "dataset-pil")
    if source == "parquet":
        data.to_parquet(str(tmp_path / "train.parquet"))
        data = str(tmp_path / "train.parquet")
    pre = _family_preprocessor("qwen2_vl")
    capacity = 512
    with pytest.warns(UserWarning, match="left out"):
        ds = packed_dataset(data, pre, capacity=capacity, oversized="skip", cache_dir=str(tmp_path / "hf"))
    assert _left_out_keys(ds) == expected_out
    reasons = dict((k, r) for k, _, r in ds.left_out)
    assert "capacity" in reasons["s-005"]
    seen, logs = _train_one_epoch(ds, pre, "qwen2_vl", capacity, tmp_path)
    all_keys = sorted(r["key"] for r in records)
    assert sorted(seen.keys) == sorted(set(all_keys) - set(expected_out))  # each exactly once
    assert sorted(seen.keys + expected_out) == all_keys  # nothing both trained and left out, nothing lost
    assert logs[-1]["num_tokens"] == sum(len(s["input_ids"]) for s in seen.inner.samples(seen.rows))
    # Built again: the plan comes from the cache, and the samples it left out are still reported.
    with pytest.warns(UserWarning, match="left out"):
        again = packed_dataset(data, pre, capacity=capacity, oversized="skip", cache_dir=str(tmp_path / "hf"))
    assert again.left_out == ds.left_out and again["keys"] == ds["keys"]


def _write_llava_json(tmp_path, records) -> str:
    import json

    (tmp_path / "imgs").mkdir()
    out = []
    for r in records:
        n = len(r["images"])
        for j, data in enumerate(r["images"]):
            (tmp_path / "imgs" / f"{r['key']}-{j}.png").write_bytes(data)
        question = r["messages"][0]["content"][-1]["text"]
        answer = r["messages"][1]["content"][0]["text"]
        rec = {"id": r["key"], "conversations": [{"from": "human", "value": "<image>\n" * n + question},
                                                 {"from": "gpt", "value": answer}]}
        if n:
            paths = [f"imgs/{r['key']}-{j}.png" for j in range(n)]
            rec["image"] = paths[0] if n == 1 else paths
        out.append(rec)
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(out))
    return str(path)


def _write_jsonl(tmp_path, records) -> str:
    import json

    (tmp_path / "jimgs").mkdir()
    lines = []
    for r in records:
        paths = []
        for j, data in enumerate(r["images"]):
            (tmp_path / "jimgs" / f"{r['key']}-{j}.png").write_bytes(data)
            paths.append(f"jimgs/{r['key']}-{j}.png")
        lines.append(json.dumps({"key": r["key"], "images": paths, "messages": r["messages"]}))
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("source", ["llava-json", "jsonl", "tar", "parquet", "saved-dataset", "mixed"])
@pytest.mark.slow
def test_every_source_kind_becomes_packs_of_all_its_samples(tmp_path, source):
    """Every source forecast_sources reads: each sample in exactly one row, the row's lengths are the lengths
    the collator's processing gives (the plan PackedMapDataset makes), and no row exceeds the capacity."""
    from vlm_pack.data import write_shards

    records = _records(9, seed=3)
    keys = [r["key"] for r in records]
    if source == "llava-json":
        data = _write_llava_json(tmp_path, records)
    elif source == "jsonl":
        data = _write_jsonl(tmp_path, records)
    elif source == "tar":
        data = write_shards(records, tmp_path / "shards", maxcount=4)
    elif source == "parquet":
        _hf_dataset(records).to_parquet(str(tmp_path / "a.parquet"))
        data = str(tmp_path / "a.parquet")
    elif source == "saved-dataset":
        _hf_dataset(records).save_to_disk(str(tmp_path / "saved"))
        data = str(tmp_path / "saved")
    else:  # a shard, a JSONL file and a Dataset together
        data = [write_shards(records[:3], tmp_path / "shards")[0], _write_jsonl(tmp_path, records[3:6]),
                _hf_dataset(records[6:])]
    pre = _family_preprocessor("qwen2_vl")
    ds = packed_dataset(data, pre, capacity=512, cache_dir=str(tmp_path / "hf"))
    assert ds.left_out == []
    assert sorted(k for row in ds["keys"] for k in row) == keys
    collator = TRLPackingCollator(512, pre)
    for row in ds:
        assert row["lengths"] == [len(s["input_ids"]) for s in collator.samples([row])]
        assert sum(row["lengths"]) <= 512


def test_records_left_out_name_the_file_they_were_read_from(tmp_path):
    """A corrupt image in a shard (found by the forecast) and a JSONL record naming a missing image file
    (found while reading): both reported with their key and the file (and line) they live in."""
    import os

    from vlm_pack.data import BadSampleWarning, write_shards

    records = _records(6, seed=4)
    records[0]["images"][0] = (b"broken image bytes", "jpg")  # the shard writer stores it as it is
    records[3]["images"] = [_png(64, 48, 7)]
    records[3]["messages"][0]["content"] = [{"type": "image"}, {"type": "text", "text": "what is it"}]
    shards = write_shards(records[:3], tmp_path / "shards")
    jsonl = _write_jsonl(tmp_path, records[3:])
    os.remove(tmp_path / "jimgs" / "s-003-0.png")  # the image of s-003 (line 1 of the JSONL) is now missing
    pre = _family_preprocessor("qwen2_vl")
    with pytest.warns(BadSampleWarning, match=r"2 sample\(s\) left out"):
        ds = packed_dataset([*shards, jsonl], pre, capacity=512, cache_dir=str(tmp_path / "hf"))
    where = {key: (at, reason) for key, at, reason in ds.left_out}
    assert sorted(where) == ["s-000", "s-003"]
    assert where["s-000"][0] == shards[0] and "image" in where["s-000"][1]
    assert where["s-003"][0] == f"{jsonl}:1" and "not found" in where["s-003"][1]
    assert sorted(k for row in ds["keys"] for k in row) == ["s-001", "s-002", "s-004", "s-005"]
    # on_error="raise" (PackingConfig's other value) stops at the first record that cannot be read, named
    with pytest.raises(SampleError, match=r"s-003.*not found.*on_error='skip'"):
        packed_dataset([*shards, jsonl], pre, capacity=512, cache_dir=str(tmp_path / "hf2"), on_error="raise")


@pytest.mark.slow
def test_a_saved_plan_trains_without_a_forecast_and_a_stale_one_is_refused(tmp_path, monkeypatch):
    """The plan as an artifact on the TRL path: `vlm-pack plan` / build_plan once, then every run (every
    rank) gives packed_dataset the folder and trains the same packs without forecasting again."""
    import vlm_pack.data.forecast as forecast_module
    from vlm_pack.data import build_plan

    data = _hf_dataset(_records(10, seed=4))
    pre = _family_preprocessor("qwen2_vl")
    build_plan(data, pre, capacity=512).save(tmp_path / "plan")
    built = packed_dataset(data, pre, capacity=512, cache_dir=str(tmp_path / "fresh"))

    def no_forecast(*args, **kwargs):
        raise AssertionError("packed_dataset forecast although a plan was given")

    monkeypatch.setattr(forecast_module, "forecast_sources", no_forecast)
    with pytest.raises(AssertionError, match="forecast although"):  # the spy sees a forecast where one happens
        packed_dataset(data, pre, capacity=512, cache_dir=str(tmp_path / "spy"))
    given = packed_dataset(data, pre, capacity=512, plan=tmp_path / "plan", cache_dir=str(tmp_path / "given"))
    assert given["keys"] == built["keys"] and given["lengths"] == built["lengths"]
    seen, _ = _train_one_epoch(given, pre, "qwen2_vl", 512, tmp_path)
    assert sorted(seen.keys) == sorted(r["key"] for r in _records(10, seed=4))  # each sample once
    with pytest.raises(ValueError, match=r"packing\.capacity"):
        packed_dataset(data, pre, capacity=1024, plan=tmp_path / "plan", cache_dir=str(tmp_path / "stale"))


@pytest.mark.slow
def test_qwen3_5_trains_on_packed_rows_each_sample_once_first_loss_as_each_sample_alone(tmp_path):
    """Qwen3.5 (gated delta-net + attention 3:1) through PackedSFTTrainer.train() on packed rows, with no call
    to isolate its mixers (the trainer does, where vlm-pack meets the model): every sample trained once, and the
    first step's loss is the per-token loss of that row's samples each run alone through the same initial
    weights."""
    from vlm_pack import isolate_token_mixers
    from vlm_pack.data import write_shards
    from vlm_pack.forward.mixers import find_token_mixers

    pre = _family_preprocessor("qwen3_5")
    records = _records(6, seed=3, max_images=1)
    shards = write_shards(records, tmp_path / "shards", maxcount=3)
    ds = packed_dataset(shards, pre, capacity=400, cache_dir=str(tmp_path / "hf"))
    assert len(ds) >= 2 and max(len(r["keys"]) for r in ds) >= 2

    def model():
        return tiny_model("qwen3_5", pre.tokenizer, num_layers=4, initializer_range=0.2, seed=0)

    trained = model()
    collator = _Recording(TRLPackingCollator(400, pre, model_config=trained.config))
    trainer = PackedSFTTrainer(model=trained, args=_args(tmp_path, num_train_epochs=1, learning_rate=1e-3),
                               train_dataset=ds, data_collator=collator, processing_class=pre.tokenizer)
    assert {m.isolation for m in find_token_mixers(trained)} == {"per_sample"}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert sorted(collator.keys) == [r["key"] for r in records]  # each exactly once
    assert len(logs) == len(ds) and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    # Oracle: the first row's samples, each alone through the initial weights (no mixer isolation needed).
    alone = model().eval()
    first = collator.inner.samples(collator.rows[:1])
    assert len(first) == len(collator.rows[0]["keys"])
    total, count = 0.0, 0
    with torch.no_grad():
        for s in first:
            inputs = {k: v for k, v in s.items() if k not in ("labels", "tokens_per_image")}
            inputs = {k: v[None] if k in ("input_ids", "mm_token_type_ids") else v for k, v in inputs.items()}
            n = int((s["labels"][1:] != -100).sum())
            total += float(alone(**inputs, labels=s["labels"][None], use_cache=False).loss) * n
            count += n
    assert abs(logs[0]["loss"] - total / count) < 5e-6, (logs[0]["loss"], total / count)
    # Control: the same first row through the initial weights without isolated mixers: called with the row's
    # seq_idx, or without it (its position ids still restart per sample), the model's mixers are isolated first
    # (vlm-pack's packed-call guard); past the guard (boundaries reach the attention layer only) the first
    # samples leak into the later ones: the loss moves (measured 6e-5).
    inputs = TRLPackingCollator(400, pre, model_config=trained.config)(collator.rows[:1])
    inputs.pop(NUM_TOKENS_KEY)
    with torch.no_grad():
        isolated = float(isolate_token_mixers(model()).eval()(**inputs, use_cache=False).loss)
        guarded = float(model().eval()(**inputs, use_cache=False).loss)
        inputs.pop("seq_idx")
        unmarked = float(model().eval()(**inputs, use_cache=False).loss)
        with unguarded():
            leaking = float(model().eval()(**inputs, use_cache=False).loss)
    assert abs(isolated - total / count) < 5e-6 and abs(leaking - total / count) > 2e-5, (isolated, leaking)
    assert guarded == isolated and unmarked == isolated
