"""Our own speculative loop: batched, lossless DFlash decoding with acceptance statistics.

One round, for every row at once (B = block size, S <= B - 1 drafted slots):

1. draft:  one drafter forward over `[bonus, MASK x (B-1)]`, conditioned on the target hidden states of the tokens
           committed since the last draft (`draft_block`);
2. plan:   the proposals to verify (`propose`): every slot's argmax (a chain, DFlash as published), or a DFlash2
           drafter's selector chain; with measured `verify_costs`, the best-first nodes of a draft tree (`tree`,
           v1 only) or chain worth their cost, possibly none (`policy`; a tree is weighed against the argmax chain,
           each with what its kind of round was measured to spend); under sampling, a chain of samples of `q`
           (or the draft's argmax, one-hot `q`), for DFlash2 `q` being the selector walk's distribution;
3. verify: one target forward over `[bonus, nodes]` (`verify`): a causal mask for a chain, a tree mask and
           per-node positions (depth from the bonus) for a tree;
4. accept: greedy keeps the longest path whose tokens are the target's argmax (`accept_greedy`); sampling applies
           Leviathan et al.'s Algorithm 1 along the chain (`accept_sampled`: accept `d_i` with probability
           `min(1, p_i(d_i) / q_i(d_i))`, on rejection sample `norm(max(0, p_i - q_i))`); either way the target then
           contributes one token (the new bonus), so a round commits `tau = n + 1` tokens;
5. keep:   the target cache keeps the accepted path (`keep_accepted`: cropped for a chain, gathered for a tree), and
           its hidden states become the draft's next context; rows of a batch that kept fewer tokens than the
           longest mask the rest (holes in the attention mask, positions counted over valid tokens only), so every row
           stays exactly the target's own computation.

With `verify_costs`, `Fallback` also skips steps 1-2 while drafting does not pay (a plain decoding step), trying
again after a pause; it judges on each step's measured seconds, and the skipped steps' hidden states are kept for
the next draft.

Targets with sliding-window attention count their window in cache slots, which holes would shrink; for them a batch
is decoded row by row (still lossless), with chains only.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.utils import logging

from hf_dflash.model.generation_dflash import (
    check_draft_fits_target,
    context_features,
    cut_at_stop,
    draft_forward,
    is_dflash2,
    pad_token_id_of,
    sample_categorical,
    synchronized_clock,
    token_ids,
    walk_logits,
    warp_logits,
)
from hf_dflash.model.selector_dflash import walk_lattice

from .compiled_kernels import compiled_sort
from .cpu_kernels import is_optimized_for_cpu, optimize_target_and_draft_for_cpu
from .policy import RoundOverhead, VerifyCosts, VerifyPlanner
from .tree import (
    DraftTree,
    accept_greedy,
    best_first_tree,
    chain,
    keep_path,
    lattice_tree,
    tree_attention_mask,
)

logger = logging.get_logger(__name__)

DEFAULT_TREE_NODES = 16  # most nodes the planner considers (the forward costs are measured up to 17 tokens)
TREE_TOP_K = 8  # candidates per slot a tree is built from
PROPOSAL_NUCLEUS_CANDIDATES = 256  # tokens a sampled proposal's top-p nucleus is looked for among

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
    verified_drafts: int = 0  # proposals (tree nodes) the target checked, over all drafted rounds
    tree_rounds: int = 0  # drafted rounds that verified a tree (not a chain)
    plain_steps: int = 0  # steps without a draft (fallback, or one token left): one token per row each
    # with verify costs: what the same steps' verify forwards cost when measured bare (`VerifyCosts.verify` at each
    # step's token count), so `verify_time_s / bare_forward_s` is the loop's price beside its forwards
    bare_forward_s: float = 0.0

    def record_plan(self, tree: Any, drafted: bool) -> None:
        """Count a round: a drafted one verifying `tree`, or a plain step."""
        if not drafted:
            self.plain_steps += 1
            return
        self.num_rounds += 1
        self.verified_drafts += tree.num_nodes
        self.tree_rounds += int(not tree.is_chain)

    @property
    def tau(self) -> float:
        """Mean acceptance length of the drafted rounds (tokens committed per target verify forward)."""
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
        counts = ("num_rounds", "prefill_time_s", "draft_time_s", "verify_time_s", "bare_forward_s", "new_tokens")
        counts += ("verified_drafts",)
        for name in (*counts, "tree_rounds", "plain_steps"):
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
            "bare_forward_s": self.bare_forward_s,
            "verified_drafts_per_round": self.verified_drafts_per_round,
            "tree_rounds": self.tree_rounds,
            "plain_steps": self.plain_steps,
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
    planner: VerifyPlanner | None = None,
    tree: bool | int | None = None,
    sample_proposals: bool = True,
    optimize_cpu: bool = True,
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
            block costs about one token, as on a GPU). `"auto"` measures the target's forward time over 1 .. n
            tokens once per `planner` (on 2 CPU cores about 17 s for SmolLM2-135M over up to 17 tokens) and
            plans each round from the draft's own probabilities: a draft tree, a chain or no proposal at all,
            whichever brings the most expected tokens per second, and plain decoding steps while drafting does not
            pay (`hf_dflash.decoding.policy`); or pass measured `VerifyCosts`. The output is the target's own either
            way.
        planner: what this call may reuse and leaves for the next: measured costs, the fallback's judgement of
            each decoding path, tree support (`VerifyPlanner`). Pass the same planner to every call on this target;
            `None`: a fresh planner for this call (`"auto"` then measures again).
        tree: draft trees for greedy decoding, on targets that verify one exactly (`tree`; not
            sliding-window targets). `None`: with `verify_costs`, trees of up to 16 nodes when the target supports
            them, else chains; `False`: chains only; an int `N`: trees of up to `N` nodes with `verify_costs`, and
            without costs a fixed best-first tree of `N` nodes every round.
        sample_proposals: under sampling, propose samples of the draft distribution `q` (`True`) or its argmax with
            a one-hot `q` (`False`, as vLLM does by default); both are lossless, and acceptance differs.
        optimize_cpu: a CPU target and drafter not prepared yet get `hf_dflash.optimize_for_cpu` (fast kernels, so a
            verify forward over a block costs little more than one token), once: they stay prepared after the call, so plain
            `target.generate` then runs the same kernels. `False` leaves both as they are.

    Returns:
        `SpeculativeOutput` with the sequences, the new-token counts and `SpeculativeStats` (tau, histogram, times).
    """
    config = _resolve_generation_config(target, generation_config, generation_kwargs)
    batch_size, prompt_len = input_ids.shape
    check_draft_fits_target(target, draft, batch_size, max_batch_size=None)
    if optimize_cpu:
        _prepare_for_cpu(target, draft)
    if streamer is not None and batch_size > 1:
        raise ValueError("A streamer can follow one sequence only; pass a batch of one, or no streamer.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    max_new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len
    row_by_row = batch_size > 1 and _has_sliding_window(target)
    planner = planner if planner is not None else VerifyPlanner()
    max_tree_nodes = _max_tree_nodes(target, draft, tree, bool(config.do_sample), verify_costs is not None, planner)
    max_tokens = max(draft.config.block_size, max_tree_nodes + 1)
    costs = _resolve_verify_costs(target, draft, verify_costs, planner, 1 if row_by_row else batch_size, max_tokens)
    parameters = inspect.signature(target.forward).parameters
    setup = _Setup(
        target=target,
        draft=draft,
        max_new_tokens=max_new_tokens,
        do_sample=bool(config.do_sample),
        warpers=_sampling_warpers(config) if config.do_sample else LogitsProcessorList(),
        temperature=float(config.temperature or 1.0) if config.do_sample else None,
        eos_ids=token_ids(config.eos_token_id),
        pad_token_id=pad_token_id_of(config),
        pass_positions="position_ids" in parameters,
        pass_logits_to_keep="logits_to_keep" in parameters,
        verify_costs=costs,
        learns_overhead=costs is not None and planner.measured(costs),
        planner=planner,
        max_tree_nodes=max_tree_nodes,
        sample_proposals=sample_proposals,
    )
    if row_by_row:
        return _generate_row_by_row(setup, input_ids, attention_mask)
    return _decode(setup, input_ids, attention_mask, streamer)


def _prepare_for_cpu(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """`optimize_for_cpu` on a CPU target and drafter that are not prepared yet (kernel choices measured once)."""
    if target.device.type != "cpu" or is_optimized_for_cpu(target):
        return
    logger.info(
        "speculative_generate: preparing the CPU target and drafter (optimize_for_cpu; optimize_cpu=False skips it)."
    )
    optimize_target_and_draft_for_cpu(target, draft)


def _max_tree_nodes(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tree: bool | int | None,
    do_sample: bool,
    costed: bool,
    planner: VerifyPlanner,
) -> int:
    """How many nodes a round may verify as a tree; 0: chains (see `speculative_generate`'s `tree`)."""
    if tree is None:
        wanted = DEFAULT_TREE_NODES if costed and not do_sample else 0
    elif tree is True:
        wanted = DEFAULT_TREE_NODES
    else:
        wanted = int(tree)
    if wanted < 0:
        raise ValueError(f"tree must be None, a bool or a number of nodes >= 0, got {tree!r}.")
    if wanted == 0:
        return 0
    reason = tree_unsupported_reason(target, do_sample, planner)
    if reason is None:
        return wanted
    if tree is None:  # the default quietly falls back to chains
        logger.info(f"Verifying chains: {reason}.")
        return 0
    raise ValueError(f"tree={tree!r} cannot be used: {reason}. Pass tree=False (chains).")


def tree_unsupported_reason(target: PreTrainedModel, do_sample: bool, planner: VerifyPlanner) -> str | None:
    """Why `target` cannot verify draft trees under these settings, or `None` when it can (tree support is checked
    once per `planner`). A v1 drafter's trees come from its slots' top candidates, a DFlash2 drafter's from its
    selector's lattice."""
    if do_sample:
        return "draft trees are verified for greedy decoding only (sampling verifies chains)"
    if _has_sliding_window(target):
        return "the target has sliding-window attention, whose window a tree's positions would break"
    if not planner.supports_trees(target):
        return "the target does not verify a tree exactly in one forward (a 4D attention mask and positions)"
    return None


def _resolve_verify_costs(
    target, draft, verify_costs, planner: VerifyPlanner, batch_size: int, max_tokens: int
) -> VerifyCosts | None:
    if verify_costs is None or isinstance(verify_costs, VerifyCosts):
        return verify_costs
    if verify_costs == "auto":
        return planner.costs_for(target, draft, batch_size, max_tokens)
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


def _generate_row_by_row(setup: _Setup, input_ids, attention_mask) -> SpeculativeOutput:
    logger.info("Target uses sliding-window attention: decoding the batch row by row to stay lossless.")
    rows, counts, stats = [], [], SpeculativeStats()
    for row_ids, row_mask in zip(input_ids, attention_mask):
        prompt = row_ids[row_mask.bool()][None]  # strip the left padding
        out = _decode(setup, prompt, torch.ones_like(prompt), None)
        rows.append(out.sequences[0, prompt.shape[1] :])
        counts.append(out.num_new_tokens[0])
        stats.merge(out.stats)
    generated = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=setup.pad_token_id)
    return SpeculativeOutput(torch.cat([input_ids, generated], dim=1), counts, stats)


class NucleusOfTopCandidates(LogitsProcessor):
    """Top-p among the `candidates` most likely tokens only: the smallest set of them, best first, whose probability
    under the whole vocabulary reaches `top_p` (all of them when they hold less). A draft's proposal distribution `q`
    has to be known, not to match `generate`'s warpers (speculative sampling is lossless for any `q`), so it is
    truncated with a top-k instead of a sort of the vocabulary (2.4 ms a row for SmolLM2's 49,152 on 2 cores)."""

    def __init__(self, top_p: float, candidates: int = PROPOSAL_NUCLEUS_CANDIDATES):
        self.top_p, self.candidates = top_p, candidates

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        top_scores, top_index = scores.topk(min(self.candidates, scores.shape[-1]), dim=-1)  # [n, c], best first
        probs = (top_scores - scores.logsumexp(-1, keepdim=True)).exp()
        kept = probs.cumsum(-1) - probs < self.top_p  # the better candidates' mass is still short of top_p
        truncated = torch.full_like(scores, float("-inf"))
        return truncated.scatter(-1, top_index, top_scores.masked_fill(~kept, float("-inf")))


class TopPBySortedValues(TopPLogitsWarper):
    """`TopPLogitsWarper` with the same result bit for bit, from a sort of the scores' values alone: the compiled radix
    sort (`compiled_sort`) takes 0.2 ms for a row of SmolLM2's 49,152 tokens on one Zen 4 core, NumPy's sort (where it
    cannot be built) 1.0, torch's sort with indices 2.5 (a sampled round warps two or three target rows). Sorted
    ascending, the values are the same sequence whatever the ties, so their softmax and cumulative sums are the
    warper's own, and the tokens it removes are those at or below the last value it removes. Where that value ties
    with the first kept one, only the warper's own index order says which tied tokens go: the row batch then runs
    through `TopPLogitsWarper` itself, as do non-CPU and non-fp32 scores and scores holding a NaN (which the sorts
    place differently)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2 or scores.isnan().any():
            return super().__call__(input_ids, scores)
        sorted_scores = _sorted_values(scores.detach())  # [n, V], ascending
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # nondecreasing: the removed entries are a prefix
        threshold = cumulative.new_full((scores.shape[0], 1), 1 - self.top_p)
        num_removed = torch.searchsorted(cumulative, threshold, right=True)  # [n, 1]: entries <= the threshold
        num_removed = num_removed.clamp(max=scores.shape[-1] - self.min_tokens_to_keep)
        removes_some = num_removed > 0  # else no entry has probability 0 either: the row stays as it is
        last_removed = sorted_scores.gather(-1, (num_removed - 1).clamp(min=0)).masked_fill(~removes_some, -math.inf)
        first_kept = sorted_scores.gather(-1, num_removed)
        if bool((last_removed == first_kept).any()):  # a tie at the cut
            return super().__call__(input_ids, scores)
        return torch.where(scores > last_removed, scores, self.filter_value)


def _sorted_values(scores: torch.Tensor) -> torch.Tensor:
    """Each row of `[n, V]` float32 CPU scores sorted ascending: the compiled sort, else NumPy's (same values)."""
    sort = compiled_sort()
    if sort is None:
        return torch.from_numpy(np.sort(scores.numpy(), axis=-1))
    return sort(scores)


def proposal_warpers(warpers: LogitsProcessorList) -> LogitsProcessorList:
    """`warpers` for a draft's proposal distribution: each top-p warper's sort of the vocabulary replaced by
    `NucleusOfTopCandidates`."""
    return LogitsProcessorList(
        NucleusOfTopCandidates(warper.top_p) if isinstance(warper, TopPLogitsWarper) else warper for warper in warpers
    )


def _sampling_warpers(config: GenerationConfig) -> LogitsProcessorList:
    """The same warpers `generate` uses for sampling, in the same order."""
    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPBySortedValues(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return warpers


@dataclass(frozen=True)
class _Setup:
    """What a run needs and never changes: the models, the generation settings and the verify policy."""

    target: PreTrainedModel
    draft: PreTrainedModel
    max_new_tokens: int
    do_sample: bool
    warpers: LogitsProcessorList
    temperature: float | None  # sampling's temperature (DFlash2's walk draws at it); None: greedy
    eos_ids: list[int]
    pad_token_id: int
    pass_positions: bool  # the target's forward takes `position_ids`
    pass_logits_to_keep: bool  # ... and `logits_to_keep`
    verify_costs: VerifyCosts | None
    learns_overhead: bool  # the costs were measured: plans add what this path's rounds spend beside the forwards
    planner: VerifyPlanner  # keeps each path's fallback (and what it measured) for the caller's next call
    max_tree_nodes: int  # 0: chains only
    sample_proposals: bool  # sampling: propose samples of q (True) or the draft's argmax with a one-hot q

    @property
    def block_size(self) -> int:
        return self.draft.config.block_size

    @functools.cached_property
    def proposal_warpers(self) -> LogitsProcessorList:
        """What shapes the draft's proposal distribution `q` (`proposal_warpers`)."""
        return proposal_warpers(self.warpers)

    @functools.cached_property
    def round_overheads(self) -> dict[str, RoundOverhead] | None:
        """What this path's chain rounds and tree rounds each spend beside their modelled forwards (a tree's mask and
        cache gather cost more than a chain's), learned as they run; measured costs only: fixed costs are the
        caller's whole model."""
        if not self.learns_overhead:
            return None
        kinds = ("chain", "tree")
        return {kind: self.planner.round_overhead(self.verify_costs, f"{self.path}, {kind} rounds") for kind in kinds}

    @property
    def path(self) -> str:
        """The decoding path, as the planner keeps its fallbacks apart (`VerifyPlanner.fallback`)."""
        proposals = "samples" if self.sample_proposals else "argmax"
        sampling = f"do_sample, proposing {proposals}" if self.do_sample else "greedy"
        return f"speculative_generate({sampling}, tree of {self.max_tree_nodes} nodes)"

    @property
    def layer_ids(self) -> list[int]:
        return list(self.draft.config.target_layer_ids)


@dataclass
class DecodeState:
    """Everything a batched run carries from one round to the next (`b` rows, `C` target cache slots)."""

    cache: DynamicCache  # the target's
    key_mask: torch.Tensor  # [b, C]: which target cache slots hold committed tokens
    next_position: torch.LongTensor  # [b]: position of each row's bonus token
    draft_cache: DynamicCache  # the drafter's: context K/V of the tokens it has read
    draft_key_mask: torch.Tensor  # [b, C_d]
    # target features [b, n, taps * H], mask [b, n] and positions [b, n] of committed tokens the drafter has not
    # read yet, one entry per step: joined once, when the drafter reads them (`take_context`), so a plain step costs
    # no copy of what is already queued (the prompt's features, and every step of a pause)
    context: list[tuple[torch.Tensor, torch.Tensor, torch.LongTensor]]
    bonus: torch.LongTensor  # [b]: the last committed token, not yet in the target cache
    generated: list[list[int]]
    done: torch.Tensor  # [b] bool, on the CPU

    def add_context(self, features: torch.Tensor, mask: torch.Tensor, positions: torch.LongTensor) -> None:
        """Queue committed tokens' target features for the next draft forward."""
        self.context.append((features, mask, positions))

    def take_context(self) -> tuple[torch.Tensor, torch.Tensor, torch.LongTensor]:
        """The queued features `[b, n, taps * H]`, mask `[b, n]` and positions `[b, n]`; the queue is then empty."""
        if not self.context:  # prefill and every step queue their tokens, so a draft always finds some
            raise RuntimeError("DecodeState.take_context: no target features are queued for the drafter to read.")
        features, mask, positions = (torch.cat(parts, dim=1) for parts in zip(*self.context))
        self.context = []
        return features, mask, positions


@dataclass(frozen=True)
class Proposal:
    """What a round verifies: the nodes (`tree`, possibly empty) and, under sampling, their distributions `q`."""

    tree: DraftTree
    q: torch.Tensor | None = None  # [b, N, V], sampling only (a chain)
    drafted: bool = True  # False: a plain step that skipped the draft


def _decode(setup: _Setup, input_ids: torch.LongTensor, attention_mask: torch.Tensor, streamer) -> SpeculativeOutput:
    """Prefill, then rounds of draft / plan / verify / accept / keep until every row is done."""
    stats = SpeculativeStats(block_size=setup.block_size)
    fallback = setup.planner.fallback(setup.verify_costs, setup.path) if setup.verify_costs is not None else None
    if streamer is not None:
        streamer.put(input_ids.cpu())
    state = prefill(setup, input_ids, attention_mask, stats)
    commit(setup, state, [[token] for token in state.bonus.tolist()], stats, streamer, count_round=False)
    while not bool(state.done.all()):
        start = synchronized_clock(state.bonus.device)
        drafting = fallback is None or fallback.should_draft()
        proposal = propose(setup, state) if drafting else _plain_step(state)
        verify_start = synchronized_clock(state.bonus.device)  # the draft's queued work ends here
        stats.draft_time_s += verify_start - start
        out = verify(setup, state, proposal.tree)
        path, lengths, new_bonus = accept(setup, proposal, out.logits)
        tokens = keep_accepted(setup, state, proposal.tree, out.hidden_states, path, lengths)
        end = synchronized_clock(state.bonus.device)
        stats.verify_time_s += end - verify_start
        if setup.verify_costs is not None:
            modelled_nodes = min(proposal.tree.num_nodes, setup.verify_costs.max_nodes)
            stats.bare_forward_s += setup.verify_costs.verify[modelled_nodes]
            if proposal.drafted and setup.round_overheads is not None:
                excess = end - start - setup.verify_costs.seconds(modelled_nodes)
                setup.round_overheads[_kind(proposal.tree)].record(proposal.tree.num_nodes, excess)
        active = int((~state.done).sum())
        accepted = [row[: n - 1] + [b] for row, n, b in zip(tokens.tolist(), lengths.tolist(), new_bonus.tolist())]
        committed = commit(setup, state, accepted, stats, streamer, count_round=proposal.drafted)
        stats.record_plan(proposal.tree, drafted=proposal.drafted)
        if fallback is not None:
            fallback.record_step(proposal.drafted, committed, active, seconds=end - start)
        state.bonus = new_bonus
    if streamer is not None:
        streamer.end()
    return _output(setup, state, input_ids, stats)


# -- steps -----------------------------------------------------------------------------------------------------------


def prefill(setup: _Setup, input_ids: torch.LongTensor, attention_mask: torch.Tensor, stats) -> DecodeState:
    """The target reads the prompts; its token after them is the first bonus."""
    start = synchronized_clock(input_ids.device)
    cache = DynamicCache(config=setup.target.config)
    cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts
    draft_cache = DynamicCache(config=setup.draft.config)
    draft_cache.activate_past_recording()
    mask = attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = target_forward(setup, cache, input_ids, mask, positions, logits_to_keep=1)
    features = context_features(out.hidden_states, setup.layer_ids, input_ids.shape[1])
    batch = input_ids.shape[0]
    state = DecodeState(
        cache=cache,
        key_mask=mask,
        next_position=mask.sum(-1),
        draft_cache=draft_cache,
        draft_key_mask=mask.new_zeros(batch, 0),
        context=[(features, mask, positions)],
        bonus=_pick(setup, out.logits[:, -1:].float())[:, 0],
        generated=[[] for _ in range(batch)],
        done=torch.zeros(batch, dtype=torch.bool),
    )
    stats.prefill_time_s += synchronized_clock(input_ids.device) - start
    return state


def draft_block(setup: _Setup, state: DecodeState) -> torch.Tensor:
    """One drafter forward over `[bonus, MASK x (B-1)]` after the queued context; returns `[b, B, H]` hidden states
    and leaves only context K/V in the draft cache."""
    context, context_mask, context_positions = state.take_context()
    batch = state.bonus.shape[0]
    block_positions = state.next_position[:, None] + torch.arange(setup.block_size, device=context.device)
    key_mask = torch.cat([state.draft_key_mask, context_mask, context_mask.new_ones(batch, setup.block_size)], 1)
    hidden = draft_forward(
        setup.draft,
        setup.target.get_input_embeddings(),
        state.bonus[:, None],
        context,
        torch.cat([context_positions, block_positions], dim=1),
        key_mask,
        state.draft_cache,
    )
    state.draft_key_mask = torch.cat([state.draft_key_mask, context_mask], dim=1)
    return hidden


def propose(setup: _Setup, state: DecodeState) -> Proposal:
    """Draft once and choose what to verify (see the module docstring, step 2)."""
    remaining = max(setup.max_new_tokens - len(g) for g, d in zip(state.generated, state.done.tolist()) if not d)
    num_slots = max(min(setup.block_size - 1, remaining - 1), 0)
    if num_slots == 0:  # one token left: the target's own next token is all a round can commit
        return _plain_step(state)
    hidden = draft_block(setup, state)[:, 1 : 1 + num_slots]  # [b, S, H]
    if is_dflash2(setup.draft):
        return _selector_chain(setup, state, hidden)
    if setup.do_sample:
        return _sampled_chain(setup, state, hidden)
    logits = setup.draft.draft_logits(hidden, setup.target.get_output_embeddings())  # [b, S, V_d]
    probs = logits.float().softmax(-1)
    if not setup.max_tree_nodes:
        top_probs, top_index = probs.max(-1)
        return Proposal(_planned(setup, state, chain(setup.draft.to_target_ids(top_index), top_probs)))
    top_probs, top_index = probs.topk(min(TREE_TOP_K, probs.shape[-1]), dim=-1)  # [b, S, K]
    tree = best_first_tree(setup.draft.to_target_ids(top_index), top_probs, setup.max_tree_nodes)
    if setup.verify_costs is None:
        return Proposal(tree)
    argmax_chain = chain(setup.draft.to_target_ids(top_index[..., 0]), top_probs[..., 0])
    return Proposal(max(_plans(setup, state, tree), _plans(setup, state, argmax_chain), key=lambda plan: plan[1])[0])


def _sampled_chain(setup: _Setup, state: DecodeState, hidden: torch.Tensor) -> Proposal:
    """A chain of samples of the draft distributions `q` (or their argmax, with `q` one-hot), its length planned from
    `q` alone before anything is sampled. `q` is shaped over the draft vocabulary, where it has its mass (the
    sampling warpers keep the same tokens there as over the whole vocabulary with -inf outside), and spread over the
    whole vocabulary for the chosen nodes only: a reduced vocabulary's round then makes one pass over `V`, not ten."""
    draft, lm_head = setup.draft, setup.target.get_output_embeddings()
    logits = draft.draft_logits(hidden, lm_head)  # [b, S, V_d]
    q = warp_logits(logits, state.bonus[:, None], setup.proposal_warpers).softmax(-1)  # [b, S, V_d]
    confidence = q.amax(-1)  # [b, S]: decides the chain's length before anything is sampled
    if setup.sample_proposals:
        draft_tokens = sample_categorical(q)
    else:
        draft_tokens = q.argmax(-1)
        q = torch.nn.functional.one_hot(draft_tokens, q.shape[-1]).to(q.dtype)
    tree = _planned(setup, state, chain(draft.to_target_ids(draft_tokens), confidence))
    q = draft.to_full_vocabulary(q[:, : tree.num_nodes], lm_head.weight.shape[0], 0.0)  # [b, N, V]
    return Proposal(tree, q)


def _selector_chain(setup: _Setup, state: DecodeState, hidden: torch.Tensor) -> Proposal:
    """DFlash2: the selector's walked chain, greedy or (sampling proposals) drawn at the temperature (greedy with
    trees: `_selector_tree`). A greedy chain's length is planned from its choices' probabilities; a sampled one's from
    the unary confidences, known before anything is drawn (a length chosen after seeing the draws would bias them);
    both times each slot's candidate mass (`SelectorChain`). Under sampling `q` is the walk's distribution over
    each slot's candidates, zero elsewhere (one-hot for a greedy walk)."""
    if setup.max_tree_nodes:
        return _selector_tree(setup, state, hidden)
    sampled = setup.do_sample and setup.sample_proposals
    temperature = setup.temperature if sampled else None
    lm_head = setup.target.get_output_embeddings()
    tokens, candidates, walk = setup.draft.select_chain(hidden, lm_head, state.bonus, temperature)
    confidence = walk.unary_confidence(temperature) if sampled else walk.chosen_probs()  # [b, S]
    tree = _planned(setup, state, chain(tokens, confidence))
    if not setup.do_sample:
        return Proposal(tree)
    vocab = lm_head.weight.shape[0]
    if sampled:
        q = walk_logits(walk, candidates, temperature, vocab).softmax(-1)
    else:
        q = torch.nn.functional.one_hot(tokens, vocab).to(walk.row_scores.dtype)
    return Proposal(tree, q[:, : tree.num_nodes])


def _selector_tree(setup: _Setup, state: DecodeState, hidden: torch.Tensor) -> Proposal:
    """DFlash2, greedy, with trees: the best-first tree of the selector's lattice or its walked chain, whichever plan
    brings more (the tree alone without costs). A candidate's probability is `SelectorLattice.transition_probs`, its
    scores' softmax after its parent's candidate times its slot's `candidate_mass`: counting on the softmax alone, the
    planner verified half as many tokens again as rounds accepted (SmolLM2's drafter: 1.80 expected against 1.26
    accepted a tree round)."""
    draft = setup.draft
    lattice = draft.selector_lattice(hidden, setup.target.get_output_embeddings(), state.bonus)
    candidates = draft.to_target_ids(lattice.candidate_ids)  # [b, S, K]
    tree = lattice_tree(candidates, lattice.transition_probs(), setup.max_tree_nodes)
    if setup.verify_costs is None:
        return Proposal(tree)
    walk = walk_lattice(lattice)
    walked = chain(draft.to_target_ids(walk.draft_ids), walk.chosen_probs())
    return Proposal(max(_plans(setup, state, tree), _plans(setup, state, walked), key=lambda plan: plan[1])[0])


def _planned(setup: _Setup, state: DecodeState, candidates: DraftTree) -> DraftTree:
    """The first nodes of the best-first `candidates` worth their verify cost (all of them without costs)."""
    if setup.verify_costs is None:
        return candidates
    return _plans(setup, state, candidates)[0]


def _plans(setup: _Setup, state: DecodeState, candidates: DraftTree) -> tuple[DraftTree, float]:
    """The first nodes of the best-first `candidates` worth their verify cost and the expected tokens per second
    they bring, with the learned overhead of rounds of their kind. A tree's best-first nodes expect at least the
    tokens of the argmax chain of as many nodes at the same modelled forward, so the two differ in a plan only by
    what their rounds spend beside it."""
    path_probs = candidates.path_probs.cpu()[~state.done]  # one host copy; `done` lives on the host
    overhead = setup.round_overheads[_kind(candidates)] if setup.round_overheads is not None else None
    num_nodes, rate = setup.verify_costs.best_plan(path_probs, overhead)
    return candidates.first(num_nodes), rate


def _kind(tree: DraftTree) -> str:
    """Which learned overhead a round verifying `tree` has: a chain's (a causal mask, a crop) or a tree's."""
    return "chain" if tree.is_chain else "tree"


def _plain_step(state: DecodeState) -> Proposal:
    """Verify the bonus alone: one plain decoding step, no draft."""
    empty = state.bonus.new_zeros(state.bonus.shape[0], 0)
    return Proposal(DraftTree(empty, empty, empty, empty.float()), drafted=False)


def verify(setup: _Setup, state: DecodeState, tree: DraftTree):
    """One target forward over `[bonus, nodes]` `[b, N + 1]`, each node at position bonus + depth."""
    ids = torch.cat([state.bonus[:, None], tree.tokens], dim=1)
    depths = torch.cat([tree.depths.new_zeros(ids.shape[0], 1), tree.depths], dim=1)
    positions = state.next_position[:, None] + depths
    if tree.is_chain:
        mask = torch.cat([state.key_mask, state.key_mask.new_ones(ids.shape)], dim=1)
    else:
        mask = tree_attention_mask(state.key_mask, tree.parents, setup.target.dtype)
    return target_forward(setup, state.cache, ids, mask, positions)


def accept(setup: _Setup, proposal: Proposal, target_logits: torch.Tensor):
    """`(path [b, L], lengths [b], new_bonus [b])`: the accepted path as verify-input indices (0 = the bonus, rows
    padded past their length) and the target's token after it. `target_logits` `[b, N + 1, V]` are the verify
    forward's, in its dtype: sampling converts only the rows it warps to fp32."""
    if not setup.do_sample:  # cast first: torch's bf16 argmax costs 3.5x a cast to fp32 and its argmax
        return accept_greedy(proposal.tree, target_logits.float().argmax(-1))
    num_accepted, new_bonus = accept_sampled_lazily(
        proposal.tree.tokens,
        proposal.q,
        lambda rows, position: _target_probs(setup, target_logits[rows, position].float()),
    )
    lengths = num_accepted + 1
    steps = torch.arange(int(lengths.max()), device=lengths.device)
    return torch.minimum(steps[None], (lengths - 1)[:, None]), lengths, new_bonus


def _target_probs(setup: _Setup, target_logits: torch.Tensor) -> torch.Tensor:
    """`[r, V]` target logits -> their warped distributions `p`, as `generate` samples them."""
    ids = target_logits.new_zeros(target_logits.shape[0], 1).long()  # warpers ignore the ids
    return setup.warpers(ids, target_logits).softmax(-1)


def accept_sampled(
    draft_ids: torch.LongTensor, p: torch.Tensor, q: torch.Tensor | None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative sampling along a chain (Leviathan et al., Algorithm 1): `draft_ids` `[b, k]` drawn from `q`
    `[b, k, V]`, target distributions `p` `[b, k + 1, V]` -> accepted counts `n` `[b]` and the next token `[b]`."""
    return accept_sampled_lazily(draft_ids, q, lambda rows, position: p[rows, position])


def accept_sampled_lazily(
    draft_ids: torch.LongTensor, q: torch.Tensor | None, target_probs_at: Callable[[torch.Tensor, int], torch.Tensor]
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`accept_sampled` asking for the target distribution `[r, V]` of position `j` (`target_probs_at(rows, j)`)
    only for the rows that accepted every proposal before `j`: a round warps about tau rows of logits (each a top-p
    sort of the vocabulary), not `k + 1`. Each position draws its own uniforms; a rejection samples
    `norm(max(0, p_j - q_j))`, a row that accepted all `k` samples `p_k`."""
    batch, num_draft = draft_ids.shape
    num_accepted, next_token = draft_ids.new_zeros(batch), draft_ids.new_zeros(batch)
    rows = torch.arange(batch, device=draft_ids.device)  # the rows that accepted every proposal so far
    for position in range(num_draft + 1):
        p = target_probs_at(rows, position)  # [r, V]
        if position == num_draft:
            next_token[rows] = sample_categorical(p)
            break
        drafted = draft_ids[rows, position, None]  # [r, 1]
        q_rows = q[rows, position]  # [r, V]
        p_drafted, q_drafted = p.gather(-1, drafted)[:, 0], q_rows.gather(-1, drafted)[:, 0]
        accepted = torch.rand_like(p_drafted) * q_drafted < p_drafted  # u < p / q, without dividing by zero
        if not bool(accepted.all()):
            residual = (p[~accepted] - q_rows[~accepted]).clamp(min=0)
            next_token[rows[~accepted]] = sample_categorical(residual)
        rows = rows[accepted]
        num_accepted[rows] += 1
        if rows.numel() == 0:
            break
    return num_accepted, next_token


def keep_accepted(setup, state: DecodeState, tree: DraftTree, hidden_states, path, lengths) -> torch.LongTensor:
    """Keep the accepted path in the target cache and queue its features as draft context; returns its tokens
    `[b, L]` (the bonus first)."""
    num_fed = tree.num_nodes + 1
    longest = path.shape[1]
    if tree.is_chain:  # the path is a prefix: crop (what sliding-window caches support)
        state.cache.crop(-(num_fed - longest))
    else:
        keep_path(state.cache, num_fed, path)
    kept = (torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]).long()  # [b, L]
    features = context_features(hidden_states, setup.layer_ids, num_fed)  # [b, N + 1, taps * H]
    features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    positions = state.next_position[:, None] + torch.arange(longest, device=lengths.device)
    state.add_context(features, kept, positions)
    state.key_mask = torch.cat([state.key_mask, kept], dim=1)
    state.next_position = state.next_position + lengths
    return torch.cat([state.bonus[:, None], tree.tokens], dim=1).gather(1, path)[:, 1:]


def commit(setup: _Setup, state: DecodeState, tokens_per_row, stats, streamer, count_round: bool) -> int:
    """Append each unfinished row's new tokens, stopping at EOS or the token budget; returns how many were added."""
    added = 0
    for row, tokens in enumerate(tokens_per_row):
        if state.done[row]:
            continue
        generated = state.generated[row]
        tokens = cut_at_stop(tokens[: setup.max_new_tokens - len(generated)], setup.eos_ids)
        stopped = bool(tokens) and tokens[-1] in setup.eos_ids
        generated += tokens
        added += len(tokens)
        if count_round:
            stats.acceptance_lengths.append(len(tokens))
        if stopped or len(generated) >= setup.max_new_tokens:
            state.done[row] = True
        if streamer is not None and tokens:
            streamer.put(torch.tensor(tokens))
    return added


# -- helpers ---------------------------------------------------------------------------------------------------------


def target_forward(setup: _Setup, cache, input_ids, attention_mask, positions, logits_to_keep: int | None = None):
    """The target over new tokens, with the hidden states of the tapped layers."""
    kwargs = {"position_ids": positions} if setup.pass_positions else {}
    if logits_to_keep is not None and setup.pass_logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    return setup.target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        cache=cache,
        use_cache=True,
        output_hidden_states=[i + 1 for i in setup.layer_ids],
        **kwargs,
    )


def _pick(setup: _Setup, logits: torch.Tensor) -> torch.LongTensor:
    """`[b, t, V]` target logits -> `[b, t]` tokens, greedy or sampled from the warped distribution."""
    if not setup.do_sample:
        return logits.argmax(-1)
    probs = warp_logits(logits, logits.new_zeros(logits.shape[0], 1).long(), setup.warpers).softmax(-1)
    return sample_categorical(probs)


def _output(setup: _Setup, state: DecodeState, input_ids: torch.LongTensor, stats) -> SpeculativeOutput:
    longest = max(len(g) for g in state.generated)
    new = torch.full((input_ids.shape[0], longest), setup.pad_token_id, dtype=input_ids.dtype)
    for row, tokens in enumerate(state.generated):
        new[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    stats.new_tokens += sum(len(g) for g in state.generated)
    sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
    return SpeculativeOutput(sequences, [len(g) for g in state.generated], stats)


__all__ = [
    "DecodeState",
    "SpeculativeOutput",
    "SpeculativeStats",
    "accept_sampled",
    "accept_sampled_lazily",
    "speculative_generate",
    "tree_unsupported_reason",
]
