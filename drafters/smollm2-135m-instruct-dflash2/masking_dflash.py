"""The attention masks of a DFlash drafter's forward, built outside the network (as transformers' `create_causal_mask`).

Keys are `[cached context ; new context ; block]`; queries are the block's slots. A caller passes `None` (every key
visible), a `[b, K]` keep-mask over all keys, a ready `[b, 1, B, K]` mask (boolean or additive) or a flex `BlockMask`
(training), or a dict of those per layer type. Sliding-window layers also see only recent keys, and attend causally
inside the block when the config says so.

This file is copied next to the weights by `save_pretrained`; it imports only torch, transformers and the standard
library.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


def key_padding_to_attention_mask(
    key_padding_mask: torch.Tensor,
    query_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Turn a `[b, K]` keep-mask over all keys (cache + context + block) into an additive `[b, 1, B, K]` mask.

    The block is the last `query_length` keys. With `sliding_window`, a block slot additionally sees only the keys less
    than `sliding_window` steps before it (counted in key slots); with `causal`, none after it.
    """
    keep = key_padding_mask.bool()[:, None, None, :].expand(-1, 1, query_length, -1)  # [b, 1, B, K]
    num_keys = key_padding_mask.shape[-1]
    query_slot = torch.arange(num_keys - query_length, num_keys, device=keep.device)[:, None]
    key_slot = torch.arange(num_keys, device=keep.device)[None, :]
    if sliding_window is not None:
        keep = keep & (query_slot - key_slot < sliding_window)
    if causal:
        keep = keep & (key_slot <= query_slot)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def draft_attention_masks(
    config: PreTrainedConfig,
    attention_mask: Any,
    batch: int,
    block_len: int,
    num_keys: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """The mask of each layer type (`"full_attention"`, `"sliding_attention"`); `None` means every key is visible."""
    if isinstance(attention_mask, dict):  # per layer type, e.g. from the training collator
        full = draft_attention_masks(
            config, attention_mask["full_attention"], batch, block_len, num_keys, dtype, device
        )
        sliding = attention_mask.get("sliding_attention", attention_mask["full_attention"])
        sliding = draft_attention_masks(config, sliding, batch, block_len, num_keys, dtype, device)
        return {"full_attention": full["full_attention"], "sliding_attention": sliding["full_attention"]}
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return dict.fromkeys(LAYER_TYPES, attention_mask)  # e.g. a flex BlockMask, built by the caller
    if attention_mask is not None and attention_mask.dim() == 4:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=dtype).masked_fill(
                ~attention_mask, torch.finfo(dtype).min
            )
        return dict.fromkeys(LAYER_TYPES, attention_mask)
    if attention_mask is not None and attention_mask.shape[-1] != num_keys:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} keys but the draft sees {num_keys} "
            "(cached context + new context + block); pass a keep-mask over all of them."
        )
    masks = {"full_attention": None, "sliding_attention": None}
    if attention_mask is not None:  # built whatever it holds: checking `.all()` would sync the host every call
        masks["full_attention"] = key_padding_to_attention_mask(attention_mask, block_len, dtype)
    if "sliding_attention" in config.layer_types:
        if attention_mask is None:
            attention_mask = torch.ones(batch, num_keys, dtype=torch.bool, device=device)
        masks["sliding_attention"] = key_padding_to_attention_mask(
            attention_mask, block_len, dtype, config.sliding_window, config.causal_sliding_attention
        )
    return masks


__all__ = ["LAYER_TYPES", "draft_attention_masks", "key_padding_to_attention_mask"]
