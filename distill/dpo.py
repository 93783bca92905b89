"""DPO (sigmoid loss) and the sequence log-probabilities it needs (the published recipe: beta 0.01).

With ``pi`` the policy, ``ref`` the frozen reference and ``log p(y | x)`` summed over the completion tokens:

    r_c = beta * (log pi(y_c | x) - log ref(y_c | x)),   r_r = beta * (log pi(y_r | x) - log ref(y_r | x))
    loss = mean over pairs of -log sigmoid(r_c - r_r)

The logged metrics use trl's names and definitions (batch means): ``rewards/chosen`` = mean r_c,
``rewards/rejected`` = mean r_r, ``rewards/accuracies`` = fraction with r_c > r_r,
``rewards/margins`` = mean (r_c - r_r), ``logps/chosen`` / ``logps/rejected`` = mean policy log-probs.
``tests/test_dpo.py`` checks all of them against trl 1.16's ``DPOTrainer`` on the same log-probs.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from hybridlm.config.errors import ConfigError

IGNORE_INDEX = -100
METRIC_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Sigmoid DPO loss (a scalar with gradient through the policy log-probs) and trl-style metrics.

    All four inputs are ``(batch,)`` sequence log-probabilities (sums over completion tokens, e.g. from
    :func:`sequence_logps`); the reference ones are treated as constants.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ConfigError(f"beta: expected a positive number, got {beta!r}")
    shapes = {t.shape for t in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)}
    if len(shapes) != 1 or policy_chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss: expected four (batch,) tensors of one shape, got {sorted(map(tuple, shapes))}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()
    loss = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()

    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios.detach()
        rejected_rewards = beta * rejected_logratios.detach()
        metrics = {
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
            "logps/chosen": policy_chosen_logps.detach().mean().item(),
            "logps/rejected": policy_rejected_logps.detach().mean().item(),
        }
    return loss, metrics


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor,
                   loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum of the log-probabilities of the completion tokens of each sequence, shape ``(batch,)``.

    ``logits`` is ``(batch, T, vocab)`` and ``labels`` ``(batch, T)`` aligned with the inputs, as for a
    causal LM: the logits at position ``t`` score ``labels[:, t + 1]``. Positions whose label is -100
    (prompt, padding) are left out; ``loss_mask`` (``(batch, T)``, aligned with ``labels``, 1 = count)
    can restrict the sum further. Computed in float32 (or the logits' dtype if wider).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"sequence_logps: expected logits (B, T, V) and labels (B, T), "
                         f"got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(f"sequence_logps: loss_mask {tuple(loss_mask.shape)} must match labels {tuple(labels.shape)}")
    logits = logits[:, :-1]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    if loss_mask is not None:
        mask = mask & loss_mask[:, 1:].bool()
    safe = targets.masked_fill(~mask, 0)
    token_logps = torch.gather(logits, 2, safe.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (token_logps * mask).sum(dim=1)
