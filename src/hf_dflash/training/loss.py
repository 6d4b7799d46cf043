"""The training forward and loss of a DFlash drafter (pure functions: the tests call them directly).

The draft runs all `N` blocks `[x_a, MASK x (B-1)]` of a sequence in one forward (`draft_training_forward`, the very
forward `speculative_generate` runs); `block_loss` puts the target's LM head on the supervised slots only, in
checkpointed chunks (memory does not grow with `N*B*V`), and weighs slot k by `w_k = exp(-(k-1)/gamma)`. A DFlash2
drafter adds the selector's K-way cross-entropy (`selector_cross_entropy`): the target's token among the slot's top-K
unary candidates, scored by the lattice after the true previous token (teacher forcing), as the public DFlash2
trainers do; a slot whose token is not a candidate adds nothing to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def draft_training_forward(
    draft: nn.Module, embed_tokens: nn.Module, features: torch.Tensor, batch: dict[str, Any], attention_mask: Any
) -> torch.Tensor:
    """All blocks of every sequence in one draft forward -> `[b, N*B, H]` (after the draft's final norm)."""
    with torch.no_grad():
        noise_embeds = embed_tokens(batch["noise_ids"])  # [b, N*B, H], frozen target embedding
    out = draft(
        noise_embeds=noise_embeds,
        context_hidden_states=features,
        position_ids=batch["position_ids"],
        attention_mask=attention_mask,
    )
    return out.last_hidden_state


@dataclass
class BlockLoss:
    """Summed weighted loss of a batch, and per-slot counts (`[B]`, slot 0 always 0): supervised slots, slots whose
    argmax is the label, and for DFlash2 slots whose label is among the selector's candidates (`in_candidates`,
    recall@K) and slots whose best lattice score, after the true previous token, is the label (`selector_correct`)."""

    weighted_sum: torch.Tensor
    correct: torch.Tensor
    supervised: torch.Tensor
    in_candidates: torch.Tensor | None = None
    selector_correct: torch.Tensor | None = None


@dataclass
class SelectorTerm:
    """DFlash2's selector loss beside the block loss: the drafter's `candidate_selector`, each slot's teacher-forced
    predecessor (the true previous token as a draft id, `[b, N*B]`, -1 outside the draft vocabulary) and the term's
    weight."""

    selector: nn.Module
    predecessor_ids: torch.Tensor
    weight: float = 1.0


def selector_cross_entropy(
    selector: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, predecessors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (`hidden` `[rows, H]`, `logits` `[rows, V_d]`, `labels` and `predecessors` `[rows]` draft ids): the
    K-way cross-entropy of the label among the row's candidates after its true predecessor (0 where the label is not
    a candidate: nothing the selector can choose), whether it is a candidate, and whether its score is the best."""
    unary, candidates = selector.candidates(selector.unary_logits(logits))  # [rows, K] each
    is_label = candidates == labels[:, None]
    found = is_label.any(-1)
    label_index = is_label.long().argmax(-1)  # 0 where not found (masked out)
    projected = selector.hidden_projection(hidden)  # [rows, R]
    scores = unary + selector.pairwise_scores(projected, predecessors[:, None], candidates)[:, 0]  # [rows, K]
    loss = F.cross_entropy(scores, label_index, reduction="none") * found
    return loss, found, found & (scores.argmax(-1) == label_index)


def block_loss(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    block_size: int,
    chunk_size: int = 1024,
    teacher_logits: torch.Tensor | None = None,
    distill_weight: float = 0.0,
    acceptance_weight: float = 0.0,
    teacher_ids: torch.Tensor | None = None,
    *,
    selector: SelectorTerm | None = None,
) -> BlockLoss:
    """`sum_k w_k * m_k * loss_k` over supervised slots, computed in checkpointed chunks of `chunk_size` slots.

    `head` maps hidden states to logits over the draft vocabulary (`DFlashForDrafting.draft_logits` with the target's
    LM head), whose indices `labels` use. `loss_k` is cross-entropy against `labels` (the target's tokens), or
    `(1 - d) * CE + d * KL(p_target || q)` with `teacher_logits` (`[b, N*B, V]`, the target's logits for the same
    token) and `d = distill_weight`; with `teacher_ids` (`[b, N*B, k]` draft-vocabulary indices) `teacher_logits` are
    `[b, N*B, k]` logits of those tokens only, and `p_target` is their softmax (the top-k renormalised). With `a = acceptance_weight`, the weights become `(1 - a) * w_k + a * C_k`, where
    `C_k` is slot k's share of the block's expected accepted length (`expected_length_shares`). With `selector`
    (DFlash2), `loss_k` also gains `selector.weight` times the selector's K-way cross-entropy (`selector_cross_entropy`).
    """
    weights = loss_weights.flatten()
    rows = torch.nonzero(weights > 0).flatten()  # only supervised slots reach the LM head
    slots = rows % block_size
    flat_hidden = hidden.flatten(0, 1)[rows]
    flat_labels = labels.flatten()[rows]
    flat_teacher = teacher_logits.flatten(0, 1)[rows] if teacher_logits is not None else None
    flat_teacher_ids = teacher_ids.flatten(0, 1)[rows] if teacher_ids is not None else None
    flat_predecessors = selector.predecessor_ids.flatten()[rows] if selector is not None else None
    losses, label_probs = [], []  # per supervised row, in order
    counts = torch.zeros(3, block_size, dtype=torch.long, device=hidden.device)  # correct, in candidates, selected
    for start in range(0, rows.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        teacher = flat_teacher[part] if flat_teacher is not None else None
        ids = flat_teacher_ids[part] if flat_teacher_ids is not None else None
        predecessors = flat_predecessors[part] if selector is not None else None
        loss, prob, *hits = checkpoint(
            _chunk_loss,
            flat_hidden[part],
            head,
            flat_labels[part],
            teacher,
            distill_weight,
            ids,
            selector,
            predecessors,
            use_reentrant=False,
        )
        losses.append(loss)
        label_probs.append(prob)
        for count, hit in zip(counts, hits):
            count += torch.bincount(slots[part][hit], minlength=block_size)
    row_weights = weights[rows]
    if acceptance_weight > 0:
        shares = expected_length_shares(
            torch.cat(label_probs) if label_probs else weights[:0], rows, weights.shape[0], block_size
        )
        row_weights = (1 - acceptance_weight) * row_weights + acceptance_weight * shares
    weighted_sum = hidden.sum() * 0.0  # touches every trainable parameter even when nothing is supervised
    if losses:
        weighted_sum = weighted_sum + (torch.cat(losses) * row_weights).sum()
    supervised = torch.bincount(slots, minlength=block_size)
    if selector is None:
        return BlockLoss(weighted_sum, counts[0], supervised)
    return BlockLoss(weighted_sum, counts[0], supervised, in_candidates=counts[1], selector_correct=counts[2])


@torch.no_grad()
def expected_length_shares(
    label_probs: torch.Tensor, rows: torch.Tensor, num_slots: int, block_size: int
) -> torch.Tensor:
    """`[rows]` weights `C_k = sum_{m >= k} prod_{j <= m} q_j` of supervised slots, `q_j` (`label_probs`) the draft's
    probability of the target's token at slot j of the same block (0 at an unsupervised slot: nothing after it is
    accepted).

    A block's expected accepted length is `E = sum_m prod_{j <= m} q_j`, and `dE = sum_k C_k * d log q_k`: a
    cross-entropy weighted by these (detached) `C_k` has exactly the gradient of `-E`, the acceptance-length objective
    (the "LK" losses of SpecForge and NeMo Automodel aim at the same quantity). `rows` are the supervised slots'
    indices among the `num_slots = b * N * B` slots.
    """
    accepted = torch.zeros(num_slots, dtype=torch.float32, device=label_probs.device)
    accepted[rows] = label_probs.float()
    accepted = accepted.view(-1, block_size)  # [blocks, B]
    accepted[:, 0] = 1.0  # the anchor is the last verified token: given
    prefix = accepted.cumprod(1)  # prod_{j <= m} q_j
    shares = prefix.flip(1).cumsum(1).flip(1)  # sum_{m >= k} prefix_m
    return shares.flatten()[rows].to(label_probs.dtype)


def _chunk_loss(hidden, head, labels, teacher_logits, distill_weight, teacher_ids, selector, predecessors):
    """Per row: the loss (CE, or CE mixed with the KL to the teacher, plus DFlash2's weighted selector CE), the draft's
    probability of the label (detached), whether its argmax is the label, and for DFlash2 whether the label is a
    candidate and whether the selector picks it."""
    logits = head(hidden).float()  # [rows, V_d]
    loss = F.cross_entropy(logits, labels, reduction="none")
    label_prob = (-loss).exp().detach()
    if teacher_logits is not None and distill_weight > 0:
        log_p = teacher_logits.float().log_softmax(-1)  # [rows, V_d], or [rows, k] over `teacher_ids`
        log_q = logits.log_softmax(-1)
        log_q = log_q if teacher_ids is None else log_q.gather(-1, teacher_ids)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        loss = (1 - distill_weight) * loss + distill_weight * kl
    hits = logits.argmax(-1) == labels
    if selector is None:
        return loss, label_prob, hits
    selector_loss, found, picked = selector_cross_entropy(selector.selector, hidden, logits, labels, predecessors)
    return loss + selector.weight * selector_loss, label_prob, hits, found, picked


def gather_at_slots(per_position: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[b, T, X]` values of every position -> `[b, N*B, X]`: the values at the position that predicts each slot's
    token (`a + k - 1`), e.g. the target's logits there."""
    block_positions = batch["position_ids"][:, batch["input_ids"].shape[1] :]
    source = (block_positions - 1).clamp(min=0, max=per_position.shape[1] - 1)
    return per_position.gather(1, source[..., None].expand(-1, -1, per_position.shape[-1]))


__all__ = [
    "BlockLoss",
    "SelectorTerm",
    "block_loss",
    "draft_training_forward",
    "expected_length_shares",
    "gather_at_slots",
    "selector_cross_entropy",
]
