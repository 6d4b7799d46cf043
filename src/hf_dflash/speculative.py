"""Our own speculative loop: batched, lossless DFlash decoding with acceptance statistics.

One round, for every row at once (B = block size, k <= B - 1 drafted tokens):

1. draft:  one drafter forward over `[bonus, MASK x (B-1)]`, conditioned on the target hidden states of the tokens
           committed since the last round; keep `k` proposals (argmax, or samples from the draft distribution `q`):
           all B - 1, or with `verify_costs` only those worth their measured verify cost (`verify_policy`);
2. verify: one target forward over `[bonus, d_1 .. d_k]`;
3. accept: greedy keeps the longest prefix where `d_i == argmax p_i`; sampling applies Leviathan et al.'s Algorithm 1
           (accept `d_i` with probability `min(1, p_i(d_i) / q_i(d_i))`, on rejection sample `norm(max(0, p_i - q_i))`);
           either way the target then contributes one token (the new bonus), so a round commits `tau = n + 1` tokens;
4. roll back: crop the target cache to the longest row; shorter rows mask their rejected slots (holes in the
           attention mask, positions counted over valid tokens only), so every row stays exactly the target's own
           computation without re-laying the cache out.

Targets with sliding-window attention count their window in cache slots, which holes would shrink; for them a batch
is decoded row by row (still lossless).
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.utils import logging

from .generation_dflash import (
    check_draft_fits_target,
    context_features,
    draft_logits_full_vocabulary,
    noise_block,
    pad_token_id_of,
    token_ids,
    warp_logits,
)
from .verify_policy import VerifyCosts, cached_verify_costs

logger = logging.get_logger(__name__)

SUPPORTED_GENERATION_FIELDS = {
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
}


@dataclass
class SpeculativeStats:
    """What a run of `speculative_generate` did. `tau` counts tokens committed per verify forward, bonus included."""

    acceptance_lengths: list[int] = field(default_factory=list)  # one entry per (row, round)
    block_size: int = 0
    num_rounds: int = 0
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    new_tokens: int = 0
    verified_drafts: int = 0  # proposals the target checked, over all rounds (fewer than B - 1 with verify_costs)

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens committed per target verify forward)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def verified_drafts_per_round(self) -> float:
        """Proposals the target checked per round (B - 1 unless `verify_costs` cut them or the budget ran out)."""
        return self.verified_drafts / max(self.num_rounds, 1)

    @property
    def histogram(self) -> list[int]:
        """`histogram[t]` = how many (row, round) pairs committed `t` tokens, for t = 0..B."""
        counts = Counter(self.acceptance_lengths)
        return [counts.get(length, 0) for length in range(self.block_size + 1)]

    @property
    def total_time_s(self) -> float:
        return self.prefill_time_s + self.draft_time_s + self.verify_time_s

    def merge(self, other: SpeculativeStats) -> SpeculativeStats:
        """Add another run's counts and times to this one (used when a batch is decoded row by row)."""
        self.acceptance_lengths += other.acceptance_lengths
        self.block_size = max(self.block_size, other.block_size)
        for name in ("num_rounds", "prefill_time_s", "draft_time_s", "verify_time_s", "new_tokens", "verified_drafts"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "histogram": self.histogram,
            "num_rounds": self.num_rounds,
            "new_tokens": self.new_tokens,
            "prefill_time_s": self.prefill_time_s,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "verified_drafts_per_round": self.verified_drafts_per_round,
        }


@dataclass
class SpeculativeOutput:
    """`sequences`: `[b, prompt_len + longest generation]`, the prompt as given then the new tokens, right-padded
    with `pad_token_id` after a row's end. `num_new_tokens[r]` says how many of row r's tokens are new."""

    sequences: torch.LongTensor
    num_new_tokens: list[int]
    stats: SpeculativeStats


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    streamer: Any | None = None,
    generation_config: GenerationConfig | None = None,
    verify_costs: VerifyCosts | str | None = None,
    **generation_kwargs: Any,
) -> SpeculativeOutput:
    """Generate with `target`, drafting with the DFlash `draft`; the output is exactly the target's own.

    Args:
        target: any supported decoder-only causal LM (see `check_draft_fits_target`).
        draft: a `DFlashForDrafting` built or trained for `target`, same dtype and device.
        input_ids: `[b, prompt_len]` prompts, left-padded when ragged.
        attention_mask: `[b, prompt_len]`, 0 on padding.
        streamer: a transformers streamer (`TextStreamer`, ...), batch size 1 only.
        generation_config / generation_kwargs: `max_new_tokens`, `do_sample`, `temperature`, `top_k`, `top_p`,
            `min_p`, `eos_token_id`, `pad_token_id`; defaults come from `target.generation_config`.
        verify_costs: `None` verifies every proposal of the block (DFlash as published: right where verifying a
            block costs about one token, as on a GPU). `"auto"` measures the target's forward time over 1 .. B
            tokens once (about a second on a CPU; cached per target) and each round verifies only as many
            proposals as pay for their cost given the draft's confidence (`hf_dflash.verify_policy`); or pass
            measured `VerifyCosts`. The output is the target's own either way.

    Returns:
        `SpeculativeOutput` with the sequences, the new-token counts and `SpeculativeStats` (tau, histogram, times).
    """
    config = _resolve_generation_config(target, generation_config, generation_kwargs)
    batch_size, prompt_len = input_ids.shape
    check_draft_fits_target(target, draft, batch_size, max_batch_size=None)
    if streamer is not None and batch_size > 1:
        raise ValueError("A streamer can follow one sequence only; pass a batch of one, or no streamer.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    max_new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len
    row_by_row = batch_size > 1 and _has_sliding_window(target)
    costs = _resolve_verify_costs(target, draft, verify_costs, 1 if row_by_row else batch_size)
    if row_by_row:
        return _generate_row_by_row(target, draft, input_ids, attention_mask, config, max_new_tokens, costs)
    loop = _SpeculativeLoop(target, draft, config, max_new_tokens, streamer, costs)
    return loop.run(input_ids, attention_mask)


def _resolve_verify_costs(target, draft, verify_costs, batch_size: int) -> VerifyCosts | None:
    if verify_costs is None or isinstance(verify_costs, VerifyCosts):
        return verify_costs
    if verify_costs == "auto":
        return cached_verify_costs(target, draft, batch_size)
    raise ValueError(f"verify_costs must be None, 'auto' or a VerifyCosts, got {verify_costs!r}.")


def _resolve_generation_config(
    target: PreTrainedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> GenerationConfig:
    unsupported = sorted(set(kwargs) - SUPPORTED_GENERATION_FIELDS)
    if unsupported:
        raise ValueError(
            f"speculative_generate does not support {unsupported}; supported: {sorted(SUPPORTED_GENERATION_FIELDS)}. "
            "Use `target.generate(..., assistant_model=draft)` for other generation options (logits processors, ...)."
        )
    config = GenerationConfig.from_dict((generation_config or target.generation_config).to_dict())
    config.update(**kwargs)
    if config.max_new_tokens is None and config.max_length is None:
        raise ValueError("Set `max_new_tokens`.")
    return config


def _has_sliding_window(target: PreTrainedModel) -> bool:
    text_config = target.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None) or []
    if any(layer_type != "full_attention" for layer_type in layer_types):
        return True
    return getattr(text_config, "sliding_window", None) is not None and getattr(
        text_config, "use_sliding_window", True
    )


def _generate_row_by_row(target, draft, input_ids, attention_mask, config, max_new_tokens, costs) -> SpeculativeOutput:
    logger.info("Target uses sliding-window attention: decoding the batch row by row to stay lossless.")
    rows, counts, stats = [], [], SpeculativeStats()
    for row_ids, row_mask in zip(input_ids, attention_mask):
        prompt = row_ids[row_mask.bool()][None]  # strip the left padding
        loop = _SpeculativeLoop(target, draft, config, max_new_tokens, None, costs)
        out = loop.run(prompt, torch.ones_like(prompt))
        rows.append(out.sequences[0, prompt.shape[1] :])
        counts.append(out.num_new_tokens[0])
        stats.merge(out.stats)
    pad = pad_token_id_of(config)
    generated = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)
    return SpeculativeOutput(torch.cat([input_ids, generated], dim=1), counts, stats)


def _sampling_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The same warpers `generate` uses for sampling, in the same order."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return warpers


class _SpeculativeLoop:
    """State of one batched run; `run` reads top to bottom: prefill, then draft / verify / accept / roll back."""

    def __init__(
        self,
        target,
        draft,
        config: GenerationConfig,
        max_new_tokens: int,
        streamer: Any | None,
        verify_costs: VerifyCosts | None = None,
    ):
        self.target, self.draft, self.streamer, self.verify_costs = target, draft, streamer, verify_costs
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.layer_ids = list(draft.config.target_layer_ids)
        self.block_size = draft.config.block_size
        self.mask_token_id = draft.config.mask_token_id
        self.max_new_tokens = max_new_tokens
        self.do_sample = bool(config.do_sample)
        self.warpers = _sampling_warpers(config) if self.do_sample else LogitsProcessorList()
        self.eos_ids = token_ids(config.eos_token_id)
        self.pad_token_id = pad_token_id_of(config)
        parameters = inspect.signature(target.forward).parameters
        self.pass_positions = "position_ids" in parameters
        self.pass_logits_to_keep = "logits_to_keep" in parameters
        self.stats = SpeculativeStats(block_size=self.block_size)

    def run(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> SpeculativeOutput:
        batch = input_ids.shape[0]
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.done = torch.zeros(batch, dtype=torch.bool)
        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
        bonus = self._prefill(input_ids, attention_mask)
        self._commit([[token] for token in bonus.tolist()], count_round=False)
        while not bool(self.done.all()):
            bonus = self._round(bonus)
        if self.streamer is not None:
            self.streamer.end()
        return self._output(input_ids)

    # -- steps -------------------------------------------------------------------------------------------------------

    def _prefill(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> torch.LongTensor:
        start = synchronized_clock(input_ids.device)
        self.cache = DynamicCache(config=self.target.config)
        self.cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts
        self.draft_cache = DynamicCache(config=self.draft.config)
        self.draft_cache.activate_past_recording()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self._target_forward(input_ids, attention_mask, positions, logits_to_keep=1)
        self.key_mask = attention_mask.long()  # [b, C]: which target cache slots hold real tokens
        self.draft_key_mask = attention_mask.new_zeros(input_ids.shape[0], 0).long()
        self.next_position = attention_mask.long().sum(-1)  # [b]: position of the bonus token
        self._stage_context(out.hidden_states, attention_mask.long(), positions)
        bonus = self._pick(out.logits[:, -1:].float())[:, 0]
        self.stats.prefill_time_s += synchronized_clock(input_ids.device) - start
        return bonus

    def _round(self, bonus: torch.LongTensor) -> torch.LongTensor:
        """Draft, verify, accept and roll back once; returns the new bonus tokens `[b]`."""
        remaining = max(self.max_new_tokens - len(g) for g, d in zip(self.generated, self.done.tolist()) if not d)
        num_draft = max(min(self.block_size - 1, remaining - 1), 0)
        start = synchronized_clock(bonus.device)
        draft_ids, q, confidence = self._draft(bonus, num_draft)  # [b, k], [b, k, V] or None, [b, k] or None
        if confidence is not None:  # keep only the proposals worth their verify cost, judged on unfinished rows
            num_draft = self.verify_costs.best_num_draft(confidence[~self.done])
            draft_ids, q = draft_ids[:, :num_draft], None if q is None else q[:, :num_draft]
        self.stats.verified_drafts += num_draft
        verify_start = synchronized_clock(bonus.device)  # the draft's queued work ends here, not inside verify
        self.stats.draft_time_s += verify_start - start
        verify_ids = torch.cat([bonus[:, None], draft_ids], dim=1)  # [b, k + 1]
        positions = self.next_position[:, None] + torch.arange(num_draft + 1, device=bonus.device)
        key_mask = torch.cat([self.key_mask, self.key_mask.new_ones(verify_ids.shape)], dim=1)
        out = self._target_forward(verify_ids, key_mask, positions)
        num_accepted, new_bonus = self._accept(draft_ids, q, out.logits.float())
        self._roll_back(out.hidden_states, positions, num_accepted + 1, num_draft + 1)
        self.stats.verify_time_s += synchronized_clock(bonus.device) - verify_start
        accepted = [ids[:n] + [b] for ids, n, b in zip(draft_ids.tolist(), num_accepted.tolist(), new_bonus.tolist())]
        self._commit(accepted, count_round=True)
        return new_bonus

    def _draft(
        self, bonus: torch.LongTensor, num_draft: int
    ) -> tuple[torch.LongTensor, torch.Tensor | None, torch.Tensor | None]:
        """`k` proposals `[b, k]`, their distributions `q` `[b, k, V]` (sampling only) and, with `verify_costs`,
        the draft's probability of its own most likely token at each slot `[b, k]` (which decides how many to verify)."""
        batch = bonus.shape[0]
        if num_draft == 0:
            return bonus.new_zeros(batch, 0), None, None
        block_positions = self.next_position[:, None] + torch.arange(self.block_size, device=bonus.device)
        out = self.draft(
            noise_embeds=self.embed_tokens(noise_block(bonus[:, None], self.block_size, self.mask_token_id)),
            context_hidden_states=self.context,
            position_ids=torch.cat([self.context_positions, block_positions], dim=1),
            attention_mask=torch.cat(
                [self.draft_key_mask, self.context_mask, self.context_mask.new_ones(batch, self.block_size)], dim=1
            ),
            cache=self.draft_cache,
        )
        self.draft_cache.crop(-self.block_size)  # keep context K/V only
        self.draft_key_mask = torch.cat([self.draft_key_mask, self.context_mask], dim=1)
        hidden = out.last_hidden_state[:, 1 : 1 + num_draft]
        costed = self.verify_costs is not None
        if not self.do_sample:  # argmax over the draft vocabulary, mapped to target ids
            logits = self.draft.draft_logits(hidden, self.lm_head)  # [b, k, V_d]
            confidence = logits.float().softmax(-1).amax(-1) if costed else None
            return self.draft.to_target_ids(logits.argmax(-1)), None, confidence
        logits = draft_logits_full_vocabulary(self.draft, self.lm_head, hidden)  # [b, k, V]
        q = warp_logits(logits, bonus[:, None], self.warpers).softmax(-1)
        # confidence from q alone, before sampling: how many to verify must not depend on the sampled tokens
        confidence = q.amax(-1) if costed else None
        return torch.multinomial(q.flatten(0, 1), 1).view(batch, num_draft), q, confidence

    def _accept(
        self, draft_ids: torch.LongTensor, q: torch.Tensor | None, target_logits: torch.Tensor
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Number of accepted drafts `n` per row and the target's token after them (the new bonus)."""
        num_draft = draft_ids.shape[1]
        if not self.do_sample:
            target_ids = target_logits.argmax(-1)  # [b, k + 1]
            matches = (draft_ids == target_ids[:, :num_draft]).long()
            num_accepted = matches.cumprod(-1).sum(-1)
            return num_accepted, target_ids.gather(1, num_accepted[:, None])[:, 0]
        batch, _, vocab = target_logits.shape
        p = self.warpers(draft_ids.new_zeros(batch * (num_draft + 1), 1), target_logits.flatten(0, 1)).softmax(-1)
        p = p.view(batch, num_draft + 1, vocab)
        if num_draft == 0:
            return draft_ids.new_zeros(batch), torch.multinomial(p[:, 0], 1)[:, 0]
        p_draft = p[:, :num_draft].gather(-1, draft_ids[..., None])[..., 0]  # [b, k]
        q_draft = q.gather(-1, draft_ids[..., None])[..., 0]
        accept = torch.rand_like(p_draft) * q_draft < p_draft  # u < p / q, without dividing by zero
        num_accepted = accept.long().cumprod(-1).sum(-1)
        rows = torch.arange(batch)
        residual = p[rows, num_accepted].clone()  # all accepted: sample the bonus from p_k itself
        rejected = num_accepted < num_draft
        q_at = q[rows, num_accepted.clamp(max=num_draft - 1)]
        residual[rejected] = (residual[rejected] - q_at[rejected]).clamp(min=0)
        residual = residual / residual.sum(-1, keepdim=True)
        return num_accepted, torch.multinomial(residual, 1)[:, 0]

    def _roll_back(self, hidden_states: tuple, positions: torch.LongTensor, keep: torch.LongTensor, fed: int) -> None:
        """Crop the target cache to the longest kept row; mask the rejected slots of the others."""
        longest = int(keep.max())
        self.cache.crop(-(fed - longest))
        kept = (torch.arange(longest, device=keep.device)[None, :] < keep[:, None]).long()  # [b, longest]
        self.key_mask = torch.cat([self.key_mask, kept], dim=1)
        self.next_position = self.next_position + keep
        self._stage_context(hidden_states, kept, positions[:, :longest])

    def _stage_context(self, hidden_states: tuple, mask: torch.Tensor, positions: torch.LongTensor) -> None:
        """Remember the newly committed tokens' target features for the next draft forward."""
        self.context = context_features(hidden_states, self.layer_ids, mask.shape[1])
        self.context_mask = mask
        self.context_positions = positions

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _target_forward(self, input_ids, attention_mask, positions, logits_to_keep: int | None = None):
        kwargs = {"position_ids": positions} if self.pass_positions else {}
        if logits_to_keep is not None and self.pass_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        return self.target(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=[i + 1 for i in self.layer_ids],
            **kwargs,
        )

    def _pick(self, logits: torch.Tensor) -> torch.LongTensor:
        """`[b, t, V]` target logits -> `[b, t]` tokens, greedy or sampled from the warped distribution."""
        if not self.do_sample:
            return logits.argmax(-1)
        probs = warp_logits(logits, logits.new_zeros(logits.shape[0], 1).long(), self.warpers).softmax(-1)
        return torch.multinomial(probs.flatten(0, 1), 1).view(logits.shape[:2])

    def _commit(self, tokens_per_row: list[list[int]], count_round: bool) -> None:
        """Append each unfinished row's new tokens, stopping at EOS or the token budget."""
        for row, tokens in enumerate(tokens_per_row):
            if self.done[row]:
                continue
            generated = self.generated[row]
            room = self.max_new_tokens - len(generated)
            tokens = tokens[:room]
            stop = next((i for i, token in enumerate(tokens) if token in self.eos_ids), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
            generated += tokens
            if count_round:
                self.stats.acceptance_lengths.append(len(tokens))
            if stop is not None or len(generated) >= self.max_new_tokens:
                self.done[row] = True
            if self.streamer is not None and tokens:
                self.streamer.put(torch.tensor(tokens))
        if count_round:
            self.stats.num_rounds += 1

    def _output(self, input_ids: torch.LongTensor) -> SpeculativeOutput:
        longest = max(len(g) for g in self.generated)
        new = torch.full((input_ids.shape[0], longest), self.pad_token_id, dtype=input_ids.dtype)
        for row, tokens in enumerate(self.generated):
            new[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        self.stats.new_tokens += sum(len(g) for g in self.generated)
        sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
        return SpeculativeOutput(sequences, [len(g) for g in self.generated], self.stats)


def synchronized_clock(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has finished its queued work (CUDA and MPS run asynchronously; a CPU
    has nothing to wait for), so the time between two readings is the work queued between them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    return time.perf_counter()


__all__ = ["SpeculativeOutput", "SpeculativeStats", "speculative_generate"]
