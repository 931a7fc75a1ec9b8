"""Context parallelism for packed rows: per-sample sharding, gathering back, the distributed label roll.

With context parallelism (CP) every packed row is split along the sequence over ``cp_size`` ranks. Splitting
the row into ``cp_size`` contiguous slices would cross sample boundaries and give the last rank all the
expensive causal work, so each sample is cut *on its own* into ``2 * cp_size`` equal chunks and rank ``r``
keeps chunks ``r`` and ``2 * cp_size - 1 - r`` (Megatron ``get_batch_on_this_cp_rank``, Transformer
Engine ``thd_get_partitioned_indices``)::

    cp_size = 2: each sample's padded length is a multiple of 2 * cp_size = 4

    packed row     |<------ sample 0 (8) ------>|<-- sample 1 (4) -->|<-------- sample 2 (12) -------->|
    global tokens  | a0 a1 | a2 a3 | a4 a5 | a6 a7 | b0 | b1 | b2 | b3 | c0 c1 c2 | c3 c4 c5 | c6 c7 c8 | c9 .. |
    chunk          |  0    |  1    |  2    |  3    | 0  | 1  | 2  | 3  |    0     |    1     |    2     |   3   |

    rank 0 (chunks 0, 3)   a0 a1 a6 a7 | b0 b3 | c0 c1 c2 c9 c10 c11
    rank 1 (chunks 1, 2)   a2 a3 a4 a5 | b1 b2 | c3 c4 c5 c6 c7 c8
    local cu_seqlens       0           4       6                  12   = cu_seqlens_padded // cp_size

Every rank gets the same number of tokens of every sample and the same causal work (chunk ``r`` is cheap,
chunk ``2 * cp_size - 1 - r`` expensive). The attention kernels take the *global* ``cu_seqlens`` (real
lengths) and ``cu_seqlens_padded`` (sample offsets in the padded buffer): Transformer Engine's THD
context-parallel attention derives the local layout itself as ``cu_seqlens_padded // cp_size``, which
:class:`ContextParallelShard` also carries for local varlen kernels and per-sample reductions.

The label shift ``labels[t] <- labels[t + 1]`` of a sample now crosses ranks: the last token of chunk ``k``
needs the first token of chunk ``k + 1``::

    a sample's chunks in sequence order (cp_size = 3)
    chunk        0       1       2       3       4       5
    held by      r0      r1      r2      r2      r1      r0
                 front   front   front   back    back    back

    last token of the front chunk of rank r  <- first token of the front chunk of rank r + 1
    last token of the front chunk of rank cp-1 <- first token of its own back chunk (local)
    last token of the back chunk of rank r   <- first token of the back chunk of rank r - 1
    last token of the back chunk of rank 0   <- fill (the sample ends)

:func:`roll_packed_context_parallel` sends, for all samples at once, the first token of each front chunk to
rank ``r - 1`` and the first token of each back chunk to rank ``r + 1`` in one ``batch_isend_irecv``.

The per-token loss that CP needs (each rank holds a different number of loss tokens) is in ``vlm_pack.forward.loss``.
:func:`check_parallel_config` rejects the configurations that silently break either (seed rules of Megatron
Bridge).

Only ``torch.distributed`` is used (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..collate.batch import thd_params_kwargs
from ..collate.collator import pad_multiple_for
from ..collate.labels import IGNORE_INDEX, roll_packed

__all__ = [
    "ContextParallelShard",
    "all_gather_from_context_parallel",
    "check_parallel_config",
    "context_parallel_index",
    "gather_from_context_parallel",
    "group_size_rank",
    "roll_packed_context_parallel",
    "shard_for_context_parallel",
]

# --------------------------------------------------------------------------------------------------------
# Index computation (pure, vectorised)
# --------------------------------------------------------------------------------------------------------


def _as_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high)`` (numpy / 0-d tensor ints accepted, bools rejected)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        out = None
    if out is None or out < low or (high is not None and out >= high):
        bounds = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return out


def _check_cu_seqlens_padded(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Validate ``cu_seqlens_padded`` (N+1,) for ``cp_size`` and return it as int64."""
    cp_size = _as_int(cp_size, "cp_size", 1)
    if not isinstance(cu_seqlens_padded, torch.Tensor) or cu_seqlens_padded.dim() != 1:
        raise TypeError("cu_seqlens_padded must be a 1-D integer tensor of N+1 sample offsets")
    if cu_seqlens_padded.is_floating_point() or cu_seqlens_padded.numel() < 1:
        raise TypeError("cu_seqlens_padded must be a 1-D integer tensor of N+1 sample offsets")
    cu = cu_seqlens_padded.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lens < 0).any()):
        raise ValueError("cu_seqlens_padded must start at 0 and be non-decreasing")
    if cp_size == 1:  # nothing is chunked
        return cu
    bad = torch.nonzero(lens % (2 * cp_size)).flatten()
    if bad.numel():
        i = int(bad[0])
        listed = ", ".join(f"sample {int(j)}: {int(lens[j])}" for j in bad[:5])
        raise ValueError(
            f"sample {i} of the packed batch has padded length {int(lens[i])}, not divisible by "
            f"2 * cp_size = {2 * cp_size} ({bad.numel()} such samples; {listed}). Context parallelism "
            f"splits every sample into 2 * cp_size chunks: pad each sample in the collator with "
            f"pad_to_multiple_of=pad_multiple_for(cp={cp_size}) (2 * CP, or 2 * CP * TP with sequence "
            f"parallelism) and pass the resulting cu_seqlens_padded."
        )
    return cu


def context_parallel_index(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int | None = None
) -> torch.Tensor:
    """Positions in the packed buffer of the tokens a context-parallel rank holds, in its local order.

    Same layout as Transformer Engine's ``thd_get_partitioned_indices(cu_seqlens_padded, total, cp_size,
    cp_rank)``: sample ``i`` occupies local slots ``[cu_padded[i] // cp, cu_padded[i + 1] // cp)``, first
    its chunk ``cp_rank`` then its chunk ``2 * cp_size - 1 - cp_rank``.

    Args:
        cu_seqlens_padded: (N+1,) offsets of each padded sample in the flattened packed buffer; every
            padded length divisible by ``2 * cp_size``.
        cp_size: context-parallel world size.
        cp_rank: the rank; ``None`` returns the indices of all ranks.

    Returns:
        (total // cp_size,) int64 for one rank, or (cp_size, total // cp_size) for all ranks.
    """
    cu = _check_cu_seqlens_padded(cu_seqlens_padded, cp_size)
    cp_size = _as_int(cp_size, "cp_size", 1)
    if cp_rank is not None:
        cp_rank = _as_int(cp_rank, "cp_rank", 0, cp_size)
    device = cu.device
    if cp_size == 1:
        index = torch.arange(int(cu[-1]), device=device)
        return index if cp_rank is not None else index[None]
    lens = cu[1:] - cu[:-1]  # (N,)
    chunk = lens // (2 * cp_size)  # (N,) tokens per chunk
    local_total = int(cu[-1]) // cp_size
    # A rank's buffer is 2N segments (front, back chunk of each sample); within a segment the global
    # position is the local slot plus a per-segment shift, so one repeat_interleave of 2N shifts suffices.
    ranks = (
        torch.arange(cp_size, device=device) if cp_rank is None else torch.tensor([cp_rank], device=device)
    )
    ranks = ranks[:, None]  # (P, 1)
    front = cu[:-1] + ranks * chunk  # (P, N) global start of chunk r
    back = cu[:-1] + (2 * cp_size - 1 - ranks) * chunk  # (P, N) global start of chunk 2cp-1-r
    local_front = cu[:-1] // cp_size
    shift = torch.stack([front - local_front, back - (local_front + chunk)], dim=-1).flatten(1)  # (P, 2N)
    index = torch.arange(local_total, device=device) + shift.repeat_interleave(
        chunk.repeat_interleave(2), dim=1, output_size=local_total
    )  # (P, T/cp)
    return index if cp_rank is None else index[0]


# --------------------------------------------------------------------------------------------------------
# Sharding and gathering
# --------------------------------------------------------------------------------------------------------


def _token_view(tensor: torch.Tensor, total: int, name: str) -> tuple[torch.Tensor, int]:
    """View ``tensor`` with one token dim of size ``total`` (rows of (..., R, T) are flattened to (..., 1, R*T)).

    Returns the view and the token dim (negative).
    """
    if tensor.shape[-1] == total:
        return tensor, -1
    if tensor.dim() >= 2 and tensor.shape[-2] * tensor.shape[-1] == total:
        return tensor.reshape(*tensor.shape[:-2], 1, total), -1
    raise ValueError(
        f"{name} has shape {tuple(tensor.shape)}, but cu_seqlens_padded[-1] = {total} tokens: expected a "
        f"token dim of {total} or rows (..., R, T) with R * T = {total}"
    )


@dataclass
class ContextParallelShard:
    """One context-parallel rank's share of a packed batch.

    Token tensors keep HF shapes with the rows flattened into one THD row: ``input_ids`` / ``labels``
    (1, T/cp), ``position_ids`` (1, T/cp) or (K, 1, T/cp) for Qwen's 4-row mRoPE ids. ``index`` (T/cp,)
    gives each local token's position in the flattened packed buffer (row-major over (R, T)).

    ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen`` are the *global* values that Transformer Engine's
    THD context-parallel attention and Megatron's ``PackedSeqParams`` take; ``cu_seqlens_local`` =
    ``cu_seqlens_padded // cp_size`` (N+1,) delimits each sample's 2 chunks in the local buffer and
    ``max_seqlen_local`` its largest local length, for local varlen kernels and per-sample reductions.
    """

    index: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    cu_seqlens_local: torch.Tensor
    max_seqlen: int
    max_seqlen_local: int
    cp_size: int
    cp_rank: int
    cu_seqlens: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def select(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of any tensor in flattened packed order along ``dim``.

        For VLMs, shard the embeddings *after* the vision features are merged (``inputs_embeds``
        (1, T, H), ``dim=1``): a rank's chunks cut through images, so the vision tower cannot run on them.
        """
        return tensor.index_select(dim, self.index.to(tensor.device))

    def packed_seq_params_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Megatron's ``PackedSeqParams(qkv_format="thd", ...)`` under CP."""
        real = self.cu_seqlens if self.cu_seqlens is not None else self.cu_seqlens_padded
        return thd_params_kwargs(real.to(torch.int32), self.cu_seqlens_padded.to(torch.int32), self.max_seqlen)


_TOKEN_FIELDS = ("input_ids", "labels", "position_ids")


def _fields(batch: Any) -> dict[str, Any]:
    if isinstance(batch, Mapping):
        return dict(batch)
    if getattr(batch, "layout", "expanded") != "expanded":
        raise ValueError(
            f"cannot shard a {batch.layout!r} PackedBatch for context parallelism: its input_ids hold one "
            "placeholder per image, so tokens and positions do not line up. Shard after the model expands "
            "the images: index the merged embeddings (1, T, H) with "
            "context_parallel_index(batch.cu_seqlens_padded_expanded, cp_size, cp_rank) along dim 1."
        )
    out = {}
    for name in (*_TOKEN_FIELDS, "mm_token_type_ids", "cu_seqlens", "cu_seqlens_padded"):
        if getattr(batch, name, None) is not None:
            out[name] = getattr(batch, name)
    return out


def shard_for_context_parallel(
    batch: Any,
    cp_size: int,
    cp_rank: int,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    extra_keys: Iterable[str] = (),
    shift_labels: bool = False,
) -> ContextParallelShard:
    """Take context-parallel rank ``cp_rank``'s chunks of every sample of a packed batch.

    Args:
        batch: an expanded-layout ``PackedBatch`` (``input_ids``, ``labels``, ``position_ids``,
            ``mm_token_type_ids``, ``cu_seqlens``, ``cu_seqlens_padded``) or a mapping with any of those keys
            (``mm_token_type_ids`` goes to ``extra``). Token tensors are (R, T) or (T,);
            ``position_ids`` (R, T) or (K, R, T) (Qwen mRoPE: K = 4); ``cu_seqlens_padded`` (N+1,) offsets
            of each padded sample in the flattened R*T buffer (it partitions the buffer).
        cp_size: context-parallel size; 1 returns the whole batch in THD layout.
        cp_rank: this rank in the context-parallel group.
        cu_seqlens_padded: overrides ``batch["cu_seqlens_padded"]``.
        extra_keys: more token-last mapping keys / attributes to shard into ``extra`` (``loss_mask`` ...;
            for (1, T, H) embeddings use :meth:`ContextParallelShard.select`).
        shift_labels: roll ``labels`` left by one per sample (fill -100) before sharding, as the loss
            needs them under CP (the model's internal shift would cross chunk and rank boundaries).

    Returns:
        :class:`ContextParallelShard`.

    Raises:
        ValueError: a sample's padded length is not divisible by ``2 * cp_size`` (names the sample), or
            a tensor does not cover ``cu_seqlens_padded[-1]`` tokens.
    """
    cp_size = _as_int(cp_size, "cp_size", 1)
    cp_rank = _as_int(cp_rank, "cp_rank", 0, cp_size)
    fields = _fields(batch)
    cu_in = cu_seqlens_padded if cu_seqlens_padded is not None else fields.get("cu_seqlens_padded")
    if cu_in is None:
        raise ValueError("shard_for_context_parallel needs cu_seqlens_padded (in the batch or as argument)")
    index = context_parallel_index(cu_in, cp_size, cp_rank)
    cu = cu_in.to(torch.int64)
    total = int(cu[-1])
    lens = cu[1:] - cu[:-1]
    max_seqlen = int(lens.max()) if lens.numel() else 0
    cu_real = fields.get("cu_seqlens")
    if cu_real is not None:
        if cu_real.shape != cu_in.shape:
            raise ValueError(
                f"cu_seqlens has {cu_real.numel()} entries but cu_seqlens_padded {cu_in.numel()}: "
                "both must list the same N samples"
            )
        short = torch.nonzero((cu_real[1:] - cu_real[:-1]).to(torch.int64) > lens).flatten()
        if short.numel():
            i = int(short[0])
            raise ValueError(f"sample {i}: real length exceeds its padded length in cu_seqlens_padded")

    def take(value: torch.Tensor, name: str) -> torch.Tensor:
        view, dim = _token_view(value, total, name)
        if name == "labels" and shift_labels:
            view = roll_packed(view, cu.to(view.device), shifts=-1, fill=IGNORE_INDEX)
        return view.index_select(dim, index.to(view.device))

    out = {name: take(fields[name], name) for name in _TOKEN_FIELDS if fields.get(name) is not None}
    extra = {}
    if fields.get("mm_token_type_ids") is not None:
        extra["mm_token_type_ids"] = take(fields["mm_token_type_ids"], "mm_token_type_ids")
    for key in extra_keys:
        value = batch[key] if isinstance(batch, Mapping) else getattr(batch, key)
        extra[key] = take(value, key)
    return ContextParallelShard(
        index=index,
        cu_seqlens_padded=cu_in,
        cu_seqlens_local=(cu // cp_size).to(cu_in.dtype),
        max_seqlen=max_seqlen,
        max_seqlen_local=max_seqlen // cp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
        cu_seqlens=cu_real,
        extra=extra,
        **out,
    )


def gather_from_context_parallel(
    outputs_per_rank: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = -1
) -> torch.Tensor:
    """Put the outputs of all context-parallel ranks back into packed order (the inverse of sharding).

    Args:
        outputs_per_rank: ``cp_size`` tensors, rank order, each with T/cp tokens along ``dim``.
        cu_seqlens_padded: (N+1,) the offsets the batch was sharded with.
        dim: the token dim.

    Returns:
        One tensor with T tokens along ``dim`` in the flattened packed order (``.unflatten(dim, (R, T))``
        restores rows). Differentiable with respect to every input.
    """
    cp_size = len(outputs_per_rank)
    index = context_parallel_index(cu_seqlens_padded, cp_size)  # (cp, T/cp)
    if any(o.shape[dim] != index.shape[1] for o in outputs_per_rank):
        raise ValueError(
            f"every rank's output needs {index.shape[1]} tokens along dim {dim} "
            f"(cu_seqlens_padded[-1] // cp_size), got {[o.shape[dim] for o in outputs_per_rank]}"
        )
    stacked = torch.cat(list(outputs_per_rank), dim=dim)
    dim = dim % stacked.dim()
    shape = list(stacked.shape)
    out = stacked.new_empty(shape)
    return out.index_copy(dim, index.flatten().to(stacked.device), stacked)


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(size, rank)`` in ``group``; ``(1, 0)`` without an initialised process group (one process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_from_context_parallel(
    local_output: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    dim: int = -1,
) -> torch.Tensor:
    """All-gather every context-parallel rank's output and return it in packed order on every rank.

    Differentiable when ``local_output`` requires grad (``torch.distributed.nn`` all-gather: the gradient of
    each rank's tokens is summed back onto the rank that produced them), which makes it the K/V exchange of
    all-gather context-parallel attention.

    Args:
        local_output: (..., T/cp, ...) this rank's output, tokens along ``dim``.
        cu_seqlens_padded: (N+1,) the offsets the batch was sharded with.
        group: the context-parallel process group (default: world).
        dim: the token dim.
    """
    cp_size, _ = group_size_rank(group)
    if cp_size == 1:
        return gather_from_context_parallel([local_output], cu_seqlens_padded, dim)
    local_output = local_output.contiguous()
    if local_output.requires_grad and torch.is_grad_enabled():
        parts = list(_AllGatherWithGrad.apply(local_output, group).unbind(0))
    else:
        parts = [torch.empty_like(local_output) for _ in range(cp_size)]
        dist.all_gather(parts, local_output, group=group)
    return gather_from_context_parallel(parts, cu_seqlens_padded, dim)


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather -> (P, ...); backward sums every rank's gradient for this rank's slot.

    (``torch.distributed.nn.functional.all_gather`` cannot serve: on gloo its backward scatters with group
    ranks taken as global ranks and fails on any subgroup not containing global rank 0.)
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        size, _ = group_size_rank(group)
        out = local.new_empty((size, *local.shape))
        dist.all_gather(list(out.unbind(0)), local, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _, rank = group_size_rank(ctx.group)
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine.view(-1), grad.view(-1), group=ctx.group)
            return mine, None
        total = grad.clone()  # gloo has no reduce-scatter
        dist.all_reduce(total, group=ctx.group)
        return total[rank], None


# --------------------------------------------------------------------------------------------------------
# Distributed per-sample roll
# --------------------------------------------------------------------------------------------------------


def _exchange_with_neighbours(
    to_prev: torch.Tensor, to_next: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``to_prev`` to rank r - 1 and ``to_next`` to rank r + 1 of ``group`` in one
    ``batch_isend_irecv``; return (what r - 1 sent, what r + 1 sent), each shaped like the tensor sent
    the other way (unfilled on the first / last rank)."""
    cp_size, cp_rank = group_size_rank(group)
    wire = torch.uint8 if to_prev.dtype == torch.bool else to_prev.dtype  # gloo/NCCL send no bool
    to_prev, to_next = to_prev.to(wire).contiguous(), to_next.to(wire).contiguous()
    from_next, from_prev = torch.empty_like(to_prev), torch.empty_like(to_next)
    world = group if group is not None else dist.group.WORLD
    ops = []
    if cp_rank > 0:
        prev = dist.get_global_rank(world, cp_rank - 1)
        ops += [dist.P2POp(dist.isend, to_prev, prev, group), dist.P2POp(dist.irecv, from_prev, prev, group)]
    if cp_rank < cp_size - 1:
        nxt = dist.get_global_rank(world, cp_rank + 1)
        ops += [dist.P2POp(dist.isend, to_next, nxt, group), dist.P2POp(dist.irecv, from_next, nxt, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return from_prev, from_next


def roll_packed_context_parallel(
    tensor: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    shifts: int = -1,
    fill: int | float | bool = 0,
    dim: int = -1,
) -> torch.Tensor:
    """Shift every sample left by one on a context-parallel rank's shard, exchanging boundary tokens.

    The result, gathered over the group, equals the single-process per-sample roll of the packed tensor
    over ``cu_seqlens_padded``: ``[1, 2, 3 | 4, 5]`` -> ``[2, 3, fill | 5, fill]``. Local tokens shift in
    place; the last token of each chunk takes the first token of the next chunk of its sample, which is on
    rank ``r + 1`` (front chunks), on rank ``r - 1`` (back chunks) or, for the middle chunk pair of rank
    ``cp - 1``, local; the last token of every sample takes ``fill``. All samples' boundary tokens travel in
    one ``batch_isend_irecv`` (at most 2 sends and 2 receives per rank, whatever the number of samples).

    Args:
        tensor: (..., T/cp, ...) this rank's shard (labels, loss mask, token ids), tokens along ``dim``.
        cu_seqlens_padded: (N+1,) *global* padded sample offsets the batch was sharded with.
        group: the context-parallel group (default: world; without an initialised process group, CP = 1).
        shifts: must be -1 (the label shift).
        fill: value for each sample's last token (-100 for labels, 0 for a loss mask).
        dim: the token dim.

    Returns:
        The rolled shard, same shape and dtype (not differentiable: meant for labels and masks).
    """
    if shifts != -1:
        raise ValueError(f"roll_packed_context_parallel supports shifts=-1 (the label shift), got {shifts}")
    cp_size, cp_rank = group_size_rank(group)
    # Offsets are read on the host (free when the collator's CPU tensor is passed): no sync per call.
    cu = _check_cu_seqlens_padded(cu_seqlens_padded.cpu(), cp_size)
    x = tensor.movedim(dim, -1)
    if x.shape[-1] != int(cu[-1]) // cp_size:
        raise ValueError(
            f"tensor has {x.shape[-1]} tokens along dim {dim}, but this rank's shard of "
            f"cu_seqlens_padded[-1] = {int(cu[-1])} over cp_size = {cp_size} has {int(cu[-1]) // cp_size}"
        )
    local_cu = cu // cp_size
    chunk = (local_cu[1:] - local_cu[:-1]) // 2
    front_first = local_cu[:-1][chunk > 0]
    back_first = front_first + chunk[chunk > 0]
    front_first, back_first, back_last = (
        t.to(x.device) for t in (front_first, back_first, local_cu[1:][chunk > 0] - 1)
    )
    # Each sample's local tokens (its front then its back chunk) shift as one sample: only the chunk ends
    # are then wrong, and the front chunk end of rank cp-1 is already right (its next chunk, cp, is its own
    # back chunk). With cp_size 1 the local buffer is the whole row and this is the whole answer.
    out = roll_packed(x, local_cu.to(x.device), shifts=-1, fill=fill)
    if cp_size == 1 or front_first.numel() == 0:
        return out.movedim(-1, dim)
    recv_prev, recv_next = _exchange_with_neighbours(x[..., front_first], x[..., back_first], group)
    if cp_rank < cp_size - 1:
        out[..., back_first - 1] = recv_next.to(x.dtype)
    if cp_rank > 0:
        out[..., back_last] = recv_prev.to(x.dtype)
    if cp_rank == 0:
        out[..., back_last] = fill
    return out.movedim(-1, dim)


# --------------------------------------------------------------------------------------------------------
# Configuration checks
# --------------------------------------------------------------------------------------------------------


def check_parallel_config(
    cp: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    per_token_loss: bool = True,
    pad_to_multiple_of: int = 1,
    micro_batch_size: int = 1,
    packing: Literal["offline", "in_batch"] = "offline",
) -> int:
    """Reject packed-training configurations that silently corrupt data or the loss.

    Rules (Megatron Bridge; Megatron-LM multimodal ``get_padding``): CP > 1 needs per-token loss; each
    sample's padded length must be a multiple of 2 * CP (2 * CP * TP with sequence parallelism; TP with
    sequence parallelism and CP = 1);
    offline packing (rows packed ahead of time) needs micro batch size 1; in-batch packing (the micro-batch's
    samples packed into one row) needs micro batch size > 1.

    Returns:
        The pad multiple these settings require.

    Raises:
        ValueError: for each violated rule, with the fix. Warns (UserWarning) when per-token loss is off
        without CP (a per-micro-batch mean re-weights the samples of a pack) and when in-batch packing has
        micro batch size 1 (nothing to pack).
    """
    cp = _as_int(cp, "cp", 1)
    tp = _as_int(tp, "tp", 1)
    pad_to_multiple_of = _as_int(pad_to_multiple_of, "pad_to_multiple_of", 1)
    micro_batch_size = _as_int(micro_batch_size, "micro_batch_size", 1)
    if packing not in ("offline", "in_batch"):
        raise ValueError(f"packing must be 'offline' or 'in_batch', got {packing!r}")
    required = pad_multiple_for(tp=tp, cp=cp, sequence_parallel=sequence_parallel)
    if cp > 1 and not per_token_loss:
        raise ValueError(
            f"context parallelism (cp={cp}) requires per-token loss: each CP rank holds a different number "
            "of loss tokens, so averaging per rank re-weights tokens. Use vlm_pack.PerTokenLoss "
            "(Megatron: calculate_per_token_loss=True and ddp average_in_collective=False)."
        )
    if pad_to_multiple_of % required:
        parts = [f"2 * CP = {2 * cp}"] if cp > 1 else []
        if sequence_parallel and tp > 1:
            parts.append(f"TP = {tp}, as sequence parallelism splits every sequence over TP")
        why = " x ".join(parts)
        raise ValueError(
            f"pad_to_multiple_of={pad_to_multiple_of} is not a multiple of {required} ({why}): pad each "
            f"sample in the collator with pad_to_multiple_of={required} (or a multiple of it)"
        )
    if packing == "offline" and micro_batch_size != 1:
        raise ValueError(
            f"offline packing requires micro_batch_size=1, got {micro_batch_size}: each packed row already "
            "holds several samples and the packed-sequence metadata (cu_seqlens) describes one row; "
            "stacking rows silently corrupts the attention boundaries. Raise the pack size instead."
        )
    if packing == "in_batch" and micro_batch_size == 1:
        warnings.warn(
            "in-batch packing with micro_batch_size=1 packs each sample alone: nothing is gained "
            "(Megatron Bridge rejects it). Use micro_batch_size > 1, or offline packing.",
            UserWarning,
            stacklevel=2,
        )
    if not per_token_loss and cp == 1:
        warnings.warn(
            "per_token_loss=False with packing: a mean per micro-batch (or per rank) weights each token by "
            "1 / tokens in its pack, so packing changes the loss. Use vlm_pack.PerTokenLoss.",
            UserWarning,
            stacklevel=2,
        )
    return required
