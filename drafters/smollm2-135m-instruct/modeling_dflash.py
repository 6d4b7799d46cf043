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
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
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

logger = logging.get_logger(__name__)

ZLAB_ARCHITECTURE = "DFlashDraftModel"
NATIVE_MODEL_TYPE = "muse_glimmer_assistant"
# transformers' native assistant calls the context projection `encoder.{fc,output_norm_enc}`.
NATIVE_KEY_MAPPING = {r"^encoder\.fc\.": "fc.", r"^encoder\.output_norm_enc\.": "hidden_norm."}
WEIGHT_FILE_PREFIXES = ("model.safetensors", "model-", "pytorch_model")
MASK_TOKEN_NAME_HINTS = ("mask", "reserved", "unused", "pad", "placeholder")
LAYER_TYPES = ("full_attention", "sliding_attention")


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


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer; the context is injected into attention without passing through `input_layernorm`."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache, **kwargs
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


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


class DFlashLayouts:
    """Names of the checkpoint layouts `DFlashForDrafting` reads and writes."""

    HF = "hf-dflash"  # model_type "dflash", flat DFlash fields, auto_map for trust_remote_code
    ZLAB = "z-lab"  # model_type "qwen3", architectures ["DFlashDraftModel"], nested dflash_config (vLLM, SGLang)
    NATIVE = "transformers-native"  # model_type "muse_glimmer_assistant" (read only)


def detect_layout(config_dict: dict) -> str:
    """Which layout a raw `config.json` dict is in."""
    if config_dict.get("model_type") == NATIVE_MODEL_TYPE:
        return DFlashLayouts.NATIVE
    if "dflash_config" in config_dict or ZLAB_ARCHITECTURE in (config_dict.get("architectures") or []):
        return DFlashLayouts.ZLAB
    return DFlashLayouts.HF


def zlab_config_dict(config: DFlashConfig, full_vocabulary: bool = False) -> dict:
    """The `config.json` that vLLM, SGLang and llama.cpp's converter read: Qwen3 fields, top-level `block_size`, a
    nested `dflash_config`, and causality spelled out the way vLLM resolves it.

    `full_vocabulary=True` leaves out `draft_vocab_size` (the engines then draft over the target's whole head).
    """
    config_dict = config.to_dict()
    nested = ("mask_token_id", "target_layer_ids", "input_embedding_scale", "causal_sliding_attention")
    for name in ("auto_map", "_name_or_path", "transformers_version", *nested):
        config_dict.pop(name, None)
    if full_vocabulary:
        config_dict.pop("draft_vocab_size", None)
    config_dict["model_type"] = "qwen3"
    config_dict["architectures"] = [ZLAB_ARCHITECTURE]
    config_dict["rope_theta"] = config.rope_parameters.get("rope_theta")  # engines predating rope_parameters
    config_dict["dflash_config"] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": config.target_layer_ids,
        "input_embedding_scale": config.input_embedding_scale,
    }
    if not config.causal_sliding_attention:
        # vLLM: top-level `is_causal`, then `dflash_config.causal`, else `sliding_attention` layers run causally.
        # A causal-sliding drafter writes neither, so that rule gives causal sliding and bidirectional full layers.
        config_dict["is_causal"] = False
        config_dict["dflash_config"]["causal"] = False
    if "sliding_attention" in config.layer_types:
        config_dict["use_sliding_window"] = True  # or transformers' Qwen3Config drops `sliding_window`
    return config_dict


def zlab_state_dict(draft: DFlashForDrafting, target: PreTrainedModel | None, full_vocabulary: bool) -> dict:
    """The drafter's weights in the z-lab layout (CPU, contiguous).

    A reduced draft vocabulary is written as vLLM reads one: `d2t` and the draft's own head `lm_head.weight`
    (`[draft_vocab_size, H]`, the target head's rows of the draft ids). Without that head vLLM would share the target's
    full head and misplace its logits. `full_vocabulary=True` writes neither, so engines share the target's head.
    """
    state_dict = {name: tensor.detach().cpu().contiguous() for name, tensor in draft.state_dict().items()}
    if draft.config.draft_vocab_size is None:
        return state_dict
    if full_vocabulary:
        del state_dict["d2t"]
        return state_dict
    if target is None:
        raise ValueError(
            f"This drafter proposes from a reduced vocabulary ({draft.config.draft_vocab_size} tokens), which vLLM reads "
            "only with the draft's own LM head: pass `target=` (its head's rows are written as `lm_head.weight`), or "
            "`full_vocabulary=True` to export for readers that draft over the whole vocabulary (SGLang, llama.cpp)."
        )
    head = target.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            "The target's LM head has a bias, which the engines' draft head cannot hold; export with "
            "`full_vocabulary=True` so that they share the target's head."
        )
    if head.weight.shape[1] != draft.config.hidden_size:
        raise ValueError(
            f"The target's LM head is {tuple(head.weight.shape)}, not [vocab, {draft.config.hidden_size}]: pass the "
            "target this drafter was built for."
        )
    token_ids = draft.draft_token_ids.to(head.weight.device)
    state_dict["lm_head.weight"] = head.weight.detach()[token_ids].to(draft.dtype).cpu().contiguous()
    return state_dict


def warn_about_zlab_readers(config: DFlashConfig, full_vocabulary: bool) -> None:
    """Say which serving engine reads this export differently from how the drafter was trained."""
    if config.draft_vocab_size is not None and not full_vocabulary:
        logger.warning(
            f"z-lab export with a reduced draft vocabulary ({config.draft_vocab_size} tokens, `lm_head.weight` + "
            "`d2t`): vLLM drafts over it as trained; SGLang ignores both and drafts over the target's whole head; "
            "the authors' reference model takes no `d2t` (export with `full_vocabulary=True` for it), and llama.cpp "
            "maps it only through `hf-dflash export --engine llama.cpp`."
        )
    if "sliding_attention" in config.layer_types and not config.causal_sliding_attention:
        logger.warning(
            "This drafter's sliding-window layers attend bidirectionally inside the block. vLLM reads `is_causal: "
            "false`; SGLang runs `sliding_attention` draft layers causally whatever the config says, so its "
            "acceptance will be lower than measured here."
        )
    if config.input_embedding_scale not in (None, 1.0):
        logger.warning(
            f"The target scales its embedding rows by {config.input_embedding_scale:g}; the export records it as "
            "`dflash_config.input_embedding_scale`, which DFlash v1 readers (vLLM's and SGLang's DFlash) ignore: "
            "they embed the block with the raw rows, so acceptance there will be lower than measured here."
        )


def write_folder_atomically(save_directory: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run `write(tmp_dir)` then move its files into `save_directory`; a failure leaves nothing half-written."""
    target = Path(save_directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        target.mkdir(exist_ok=True)
        written = {path.name for path in tmp.iterdir()}
        for stale in target.iterdir():  # weights of an earlier save would shadow or mix with the new ones
            if stale.name not in written and stale.name.startswith(WEIGHT_FILE_PREFIXES):
                stale.unlink()
        for path in tmp.iterdir():
            os.replace(path, target / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
        trained over 8,192 of them keeps its layers when it continues over 16,384).
        """
        size = int(torch.as_tensor(target_ids).unique().numel())
        self.config.draft_vocab_size = size
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long, device=self.fc.weight.device))
        self.set_draft_vocabulary(target_ids)

    def draft_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The target's LM head on draft hidden states `[..., H]` -> `[..., V_d]` logits over the draft vocabulary
        (`V_d` = `draft_vocab_size`, or the whole vocabulary). Map an index back with `to_target_ids`."""
        # Products over rows `[n, H]`: on a CPU, torch's stock bf16 linear over a 3-D slice such as `hidden[:, 1:]`
        # (contiguous, but not with default strides) takes a slow oneDNN path: 3.4 against 0.29 ms for the same rows as
        # a 2-D input at SmolLM2's draft head on a Xeon (benchmarks/results/probe_sliced_linear_xeon.json).
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])  # a view where it can be
        token_ids = self.draft_token_ids
        if token_ids is None:
            logits = lm_head(rows)
        else:
            weight, bias = self._draft_head(lm_head, token_ids)
            logits = nn.functional.linear(rows, weight, bias)
        return logits.view(*hidden_states.shape[:-1], logits.shape[-1])

    def to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Draft-vocabulary indices -> target token ids."""
        token_ids = self.draft_token_ids
        return draft_ids if token_ids is None else token_ids[draft_ids]

    def to_full_vocabulary(self, draft_scores: torch.Tensor, vocab_size: int, fill: float) -> torch.Tensor:
        """`[..., V_d]` scores -> `[..., V]`, `fill` at tokens outside the draft vocabulary."""
        token_ids = self.draft_token_ids
        if token_ids is None:
            return draft_scores
        full = draft_scores.new_full((*draft_scores.shape[:-1], vocab_size), fill)
        return full.index_copy_(-1, token_ids, draft_scores)

    def _draft_head(self, lm_head: nn.Module, token_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM-head rows of the draft vocabulary, cached while the (frozen) head and the vocabulary are unchanged."""
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        key = (weight.data_ptr(), weight._version, self.d2t.data_ptr(), self.d2t._version)
        if self._draft_head_cache is None or self._draft_head_cache[0] != key:
            rows = weight.detach()[token_ids]
            self._draft_head_cache = (key, rows, bias.detach()[token_ids] if bias is not None else None)
        return self._draft_head_cache[1], self._draft_head_cache[2]

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
        masks = self._attention_masks(attention_mask, batch, block_len, past_len + context.shape[1] + block_len)
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

    def _attention_masks(self, attention_mask: Any, batch: int, block_len: int, num_keys: int) -> dict[str, Any]:
        """The mask of each layer type (`"full_attention"`, `"sliding_attention"`); `None` means every key is visible."""
        if isinstance(attention_mask, dict):  # per layer type, e.g. from the training collator
            full = self._attention_masks(attention_mask["full_attention"], batch, block_len, num_keys)
            sliding = attention_mask.get("sliding_attention", attention_mask["full_attention"])
            sliding = self._attention_masks(sliding, batch, block_len, num_keys)
            return {"full_attention": full["full_attention"], "sliding_attention": sliding["full_attention"]}
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            return dict.fromkeys(LAYER_TYPES, attention_mask)  # e.g. a flex BlockMask, built by the caller
        dtype = self.norm.weight.dtype
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
        if "sliding_attention" in self.config.layer_types:
            if attention_mask is None:
                attention_mask = torch.ones(batch, num_keys, dtype=torch.bool, device=self.norm.weight.device)
            masks["sliding_attention"] = key_padding_to_attention_mask(
                attention_mask, block_len, dtype, self.config.sliding_window, self.config.causal_sliding_attention
            )
        return masks

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
            config_dict, _ = DFlashConfig.get_config_dict(pretrained_model_name_or_path, **_hub_kwargs(kwargs))
            layout = detect_layout(config_dict)
            if layout == DFlashLayouts.NATIVE and config_dict.get("sliding_window"):
                config_dict["sliding_window"] += 1  # native masks keep |q - k| <= w, ours (Qwen3's) q - k < w
            if layout != DFlashLayouts.HF:
                for name in ("model_type", "architectures", "auto_map", "transformers_version"):
                    config_dict.pop(name, None)
                kwargs["config"] = DFlashConfig(**config_dict)
            if layout == DFlashLayouts.NATIVE:
                kwargs.setdefault("key_mapping", NATIVE_KEY_MAPPING)
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        if info.get("missing_keys"):
            raise ValueError(
                f"{pretrained_model_name_or_path} lacks weights {sorted(info['missing_keys'])}: they would be random. "
                "Is it a DFlash drafter checkpoint (hf-dflash, z-lab or transformers-native layout)?"
            )
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


__all__ = ["DFlashForDrafting", "DFlashPreTrainedModel", "DFlashLayouts", "choose_mask_token_id"]
