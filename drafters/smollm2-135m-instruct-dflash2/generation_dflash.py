"""DFlash inside `target.generate(..., assistant_model=draft)`.

transformers' assisted decoding asks a *candidate generator* for draft tokens, verifies them with one target forward
and keeps the longest correct prefix (greedy) or applies speculative sampling (Leviathan et al., Algorithm 1), so the
output is the target's own. This module provides:

- `DFlashCandidateGenerator`: drafts a block from the target's hidden states (`output_hidden_states` of the verify
  forward) with a DFlash drafter. Unlike transformers' native generator it keeps the user's `output_hidden_states`,
  clamps drafts to the remaining token budget, applies position-independent logits warpers in one batched call, and
  validates the target/draft pair up front.
- `enable_dflash_generate()`: the routing. transformers only picks a DFlash generator when the *target's* generation
  config says `speculation_type="dflash"`; nothing the assistant carries is read. We therefore wrap two private
  `GenerationMixin` methods, once per process: `_get_candidate_generator` returns our generator when the assistant is a
  DFlash drafter and no other strategy was asked for (an explicit `speculation_type="dflash"` keeps transformers' native
  generator), and `_validate_generation_mode` replaces the generic assistant checks (vocab/tokenizer) with ours for
  DFlash drafters. Every other assistant falls through untouched. The wrap is installed by `DFlashForDrafting.__init__`,
  so it also happens for drafts loaded with `trust_remote_code` where `hf_dflash` is not installed; it is skipped with a
  warning if the installed transformers does not have the expected method signatures.
- `check_draft_fits_target()`: the validation shared with `hf_dflash.speculative_generate`.

This file is copied next to the weights by `save_pretrained`: it imports only torch, transformers and the standard
library.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin
from transformers.generation import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Warpers that transform each position's logits on their own: safe to apply to all drafted positions at once.
POSITION_INDEPENDENT_WARPERS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)
_EXPECTED_PARAMETERS = {
    "_get_candidate_generator": {
        "generation_config",
        "input_ids",
        "logits_processor",
        "model_kwargs",
        "assistant_model",
    },
    "_validate_generation_mode": {"generation_mode", "generation_config", "generation_mode_kwargs"},
}


def is_dflash_draft(model: Any) -> bool:
    """Whether `model` is a DFlash drafter (ours, or a copy loaded with `trust_remote_code`)."""
    return bool(getattr(model, "_is_dflash_draft", False))


# ---------------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------------


def token_ids(value: Any) -> list[int]:
    """`None`, one id or a list of ids (as `eos_token_id` may be) -> a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def cut_at_stop(tokens: Any, stop_ids: Any) -> list[int]:
    """`tokens` up to and including the first of `stop_ids`; all of them when none is a stop id."""
    tokens = list(tokens)
    stop = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
    return tokens if stop is None else tokens[: stop + 1]


def pad_token_id_of(generation_config: Any) -> int:
    """The id that pads finished rows and batches: `pad_token_id`, else the first EOS id, else 0."""
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    eos = token_ids(generation_config.eos_token_id)
    return eos[0] if eos else 0


def keeps_recurrent_state(target: Any) -> bool:
    """Whether `target`'s cache holds a recurrent or linear-attention state (Mamba, Qwen3-Next, ...).

    transformers < 5.25 flags such models with `_is_stateful`; later versions dropped the flag, so the cache layers
    the target's config asks for are checked too (built lazily: no tensors are allocated).
    """
    if getattr(target, "_is_stateful", False):
        return True
    layers = DynamicCache(config=target.config).layers
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)


def check_target_supported(target: Any) -> None:
    """Raise a clear error if `target` is a kind of model DFlash cannot speculate for losslessly."""
    target_name = type(target).__name__
    text_config = target.config.get_text_config()
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError(f"{target_name} is an encoder-decoder model; DFlash drafts for decoder-only causal LMs.")
    if keeps_recurrent_state(target):
        raise ValueError(
            f"{target_name} keeps a recurrent/linear-attention state that cannot be rolled back after a rejected "
            "draft, so speculative decoding cannot be lossless with it. Use plain `generate` for this model."
        )
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "mrope_section" in rope:
        raise ValueError(
            f"{target_name} uses multi-axis (mRoPE) positions, which DFlash drafts do not model. Use a text-only "
            "target with one position per token."
        )
    if target.get_output_embeddings() is None:
        raise ValueError(f"{target_name} has no LM head (`get_output_embeddings()` is None); load it as a causal LM.")


def check_draft_fits_target(
    target: Any, draft: Any, batch_size: int | None = None, max_batch_size: int | None = 1
) -> None:
    """Raise a clear error if `draft` cannot speculate for `target` (or for a batch of `batch_size` rows).

    Checks: a decoder-only target with a croppable attention cache and one-axis positions, an LM head; the draft's
    hidden size, vocabulary, tapped layers and mask token against the target; same dtype and device.
    """
    check_target_supported(target)
    config = draft.config
    text_config = target.config.get_text_config()
    for name in ("mask_token_id", "target_layer_ids", "block_size"):
        if getattr(config, name, None) is None:
            raise ValueError(
                f"The draft's config has no `{name}`: set it (e.g. `draft.config.{name} = ...`; for the mask token "
                "see `hf_dflash.choose_mask_token_id`), or build the draft with `DFlashForDrafting.from_target`."
            )
    num_rows = target.get_input_embeddings().weight.shape[0]
    if config.hidden_size != text_config.hidden_size:
        raise ValueError(
            f"The draft's hidden size is {config.hidden_size} but the target's is {text_config.hidden_size}: this draft "
            f"was built for another target. Build one for this target with `DFlashForDrafting.from_target(target)`."
        )
    if config.vocab_size is not None and config.vocab_size != num_rows:
        raise ValueError(
            f"The draft expects a vocabulary of {config.vocab_size} tokens but the target's embedding has {num_rows} "
            "rows: draft and target must share the tokenizer. Use a draft trained for this target."
        )
    num_layers = text_config.num_hidden_layers
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad_ids:
        raise ValueError(
            f"target_layer_ids {config.target_layer_ids} include {bad_ids}, outside the target's {num_layers} decoder "
            f"layers (valid ids: 0..{num_layers - 1}). The draft was built for a deeper target; use one built for this."
        )
    if getattr(config, "num_target_layers", None) not in (None, num_layers):
        logger.warning(
            f"The draft was trained for a target with {config.num_target_layers} layers, this one has {num_layers}; "
            "acceptance will be poor unless this is the right target."
        )
    if not 0 <= config.mask_token_id < num_rows:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is outside the target's embedding (0..{num_rows - 1}). Set it to a "
            "reserved row the target never emits (see `hf_dflash.choose_mask_token_id`)."
        )
    if draft.dtype != target.dtype:
        raise TypeError(f"The draft is {draft.dtype} but the target is {target.dtype}: call `draft.to(target.dtype)`.")
    if draft.device != target.device:
        raise ValueError(
            f"The draft is on {draft.device} but the target is on {target.device}: call `draft.to(target.device)`."
        )
    if batch_size is not None and max_batch_size is not None and batch_size > max_batch_size:
        raise ValueError(
            f"`generate(..., assistant_model=draft)` decodes one sequence at a time (got a batch of {batch_size}). "
            "Use `hf_dflash.speculative_generate(target, draft, input_ids, attention_mask)` for batches."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Shared drafting steps (also used by `hf_dflash.speculative_generate`)
# ---------------------------------------------------------------------------------------------------------------------


def synchronized_clock(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has finished its queued work (CUDA and MPS run asynchronously; a CPU
    has nothing to wait for), so the time between two readings is the work queued between them. Every timer of the
    library reads this clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


def context_features(hidden_states: tuple, target_layer_ids: list[int], length: int) -> torch.Tensor:
    """`[b, length, n * H]`: the tapped layers' outputs (`hidden_states[l + 1]`) of the first `length` positions."""
    try:
        return torch.cat([hidden_states[i + 1][:, :length] for i in target_layer_ids], dim=-1)
    except (TypeError, IndexError) as error:
        raise RuntimeError(
            "The target did not return the hidden states of layers "
            f"{[i + 1 for i in target_layer_ids]}; DFlash needs a target that supports `output_hidden_states`."
        ) from error


def noise_block(anchor_ids: torch.LongTensor, block_size: int, mask_token_id: int) -> torch.LongTensor:
    """`[b, B]` block `[anchor, MASK x (B-1)]` from the `[b, 1]` last committed tokens."""
    masks = anchor_ids.new_full((anchor_ids.shape[0], block_size - 1), mask_token_id)
    return torch.cat([anchor_ids, masks], dim=1)


def draft_forward(
    draft: Any,
    embed_tokens: Any,
    anchor_ids: torch.LongTensor,
    context: torch.Tensor,
    position_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    cache: DynamicCache | None = None,
) -> torch.Tensor:
    """One draft forward: `[b, B, H]` hidden states of the block `[anchor, MASK x (B-1)]` read after `context`
    (`[b, n, taps * H]` target features of the tokens the draft has not read yet).

    `position_ids` `[b, n + B]` cover the context and the block; `attention_mask` `[b, cached + n + B]` marks the
    keys to attend (`None`: all). With a `cache` the context's keys/values stay in it and the block's are cropped
    back, so the next draft reads only newer context.
    """
    block_size = draft.config.block_size
    embeds = embed_tokens(noise_block(anchor_ids, block_size, draft.config.mask_token_id))  # [b, B, H]
    out = draft(
        noise_embeds=embeds,
        context_hidden_states=context,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cache=cache,
    )
    if cache is not None:
        cache.crop(-block_size)
    return out.last_hidden_state


def draft_logits_full_vocabulary(draft: Any, lm_head: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """`[b, k, V]` draft logits over the target's whole vocabulary; a draft with a reduced vocabulary (`d2t`) gives
    `-inf` outside it, so `q` is 0 there and the target's verification stays exact."""
    logits = draft.draft_logits(hidden_states, lm_head)
    return draft.to_full_vocabulary(logits, lm_head.weight.shape[0], float("-inf"))


def is_dflash2(draft: Any) -> bool:
    """Whether `draft` proposes through DFlash2's candidate selector."""
    return getattr(draft.config, "variant", "dflash") == "dflash2"


def walk_logits(chain: Any, candidates: torch.LongTensor, temperature: float | None, vocab_size: int) -> torch.Tensor:
    """`[b, S, V]` logits of a DFlash2 walk over the whole vocabulary: each row's scores over its K candidates
    (`candidates` `[b, S, K]`, target ids) divided by the temperature, -inf elsewhere; their softmax is the
    distribution `q` each proposal was drawn from."""
    rows = chain.row_scores / (temperature or 1.0)  # [b, S, K]
    logits = rows.new_full((*rows.shape[:-1], vocab_size), float("-inf"))
    return logits.scatter_(-1, candidates, rows)


def selector_proposals(
    draft: Any, lm_head: Any, hidden_states: torch.Tensor, anchor_ids: torch.LongTensor, temperature: float | None
) -> tuple[torch.LongTensor, torch.Tensor]:
    """DFlash2's proposals for drafted slots `[b, S, H]` after the `[b]` anchors: the selector's walked chain `[b, S]`
    (greedy with `temperature` None or 0, else sampled at it) and the walk's logits over the whole vocabulary
    (`walk_logits`)."""
    tokens, candidates, chain = draft.select_chain(hidden_states, lm_head, anchor_ids, temperature)
    return tokens, walk_logits(chain, candidates, temperature, lm_head.weight.shape[0])


def greedy_head_step(draft: Any, lm_head: Any, hidden_states: torch.Tensor, anchor_ids: torch.LongTensor) -> Any:
    """What a greedy round computes after the draft forward, for timing it: the logits over the draft vocabulary (v1),
    or the selector's walked chain (DFlash2)."""
    if is_dflash2(draft):
        return draft.select_chain(hidden_states, lm_head, anchor_ids)
    return draft.draft_logits(hidden_states, lm_head)


def warp_logits(
    logits: torch.Tensor, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList | None
) -> torch.Tensor:
    """Apply position-independent warpers to all `[b, k, V]` draft positions in one call (fp32 out)."""
    logits = logits.float()
    if not logits_processor:
        return logits
    batch, k, vocab = logits.shape
    flat_ids = input_ids.repeat_interleave(k, dim=0)  # warpers ignore the ids; shape kept for their signature
    return logits_processor(flat_ids, logits.reshape(batch * k, vocab)).view(batch, k, vocab)


def sample_categorical(probs: torch.Tensor) -> torch.LongTensor:
    """One draw per row of `[..., V]` probabilities (unnormalised is fine) -> `[...]` token ids, by the inverse of
    each row's cumulative distribution: one uniform a row, where `torch.multinomial` draws an exponential for every
    entry (7.6 ms against 0.2 ms for 7 rows of a 49,152-token vocabulary on 2 CPU cores). A token of zero mass is
    never drawn: the uniform stays below the row's total, and the first cumulative sum above it ends on a token that
    added mass."""
    cdf = probs.float().cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    if not bool((total > 0).all()):  # also catches NaN, as torch.multinomial does
        raise ValueError("sample_categorical: a row of probabilities sums to zero, is negative or is not a number.")
    below_total = torch.nextafter(total, torch.zeros_like(total))
    uniform = torch.minimum(torch.rand(total.shape, device=total.device) * total, below_total)
    return torch.searchsorted(cdf, uniform, right=True)[..., 0]


def _is_position_independent(logits_processor: LogitsProcessorList | None) -> bool:
    return all(isinstance(processor, POSITION_INDEPENDENT_WARPERS) for processor in logits_processor or [])


class DFlashCandidateGenerator(CandidateGenerator):
    """Candidate generator for transformers' assisted decoding, driven by a DFlash drafter.

    Each call drafts `min(B - 1, remaining budget - 1)` tokens from one draft forward over
    `[last committed token, MASK x (B-1)]`, with the target hidden states of the tokens committed since the previous
    draft appended to the draft's context cache. Returns the candidates and their (processed) draft logits `q`.
    Given a planner (`generation_config.dflash_planner`, a `hf_dflash.VerifyPlanner`), calls are planned like
    `speculative_generate`'s chains: greedy decoding returns only the proposals worth verifying (the planner's
    measured costs, `best_num_draft`), and while drafted rounds commit fewer tokens per second than plain decoding
    would, calls return no candidate without drafting (the planner's `Fallback` for this path: a plain step), keeping
    the skipped steps' hidden states for the next draft. The planner keeps what it measured and judged for the next
    call. This path verifies chains only. A DFlash2 drafter proposes its selector's chain (`selector_proposals`), and
    its candidate logits are the walk's, so that `q` is what the proposals were drawn from.
    """

    requires_model_outputs = True

    def __init__(
        self,
        target: Any,
        draft: Any,
        generation_config: Any,
        logits_processor: LogitsProcessorList | None,
        input_ids: torch.LongTensor,
    ):
        check_draft_fits_target(target, draft, batch_size=input_ids.shape[0])
        self.draft = draft
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.target_layer_ids = list(draft.config.target_layer_ids)
        self.block_size = draft.config.block_size
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = generation_config.temperature if self.do_sample else None
        self.logits_processor = logits_processor
        self.batched_warpers = _is_position_independent(logits_processor)
        # Keep the user's own request for all hidden states; otherwise capture only the tapped layers.
        wants_all = generation_config.output_hidden_states and generation_config.return_dict_in_generate
        layers = [i + 1 for i in self.target_layer_ids]
        self.model_kwargs_overrides = {"output_hidden_states": True if wants_all else layers}
        self.cache = DynamicCache(config=draft.config)
        self.cache.activate_past_recording()  # lets sliding-window layers crop the block back
        self.num_context = 0  # committed tokens whose target features are already in the draft cache
        self.pending: list[torch.Tensor] = []  # features of committed tokens not in the draft cache yet
        self.num_seen = 0  # committed tokens whose features are in the cache or pending
        planner = getattr(generation_config, "dflash_planner", None)
        self.costs = planner.costs_for(target, draft, batch_size=1) if planner is not None else None
        self.fallback = planner.fallback(self.costs, self.path) if planner is not None else None
        self.last_step: tuple[int, bool, float] | None = None  # (length before, drafted, start) of the last call

    @property
    def path(self) -> str:
        """The decoding path, as the planner keeps its fallbacks apart (`VerifyPlanner.fallback`)."""
        return f"generate({'do_sample' if self.do_sample else 'greedy'})"

    @property
    def num_drafting_tokens(self) -> int:
        """The most candidates one call proposes (transformers >= 5.25 reads it when it prepares the target cache)."""
        return self.block_size - 1

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        budget = self.max_length - input_ids.shape[1]
        if is_first_iteration or budget <= 1:  # the target prefills first; one token left needs no draft
            return input_ids, None
        committed = input_ids.shape[1] - 1  # the last token (the target's bonus) has no hidden states yet
        new = committed - self.num_seen  # the last forward's first positions: what it committed
        self.pending.append(context_features(model_outputs.hidden_states, self.target_layer_ids, new))
        self.num_seen = committed
        self._record_last_step(input_ids)
        drafting = self.fallback is None or self.fallback.should_draft()
        if self.fallback is not None:  # timed only for the fallback: on an accelerator the clock waits for the device
            self.last_step = (input_ids.shape[1], drafting, synchronized_clock(input_ids.device))
        if not drafting:
            return input_ids, None  # a plain step: the target decodes one token
        features, self.pending = torch.cat(self.pending, dim=1), []
        hidden = self._draft_block(input_ids, features, (model_kwargs or {}).get("attention_mask"))
        num_draft = min(self.block_size - 1, budget - 1)
        if is_dflash2(self.draft):  # the selector's chain; its logits make q, whatever the processors do to p
            anchor = input_ids[:, -1]
            draft_ids, logits = selector_proposals(
                self.draft, self.lm_head, hidden[:, 1 : 1 + num_draft], anchor, self.temperature
            )
        else:
            logits = draft_logits_full_vocabulary(self.draft, self.lm_head, hidden[:, 1 : 1 + num_draft])  # [1, k, V]
            draft_ids, logits = self._select(input_ids, logits)
        keep = self._num_worth_verifying(logits)
        return torch.cat([input_ids, draft_ids[:, :keep]], dim=1), logits[:, :keep] if keep else None

    def _record_last_step(self, input_ids: torch.LongTensor) -> None:
        """Tell the fallback what the last step (this call's predecessor and the target's verification after it)
        committed and how long it took."""
        if self.fallback is not None and self.last_step is not None:
            length_before, drafted, start = self.last_step
            seconds = synchronized_clock(input_ids.device) - start
            self.fallback.record_step(drafted, input_ids.shape[1] - length_before, 1, seconds)
        self.last_step = None

    def _num_worth_verifying(self, logits: torch.Tensor) -> int:
        """Every proposal, unless decoding is greedy with a planner: then as many as pay for their measured cost.
        Sampling keeps them all: with history-dependent processors a later slot's confidence depends on an earlier
        sampled token, and the choice must not."""
        if self.costs is None or self.do_sample:
            return logits.shape[1]
        return self.costs.best_num_draft(logits.float().softmax(-1).amax(-1))  # [1, k] draft confidence per slot

    def _draft_block(
        self, input_ids: torch.LongTensor, features: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One draft forward; returns the `[1, B, H]` block hidden states and leaves only context K/V cached."""
        committed = input_ids.shape[1] - 1
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding sits at position 0
        block_positions = positions[:, committed:] + torch.arange(self.block_size, device=positions.device)
        position_ids = torch.cat([positions[:, self.num_context : committed], block_positions], dim=1)
        key_mask = torch.cat([attention_mask[:, :committed], attention_mask.new_ones(1, self.block_size)], dim=1)
        hidden = draft_forward(
            self.draft, self.embed_tokens, input_ids[:, -1:], features, position_ids, key_mask, self.cache
        )
        self.num_context = committed
        return hidden

    def _select(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
        """Pick draft tokens (argmax, or samples from `q`) after the generation's logits processors."""
        if not self.logits_processor or self.batched_warpers:
            logits = warp_logits(logits, input_ids, self.logits_processor)
            if not self.do_sample:
                return logits.argmax(-1), logits
            return sample_categorical(logits[0].softmax(-1))[None], logits
        # History-dependent processors (repetition penalty, n-gram bans, ...) see each drafted token in turn.
        logits, ids = logits.float(), input_ids
        for k in range(logits.shape[1]):
            logits[:, k] = self.logits_processor(ids, logits[:, k])
            pick = (
                sample_categorical(logits[:, k].softmax(-1))[:, None]
                if self.do_sample
                else logits[:, k].argmax(-1, True)
            )
            ids = torch.cat([ids, pick], dim=1)
        return ids[:, input_ids.shape[1] :], logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """The block size is fixed by training; nothing to adapt."""


# ---------------------------------------------------------------------------------------------------------------------
# Routing `generate(..., assistant_model=draft)` to our generator
# ---------------------------------------------------------------------------------------------------------------------


def _routing_supported() -> bool:
    """Whether the installed transformers has the private methods we wrap, with the parameters we rely on."""
    for name, expected in _EXPECTED_PARAMETERS.items():
        method = getattr(GenerationMixin, name, None)
        if method is None or not expected <= set(inspect.signature(method).parameters):
            return False
    return True


def _uses_our_generator(generation_config: Any, assistant_model: Any) -> bool:
    """A DFlash drafter as assistant, and no other candidate strategy explicitly requested."""
    return (
        is_dflash_draft(assistant_model)
        and getattr(generation_config, "speculation_type", None) is None
        and getattr(generation_config, "prompt_lookup_num_tokens", None) is None
        and getattr(generation_config, "assistant_early_exit", None) is None
        and not getattr(generation_config, "use_mtp", False)
    )


def enable_dflash_generate() -> bool:
    """Route `generate(..., assistant_model=<DFlash drafter>)` to `DFlashCandidateGenerator`. Idempotent.

    Returns whether the routing is active. Called by `DFlashForDrafting.__init__`; harmless to call again, from this
    module or from a `trust_remote_code` copy of it.
    """
    if getattr(GenerationMixin._get_candidate_generator, "_dflash_routing", False):
        return True
    if not _routing_supported():
        logger.warning_once(
            "This transformers version does not have the generation internals hf-dflash routes through; "
            "`generate(..., assistant_model=draft)` will not use DFlash. Pass `speculation_type='dflash'` for "
            "transformers' own DFlash path, or use `hf_dflash.speculative_generate`."
        )
        return False
    GenerationMixin._get_candidate_generator = _wrap_get_candidate_generator(GenerationMixin._get_candidate_generator)
    GenerationMixin._validate_generation_mode = _wrap_validate_generation_mode(
        GenerationMixin._validate_generation_mode
    )
    return True


def _wrap_get_candidate_generator(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        assistant, generation_config = call.get("assistant_model"), call["generation_config"]
        if (
            is_dflash_draft(assistant)
            and is_dflash2(assistant)
            and not _uses_our_generator(generation_config, assistant)
        ):
            raise ValueError(
                "This DFlash2 drafter proposes through its candidate selector, which only hf-dflash's generator runs; "
                f"`speculation_type={getattr(generation_config, 'speculation_type', None)!r}` (or another candidate "
                "strategy) asks for a path that would ignore it. Drop that argument: "
                "`generate(..., assistant_model=draft)` routes to hf-dflash's generator."
            )
        if _uses_our_generator(generation_config, assistant):
            return DFlashCandidateGenerator(
                target=self,
                draft=call["assistant_model"],
                generation_config=call["generation_config"],
                logits_processor=call["logits_processor"],
                input_ids=call["input_ids"],
            )
        return original(self, *args, **kwargs)

    _get_candidate_generator._dflash_routing = True
    return _get_candidate_generator


def _wrap_validate_generation_mode(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _validate_generation_mode(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        mode_kwargs = call.arguments["generation_mode_kwargs"]
        if not is_dflash_draft(mode_kwargs.get("assistant_model")):
            return original(self, *args, **kwargs)
        check_draft_fits_target(self, mode_kwargs["assistant_model"], max_batch_size=None)
        # Our check replaces the generic assistant checks (which compare vocab sizes to detect other tokenizers).
        call.arguments["generation_mode_kwargs"] = {k: v for k, v in mode_kwargs.items() if k != "assistant_model"}
        return original(*call.args, **call.kwargs)

    _validate_generation_mode._dflash_routing = True
    return _validate_generation_mode


__all__ = [
    "DFlashCandidateGenerator",
    "check_draft_fits_target",
    "check_target_supported",
    "context_features",
    "cut_at_stop",
    "draft_forward",
    "enable_dflash_generate",
    "greedy_head_step",
    "is_dflash2",
    "is_dflash_draft",
    "noise_block",
    "sample_categorical",
    "selector_proposals",
    "walk_logits",
    "warp_logits",
]
