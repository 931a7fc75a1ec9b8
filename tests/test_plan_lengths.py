"""A plan from a lengths table (issue 34): ``vlm_pack.data.plan_from_lengths``, nothing forecast again.

Real parts: a ``datasets.Dataset`` with PNG bytes made by Pillow, the offline Qwen2-VL tokenizer and image
processor, the lengths table written to parquet and read back. Oracle: ``build_plan`` on the dataset itself
(forecast and plan in one call), and the dataset's rows (each once).
"""

from __future__ import annotations

import io
import math

import datasets
import numpy as np
import pytest
from PIL import Image

import vlm_pack.data as data
from vlm_pack.config import PackingConfig
from vlm_pack.data import build_plan, forecast_sources, plan_from_lengths, read_lengths, write_lengths
from vlm_pack.data.map_style import PackedMapDataset
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.packing import PackCost, StepBalance
from vlm_pack.preprocessor import Preprocessor

N = 40
CAPACITY = 256


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def dataset():
    images = [[_png((28 + 11 * (i % 9), 28 + 17 * (i % 4)), i)] * (i % 3 != 1) for i in range(N)]
    messages = [
        [{"role": "user", "content": [{"type": "image", "text": None}] * len(im) + [{"type": "text", "text": "q " * (1 + i % 5)}]},
         {"role": "assistant", "content": [{"type": "text", "text": "answer " * (1 + (5 * i) % 17)}]}]
        for i, im in enumerate(images)
    ]  # fmt: skip
    return datasets.Dataset.from_dict({"images": images, "messages": messages}).cast_column(
        "images", datasets.List(datasets.Image())
    )


@pytest.fixture(scope="module")
def pre():
    return Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))


@pytest.fixture(scope="module")
def lengths_file(dataset, pre, tmp_path_factory):
    table = forecast_sources(dataset, preprocessor=pre, progress=False)
    return write_lengths(table, tmp_path_factory.mktemp("lengths") / "train.lengths.parquet")


def _same_arrays(a, b) -> None:
    for name in ("rows", "lengths", "bin_ptr", "rank_bins"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_lengths_file_plans_as_build_plan_does_with_the_keyword_names(dataset, pre, lengths_file):
    cost = PackCost(hidden_size=1536, num_layers=28, intermediate_size=8960, kv_size=256)
    expected = build_plan(dataset, pre, capacity=CAPACITY, world_size=2, balance=StepBalance(grad_accum=2, cost=cost))
    plan = plan_from_lengths(
        lengths_file, capacity=CAPACITY, world_size=2, grad_accum=2, cost=cost, dataset=dataset, preprocessor=pre
    )
    _same_arrays(plan, expected)
    assert plan.key == expected.key and plan.digest == expected.digest and plan.cost == cost.to_dict()
    # optimizer steps, not micro-steps: grad-accum 2 halves them (a partial last step counted)
    assert plan.grad_accum == 2 and plan.steps == math.ceil(plan.micro_steps / 2) < plan.micro_steps
    assert sorted(plan.rows.tolist()) == list(range(N))
    # keyed by the dataset and its preprocessor: the dataset takes it as it is, nothing forecast
    ds = PackedMapDataset(dataset, pre, PackingConfig(capacity=CAPACITY), plan=plan, rank=0,
                          balance=StepBalance(grad_accum=2, cost=cost))  # fmt: skip
    assert ds.plan_digest == plan.digest and len(ds) == plan.micro_steps


def test_a_table_alone_plans_without_a_key(dataset, pre, lengths_file):
    table = read_lengths(lengths_file)
    alone = plan_from_lengths(table, PackingConfig(capacity=CAPACITY), world_size=2)
    keyed = build_plan(dataset, pre, capacity=CAPACITY, world_size=2)
    _same_arrays(alone, keyed)
    assert alone.key is None and alone.digest != keyed.digest and alone.cost["hidden_size"] == 3584
    assert alone.steps == alone.micro_steps  # grad_accum 1


def test_wrong_arguments_name_the_fix(dataset, pre, lengths_file):
    table = read_lengths(lengths_file)
    with pytest.raises(TypeError, match=r"grad_accum given with balance=: put them in the StepBalance"):
        plan_from_lengths(table, capacity=CAPACITY, balance=StepBalance(), grad_accum=2)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['capcity'\]"):
        plan_from_lengths(table, capcity=CAPACITY)
    with pytest.raises(TypeError, match="positional"):
        plan_from_lengths(table, PackingConfig(capacity=CAPACITY), 2)  # world_size only by name
    with pytest.raises(TypeError, match="dataset= and preprocessor= together"):
        plan_from_lengths(table, capacity=CAPACITY, dataset=dataset)
    with pytest.raises(ValueError, match=r"40 records, the dataset 10 rows"):
        plan_from_lengths(table, capacity=CAPACITY, dataset=dataset.select(range(10)), preprocessor=pre)


def test_the_lengths_route_is_public():
    assert {"plan_from_lengths", "read_lengths", "write_lengths", "build_plan", "Plan"} <= set(data.__all__)
