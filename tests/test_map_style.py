"""The map-style packed dataset: every sample once per epoch over ranks, exact resume, a cache never stale.

A ``datasets.Dataset`` with ``Image`` features (noise images made with Pillow, conversations of varied
length) is planned once; the oracle for lengths is ``process_sample`` on the original images, for coverage
the set of dataset rows.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vlm_pack.config import PackingConfig
from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
from vlm_pack.processing import process_sample
from vlm_pack.processing.chat import chat_format

N = 30
CAPACITY = 192


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _conversation(i: int, images: int) -> list[dict]:
    user = [{"type": "image", "text": None}] * images + [{"type": "text", "text": "question " * (1 + i % 4)}]
    answer = [{"type": "text", "text": "answer " * (1 + (7 * i) % 11)}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _columns(n: int) -> dict:
    images = [[_png((28 + 9 * (i % 8), 28 + 13 * (i % 5)), i)] * (i % 3 != 2) for i in range(n)]
    return {"images": images, "messages": [_conversation(i, len(im)) for i, im in enumerate(images)]}


@pytest.fixture(scope="module")
def columns():
    return _columns(N)


@pytest.fixture(scope="module")
def dataset(columns):
    ds = datasets.Dataset.from_dict(columns)
    return ds.cast_column("images", datasets.List(datasets.Image()))


@pytest.fixture(scope="module")
def model():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


@pytest.fixture(scope="module")
def lengths(columns, model):
    tok, ip = model
    out = []
    for images, conversation in zip(columns["images"], columns["messages"]):
        pil = [Image.open(io.BytesIO(b)) for b in images]
        out.append(
            int(process_sample(pil, conversation, tokenizer=tok, image_processor=ip)["input_ids"].shape[0])
        )
    return np.asarray(out)


def _packed(dataset, model, cache, **kwargs) -> PackedMapDataset:
    tok, ip = model
    config = kwargs.pop("config", PackingConfig(capacity=CAPACITY, shuffle_seed=1))
    return PackedMapDataset(dataset, Preprocessor(tok, ip), config, cache=cache, **kwargs)


def _rows(batches) -> list[int]:
    return [r for b in batches for r in plan_info(b)["rows"]]


@pytest.mark.slow
def test_two_ranks_see_every_sample_once_per_epoch(dataset, model, lengths, tmp_path):
    ranks = [
        _packed(dataset, model, tmp_path, world_size=2, rank=r, num_proc=2 if r == 0 else 1) for r in (0, 1)
    ]
    assert [r.from_cache for r in ranks] == [False, True]  # rank 1 reads the plan rank 0 made
    assert len(ranks[0]) == len(ranks[1]) == ranks[0].steps  # lock-step: equal packs per rank
    seen = []
    for ds in ranks:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=PackedSampler(ds), num_workers=2)
        for batch in loader:
            info = plan_info(batch)
            assert info["rank"] == ds.rank
            assert batch.input_ids.shape == (1, CAPACITY)
            # processed lengths are the real processor's, and the batch holds exactly those samples
            assert info["lengths"] == lengths[info["rows"]].tolist()
            assert sorted(batch.seq_lens.tolist()) == sorted(info["lengths"])
            assert sorted(batch.metadata["__row__"]) == sorted(info["rows"])
            seen += info["rows"]
    assert sorted(seen) == list(range(N))
    # the next epoch reorders the packs of each rank, and still covers every sample once
    ranks[0].set_epoch(1)
    ranks[1].set_epoch(1)
    assert [ranks[0].bin_of(i, 1)[2] for i in range(len(ranks[0]))] != [
        ranks[0].bin_of(i, 0)[2] for i in range(len(ranks[0]))
    ]
    assert sorted(_rows(ds[i] for ds in ranks for i in range(len(ds)))) == list(range(N))


def test_global_view_interleaves_the_ranks(dataset, model, tmp_path):
    both = _packed(dataset, model, tmp_path, world_size=2)
    rank1 = _packed(dataset, model, tmp_path, world_size=2, rank=1)
    assert len(both) == 2 * len(rank1)
    # a sequential sampler sharded the Accelerate / Trainer way (item r, r + W, ...) gives rank 1 its packs
    assert [both.bin_of(i)[2] for i in range(1, len(both), 2)] == [
        rank1.bin_of(i)[2] for i in range(len(rank1))
    ]


def test_resume_with_another_number_of_workers(dataset, model, tmp_path):
    ds = _packed(dataset, model, tmp_path, world_size=2, rank=0)
    full = _rows(torch.utils.data.DataLoader(ds, batch_size=None, sampler=PackedSampler(ds), num_workers=0))
    sampler = PackedSampler(ds)
    sampler.set_epoch(0)
    first = []
    for batch in torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler, num_workers=2):
        first.append(sampler.observe(batch))
        if len(first) == 2:
            break  # the workers had prefetched more: the state says what was consumed
    state = sampler.state_dict()
    assert state["next"] == 2

    again = _packed(dataset, model, tmp_path, world_size=2, rank=0)  # a new process: the plan from cache
    assert again.from_cache
    resumed = PackedSampler(again)
    resumed.load_state_dict(state)
    rest = [resumed.observe(b) for b in torch.utils.data.DataLoader(again, batch_size=None, sampler=resumed)]
    assert _rows(first) + _rows(rest) == full  # the same packs, in the same order, none twice
    assert resumed.state_dict()["next"] == len(again)
    assert [plan_info(b)["epoch"] for b in rest] == [0] * len(rest)
    # a finished epoch: the next iteration is the next epoch's
    assert {e for e, _ in resumed} == {1}


def test_stale_plan_is_rebuilt_never_reused(columns, dataset, model, lengths, tmp_path):
    path = tmp_path / "run.plan"
    _packed(dataset, model, path)
    assert _packed(dataset, model, path).from_cache
    # the data changes: one answer grows, the fingerprint changes, the plan file is stale
    changed = dict(columns)
    changed["messages"] = list(columns["messages"])
    changed["messages"][4] = _conversation(4, len(columns["images"][4]))
    changed["messages"][4][1]["content"][0]["text"] = "a much longer answer " * 6
    new = datasets.Dataset.from_dict(changed).cast_column("images", datasets.List(datasets.Image()))
    with pytest.warns(UserWarning, match=r"run.plan is stale \(dataset[.]fingerprint changed\)"):
        rebuilt = _packed(new, model, path)
    assert not rebuilt.from_cache
    (b,) = [b for b in range(int(rebuilt._bin_ptr.size) - 1) if 4 in rebuilt.rows_of(b)]
    item = next(i for i in range(len(rebuilt)) if rebuilt.bin_of(i)[2] == b)
    assert plan_info(rebuilt[item])["lengths"][list(rebuilt.rows_of(b)).index(4)] > lengths[4]
    # other packing settings: another plan (in a cache folder, another file), never the old one
    folder = tmp_path / "plans"
    _packed(dataset, model, folder)
    other = _packed(dataset, model, folder, config=PackingConfig(capacity=2 * CAPACITY, shuffle_seed=1))
    assert not other.from_cache and other.plan_digest != _packed(dataset, model, folder).plan_digest
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same settings again: reused silently and correctly
        assert _packed(dataset, model, folder).from_cache


def test_oversized_and_unreadable_samples_are_reported(columns, model, lengths):
    broken = dict(columns)
    broken["images"] = list(columns["images"])
    broken["images"][0] = [b"not an image at all"]
    ds = datasets.Dataset.from_dict(broken).cast_column("images", datasets.List(datasets.Image(decode=False)))
    capacity = int(lengths.max()) - 1  # the longest samples do not fit
    too_long = {str(i) for i in np.flatnonzero(lengths > capacity) if i != 0}
    config = PackingConfig(capacity=capacity, oversized="skip", shuffle_seed=None)
    with pytest.warns(UserWarning, match=r"left out of the plan: 0 \(dataset\[0\]\): .*image_size"):
        packed = _packed(ds, model, None, config=config)
    reasons = {key: reason for key, _, reason in packed.skipped}
    assert set(reasons) == {"0"} | too_long and too_long
    assert all(f"> capacity {capacity}" in reasons[k] for k in too_long)
    kept = _rows(packed[i] for i in range(len(packed)))
    assert sorted(kept + [int(k) for k in reasons]) == list(range(N))
    with pytest.raises(
        ValueError, match=rf"dataset\[\d+\] \(key '\d+'\): \d+ tokens exceed capacity {capacity}"
    ):
        _packed(
            datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image())),
            model,
            None,
            config=config.replace(oversized="raise"),
        )


@pytest.mark.slow
def test_hf_trainer_trains_on_the_packs(dataset, model, tmp_path):
    from transformers import Trainer, TrainingArguments

    from vlm_pack.offline import tiny_model

    ds = _packed(dataset, model, tmp_path, world_size=1)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",  # the plan's order (rank-interleaved under Accelerate)
        remove_unused_columns=False,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    net = tiny_model("qwen2_vl", model[0]).train()
    trainer = Trainer(model=net, args=args, train_dataset=ds, data_collator=ds.trainer_collator("sdpa"))
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == len(ds)
    assert sorted(r for i in range(len(ds)) for r in ds.rows_of(ds.bin_of(i)[2])) == list(range(N))
    assert all("attention_mask" not in b and b["input_ids"].shape == (1, CAPACITY) for b in batches)
    result = trainer.train()
    assert result.global_step == 2 and np.isfinite(result.training_loss)


def test_an_image_that_fails_to_decode_is_warned_about_and_left_out(columns, model):
    from vlm_pack.data.stats import BadSampleWarning

    buf = io.BytesIO()
    Image.effect_noise((64, 48), 50).convert("RGB").save(buf, format="JPEG")
    cut = buf.getvalue()[: len(buf.getvalue()) // 2]  # the header reads (the plan has it), the pixels do not
    broken = dict(columns)
    broken["images"] = [[cut], *list(columns["images"][1:])]
    broken["messages"] = [_conversation(0, 1), *list(columns["messages"][1:])]
    ds = datasets.Dataset.from_dict(broken).cast_column("images", datasets.List(datasets.Image(decode=False)))
    packed = _packed(ds, model, None, config=PackingConfig(capacity=CAPACITY))
    (item,) = [i for i in range(len(packed)) if 0 in packed.rows_of(packed.bin_of(i)[2])]
    with pytest.warns(BadSampleWarning, match="dataset row 0 left out of its pack"):
        info = plan_info(packed[item])
    assert 0 not in info["rows"] and len(info["rows"]) == len(packed.rows_of(info["bin"])) - 1
    strict = _packed(ds, model, None, config=PackingConfig(capacity=CAPACITY, on_error="raise"))
    with pytest.raises(OSError):
        strict[item]


@pytest.mark.parametrize("family", ["internvl", "idefics3", "gemma3"])
@pytest.mark.slow
def test_a_processor_whose_images_are_wrapped_plans_and_loads_every_sample(columns, family):
    """With the checkpoint's processor (its released template, its image wrappers) every row is planned at
    transformers' own length and loads into its pack: nothing is left out as a forecast mismatch."""
    from pathlib import Path

    from transformers import ProcessorMixin

    from vlm_pack.offline import processor as make_processor

    template = (Path(__file__).parent / "templates" / f"{family}.jinja").read_text()
    proc = make_processor(family, build_tokenizer(family), chat_template=template)
    n = 9
    ds = datasets.Dataset.from_dict({k: v[:n] for k, v in columns.items()})
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    extra = {"collator_kwargs": {"sliding_window": 512}} if family == "gemma3" else {}
    config = PackingConfig(capacity=8192, on_error="raise")
    packed = PackedMapDataset(ds, Preprocessor(processor=proc), config, cache=False, **extra)
    assert packed.skipped == [] and packed.num_samples == n
    seen = {}
    for i in range(len(packed)):
        info = plan_info(packed[i])
        seen.update(zip(info["rows"], info["lengths"]))
    assert sorted(seen) == list(range(n))
    for row in range(n):  # the oracle: transformers' template rendering through the processor
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in columns["images"][row]]
        messages = [
            {"role": m["role"], "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
            for m in columns["messages"][row]
        ]
        text = ProcessorMixin.apply_chat_template(proc, messages)
        bos = proc.tokenizer.bos_token
        enc = proc(text=[text], images=[images] if images else None, add_special_tokens=not (bos and text.startswith(bos)))
        assert seen[row] == len(enc["input_ids"][0]), row


# ---------------------------------------------------------------------- the plan's key: everything that makes a token
_QWEN_TEMPLATE = (Path(__file__).parent / "templates" / "qwen2_vl.jinja").read_text()
_LONGER_SYSTEM = "You are a helpful assistant. Answer every question about the picture in full sentences."


def _prefixed(prefix: str):
    """A chat-template callable whose output depends on a value held in its closure, not in its code."""

    def template(conversation, num_images):
        return [(prefix, False), *chat_format("qwen2_vl").render(conversation, num_images)]

    return template


def _with_default(prefix: str):
    return lambda conversation, num_images, prefix=prefix: [  # the value lives in a default argument
        (prefix, False),
        *chat_format("qwen2_vl").render(conversation, num_images),
    ]


def _variants(tok, ip):
    """``(name, what must be named as changed, kwargs of a first build, kwargs of a rebuild)``: each rebuild
    changes one thing that changes tokens, and nothing else."""
    from vlm_pack.offline import processor

    other = _QWEN_TEMPLATE.replace("You are a helpful assistant.", _LONGER_SYSTEM)
    assert other[:200] == _QWEN_TEMPLATE[:200] and other != _QWEN_TEMPLATE  # a long common prefix
    return [
        ("template_string", "chat.template", dict(template=_QWEN_TEMPLATE), dict(template=other)),
        (
            "processor_template",
            "processor.chat_template",
            dict(processor=processor("qwen2_vl", tok, chat_template=_QWEN_TEMPLATE)),
            dict(processor=processor("qwen2_vl", tok, chat_template=other)),
        ),
        ("closure", "chat.template", dict(template=_prefixed("")), dict(template=_prefixed(_LONGER_SYSTEM))),
        ("default", "chat.template", dict(template=_with_default("")), dict(template=_with_default(_LONGER_SYSTEM))),
        (
            "max_pixels",
            "image_processor.size",
            dict(image_processor=ip),
            dict(image_processor=image_processor("qwen2_vl", size={"shortest_edge": 4 * 56 * 56, "longest_edge": 64 * 784})),
        ),
    ]


def _build(dataset, tok, cache, **parts):
    """The dataset of these Preprocessor ``parts`` (a template, a processor or an image processor)."""
    parts.setdefault("tokenizer", tok)
    if "processor" not in parts:
        parts.setdefault("image_processor", image_processor("qwen2_vl"))
    config = PackingConfig(capacity=CAPACITY, shuffle_seed=1)
    return PackedMapDataset(dataset, Preprocessor(**parts), config, cache=cache)


def _epoch_rows(ds) -> list[int]:
    """The rows of one full epoch; a sample left out (a stale plan's forecast mismatch) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadSampleWarning)
        return sorted(_rows(ds[i] for i in range(len(ds))))


@pytest.mark.parametrize("variant", ["template_string", "processor_template", "closure", "default", "max_pixels"])
@pytest.mark.slow
def test_a_rebuild_with_anything_that_changes_tokens_replans(dataset, model, tmp_path, variant):
    tok, ip = model
    _, changed, first, second = next(v for v in _variants(tok, ip) if v[0] == variant)
    folder, single = tmp_path / "plans", tmp_path / "run.plan"
    old = _build(dataset, tok, folder, **first)
    _build(dataset, tok, single, **first)
    assert _epoch_rows(old) == list(range(N))
    new = _build(dataset, tok, folder, **second)
    assert not new.from_cache and new.plan_digest != old.plan_digest
    assert _epoch_rows(new) == list(range(N))  # every sample, at the length the new parts give it
    assert not np.array_equal(new._forecast, old._forecast) or variant == "max_pixels"
    # one plan file: the stale plan is rebuilt, and the warning names what changed
    with pytest.warns(UserWarning, match=rf"run.plan is stale \(.*{changed.replace('.', '[.]')}"):
        again = _build(dataset, tok, single, **second)
    assert not again.from_cache and _epoch_rows(again) == list(range(N))


@pytest.mark.slow
def test_an_unchanged_rebuild_reuses_the_plan(dataset, model, tmp_path):
    """Equal parts built anew (a copy of the template text, a new closure over an equal value, a new image
    processor with the same settings) are the same plan: the cache is keyed by content, not identity."""
    tok, _ = model
    from vlm_pack.offline import processor

    for first, second in [
        (dict(template=_QWEN_TEMPLATE), dict(template="".join(list(_QWEN_TEMPLATE)))),
        (dict(template=_prefixed("x " * 3)), dict(template=_prefixed("x " * 3))),
        (
            dict(processor=processor("qwen2_vl", tok, chat_template=_QWEN_TEMPLATE)),
            dict(processor=processor("qwen2_vl", tok, chat_template=_QWEN_TEMPLATE)),
        ),
    ]:
        old = _build(dataset, tok, tmp_path, **first)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = _build(dataset, tok, tmp_path, **second)
        assert new.from_cache and new.plan_digest == old.plan_digest
        assert _epoch_rows(new) == list(range(N))


def test_a_template_that_cannot_be_fingerprinted_is_not_cached(dataset, model, tmp_path):
    """A callable holding an object vlm-pack cannot fingerprint (here a lock) is never keyed by its code
    alone: the plan is made anew, with a warning that says why, and never read from or written to the cache."""
    import threading

    tok, _ = model
    lock = threading.Lock()

    def template(conversation, num_images):
        with lock:
            return chat_format("qwen2_vl").render(conversation, num_images)

    with pytest.warns(UserWarning, match=r"cannot fingerprint .*template.*lock.*not cached"):
        first = _build(dataset, tok, tmp_path, template=template)
    with pytest.warns(UserWarning, match=r"cannot fingerprint"):
        second = _build(dataset, tok, tmp_path, template=template)
    assert not first.from_cache and not second.from_cache and not list(tmp_path.iterdir())
    assert _epoch_rows(second) == list(range(N))


@pytest.mark.slow
def test_the_fingerprint_is_the_same_in_every_process():
    """The plan's key holds no id, address or hash-seeded order: two processes with other string hash seeds
    (a rank, a restarted job) name the same callable template, with a set in its code, by the same digest."""
    import subprocess
    import sys

    code = (
        "from vlm_pack import Preprocessor\n"
        "from vlm_pack.processing.chat import chat_format\n"
        "from vlm_pack.data.fingerprint import fingerprint\n"
        "from vlm_pack.offline import build_tokenizer, image_processor\n"
        "ROLES = {'user', 'assistant', 'system', 'tool'}\n"
        "def make(prefix, names=frozenset({'a', 'b', 'c', 'd'})):\n"
        "    def template(conversation, num_images):\n"
        "        assert all(t['role'] in ROLES | {'x', 'y'} for t in conversation)\n"
        "        return [(prefix, False), *chat_format('qwen2_vl').render(conversation, num_images)]\n"
        "    return template\n"
        "pre = Preprocessor(build_tokenizer('qwen2_vl'), image_processor('qwen2_vl'), template=make('hi'))\n"
        "print(fingerprint(pre)[0])\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True,
            text=True, check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 64


def test_files_instead_of_one_dataset_are_refused_with_the_fix(dataset, model, tmp_path):
    """A user who points the map-style dataset at their files (a glob of shards, a parquet file) gets an error
    that says what it found and what to use instead, not a bare unpacking error."""
    dataset.to_parquet(str(tmp_path / "a.parquet"))
    dataset.to_parquet(str(tmp_path / "b.parquet"))
    for given, found in ((str(tmp_path / "*.parquet"), "found 2 source"), (str(tmp_path / "a.parquet"), "found 1")):
        with pytest.raises(ValueError, match=rf"{found}.*reads rows by index.*datasets.load_dataset.*packed_dataset"):
            _packed(given, model, None)
