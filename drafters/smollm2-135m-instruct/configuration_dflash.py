"""Configuration of a DFlash drafter.

A DFlash drafter is a stack of Qwen3-style decoder layers that borrows its embedding and LM head from the target,
so its config holds the usual Qwen3 fields (sized like the target) plus four flat DFlash fields:

- `block_size` (B): tokens per draft block, the anchor (last committed token) included; B - 1 tokens are drafted.
- `mask_token_id`: the id that fills the B - 1 draft slots; a row of the target's embedding the target never emits.
- `target_layer_ids`: 0-based decoder layers of the target whose outputs (`hidden_states[i + 1]`) feed the draft.
- `num_target_layers`: how many decoder layers the target has (checked against the target at generation time).

This file is copied next to the weights by `save_pretrained` and imported by `trust_remote_code` users who do not
have `hf_dflash` installed: it imports only `transformers` and the standard library.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The paper's evenly spaced tap points: `round(1 + i * (L_t - 4) / (n - 1))`, or `[L_t // 2]` for one feature.

    Qwen3-8B (36 layers) with 5 features gives `[1, 9, 17, 25, 33]`. Shallow targets (fewer than 5 layers) get ids
    spread over the layers they have.
    """
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}.")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        return sorted({round(i * (num_target_layers - 1) / (num_features - 1)) for i in range(num_features)})
    return [round(1 + i * (num_target_layers - 4) / (num_features - 1)) for i in range(num_features)]


class DFlashConfig(PreTrainedConfig):
    r"""
    Configuration of [`DFlashForDrafting`]. Sizes must match the target (hidden size, vocabulary); build one from a
    target with `DFlashForDrafting.from_target(target, ...)` rather than by hand.

    Args:
        vocab_size (`int`, *optional*): rows of the target's embedding table (the draft uses the target's LM head).
        hidden_size (`int`): the target's hidden size.
        intermediate_size (`int`): MLP width of each draft layer.
        num_hidden_layers (`int`): number of draft layers (1 to 8; the paper's best is 5).
        num_attention_heads, num_key_value_heads, head_dim (`int`): attention shape of the draft layers.
        rms_norm_eps (`float`), hidden_act (`str`), attention_bias (`bool`): as in Qwen3.
        max_position_embeddings (`int`), rope_parameters (`dict`): rotary embedding of the draft.
        layer_types (`list[str]`): `"full_attention"` or `"sliding_attention"` per draft layer.
        sliding_window (`int`, *optional*): window of the sliding layers.
        block_size (`int`): tokens per draft block, anchor included.
        mask_token_id (`int`): token id filling the draft slots.
        target_layer_ids (`list[int]`): target decoder layers whose outputs are the draft's context.
        num_target_layers (`int`): decoder layers of the target.
        draft_vocab_size (`int`, *optional*): draft over this many target tokens only (the rows of the target's LM
            head listed by the draft's `d2t` buffer, vLLM/EAGLE-3 convention: `target_id = draft_id + d2t[draft_id]`);
            `None` drafts over the whole vocabulary. Verification still uses the target's full distribution, so the
            output is unchanged; only the draft's LM-head cost shrinks.

    Checkpoints in the published z-lab layout (`model_type: "qwen3"` with a nested `dflash_config`) load into this
    class too: the nested fields are lifted to the top level.
    """

    model_type = "dflash"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int | None = None
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        dflash_config = kwargs.pop("dflash_config", None) or {}
        self._lift_nested_dflash_fields(dflash_config)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.rope_parameters is None and "rope_theta" not in kwargs:
            kwargs["rope_theta"] = 1_000_000.0
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        super().__post_init__(**kwargs)
        self._check_fields()

    def _lift_nested_dflash_fields(self, dflash_config: dict) -> None:
        """z-lab checkpoints nest `mask_token_id`/`target_layer_ids` (and sometimes `block_size`) in `dflash_config`."""
        for name in ("mask_token_id", "target_layer_ids", "num_target_layers"):
            if getattr(self, name) is None and dflash_config.get(name) is not None:
                setattr(self, name, dflash_config[name])
        if dflash_config.get("block_size") is not None:  # the nested value is the more specific one
            self.block_size = dflash_config["block_size"]
        unknown = set(dflash_config) - {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers"}
        if unknown:
            logger.warning(f"Ignoring unsupported `dflash_config` fields {sorted(unknown)}.")

    def _check_fields(self) -> None:
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (the anchor plus at least one drafted token), got {self.block_size}."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers; give one per layer."
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers: set `sliding_window` to the window length.")
        if self.target_layer_ids is not None and len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct, got {self.target_layer_ids}.")
        if self.draft_vocab_size is not None and not (
            1 <= self.draft_vocab_size <= (self.vocab_size or self.draft_vocab_size)
        ):
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be between 1 and the vocabulary size {self.vocab_size}."
            )
        if (
            self.mask_token_id is not None
            and self.vocab_size is not None
            and not 0 <= self.mask_token_id < self.vocab_size
        ):
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); pick a row of the "
                "target's embedding that the target never emits (a reserved or padded token)."
            )


__all__ = ["DFlashConfig", "default_target_layer_ids"]
