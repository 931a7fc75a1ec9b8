"""Per-token loss over data-parallel x context-parallel ranks and gradient-accumulation micro-batches.

A loss averaged per rank or per micro-batch weights each token by ``1 / tokens in its rank's share``: packing
and context parallelism then change the loss (tokens of a full pack count less than those of a sparse one)::

    rank 0  pack of 4000 loss tokens   mean per rank: each token weighs 1 / 4000
    rank 1  pack of  500 loss tokens                  each token weighs 1 /  500   (8x more)
    per token (here): every token weighs 1 / 4500

:class:`PerTokenLoss` (and the one-call :func:`reduce_token_loss`) sum token losses and token counts over the
group and the micro-batches, so that the optimised loss is exactly ``sum of token losses / number of real
tokens`` of the whole step; :func:`token_cross_entropy` gives the sum and the count of one micro-batch.

Only ``torch.distributed`` is used (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist

from ..collate.labels import IGNORE_INDEX
from .context_parallel import group_size_rank

__all__ = ["PerTokenLoss", "reduce_token_loss", "token_cross_entropy"]


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of cross-entropy over the tokens whose label is not ``ignore_index``, and their number.

    Args:
        logits: (..., T, V) predictions for the *already shifted* ``labels`` (no internal shift: under CP
            use :func:`roll_packed_context_parallel` or ``shard_for_context_parallel(shift_labels=True)``).
        labels: (..., T) target ids.

    Returns:
        ``(loss_sum, num_tokens)``: float32 (float64 for float64 logits) scalar, differentiable, and the
        int64 token count.
    """
    flat_labels = labels.reshape(-1)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.dtype != torch.float64:  # low-precision logits: sum in float32
        flat_logits = flat_logits.float()
    loss_sum = torch.nn.functional.cross_entropy(
        flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (flat_labels != ignore_index).sum()


def _all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """SUM all-reduce of a small stats tensor (moved to the GPU and back when the backend is NCCL)."""
    if group_size_rank(group)[0] == 1:
        return values
    device = values.device
    wire = values.to("cuda", copy=True) if dist.get_backend(group) == "nccl" else values.clone()
    dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    return wire.to(device)


def reduce_token_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor | int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global per-token mean loss over ``group``: sum of all ranks' token losses / all ranks' tokens.

    One all-reduce of ``[loss_sum, num_tokens]`` (float64). The value is identical on every rank; its
    gradient on each rank is ``d loss_sum / total_tokens``, so *summing* gradients over ``group`` (Megatron
    with ``average_in_collective=False``) yields exactly the gradient of the global mean. With a gradient
    reduction that averages over the group (PyTorch DDP, FSDP) multiply the result by the group size, or
    use :class:`PerTokenLoss` which does it for you. A step without any loss token gives 0, not NaN.

    Args:
        loss_sum: scalar, this rank's sum of token losses (differentiable).
        num_tokens: this rank's number of loss tokens.
        group: the data-parallel x context-parallel group (default: world).
    """
    stats = torch.stack(
        [loss_sum.detach().double(), torch.as_tensor(num_tokens, device=loss_sum.device).double().reshape(())]
    )
    total_sum, total_tokens = _all_reduce_sum(stats, group).unbind()
    denom = total_tokens.clamp(min=1)
    local = loss_sum / denom.to(loss_sum.dtype)
    # value: the global mean; gradient: through this rank's sum only.
    return local - local.detach() + (total_sum / denom).to(loss_sum.dtype)


class PerTokenLoss:
    """Token-weighted loss over data-parallel x context-parallel ranks and gradient-accumulation steps.

    The optimised loss of a step is ``sum of every loss token's loss / number of loss tokens``, over all
    micro-batches of all ranks of ``group``: packing, CP sharding and unequal token counts between ranks or
    micro-batches re-weight nothing. Two ways to get the global token count:

    - counted ahead (labels are known before the forward; one all-reduce per step)::

          ptl = PerTokenLoss(group=dp_cp_group, grad_reduction="mean")  # PyTorch DDP averages gradients
          ptl.begin_step(sum(int((mb_labels != -100).sum()) for mb_labels in my_micro_batch_labels))
          for mb in micro_batches:
              loss_sum, n = token_cross_entropy(model(mb), mb_labels)
              ptl.loss_for_backward(loss_sum, n).backward()
          step_loss = ptl.end_step()  # global mean, for logging

    - deferred (Megatron ``calculate_per_token_loss``): ``ptl.begin_step()`` without a count, backward on
      the unnormalised sums, then ``ptl.end_step(model.parameters())`` divides the (reduced) gradients by
      the global token count.

    Args:
        group: the group the gradients are reduced over (data-parallel x context-parallel; default world).
        grad_reduction: ``"mean"`` if that reduction averages (DDP, FSDP), ``"sum"`` if it sums (Megatron
            with ``average_in_collective=False``, or a manual all-reduce SUM).
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, grad_reduction: Literal["mean", "sum"] = "mean"
    ) -> None:
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        self.group = group
        self.grad_reduction = grad_reduction
        self._global_tokens: int | None = None
        self._expected_local: int | None = None
        self._loss_sum: torch.Tensor | float = 0.0  # on the loss's device until end_step
        self._tokens: torch.Tensor | int = 0
        self._open = False

    @property
    def global_tokens(self) -> int | None:
        """Loss tokens of the current step over the whole group (known after ``begin_step(count)``)."""
        return self._global_tokens

    def _factor(self) -> float:
        return float(group_size_rank(self.group)[0]) if self.grad_reduction == "mean" else 1.0

    def begin_step(self, local_num_tokens: int | torch.Tensor | None = None) -> None:
        """Start an optimizer step; with this rank's token count of the whole step, all-reduce it now."""
        self._loss_sum, self._tokens, self._open = 0.0, 0, True
        self._global_tokens = self._expected_local = None
        if local_num_tokens is not None:
            count = torch.as_tensor(local_num_tokens, dtype=torch.float64).cpu()
            self._expected_local = int(count)
            self._global_tokens = int(_all_reduce_sum(count.reshape(1), self.group)[0])

    def loss_for_backward(self, loss_sum: torch.Tensor, num_tokens: int | torch.Tensor) -> torch.Tensor:
        """The micro-batch loss to call ``.backward()`` on; records it for :meth:`end_step`."""
        if not self._open:
            raise RuntimeError("call PerTokenLoss.begin_step() before loss_for_backward()")
        # Accumulate on the loss's device: a float()/int() here would stall the GPU once per micro-batch;
        # end_step reads both back once per step.
        self._loss_sum = self._loss_sum + loss_sum.detach().double()
        self._tokens = self._tokens + num_tokens
        scale = self._factor()
        if self._global_tokens is not None:
            scale /= max(self._global_tokens, 1)
        return loss_sum * scale

    def end_step(self, parameters: Iterable[torch.nn.Parameter] | None = None) -> torch.Tensor:
        """Finish the step: return the global per-token mean loss (float64 scalar, same on every rank).

        In deferred mode, divide the gradients of ``parameters`` by the global token count (after the
        gradient reduction or before it: the scaling is linear).
        """
        if not self._open:
            raise RuntimeError("call PerTokenLoss.begin_step() before end_step()")
        self._open = False
        device = self._loss_sum.device if isinstance(self._loss_sum, torch.Tensor) else None
        pair = [
            torch.as_tensor(x, dtype=torch.float64, device=device).reshape(())
            for x in (self._loss_sum, self._tokens)
        ]
        stats = torch.stack(pair).cpu()  # the step's one device-to-host copy
        local_tokens = int(stats[1])
        if self._expected_local is not None and self._expected_local != local_tokens:
            raise ValueError(
                f"begin_step counted {self._expected_local} loss tokens on this rank but the micro-batches "
                f"passed to loss_for_backward had {local_tokens}: count the same (shifted) labels"
            )
        total_sum, total_tokens = _all_reduce_sum(stats, self.group).unbind()
        if self._global_tokens is None:
            self._global_tokens = int(total_tokens)
            if parameters is None:
                raise ValueError(
                    "deferred PerTokenLoss (begin_step() without a token count) needs end_step(parameters) "
                    "to divide the gradients by the global token count"
                )
            inv = 1.0 / max(self._global_tokens, 1)
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(inv)
        return total_sum / total_tokens.clamp(min=1)
