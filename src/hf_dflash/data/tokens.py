"""Token-id rules that regeneration, the benchmark and the CLI share: the pad id for a target and its tokenizer, and
left padding.

The rules decoding itself needs (a generation config's pad id, the cut at the first stop token) live in the Hub
file `hf_dflash.model.generation_dflash` (`pad_token_id_of`, `cut_at_stop`), which imports nothing from the package;
`pad_token_id_for` builds on `pad_token_id_of`, and the data and bench modules use `cut_at_stop` from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_dflash.model.generation_dflash import pad_token_id_of


def pad_token_id_for(
    target: PreTrainedModel | GenerationConfig, tokenizer: PreTrainedTokenizerBase | None = None
) -> int:
    """The id batches of ``target`` are padded with: the tokenizer's pad token, else
    ``pad_token_id_of(target's generation config)`` (its pad token, else its first EOS, else 0).

    The tokenizer comes first because its pad token is the one the user configured for batching; the generation
    config's rule next, so that batched plain generation pads as ``speculative_generate`` pads finished rows.
    Never raises: the id only fills left padding (masked out) and the positions after a row's stop token (cut
    off by ``cut_at_stop``), so any id of the vocabulary does, and 0 always is one. (Regeneration used to fall
    back to the tokenizer's EOS and then raise; the benchmark already followed this rule.)
    """
    tokenizer_pad = getattr(tokenizer, "pad_token_id", None)
    if tokenizer_pad is not None:
        return int(tokenizer_pad)
    generation_config = target if isinstance(target, GenerationConfig) else target.generation_config
    return pad_token_id_of(generation_config)


def left_pad(
    rows: Sequence[Sequence[int] | torch.Tensor], pad_token_id: int, device: torch.device | str | None = None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-pad token rows (lists of ids or 1-D tensors) into ``[b, L]`` ids and attention mask, what batched
    generation expects; ``L`` is the longest row. On ``device``, else the first row's device (CPU for lists)."""
    if device is None:
        device = rows[0].device if isinstance(rows[0], torch.Tensor) else "cpu"
    length = max(len(row) for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :] = torch.as_tensor(row, dtype=torch.long, device=device)
        mask[i, length - len(row) :] = 1
    return ids, mask
