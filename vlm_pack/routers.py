"""Mixture-of-experts routers on packed rows: statistics and the auxiliary loss over real tokens only.

A packed row carries padding (each sample's pad to a multiple, the row's tail). The router still routes every
padding token (routing is per token, so padding never changes a real token's experts or output), but
transformers' auxiliary loss counts every routed token unless it is given a 2-D ``attention_mask``, and packed
rows are given none (the sample boundaries come from the position ids): padding then enters the expert
counts and the balance loss (Megatron-Bridge #5470)::

    row        a0 a1 a2 _  b0 b1 _  _          (_ = padding)
    real       1  1  1  0  1  1  0  0          batch.real_tokens(): [R, T]
    counted    a0 a1 a2    b0 b1               every statistic below, as for the samples alone

:func:`expert_load` gives the router statistics (the share of top-k assignments and the mean routing
probability of each expert) over real tokens; :func:`load_balancing_loss` the auxiliary loss transformers'
``load_balancing_loss_func`` (``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py``, which GLM-4.5V's
``modeling_glm4v_moe.py`` imports) computes, with exactly those statistics. Each equals the value computed
over the samples run alone, padding-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["expert_load", "load_balancing_loss"]


def _flat_mask(real_tokens: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    mask = real_tokens.reshape(-1).to(device=device, dtype=torch.float32)
    if mask.numel() != rows:
        raise ValueError(
            f"router logits have {rows} rows but real_tokens has {mask.numel()} entries: pass the "
            "batch's real_tokens() of the same model call (rows flattened as the model flattens them)."
        )
    return mask


def expert_load(
    router_logits: Sequence[torch.Tensor], real_tokens: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router statistics of real tokens, summed over the MoE layers: ``(tokens_per_expert, prob_per_expert)``.

    Args:
        router_logits: one ``[R*T, E]`` tensor per MoE layer (``outputs.router_logits`` of a forward call with
            ``output_router_logits=True``).
        real_tokens: ``[R, T]`` 1 on real tokens, 0 on padding (:meth:`PackedBatch.real_tokens`).
        top_k: experts per token (``config.text_config.num_experts_per_tok``).

    Returns:
        float32 ``[E]`` each: the fraction of top-k assignments that went to each expert and the mean softmax
        routing probability of each expert, averaged over real tokens and layers (as transformers does).
    """
    if not router_logits:
        raise ValueError("no router logits: call the model with output_router_logits=True")
    device = router_logits[0].device
    mask = _flat_mask(real_tokens, router_logits[0].shape[0], device)
    experts = router_logits[0].shape[-1]
    assigned = torch.zeros(experts, dtype=torch.float32, device=device)
    prob = torch.zeros(experts, dtype=torch.float32, device=device)
    for layer in router_logits:
        weights = torch.softmax(layer.to(device).float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        assigned = assigned.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        prob = prob + (weights * mask[:, None]).sum(0)
    count = mask.sum() * len(router_logits)
    return assigned / count, prob / count


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor], real_tokens: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """The Switch-Transformer balance loss of real tokens only: ``E * sum_e tokens_e * prob_e``.

    Shapes as in :func:`expert_load`; a scalar, differentiable in the router logits. Add
    ``config.text_config.router_aux_loss_coef`` times it to the loss in place of the model's own ``aux_loss``
    (which, on packed rows, counts padding).
    """
    tokens, prob = expert_load(router_logits, real_tokens, top_k)
    if tokens.numel() != num_experts:
        raise ValueError(f"router logits score {tokens.numel()} experts, num_experts={num_experts}")
    return (tokens * prob).sum() * num_experts
