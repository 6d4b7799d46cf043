"""Training batches for DFlash: random anchors, noise blocks, same-position labels, loss weights and the block mask.

The method is DFlash's (arXiv:2602.06036). Notation: a sequence `x` of length `T` with a loss mask over its response
tokens; `N` anchors per sequence; block size `B`. Block `j` is `[x_a, MASK x (B-1)]` at positions `a .. a+B-1` (`a` =
anchor `j`); slot `k` (1..B-1) is trained to predict `x_{a+k}` (same position: no shift), slot 0 carries no loss.

Visibility (query = block slot, key = context position `t` or block slot), decided by positions:
- context keys `t < a` only (strictly before the anchor: at inference the anchor is the bonus token, whose target
  features do not exist yet);
- its own block, both ways; no other block;
- a padded block (no valid anchor) sees nothing and has no loss.

The draft's keys are laid out `[context (T) ; all blocks (N*B)]`, which is what `DFlashForDrafting.forward` builds
from `context_hidden_states` and `noise_embeds`.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

IGNORE_INDEX = -100
# Paper (and public trainers): loss decay gamma per block size; other sizes fall back to `block_size / 2`.
DEFAULT_LOSS_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_loss_decay_gamma(block_size: int) -> float:
    """The paper's `gamma` for `w_k = exp(-(k-1)/gamma)`: 7 at B=16, 5 at B=10, 4 at B=8, else `B / 2`."""
    return DEFAULT_LOSS_DECAY_GAMMA.get(block_size, block_size / 2)


def slot_loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """`[B]` weights `w_k = exp(-(k-1)/gamma)` for slots k = 1..B-1; slot 0 (the anchor) gets 0."""
    slots = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions `a` where the anchor and its next token are both supervised (response tokens)."""
    supervised = loss_mask.bool()
    return torch.nonzero(supervised[:-1] & supervised[1:]).flatten()


def dense_block_mask(
    anchor_positions: torch.Tensor,
    anchor_valid: torch.Tensor,
    token_mask: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`[b, 1, N*B, T + N*B]` boolean mask (True = visible) of the module docstring's rule; with `sliding_window` a
    slot at position `p` also sees only context positions `t > p - sliding_window` (the draft's sliding layers)."""
    batch, num_anchors = anchor_positions.shape
    seq_len = token_mask.shape[1]
    query_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [b, N*B]
    query_valid = anchor_valid.repeat_interleave(block_size, dim=1)  # [b, N*B]
    context = torch.arange(seq_len, device=anchor_positions.device)
    sees_context = (context[None, None, :] < query_anchor[:, :, None]) & token_mask.bool()[:, None, :]  # [b, NB, T]
    if sliding_window is not None:
        query_position = query_anchor + torch.arange(block_size, device=context.device).repeat(num_anchors)
        sees_context &= query_position[:, :, None] - context[None, None, :] < sliding_window
    query_block = torch.arange(num_anchors * block_size, device=anchor_positions.device) // block_size
    own_block = query_block[:, None] == query_block[None, :]  # [NB, NB]
    sees_block = own_block[None].expand(batch, -1, -1)
    visible = torch.cat([sees_context, sees_block], dim=-1) & query_valid[:, :, None]
    return visible[:, None]


def flex_block_mask(
    anchor_positions: torch.Tensor,
    anchor_valid: torch.Tensor,
    token_mask: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> Any:
    """The same rule as `dense_block_mask`, as a flex-attention `BlockMask` (for `attn_implementation="flex_attention"`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, shape = flex_mask_mod(anchor_positions, anchor_valid, token_mask, block_size, sliding_window)
    return create_block_mask(mask_mod, B=shape[0], H=None, Q_LEN=shape[1], KV_LEN=shape[2], device=token_mask.device)


def flex_mask_mod(
    anchor_positions: torch.Tensor,
    anchor_valid: torch.Tensor,
    token_mask: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> tuple[Any, tuple[int, int, int]]:
    """A flex `mask_mod(b, h, q_idx, kv_idx)` for the block rule, and its `(batch, Q_LEN, KV_LEN)`."""
    batch, num_anchors = anchor_positions.shape
    seq_len = token_mask.shape[1]
    token_mask = token_mask.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        block = (q_idx // block_size).clamp(max=num_anchors - 1)  # flex pads indices past the end: clamp
        in_context = kv_idx < seq_len
        anchor = anchor_positions[b, block]
        context_visible = (kv_idx < anchor) & token_mask[b, kv_idx.clamp(max=seq_len - 1)]
        if sliding_window is not None:
            context_visible = context_visible & (anchor + q_idx % block_size - kv_idx < sliding_window)
        block_visible = (kv_idx - seq_len) // block_size == block
        return anchor_valid[b, block] & torch.where(in_context, context_visible, block_visible)

    return mask_mod, (batch, num_anchors * block_size, seq_len + num_anchors * block_size)


@dataclass
class DataCollatorForDFlash:
    """Pads sequences and samples DFlash training blocks.

    Features: dicts with `input_ids` and `loss_mask` (1 on response tokens), as written by `hf_dflash.data.regenerate`.
    With `draft_vocabulary` (the target ids of a reduced draft vocabulary, `DFlashForDrafting.draft_token_ids`),
    labels are indices into it and tokens outside it carry no loss (the draft cannot propose them).
    Anchors are drawn without replacement among positions whose token and next token are supervised, re-drawn
    every epoch (`set_epoch`) from `seed`, the epoch and the sequence's content (so any worker order gives the same
    anchors), and sorted. Sequences with fewer candidates than `num_anchors` get padded (invalid) blocks.

    Returns tensors:
        input_ids, attention_mask `[b, T]`; anchor_positions, anchor_valid `[b, N]`;
        noise_ids, labels, loss_weights `[b, N*B]`; predecessor_ids `[b, N*B]` (the target token before each slot,
        for DFlash2's selector loss); position_ids `[b, T + N*B]` (context, then blocks);
        draft_attention_mask `[b, 1, N*B, T + N*B]` boolean when `dense_mask` (else build a flex mask on device),
        and draft_sliding_attention_mask (the same, windowed) when `sliding_window` is set.
    """

    block_size: int
    num_anchors: int
    mask_token_id: int
    pad_token_id: int = 0
    loss_decay_gamma: float | None = None
    max_length: int | None = None
    seed: int = 0
    dense_mask: bool = True
    sliding_window: int | None = None
    draft_vocabulary: torch.Tensor | None = None
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be at least 2 (an anchor plus one drafted slot), got {self.block_size}."
            )
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be at least 1, got {self.num_anchors}.")
        gamma = self.loss_decay_gamma or default_loss_decay_gamma(self.block_size)
        self.slot_weights = slot_loss_weights(self.block_size, gamma)
        self.target_to_draft = None
        if self.draft_vocabulary is not None:  # [V'] target id -> draft index, -1 outside the draft vocabulary
            vocabulary = torch.as_tensor(self.draft_vocabulary, dtype=torch.long).cpu()
            self.target_to_draft = torch.full((int(vocabulary.max()) + 1,), -1, dtype=torch.long)
            self.target_to_draft[vocabulary] = torch.arange(vocabulary.shape[0])

    def set_epoch(self, epoch: int) -> None:
        """Draw new anchors: call at the start of every epoch (`DFlashTrainer` does)."""
        self.epoch = int(epoch)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [self._truncate(feature) for feature in features]
        anchors, valid = zip(*(self._sample_anchors(ids, mask) for ids, mask in sequences))
        return self.collate_with_anchors(features, torch.stack(anchors), torch.stack(valid))

    def collate_with_anchors(
        self, features: list[dict[str, Any]], anchor_positions: torch.Tensor, anchor_valid: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The batch for given `[b, N]` anchors (sorted) and their validity, instead of random ones."""
        sequences = [self._truncate(feature) for feature in features]
        input_ids, loss_mask, attention_mask = self._pad(sequences)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "anchor_positions": anchor_positions,
            "anchor_valid": anchor_valid,
            **self._blocks(input_ids, loss_mask, anchor_positions, anchor_valid),
        }
        if "row" in features[0]:  # index into a trainer's feature cache
            batch["rows"] = torch.tensor([feature["row"] for feature in features])
        if self.dense_mask:
            batch["draft_attention_mask"] = dense_block_mask(
                anchor_positions, anchor_valid, attention_mask, self.block_size
            )
            if self.sliding_window is not None:
                batch["draft_sliding_attention_mask"] = dense_block_mask(
                    anchor_positions, anchor_valid, attention_mask, self.block_size, self.sliding_window
                )
        return batch

    # -- steps -------------------------------------------------------------------------------------------------------

    def _truncate(self, feature: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = torch.as_tensor(feature["input_ids"], dtype=torch.long)
        loss_mask = torch.as_tensor(feature["loss_mask"], dtype=torch.long)
        if input_ids.shape != loss_mask.shape:
            raise ValueError(f"input_ids and loss_mask differ in length: {input_ids.shape} vs {loss_mask.shape}.")
        return input_ids[: self.max_length], loss_mask[: self.max_length]

    def _pad(self, sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        seq_len = max(ids.shape[0] for ids, _ in sequences)
        input_ids = torch.full((len(sequences), seq_len), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(len(sequences), seq_len, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), seq_len, dtype=torch.long)
        for row, (ids, mask) in enumerate(sequences):
            input_ids[row, : ids.shape[0]] = ids
            loss_mask[row, : ids.shape[0]] = mask
            attention_mask[row, : ids.shape[0]] = 1
        return input_ids, loss_mask, attention_mask

    def _sample_anchors(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        candidates = anchor_candidates(loss_mask)
        content = zlib.crc32(input_ids.numpy().tobytes())
        generator = torch.Generator().manual_seed(hash((self.seed, self.epoch, content)) % (2**63))
        count = min(self.num_anchors, candidates.shape[0])
        chosen = candidates[torch.randperm(candidates.shape[0], generator=generator)[:count]].sort().values
        anchors = torch.zeros(self.num_anchors, dtype=torch.long)
        anchors[:count] = chosen
        valid = torch.arange(self.num_anchors) < count
        return anchors, valid

    def _blocks(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        anchor_positions: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        batch, seq_len = input_ids.shape
        slots = torch.arange(self.block_size)
        block_positions = (anchor_positions[:, :, None] + slots).flatten(1)  # [b, N*B]: a + k
        in_range = block_positions < seq_len
        gathered = block_positions.clamp(max=seq_len - 1)
        targets = input_ids.gather(1, gathered)
        supervised = loss_mask.gather(1, gathered).bool() & in_range
        supervised &= anchor_valid.repeat_interleave(self.block_size, dim=1)
        supervised &= (slots != 0).repeat(self.num_anchors)[None]  # slot 0 is the anchor itself
        if self.target_to_draft is not None:
            in_table = targets < self.target_to_draft.shape[0]
            targets = torch.where(
                in_table, self.target_to_draft[targets.clamp(max=self.target_to_draft.shape[0] - 1)], -1
            )
            supervised &= targets >= 0
        noise_ids = torch.full_like(block_positions, self.mask_token_id)
        noise_ids[:, :: self.block_size] = input_ids.gather(1, anchor_positions)
        context_positions = torch.arange(seq_len).expand(batch, -1)
        return {
            "noise_ids": noise_ids,
            # the token before each slot (the anchor for slot 1): DFlash2's teacher-forced selector predecessor
            "predecessor_ids": input_ids.gather(1, (block_positions - 1).clamp(min=0, max=seq_len - 1)),
            "position_ids": torch.cat([context_positions, block_positions], dim=1),
            "labels": torch.where(supervised, targets, IGNORE_INDEX),
            "loss_weights": self.slot_weights.repeat(self.num_anchors)[None] * supervised,
        }


def simulated_acceptance_length(slot_accuracy: list[float]) -> float:
    """`1 + sum_k prod_{i<=k} acc_i` over slots 1..B-1: the tau a drafter with these per-slot accuracies would reach
    if its errors were independent (an estimate; the real loop measures the true tau)."""
    tau, running = 1.0, 1.0
    for accuracy in slot_accuracy:
        if math.isnan(accuracy):
            break
        running *= accuracy
        tau += running
    return tau


__all__ = [
    "DEFAULT_LOSS_DECAY_GAMMA",
    "IGNORE_INDEX",
    "DataCollatorForDFlash",
    "anchor_candidates",
    "default_loss_decay_gamma",
    "dense_block_mask",
    "flex_block_mask",
    "simulated_acceptance_length",
    "slot_loss_weights",
]
