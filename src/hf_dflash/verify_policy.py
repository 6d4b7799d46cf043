"""How many drafted tokens to verify each round: the most expected tokens per second, from measured costs.

On a GPU a target forward over 16 tokens costs about what one token costs, so DFlash verifies the whole block.
On a CPU it does not (SmolLM2-135M on 2 cores: 1.25x a plain decoding step for 2 tokens, 1.7x for 4, 2.0x for 8),
so verifying proposals the draft itself doubts costs more than they bring. `VerifyCosts` holds the measured
seconds of one target forward over `n = 1 .. B` tokens and of one draft forward; each round `best_num_draft`
keeps the `k` first proposals that maximise

    expected committed tokens / (draft + verify(k + 1)),   expected = 1 + sum_{i <= k} prod_{j <= i} c_j,

where `c_j` is the draft's probability for its own j-th proposal. Losslessness does not depend on `k`: the
target still checks every token it keeps. Under sampling, `k` is chosen from the draft distributions before any
token is sampled from them (all of a block's distributions come from one draft forward), so each kept proposal
is still an unconditioned sample of `q_j`, which speculative sampling's correctness needs.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from .generation_dflash import context_features, noise_block

logger = logging.get_logger(__name__)

# target -> {(block size, batch size, device, dtype): VerifyCosts}; measured once per target and setting
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class VerifyCosts:
    """Seconds of one target forward over `n` new tokens (`verify[n - 1]`, n = 1 .. B) and of one draft forward."""

    verify: tuple[float, ...]
    draft: float

    def __post_init__(self):
        if not self.verify or any(cost <= 0 for cost in self.verify) or self.draft < 0:
            raise ValueError(f"VerifyCosts needs positive verify costs and a non-negative draft cost, got {self}.")

    def best_num_draft(self, confidences: torch.Tensor) -> int:
        """How many of the `k` proposals to verify, given the draft's probability of each: `[b, k]` -> `0 .. k`.

        Rows of a batch share one verify forward, so their expected tokens add up.
        """
        num_draft = min(confidences.shape[1], len(self.verify) - 1)
        reach = confidences[:, :num_draft].float().cumprod(-1).sum(0)  # [k]: expected rows that accept past slot i
        expected = torch.cat([reach.new_tensor([float(confidences.shape[0])]), reach]).cumsum(0)  # [k + 1]
        seconds = self.draft + torch.tensor(self.verify[: num_draft + 1], dtype=expected.dtype)
        return int((expected / seconds).argmax())

    def relative(self) -> list[float]:
        """Verify costs relative to a forward over one token (for reports)."""
        return [round(cost / self.verify[0], 3) for cost in self.verify]


@torch.no_grad()
def measure_verify_costs(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    batch_size: int = 1,
    context_length: int = 256,
    repeats: int = 5,
) -> VerifyCosts:
    """Time target forwards over 1 .. B new tokens after a `context_length` cache, and one draft forward.

    Sizes are interleaved over `repeats` passes and the median kept, so a busy moment hits all sizes alike.
    `cached_verify_costs` measures once per target and setting and then answers from memory.
    """
    device = target.device
    block_size = draft.config.block_size
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (batch_size, context_length), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()  # sliding-window layers must be able to crop each timed forward back
    target(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    layers = [i + 1 for i in draft.config.target_layer_ids]
    timings: list[list[float]] = [[] for _ in range(block_size)]
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        for size in range(1, block_size + 1):
            new = torch.randint(0, vocab, (batch_size, size), generator=generator).to(device)
            start = time.perf_counter()
            out = target(input_ids=new, cache=cache, use_cache=True, output_hidden_states=layers)
            out.logits.argmax(-1).tolist()  # waits for the device
            timings[size - 1].append(time.perf_counter() - start)
            cache.crop(-size)
    verify = tuple(sorted(t[1:])[len(t[1:]) // 2] for t in timings)
    return VerifyCosts(verify=verify, draft=_time_draft(target, draft, out.hidden_states, batch_size, repeats))


def cached_verify_costs(target: PreTrainedModel, draft: PreTrainedModel, batch_size: int) -> VerifyCosts:
    """`measure_verify_costs` once per target and (block size, batch size, device, dtype); then from memory."""
    key = (draft.config.block_size, batch_size, str(target.device), str(target.dtype))
    per_target = _MEASURED.setdefault(target, {})
    if key not in per_target:
        per_target[key] = measure_verify_costs(target, draft, batch_size)
        logger.info(f"Measured verify costs (relative to one token): {per_target[key].relative()}")
    return per_target[key]


def _time_draft(target, draft, hidden_states, batch_size: int, repeats: int) -> float:
    """Median seconds of one draft forward over a block and its LM head, conditioned on the last forward's tokens."""
    features = context_features(hidden_states, list(draft.config.target_layer_ids), draft.config.block_size)
    block_size = draft.config.block_size
    embed = target.get_input_embeddings()
    bonus = torch.zeros(batch_size, 1, dtype=torch.long, device=target.device)
    noise = embed(noise_block(bonus, block_size, draft.config.mask_token_id))
    positions = torch.arange(features.shape[1] + block_size, device=target.device).expand(batch_size, -1)
    timings = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = draft(noise_embeds=noise, context_hidden_states=features, position_ids=positions)
        draft.draft_logits(out.last_hidden_state[:, 1:], target.get_output_embeddings()).argmax(-1).tolist()
        timings.append(time.perf_counter() - start)
    timings = sorted(timings[1:])
    return timings[len(timings) // 2]
