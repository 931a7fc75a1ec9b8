"""One length check, in the preprocessor's layout: every loader packs a collapsed-layout sample (one placeholder
per image, Megatron style) on its forecast, as it packs an expanded one.

The oracle is outside the code under test: each sample processed alone by the real HF image processor in the
expanded layout (``len(input_ids)``), which is the length a collapsed sample takes in a row once its placeholders
are expanded. Real tar shards and a real ``datasets.Dataset`` written here, real images through Pillow.
"""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import datasets
import pytest
import torch
from PIL import Image

from vlm_pack import Preprocessor
from vlm_pack.data import PackedDataLoader, PackedWebDataset, write_shards
from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.data.stream_meta import stream_info
from vlm_pack.offline import build_tokenizer, image_processor

CAPACITY = 2048
SIZES = [None, (56, 56), (84, 112), (140, 70), None, (224, 168), (112, 112), (56, 168), (98, 70), None, (70, 70),
         (168, 84)]  # fmt: skip


def _image(i: int, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 20 + i).convert("RGB").save(buf, format="JPEG" if i % 2 else "PNG")
    return buf.getvalue()


def _text(i: int, images: int) -> str:
    return "<image>\n" * images + f"What is in picture {i}? " + "Look closely. " * (i % 4)


@pytest.fixture(scope="module")
def parts():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


@pytest.fixture(scope="module")
def samples() -> list[tuple[str, list[bytes], str]]:
    """(key, images, question) of the 12 samples: 3 text-only, 9 with a photo of its own size."""
    out = []
    for i, size in enumerate(SIZES):
        images = [] if size is None else [_image(i, size)]
        out.append((f"s{i:02d}", images, _text(i, len(images))))
    return out


def _conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": "A noisy picture."}]


@pytest.fixture(scope="module")
def expanded_lengths(parts, samples) -> dict[str, int]:
    """The oracle: each sample alone through the real processor, expanded."""
    pre = Preprocessor(*parts)
    return {
        key: int(pre.process([Image.open(io.BytesIO(b)) for b in images], _conversation(q), key)["input_ids"].shape[0])
        for key, images, q in samples
    }


def test_packed_webdataset_packs_every_collapsed_sample_on_its_forecast(tmp_path, parts, samples, expanded_lengths):
    records = [
        {"key": key, "images": [(b, "jpg" if i % 2 else "png") for b in images], "conversation": _conversation(q)}
        for i, (key, images, q) in enumerate(samples)
    ]
    urls = write_shards(records, tmp_path / "shards", maxcount=5)  # 3 real tar shards
    for layout in ("collapsed", "expanded"):
        ds = PackedWebDataset(urls, Preprocessor(*parts, layout=layout), capacity=CAPACITY)
        with warnings.catch_warnings():
            warnings.simplefilter("error", BadSampleWarning)  # not one sample left out
            batches = list(PackedDataLoader(ds, num_workers=0))
        assert ds.stats.forecast_mismatches == 0 and ds.stats.reasons == {}, layout
        got = {}
        for batch in batches:
            info = stream_info(batch)
            got.update({key: n for (_, key), n in zip(info["samples"], info["lengths"])})
            assert info["lengths"] == info["forecast"]
        assert got == expanded_lengths, layout
        assert ds.stats.tokens == sum(expanded_lengths.values())


def _dataset(samples) -> datasets.Dataset:
    """The samples as a ``datasets.Dataset`` (messages, an ``Image`` column of encoded bytes)."""
    columns = {
        "key": [key for key, _, _ in samples],
        "images": [images for _, images, _ in samples],
        "messages": [_conversation(q) for _, _, q in samples],
    }
    return datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image(decode=False)))


def test_packed_map_dataset_packs_every_collapsed_sample_on_its_forecast(parts, samples, expanded_lengths):
    ds = _dataset(samples)
    for layout in ("collapsed", "expanded"):
        packed = PackedMapDataset(ds, Preprocessor(*parts, layout=layout), capacity=CAPACITY, cache=None)
        loader = torch.utils.data.DataLoader(packed, batch_size=None, sampler=PackedSampler(packed))
        with warnings.catch_warnings():
            warnings.simplefilter("error", BadSampleWarning)  # not one sample left out
            infos = [plan_info(batch) for batch in loader]
        got = {samples[row][0]: n for info in infos for row, n in zip(info["rows"], info["lengths"])}
        assert all(info["left_out"] == [] for info in infos), layout
        assert got == expanded_lengths, layout


def test_trl_collator_checks_each_sample_against_its_rows_forecast(parts, samples, expanded_lengths):
    """TRL's rows carry each sample's forecast; the collator checks the processed sample with the same one
    check (``Preprocessor.checked_length``) instead of collating a sample its pack was not planned for."""
    pytest.importorskip("trl")
    import json

    from vlm_pack.failures import SampleError
    from vlm_pack.integrations.trl import TRLPackingCollator

    picked = [s for s in samples if s[1]][:2]
    row = {
        "keys": [key for key, _, _ in picked],
        "conversations": [json.dumps(_conversation(q)) for _, _, q in picked],
        "image_bytes": [images for _, images, _ in picked],
        "video_bytes": [[] for _ in picked],
        "lengths": [expanded_lengths[key] for key, _, _ in picked],
    }
    collator = TRLPackingCollator(CAPACITY, Preprocessor(*parts))
    assert [len(s["input_ids"]) for s in collator.samples([row])] == row["lengths"]
    stale = {**row, "lengths": [row["lengths"][0], row["lengths"][1] + 1]}  # a plan made for other data
    with pytest.raises(SampleError, match=f"forecast {row['lengths'][1] + 1} != processed length") as raised:
        collator([stale])
    assert raised.value.reason == "forecast_mismatch" and picked[1][0] in str(raised.value)


def test_trl_packed_dataset_rows_process_at_their_forecast_and_refuse_the_collapsed_layout(tmp_path, parts, samples,
                                                                                           expanded_lengths):
    """The user's path: ``packed_dataset`` plans the rows, ``TRLPackingCollator`` processes them (the sample
    contract: each checked against its row's forecast); every sample's row length is its length alone through the
    real processor. TRL trains Hugging Face models, which take expanded rows: a collapsed Preprocessor is refused
    by name before anything is planned."""
    pytest.importorskip("trl")
    from vlm_pack.integrations.trl import TRLPackingCollator, packed_dataset

    ds = _dataset(samples)
    with pytest.raises(ValueError, match="layout='expanded', not 'collapsed'"):
        packed_dataset(ds, Preprocessor(*parts, layout="collapsed"), capacity=CAPACITY, cache_dir=str(tmp_path / "c"))
    pre = Preprocessor(*parts)
    rows = packed_dataset(ds, pre, capacity=CAPACITY, cache_dir=str(tmp_path / "e"))
    collator = TRLPackingCollator(CAPACITY, pre)
    got = {}
    for row in rows:
        processed = collator.samples([row])
        assert row["lengths"] == [len(s["input_ids"]) for s in processed]
        got.update({key: len(s["input_ids"]) for key, s in zip(row["keys"], processed)})
    assert got == expanded_lengths


@pytest.mark.slow  # energon prepare and a loader: ~20 s
def test_energon_packs_every_sample_at_its_length_alone_in_either_layout(tmp_path, parts, samples, expanded_lengths):
    """The Energon encoder's cooker forecasts each tar sample (``forecast_job``), its packer processes and checks
    it (``SampleJob.process``): in both layouts every sample is packed, none left out, and each sample's
    length in its row (``seq_lens_expanded``) is its length alone through the real processor, expanded."""
    pytest.importorskip("megatron.energon", reason="needs the [energon] extra")
    from megatron.energon import WorkerConfig, get_savable_loader
    from megatron.energon.errors import reraise_exception

    from vlm_pack.integrations.energon import VLMPackingTaskEncoder, packed_train_dataset

    records = [
        {"key": key, "images": [(b, "jpg" if i % 2 else "png") for b in images], "conversation": _conversation(q)}
        for i, (key, images, q) in enumerate(samples)
    ]
    write_shards(records, str(tmp_path / "part-%05d.tar"), maxcount=5)
    energon = "import sys; from megatron.energon.cli.main import main; sys.argv[0] = 'energon'; sys.exit(main())"
    subprocess.run([sys.executable, "-c", energon, "prepare", str(tmp_path), "--non-interactive", "--split-ratio",
                    "1,0,0", "--sample-type", "CrudeWebdataset"], check=True, capture_output=True, text=True)
    for layout in ("collapsed", "expanded"):
        encoder = VLMPackingTaskEncoder(Preprocessor(*parts, layout=layout), CAPACITY)
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
        loader = get_savable_loader(packed_train_dataset(str(tmp_path), encoder, worker_config=wc, repeat=False),
                                    watchdog_timeout_seconds=None)
        packs = list(loader)
        assert encoder.left_out == [] and all(p.left_out == [] for p in packs), layout
        got = {k: int(n) for p in packs for k, n in zip(p.keys, p.batch.seq_lens_expanded.tolist())}
        assert got == expanded_lengths, layout
        ids = sum(int(p.batch.seq_lens.sum()) for p in packs)  # collapsed: one id per image
        assert (ids < sum(got.values())) == (layout == "collapsed"), layout
