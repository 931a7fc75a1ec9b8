"""Mixture-of-experts routers on packed rows: statistics and the auxiliary loss over real tokens only.

A packed row carries padding (each sample's pad to a multiple, the row's tail). The router still routes every
padding token (routing is per token, so padding never changes a real token's experts or output), but
transformers' auxiliary loss counts every routed token unless it is given a 2-D ``attention_mask`` (Megatron-
Bridge #5470)::

    row        a0 a1 a2 _  b0 b1 _  _          (_ = padding)
    real       1  1  1  0  1  1  0  0          batch.real_tokens(): [R, T]
    counted    a0 a1 a2    b0 b1               the model's aux loss or this module, as for the samples alone

One path per family (transformers 5.24):

    family        path                                   why
    qwen3_5_moe   automatic: the model's own aux_loss    its text model takes a mask mapping, so model_inputs
                  (Family.experts, batch.model_inputs)   passes a MaskMapping whose reshape() is real_tokens
    glm4v_moe     this module, in place of aux_loss      its text model hands attention_mask to
                                                         create_causal_mask, which takes no mapping and
                                                         turns a 2-D mask into one causal span over the row
                                                         (the samples attend across each other)
    glm46v        this module (its only aux loss)        Glm46VForConditionalGeneration computes none and
                                                         refuses output_router_logits

:func:`record_router_logits` reads the router logits of a forward call (GLM-4.6V gives them no other way);
:func:`expert_load` gives the router statistics (the share of top-k assignments and the mean routing
probability of each expert) over real tokens; :func:`load_balancing_loss` the auxiliary loss transformers'
``load_balancing_loss_func`` (``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py``, which GLM-4.5V's
``modeling_glm4v_moe.py`` copies) computes, with exactly those statistics. Each equals the value computed
over the samples run alone, padding-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["expert_load", "load_balancing_loss", "record_router_logits"]


#: Router modules whose forward returns ``(router_logits [N, E], weights, indices)`` (transformers 5.6.x: the
#: ``router_logits`` alone): GLM-4.5V's text model, which GLM-4.6V's checkpoints use too
#: (``models/glm4v_moe/modeling_glm4v_moe.py``).
ROUTERS = ("Glm4vMoeTextTopkRouter",)


@contextmanager
def record_router_logits(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The router logits of the forward calls made inside the block, one ``[R*T, E]`` tensor per MoE layer
    and call, in call order (forward hooks on the routers; removed on exit)::

        with record_router_logits(model) as logits:
            out = model(**batch.model_inputs("sdpa"))
        loss = out.loss + coef * load_balancing_loss(logits, batch.real_tokens(), experts, top_k)

    Raises ValueError on a model with no router vlm-pack knows (:data:`ROUTERS`).
    """
    routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no mixture-of-experts router vlm-pack reads ({', '.join(ROUTERS)}); "
            "call the model with output_router_logits=True and pass outputs.router_logits instead."
        )
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: seen.append(out if torch.is_tensor(out) else out[0])) for r in routers]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


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
        router_logits: one ``[R*T, E]`` tensor per MoE layer (:func:`record_router_logits`, or
            ``outputs.router_logits`` of a forward call with ``output_router_logits=True``).
        real_tokens: ``[R, T]`` 1 on real tokens, 0 on padding (:meth:`PackedBatch.real_tokens`).
        top_k: experts per token (``config.text_config.num_experts_per_tok``).

    Returns:
        float32 ``[E]`` each: the fraction of top-k assignments that went to each expert and the mean softmax
        routing probability of each expert, averaged over real tokens and layers (as transformers does).
    """
    if not router_logits:
        raise ValueError(
            "no router logits: read them with record_router_logits(model), or call the model with "
            "output_router_logits=True"
        )
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
    (GLM-4.5V's counts padding on packed rows; GLM-4.6V has none). Qwen3.5-MoE needs none of this: its own
    ``aux_loss`` already counts real tokens only (see the module docstring).
    """
    tokens, prob = expert_load(router_logits, real_tokens, top_k)
    if tokens.numel() != num_experts:
        raise ValueError(f"router logits score {tokens.numel()} experts, num_experts={num_experts}")
    return (tokens * prob).sum() * num_experts
