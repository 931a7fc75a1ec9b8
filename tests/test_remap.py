"""remap.py: collapsed <-> expanded cu_seqlens against plain reference loops; labels.roll_packed."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_pack.collate.labels import roll_packed
from vlm_pack.collate.remap import (
    expansion_map,
    remap_cu_seqlens,
    remap_cu_seqlens_padded,
    segment_ids,
)

IMG = -200  # Megatron LLaVA's placeholder id
TEXT = 7


# ------------------------------------------------------------------------------------- reference loops


def ref_remap(cu: list[int], ids: list[int], counts: list[int]) -> list[int]:
    """Walk the collapsed row token by token, as Megatron's _preprocess_data lays it out."""
    expanded_at = []
    pos, k = 0, 0
    for tok in ids:
        expanded_at.append(pos)
        if tok == IMG:
            pos += counts[k]
            k += 1
        else:
            pos += 1
    expanded_at.append(pos)
    return [expanded_at[c] for c in cu]


def ref_roll(values: list, cu: list[int], shifts: int, fill) -> list:
    out = [fill] * len(values)
    for a, b in itertools.pairwise(cu):
        for p in range(a, b):
            src = p - shifts
            if a <= src < b:
                out[p] = values[src]
    return out


# A packed row: samples of text with 0-8 images each, every image 1-4096 embeddings.
sample_st = st.tuples(
    st.integers(0, 40),  # text tokens
    st.lists(st.integers(1, 4096), min_size=0, max_size=8),  # embeddings per image
    st.integers(0, 5),  # padding (padded variant)
).filter(lambda s: s[0] + len(s[1]) > 0)


def build_row(samples, seed: int, padded: bool):
    g = torch.Generator().manual_seed(seed)
    ids, counts, cu, cu_pad = [], [], [0], [0]
    for n_text, imgs, pad in samples:
        toks = [TEXT] * n_text + [IMG] * len(imgs)
        perm = torch.randperm(len(toks), generator=g).tolist()  # images anywhere in the sample
        ids.extend(toks[i] for i in perm)
        counts.extend(imgs)  # one count per placeholder, in order (all placeholders of a sample equal id)
        cu.append(cu[-1] + len(toks))
        if padded:
            ids.extend([0] * pad)
            cu_pad.append(cu_pad[-1] + len(toks) + pad)
    return ids, counts, cu, cu_pad


@settings(max_examples=60, deadline=None)
@given(st.lists(sample_st, min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_remap_matches_reference_loop(samples, seed):
    ids, counts, cu, _ = build_row(samples, seed, padded=False)
    t_ids = torch.tensor(ids)
    t_cu = torch.tensor(cu, dtype=torch.int32)
    out = remap_cu_seqlens(t_cu, t_ids, IMG, torch.tensor(counts, dtype=torch.long))
    assert out.dtype == torch.int32
    assert out.tolist() == ref_remap(cu, ids, counts)
    # The inverse recovers the collapsed boundaries.
    back = remap_cu_seqlens(out, t_ids, IMG, torch.tensor(counts), inverse=True)
    assert back.tolist() == cu
    # One count for every image (fixed-size encoders, e.g. LLaVA-1.5's 576).
    same = remap_cu_seqlens(t_cu, t_ids, IMG, 576)
    assert same.tolist() == ref_remap(cu, ids, [576] * len(counts))


@settings(max_examples=40, deadline=None)
@given(st.lists(sample_st, min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_remap_padded_matches_reference(samples, seed):
    ids, counts, cu, cu_pad = build_row(samples, seed, padded=True)
    t_ids = torch.tensor(ids)
    real, pad = remap_cu_seqlens_padded(
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(cu_pad, dtype=torch.int32),
        t_ids,
        IMG,
        torch.tensor(counts),
    )
    assert pad.tolist() == ref_remap(cu_pad, ids, counts)
    # Real expanded length of sample i: its text plus its images' embeddings.
    exp_lens = []
    k = 0
    for n_text, imgs, _ in samples:
        exp_lens.append(n_text + sum(imgs))
        k += len(imgs)
    assert real.tolist() == [sum(exp_lens[:i]) for i in range(len(exp_lens) + 1)]
    assert real.dtype == pad.dtype == torch.int32


def test_two_dimensional_rows_are_one_buffer():
    ids = torch.tensor([[TEXT, IMG, TEXT], [IMG, TEXT, TEXT]])
    cu = torch.tensor([0, 2, 4, 6])
    assert remap_cu_seqlens(cu, ids, IMG, torch.tensor([3, 5])).tolist() == [0, 4, 10, 12]


def test_expansion_map_agrees_with_real_expansion():
    ids = torch.tensor([1, IMG, 2, 3, IMG, IMG, 4])
    counts = torch.tensor([2, 3, 1])
    emap = expansion_map(ids, IMG, counts)
    repeats = torch.ones_like(ids)
    repeats[ids == IMG] = counts
    expanded = torch.repeat_interleave(ids, repeats)
    assert int(emap[-1]) == expanded.numel()
    text = ids != IMG
    assert torch.equal(expanded[emap[:-1][text]], ids[text])


def test_image_and_video_placeholders_count_together_in_buffer_order():
    """Two placeholder ids (image -200, video -300): one count per placeholder of either, in the order they
    stand; the reference loop reads them as one kind, so mark both as IMG for it."""
    vid = -300
    ids = [TEXT, vid, TEXT, IMG, vid, vid, TEXT, TEXT, IMG, TEXT]
    counts = [4, 3, 6, 2, 5]  # video, image, video group, video group, image
    cu = [0, 3, 7, 10]
    as_one = [IMG if t == vid else t for t in ids]
    want = ref_remap(cu, as_one, counts)
    t_ids, t_counts, t_cu = torch.tensor(ids), torch.tensor(counts), torch.tensor(cu)
    assert remap_cu_seqlens(t_cu, t_ids, (IMG, vid), t_counts).tolist() == want == [0, 6, 18, 25]
    assert remap_cu_seqlens(torch.tensor(want), t_ids, [IMG, vid], t_counts, inverse=True).tolist() == cu
    assert remap_cu_seqlens(t_cu, t_ids, IMG, torch.tensor([3, 5])).tolist() == ref_remap(cu, ids, [3, 5])
    with pytest.raises(ValueError, match="5 image placeholder"):
        remap_cu_seqlens(t_cu, t_ids, (IMG, vid), torch.tensor([3, 5]))


def test_seed_004_example():
    """Megatron-LM PR 3427's case: tiles per image vary and samples hold several images."""
    img_seq_len = 576
    tiles = torch.tensor([1, 2, 1, 3, 1])
    samples = [[5, IMG, 6, 7], [8, IMG, IMG, 9], [IMG, 1], [2, IMG, 3]]
    ids = torch.tensor([t for s in samples for t in s])
    cu = torch.tensor([0, 4, 8, 10, 13], dtype=torch.int32)
    out = remap_cu_seqlens(cu, ids, IMG, tiles * img_seq_len)
    lens = [3 + 576, 2 + 576 * 3, 1 + 576 * 3, 2 + 576]
    assert out.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        ([1, 3, 6], "must start at 0"),
        ([0, 4, 3, 6], "decreases at entry 2"),
        ([0, 3, 5], "ends at 5 but input_ids holds 6"),
        ([], "empty"),
    ],
)
def test_bad_cu_seqlens_raise(cu, match):
    ids = torch.tensor([TEXT, IMG, TEXT, TEXT, IMG, TEXT])
    with pytest.raises(ValueError, match=match):
        remap_cu_seqlens(torch.tensor(cu, dtype=torch.int32), ids, IMG, torch.tensor([2, 2]))


def test_count_mismatch_raises():
    ids = torch.tensor([TEXT, IMG, TEXT, IMG])
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="3 count\\(s\\) but input_ids holds 2 image placeholder"):
        remap_cu_seqlens(cu, ids, IMG, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"tokens_per_image\[1\] = 0"):
        remap_cu_seqlens(cu, ids, IMG, torch.tensor([4, 0]))
    with pytest.raises(ValueError, match="1-D tensor"):
        remap_cu_seqlens(cu, ids, IMG, torch.tensor([[4, 1]]))
    with pytest.raises(TypeError, match="integers"):
        remap_cu_seqlens(cu, ids, IMG, torch.tensor([4.0, 1.0]))
    with pytest.raises(ValueError, match=">= 1"):
        remap_cu_seqlens(cu, ids, IMG, 0)


def test_padded_real_longer_than_padded_raises():
    ids = torch.tensor([TEXT] * 6)
    with pytest.raises(ValueError, match="sample 1: real length 4 exceeds its padded length 2"):
        remap_cu_seqlens_padded(torch.tensor([0, 2, 6]), torch.tensor([0, 4, 6]), ids, IMG, 3)


def test_collapse_rejects_boundary_inside_an_image():
    ids = torch.tensor([TEXT, IMG, TEXT])
    with pytest.raises(ValueError, match=r"cu_seqlens\[1\] = 3 falls inside an image"):
        remap_cu_seqlens(torch.tensor([0, 3, 6]), ids, IMG, torch.tensor([4]), inverse=True)


def test_validate_false_skips_checks_and_stays_in_bounds():
    # A surplus placeholder without validation must not index out of range (no crash, no host sync).
    ids = torch.tensor([TEXT, IMG, IMG, TEXT])
    out = remap_cu_seqlens(torch.tensor([0, 4]), ids, IMG, torch.tensor([3]), validate=False)
    assert out.tolist() == [0, 6]


# -------------------------------------------------------------------------------------------- roll


def test_roll_packed_example():
    t = torch.tensor([1, 2, 3, 4, 5])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert roll_packed(t, cu).tolist() == [2, 3, 0, 5, 0]
    assert roll_packed(t, cu, shifts=1).tolist() == [0, 1, 2, 0, 4]
    assert roll_packed(t, cu, fill=-100).tolist() == [2, 3, -100, 5, -100]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=8),
    st.integers(-3, 3),
    st.integers(1, 3),
)
@pytest.mark.slow
def test_roll_packed_matches_loop(lengths, shifts, lead):
    total = sum(lengths)
    values = torch.arange(lead * total).reshape(lead, total) + 1
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    out = roll_packed(values, torch.tensor(cu), shifts=shifts, fill=-1)
    for r in range(lead):
        assert out[r].tolist() == ref_roll(values[r].tolist(), cu, shifts, -1)


def test_roll_packed_by_one_with_empty_samples():
    """The label shift (+-1, its own fast path) where empty samples sit first, inside and last."""
    cu = [0, 0, 3, 3, 5, 5]
    values = [1, 2, 3, 4, 5]
    for shifts in (-1, 1):
        out = roll_packed(torch.tensor([values, values]), torch.tensor(cu), shifts=shifts, fill=-1)
        assert out.tolist() == [ref_roll(values, cu, shifts, -1)] * 2
    assert roll_packed(torch.tensor([1, 2, 3, 4, 5]), torch.tensor(cu)).tolist() == [2, 3, 0, 5, 0]


def test_roll_packed_float_and_bool():
    cu = torch.tensor([0, 2, 3])
    assert roll_packed(torch.tensor([0.5, 1.5, 2.5]), cu, fill=0.0).tolist() == [1.5, 0.0, 0.0]
    assert roll_packed(torch.tensor([True, True, True]), cu, fill=False).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="ends at 3"):
        roll_packed(torch.zeros(4), cu)


def test_segment_ids_with_empty_samples():
    assert segment_ids(torch.tensor([0, 2, 2, 5]), 5).tolist() == [0, 0, 2, 2, 2]


# ------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_without_host_sync():
    dev = torch.device("cuda")
    ids = torch.tensor([TEXT, IMG, TEXT, IMG, TEXT, TEXT], device=dev)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32, device=dev)
    counts = torch.tensor([5, 2], device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = remap_cu_seqlens(cu, ids, IMG, counts)  # validate=None: no checks on CUDA
        pair = remap_cu_seqlens_padded(cu, cu, ids, IMG, counts)
        rolled = roll_packed(ids, cu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.tolist() == [0, 7, 11]
    assert pair[0].tolist() == pair[1].tolist() == [0, 7, 11]
    assert rolled.tolist() == [IMG, TEXT, 0, TEXT, TEXT, 0]
