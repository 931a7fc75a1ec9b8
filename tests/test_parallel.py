"""Context-parallel sharding, the distributed label roll (vlm_pack.forward.context_parallel) and per-token loss
(vlm_pack.forward.loss).

Single-process properties run in the test process; the distributed ones run in 2 and 4 gloo processes
spawned once per world size (module fixtures), each process running every check of its world and
reporting per-check tracebacks, so that one spawn serves several tests.
"""

from __future__ import annotations

import itertools
import os
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from vlm_pack.collate.labels import roll_packed
from vlm_pack.forward.context_parallel import (
    all_gather_from_context_parallel,
    check_parallel_config,
    context_parallel_index,
    gather_from_context_parallel,
    roll_packed_context_parallel,
    shard_for_context_parallel,
)
from vlm_pack.forward.loss import PerTokenLoss, reduce_token_loss, token_cross_entropy

VOCAB = 32

# --------------------------------------------------------------------------------------------------------
# Test data and references
# --------------------------------------------------------------------------------------------------------


def make_packed(seed: int, rows: int, row_len: int, multiple: int, mrope: bool = False) -> dict:
    """Random packed rows as the collator lays them out (flattened offsets, tail padding on the last sample).

    input_ids / labels (rows, row_len); labels -100 on each sample's first token and on padding;
    position_ids (rows, row_len) per-sample arange, or (4, rows, row_len) with 3 random mRoPE rows.
    """
    g = torch.Generator().manual_seed(seed)
    padded: list[int] = []
    for _ in range(rows):
        left = row_len
        while left:
            length = multiple * int(torch.randint(1, max(2, row_len // multiple // 2) + 1, (1,), generator=g))
            padded.append(min(length, left))
            left -= padded[-1]
    padded_t = torch.tensor(padded)
    real = (padded_t - torch.randint(0, multiple + 3, (len(padded),), generator=g)).clamp(min=1)
    cu_padded = F.pad(padded_t.cumsum(0), (1, 0)).to(torch.int32)
    cu_real = F.pad(real.cumsum(0), (1, 0)).to(torch.int32)
    total = rows * row_len
    sample = torch.repeat_interleave(torch.arange(len(padded)), padded_t)
    offset = torch.arange(total) - cu_padded[:-1].long()[sample]
    is_real = offset < real[sample]
    input_ids = torch.randint(1, VOCAB, (total,), generator=g).masked_fill(~is_real, 0)
    labels = input_ids.masked_fill(~is_real | (offset == 0), -100)
    positions = offset
    if mrope:
        positions = torch.cat([offset[None], torch.randint(0, 50, (3, total), generator=g)])
    return dict(
        input_ids=input_ids.view(rows, row_len),
        labels=labels.view(rows, row_len),
        position_ids=positions.view(*positions.shape[:-1], rows, row_len),
        cu_seqlens=cu_real,
        cu_seqlens_padded=cu_padded,
    )


def reference_roll(x: torch.Tensor, cu_padded: torch.Tensor, fill) -> torch.Tensor:
    """Per-sample left shift along the last dim, one sample at a time (the obviously correct version)."""
    out = torch.full_like(x, fill)
    bounds = cu_padded.tolist()
    for a, b in itertools.pairwise(bounds):
        if b > a:
            out[..., a : b - 1] = x[..., a + 1 : b]
    return out


def reference_index(cu_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Chunks ``rank`` and ``2 * cp - 1 - rank`` of every sample, sample by sample."""
    out = []
    bounds = cu_padded.tolist()
    for a, b in itertools.pairwise(bounds):
        c = (b - a) // (2 * cp)
        out += list(range(a + rank * c, a + (rank + 1) * c))
        out += list(range(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c))
    return torch.tensor(out, dtype=torch.long)


class TinyCausalLM(nn.Module):
    """2-layer pre-norm transformer whose attention uses a document + causal mask on *global* positions.

    Under CP each rank embeds its own tokens; keys and values of every layer are all-gathered (with
    gradient) into packed order, and each local query attends to the keys of its sample at global
    positions <= its own.
    """

    def __init__(self, dim: int = 16, heads: int = 2, layers: int = 2, max_positions: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(max_positions, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    norm1=nn.LayerNorm(dim),
                    qkv=nn.Linear(dim, 3 * dim),
                    proj=nn.Linear(dim, dim),
                    norm2=nn.LayerNorm(dim),
                    mlp=nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
                )
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids, position_ids, index, cu_seqlens_padded, cp_group=None):
        """input_ids, position_ids, index (t,): this rank's tokens and their packed positions -> (t, V)."""
        cu = cu_seqlens_padded.long()
        keys = torch.arange(int(cu[-1]))
        if cp_group is None and not torch.equal(index, keys):
            raise ValueError("without a CP group the model needs the whole packed buffer")
        q_sample = torch.searchsorted(cu, index, right=True)
        k_sample = torch.searchsorted(cu, keys, right=True)
        mask = (q_sample[:, None] == k_sample[None]) & (keys[None] <= index[:, None])  # (t, T)
        x = self.embed(input_ids) + self.pos(position_ids)
        for b in self.blocks:
            q, k, v = b["qkv"](b["norm1"](x)).unflatten(-1, (3, self.heads, -1)).unbind(1)  # (t, H, d)
            if cp_group is not None:
                k = all_gather_from_context_parallel(k, cu_seqlens_padded, cp_group, dim=0)  # (T, H, d)
                v = all_gather_from_context_parallel(v, cu_seqlens_padded, cp_group, dim=0)
            scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
            attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + b["proj"](torch.einsum("hqk,khd->qhd", attn, v).flatten(1))
            x = x + b["mlp"](b["norm2"](x))
        return self.head(self.norm(x))


def tiny_model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM().double()


def full_forward(model, batch):
    """Unsharded forward of a packed batch: (T, V) logits and the per-sample shifted labels (T,)."""
    ids = batch["input_ids"].flatten()
    total = ids.numel()
    logits = model(ids, batch["position_ids"].flatten(), torch.arange(total), batch["cu_seqlens_padded"])
    shifted = reference_roll(batch["labels"].flatten(), batch["cu_seqlens_padded"], -100)
    return logits, shifted


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------------------
# Checks run inside the spawned gloo processes (collectives first, assertions last)
# --------------------------------------------------------------------------------------------------------


def _check_shard_gather(rank: int, world: int, groups) -> None:
    for seed, mrope in ((1, True), (2, False), (3, True)):
        batch = make_packed(seed, rows=2, row_len=8 * world, multiple=2 * world, mrope=mrope)
        shard = shard_for_context_parallel(batch, world, rank)
        ids = all_gather_from_context_parallel(shard.input_ids, batch["cu_seqlens_padded"])
        labels = all_gather_from_context_parallel(shard.labels, batch["cu_seqlens_padded"])
        pos = all_gather_from_context_parallel(shard.position_ids, batch["cu_seqlens_padded"])
        local = int(batch["cu_seqlens_padded"][-1]) // world
        assert shard.input_ids.shape == (1, local)
        assert shard.position_ids.shape == ((4, 1, local) if mrope else (1, local))
        assert torch.equal(ids.view(batch["input_ids"].shape), batch["input_ids"])
        assert torch.equal(labels.view(batch["labels"].shape), batch["labels"])
        assert torch.equal(pos.view(batch["position_ids"].shape), batch["position_ids"])


def _check_roll(rank: int, world: int, groups) -> None:
    results = []
    for seed in range(4):
        batch = make_packed(10 + seed, rows=3, row_len=4 * world, multiple=2 * world)
        cu = batch["cu_seqlens_padded"]
        labels = batch["labels"].flatten()
        mask = labels != -100
        hidden = torch.randn(labels.numel(), 3, generator=torch.Generator().manual_seed(seed))
        index = context_parallel_index(cu, world, rank)
        rolled = (
            roll_packed_context_parallel(labels[index], cu, fill=-100),
            roll_packed_context_parallel(mask[index], cu, fill=False),
            roll_packed_context_parallel(hidden[index], cu, fill=0.5, dim=0),
        )
        gathered = (
            all_gather_from_context_parallel(rolled[0], cu),
            all_gather_from_context_parallel(rolled[1].to(torch.uint8), cu).bool(),
            all_gather_from_context_parallel(rolled[2], cu, dim=0),
        )
        results.append((batch, labels, mask, hidden, gathered))
    for batch, labels, mask, hidden, (g_labels, g_mask, g_hidden) in results:
        cu = batch["cu_seqlens_padded"]
        assert torch.equal(g_labels, reference_roll(labels, cu, -100))
        assert torch.equal(g_mask, reference_roll(mask, cu, False))
        assert torch.equal(g_hidden, reference_roll(hidden.T, cu, 0.5).T)


def _check_cp_model(rank: int, world: int, groups, dp: int) -> None:
    """DP = ``dp`` replicas x CP = world // dp: log-probs, loss and gradients equal the unsharded ones."""
    cp = world // dp
    dp_rank, cp_rank = divmod(rank, cp)
    cp_group = groups[dp_rank]
    batches = [make_packed(20 + d, rows=2, row_len=24 if cp == 2 else 32, multiple=2 * cp) for d in range(dp)]

    # Reference: one process, every replica's batch, global per-token mean.
    ref_model = tiny_model()
    sums, counts, ref_logp = [], [], None
    for d, batch in enumerate(batches):
        logits, shifted = full_forward(ref_model, batch)
        s, n = token_cross_entropy(logits, shifted)
        sums.append(s)
        counts.append(n)
        if d == dp_rank:
            ref_logp = logits.log_softmax(-1).detach()
    ref_loss = sum(sums) / sum(counts)
    ref_loss.backward()
    ref_grads = grads(ref_model)

    # Context parallel: this rank's chunks, labels rolled across ranks, loss over DP x CP.
    batch = batches[dp_rank]
    cu = batch["cu_seqlens_padded"]
    model = tiny_model()
    shard = shard_for_context_parallel(batch, cp, cp_rank)
    logits = model(shard.input_ids[0], shard.position_ids[0], shard.index, cu, cp_group)
    shifted = roll_packed_context_parallel(shard.labels, cu, cp_group, fill=-100)
    loss_sum, n = token_cross_entropy(logits, shifted[0])
    loss = reduce_token_loss(loss_sum, n)  # world = DP x CP group
    loss.backward()
    for p in model.parameters():  # a gradient reduction that sums (Megatron average_in_collective=False)
        dist.all_reduce(p.grad)
    logp = all_gather_from_context_parallel(logits.log_softmax(-1).detach(), cu, cp_group, dim=0)
    per_rank = [torch.empty_like(logits.detach()) for _ in range(cp)]
    dist.all_gather(per_rank, logits.log_softmax(-1).detach().contiguous(), group=cp_group)

    pre_shifted = shard_for_context_parallel(batch, cp, cp_rank, shift_labels=True).labels
    assert torch.equal(shifted, pre_shifted)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    # The zigzag order matters: concatenating the ranks' outputs is not the packed order.
    assert (torch.cat(per_rank) - ref_logp).abs().max() > 1e-2
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=1e-12)
    for got, want in zip(grads(model), ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _micro_batches(rank: int) -> list[dict]:
    # Unequal token counts across micro-batches and ranks: 1 short and 1 long row each, swapped.
    sizes = [(6, 30), (40, 10)][rank]
    return [make_packed(40 + 2 * rank + i, rows=1, row_len=n, multiple=2) for i, n in enumerate(sizes)]


def _check_dp_grad_accum(rank: int, world: int, groups) -> None:
    """DP = 2 x grad-accum = 2 with unequal token counts: both PerTokenLoss modes give the global mean."""
    ref_model = tiny_model()
    sums, counts, naive = [], [], []
    for r in range(world):
        for batch in _micro_batches(r):
            s, n = token_cross_entropy(*full_forward(ref_model, batch))
            sums.append(s)
            counts.append(n)
            naive.append(float(s / n))
    ref_loss = sum(sums) / sum(counts)
    ref_loss.backward()
    ref_grads = grads(ref_model)
    mine = _micro_batches(rank)

    # Counted ahead, gradients averaged over the group (PyTorch DDP).
    model = tiny_model()
    ptl = PerTokenLoss(grad_reduction="mean")
    ptl.begin_step(
        sum(int((reference_roll(b["labels"][0], b["cu_seqlens_padded"], -100) != -100).sum()) for b in mine)
    )
    for batch in mine:
        ptl.loss_for_backward(*token_cross_entropy(*full_forward(model, batch))).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    loss_mean_mode = ptl.end_step()
    mean_grads = grads(model)

    # Deferred: backward on sums, gradients summed, then divided by the global token count.
    model = tiny_model()
    ptl = PerTokenLoss(grad_reduction="sum")
    ptl.begin_step()
    for batch in mine:
        ptl.loss_for_backward(*token_cross_entropy(*full_forward(model, batch))).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    loss_sum_mode = ptl.end_step(model.parameters())

    assert ptl.global_tokens == int(sum(counts))
    # The data re-weights: a mean of micro-batch means is far from the per-token mean.
    assert abs(sum(naive) / len(naive) - float(ref_loss)) > 1e-2
    for step_loss, step_grads in ((loss_mean_mode, mean_grads), (loss_sum_mode, grads(model))):
        torch.testing.assert_close(step_loss, ref_loss.detach(), rtol=0, atol=1e-12)
        for got, want in zip(step_grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


CHECKS = {
    2: {
        "shard_gather": _check_shard_gather,
        "roll": _check_roll,
        "cp_model": lambda r, w, g: _check_cp_model(r, w, g, dp=1),
        "dp_grad_accum": _check_dp_grad_accum,
    },
    4: {
        "shard_gather": _check_shard_gather,
        "roll": _check_roll,
        "cp_model": lambda r, w, g: _check_cp_model(r, w, g, dp=1),
        "dp2_cp2_model": lambda r, w, g: _check_cp_model(r, w, g, dp=2),
    },
}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        # CP groups of the DP=2 x CP=2 layout ({0, 1}, {2, 3}); the world is the CP group otherwise.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
        results = {}
        for name, check in CHECKS[world].items():
            groups = pairs if name == "dp2_cp2_model" else [dist.group.WORLD]
            try:
                check(rank, world, groups)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp(f"gloo{world}")
    with pytest.MonkeyPatch.context() as patch:  # the variables come back as they were
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("MKL_NUM_THREADS", "1")
        # forkserver: fresh processes like spawn, but torch is imported once in the server, not per rank.
        mp.set_forkserver_preload(["torch", "torch.distributed", "vlm_pack.forward.context_parallel", "vlm_pack.forward.loss"])
        mp.start_processes(
            _worker, args=(world, str(tmp / "rendezvous"), str(tmp)), nprocs=world, start_method="forkserver"
        )
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def gloo4(tmp_path_factory):
    return _spawn(4, tmp_path_factory)


def _assert_check(results: list[dict], name: str) -> None:
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


# --------------------------------------------------------------------------------------------------------
# Distributed tests (2 and 4 gloo processes)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_shard_then_all_gather_is_identity(world, request):
    """Token ids, labels and 1-row / 4-row mRoPE positions come back in packed order on every rank."""
    _assert_check(request.getfixturevalue(f"gloo{world}"), "shard_gather")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_distributed_roll_equals_single_process_roll(world, request):
    """Labels, a bool loss mask and a float (T, 3) tensor, random packed rows, CP = 2 and 4."""
    _assert_check(request.getfixturevalue(f"gloo{world}"), "roll")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_context_parallel_forward_matches_unsharded(world, request):
    """Per-rank attention with all-gathered K/V: same log-probs, per-token loss and gradients as 1 process."""
    _assert_check(request.getfixturevalue(f"gloo{world}"), "cp_model")


@pytest.mark.slow
def test_data_parallel_grad_accumulation_loss_is_per_token(gloo2):
    """DP = 2 x grad-accum = 2 with unequal token counts: loss and gradients of the global token mean."""
    _assert_check(gloo2, "dp_grad_accum")


@pytest.mark.slow
def test_dp2_cp2_loss_and_gradients_match_single_process(gloo4):
    _assert_check(gloo4, "dp2_cp2_model")


# --------------------------------------------------------------------------------------------------------
# Single-process tests
# --------------------------------------------------------------------------------------------------------


def test_index_is_megatron_chunk_assignment():
    cu = torch.tensor([0, 8, 8, 16, 24, 48], dtype=torch.int32)  # includes an empty sample
    assert torch.equal(context_parallel_index(cu, 1, 0), torch.arange(48))
    for cp in (2, 4):
        for rank in range(cp):
            assert torch.equal(context_parallel_index(cu, cp, rank), reference_index(cu, cp, rank))
        every = context_parallel_index(cu, cp)  # (cp, T / cp): a permutation of the buffer
        assert every.shape == (cp, 48 // cp)
        assert torch.equal(every.flatten().sort().values, torch.arange(48))
    cu6 = torch.tensor([0, 6, 18, 30])
    for rank in range(3):
        assert torch.equal(context_parallel_index(cu6, 3, rank), reference_index(cu6, 3, rank))


def test_docstring_example():
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    a, b, c = list(range(8)), list(range(8, 12)), list(range(12, 24))
    assert context_parallel_index(cu, 2, 0).tolist() == a[0:2] + a[6:8] + b[0:1] + b[3:4] + c[0:3] + c[9:12]
    assert context_parallel_index(cu, 2, 1).tolist() == a[2:6] + b[1:3] + c[3:9]
    shard = shard_for_context_parallel({"cu_seqlens_padded": cu}, 2, 1)
    assert shard.cu_seqlens_local.tolist() == [0, 4, 6, 12]
    assert (shard.max_seqlen, shard.max_seqlen_local) == (12, 6)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_then_gather_is_identity_single_process(cp):
    batch = make_packed(cp, rows=3, row_len=16, multiple=2 * cp, mrope=True)
    shards = [shard_for_context_parallel(batch, cp, r) for r in range(cp)]
    cu = batch["cu_seqlens_padded"]
    for name in ("input_ids", "labels", "position_ids"):
        got = gather_from_context_parallel([getattr(s, name) for s in shards], cu)
        assert torch.equal(got.view(batch[name].shape), batch[name])
    kw = shards[0].packed_seq_params_kwargs()
    assert torch.equal(kw["cu_seqlens_q"], batch["cu_seqlens"])
    assert torch.equal(kw["cu_seqlens_q_padded"], cu)
    assert kw["qkv_format"] == "thd" and kw["max_seqlen_q"] == int((cu[1:] - cu[:-1]).max())


def test_gather_is_differentiable_and_checks_sizes():
    cu = torch.tensor([0, 4, 12])
    parts = [torch.randn(6, 2, requires_grad=True) for _ in range(2)]
    out = gather_from_context_parallel(parts, cu, dim=0)
    (out * torch.arange(12.0)[:, None]).sum().backward()
    for r, p in enumerate(parts):
        assert torch.equal(p.grad[:, 0], context_parallel_index(cu, 2, r).double().float())
    with pytest.raises(ValueError, match="6 tokens"):
        gather_from_context_parallel([torch.zeros(6), torch.zeros(5)], cu)


def test_shard_rejects_sample_not_divisible_by_2cp():
    batch = make_packed(0, rows=1, row_len=16, multiple=2)
    batch["cu_seqlens_padded"] = torch.tensor([0, 8, 14, 16], dtype=torch.int32)
    batch["cu_seqlens"] = torch.tensor([0, 7, 12, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sample 1 .*length 6.*pad_multiple_for\(cp=2\)"):
        shard_for_context_parallel(batch, 2, 0)
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        shard_for_context_parallel({"input_ids": torch.zeros(8)}, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        shard_for_context_parallel(make_packed(0, 1, 8, 4), 2, 2)
    bad_rows = make_packed(0, rows=2, row_len=8, multiple=4)
    bad_rows["input_ids"] = bad_rows["input_ids"][:, :6]
    with pytest.raises(ValueError, match="input_ids has shape"):
        shard_for_context_parallel(bad_rows, 2, 0)


def test_shift_labels_before_sharding_equals_reference_roll():
    batch = make_packed(5, rows=2, row_len=16, multiple=4)
    cu = batch["cu_seqlens_padded"]
    shards = [shard_for_context_parallel(batch, 2, r, shift_labels=True).labels for r in range(2)]
    want = reference_roll(batch["labels"].flatten(), cu, -100)
    assert torch.equal(gather_from_context_parallel(shards, cu)[0], want)
    # Every sample's last real token now predicts nothing and its first token's label moved out.
    assert torch.equal(want[cu[1:].long() - 1], torch.full((cu.numel() - 1,), -100))


def test_single_process_roll_without_process_group():
    x = torch.tensor([1, 2, 3, 4, 5])
    assert roll_packed_context_parallel(x, torch.tensor([0, 3, 5])).tolist() == [2, 3, 0, 5, 0]
    batch = make_packed(7, rows=2, row_len=12, multiple=1)
    labels, cu = batch["labels"].flatten(), batch["cu_seqlens_padded"]
    assert torch.equal(roll_packed_context_parallel(labels, cu, fill=-100), reference_roll(labels, cu, -100))
    with pytest.raises(ValueError, match="shifts=-1"):
        roll_packed_context_parallel(x, torch.tensor([0, 5]), shifts=1)


def test_matches_remap_roll_packed():
    batch = make_packed(8, rows=2, row_len=16, multiple=2)
    labels, cu = batch["labels"].flatten(), batch["cu_seqlens_padded"]
    want = roll_packed(labels, cu, shifts=-1, fill=-100)
    assert torch.equal(roll_packed_context_parallel(labels, cu, fill=-100), want)
    assert torch.equal(reference_roll(labels, cu, -100), want)


def _image(width: int, height: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_sharding_a_real_qwen_packed_batch():
    """PackingCollator batch (Qwen2-VL, images, 4-row mRoPE) padded for CP = 2: shards gather back exactly."""
    # Imported here: the spawned gloo workers import this module and need none of this.
    from vlm_pack.collate.collator import PackingCollator, pad_multiple_for
    from vlm_pack.offline import build_tokenizer, image_processor
    from vlm_pack.processing import process_sample

    tok = build_tokenizer("qwen2_vl")
    proc = image_processor("qwen2_vl")
    convs = [
        (
            [_image(56, 84, 0)],
            [{"role": "user", "content": "<image> what is it?"}, {"role": "assistant", "content": "A cat."}],
        ),
        ([], [{"role": "user", "content": "two words"}, {"role": "assistant", "content": "yes indeed"}]),
        ([_image(112, 56, 1), _image(56, 56, 2)], "two small pictures side by side"),
    ]
    samples = [process_sample(imgs, conv, tokenizer=tok, image_processor=proc) for imgs, conv in convs]
    collator = PackingCollator(
        96, family="qwen2_vl", tokenizer=tok, pad_to_multiple_of=pad_multiple_for(cp=2)
    )
    batch = collator(samples)
    assert batch.position_ids.shape[0] == 4
    shards = [shard_for_context_parallel(batch, 2, r, shift_labels=True) for r in range(2)]
    cu = batch.cu_seqlens_padded
    for name in ("input_ids", "position_ids"):
        got = gather_from_context_parallel([getattr(s, name) for s in shards], cu)
        assert torch.equal(got.view(getattr(batch, name).shape), getattr(batch, name))
    mm = gather_from_context_parallel([s.extra["mm_token_type_ids"] for s in shards], cu)
    assert torch.equal(mm.view(batch.mm_token_type_ids.shape), batch.mm_token_type_ids)
    # Labels shifted per sample before sharding = the collator's Megatron (already shifted) labels.
    shifted = gather_from_context_parallel([s.labels for s in shards], cu)
    assert torch.equal(shifted, batch.model_inputs("megatron")["labels"])
    assert torch.equal(shards[0].cu_seqlens, batch.cu_seqlens)

    unpadded = PackingCollator(96, family="qwen2_vl", tokenizer=tok)(samples)
    with pytest.raises(ValueError, match=r"sample \d+ of the packed batch .*pad_multiple_for\(cp=2\)"):
        shard_for_context_parallel(unpadded, 2, 0)
    collapsed_samples = [
        process_sample(imgs, conv, tokenizer=tok, image_processor=proc, layout="collapsed")
        for imgs, conv in convs
    ]
    collapsed = PackingCollator(96, family="qwen2_vl", tokenizer=tok, layout="collapsed")
    with pytest.raises(ValueError, match="cu_seqlens_padded_expanded"):
        shard_for_context_parallel(collapsed(collapsed_samples), 2, 0)


def test_token_cross_entropy_and_single_process_reduction():
    logits = torch.randn(2, 7, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[0, :3] = -100
    loss_sum, n = token_cross_entropy(logits, labels)
    assert int(n) == 11
    torch.testing.assert_close(loss_sum / n, F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)))
    mean = reduce_token_loss(loss_sum, n)
    torch.testing.assert_close(mean, loss_sum / n)
    mean.backward()
    assert torch.isfinite(logits.grad).all()
    # A step without loss tokens gives 0 and zero gradients, not NaN.
    empty_logits = torch.randn(3, VOCAB, requires_grad=True)
    s, n = token_cross_entropy(empty_logits, torch.full((3,), -100))
    zero = reduce_token_loss(s, n)
    zero.backward()
    assert float(zero.detach()) == 0.0 and torch.equal(empty_logits.grad, torch.zeros(3, VOCAB))


def test_per_token_loss_checks_its_bookkeeping():
    ptl = PerTokenLoss()
    with pytest.raises(RuntimeError, match="begin_step"):
        ptl.loss_for_backward(torch.tensor(1.0), 1)
    ptl.begin_step(5)
    ptl.loss_for_backward(torch.tensor(2.0), 3)
    with pytest.raises(ValueError, match="counted 5 loss tokens"):
        ptl.end_step()
    ptl.begin_step()
    ptl.loss_for_backward(torch.tensor(2.0), 3)
    with pytest.raises(ValueError, match="end_step\\(parameters\\)"):
        ptl.end_step()
    with pytest.raises(ValueError, match="grad_reduction"):
        PerTokenLoss(grad_reduction="avg")


def test_check_parallel_config():
    assert check_parallel_config(cp=2, pad_to_multiple_of=4) == 4
    assert check_parallel_config(cp=2, tp=2, sequence_parallel=True, pad_to_multiple_of=16) == 8
    assert check_parallel_config(cp=1, tp=4, sequence_parallel=True, pad_to_multiple_of=4) == 4
    with pytest.raises(ValueError, match="requires per-token loss"):
        check_parallel_config(cp=2, per_token_loss=False, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match=r"not a multiple of 4 \(2 \* CP = 4\)"):
        check_parallel_config(cp=2, pad_to_multiple_of=2)
    with pytest.raises(ValueError, match=r"multiple of 8 .*TP = 2.*pad_to_multiple_of=8"):
        check_parallel_config(cp=2, tp=2, sequence_parallel=True, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match="offline packing requires micro_batch_size=1"):
        check_parallel_config(cp=1, micro_batch_size=2)
    with pytest.warns(UserWarning, match="in-batch packing with micro_batch_size=1"):
        check_parallel_config(cp=1, packing="in_batch", micro_batch_size=1)
    with pytest.warns(UserWarning, match="packing changes the loss"):
        check_parallel_config(cp=1, per_token_loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_parallel_config(cp=4, packing="in_batch", micro_batch_size=4, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="packing must be"):
        check_parallel_config(cp=1, packing="online")
    # One pad rule: what the check requires is what pad_multiple_for gives the collator, for every layout.
    from vlm_pack.collate.collator import pad_multiple_for

    for cp, tp, sp in itertools.product((1, 2, 3, 4), (1, 2, 4), (False, True)):
        multiple = pad_multiple_for(tp=tp, cp=cp, sequence_parallel=sp)
        assert check_parallel_config(cp=cp, tp=tp, sequence_parallel=sp, pad_to_multiple_of=multiple) == multiple


def test_sharding_a_multi_row_collator_batch():
    """R > 1 rows from PackingCollator: rows are flattened into one THD buffer and shard back exactly."""
    import numpy as np

    from vlm_pack.collate.collator import PackingCollator, pad_multiple_for
    from vlm_pack.offline import build_tokenizer
    from vlm_pack.processing import process_sample

    tok = build_tokenizer("qwen2_vl")
    convs = [
        [{"role": "user", "content": "w " * n}, {"role": "assistant", "content": "yes " * n}]
        for n in (5, 9, 3, 12, 7, 2)
    ]
    samples = [process_sample([], conv, tokenizer=tok) for conv in convs]
    collator = PackingCollator(  # max_rows=None: the samples re-packed into several rows (in-batch packing)
        64, family="qwen2_vl", tokenizer=tok, pad_to_multiple_of=pad_multiple_for(cp=2), max_rows=None
    )
    batch = collator(samples)
    assert batch.num_rows > 1 and batch.position_ids.shape == (4, batch.num_rows, 64)
    cu = batch.cu_seqlens_padded
    assert int(cu[-1]) == batch.num_rows * 64  # the padded samples partition every row
    shards = [
        shard_for_context_parallel(batch, np.int64(2), np.int64(r), shift_labels=True) for r in range(2)
    ]
    assert all(s.input_ids.shape == (1, batch.num_rows * 32) for s in shards)
    for name in ("input_ids", "position_ids"):
        got = gather_from_context_parallel([getattr(s, name) for s in shards], cu)
        assert torch.equal(got.view(getattr(batch, name).shape), getattr(batch, name))
    labels = gather_from_context_parallel([s.labels for s in shards], cu)
    assert torch.equal(labels, batch.model_inputs("megatron")["labels"].reshape(labels.shape))
    # Every sample's tokens are split evenly: each rank holds half of every padded sample.
    assert torch.equal(shards[0].cu_seqlens_local, cu // 2)

    with pytest.raises(
        ValueError,
        match=r"sample 0 of the packed batch has padded length \d+, not divisible by 2 \* cp_size = 6",
    ):
        shard_for_context_parallel(batch, 3, 0)
    for bad in (True, 2.0, -1):
        with pytest.raises(ValueError, match="cp_rank must be an int in"):
            shard_for_context_parallel(batch, 2, bad)
    with pytest.raises(ValueError, match="cp_size must be an int >= 1"):
        shard_for_context_parallel(batch, 0, 0)
    assert check_parallel_config(cp=np.int64(2), pad_to_multiple_of=torch.tensor(4)) == 4
    with pytest.raises(ValueError, match="cp must be an int >= 1, got True"):
        check_parallel_config(cp=True)
