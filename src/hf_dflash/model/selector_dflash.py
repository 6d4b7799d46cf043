"""DFlash2's two additions to the DFlash drafter: the sublayer convolution and the candidate selector.

Notation: `b` rows, `L` block slots in one forward (B at inference, N*B in training), `H` hidden size, `T` taps
(`conv_kernel_size`), `G = H / conv_group_size` coefficient groups, `S` drafted slots, `K` candidates per slot
(`selector_top_k`), `R` selector rank, `V_d` the draft vocabulary (the whole vocabulary unless reduced).

**Convolution.** Around the input and the output of every attention and MLP sublayer:
`conv(x)[t, c] = sum_tau (base[tau, c] + D[t, tau, c // gs]) * x[t - tau, c]`, strictly inside the block (`x[t - tau]`
is zero when it lies before the block's first slot). The dynamic coefficients `D` (`[b, L, 2, T, G]`, side 0 for the
input, side 1 for the output) are projected from the sublayer's normed input, and both sides use them. With
`base[:, 0] = 1`, the other taps and the projection zero, the convolution is the identity.

**Selector.** The unary logits `u = softcap(z * output_multiplier)` of the target's head keep their top K per slot
(values `U`, draft ids `C`). A pair of consecutive choices scores
`S[i, p, c] = U[i, c] + sum_r A[pred_p, r] * P[i, r] * Bc[C[i, c], r]`, with `P = hidden_projection(h_i)`, `A` and
`Bc` the predecessor and successor codebooks (`[V_d, R]`) and `pred_p` the previous slot's candidate p (the anchor
for the first slot: every row the same). A token outside the draft vocabulary (an anchor can be one) has a zero
predecessor row. The chain is walked left to right, each step conditioned on its own previous choice: greedy takes
each row's argmax, sampling draws from `softmax(row / temperature)`, which is the proposal's distribution `q` (zero
outside the K candidates). A zero successor codebook makes `S = U`: the walk then proposes the unary argmax, v1's
proposals.

This file is copied next to the weights by `save_pretrained`; it imports only torch, transformers and the standard
library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .configuration_dflash import DFlashConfig


def block_causal_shift(x: torch.Tensor, tau: int, block_size: int) -> torch.Tensor:
    """`x[..., t - tau, :]` at slot t of each block of `block_size` slots, zero where that lies before the block."""
    if tau == 0:
        return x
    if x.shape[1] % block_size == 0:  # whole blocks (always, in drafting and training): shift inside each block
        blocks = x.unflatten(1, (-1, block_size))  # [b, n, B, ...]
        pad = [0, 0] * (x.dim() - 2) + [tau, 0]  # F.pad's order: last dimension first; zeros before each block
        return torch.nn.functional.pad(blocks[:, :, :-tau], pad).flatten(1, 2)
    shifted = torch.cat([torch.zeros_like(x[:, :tau]), x[:, :-tau]], dim=1)  # [b, L, ...], the first tau rows zero
    slot_in_block = torch.arange(x.shape[1], device=x.device) % block_size
    inside = (slot_in_block >= tau).to(x.dtype)
    return shifted * inside.view(1, -1, *([1] * (x.dim() - 2)))


def reindex_rows(rows: torch.Tensor, old_token_ids: torch.LongTensor, new_token_ids: torch.LongTensor) -> torch.Tensor:
    """`[len(old), R]` rows of the sorted target ids `old_token_ids` -> `[len(new), R]` rows of `new_token_ids`: a token
    in both keeps its row, a token new to the vocabulary gets a zero row (a codebook row with no pairwise score)."""
    index = torch.searchsorted(old_token_ids, new_token_ids).clamp(max=old_token_ids.shape[0] - 1)
    kept = old_token_ids[index] == new_token_ids
    return rows[index] * kept[:, None].to(rows.dtype)


class DFlashSublayerConv(nn.Module):
    """DFlash2's grouped dynamic causal depthwise convolution around one sublayer (its input and its output).

    `base_kernel` `[2, T, H]` (side, tap, channel); `kernel_projection` maps the sublayer's normed input to the dynamic
    coefficients `[2 * T * G]` per slot.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_taps = config.conv_kernel_size
        self.group_size = config.conv_group_size
        self.num_groups = config.hidden_size // config.conv_group_size
        self.block_size = config.block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.num_taps, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.num_taps * self.num_groups, bias=False)

    def coefficients(self, normed: torch.Tensor) -> torch.Tensor:
        """`[b, L, H]` normed sublayer input -> `[b, L, 2, T, G]` dynamic coefficients of both sides."""
        return self.kernel_projection(normed).unflatten(-1, (2, self.num_taps, self.num_groups))

    def forward(self, x: torch.Tensor, coefficients: torch.Tensor, side: int) -> torch.Tensor:
        """Convolve `x` `[b, L, H]` on `side` (0: the sublayer's input, 1: its output) -> `[b, L, H]`."""
        grouped = x.unflatten(-1, (self.num_groups, self.group_size))  # [b, L, G, gs]
        kernel = self.base_kernel[side].view(self.num_taps, self.num_groups, self.group_size).to(x.dtype)
        out = None
        for tau in range(self.num_taps):
            weight = kernel[tau] + coefficients[:, :, side, tau, :, None]  # [b, L, G, gs]
            term = weight * block_causal_shift(grouped, tau, self.block_size)
            out = term if out is None else out + term
        return out.flatten(-2)


class DFlashCandidateSelector(nn.Module):
    """DFlash2's candidate selector: a hidden projection `[R, H]` and two codebooks `[V_d, R]` over draft ids.

    The codebooks are bare parameters (no `.weight`), as the published checkpoints name them.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        vocabulary = config.draft_vocab_size or config.vocab_size
        self.top_k = config.selector_top_k
        self.output_multiplier = config.output_multiplier
        self.softcap = config.final_logit_softcapping or None
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocabulary, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocabulary, config.selector_rank))

    @torch.no_grad()
    def move_codebook_rows(self, old_token_ids: torch.LongTensor, new_token_ids: torch.LongTensor) -> None:
        """Re-index both codebooks from the draft vocabulary `old_token_ids` to `new_token_ids` (`reindex_rows`)."""
        for name in ("predecessor_codebook", "successor_codebook"):
            old = getattr(self, name)
            rows = reindex_rows(old, old_token_ids, new_token_ids)
            setattr(self, name, nn.Parameter(rows, requires_grad=old.requires_grad))

    def unary_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`u = cap * tanh(z * output_multiplier / cap)` (no cap: `z * output_multiplier`), in fp32."""
        unary = logits.float() * self.output_multiplier
        return unary if self.softcap is None else self.softcap * torch.tanh(unary / self.softcap)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor]:
        """`[..., V_d]` unary logits -> the top K: values `U` and draft ids `C`, `[..., K]` each (best first)."""
        return unary.topk(min(self.top_k, unary.shape[-1]), dim=-1)

    def predecessor_rows(self, draft_ids: torch.LongTensor) -> torch.Tensor:
        """`[...]` draft ids (-1: outside the draft vocabulary) -> `[..., R]` predecessor codes (zero for -1)."""
        rows = self.predecessor_codebook[draft_ids.clamp(min=0)]
        return rows * (draft_ids >= 0)[..., None].to(rows.dtype)

    def pairwise_scores(
        self, projected: torch.Tensor, predecessor_ids: torch.LongTensor, candidate_ids: torch.LongTensor
    ) -> torch.Tensor:
        """`sum_r A[pred, r] * P[r] * Bc[c, r]`: `projected` `[..., R]`, `predecessor_ids` `[..., Pr]`, `candidate_ids`
        `[..., K]` -> `[..., Pr, K]` (fp32)."""
        gated = self.predecessor_rows(predecessor_ids).float() * projected.float()[..., None, :]  # [..., Pr, R]
        successors = self.successor_codebook[candidate_ids].float()  # [..., K, R]
        return gated @ successors.transpose(-1, -2)

    def lattice(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_draft_ids: torch.LongTensor
    ) -> SelectorLattice:
        """Every pairwise score of a drafted block: `hidden` `[b, S, H]` (after the final norm), `logits` `[b, S, V_d]`
        (the target head's), `anchor_draft_ids` `[b]` (-1 outside the draft vocabulary)."""
        all_unary = self.unary_logits(logits)  # [b, S, V_d]
        unary, candidate_ids = self.candidates(all_unary)  # [b, S, K] each
        candidate_mass = (unary - all_unary.logsumexp(-1, keepdim=True)).exp().sum(-1)  # [b, S]
        previous = torch.cat(
            [anchor_draft_ids[:, None, None].expand(-1, 1, unary.shape[-1]), candidate_ids[:, :-1]], 1
        )
        projected = self.hidden_projection(hidden)  # [b, S, R]
        scores = unary[..., None, :] + self.pairwise_scores(projected, previous, candidate_ids)  # [b, S, K, K]
        return SelectorLattice(
            candidate_ids=candidate_ids, unary_scores=unary, scores=scores, candidate_mass=candidate_mass
        )


@dataclass
class SelectorLattice:
    """A drafted block's candidates and scores: `candidate_ids` `[b, S, K]` (draft ids, best unary first), their unary
    logits `unary_scores` `[b, S, K]`, and `scores` `[b, S, K, K]`, `scores[:, i, p, c]` for candidate c of slot i after
    candidate p of slot i - 1 (slot 0's rows all follow the anchor). `candidate_mass` `[b, S]` is the share of each
    slot's unary softmax (over the whole draft vocabulary) that its K candidates hold: a walk's softmax over the
    candidates alone sums to one, so how likely a slot's right token is among them at all is this."""

    candidate_ids: torch.LongTensor
    unary_scores: torch.Tensor
    scores: torch.Tensor
    candidate_mass: torch.Tensor

    def transition_probs(self) -> torch.Tensor:
        """`[b, S, K, K]` each candidate's probability after its parent's: its row's softmax times its slot's
        `candidate_mass` (the softmax over the K candidates alone sums to one, however often the right token is
        among them)."""
        return self.scores.softmax(-1) * self.candidate_mass[..., None, None]


@dataclass
class SelectorChain:
    """The walked chain: `draft_ids` `[b, S]`, the index of each choice among its slot's candidates `choices` `[b, S]`,
    the row each choice was made from `row_scores` `[b, S, K]` (the walk's logits over the candidates), and, from the
    lattice and independent of the walk's choices, the slots' unary logits `unary_scores` `[b, S, K]` and their
    `candidate_mass` `[b, S]` (`SelectorLattice`)."""

    draft_ids: torch.LongTensor
    choices: torch.LongTensor
    row_scores: torch.Tensor
    unary_scores: torch.Tensor
    candidate_mass: torch.Tensor

    def proposal_probs(self, temperature: float = 1.0) -> torch.Tensor:
        """`[b, S, K]` the walk's distribution over each slot's candidates, `softmax(row / temperature)`."""
        return (self.row_scores / temperature).softmax(-1)

    def chosen_probs(self) -> torch.Tensor:
        """`[b, S]` each choice's probability in its row at temperature 1 times its slot's `candidate_mass` (a greedy
        chain's confidence)."""
        return self.proposal_probs().gather(-1, self.choices[..., None])[..., 0] * self.candidate_mass

    def unary_confidence(self, temperature: float = 1.0) -> torch.Tensor:
        """`[b, S]` each slot's most likely candidate's probability under its unary logits alone, times its
        `candidate_mass`: known before any choice is drawn, so a sampled chain's length can be planned from it without
        biasing what is sampled."""
        return (self.unary_scores / temperature).softmax(-1).amax(-1) * self.candidate_mass


def walk_lattice(lattice: SelectorLattice, temperature: float | None = None) -> SelectorChain:
    """Walk one chain left to right, each slot conditioned on the walk's own previous choice: the row's argmax
    (`temperature` `None` or 0), or a sample of `softmax(row / temperature)`."""
    candidate_ids, scores = lattice.candidate_ids, lattice.scores
    batch, num_slots, num_candidates = candidate_ids.shape
    previous = torch.zeros(batch, 1, 1, dtype=torch.long, device=scores.device)  # slot 0: every row is the anchor's
    choices, rows = [], []
    for slot in range(num_slots):
        row = scores[:, slot].gather(1, previous.expand(-1, 1, num_candidates))[:, 0]  # [b, K]
        if temperature:
            choice = torch.multinomial((row / temperature).softmax(-1), 1)  # [b, 1]
        else:
            choice = row.argmax(-1, keepdim=True)
        choices.append(choice)
        rows.append(row)
        previous = choice[:, :, None]
    choices = torch.cat(choices, dim=1)  # [b, S]
    draft_ids = candidate_ids.gather(-1, choices[..., None])[..., 0]
    return SelectorChain(draft_ids, choices, torch.stack(rows, dim=1), lattice.unary_scores, lattice.candidate_mass)


__all__ = [
    "DFlashCandidateSelector",
    "DFlashSublayerConv",
    "SelectorChain",
    "SelectorLattice",
    "block_causal_shift",
    "reindex_rows",
    "walk_lattice",
]
