"""Systematic loss is loud: the failure budget's share of bad samples (``PackingConfig.max_bad_fraction``).

The issue's run, made here: LLaVA-Instruct JSON records whose photos (real JPEG / PNG / WebP through Pillow) lie
under another folder than the JSON, ``--image-root`` forgotten, a text-only row every 25 resetting the run of
consecutive failures. ``vlm-pack pack`` used to exit 0 having skipped 144 of 150 samples; ``build_plan`` used to
plan the 6 text-only rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from PIL import Image

from vlm_pack import PackingConfig, Preprocessor, forecast_sources
from vlm_pack.cli.main import main
from vlm_pack.data import build_plan
from vlm_pack.failures import MIN_SEEN_FOR_FRACTION, FailureBudget, FailureBudgetError
from vlm_pack.offline import build_tokenizer, image_processor

N, TEXT_EVERY = 150, 25  # 6 text-only rows, 144 with a photo


def _llava(root: Path) -> tuple[Path, Path]:
    """``root/data/llava.json`` (150 LLaVA records) and ``root/images`` (their photos): another folder."""
    images, data = root / "images", root / "data"
    images.mkdir(parents=True)
    data.mkdir()
    records = []
    for i in range(N):
        turns = [{"from": "human", "value": "Describe it."}, {"from": "gpt", "value": f"Sample {i}."}]
        if i % TEXT_EVERY:
            fmt, ext = [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")][i % 3]
            Image.effect_noise((40 + i % 30, 30 + i % 20), 40).convert("RGB").save(images / f"{i}.{ext}", fmt)
            turns[0]["value"] = "<image>\nDescribe it."
            records.append({"id": f"s{i}", "image": f"{i}.{ext}", "conversations": turns})
        else:
            records.append({"id": f"s{i}", "conversations": turns})
    path = data / "llava.json"
    path.write_text(json.dumps(records))
    return path, images


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> tuple[Path, Path]:
    return _llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))


def test_cli_pack_with_the_image_root_forgotten_exits_non_zero_and_says_the_fix_last(llava, tmp_path, capsys):
    json_path, images = llava
    argv = ["pack", str(json_path), "--family", "qwen2_vl", "--capacity", "4096", "--no-progress"]
    code = main([*argv, "--out", str(tmp_path / "plan.jsonl")])
    err = capsys.readouterr().err
    assert code == 1
    assert "max_bad_fraction=0.1" in err and "corrupt_image" in err
    last = err.strip().splitlines()[-1]
    assert last.strip().startswith("most common reason: corrupt_image") and "--image-root" in last
    assert not (tmp_path / "plan.jsonl").exists()  # no plan of 4% of the data

    # with the image root given, every sample is packed
    assert main([*argv, "--image-root", str(images), "--out", str(tmp_path / "good.jsonl")]) == 0
    capsys.readouterr()
    packed = [k for line in (tmp_path / "good.jsonl").read_text().splitlines() for k in json.loads(line)["keys"]]
    assert sorted(packed) == sorted(f"s{i}" for i in range(N))

    # the budget switched off: the run goes on, and every left-out sample is in the report
    assert main([*argv, "--max-bad-fraction", "none", "--out", str(tmp_path / "off.jsonl")]) == 0
    capsys.readouterr()
    meta = json.loads((tmp_path / "off.meta.json").read_text())
    assert len(meta["skipped"]) == N - N // TEXT_EVERY
    assert all("not found" in s["reason"] for s in meta["skipped"])


def test_python_raises_failure_budget_error_past_the_share(llava, pre):
    json_path, images = llava
    with pytest.raises(FailureBudgetError, match="max_bad_fraction") as raised:
        forecast_sources(str(json_path), preprocessor=pre, progress=False)
    assert str(raised.value).strip().splitlines()[-1].strip().startswith("most common reason: corrupt_image")

    records = json.loads(json_path.read_text())
    ds = datasets.Dataset.from_list([{**r, "image": r.get("image")} for r in records])
    with pytest.raises(FailureBudgetError, match="max_bad_fraction"):
        build_plan(ds, pre, capacity=4096, progress=False)
    # given the root, the plan holds every sample; without the budget, every skip is listed
    assert build_plan(ds, pre, capacity=4096, image_root=images, progress=False).num_samples == N
    with pytest.warns(UserWarning, match="left out of the plan"):
        plan = build_plan(ds, pre, PackingConfig(capacity=4096, max_bad_fraction=None), progress=False)
    assert plan.num_samples == N // TEXT_EVERY and len(plan.skipped) == N - N // TEXT_EVERY


def test_the_share_is_judged_only_once_enough_samples_were_seen():
    """A few bad samples first are no pattern: the share waits for MIN_SEEN_FOR_FRACTION samples, then judges
    every sample, and the run's end."""
    budget = FailureBudget(limit=None, what="stage", max_bad_fraction=0.1)
    for i in range(10):  # 10 bad in a row at the start: 100% of those seen, but only 10 seen
        budget.failure("corrupt_image", f"s{i}", "missing")
    for _ in range(MIN_SEEN_FOR_FRACTION - 10):
        budget.success()
    budget.finish()  # 10 of 100 = 10%: not more than the share
    with pytest.raises(FailureBudgetError, match="11 of 101 samples seen were bad") as raised:
        budget.failure("corrupt_image", "s100", "missing")
    assert "image_root" in str(raised.value).splitlines()[-1]


def test_the_share_counts_at_the_crossing_and_is_validated():
    budget = FailureBudget(limit=None, what="stage", max_bad_fraction=0.1)
    for i in range(20):
        budget.failure("decode_error", f"s{i}", "cut")
    for _ in range(MIN_SEEN_FOR_FRACTION - 21):
        budget.success()
    with pytest.raises(FailureBudgetError, match="20 of 100"):  # the 100th seen, good, ends the wait
        budget.success()
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="max_bad_fraction"):
            PackingConfig(capacity=64, max_bad_fraction=bad)
    assert PackingConfig(capacity=64, max_bad_fraction=None).max_bad_fraction is None
