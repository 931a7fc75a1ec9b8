"""Tests for vlm_pack.packing: exactness against plain reference packers, budgets, no sample lost,
resumable streaming, DP balancing, and error messages."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlm_pack.packing import (
    PackedBin,
    PackResult,
    StreamPacker,
    Unpacked,
    balance_bins,
    bin_costs,
    pack,
    padded_lengths,
    partition_imbalance,
)
from vlm_pack.packing.histogram import _bfd_histogram

settings.register_profile(
    "packing", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
FAST = settings.get_profile("packing")


# ----------------------------------------------------------------------------- plain references
# O(n * bins) Python, written from the definitions in the module docstring.


def ref_pack(lengths, capacity, strategy, vision=None, vcap=None, max_n=None):
    n = len(lengths)
    vis = vision if vision is not None else [0] * n
    vcap = vcap if vcap is not None else math.inf
    max_n = max_n if max_n is not None else math.inf
    if strategy in ("bfd", "ffd"):
        order = sorted(range(n), key=lambda i: (-lengths[i], -vis[i], i))
    else:
        order = list(range(n))
    free, vfree, bins, mtime = [], [], [], []
    for t, i in enumerate(order):
        L, v = lengths[i], vis[i]

        def fits(b, L=L, v=v):
            return free[b] >= L and vfree[b] >= v and len(bins[b]) < max_n

        if strategy == "nf":
            cands = [len(bins) - 1] if bins and fits(len(bins) - 1) else []
        else:
            cands = [b for b in range(len(bins)) if fits(b)]
        if not cands:
            free.append(capacity)
            vfree.append(vcap)
            bins.append([])
            mtime.append(-1)
            b = len(bins) - 1
        elif strategy == "bfd":
            b = min(cands, key=lambda b: (free[b], -mtime[b]))
        else:
            b = cands[0]
        free[b] -= L
        vfree[b] -= v
        bins[b].append(i)
        mtime[b] = t
    return bins


def ref_stream(samples, capacity, buffer_size, min_fill_ratio, max_n=None, vcap=None):
    """Reference streaming packer: lists scanned linearly, same rules as StreamPacker."""
    thr = math.ceil(round(min_fill_ratio * capacity, 9))
    max_n = max_n or math.inf
    vcap = vcap if vcap is not None else math.inf
    open_bins = []  # dicts: keys, lengths, total, vtotal, mtime
    out = []
    for clock, (key, L, v) in enumerate(samples, start=1):
        cands = [b for b in open_bins if capacity - b["total"] >= L and b["vtotal"] + v <= vcap]
        if cands:
            b = min(cands, key=lambda b: (capacity - b["total"], -b["mtime"]))
            open_bins.remove(b)
        else:
            if thr <= L or max_n == 1 or capacity == L:
                out.append([key])
                continue
            if len(open_bins) >= buffer_size:
                full = min(open_bins, key=lambda b: (capacity - b["total"], -b["mtime"]))
                open_bins.remove(full)
                out.append(full["keys"])
            b = {"keys": [], "total": 0, "vtotal": 0}
        b["keys"].append(key)
        b["total"] += L
        b["vtotal"] += v
        b["mtime"] = clock
        if b["total"] >= thr or b["total"] == capacity or len(b["keys"]) >= max_n:
            out.append(b["keys"])
        else:
            open_bins.append(b)
    open_bins.sort(key=lambda b: (capacity - b["total"], -b["mtime"]))
    out.extend(b["keys"] for b in open_bins)
    return out


def check_invariants(res: PackResult, n, capacity, vision=None, vcap=None, max_n=None):
    """Every sample in exactly one bin or unpacked; no budget exceeded; arrays consistent."""
    packed = res.order.tolist()
    unpacked = [u.index for u in res.unpacked]
    assert sorted(packed + unpacked) == list(range(n))
    assert res.bin_offsets[0] == 0 and res.bin_offsets[-1] == len(packed)
    assert (np.diff(res.bin_offsets) > 0).all()
    for b, idx in enumerate(res.bins):
        assert res.lengths[idx].sum() == res.bin_lengths[b] <= capacity
        if vision is not None:
            assert np.asarray(vision)[idx].sum() == res.bin_vision[b] <= vcap
        if max_n is not None:
            assert len(idx) <= max_n
        assert res.bin(b).tolist() == idx
    assert res.num_bins >= res.lower_bound
    if res.num_bins:
        assert res.efficiency == pytest.approx(res.bin_lengths.sum() / (res.num_bins * capacity))


lengths_st = st.lists(st.integers(1, 64), min_size=0, max_size=60)


# ----------------------------------------------------------------------------- offline pack


def test_docstring_example():
    res = pack([900, 700, 500, 400, 300, 120, 60], 1024)
    assert res.order.tolist() == [0, 6, 1, 4, 2, 3, 5]
    assert res.bin_offsets.tolist() == [0, 2, 4, 7]
    assert res.bin_lengths.tolist() == [960, 1000, 1020]
    assert res.lower_bound == 3 and res.efficiency == pytest.approx(2980 / 3072)
    assert res.sample_bin.tolist() == [0, 1, 2, 2, 1, 2, 0]


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "ff", "nf"])
@FAST
@given(lengths=lengths_st, capacity=st.integers(1, 96), data=st.data())
@pytest.mark.slow
def test_matches_reference_unconstrained(strategy, lengths, capacity, data):
    lengths = [min(x, capacity) for x in lengths]
    res = pack(lengths, capacity, strategy=strategy)
    assert res.bins == ref_pack(lengths, capacity, strategy)
    check_invariants(res, len(lengths), capacity)


@FAST
@given(
    n=st.integers(0, 3000),
    capacity=st.sampled_from([7, 64, 100, 1000, 4096]),
    seed=st.integers(0, 2**32 - 1),
)
@pytest.mark.slow
def test_bfd_histogram_matches_reference_many_duplicates(n, capacity, seed):
    # many equal lengths and equal free spaces: exercises whole-bucket moves and the tie-break
    rng = np.random.default_rng(seed)
    hi = int(rng.integers(1, capacity + 1))
    lengths = rng.integers(1, hi + 1, n).tolist()
    res = pack(lengths, capacity)
    if n <= 400:
        assert res.bins == ref_pack(lengths, capacity, "bfd")
    check_invariants(res, n, capacity)


@FAST
@given(
    n=st.integers(0, 2000),
    capacity=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_bfd_both_stack_representations_agree(n, capacity, seed):
    # pack() picks lists of bin ids (spread-out lengths) or range runs (many items per length);
    # both must produce the same bins on any input
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, int(rng.integers(1, capacity + 1)) + 1, n)
    distinct, counts = np.unique(lengths, return_counts=True)
    a, na = _bfd_histogram(distinct[::-1], counts[::-1], capacity, ranges=False)
    b, nb = _bfd_histogram(distinct[::-1], counts[::-1], capacity, ranges=True)
    assert na == nb and a.tolist() == b.tolist()


@pytest.mark.parametrize("strategy", ["bfd", "ffd"])
@pytest.mark.parametrize(
    ("dist", "capacity"), [("uniform", 2048), ("lognormal", 8192), ("vlm", 16384), ("tiny", 64)]
)
@pytest.mark.slow
def test_histogram_paths_equal_one_item_at_a_time(strategy, dist, capacity):
    # the whole-length-at-a-time cores against the independent per-item cores (a samples-per-bin
    # cap of n takes that path and never binds, since no bin can hold all n samples here)
    rng = np.random.default_rng(11)
    n = 30_000
    if dist == "uniform":
        lengths = rng.integers(1, capacity + 1, n)
    elif dist == "lognormal":
        lengths = np.clip(rng.lognormal(np.log(600), 0.8, n).astype(np.int64), 1, capacity)
    elif dist == "vlm":
        images = rng.integers(64, 1281, (n, 3)) * (np.arange(3) < rng.integers(0, 4, n)[:, None])
        lengths = rng.integers(50, 1501, n) + images.sum(1)
    else:
        lengths = rng.integers(1, 9, n)
    fast = pack(lengths, capacity, strategy=strategy)
    slow = pack(lengths, capacity, strategy=strategy, max_samples_per_bin=n)
    assert np.array_equal(fast.order, slow.order) and np.array_equal(fast.bin_offsets, slow.bin_offsets)
    assert np.array_equal(fast.bin_lengths, slow.bin_lengths)


def test_bfd_large_matches_reference_bin_count_and_bins():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 0.9, 1500).astype(np.int64), 1, 2048)
    res = pack(lengths, 2048)
    assert res.bins == ref_pack(lengths.tolist(), 2048, "bfd")


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "ff", "nf"])
@FAST
@given(
    items=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 6)), max_size=40),
    capacity=st.integers(40, 90),
    vcap=st.integers(6, 12),
    max_n=st.one_of(st.none(), st.integers(1, 5)),
)
@pytest.mark.slow
def test_matches_reference_with_vision_and_max_samples(strategy, items, capacity, vcap, max_n):
    lengths = [a for a, _ in items]
    vision = [b for _, b in items]
    res = pack(
        lengths, capacity, strategy=strategy, vision=vision, vision_capacity=vcap, max_samples_per_bin=max_n
    )
    assert res.bins == ref_pack(lengths, capacity, strategy, vision, vcap, max_n)
    check_invariants(res, len(lengths), capacity, vision, vcap, max_n)


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "ff", "nf"])
@FAST
@given(lengths=lengths_st, max_n=st.integers(1, 4))
@pytest.mark.slow
def test_max_samples_only(strategy, lengths, max_n):
    res = pack(lengths, 64, strategy=strategy, max_samples_per_bin=max_n)
    assert res.bins == ref_pack(lengths, 64, strategy, max_n=max_n)
    check_invariants(res, len(lengths), 64, max_n=max_n)


@FAST
@given(
    lengths=st.lists(st.integers(1, 200), max_size=50),
    vision=st.data(),
    policy=st.sampled_from(["truncate", "skip"]),
)
@pytest.mark.slow
def test_oversized_policies_lose_nothing(lengths, vision, policy):
    v = vision.draw(st.lists(st.integers(0, 30), min_size=len(lengths), max_size=len(lengths)))
    res = pack(lengths, 100, vision=v, vision_capacity=20, oversized=policy)
    check_invariants(res, len(lengths), 100, v, 20)
    skipped = {u.index: u.reason for u in res.unpacked}
    for i, (L, c) in enumerate(zip(lengths, v)):
        if c > 20:
            assert i in skipped and "vision cost" in skipped[i]
        elif L > 100:
            if policy == "skip":
                assert i in skipped and f"length {L} > capacity 100" in skipped[i]
            else:
                assert res.truncated[i] == L and res.lengths[i] == 100 and i not in skipped
        else:
            assert i not in skipped and i not in res.truncated and res.lengths[i] == L


def test_seed_shuffles_bins_deterministically():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 500, 2000)
    base = pack(lengths, 512)
    a = pack(lengths, 512, shuffle_seed=7)
    b = pack(lengths, 512, shuffle_seed=7)
    c = pack(lengths, 512, shuffle_seed=8)
    assert a.bins == b.bins and a.order.tolist() == b.order.tolist()
    assert a.bins != base.bins and a.bins != c.bins
    assert sorted(map(tuple, a.bins)) == sorted(map(tuple, base.bins))
    # deterministic across calls and input containers
    assert pack(lengths.tolist(), 512).bins == base.bins
    assert pack(lengths.astype(np.int32), 512).bins == base.bins
    torch = pytest.importorskip("torch")
    assert pack(torch.as_tensor(lengths), 512).bins == base.bins


@pytest.mark.slow
def test_large_capacity_path_and_many_bins():
    # capacity >= 2**16 (no uint16 sort) and more than 2**16 bins (two-pass id sort)
    rng = np.random.default_rng(3)
    big = rng.integers(1, 200_000, 500)
    res = pack(big, 200_000)
    assert res.bins == ref_pack(big.tolist(), 200_000, "bfd")
    many = rng.integers(60, 101, 140_000)
    res = pack(many, 100)
    assert res.num_bins > 1 << 16
    check_invariants(res, many.size, 100)
    # two items of 60..100 never share a bin of 100
    assert res.num_bins == many.size


def test_huge_capacity_needs_no_capacity_sized_arrays():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 2**40, 300)
    res = pack(lengths, 2**41)
    assert res.bins == ref_pack(lengths.tolist(), 2**41, "bfd")
    with pytest.raises(ValueError, match="too large for best fit with a vision budget"):
        pack(lengths, 2**41, vision=np.ones(300, dtype=int), vision_capacity=8)
    res = pack(lengths, 2**41, strategy="ffd", vision=np.ones(300, dtype=int), vision_capacity=8)
    assert res.bins == ref_pack(lengths.tolist(), 2**41, "ffd", [1] * 300, 8)


def test_empty_and_single():
    res = pack([], 10)
    assert res.num_bins == 0 and res.bins == [] and res.efficiency == 0.0 and res.lower_bound == 0
    res = pack([10], 10)
    assert res.bins == [[0]] and res.efficiency == 1.0
    res = pack([11], 10, oversized="skip")
    assert res.num_bins == 0 and res.unpacked == [Unpacked(0, "length 11 > capacity 10")]


def test_lazy_bins_and_repr():
    res = pack(np.full(100_000, 3), 10)
    assert res._bins is None  # nothing materialised by pack()
    assert res.num_bins == 33_334 and res.bin(0).tolist() == [0, 1, 2] and res.bin(-1).tolist() == [99_999]
    assert "num_bins=33334" in repr(res)
    with pytest.raises(IndexError):
        res.bin(33_334)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("lengths", "exc", "pattern"),
    [
        ([3, 0, 2], ValueError, r"lengths\[1\] = 0 is zero.*sample 1"),
        ([3, -4], ValueError, r"lengths\[1\] = -4 is negative"),
        ([3.0, 2.5], ValueError, r"lengths\[1\] = 2.5 is not an integer"),
        ([3.0, float("nan")], ValueError, r"lengths\[1\] = nan"),
        ([3.0, 4.0], TypeError, r"float dtype.*np.asarray"),
        ([3, "7"], TypeError, r"lengths\[0\].*not an integer"),
        ([3, None], TypeError, r"lengths\[1\] = None"),
        (np.array([True, True]), TypeError, r"lengths\[0\] = True"),
        ([[1, 2], [3, 4]], ValueError, r"1-D"),
    ],
)
def test_bad_lengths_name_the_sample(lengths, exc, pattern):
    with pytest.raises(exc, match=pattern):
        pack(lengths, 10)


def test_oversized_raise_names_sample_and_fix():
    with pytest.raises(
        ValueError, match=r"sample 2 has expanded length 12 > capacity 10.*at least 12.*'truncate'.*'skip'"
    ):
        pack([3, 4, 12, 13], 10)
    with pytest.raises(
        ValueError, match=r"sample 1 has vision cost 9 > vision_capacity 8.*cannot be truncated"
    ):
        pack([3, 4], 10, vision=[1, 9], vision_capacity=8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy"):
        pack([1], 10, strategy="best")
    with pytest.raises(ValueError, match="oversized"):
        pack([1], 10, oversized="clip")
    with pytest.raises(ValueError, match="capacity"):
        pack([1], 0)
    with pytest.raises(ValueError, match="vision_capacity is None"):
        pack([1], 10, vision=[1])
    with pytest.raises(ValueError, match="vision is None"):
        pack([1], 10, vision_capacity=3)
    with pytest.raises(ValueError, match="2 entries but lengths has 1"):
        pack([1], 10, vision=[1, 2], vision_capacity=3)
    with pytest.raises(ValueError, match=r"vision\[0\] = -1 is negative"):
        pack([1], 10, vision=[-1], vision_capacity=3)
    with pytest.raises(ValueError, match="max_samples_per_bin"):
        pack([1], 10, max_samples_per_bin=0)


# ----------------------------------------------------------------------------- streaming


def run_stream(samples, capacity, buffer_size, ratio, **kw):
    sp = StreamPacker(capacity, buffer_size=buffer_size, min_fill_ratio=ratio, **kw)
    bins = []
    for key, L, v in samples:
        bins += [b.keys for b in sp.add(key, L, v)]
    bins += [b.keys for b in sp.flush()]
    return sp, bins


stream_st = st.lists(st.tuples(st.integers(1, 64), st.integers(0, 4)), max_size=120)


@FAST
@given(
    items=stream_st,
    buffer_size=st.integers(1, 6),
    ratio=st.sampled_from([0.5, 0.7, 0.9, 1.0]),
    max_n=st.one_of(st.none(), st.integers(1, 4)),
    use_vision=st.booleans(),
)
@pytest.mark.slow
def test_stream_matches_reference_and_loses_nothing(items, buffer_size, ratio, max_n, use_vision):
    vcap = 6 if use_vision else None
    samples = [(i, L, v if use_vision else 0) for i, (L, v) in enumerate(items)]
    sp, bins = run_stream(samples, 64, buffer_size, ratio, max_samples_per_bin=max_n, vision_capacity=vcap)
    assert bins == ref_stream(samples, 64, buffer_size, ratio, max_n, vcap)
    assert sorted(k for b in bins for k in b) == list(range(len(samples)))
    assert sp.stats.samples_emitted == len(samples) == sp.stats.samples_seen
    lens = {k: L for k, L, _ in samples}
    for b in bins:
        assert sum(lens[k] for k in b) <= 64
        if max_n:
            assert len(b) <= max_n


@FAST
@given(
    items=stream_st,
    cut=st.integers(0, 120),
    buffer_size=st.integers(1, 5),
    ratio=st.sampled_from([0.6, 0.8, 1.0]),
    drop_last=st.booleans(),
    use_vision=st.booleans(),
)
def test_stream_resume_from_any_state_is_exact(items, cut, buffer_size, ratio, drop_last, use_vision):
    vcap = 5 if use_vision else None
    samples = [(f"s{i}", L, v if use_vision else 0) for i, (L, v) in enumerate(items)]
    samples += [("long", 200, 0)]  # exercises oversized="truncate" and its report across resume
    kw = dict(drop_last=drop_last, vision_capacity=vcap, oversized="truncate")
    sp_full, full = run_stream(samples, 70, buffer_size, ratio, **kw)
    cut = min(cut, len(samples))
    sp = StreamPacker(70, buffer_size=buffer_size, min_fill_ratio=ratio, **kw)
    before = []
    for key, L, v in samples[:cut]:
        before += [b.keys for b in sp.add(key, L, v)]
    state = json.loads(json.dumps(sp.state_dict()))
    sp2 = StreamPacker(70, buffer_size=buffer_size, min_fill_ratio=ratio, **kw)
    sp2.load_state_dict(state)
    after = []
    for key, L, v in samples[cut:]:
        after += [b.keys for b in sp2.add(key, L, v)]
    after += [b.keys for b in sp2.flush()]
    assert before + after == full
    assert sp2.state_dict() == sp_full.state_dict()
    assert sp2.stats.truncated == [("long", 200)]
    st_ = sp2.stats
    assert st_.samples_seen == st_.samples_emitted + st_.samples_dropped == len(samples)
    if drop_last:
        assert all(b.total < math.ceil(ratio * 70) for b in sp2.dropped)


def test_stream_example_and_stats():
    sp = StreamPacker(1024, min_fill_ratio=0.7)  # emit at >= 717 tokens
    assert sp.add("a", 700) == []
    assert sp.add("b", 500) == []
    out = sp.add("c", 300)
    assert [(b.keys, b.total) for b in out] == [(["a", "c"], 1000)]
    assert [b.keys for b in sp.add("d", 900)] == [["d"]]
    assert sp.num_open == 1
    rest = sp.flush()
    assert [b.keys for b in rest] == [["b"]]
    s = sp.stats
    assert (s.samples_seen, s.samples_emitted, s.bins_emitted, s.tokens_emitted) == (4, 4, 3, 2400)
    assert s.fill_ratio == pytest.approx(2400 / (3 * 1024))


def test_stream_buffer_full_emits_fullest_and_memory_is_bounded():
    sp = StreamPacker(100, buffer_size=3, min_fill_ratio=1.0)
    out = []
    for i, L in enumerate([60, 55, 50, 58]):  # no two fit together
        out += sp.add(i, L)
        assert sp.num_open <= 3
    assert [b.keys for b in out] == [[0]]  # 60 was the fullest when the 4th bin was needed
    rng = np.random.default_rng(0)
    sp = StreamPacker(4096, buffer_size=16)
    for i, L in enumerate(rng.integers(1, 4097, 5000).tolist()):
        sp.add(i, L)
        assert sp.num_open <= 16


def test_stream_drop_last_reports_dropped():
    sp = StreamPacker(100, min_fill_ratio=0.8, drop_last=True)
    sp.add_many(["a", "b", "c"], [90, 30, 20])
    out = sp.flush()
    assert out == [] and [b.keys for b in sp.dropped] == [["b", "c"]]
    assert (sp.stats.bins_dropped, sp.stats.samples_dropped, sp.stats.tokens_dropped) == (1, 2, 50)
    assert sp.stats.samples_emitted + sp.stats.samples_dropped == sp.stats.samples_seen == 3


def test_stream_add_many_equals_add():
    rng = np.random.default_rng(5)
    L = rng.integers(1, 300, 3000)
    a = StreamPacker(512, buffer_size=8)
    got = a.add_many(range(L.size), L) + a.flush()
    b = StreamPacker(512, buffer_size=8)
    want = [x for i, n in enumerate(L.tolist()) for x in b.add(i, n)] + b.flush()
    assert [x.keys for x in got] == [x.keys for x in want]
    assert a.state_dict() == b.state_dict()
    vis = rng.integers(0, 3, L.size)
    c = StreamPacker(512, buffer_size=8, vision_capacity=4)
    got = c.add_many(range(L.size), L, vis) + c.flush()
    assert all(x.vision_total <= 4 for x in got)
    assert sorted(k for x in got for k in x.keys) == list(range(L.size))


def test_stream_bad_sample_mid_batch_keeps_state_consistent():
    good = StreamPacker(100)
    ref = good.add_many(["a", "b"], [60, 30])
    sp = StreamPacker(100)
    with pytest.raises(ValueError, match=r"sample 'c'.*length 0 is zero"):
        sp.add_many(["a", "b", "c", "d"], [60, 30, 0, 20])
    assert sp.state_dict() == good.state_dict() and ref == []
    assert sp.stats.samples_seen == 2
    assert [(b.keys, b.total) for b in sp.open_bins()] == [(["a", "b"], 90)]
    skip = StreamPacker(100, oversized="skip")
    out = skip.add_many(["a", "b", "c"], np.array([60, 130, 40])) + skip.flush()
    assert [b.keys for b in out] == [["a", "c"]]
    st_ = skip.stats
    assert (
        st_.samples_seen == 3
        and st_.samples_emitted == 2
        and st_.skipped == [Unpacked("b", "length 130 > capacity 100")]
    )


def test_stream_errors_name_the_key():
    sp = StreamPacker(100)
    with pytest.raises(ValueError, match=r"sample 'img7'.*length 0 is zero"):
        sp.add("img7", 0)
    with pytest.raises(TypeError, match=r"sample 'x'.*2.5"):
        sp.add("x", 2.5)
    with pytest.raises(TypeError, match=r"sample 'b'.*True \(bool\)"):  # a bool is a bug, not one token
        sp.add("b", True)
    with pytest.raises(ValueError, match=r"sample 'v'.*vision cost -1 is negative"):
        StreamPacker(100, vision_capacity=8).add("v", 5, vision=-1)
    with pytest.raises(ValueError, match=r"sample 'y' has expanded length 101 > capacity 100.*'truncate'"):
        sp.add("y", 101)
    with pytest.raises(ValueError, match="no vision_capacity"):
        sp.add("z", 5, vision=3)
    with pytest.raises(ValueError, match=r"sample 'z' has vision cost 9 > vision_capacity 8"):
        StreamPacker(100, vision_capacity=8).add("z", 5, vision=9)
    sk = StreamPacker(100, oversized="skip", vision_capacity=8)
    sk.add("y", 101)
    sk.add("z", 5, vision=9)
    assert [u.index for u in sk.stats.skipped] == ["y", "z"]
    with pytest.raises(ValueError, match="different configuration"):
        StreamPacker(200).load_state_dict(sp.state_dict())
    with pytest.raises(ValueError, match="min_fill_ratio"):
        StreamPacker(100, min_fill_ratio=0.0)


# ----------------------------------------------------------------------------- balancing


def test_bin_costs_formula():
    c = bin_costs([[3, 4], [5]], hidden_size=1)
    assert c.tolist() == [9 + 16 + 6 * 7, 25 + 6 * 5]
    assert bin_costs([7, 5], cost="tokens").tolist() == [7, 5]
    v = bin_costs([[1], [1]], cost="tokens", vision=[[2, 3], []], vision_weight=2.0)
    assert v.tolist() == [1 + 2 * 5, 1]
    va = bin_costs([[1], [1]], hidden_size=10, vision=[[2, 3], 4], vision_hidden_size=5)
    w = 5 / 10
    assert va.tolist() == pytest.approx([1 + 60 + w * (4 + 9 + 30 * 5), 1 + 60 + w * (16 + 30 * 4)])
    res = pack([900, 700, 500, 400, 300, 120, 60], 1024)
    assert bin_costs(res, cost="tokens").tolist() == [960, 1000, 1020]
    assert bin_costs([[2, 2]], cost=lambda x: float(x.prod())).tolist() == [4.0]


def test_balance_attention_differs_from_tokens():
    # same tokens per bin, very different attention work: one 8192 sequence vs 8 x 1024
    bins = [[8192], [1024] * 8, [8192], [1024] * 8]
    parts = balance_bins(bins, 2)
    assert sorted(map(sorted, parts)) == [[0, 1], [2, 3]] or sorted(map(sorted, parts)) == [[0, 3], [1, 2]]
    costs = bin_costs(bins)
    assert partition_imbalance(costs, parts) == pytest.approx(1.0)


@FAST
@given(
    costs=st.lists(st.lists(st.integers(1, 4000), min_size=1, max_size=4), min_size=0, max_size=40),
    k=st.integers(1, 6),
    equal=st.booleans(),
)
@pytest.mark.slow
def test_balance_partitions_all_bins(costs, k, equal):
    if equal:
        costs = costs[: len(costs) - len(costs) % k]
    parts = balance_bins(costs, k, equal_count=equal)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    c = bin_costs(costs)
    loads = [c[p].sum() for p in parts]
    if costs:
        # largest differencing keeps the spread within the largest single bin cost
        assert max(loads) - min(loads) <= c.max() + 1e-6
    if equal:
        assert len({len(p) for p in parts}) <= 1
    assert balance_bins(costs, k, equal_count=equal) == parts  # deterministic


def test_balance_errors():
    with pytest.raises(ValueError, match="divisible"):
        balance_bins([1, 2, 3], 2, equal_count=True)
    with pytest.raises(ValueError, match="world_size"):
        balance_bins([1, 2], 0)
    with pytest.raises(ValueError, match="vision has 1 bins but bins has 2"):
        balance_bins([1, 2], 2, vision=[3])


# -- review: input types, edge sizes, JSON resume with composite keys, rank balancing edge cases --------


@pytest.mark.parametrize(
    "make",
    [
        lambda v: np.asarray(v, dtype=np.int32),
        lambda v: np.asarray(v, dtype=np.uint16),
        lambda v: np.asarray(v, dtype=np.int64),
        lambda v: __import__("torch").tensor(v),
        lambda v: __import__("torch").tensor(v, dtype=__import__("torch").int16),
        list,
        tuple,
        lambda v: (x for x in v),  # a generator: consumed once, like any iterable of ints
        lambda v: [np.int32(x) for x in v],
    ],
)
def test_pack_accepts_every_integer_container(make):
    lengths = [700, 300, 500, 1024, 24, 1]
    want = pack(lengths, 1024)
    for strategy in ("bfd", "ffd", "ff", "nf"):
        got = pack(make(lengths), 1024, strategy=strategy)
        assert got.bins == pack(lengths, 1024, strategy=strategy).bins
    assert want.bins == [[3], [0, 1, 4], [2, 5]]  # 24 fills the 700 + 300 bin exactly
    assert pack(make([]), 8).bins == []


@pytest.mark.slow
def test_edge_sizes_and_flat_arrays_agree_with_bins():
    for strategy in ("bfd", "ffd", "ff", "nf"):
        ones = pack([1] * 5, 1, strategy=strategy)  # capacity 1: one sample per bin
        assert ones.bins == [[i] for i in range(5)] and ones.efficiency == 1.0
        full = pack([8] * 4, 8, strategy=strategy, shuffle_seed=1)  # every sample fills its bin
        assert sorted(full.bins) == [[0], [1], [2], [3]] and full.lower_bound == full.num_bins == 4
        many = pack(np.full(200_000, 3, dtype=np.uint16), 10, strategy=strategy)
        assert many.num_bins == math.ceil(200_000 / 3) and int(many.bin_sizes.max()) == 3
    res = pack(
        np.random.default_rng(0).integers(1, 50, 2000), 64, vision=np.arange(2000) % 3, vision_capacity=4
    )
    bins = res.bins
    assert [res.bin(i).tolist() for i in range(res.num_bins)] == bins
    assert res.bin(-1).tolist() == bins[-1]
    assert [sum(int(res.lengths[j]) for j in b) for b in bins] == res.bin_lengths.tolist()
    assert [sum(int(res.vision[j]) for j in b) for b in bins] == res.bin_vision.tolist()
    assert all(res.sample_bin[j] == i for i, b in enumerate(bins) for j in b)
    assert res.bin_offsets[-1] == res.order.size == res.num_samples


def test_stream_state_json_round_trip_with_composite_keys():
    """Keys like (shard, index) come back as tuples after JSON, so resumed bins equal the uninterrupted ones."""
    items = [((f"shard-{i % 3}", i), 50 + (37 * i) % 400) for i in range(200)]
    ref = StreamPacker(512, buffer_size=8, min_fill_ratio=0.9, drop_last=True, oversized="skip")
    ref_bins = ref.add_many([k for k, _ in items], [n for _, n in items]) + ref.flush()
    for cut in (0, 37, 150):
        head = StreamPacker(512, buffer_size=8, min_fill_ratio=0.9, drop_last=True, oversized="skip")
        head_bins = head.add_many([k for k, _ in items[:cut]], [n for _, n in items[:cut]])
        tail = StreamPacker(512, buffer_size=8, min_fill_ratio=0.9, drop_last=True, oversized="skip")
        tail.load_state_dict(json.loads(json.dumps(head.state_dict())))
        assert tail.open_bins() == head.open_bins()
        rest = tail.add_many([k for k, _ in items[cut:]], [n for _, n in items[cut:]]) + tail.flush()
        assert head_bins + rest == ref_bins, cut
        assert all(isinstance(k, tuple) for b in rest for k in b.keys)
        assert tail.dropped == ref.dropped and tail.stats == ref.stats


def test_stream_flush_twice_add_after_flush_and_drop_last_accounting():
    sp = StreamPacker(10, min_fill_ratio=0.9, drop_last=True)
    assert sp.add("a", 3) == [] and sp.add("b", 9) == [PackedBin(["b"], [9], 9)]
    assert sp.flush() == [] and sp.flush() == []  # "a" (3 < 9 tokens) dropped once, not twice
    assert [b.keys for b in sp.dropped] == [["a"]]
    assert (sp.stats.samples_dropped, sp.stats.bins_dropped, sp.stats.tokens_dropped) == (1, 1, 3)
    assert sp.add("c", 4) == [] and sp.add("d", 5) == [PackedBin(["c", "d"], [4, 5], 9)]  # a new epoch
    st = sp.stats
    assert st.samples_seen == st.samples_emitted + st.samples_dropped + sp.num_open == 4


def test_balance_more_ranks_than_bins_and_one_rank():
    assert balance_bins([5, 3], 4) == [[0], [1], [], []]  # the extra ranks get no bin: their lists are empty
    assert balance_bins([], 3) == [[], [], []]
    assert balance_bins([5, 3, 2], 1) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="2 bins for 4 ranks"):
        balance_bins([5, 3], 4, equal_count=True)


# ----------------------------------------------------------------------------- shared config and saved states

# written by StreamPacker.state_dict() of the release before vlm_pack/packing/ became a package, after
# add(("s", i), length, vision) for (40, 10), (130, 0), (30, 45), (20, 5), (70, 0) with the knobs below
SAVED_BY_PREVIOUS_RELEASE = (
    '{"version": 1, "config": {"capacity": 100, "buffer_size": 4, "min_fill_ratio": 0.9, "drop_last": true, '
    '"vision_capacity": 50, "max_samples_per_bin": 3, "oversized": "truncate"}, "clock": 5, "open": '
    '[{"keys": [["s", 0], ["s", 3]], "lengths": [40, 20], "visions": [10, 5], "mtime": 4}], "stats": '
    '{"samples_seen": 5, "samples_emitted": 3, "bins_emitted": 2, "tokens_emitted": 200, "samples_dropped": 0, '
    '"bins_dropped": 0, "tokens_dropped": 0, "skipped": [], "truncated": [[["s", 1], 130]]}, "dropped": []}'
)
SAVED_KNOBS = dict(
    capacity=100,
    buffer_size=4,
    min_fill_ratio=0.9,
    drop_last=True,
    vision_capacity=50,
    max_samples_per_bin=3,
    oversized="truncate",
)


def _feed(sp):
    out = []
    for i, (length, vision) in enumerate([(40, 10), (130, 0), (30, 45), (20, 5), (70, 0)]):
        out += sp.add(("s", i), length, vision)
    return out


def test_stream_state_of_the_previous_release_loads_and_keeps_its_format():
    saved = json.loads(SAVED_BY_PREVIOUS_RELEASE)
    sp = StreamPacker(**SAVED_KNOBS)
    sp.load_state_dict(saved)
    assert json.loads(json.dumps(sp.state_dict())) == saved  # same JSON format, nothing lost
    assert [b.keys for b in sp.open_bins()] == [[("s", 0), ("s", 3)]]
    assert sp.stats.truncated == [(("s", 1), 130)]
    # the open bin holds 60 < ceil(0.9 * 100) tokens: drop_last drops it and reports it
    assert sp.flush() == []
    assert [(b.keys, b.lengths, b.visions) for b in sp.dropped] == [([("s", 0), ("s", 3)], [40, 20], [10, 5])]
    assert (sp.stats.samples_dropped, sp.stats.bins_dropped, sp.stats.tokens_dropped) == (2, 1, 60)
    # and today's packer, fed the same samples, writes exactly that state
    fresh = StreamPacker(**SAVED_KNOBS)
    emitted = _feed(fresh)
    assert [(b.keys, b.lengths) for b in emitted] == [([("s", 1)], [100]), ([("s", 2), ("s", 4)], [30, 70])]
    assert json.loads(json.dumps(fresh.state_dict())) == saved


def test_stream_packer_from_packing_config():
    from vlm_pack.config import PackingConfig

    cfg = PackingConfig(**SAVED_KNOBS, shuffle_seed=3, pad_to_multiple_of=4)  # streaming knobs are ignored
    sp = StreamPacker(cfg)
    assert [getattr(sp, name) for name in SAVED_KNOBS] == list(SAVED_KNOBS.values())
    assert sp.config == cfg
    assert _feed(sp) == _feed(StreamPacker(**SAVED_KNOBS, pad_to_multiple_of=4))
    # knobs over a config, and the capacity in the config's place, through the same validation
    assert StreamPacker(cfg, buffer_size=4).config == cfg.replace(buffer_size=4)
    assert StreamPacker(SAVED_KNOBS["capacity"]).config == PackingConfig(SAVED_KNOBS["capacity"])
    with pytest.raises(TypeError, match="PackingConfig"):
        StreamPacker(SAVED_KNOBS)
    with pytest.raises(TypeError, match="capacity given twice"):
        StreamPacker(100, capacity=200)
    with pytest.raises(TypeError, match="unknown argument"):
        StreamPacker(100, max_samples_per_row=2)  # an old name is gone (CHANGELOG), not translated


def test_pack_reads_packing_config():
    from vlm_pack.config import PackingConfig

    lengths = [900, 700, 500, 400, 300, 120, 60, 1100]
    cfg = PackingConfig(1024, max_samples_per_bin=2, oversized="skip", shuffle_seed=5, pad_to_multiple_of=4)
    by_config = pack(lengths, cfg)
    by_knobs = pack(
        lengths, 1024, max_samples_per_bin=2, oversized="skip", shuffle_seed=5, pad_to_multiple_of=4
    )
    assert by_config.bins == by_knobs.bins and [u.index for u in by_config.unpacked] == [7]
    assert pack(lengths, cfg, oversized="truncate").truncated == {7: 1100}
    with pytest.raises(ValueError, match="oversized must be one of"):
        pack(lengths, cfg, oversized="clip")  # PackingConfig's message, the same as StreamPacker's
    with pytest.raises(ValueError, match="capacity 1022 is not a multiple of pad_to_multiple_of 4"):
        pack(lengths, 1022, pad_to_multiple_of=4)


def test_stream_truncate_clips_and_reports():
    sp = StreamPacker(100, oversized="truncate")
    (only,) = sp.add("long", 130)
    assert (only.keys, only.lengths, only.total) == (["long"], [100], 100)
    assert sp.stats.truncated == [("long", 130)]


@pytest.mark.parametrize(
    ("knobs", "pattern"),
    [
        ({"capacity": 0}, "capacity must be a positive integer"),
        ({"capacity": 100, "buffer_size": 0}, "buffer_size"),
        ({"capacity": 100, "min_fill_ratio": 1.5}, r"min_fill_ratio must be a float in \(0, 1\]"),
        ({"capacity": 100, "oversized": "clip"}, "oversized must be one of"),
        ({"capacity": 100, "max_samples_per_bin": -1}, "max_samples_per_bin"),
        ({"capacity": 100, "vision_capacity": 2.5}, "vision_capacity"),
    ],
)
def test_stream_knobs_are_validated_like_the_config(knobs, pattern):
    from vlm_pack.config import PackingConfig

    with pytest.raises(ValueError, match=pattern):
        StreamPacker(**knobs)
    with pytest.raises(ValueError, match=pattern):
        PackingConfig(**knobs)


# ----------------------------------------------------------------------------- padding: plan on the rows' spans


def test_pack_plans_on_the_spans_the_collator_pads_to():
    """[4093, 4097] fit 8192 raw, but the collator pads them to [4096, 4100] at a multiple of 4: two rows, so
    two bins; the plan's lengths are the spans."""
    assert pack([4093, 4097], 8192).num_bins == 1
    res = pack([4093, 4097], 8192, pad_to_multiple_of=4)
    assert res.num_bins == 2 and res.lengths.tolist() == [4096, 4100] and res.pad_to_multiple_of == 4
    assert res.bin_lengths.tolist() == [4100, 4096] and res.efficiency == 8196 / (2 * 8192)
    assert padded_lengths([4093, 4097, 4], 4).tolist() == [4096, 4100, 4]
    with pytest.raises(ValueError, match="capacity 8190 is not a multiple of pad_to_multiple_of 4"):
        pack([1], 8190, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive int"):
        pack([1], 8192, pad_to_multiple_of=0)


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "ff", "nf"])
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=60), multiple=st.sampled_from([1, 2, 4, 8, 16]))
@FAST
@pytest.mark.slow
def test_pack_with_a_multiple_equals_pack_of_the_padded_lengths(strategy, lengths, multiple):
    padded = padded_lengths(lengths, multiple)
    res = pack(lengths, 96, strategy=strategy, pad_to_multiple_of=multiple, oversized="skip")
    ref = pack(padded, 96, strategy=strategy, oversized="skip")
    assert res.bins == ref.bins and [u.index for u in res.unpacked] == [u.index for u in ref.unpacked]
    assert all(int(padded[b].sum()) <= 96 for b in res.bins)  # every bin is one row once padded


def test_padded_oversized_samples_are_reported_with_their_own_length():
    res = pack([10, 4097], 4096, pad_to_multiple_of=4, oversized="skip")
    assert res.unpacked == [Unpacked(1, "length 4097 (padded to 4100, a multiple of 4) > capacity 4096")]
    res = pack([10, 4097], 4096, pad_to_multiple_of=4, oversized="truncate")
    assert res.truncated == {1: 4097} and res.lengths.tolist() == [12, 4096]
    with pytest.raises(ValueError, match=r"sample 1 has expanded length 4097 \(padded to 4100.*at least 4100"):
        pack([10, 4097], 4096, pad_to_multiple_of=4)


def test_stream_packer_places_padded_spans_and_saves_the_multiple():
    sp = StreamPacker(100, buffer_size=8, min_fill_ratio=1.0, pad_to_multiple_of=4)
    sp.add_many(["a", "b", "c"], [30, 33, 36])  # 99 raw: one bin; 32 + 36 + 36 = 104 padded: two
    with pytest.raises(ValueError, match=r"101 \(padded to 104, a multiple of 4\) > capacity 100"):
        StreamPacker(100, pad_to_multiple_of=4).add("long", 101)
    state = json.loads(json.dumps(sp.state_dict()))
    assert state["config"]["pad_to_multiple_of"] == 4
    bins = sp.flush()
    assert sorted(k for b in bins for k in b.keys) == ["a", "b", "c"] and all(b.total <= 100 for b in bins)
    assert sorted(length for b in bins for length in b.lengths) == [32, 36, 36]
    resumed = StreamPacker(100, buffer_size=8, min_fill_ratio=1.0, pad_to_multiple_of=4)
    resumed.load_state_dict(state)
    assert resumed.flush() == bins
    with pytest.raises(ValueError, match=r"different configuration.*pad_to_multiple_of"):
        StreamPacker(100, buffer_size=8, min_fill_ratio=1.0).load_state_dict(state)
    assert "pad_to_multiple_of" not in StreamPacker(100).state_dict()["config"]  # the first release's format
