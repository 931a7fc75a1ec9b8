"""The metric of packed-vs-batched equivalence, and the per-token log-probs it compares.

::

    logp[t] = log_softmax(logits[t])[x[t+1]]                     next_token_logprobs
    token_mult_prob_error = mean_t exp(|logp_a[t] - logp_b[t]|)  1.0 = identical

``token_mult_prob_error`` is NeMo-RL's metric (``nemo_rl/algorithms/loss/loss_functions.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["next_token_logprobs", "token_mult_prob_error"]


def token_mult_prob_error(
    logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """NeMo-RL's ``token_mult_prob_error``: ``sum(mask * exp(|a - b|)) / sum(mask)``; 1.0 is exact.

    Args:
        logp_a, logp_b: per-token log-probs of the same tokens, any equal shapes.
        mask: weights of the same shape (1 = real token, 0 = ignore); ``None`` weighs every token 1.

    Returns:
        A float64 scalar tensor >= 1.0 (``exp(|dlogp|)`` averaged: 1.001 means probabilities off by ~0.1%).
    """
    if logp_a.shape != logp_b.shape:
        raise ValueError(f"logp_a {tuple(logp_a.shape)} and logp_b {tuple(logp_b.shape)} differ in shape")
    mask = torch.ones_like(logp_a, dtype=torch.float64) if mask is None else mask.to(torch.float64)
    if mask.shape != logp_a.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match the log-probs {tuple(logp_a.shape)}")
    total = mask.sum()
    if total <= 0:
        raise ValueError("token_mult_prob_error: the mask selects no token")
    err = torch.exp((logp_a.double() - logp_b.double()).abs())
    # where() rather than a bare product: exp(inf) * 0 on an ignored token would be nan.
    return torch.where(mask != 0, err * mask, torch.zeros_like(err)).sum() / total


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob each position gives the token that follows it: ``out[..., t] = logp(x[t+1] | logits[t])``.

    Args:
        logits: (R, T, V) any float dtype (computed in float32).
        input_ids: (R, T) the tokens the logits were computed on.

    Returns:
        (R, T) float32; the last column (no next token) is 0. Sample boundaries are the caller's business:
        in a packed row, the last token of one sample "predicts" the first of the next and must be dropped.
    """
    if logits.shape[:-1] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    head = logits[..., :-1, :].float()
    target = input_ids[..., 1:].unsqueeze(-1).to(logits.device)
    # gather - logsumexp: no (R, T, V) log_softmax copy.
    logp = head.gather(-1, target).squeeze(-1) - torch.logsumexp(head, dim=-1)
    return F.pad(logp, (0, 1))
