"""Ray Data forecast (issue 25): on a local 2-CPU cluster with 2 workers, the lengths table and the plan
equal the single-process ``forecast_sources`` + planning bit for bit, on a parquet dataset and on
WebDataset shards written here (real PNG bytes through Pillow, the offline Qwen2-VL tokenizer and image
processor). One cluster for the module (about 10 s to start), shut down after it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from vlm_pack.config import PackingConfig
from vlm_pack.data.forecast import LengthTable, forecast_sources
from vlm_pack.data.lengths import read_lengths, write_lengths
from vlm_pack.data.plan import make_plan
from vlm_pack.data.shards import write_shards
from vlm_pack.data.sources import open_sources
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
from vlm_pack.vision import vision_spec_from_processor

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'vlm-pack[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'vlm-pack[ray]'")

from vlm_pack.integrations.ray import build_plan_ray, forecast_ray, ray_chunks  # noqa: E402

WORDS = "a photo of the dog cat street sign chart table read describe what where is shown".split()
CONFIG = PackingConfig(capacity=1024, on_error="skip")


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 20 + seed % 50).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _samples(n: int = 30) -> list[dict]:
    """``n`` samples of 0-2 images (16-200 px a side) and 3-40 words; sample 7's image is cut short."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        blobs = [_png(tuple(int(v) for v in rng.integers(16, 200, size=2)), 3 * i + j) for j in range(i % 3)]
        if i == 7:
            blobs = [blobs[0][:20]]  # a PNG header without its size: invalid, skipped the same way by both
        question = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 15))))
        answer = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 40))))
        out.append({"key": f"s{i:03d}", "blobs": blobs, "q": question, "a": answer})
    return out


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pre():
    ip = image_processor("qwen2_vl")
    return Preprocessor(build_tokenizer("qwen2_vl"), spec=vision_spec_from_processor(ip))


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> str:
    """The TRL / hub layout (an ``Image`` column of bytes + content-part messages), 6 rows per row group."""
    import pyarrow.parquet as pq

    samples = _samples()
    messages = [
        [
            {"role": "user", "content": [{"type": "image", "text": None}] * len(s["blobs"]) + [{"type": "text", "text": s["q"]}]},
            {"role": "assistant", "content": [{"type": "text", "text": s["a"]}]},
        ]
        for s in samples
    ]  # fmt: skip
    ds = datasets.Dataset.from_dict({"images": [s["blobs"] for s in samples], "messages": messages})
    ds = ds.cast_column("images", datasets.List(datasets.Image()))
    path = tmp_path_factory.mktemp("parquet") / "train.parquet"
    pq.write_table(ds.data.table, path, row_group_size=6)
    return str(path)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    records = [
        {
            "key": s["key"],
            "images": s["blobs"],
            "conversation": [
                {"role": "user", "content": "<image>" * len(s["blobs"]) + s["q"]},
                {"role": "assistant", "content": s["a"]},
            ],
        }
        for s in _samples()
        if s["key"] != "s007"  # write_shards checks its images; the cut-short one is the parquet's test
    ]
    return write_shards(records, tmp_path_factory.mktemp("shards"), maxcount=5)


def _assert_same_table(a: LengthTable, b: LengthTable) -> None:
    arrays = ("text_tokens", "vision_tokens", "num_patches", "image_ptr", "image_tokens", "image_starts", "index")
    for name in arrays:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.keys == b.keys and a.sources == b.sources
    assert a.invalid == b.invalid and a.invalid_reasons == b.invalid_reasons


def _single_process_plan(table: LengthTable, pre: Preprocessor, world_size: int):
    return make_plan(None, pre, CONFIG, None, world_size, "bfd", None, None, 1, False, table=table)


@pytest.mark.parametrize("kind", ["parquet", "webdataset"])
@pytest.mark.slow  # a local Ray cluster: make test runs it, make test-fast does not
def test_ray_with_two_workers_gives_the_single_process_table_and_plan(
    kind, cluster, pre, parquet, shards, tmp_path
):
    source = parquet if kind == "parquet" else shards
    one = forecast_sources(source, preprocessor=pre, progress=False)
    assert len(ray_chunks(open_sources(source))) >= 5  # more pieces than workers: both take some
    if kind == "parquet":
        assert [r for _, _, r in one.invalid] and one.invalid_reasons == ["corrupt_image"]
    else:
        assert not one.invalid
    expected = _single_process_plan(one, pre, world_size=2)

    lengths = tmp_path / "ray-lengths.parquet"
    plan = build_plan_ray(source, pre, CONFIG, world_size=2, lengths=lengths, num_proc=2)
    got = read_lengths(lengths)
    _assert_same_table(got, one)
    single = write_lengths(one, tmp_path / "one-lengths.parquet")
    assert single.read_bytes() == lengths.read_bytes()  # the files too, byte for byte

    for name in ("rows", "lengths", "bin_ptr", "rank_bins"):
        a, b = getattr(plan, name), getattr(expected, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert plan.digest == expected.digest and plan.skipped == expected.skipped
    parts = [plan.rows_of(int(b)) for r in range(2) for b in plan.rank_bins_of(r)]
    rows = np.concatenate(parts)
    assert len(np.unique(rows)) == len(rows) == len(one) - len(plan.skipped) + len(one.invalid)


@pytest.mark.slow
def test_ray_forecast_of_a_dataset_is_keyed_for_packed_map_dataset(cluster, pre, parquet):
    """A ``datasets.Dataset`` (a hub dataset as ``load_dataset`` returns it): the plan is keyed as
    ``build_plan`` keys it, so the digest equals the single-process plan's."""
    from vlm_pack.data.plan import build_plan

    ds = datasets.Dataset.from_parquet(parquet)
    expected = build_plan(ds, pre, CONFIG, world_size=2, progress=False)
    plan = build_plan_ray(ds, pre, CONFIG, world_size=2, num_proc=2)
    assert plan.key == expected.key and plan.digest == expected.digest
    for name in ("rows", "lengths", "bin_ptr", "rank_bins"):
        assert np.array_equal(getattr(plan, name), getattr(expected, name)), name


@pytest.mark.slow
def test_ray_forecast_raises_the_first_bad_sample_in_source_order(cluster, pre, parquet):
    with pytest.raises(ValueError) as single:
        forecast_sources(parquet, preprocessor=pre, on_error="raise", progress=False)
    with pytest.raises(ValueError) as distributed:
        forecast_ray(parquet, preprocessor=pre, on_error="raise", num_proc=2)
    assert str(distributed.value) == str(single.value) and "train.parquet:7" in str(single.value)


@pytest.mark.slow
def test_ray_failure_budget_names_its_stage_once_as_the_local_forecast_does(cluster, pre, parquet):
    """Issue 39: ``forecast_ray, header-only forecast: ...``, not ``forecast_ray (header-only forecast),
    header-only forecast: ...``; the same message as one process gives, but for the run's name."""
    from vlm_pack.failures import FailureBudgetError

    with pytest.raises(FailureBudgetError) as single:
        forecast_sources(parquet, preprocessor=pre, max_consecutive_failures=0, progress=False)
    with pytest.raises(FailureBudgetError) as distributed:
        forecast_ray(parquet, preprocessor=pre, max_consecutive_failures=0, num_proc=2)
    assert str(distributed.value).startswith("forecast_ray, header-only forecast: 1 bad samples in a row")
    assert str(distributed.value).replace("forecast_ray", "forecast_sources", 1) == str(single.value)


@pytest.mark.slow
def test_cli_analyze_engine_ray_writes_the_same_lengths(cluster, parquet, tmp_path, capsys):
    from vlm_pack.cli.main import main

    base = ["analyze", parquet, "--capacity", "1024", "--no-plots", "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "a"), "--lengths", str(tmp_path / "local.parquet")]) == 0
    argv = [*base, "--out", str(tmp_path / "b"), "--engine", "ray", "--workers", "2"]
    assert main([*argv, "--lengths", str(tmp_path / "ray.parquet")]) == 0, capsys.readouterr().err
    assert (tmp_path / "local.parquet").read_bytes() == (tmp_path / "ray.parquet").read_bytes()
    reports = [json.loads((tmp_path / d / "report.json").read_text())["dataset"] for d in "ab"]
    assert reports[0] == reports[1] and reports[0]["samples"] == 29


def test_lengths_table_round_trips_through_parquet(pre, shards, tmp_path):
    table = forecast_sources(shards, preprocessor=pre, progress=False)
    _assert_same_table(read_lengths(write_lengths(table, tmp_path / "t.parquet")), table)
    with pytest.raises(ValueError, match="not a vlm-pack lengths table"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
        read_lengths(Path(tmp_path / "other.parquet"))


@pytest.mark.slow
def test_cli_plan_engine_ray_gives_the_local_plan(cluster, parquet, tmp_path, capsys):
    """``vlm-pack plan --engine ray``: the forecast through ``forecast_ray``, the same plan folder (key, digest,
    arrays) and lengths file as ``--engine local``; optimizer steps and micro-steps printed apart."""
    from vlm_pack.cli.main import main
    from vlm_pack.data.plan_folder import Plan

    folder = tmp_path / "train"
    datasets.Dataset.from_parquet(parquet).save_to_disk(str(folder))
    base = ["plan", str(folder), "--family", "qwen2_vl", "--capacity", "1024", "--world-size", "2",
            "--grad-accum", "2", "--no-progress"]  # fmt: skip
    assert main([*base, "--out", str(tmp_path / "local.plan"), "--lengths", str(tmp_path / "local.parquet")]) == 0
    argv = [*base, "--out", str(tmp_path / "ray.plan"), "--engine", "ray", "--workers", "2"]
    assert main([*argv, "--lengths", str(tmp_path / "ray.parquet")]) == 0, capsys.readouterr().err
    local, distributed = Plan.load(tmp_path / "local.plan"), Plan.load(tmp_path / "ray.plan")
    assert distributed.key == local.key and distributed.digest == local.digest
    for name in ("rows", "lengths", "bin_ptr", "rank_bins"):
        assert np.array_equal(getattr(distributed, name), getattr(local, name)), name
    assert (tmp_path / "local.parquet").read_bytes() == (tmp_path / "ray.parquet").read_bytes()
    printed = capsys.readouterr().out
    assert f"{local.steps:,} optimizer steps x 2 rank(s) ({local.micro_steps:,} micro-steps per rank, grad-accum 2)" in printed
    assert local.steps == -(-local.micro_steps // 2)
    assert main([*base[:-1], "--out", str(tmp_path / "x.plan"), "--address", "auto"]) == 1
    assert "--address names a Ray cluster: pass --engine ray" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["expanded", "collapsed"])
def test_a_ray_plan_loads_in_either_layout_each_sample_at_its_length_alone(cluster, parquet, layout):
    """Ray forecasts; its plan is processed by ``PackedMapDataset(plan=)``, each sample through the one sample
    contract (``SampleJob``: processed, then checked against the plan's length in the preprocessor's layout).
    Oracle: each good row processed alone by the real image processor, expanded (a collapsed row's length in
    a row once its placeholders are expanded)."""
    import torch

    from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info

    tok, ip = build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")
    ds = datasets.Dataset.from_parquet(parquet)
    pre = Preprocessor(tok, ip, layout=layout)
    plan = build_plan_ray(ds, pre, CONFIG, num_proc=2)
    packed = PackedMapDataset(ds, pre, CONFIG, plan=plan)
    infos = [plan_info(b) for b in torch.utils.data.DataLoader(packed, batch_size=None, sampler=PackedSampler(packed))]
    got = {row: n for info in infos for row, n in zip(info["rows"], info["lengths"])}
    alone = Preprocessor(tok, ip)
    want = {
        row: int(alone.process(ds[row]["images"], ds[row]["messages"], row)["input_ids"].shape[0])
        for row in range(len(ds))
        if row != 7  # the cut-short PNG: left out of the plan (corrupt_image)
    }
    assert got == want and all(info["left_out"] == [] for info in infos)
