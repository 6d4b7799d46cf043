"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one forward, conditioned on the target.

Notation (as in the paper, arXiv 2602.06036): `B` block size, `H` hidden size (the target's), `n` number of tapped
target layers. One forward maps a block `[anchor, MASK x (B-1)]` (embedded with the *target's* embedding) to B hidden
states; the target's LM head on slots 1..B-1 gives the draft logits `q`.

Context ("KV injection"): the target's hidden states at `target_layer_ids` are concatenated and projected,
`ctx = hidden_norm(fc(cat(hs[l + 1] for l in target_layer_ids)))`, and every draft layer attends to
`[k_proj(ctx) ; k_proj(norm(block))]` (keys) and the matching values. The context never passes through a layer's input
norm, queries come from the block only, and attention is bidirectional inside the block. Context K/V of committed tokens
are kept in the cache between rounds; block K/V are cropped by the caller after each forward.

The drafter has no embedding and no LM head: nothing of the target is copied or forked. Weight names are those of
the published z-lab checkpoints (`layers.*`, `fc`, `hidden_norm`, `norm`), so the same safetensors serve vLLM and SGLang.

This file is copied next to the weights by `save_pretrained`; it imports only torch, transformers, the standard
library and its sibling `generation_dflash.py`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import logging

from .configuration_dflash import DFlashConfig, default_target_layer_ids, draft_rope_parameters
from .generation_dflash import check_target_supported, enable_dflash_generate, token_ids
from .layouts_dflash import (
    NATIVE_KEY_MAPPING,
    DFlashLayouts,
    config_dict_from_layout,
    detect_layout,
    warn_about_zlab_readers,
    write_folder_atomically,
    zlab_config_dict,
    zlab_state_dict,
)
from .masking_dflash import draft_attention_masks
from .selector_dflash import (
    DFlashCandidateSelector,
    DFlashSublayerConv,
    SelectorChain,
    SelectorLattice,
    walk_lattice,
)

logger = logging.get_logger(__name__)

MASK_TOKEN_NAME_HINTS = ("mask", "reserved", "unused", "pad", "placeholder")
DFLASH2_PARTS = ("attention_conv", "mlp_conv", "candidate_selector")  # weight-name parts only DFlash2 has


class DFlashRMSNorm(Qwen3RMSNorm):
    """RMSNorm, exactly Qwen3's."""


class DFlashMLP(Qwen3MLP):
    """SwiGLU MLP, exactly Qwen3's."""


class DFlashRotaryEmbedding(Qwen3RotaryEmbedding):
    """Rotary embedding, exactly Qwen3's (reads `config.rope_parameters`)."""


def apply_rotary_to_block_and_context(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE where keys span `[context ; block]` and queries only the block (the last `q_len` positions)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, n_ctx + B, head_dim]
    q_len = query.shape[-2]
    query = query * cos[..., -q_len:, :] + rotate_half(query) * sin[..., -q_len:, :]
    key = key * cos + rotate_half(key) * sin
    return query, key


class DFlashAttention(nn.Module):
    """GQA attention with q/k RMSNorm whose keys and values also come from the projected target context."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False  # bidirectional inside the block; the context is fully visible unless masked
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        kv_input = torch.cat([context, hidden_states], dim=1)  # [b, n_ctx + B, H]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_to_block_and_context(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # [b, kv_heads, past + n_ctx + B, head_dim]
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = attention_mask[..., -key.shape[-2] :]  # sliding caches may return fewer keys
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, q_len, -1))


def convolved(conv: DFlashSublayerConv | None, sublayer: Callable, normed: torch.Tensor) -> torch.Tensor:
    """`sublayer(normed)`, or with DFlash2's `conv` around it: on its input and its output, both with the dynamic
    coefficients of `normed`."""
    if conv is None:
        return sublayer(normed)
    coefficients = conv.coefficients(normed)  # [b, L, 2, T, G]
    return conv(sublayer(conv(normed, coefficients, 0)), coefficients, 1)


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer; the context is injected into attention without passing through `input_layernorm`.
    DFlash2 wraps each sublayer in a convolution (`attention_conv`, `mlp_conv`); the context is not convolved."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        dflash2 = config.variant == "dflash2"
        self.attention_conv = DFlashSublayerConv(config) if dflash2 else None
        self.mlp_conv = DFlashSublayerConv(config) if dflash2 else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        def attention(normed: torch.Tensor) -> torch.Tensor:
            return self.self_attn(normed, context, position_embeddings, attention_mask, cache, **kwargs)

        hidden_states = hidden_states + convolved(self.attention_conv, attention, self.input_layernorm(hidden_states))
        return hidden_states + convolved(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config: DFlashConfig
    config_class = DFlashConfig
    base_model_prefix = "model"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # tests/test_modeling.py compiles the forward with fullgraph=True
    # A z-lab export of a reduced-vocabulary drafter carries the target head's rows for vLLM; the drafter itself reads
    # them from the target at run time.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.weight$"]

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' defaults, and DFlash2's start: identity convolutions (tap 0 one, other taps and the dynamic
        projection zero) and a zero successor codebook, so a fresh DFlash2 drafter drafts what its v1 layers do."""
        super()._init_weights(module)
        if isinstance(module, DFlashSublayerConv):
            init.zeros_(module.kernel_projection.weight)
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
        elif isinstance(module, DFlashCandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.successor_codebook)


class DFlashForDrafting(DFlashPreTrainedModel):
    """The DFlash drafter. Pass it to `target.generate(..., assistant_model=draft)` or `hf_dflash.speculative_generate`.

    Forward inputs (the interface of transformers' native DFlash path):
        noise_embeds (`[b, B, H]`): the target's embedding of `[anchor, MASK x (B-1)]`.
        context_hidden_states (`[b, n_ctx, n * H]`): target hidden states of the tokens committed since the last call,
            `cat([hidden_states[l + 1] for l in target_layer_ids], -1)`; `n_ctx` may be 0.
        position_ids (`[b, n_ctx + B]`): positions of the new context tokens, then of the block.
        attention_mask: `None` (everything visible), a `[b, past + n_ctx + B]` keep-mask over all keys, or a ready
            `[b, 1, B, K]` mask (boolean or additive) / flex `BlockMask` used as is (training), or a dict of those
            per layer type (`{"full_attention": ..., "sliding_attention": ...}`).
        cache: a transformers `Cache` holding the context K/V of earlier calls (e.g. `DFlashCache`).
        use_cache: `False` runs without `cache` (neither read nor extended); by default a given cache is used.

    Returns a `BaseModelOutputWithPast` whose `last_hidden_state` (`[b, B, H]`) is after the final norm.

    A DFlash2 drafter (`config.variant == "dflash2"`) proposes through its `candidate_selector`: `select_chain` walks
    the chain of the slots' candidates that its pairwise lattice scores best.
    """

    _is_dflash_draft = True  # duck-typed marker the generate() routing looks for

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        num_features = len(config.target_layer_ids or [0])
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        self.candidate_selector = DFlashCandidateSelector(config) if config.variant == "dflash2" else None
        if config.draft_vocab_size is not None:  # offsets to target ids (vLLM/EAGLE-3 `d2t`); identity until set
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self._draft_head_cache: tuple | None = None
        self.gradient_checkpointing = False
        self.post_init()
        enable_dflash_generate()

    def project_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """`[b, n_ctx, n * H]` target features -> `[b, n_ctx, H]` context injected into every layer."""
        return self.hidden_norm(self.fc(context_hidden_states))

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """`[draft_vocab_size]` target ids the draft proposes from, or `None` for the whole vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocabulary(self, target_ids: torch.LongTensor) -> None:
        """Draft over these target token ids only (sorted here); their number must be `config.draft_vocab_size`."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long).unique()  # sorted, distinct
        if target_ids.shape[0] != self.config.draft_vocab_size:
            raise ValueError(
                f"Got {target_ids.shape[0]} distinct token ids for a draft vocabulary of {self.config.draft_vocab_size}."
            )
        if (
            self.config.vocab_size is not None
            and not 0 <= int(target_ids.min()) <= int(target_ids.max()) < self.config.vocab_size
        ):
            raise ValueError(f"Draft vocabulary ids must lie in [0, {self.config.vocab_size}).")
        self.d2t.copy_(target_ids.to(self.d2t.device) - torch.arange(target_ids.shape[0], device=self.d2t.device))
        self._draft_head_cache = None

    def resize_draft_vocabulary(self, target_ids: torch.LongTensor) -> None:
        """Draft over these target token ids from now on, however many there are (`config.draft_vocab_size` follows).

        Nothing learned is lost: the LM head is the target's, so the rows are only a choice among its rows (a drafter
        trained over 8,192 of them keeps its layers when it continues over 16,384). A DFlash2 selector's codebook rows
        move with their tokens; tokens new to the vocabulary start with zero rows (no pairwise score).
        """
        old_ids = self.draft_token_ids
        if old_ids is None:
            old_ids = torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        size = int(torch.as_tensor(target_ids).unique().numel())
        self.config.draft_vocab_size = size
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long, device=self.fc.weight.device))
        self.set_draft_vocabulary(target_ids)
        if self.candidate_selector is not None:
            self.candidate_selector.move_codebook_rows(old_ids, self.draft_token_ids)

    def draft_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The target's LM head on draft hidden states `[..., H]` -> `[..., V_d]` logits over the draft vocabulary
        (`V_d` = `draft_vocab_size`, or the whole vocabulary). Map an index back with `to_target_ids`."""
        # Products over rows `[n, H]`: on a CPU, torch's stock bf16 linear over a 3-D slice such as `hidden[:, 1:]`
        # (contiguous, but not with default strides) takes a slow oneDNN path: 3.4 against 0.29 ms for the same rows as
        # a 2-D input at SmolLM2's draft head on a Xeon (benchmarks/results/probe_sliced_linear_xeon.json).
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])  # a view where it can be
        head = lm_head if self.draft_token_ids is None else self.draft_head(lm_head)
        logits = head(rows)
        return logits.view(*hidden_states.shape[:-1], logits.shape[-1])

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Draft-vocabulary indices -> target token ids."""
        token_ids = self.draft_token_ids
        return draft_ids if token_ids is None else token_ids[draft_ids]

    def to_draft_ids(self, target_ids: torch.LongTensor) -> torch.LongTensor:
        """Target token ids -> draft-vocabulary indices, -1 for a token outside the draft vocabulary."""
        token_ids = self.draft_token_ids
        if token_ids is None:
            return target_ids
        index = torch.searchsorted(token_ids, target_ids).clamp(max=token_ids.shape[0] - 1)  # ids are sorted
        return torch.where(token_ids[index] == target_ids, index, -1)

    def selector_lattice(
        self, hidden_states: torch.Tensor, lm_head: nn.Module, anchor_ids: torch.LongTensor
    ) -> SelectorLattice:
        """DFlash2: the candidates (draft ids) and pairwise scores of drafted slots `[b, S, H]` after the `[b]` anchor
        tokens (target ids)."""
        if self.candidate_selector is None:
            raise ValueError(
                "This is a DFlash (v1) drafter: it has no candidate selector. Build a DFlash2 drafter "
                "(`DFlashForDrafting.from_target(target, variant='dflash2')`, or convert this one with "
                "`hf_dflash.training.draft_init.dflash2_from_dflash`)."
            )
        logits = self.draft_logits(hidden_states, lm_head)  # [b, S, V_d]
        return self.candidate_selector.lattice(hidden_states, logits, self.to_draft_ids(anchor_ids))

    def select_chain(
        self,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        anchor_ids: torch.LongTensor,
        temperature: float | None = None,
    ) -> tuple[torch.LongTensor, torch.LongTensor, SelectorChain]:
        """DFlash2's proposals for drafted slots `[b, S, H]`: the selector's walked chain, greedy (`temperature` None
        or 0) or sampled at `temperature`. Returns the chain's target ids `[b, S]`, every slot's candidates as target
        ids `[b, S, K]`, and the walk itself (its rows give the proposal distribution `q` over the candidates)."""
        lattice = self.selector_lattice(hidden_states, lm_head, anchor_ids)
        chain = walk_lattice(lattice, temperature)
        return self.to_target_ids(chain.draft_ids), self.to_target_ids(lattice.candidate_ids), chain

    def to_full_vocabulary(self, draft_scores: torch.Tensor, vocab_size: int, fill: float) -> torch.Tensor:
        """`[..., V_d]` scores -> `[..., V]`, `fill` at tokens outside the draft vocabulary."""
        token_ids = self.draft_token_ids
        if token_ids is None:
            return draft_scores
        full = draft_scores.new_full((*draft_scores.shape[:-1], vocab_size), fill)
        return full.index_copy_(-1, token_ids, draft_scores)

    def draft_head(self, lm_head: nn.Module) -> nn.Linear:
        """The target's LM head over the draft vocabulary only: an `nn.Linear` holding its rows (frozen), cached while
        the head and the vocabulary are unchanged, so a CPU preparation (hf-dflash's
        `optimize_target_and_draft_for_cpu`) can give its product a faster kernel once. Over the whole vocabulary the
        head itself is used."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        key = (weight.data_ptr(), weight._version, self.d2t.data_ptr(), self.d2t._version)
        if self._draft_head_cache is None or self._draft_head_cache[0] != key:
            token_ids = self.draft_token_ids
            head = nn.Linear(weight.shape[1], token_ids.shape[0], bias=bias is not None, device="meta")
            head.weight = nn.Parameter(weight.detach()[token_ids], requires_grad=False)
            if bias is not None:
                head.bias = nn.Parameter(bias.detach()[token_ids], requires_grad=False)
            self._draft_head_cache = (key, head)
        return self._draft_head_cache[1]

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | Any | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if use_cache is False:
            cache = None  # neither read nor extended
        batch, block_len, _ = noise_embeds.shape
        context = self.project_context(context_hidden_states.to(noise_embeds.dtype))  # [b, n_ctx, H]
        past_len = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + context.shape[1] + block_len, device=noise_embeds.device)
            position_ids = position_ids.expand(batch, -1)
        position_embeddings = self.rotary_emb(noise_embeds, position_ids)
        num_keys = past_len + context.shape[1] + block_len
        dtype, device = self.norm.weight.dtype, self.norm.weight.device
        masks = draft_attention_masks(self.config, attention_mask, batch, block_len, num_keys, dtype, device)
        hidden_states = noise_embeds
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = layer(
                hidden_states,
                context,
                position_embeddings,
                attention_mask=masks[layer_type],
                cache=cache,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)

    # ----------------------------------------------------------------------------------------------------------------
    # Construction from a target
    # ----------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        tokenizer: Any | None = None,
        **overrides: Any,
    ) -> DFlashForDrafting:
        """A randomly initialised drafter that fits `target` (any causal LM).

        Hidden size, vocabulary (embedding rows), attention heads, head dim, MLP width, RoPE settings and dtype come
        from the target; `target_layer_ids` follow the paper's rule; `mask_token_id` follows `choose_mask_token_id`
        (pass `tokenizer` so reserved special tokens can be found). Any config field can be overridden by keyword.
        """
        check_target_supported(target)
        text_config = target.config.get_text_config()
        hidden_size = text_config.hidden_size
        num_heads = text_config.num_attention_heads
        num_target_layers = text_config.num_hidden_layers
        fields = {
            "vocab_size": target.get_input_embeddings().weight.shape[0],
            "hidden_size": hidden_size,
            "intermediate_size": getattr(text_config, "intermediate_size", None) or 4 * hidden_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or num_heads,
            "head_dim": getattr(text_config, "head_dim", None) or hidden_size // num_heads,
            "rms_norm_eps": getattr(text_config, "rms_norm_eps", None) or 1e-6,
            "max_position_embeddings": getattr(text_config, "max_position_embeddings", None) or 32768,
            "rope_parameters": _target_rope_parameters(text_config),
            "block_size": block_size,
            "num_target_layers": num_target_layers,
            "target_layer_ids": default_target_layer_ids(num_target_layers, num_hidden_layers),
            "bos_token_id": text_config.bos_token_id,
            "eos_token_id": text_config.eos_token_id,
            "pad_token_id": text_config.pad_token_id,
        }
        fields.update(overrides)
        fields.setdefault("input_embedding_scale", input_embedding_scale(target))
        if fields.get("mask_token_id") is None:
            fields["mask_token_id"] = choose_mask_token_id(target, tokenizer)
        config = DFlashConfig(**fields)
        with target.device:  # initialised on the target's device: no host copy of a target-sized drafter
            draft = cls._from_config(config, dtype=target.dtype)  # RoPE frequencies stay fp32, as in the target
        return draft.to(target.device)

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoint layouts
    # ----------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any):
        """Load a drafter saved by hf-dflash, a published z-lab checkpoint, or a transformers-native assistant.

        The layout is read from `config.json`. Every weight of the drafter must come from the checkpoint: a missing
        weight raises instead of being silently initialised at random.
        """
        if kwargs.get("config") is None:
            layout, converted = _layout_and_config(pretrained_model_name_or_path, _hub_kwargs(kwargs))
            if converted is not None:
                kwargs["config"] = converted
            if layout == DFlashLayouts.NATIVE:
                kwargs.setdefault("key_mapping", NATIVE_KEY_MAPPING)
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        check_loaded_weights(pretrained_model_name_or_path, model.config, info)
        return (model, info) if wants_info else model

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args: Any,
        layout: str = DFlashLayouts.HF,
        target: PreTrainedModel | None = None,
        full_vocabulary: bool = False,
        **kwargs: Any,
    ):
        """Save the drafter (draft weights only: no embedding; an LM head only where an engine needs one).

        `layout="hf-dflash"` (default) writes the transformers layout with the remote code, loadable with
        `AutoModel.from_pretrained(path, trust_remote_code=True)`. `layout="z-lab"` writes the published z-lab layout
        that vLLM (`--speculative-config '{"method": "dflash", ...}'`), SGLang (`--speculative-algorithm DFLASH`) and
        llama.cpp's `convert_hf_to_gguf.py` read; `DFlashForDrafting.from_pretrained` reads both. Files appear only
        once fully written.

        z-lab only: `target` is the model this drafter was built for; a drafter with a reduced vocabulary needs it
        (its head's rows become `lm_head.weight`), as does one that does not record `input_embedding_scale`.
        `full_vocabulary=True` writes no `d2t` and no head, for readers that take no reduced vocabulary.
        """
        if layout == DFlashLayouts.HF:
            if target is not None or full_vocabulary:
                raise ValueError("`target=` and `full_vocabulary=` apply to `layout='z-lab'` only.")
            write_folder_atomically(
                save_directory, lambda tmp: super(DFlashForDrafting, self).save_pretrained(tmp, *args, **kwargs)
            )
        elif layout == DFlashLayouts.ZLAB:
            write_folder_atomically(save_directory, lambda tmp: self._write_zlab(tmp, target, full_vocabulary))
        else:
            raise ValueError(f"Unknown layout {layout!r}; use {DFlashLayouts.HF!r} or {DFlashLayouts.ZLAB!r}.")

    def _write_zlab(self, folder: Path, target: PreTrainedModel | None, full_vocabulary: bool) -> None:
        from safetensors.torch import save_file

        config = copy.deepcopy(self.config)
        config.input_embedding_scale = self._recorded_embedding_scale(target)
        state_dict = zlab_state_dict(self, target, full_vocabulary)
        warn_about_zlab_readers(config, full_vocabulary)
        save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config_dict = zlab_config_dict(config, full_vocabulary)
        config_dict["dtype"] = str(self.dtype).removeprefix("torch.")
        (folder / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

    def _recorded_embedding_scale(self, target: PreTrainedModel | None) -> float:
        """The target's embedding scale: recorded in the config, measured on `target`, and the two must agree."""
        recorded = self.config.input_embedding_scale
        measured = input_embedding_scale(target) if target is not None else None
        if (
            recorded is not None
            and measured is not None
            and abs(recorded - measured) > _scale_tolerance(target) * recorded
        ):
            raise ValueError(
                f"The drafter was built for a target whose embedding scale is {recorded:g}, this one scales by "
                f"{measured:g}: pass the target this drafter was built for."
            )
        scale = recorded if recorded is not None else measured
        if scale is None:
            raise ValueError(
                "The drafter does not record how its target scales embedding rows (`input_embedding_scale`), which "
                "serving engines need: pass `target=` to the export so it can be measured."
            )
        return scale


def read_draft_config(pretrained_model_name_or_path: str | os.PathLike, **hub_kwargs: Any) -> DFlashConfig:
    """The `DFlashConfig` of a drafter checkpoint in any layout `DFlashForDrafting.from_pretrained` reads (hf-dflash,
    z-lab, transformers-native), without loading its weights. `hub_kwargs`: `revision`, `token`, `cache_dir`, ..."""
    _, converted = _layout_and_config(pretrained_model_name_or_path, hub_kwargs)
    return converted or DFlashConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)


def _layout_and_config(
    pretrained_model_name_or_path: str | os.PathLike, hub_kwargs: dict
) -> tuple[str, DFlashConfig | None]:
    """A checkpoint's layout, and its config converted to `DFlashConfig` when it is not hf-dflash's own."""
    config_dict, _ = DFlashConfig.get_config_dict(pretrained_model_name_or_path, **hub_kwargs)
    layout = detect_layout(config_dict)
    converted = DFlashConfig(**config_dict_from_layout(config_dict, layout)) if layout != DFlashLayouts.HF else None
    return layout, converted


def check_loaded_weights(name: str | os.PathLike, config: DFlashConfig, info: dict) -> None:
    """Raise when a checkpoint's weights do not make the drafter its config describes: a missing weight would stay
    random, and DFlash2 weights under a v1 config would be dropped."""
    missing = sorted(info.get("missing_keys") or [])
    dflash2_missing = [key for key in missing if any(part in key for part in DFLASH2_PARTS)]
    if dflash2_missing:
        raise ValueError(
            f"{name} is configured as a DFlash2 drafter but lacks its weights {dflash2_missing}: they would be random. "
            "Save the complete drafter again, or, for a DFlash (v1) checkpoint, load it without `variant: dflash2` "
            "and convert it with `hf_dflash.training.draft_init.dflash2_from_dflash`."
        )
    if missing:
        raise ValueError(
            f"{name} lacks weights {missing}: they would be random. "
            "Is it a DFlash drafter checkpoint (hf-dflash, z-lab or transformers-native layout)?"
        )
    dropped = sorted(key for key in info.get("unexpected_keys") or [] if any(part in key for part in DFLASH2_PARTS))
    if config.variant == "dflash" and dropped:
        raise ValueError(
            f"{name} holds DFlash2 weights ({dropped[:3]}...) but its config describes a DFlash (v1) drafter, so they "
            'would be ignored. Set `variant: "dflash2"` (hf-dflash layout) or `architectures: '
            '["DFlash2DraftModel"]` (z-lab layout) in its config.json.'
        )


def _hub_kwargs(kwargs: dict) -> dict:
    names = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
    return {name: kwargs[name] for name in names if name in kwargs}


def _target_rope_parameters(text_config: Any) -> dict:
    """The target's RoPE settings when it has RoPE (so positions mean the same), else the Qwen3 default; only what the
    draft's rotary uses is kept (`draft_rope_parameters`: no `partial_rotary_factor`)."""
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return draft_rope_parameters(rope)
    return {"rope_type": "default", "rope_theta": 1_000_000.0}


def _scale_tolerance(target: PreTrainedModel) -> float:
    """Relative tolerance between a recorded embedding scale and the one `target` applies: its embedding's rounding.

    A target loaded in bfloat16 keeps its scale in bfloat16 (Gemma 3's sqrt(640) = 25.298 becomes 25.25); distinct
    targets differ by far more (1 against sqrt(H); sqrt(640) against sqrt(1152))."""
    embedding = target.get_input_embeddings()
    scale = getattr(embedding, "embed_scale", None)
    dtype = scale.dtype if isinstance(scale, torch.Tensor) else embedding.weight.dtype
    return max(1e-3, torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3


def input_embedding_scale(target: PreTrainedModel) -> float | None:
    """The factor by which `target.get_input_embeddings()` scales its raw rows: `sqrt(hidden_size)` for Gemma 3, 1.0 for
    most targets; `None` if its output is not a scaled row. The draft's block is embedded through that module."""
    embedding = target.get_input_embeddings()
    if getattr(embedding, "embed_scale", None) is not None:
        return float(embedding.embed_scale)
    with torch.no_grad():
        ids = torch.arange(min(8, embedding.weight.shape[0]), device=embedding.weight.device)
        out, raw = embedding(ids[None])[0].float(), embedding.weight[ids].float()  # [8, H] each
    scale = float((out * raw).sum() / raw.square().sum().clamp(min=1e-12))
    return scale if torch.allclose(out, raw * scale, rtol=1e-3, atol=1e-6) else None


def choose_mask_token_id(target: PreTrainedModel, tokenizer: Any | None = None) -> int:
    """Pick the mask token: an existing embedding row that the target does not emit. The rule, in order:

    1. a special token of the tokenizer whose name says it is unused (`mask`, `reserved`, `unused`, `pad`,
       `placeholder`), and that is not the BOS/EOS token;
    2. the first embedding row past the tokenizer's vocabulary (padded rows, never produced by tokenization);
    3. the target config's `pad_token_id`, when it differs from every EOS/BOS id;
    4. the last special token of the tokenizer that is not BOS/EOS/PAD and not used by its chat template (e.g.
       SmolLM2's `<empty_output>`, a code-data marker a chat model does not produce).

    Raises if none applies: pass `mask_token_id=` explicitly then (never resize a frozen embedding to add one).
    """
    num_rows = target.get_input_embeddings().weight.shape[0]
    text_config = target.config.get_text_config()
    emitted = set(token_ids(text_config.eos_token_id)) | set(token_ids(text_config.bos_token_id))
    if tokenizer is not None:
        emitted |= set(token_ids(tokenizer.eos_token_id)) | set(token_ids(tokenizer.bos_token_id))
        for token, token_id in sorted(_special_tokens(tokenizer).items(), key=lambda item: item[1]):
            if (
                token_id not in emitted
                and token_id < num_rows
                and any(h in token.lower() for h in MASK_TOKEN_NAME_HINTS)
            ):
                return token_id
        if len(tokenizer) < num_rows:
            return len(tokenizer)
    pad = text_config.pad_token_id
    if pad is not None and pad not in emitted and 0 <= pad < num_rows:
        return pad
    if tokenizer is not None:
        emitted |= (
            set(token_ids(tokenizer.pad_token_id)) | set(token_ids(pad)) | set(token_ids(tokenizer.unk_token_id))
        )
        template = str(getattr(tokenizer, "chat_template", None) or "")
        unused = [
            i for t, i in _special_tokens(tokenizer).items() if i not in emitted and i < num_rows and t not in template
        ]
        if unused:
            return max(unused)
    raise ValueError(
        "Could not find an unused embedding row for the mask token. Pass `mask_token_id=<id>` (a reserved or padded "
        "token the target never emits), or pass `tokenizer=` so its reserved special tokens can be searched."
    )


def _special_tokens(tokenizer: Any) -> dict[str, int]:
    tokens = {str(t.content if hasattr(t, "content") else t): i for i, t in tokenizer.added_tokens_decoder.items()}
    tokens.update(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    return tokens


__all__ = ["DFlashForDrafting", "DFlashPreTrainedModel", "DFlashLayouts", "choose_mask_token_id", "read_draft_config"]
