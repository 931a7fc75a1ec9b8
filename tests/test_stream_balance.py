"""Step balancing of the streaming dataset by a look-ahead window (issue 26, ``vlm_pack.packing.window``).

The rule alone (pure functions), then real WebDataset shards written here, real images through Pillow, the
offline Qwen2-VL tokenizer and image processor: exactly once across ranks over an epoch, an exact mid-epoch
resume, and every rank emitting the pack of the same cost rank of its window at every micro-step.
"""

from __future__ import annotations

import io
import json
import random
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image

from vlm_pack.data import BadSampleWarning, PackedDataLoader, PackedWebDataset, stream_info, write_shards
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.packing import PackCost, step_imbalance
from vlm_pack.packing.window import StreamBalance, reserved_positions, window_order, window_schedule
from vlm_pack.preprocessor import Preprocessor

CAPACITY = 160
WORDS = "red dog sky the car two blue tree".split()


# -- the rule alone ---------------------------------------------------------------------------------------


def test_every_rank_emits_the_same_cost_rank_at_each_micro_step():
    rng = np.random.default_rng(0)
    world, window, windows = 8, 16, 12
    costs = rng.lognormal(0, 0.6, (world, window * windows))  # [ranks, packs], each rank's stream order
    orders = []
    for r in range(world):
        parts = []
        for w in range(windows):
            schedule = window_schedule(window, (0, w))
            part = costs[r, w * window : (w + 1) * window]
            order = window_order(part, schedule)
            assert sorted(order.tolist()) == list(range(window))  # a permutation of the window
            # position t emits the pack of cost rank schedule[t] (0: dearest) of this rank's window
            np.testing.assert_array_equal(part[order], np.sort(part)[::-1][schedule])
            parts.append(w * window + order)
        orders.append(np.concatenate(parts))
    flat = costs.reshape(-1)
    plain = np.stack([r * costs.shape[1] + np.arange(costs.shape[1]) for r in range(world)])
    ordered = np.stack([r * costs.shape[1] + o for r, o in enumerate(orders)])
    # the same quantile at each micro-step: ranks wait far less for the slowest
    assert step_imbalance(flat, ordered) < 0.8 * step_imbalance(flat, plain)
    # a fresh schedule per window (no length curriculum), the same for the same key on every rank
    assert not np.array_equal(window_schedule(window, (0, 0)), window_schedule(window, (0, 1)))
    np.testing.assert_array_equal(window_schedule(window, (0, 5)), window_schedule(window, (0, 5)))


def test_a_partial_window_follows_the_schedule_in_cost_order():
    schedule = np.array([5, 0, 3, 6, 1, 7, 2, 4])
    costs = np.array([1.0, 9.0, 4.0, 7.0])  # 4 packs of a window of 8: the schedule's first 4 ranks 5 0 3 6
    order = window_order(costs, schedule)
    # positions sorted by their target rank (1: 0, 2: 3, 0: 5, 3: 6) take the packs dearest first
    assert costs[order].tolist() == [4.0, 9.0, 7.0, 1.0]
    with pytest.raises(ValueError, match="at most W packs"):
        window_order(np.ones(9), schedule)


def test_reserved_positions_start_every_step_of_the_rank():
    assert reserved_positions(8, grad_accum=2).tolist() == [True, False] * 4
    assert reserved_positions(4, grad_accum=1).all()
    # 2 workers, grad_accum 4: the rank's micro-steps 0, 4, 8 ... all come from the stream in slot 0
    assert reserved_positions(6, 4, slot=0, num_workers=2).tolist() == [True, False] * 3
    assert not reserved_positions(6, 4, slot=1, num_workers=2).any()
    # 2 workers, grad_accum 1: every micro-step starts a step, in both slots
    assert reserved_positions(4, 1, slot=1, num_workers=2).all()


def test_image_packs_take_each_steps_first_micro_step_and_run_short_at_the_windows_end():
    schedule = window_schedule(8, (1, 0))
    reserved = reserved_positions(8, grad_accum=2)
    costs = np.array([3.0, 1.0, 8.0, 2.0, 5.0, 4.0, 7.0, 6.0])
    image = np.array([False, True, False, False, True, False, True, False])  # 3 image packs, 4 steps
    order = window_order(costs, schedule, has_image=image, reserved=reserved)
    assert sorted(order.tolist()) == list(range(8))
    # steps 0..2 start with an image pack; step 3 has none on this rank (it cannot hold with 3 for 4 steps)
    assert image[order].tolist()[::2] == [True, True, True, False]
    assert not image[order][1::2].any()
    # enough image packs: every step starts with one; the extra image packs go with the rest by cost rank
    image = np.array([True, True, False, True, True, False, True, False])
    order = window_order(costs, schedule, has_image=image, reserved=reserved)
    assert image[order][::2].all() and sorted(order.tolist()) == list(range(8))
    # the images placed at the reserved positions are spread over the image packs' cost ranks
    placed = sorted(costs[order][::2].tolist())
    assert placed[0] <= 2.0 and placed[-1] >= 6.0
    # without the rule (the positions of the plain quantile order), a step can start with a text-only pack
    plain = window_order(costs, schedule)
    assert not image[plain][::2].all()


def test_stream_balance_is_validated():
    assert StreamBalance(grad_accum=4, window_steps=8).window == 32
    with pytest.raises(ValueError, match="window_steps"):
        StreamBalance(window_steps=0)
    with pytest.raises(TypeError, match="cost must be"):
        StreamBalance(cost="flops")
    assert StreamBalance(cost=lambda lengths, patches: float(lengths.sum())).pack_cost([3, 4], []) == 7.0


# -- the streaming dataset ----------------------------------------------------------------------------------


def _png(width: int, height: int, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


def _corpus(root, images_per_sample: list[int], n: int = 72) -> dict:
    """``n`` samples in shards of 6: captions of 2..40 words, images (a count drawn from ``images_per_sample``)
    of 28..112 px (4..16 vision tokens)."""
    rng = random.Random(0)
    records = []
    for i in range(n):
        sizes = [(rng.choice([28, 56, 84, 112]), rng.choice([28, 56, 112])) for _ in range(rng.choice(images_per_sample))]
        caption = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        records.append({"key": f"k{i:03d}", "images": [_png(w, h, i) for w, h in sizes], "caption": caption})
    urls = write_shards(records, root / "shards", maxcount=6)
    return {"urls": urls, "keys": sorted(r["key"] for r in records)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("balance"), [0, 1, 1, 2])


@pytest.fixture(scope="module")
def text_heavy(tmp_path_factory):
    """Three samples in four without an image: many packs hold none."""
    return _corpus(tmp_path_factory.mktemp("text_heavy"), [0, 0, 0, 1], n=144)


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


BALANCE = StreamBalance(grad_accum=2, window_steps=2)


def _dataset(corpus, qwen, balance=BALANCE, **knobs) -> PackedWebDataset:
    tok, ip = qwen
    kwargs = dict(capacity=CAPACITY, shuffle_seed=3, shuffle_buffer=4, buffer_size=4, min_fill_ratio=0.9)
    return PackedWebDataset(corpus["urls"], Preprocessor(tok, ip), balance=balance, **{**kwargs, **knobs})


@contextmanager
def _rank(monkeypatch, rank: int, world: int):
    with monkeypatch.context() as patch:
        patch.setenv("RANK", str(rank))
        patch.setenv("WORLD_SIZE", str(world))
        yield


def _run(loader, stop: int | None = None) -> list:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        for batch in loader:
            out.append(batch)
            if stop is not None and len(out) == stop:
                break
    return out


def _keys(batches) -> list[str]:
    return [k for b in batches for k in b.metadata["__key__"]]


def _summary(batch) -> tuple:
    return stream_info(batch)["snapshot"].stream, tuple(batch.metadata["__key__"]), tuple(batch.seq_lens.tolist())


def _cost(batch) -> float:
    """The pack's cost as the stream computes it: forecast lengths (= processed here) and patches per image."""
    patches = [] if batch.image_grid_thw is None else batch.image_grid_thw.prod(-1).tolist()
    return PackCost()(batch.seq_lens.numpy(), np.asarray(patches, dtype=np.int64))


def test_exactly_once_across_ranks_over_an_epoch_with_balancing(corpus, qwen, monkeypatch):
    per_rank = []
    for rank in range(2):
        with _rank(monkeypatch, rank, 2):
            ds = _dataset(corpus, qwen)
            per_rank.append(_run(PackedDataLoader(ds, num_workers=2)))
            assert ds.stats.samples_packed == len(_keys(per_rank[-1]))
    keys = _keys(per_rank[0]) + _keys(per_rank[1])
    assert sorted(keys) == corpus["keys"]  # every sample once, none lost or repeated
    for batches in per_rank:
        assert all(int(b.seq_lens.sum()) <= CAPACITY for b in batches)
    # the windows reorder the packs: the same packs as without balancing, in another order
    with _rank(monkeypatch, 0, 2):
        plain = _run(PackedDataLoader(_dataset(corpus, qwen, balance=None), num_workers=2))
    assert sorted(map(_summary, plain)) == sorted(map(_summary, per_rank[0]))
    assert list(map(_summary, plain)) != list(map(_summary, per_rank[0]))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_resume_with_balancing_yields_exactly_the_remaining_packs(corpus, qwen, workers):
    ds = _dataset(corpus, qwen)
    loader = PackedDataLoader(ds, num_workers=workers)
    reference, states = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        for batch in loader:
            reference.append(_summary(batch))
            states.append(json.loads(json.dumps(loader.state_dict())))
    assert sorted(k for s in reference for k in s[1]) == corpus["keys"]
    mid_window = 0
    for k in (1, 2, 3, 5, len(reference) // 2, len(reference) - 1):
        mid_window += sum(s["scheduled"] > 0 for s in states[k - 1]["progress"]["streams"])
        resumed = _dataset(corpus, qwen)
        resumed.load_state_dict(states[k - 1])
        tail = [_summary(b) for b in _run(PackedDataLoader(resumed, num_workers=workers))]
        assert reference[:k] + tail == reference, k  # the same remaining packs, in the same order
        assert resumed.stats.samples_packed == len(corpus["keys"])
    assert mid_window > 0  # some cuts fell inside a window, whose rest the snapshot carried


def test_ranks_emit_the_same_cost_rank_of_their_windows_at_each_micro_step(corpus, qwen, monkeypatch):
    balance = StreamBalance(grad_accum=1, window_steps=4, image_every_rank=False)
    w = balance.window

    def ranks_of(batches) -> list[int]:
        """Cost rank (0: dearest) of each batch within its window of w consecutive batches."""
        out = []
        for start in range(0, len(batches) - len(batches) % w, w):
            costs = np.array([_cost(b) for b in batches[start : start + w]])
            out.extend(np.argsort(np.argsort(-costs, kind="stable"), kind="stable").tolist())
        return out

    def run(balance) -> list[list[int]]:
        out = []
        for rank in range(2):
            with _rank(monkeypatch, rank, 2):
                out.append(ranks_of(_run(PackedDataLoader(_dataset(corpus, qwen, balance=balance)))))
        steps = min(map(len, out))
        assert steps >= 2 * w  # at least two whole windows on both ranks
        return [r[:steps] for r in out]

    balanced = run(balance)
    assert balanced[0] == balanced[1]  # the same quantile on both ranks at every micro-step
    assert balanced[0][:w] == window_schedule(w, (0, 4, 0, 0, 0)).tolist()  # (seed, shuffle_seed + 1, epoch ...)
    plain = run(None)
    assert plain[0] != plain[1]  # without the look-ahead, the packs that meet are unrelated


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_every_step_of_a_rank_starts_with_an_image_pack_while_its_window_has_them(text_heavy, qwen, grad_accum):
    balance = StreamBalance(grad_accum=grad_accum, window_steps=2)
    batches = _run(PackedDataLoader(_dataset(text_heavy, qwen, balance=balance)))
    assert sorted(_keys(batches)) == text_heavy["keys"]
    has_image = [b.image_grid_thw is not None for b in batches]
    assert 0.2 < np.mean(has_image) < 0.8  # text-only packs are common: without the rule steps would lack one
    w = balance.window
    checked = 0
    for start in range(0, len(batches), w):
        window = has_image[start : start + w]
        firsts = window[::grad_accum]  # each step's first micro-step
        if sum(window) >= len(firsts):
            assert all(firsts), (start, window)
            checked += 1
        else:  # short of images: all of them start the first steps, the steps without one are the last
            assert firsts == sorted(firsts, reverse=True) and sum(firsts) == sum(window), (start, window)
    assert checked >= 1


def test_a_resume_on_another_layout_with_balancing_loses_and_repeats_nothing(corpus, qwen):
    loader = PackedDataLoader(_dataset(corpus, qwen), num_workers=2)
    head = _run(loader, stop=3)
    state = loader.state_dict()
    assert any(s["scheduled"] for s in state["progress"]["streams"])  # cut inside a window
    resumed = _dataset(corpus, qwen, balance=StreamBalance(grad_accum=4, window_steps=1))
    resumed.load_state_dict(state)
    tail = _run(PackedDataLoader(resumed, num_workers=0))  # re-dealt: the window's packs are read again
    assert sorted(_keys(head + tail)) == corpus["keys"]


def test_balancing_may_be_switched_off_and_on_again_across_resumes(corpus, qwen):
    loader = PackedDataLoader(_dataset(corpus, qwen))
    head = _run(loader, stop=1)
    assert any(s["scheduled"] for s in loader.state_dict()["progress"]["streams"])
    plain = _dataset(corpus, qwen, balance=None)  # the rest of the window leaves in its scheduled order
    plain.load_state_dict(loader.state_dict())
    loader = PackedDataLoader(plain)
    middle = _run(loader, stop=2)
    assert not any(s["scheduled"] for s in loader.state_dict()["progress"]["streams"])
    again = _dataset(corpus, qwen)
    again.load_state_dict(loader.state_dict())
    tail = _run(PackedDataLoader(again))
    assert sorted(_keys(head + middle + tail)) == corpus["keys"]
