"""Configuration of a DFlash drafter.

A DFlash drafter is a stack of Qwen3-style decoder layers that borrows its embedding and LM head from the target,
so its config holds the usual Qwen3 fields (sized like the target) plus four flat DFlash fields:

- `block_size` (B): tokens per draft block, the anchor (last committed token) included; B - 1 tokens are drafted.
- `mask_token_id`: the id that fills the B - 1 draft slots; a row of the target's embedding the target never emits.
- `target_layer_ids`: 0-based decoder layers of the target whose outputs (`hidden_states[i + 1]`) feed the draft.
- `num_target_layers`: how many decoder layers the target has (checked against the target at generation time).

Two fields record what serving engines need to read the drafter the way it was trained: `input_embedding_scale`
(the factor the target's `get_input_embeddings()` applies to the raw rows; sqrt(hidden) for Gemma 3) and
`causal_sliding_attention` (whether sliding-window layers attend causally inside the block, as in z-lab's SWA drafters;
hf-dflash trains every layer bidirectionally).

`variant="dflash2"` adds DFlash2's two parts (inco.ai with z-lab, 2026): a grouped dynamic two-tap causal depthwise
convolution around the input and output of every attention and MLP sublayer (`conv_kernel_size` taps, one dynamic
coefficient per `conv_group_size` channels), and a candidate selector that keeps each slot's `selector_top_k` most
likely draft tokens and walks one chain through a rank-`selector_rank` pairwise lattice. `output_multiplier` and
`final_logit_softcapping` transform the unary logits the selector starts from.

This file is copied next to the weights by `save_pretrained` and imported by `trust_remote_code` users who do not
have `hf_dflash` installed: it imports only `transformers` and the standard library.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

# What the draft's rotary (Qwen3's) reads from `rope_parameters` for each `rope_type`, besides `rope_type` and
# `rope_theta` (the keys of transformers' rope validators). `partial_rotary_factor` is never kept: the draft rotates
# every head dimension, while serving engines would honour the factor and rotate only part of it.
ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor", "factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# `dflash_config` fields of the z-lab layout that this config reads.
NESTED_FIELDS = (
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "num_target_layers",
    "causal",
    "input_embedding_scale",
)
VARIANTS = ("dflash", "dflash2")
# DFlash2 fields, also nested in `dflash_config` by the z-lab layout.
DFLASH2_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)


def draft_rope_parameters(rope_parameters: dict) -> dict:
    """The part of `rope_parameters` the draft's rotary uses: `rope_type`, `rope_theta` and that type's scaling keys.

    Anything else (e.g. a GPT-NeoX target's `partial_rotary_factor: 0.25`) would be read by vLLM and change the
    rotary it serves, although the draft was trained without it.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by the draft's rotary embedding (supported: "
            f"{sorted(ROPE_SCALING_KEYS)}). Pass `rope_parameters={{'rope_type': 'default', 'rope_theta': ...}}`."
        )
    kept = ("rope_type", "rope_theta", *ROPE_SCALING_KEYS[rope_type])
    return {"rope_type": rope_type} | {name: rope_parameters[name] for name in kept if name in rope_parameters}


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
        input_embedding_scale (`float`, *optional*): the factor by which the target's `get_input_embeddings()` scales
            the raw embedding rows the block is embedded with (`sqrt(hidden_size)` for Gemma 3, 1.0 for most targets);
            recorded by `from_target` for serving engines that embed with the raw rows. `None`: not recorded.
        causal_sliding_attention (`bool`): sliding-window layers attend causally inside the block (z-lab's SWA
            drafters) instead of bidirectionally (hf-dflash's, and every full-attention layer).
        variant (`str`): `"dflash"` (v1, the default) or `"dflash2"` (convolutions and a candidate selector).
        conv_kernel_size (`int`): DFlash2 only: taps of each sublayer convolution (the token and the ones before it in
            the block).
        conv_group_size (`int`): DFlash2 only: channels sharing one dynamic coefficient; must divide `hidden_size`.
        selector_rank (`int`): DFlash2 only: width R of the selector's codebooks and hidden projection.
        selector_top_k (`int`): DFlash2 only: candidates K kept per slot; at most the draft vocabulary.
        output_multiplier (`float`): DFlash2 only: factor on the unary logits before softcapping (1.0: the target
            head's own scale).
        final_logit_softcapping (`float`, *optional*): DFlash2 only: unary logits become `cap * tanh(u / cap)`;
            `None` or 0: no cap.

    Checkpoints in the published z-lab layout (`model_type: "qwen3"` with a nested `dflash_config`) load into this
    class too: the nested fields are lifted to the top level, and causality is read the way vLLM reads it (top-level
    `is_causal`, else `dflash_config.causal`, else sliding-window layers are causal). `rope_parameters` keeps only
    what the draft's rotary uses (`draft_rope_parameters`).
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
    input_embedding_scale: float | None = None
    causal_sliding_attention: bool = False

    variant: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        dflash_config = kwargs.pop("dflash_config", None) or {}
        is_causal = kwargs.pop("is_causal", None)  # written by the z-lab export; hf-dflash keeps it in the flat field
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
        self.rope_parameters = self._used_rope_parameters()
        self._read_causality(is_causal, dflash_config)
        self._check_fields()

    def _used_rope_parameters(self) -> dict:
        kept = draft_rope_parameters(self.rope_parameters)
        dropped = sorted(set(self.rope_parameters) - set(kept))
        if dropped:
            logger.warning(f"Dropping rope_parameters {dropped}: the draft's rotary embedding does not use them.")
        return kept

    def _read_causality(self, is_causal: bool | None, dflash_config: dict) -> None:
        """Causality as vLLM reads a z-lab config: `is_causal`, else `dflash_config.causal`, else (z-lab layout only)
        sliding-window layers are causal. Only sliding layers can be causal here."""
        explicit = is_causal if is_causal is not None else dflash_config.get("causal")
        if explicit is None and not dflash_config:
            return  # hf-dflash layout: the flat field says it
        if explicit and "full_attention" in self.layer_types:
            raise ValueError(
                "This config makes full-attention draft layers causal (`is_causal: true` or `dflash_config.causal: "
                "true`); DFlash drafters attend bidirectionally inside the block there and hf-dflash implements only "
                "that. Set `is_causal: false` if the drafter was trained bidirectionally."
            )
        self.causal_sliding_attention = "sliding_attention" in self.layer_types and explicit in (None, True)

    def _lift_nested_dflash_fields(self, dflash_config: dict) -> None:
        """z-lab checkpoints nest `mask_token_id`/`target_layer_ids` (and sometimes `block_size`) in `dflash_config`."""
        for name in ("mask_token_id", "target_layer_ids", "num_target_layers", "input_embedding_scale"):
            if getattr(self, name) is None and dflash_config.get(name) is not None:
                setattr(self, name, dflash_config[name])
        for name in ("block_size", *DFLASH2_FIELDS):  # the nested value is the more specific one
            if dflash_config.get(name) is not None:
                setattr(self, name, dflash_config[name])
        if dflash_config.get("sample_from_anchor"):
            raise ValueError(
                "This checkpoint drafts from the anchor slot (`dflash_config.sample_from_anchor: true`, DSpark's layout); "
                "DFlash and DFlash2 drafters read their proposals from the slots after the anchor. Use a DFlash or "
                "DFlash2 checkpoint, or set `sample_from_anchor: false` if it was trained anchor-first."
            )
        unknown = set(dflash_config) - set(NESTED_FIELDS) - set(DFLASH2_FIELDS) - {"sample_from_anchor"}
        if unknown:
            logger.warning(f"Ignoring unsupported `dflash_config` fields {sorted(unknown)}.")

    def _check_fields(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}.")
        if self.variant == "dflash2":
            self._check_dflash2_fields()
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

    def to_dict(self) -> dict[str, Any]:
        """The config as a dict; a v1 drafter's has no DFlash2 fields (its `config.json` stays as it always was)."""
        config_dict = super().to_dict()
        if self.variant == "dflash":
            for name in ("variant", *DFLASH2_FIELDS):
                config_dict.pop(name, None)
        return config_dict

    def _check_dflash2_fields(self) -> None:
        if self.conv_kernel_size < 1 or self.conv_group_size < 1:
            raise ValueError(
                f"conv_kernel_size ({self.conv_kernel_size}) and conv_group_size ({self.conv_group_size}) must be >= 1."
            )
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by conv_group_size {self.conv_group_size}: each "
                "dynamic coefficient covers conv_group_size channels. Pick a divisor of the hidden size (e.g. 16)."
            )
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}.")
        vocabulary = self.draft_vocab_size or self.vocab_size
        if self.selector_top_k < 1 or (vocabulary is not None and self.selector_top_k > vocabulary):
            raise ValueError(
                f"selector_top_k={self.selector_top_k} must be between 1 and the draft vocabulary ({vocabulary} "
                "tokens): the selector keeps that many candidates per slot. Lower selector_top_k (e.g. 16)."
            )
        if self.final_logit_softcapping is not None and self.final_logit_softcapping < 0:
            raise ValueError(f"final_logit_softcapping must be positive or None, got {self.final_logit_softcapping}.")


__all__ = ["DFLASH2_FIELDS", "DFlashConfig", "default_target_layer_ids", "draft_rope_parameters"]
