"""Step plans (issue 26): every training step's packs cost about the same on every rank.

Real parts: a ``datasets.Dataset`` with PNG bytes made by Pillow, the offline Qwen2-VL tokenizer and image
processor, a tiny real Qwen2-VL from its transformers config. Oracles: the set of dataset rows (exactly once),
the uninterrupted epoch (a resume continues it), the plan's own step blocks (an epoch's shuffle keeps them),
and measured forward + backward time (the cost model's ranking).
"""

from __future__ import annotations

import io
import statistics
import time

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model
from vlm_pack.packing import PackCost, StepBalance, step_imbalance, step_plan
from vlm_pack.packing.steps import steps_short_of_images
from vlm_pack.preprocessor import Preprocessor

N = 48
CAPACITY = 192
WORLD, ACCUM = 2, 2


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _conversation(i: int, images: int) -> list[dict]:
    user = [{"type": "image", "text": None}] * images + [{"type": "text", "text": "question " * (1 + i % 4)}]
    answer = [{"type": "text", "text": "answer " * (1 + (7 * i) % 13)}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def dataset():
    images = [[_png((28 + 9 * (i % 8), 28 + 13 * (i % 5)), i)] * (i % 3 != 2) for i in range(N)]
    columns = {"images": images, "messages": [_conversation(i, len(im)) for i, im in enumerate(images)]}
    return datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image()))


@pytest.fixture(scope="module")
def parts():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


def _packed(dataset, parts, rank: int, **kwargs) -> PackedMapDataset:
    tok, ip = parts
    return PackedMapDataset(dataset, Preprocessor(tok, ip), capacity=CAPACITY, shuffle_seed=3, cache=None, world_size=WORLD, rank=rank, balance=StepBalance(grad_accum=ACCUM), **kwargs)  # fmt: skip


def _epoch(ds: PackedMapDataset, sampler: PackedSampler, stop: int | None = None) -> list[dict]:
    out = []
    for batch in torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler, num_workers=0):
        out.append(plan_info(sampler.observe(batch)))
        if stop is not None and len(out) == stop:
            break
    return out


def test_every_sample_once_across_ranks_and_after_a_mid_epoch_resume(dataset, parts):
    ranks = [_packed(dataset, parts, r) for r in range(WORLD)]
    plan = ranks[0].plan
    assert plan.grad_accum == ACCUM and ranks[0].steps >= 2 * ACCUM
    full = [_epoch(ds, PackedSampler(ds)) for ds in ranks]
    assert sorted(row for infos in full for info in infos for row in info["rows"]) == list(range(N))
    # the epoch's shuffle moves whole steps: the micro-steps of step g are one column block of the plan
    micro = plan.micro_steps
    assert plan.steps == -(-micro // ACCUM)  # optimizer steps, a partial last one counted
    blocks = {tuple(plan.rank_bins[:, g : g + ACCUM].ravel()) for g in range(0, micro, ACCUM)}
    for g in range(0, micro, ACCUM):
        cells = tuple(full[r][s]["bin"] for r in range(WORLD) for s in range(g, min(g + ACCUM, micro)))
        assert cells in blocks
    for rank, ds in enumerate(ranks):
        sampler = PackedSampler(ds)
        sampler.set_epoch(0)
        first = _epoch(ds, sampler, stop=3)
        state = sampler.state_dict()
        again = _packed(dataset, parts, rank)  # a new process: the same plan, rebuilt
        resumed = PackedSampler(again)
        resumed.load_state_dict(state)
        rest = _epoch(again, resumed)
        assert [i["bin"] for i in first + rest] == [i["bin"] for i in full[rank]]
        assert [i["rows"] for i in first + rest] == [i["rows"] for i in full[rank]]
    # another epoch: other steps first, every sample still once
    for ds in ranks:
        ds.set_epoch(1)
    assert [ranks[0].bin_of(i, 1)[2] for i in range(len(ranks[0]))] != [i["bin"] for i in full[0]]
    rows = [int(r) for ds in ranks for i in range(len(ds)) for r in ds.rows_of(ds.bin_of(i, 1)[2])]
    assert sorted(rows) == list(range(N))


def test_step_plan_deals_each_pack_once_deterministically_and_shuffled():
    rng = np.random.default_rng(0)
    costs = rng.lognormal(0, 0.5, 64 * 12)
    plans = [step_plan(costs, 64, 3, seed=s) for s in (0, 0, 1)]
    assert plans[0].shape == (64, 12) and sorted(plans[0].ravel().tolist()) == list(range(costs.size))
    assert np.array_equal(plans[0], plans[1]) and not np.array_equal(plans[0], plans[2])
    # no curriculum: the steps' costs are not in order
    totals = costs[plans[0]].sum(axis=0).reshape(4, 3).sum(axis=1)
    assert not (np.all(np.diff(totals) <= 0) or np.all(np.diff(totals) >= 0))
    costs = rng.lognormal(0, 0.5, 8 * 4 * 40)
    plan = step_plan(costs, 8, 4)
    epoch = plan.ravel()[rng.permutation(costs.size)].reshape(8, -1)  # packs meeting at a step unrelated
    assert step_imbalance(costs, plan, 4) < 1.02 < 1.1 < step_imbalance(costs, epoch, 4)


@pytest.mark.parametrize("world, accum", [(4, 1), (4, 3), (8, 2)])
def test_every_rank_gets_an_image_pack_where_the_step_has_enough(world, accum):
    rng = np.random.default_rng(world * 10 + accum)
    n = world * accum * 9
    for share in (0.2, 0.5, 0.9):
        has_image = rng.random(n) < share
        costs = rng.lognormal(0, 0.6, n) + has_image  # image packs dearer: they would bunch by cost
        plan = step_plan(costs, world, accum, has_image=has_image, seed=1)
        per_step = has_image[plan].reshape(world, -1, accum).sum(axis=2)  # [W, steps] image packs
        enough = per_step.sum(axis=0) >= world
        assert (per_step[:, enough] >= 1).all()
        short = steps_short_of_images(has_image, plan, accum)
        assert short["avoidable"] == 0 and short["mixed"] <= 1  # image packs fill whole steps
        assert short["steps"] == n // (world * accum)
        # image packs spread over the steps: with world_size of them per step, no step goes without
        # (every step without one would fail DDP's unused-parameter check on every rank)
        images, steps = int(has_image.sum()), short["steps"]
        image_steps = max(min(steps, images // world), -(-images // (world * accum)))  # >= world each, or all
        assert short["text_only"] == steps - image_steps


def test_cost_model_reads_widths_depths_and_windows_from_configs():
    from vlm_pack.offline import tiny_model_config

    qwen = PackCost.from_config(tiny_model_config("qwen2_vl", hidden_size=64, num_layers=3))
    assert (qwen.hidden_size, qwen.num_layers, qwen.vision_hidden_size, qwen.vision_window) == (64, 3, 32, None)
    windowed = PackCost.from_config(tiny_model_config("qwen2_5_vl", vision_layers=4))
    assert windowed.vision_window == 64 and windowed.vision_full_layers == 1 and windowed.vision_layers == 4
    big = np.array([4096])
    assert windowed(big * 0 + 100, big) < PackCost.from_config(tiny_model_config("qwen2_vl", vision_layers=4))(
        big * 0 + 100, big
    )  # window attention: a large image costs less than under full attention
    llava = PackCost.from_config(tiny_model_config("llava"))
    assert llava.vision_layers == 2 and llava.vision_hidden_size == 32


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.mark.slow
def test_cost_ranking_agrees_with_measured_forward_backward_time():
    from vlm_pack.forward.attention import use_varlen_attention

    tok, ip = build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")
    pre = Preprocessor(tok, ip)
    model = use_varlen_attention(
        tiny_model("qwen2_vl", hidden_size=128, num_layers=2, vision_hidden_size=32, vision_layers=1)
    ).train()
    cost = PackCost.from_config(model.config)
    # packs spanning small to large in both text and images
    shapes = [(1, 0, 0), (2, 1, 56), (3, 1, 84), (5, 2, 112), (7, 2, 140), (9, 3, 168), (12, 3, 224)]
    predicted, packs = [], []
    for n_samples, n_images, side in shapes:
        samples = []
        for i in range(n_samples):
            images = [Image.effect_noise((side, side), 40 + i).convert("RGB")] * (i < n_images)
            samples.append(pre.process(images, _conversation(i, len(images))))
        lengths = np.array([int(s["input_ids"].shape[0]) for s in samples])
        capacity = -(-int(lengths.sum()) // 8) * 8  # no padding: the row is the samples
        inputs = pre.collator(capacity, model_config=model.config)(samples).model_inputs("sdpa")
        grid = inputs.get("image_grid_thw")
        patches = grid.prod(-1).numpy() if grid is not None else np.zeros(0, np.int64)
        predicted.append(cost(lengths, patches))
        packs.append(inputs)

    def step(inputs) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(**inputs).loss.backward()
        return time.perf_counter() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: steadier timings on a shared machine
    try:
        for inputs in packs:
            step(inputs)  # warm-up
        # rounds over all packs, so that load from other processes falls on every pack alike
        times = [[step(inputs) for inputs in packs] for _ in range(5)]
    finally:
        torch.set_num_threads(threads)
    measured = [statistics.median(t) for t in zip(*times)]
    rho = _spearman(predicted, measured)
    assert rho >= 0.9, (rho, predicted, measured)
