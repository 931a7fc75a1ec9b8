"""A plan as an artifact (issues 23, 25): built once, saved as a folder, read by every rank without forecasting.

A real ``datasets.Dataset`` with PNG bytes made by Pillow, the offline Qwen2-VL tokenizer and image processor.
Oracles: the set of dataset rows (coverage), the items of the dataset that built the plan (a dataset given
the saved plan must yield the same packs), and the parts that were changed on purpose (a stale plan's error).
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vlm_pack.config import PackingConfig
from vlm_pack.data import Plan, build_plan, plan_info
from vlm_pack.data.map_style import PackedMapDataset
from vlm_pack.data.plan import StalePlanError, plan_key
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor

N = 24
CAPACITY = 192
_QWEN_TEMPLATE = (Path(__file__).parent / "templates" / "qwen2_vl.jinja").read_text()


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _conversation(i: int, images: int) -> list[dict]:
    user = [{"type": "image", "text": None}] * images + [{"type": "text", "text": "question " * (1 + i % 4)}]
    answer = [{"type": "text", "text": "answer " * (1 + (7 * i) % 11)}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def dataset():
    images = [[_png((28 + 9 * (i % 8), 28 + 13 * (i % 5)), i)] * (i % 3 != 2) for i in range(N)]
    columns = {"images": images, "messages": [_conversation(i, len(im)) for i, im in enumerate(images)]}
    return datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image()))


@pytest.fixture(scope="module")
def parts():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


@pytest.fixture(scope="module")
def saved(dataset, parts, tmp_path_factory):
    """A plan for two ranks, built once and saved."""
    tok, ip = parts
    plan = build_plan(dataset, Preprocessor(tok, ip), capacity=CAPACITY, world_size=2)
    return plan, plan.save(tmp_path_factory.mktemp("plans") / "train.plan")


def _packed(dataset, parts, template=None, **kwargs) -> PackedMapDataset:
    tok, ip = parts
    config = PackingConfig(capacity=kwargs.pop("capacity", CAPACITY), shuffle_seed=1)
    return PackedMapDataset(dataset, Preprocessor(tok, ip, template=template), config, cache=None, **kwargs)


def _tensors(batch) -> dict[str, torch.Tensor]:
    return {
        f.name: v for f in dataclasses.fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)
    }


def _no_forecast(monkeypatch) -> None:
    """A spy that fails the test if anything forecasts (the one expensive pass a saved plan saves)."""

    def forecast_sources(*args, **kwargs):
        raise AssertionError("forecast_sources was called: a saved plan must be used without forecasting")

    monkeypatch.setattr("vlm_pack.data.forecast.forecast_sources", forecast_sources)


def test_two_ranks_read_disjoint_parts_covering_every_sample(saved):
    plan, path = saved
    assert sorted(p.name for p in path.iterdir()) == [
        "bin_ptr.npy", "lengths.npy", "plan.json", "rank_bins.npy", "rows.npy"
    ]  # fmt: skip
    seen = []
    for rank in (0, 1):
        part = Plan.load(path, rank=rank)
        assert part.digest == plan.digest and part.micro_steps == plan.micro_steps and part.world_size == 2
        bins = part.rank_bins_of(rank).tolist()
        assert len(bins) == part.micro_steps
        seen.append([int(r) for b in bins for r in part.rows_of(b)])
        for b in bins:  # the forecast lengths travel with the rows, bin by bin
            assert part.lengths_of(b).tolist() == plan.lengths_of(b).tolist()
            assert 0 < int(part.lengths_of(b).sum()) <= CAPACITY
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(N)) and plan.num_samples == N and plan.skipped == ()
    assert plan.num_bins == 2 * plan.micro_steps and plan.steps == plan.micro_steps  # grad_accum 1


def test_a_rank_maps_its_plan_instead_of_reading_it(saved):
    _, path = saved
    part = Plan.load(path, rank=1)
    for name in ("rows", "lengths", "bin_ptr", "rank_bins"):
        array = getattr(part, name)
        assert isinstance(array, np.memmap) and not array.flags.writeable, name
    # a DataLoader worker receives the folder, mapped again there, not a copy of the arrays
    again = pickle.loads(pickle.dumps(part))
    assert isinstance(again.rows, np.memmap) and again.rank == 1 and again.digest == part.digest
    assert len(pickle.dumps(part)) < 1000
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        Plan.load(path, rank=2)


def test_a_dataset_given_the_saved_plan_gives_the_same_items_without_forecasting(
    dataset, parts, saved, monkeypatch
):
    plan, path = saved
    built = _packed(dataset, parts, world_size=2, rank=1)  # plans itself: the same parts, the same plan
    assert built.plan_digest == plan.digest
    _no_forecast(monkeypatch)
    given = _packed(dataset, parts, rank=1, plan=path)  # world_size: the plan's
    assert given.world_size == 2 and given.from_cache and isinstance(given.plan.rows, np.memmap)
    assert given.plan_digest == built.plan_digest and len(given) == len(built) == plan.micro_steps
    for i in range(len(given)):
        a, b = built[i], given[i]
        assert plan_info(a) == plan_info(b)
        assert _tensors(a).keys() == _tensors(b).keys() and {"input_ids", "labels"} <= _tensors(a).keys()
        assert all(torch.equal(x, _tensors(b)[name]) for name, x in _tensors(a).items())
    # a Plan object works the same, for the global (rank-interleaved) view
    both = _packed(dataset, parts, plan=plan)
    assert [both.bin_of(i)[2] for i in range(1, len(both), 2)] == [
        given.bin_of(i)[2] for i in range(len(given))
    ]
    with pytest.raises(ValueError, match=r"world_size=4 but the plan deals its packs to 2 ranks"):
        _packed(dataset, parts, plan=path, world_size=4)


def test_a_plan_made_with_another_template_or_capacity_is_refused_naming_it(
    dataset, parts, tmp_path, monkeypatch
):
    tok, ip = parts
    path = build_plan(dataset, Preprocessor(tok, ip, template=_QWEN_TEMPLATE), capacity=CAPACITY).save(
        tmp_path / "p"
    )
    _no_forecast(monkeypatch)
    other = _QWEN_TEMPLATE.replace("You are a helpful assistant.", "You answer in full sentences.")
    with pytest.raises(StalePlanError, match=r"is stale: chat\.template changed.*[Rr]ebuild it") as e:
        _packed(dataset, parts, plan=path, template=other)
    assert e.value.changed == ["chat.template"]
    with pytest.raises(
        ValueError,
        match=r"is stale: packing\.capacity changed since it was made \(packing\.capacity: 192 -> 384\)",
    ):
        _packed(dataset, parts, plan=path, template=_QWEN_TEMPLATE, capacity=2 * CAPACITY)
    # the same check for any consumer: Plan.load(expect=the key it would plan with)
    key = plan_key(dataset, Preprocessor(tok, ip, template=other), PackingConfig(capacity=CAPACITY))
    with pytest.raises(StalePlanError, match=r"chat\.template"):
        Plan.load(path, expect=key)
    ok = plan_key(dataset, Preprocessor(tok, ip, template=_QWEN_TEMPLATE), PackingConfig(capacity=CAPACITY))
    assert Plan.load(path, expect=ok).key == ok
    assert _packed(dataset, parts, plan=path, template=_QWEN_TEMPLATE).num_samples == N


def test_a_partial_or_corrupt_plan_folder_is_named(saved, tmp_path):
    import shutil

    _, path = saved

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(path, target)
        return target

    missing = copy("missing")
    (missing / "rank_bins.npy").unlink()
    with pytest.raises(ValueError, match=r"missing is not a whole plan: rank_bins\.npy is missing"):
        Plan.load(missing)
    no_meta = copy("no_meta")
    (no_meta / "plan.json").unlink()
    with pytest.raises(ValueError, match=r"plan\.json is missing"):
        Plan.load(no_meta)
    cut = copy("cut")
    text = (cut / "plan.json").read_text()
    (cut / "plan.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"plan\.json is unreadable"):
        Plan.load(cut)
    mixed = copy("mixed")
    np.save(mixed / "rows.npy", np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match=r"rows\.npy holds int64 \[3\], plan\.json says"):
        Plan.load(mixed)
    garbage = copy("garbage")
    (garbage / "bin_ptr.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match=r"bin_ptr\.npy is unreadable"):
        Plan.load(garbage)
    with pytest.raises(FileNotFoundError, match=r"no plan folder at .*nowhere"):
        Plan.load(tmp_path / "nowhere")
    # saving over a folder that is not a plan is refused; over a plan, it replaces it whole
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes exists and is not a plan folder"):
        Plan.load(path).save(tmp_path / "notes")
    meta = json.loads((Plan.load(path).save(missing) / "plan.json").read_text())
    assert Plan.load(missing).digest == meta["digest"] and not list(tmp_path.glob(".*"))


def test_the_cache_is_a_plan_folder_and_an_old_npz_path_is_refused(dataset, parts, tmp_path):
    tok, ip = parts
    config = PackingConfig(capacity=CAPACITY)
    first = PackedMapDataset(dataset, Preprocessor(tok, ip), config, cache=tmp_path)
    (folder,) = tmp_path.iterdir()
    assert folder.name == f"plan-{first.plan_digest}" and Plan.load(folder).digest == first.plan_digest
    with pytest.raises(ValueError, match=r"plans are folders now.*'plan\.plan'"):
        PackedMapDataset(dataset, Preprocessor(tok, ip), config, cache=tmp_path / "plan.npz")


def test_the_cli_plans_a_folder_once_for_every_rank(dataset, parts, tmp_path, monkeypatch, capsys):
    from vlm_pack.cli.main import main

    data = tmp_path / "train"
    dataset.save_to_disk(str(data))
    out = tmp_path / "train.plan"
    argv = ["plan", str(data), "--out", str(out), "--capacity", str(CAPACITY), "--world-size", "2",
            "--family", "qwen2_vl", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert f"{N} samples in" in printed.out and "x 2 rank(s)" in printed.out and "stand-in" in printed.err
    accum = tmp_path / "accum.plan"  # --grad-accum: each optimizer step's packs balanced across the ranks
    assert main([*argv[:3], str(accum), *argv[4:], "--grad-accum", "2"]) == 0
    assert Plan.load(accum).grad_accum == 2 and Plan.load(out).grad_accum == 1
    best_fit = tmp_path / "bfd.plan"  # --packs bfd: the best-fit packs as they are, a choice the key records
    assert main([*argv[:3], str(best_fit), *argv[4:], "--packs", "bfd"]) == 0
    keys = [Plan.load(p).key["packing"]["balance"]["packs"] for p in (out, best_fit)]
    assert keys == ["auto", "bfd"] and Plan.load(best_fit).digest != Plan.load(out).digest
    _no_forecast(monkeypatch)
    ranks = [_packed(str(data), parts, plan=out, rank=r) for r in (0, 1)]
    rows = [int(x) for ds in ranks for i in range(len(ds)) for x in ds.rows_of(ds.bin_of(i)[2])]
    assert sorted(rows) == list(range(N))
    assert plan_info(ranks[1][0])["rank"] == 1
