"""What to verify each round, from measured costs: a draft tree, a chain, or nothing.

On a GPU a target forward over 16 tokens costs about what one token costs, so DFlash verifies the whole block.
On a CPU it does not (SmolLM2-135M on 2 cores: 1.1-1.6x a plain decoding step for 2 tokens, 1.5-2x for 8), so
verifying proposals the draft itself doubts costs more than they bring. `VerifyCosts` holds the measured seconds of
one target forward over `n = 1 .. n_max` tokens and of one draft forward. Each round the planner
(`VerifyCosts.best_num_nodes`) takes the best-first candidates of the draft (`tree`: a tree, or a chain) and
keeps the first `N` that maximise

    expected committed tokens / (draft + verify(N + 1)),   expected = rows + sum over kept nodes of P(node accepted),

where `P(node accepted)` is the node's path probability under the draft (for a chain: `prod_{j <= i} c_j`, `c_j` the
draft's probability for its own j-th proposal); `N = 0` is a plain step. Rows of a batch share one forward, so their
expected tokens add up. With measured costs, `speculative_generate` also adds to each candidate's seconds what its
rounds spend beside those forwards (`RoundOverhead`: tree masks, acceptance, cache bookkeeping), learned from its
own timed rounds. `Fallback` goes further when drafting stops paying: it skips the draft altogether for a number of
plain steps (doubling while probes keep failing), judged on the tokens rounds really committed in the seconds they
really took, against the plain steps' own measured seconds.

`VerifyPlanner` is what a caller holds across calls: the costs it measured (per batch size, device, dtype and
kernels), each decoding path's `Fallback` (so a drafter that does not pay on some prompts costs their probes once,
not per prompt) and whether the target verifies trees. Nothing is kept in module globals or on the models: a caller
that wants memory across calls passes the same planner to each (`speculative_generate(..., planner=planner)`,
`target.generate(..., generation_config=GenerationConfig(..., dflash_planner=planner))`).

Losslessness does not depend on the plan: the target still checks every token it keeps. Under sampling, `N` is chosen
from the draft distributions before any token is sampled from them (all of a block's distributions come from one
draft forward), so each kept proposal is still an unconditioned sample of `q_j`, which speculative sampling's
correctness needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from hf_dflash.model.generation_dflash import context_features, draft_forward, greedy_head_step, synchronized_clock

from .cpu_kernels import is_optimized_for_cpu
from .tree import supports_tree_verification

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class VerifyCosts:
    """Seconds of one target forward over `n` new tokens (`verify[n - 1]`, n = 1 .. B) and of one draft forward."""

    verify: tuple[float, ...]
    draft: float

    def __post_init__(self):
        if not self.verify or any(cost <= 0 for cost in self.verify) or self.draft < 0:
            raise ValueError(f"VerifyCosts needs positive verify costs and a non-negative draft cost, got {self}.")

    @property
    def max_nodes(self) -> int:
        """The most nodes a plan can verify: forwards were timed over up to `max_nodes + 1` tokens."""
        return len(self.verify) - 1

    def best_num_nodes(self, path_probs: torch.Tensor, overhead: RoundOverhead | None = None) -> int:
        """How many of the best-first nodes to verify, given each node's path probability `[b, N]` -> `0 .. N`.

        Rows of a batch share one verify forward, so their expected tokens add up. `overhead`: what a round of this
        kind spends beside its forwards, added to each candidate's seconds.
        """
        return self.best_plan(path_probs, overhead)[0]

    def best_plan(self, path_probs: torch.Tensor, overhead: RoundOverhead | None = None) -> tuple[int, float]:
        """`best_num_nodes` and the expected committed tokens per second it brings (to weigh plans of two kinds)."""
        num_nodes = min(path_probs.shape[1], self.max_nodes)
        # [N]: expected rows that accept each node; on the host, like the costs (the plan is a host-side number)
        reach = path_probs[:, :num_nodes].float().sum(0).cpu()
        expected = torch.cat([reach.new_tensor([float(path_probs.shape[0])]), reach]).cumsum(0)  # [N + 1]
        seconds = self.draft + torch.tensor(self.verify[: num_nodes + 1], dtype=expected.dtype)
        if overhead is not None:
            seconds = seconds + overhead.seconds(num_nodes)
        rates = expected / seconds
        best = int(rates.argmax())
        return best, float(rates[best])

    def best_num_draft(self, confidences: torch.Tensor) -> int:
        """How many of a chain's `k` proposals to verify, given the draft's probability of each: `[b, k]` -> `0..k`."""
        return self.best_num_nodes(confidences.float().cumprod(-1))

    def seconds(self, num_nodes: int) -> float:
        """Modelled seconds of a drafted round verifying `num_nodes` nodes (plus the bonus)."""
        return self.draft + self.verify[num_nodes]

    def relative(self) -> list[float]:
        """Verify costs relative to a forward over one token (for reports)."""
        return [round(cost / self.verify[0], 3) for cost in self.verify]


@dataclass
class RoundOverhead:
    """Seconds a drafted round spends beyond its modelled forwards (`VerifyCosts.seconds`: the draft and the verify
    forward): the plan, the tree mask and positions, the acceptance, the cache bookkeeping and the Python between
    them, learned from the loop's own timed rounds, so the plan weighs what a round of this kind really costs.

    Kinds of rounds differ in what they spend per node (a tree's mask, a sampled chain's warped target rows), so the
    excess is fitted as `fixed + per_node * n` over the last `window` rounds by medians, which a few outliers do not
    move (a prompt's first draft, which reads the whole prompt, is not a round's usual cost). While the window's node
    counts hardly vary (a plan that settled on one length) the slope cannot be told from the rest: the last one
    fitted stays and only the fixed part follows. Until `min_rounds` are in, and wherever the fit is negative (rounds
    faster than their model, as on a context shorter than the costs'), the overhead is zero.
    """

    window: int = 64
    min_rounds: int = 8
    _rounds: list[tuple[int, float]] = field(default_factory=list, init=False)  # (nodes verified, excess seconds)
    _fit: tuple[float, float] = field(default=(0.0, 0.0), init=False)  # (fixed, per_node) seconds

    def record(self, num_nodes: int, excess_seconds: float) -> None:
        """A drafted round verified `num_nodes` nodes in `excess_seconds` more than its modelled forwards."""
        self._rounds = [*self._rounds, (num_nodes, excess_seconds)][-self.window :]
        if len(self._rounds) >= self.min_rounds:
            self._fit = _fit_line(self._rounds, slope_if_flat=self._fit[1])

    @property
    def fixed_and_per_node(self) -> tuple[float, float]:
        """The fitted `(fixed, per_node)` seconds (zeros until `min_rounds` rounds are in)."""
        return self._fit

    def seconds(self, max_nodes: int) -> torch.Tensor:
        """The overhead of a round verifying `n = 0 .. max_nodes` nodes `[max_nodes + 1]`, never negative."""
        fixed, per_node = self._fit
        return (fixed + per_node * torch.arange(max_nodes + 1, dtype=torch.float32)).clamp(min=0.0)


def _fit_line(points: list[tuple[int, float]], slope_if_flat: float) -> tuple[float, float]:
    """Theil-Sen `(intercept, slope)` of `y` over `(x, y)` points: the median slope over pairs with different `x`,
    then the median intercept, so a few outliers move neither. Where `x` varies by less than one (its standard
    deviation) the slope is `slope_if_flat`."""
    x = torch.tensor([float(n) for n, _ in points], dtype=torch.float64)
    y = torch.tensor([excess for _, excess in points], dtype=torch.float64)
    slope = slope_if_flat
    if float(x.std(correction=0)) >= 1.0:
        dx, dy = x[None] - x[:, None], y[None] - y[:, None]  # [n, n]
        pairs = dx > 0
        slope = float((dy[pairs] / dx[pairs]).median())
    return float((y - slope * x).median()), slope


@dataclass
class Fallback:
    """Plain decoding steps while drafting does not pay, with probes that try again.

    Judged on time measured as the loop runs, not on the modelled costs: a round also spends time the model leaves
    out (the tree, the acceptance, the cache bookkeeping), and the costs were timed once, on a random context. After
    each drafted round `record` adds the tokens it committed and the seconds it took; once `min_rounds` of the last
    `window` rounds are in and they committed fewer tokens per second than plain steps do (`plain_seconds`: the mean
    of the last `window` plain steps, `record_plain`), the next `backoff` steps skip the draft. The backoff doubles
    (up to `max_backoff`) each time the rounds after a pause fail again, and is reset by a full window that pays.

    The first judgement that finds no plain step timed yet takes `reference_plain_steps` plain steps first and
    judges after them, so rounds are never compared with a cost of other units or conditions (`0`: the modelled
    `verify(1)` stands in). A plain step costs what plain decoding costs, and its hidden states still feed the next
    draft, so the reference is cheap.
    """

    costs: VerifyCosts
    window: int = 16
    min_rounds: int = 4
    first_backoff: int = 8
    max_backoff: int = 256
    reference_plain_steps: int = 2
    plain_steps_left: int = field(default=0, init=False)
    backoff: int = field(default=0, init=False)  # the next pause; starts at `first_backoff`
    _rounds: list[tuple[int, float]] = field(default_factory=list, init=False)  # (tokens committed, seconds)
    _plain: list[float] = field(default_factory=list, init=False)  # seconds of the last plain steps

    def __post_init__(self):
        self.backoff = self.first_backoff

    def should_draft(self) -> bool:
        """Whether this step drafts (`False`: a plain step, which uses up one step of the pause)."""
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        return True

    @property
    def plain_seconds(self) -> float:
        """Seconds of one plain step: the mean of the last `window` timed plain steps, else the modelled
        `verify(1)`."""
        return sum(self._plain) / len(self._plain) if self._plain else self.costs.verify[0]

    def record_step(self, drafted: bool, committed: int, num_rows: int, seconds: float) -> None:
        """A step ended: a drafted round (`record`) or a plain step (`record_plain`) that took `seconds`."""
        if drafted:
            self.record(committed, num_rows, seconds)
        else:
            self.record_plain(seconds)

    def record_plain(self, seconds: float) -> None:
        """A plain step (no draft, one token per unfinished row) took `seconds`."""
        self._plain = [*self._plain, seconds][-self.window :]

    def record(self, committed: int, num_rows: int, seconds: float) -> None:
        """A drafted round committed `committed` tokens over `num_rows` unfinished rows in `seconds`."""
        self._rounds = [*self._rounds, (committed, seconds)][-self.window :]
        if len(self._rounds) < self.min_rounds:
            return
        if not self._plain and self.reference_plain_steps > 0:
            self.plain_steps_left = self.reference_plain_steps  # time plain decoding, then judge
            return
        rate = sum(tokens for tokens, _ in self._rounds) / sum(seconds for _, seconds in self._rounds)
        if rate < num_rows / self.plain_seconds:
            self.plain_steps_left, self._rounds = self.backoff, []
            self.backoff = min(2 * self.backoff, self.max_backoff)
        elif len(self._rounds) == self.window:
            self.backoff = self.first_backoff


@torch.no_grad()
def measure_verify_costs(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    batch_size: int = 1,
    context_length: int = 256,
    repeats: int = 5,
    max_tokens: int | None = None,
) -> VerifyCosts:
    """Time target forwards over 1 .. `max_tokens` (default: the block size) new tokens after a `context_length`
    cache, and one draft forward.

    Sizes are interleaved over `repeats` passes and the median kept, so a busy moment hits all sizes alike.
    `VerifyPlanner.costs_for` measures once per setting and then answers from memory.
    """
    device = target.device
    max_tokens = max_tokens or draft.config.block_size
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (batch_size, context_length), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()  # sliding-window layers must be able to crop each timed forward back
    target(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    layers = [i + 1 for i in draft.config.target_layer_ids]
    timings: list[list[float]] = [[] for _ in range(max_tokens)]
    for _ in range(repeats + 1):  # the first pass warms up and is dropped
        for size in range(1, max_tokens + 1):
            new = torch.randint(0, vocab, (batch_size, size), generator=generator).to(device)
            start = synchronized_clock(device)
            out = target(input_ids=new, cache=cache, use_cache=True, output_hidden_states=layers)
            timings[size - 1].append(synchronized_clock(device) - start)
            cache.crop(-size)
    verify = tuple(median(t[1:]) for t in timings)
    return VerifyCosts(verify=verify, draft=_time_draft(target, draft, out.hidden_states, batch_size, repeats))


@dataclass
class VerifyPlanner:
    """What decoding learns about a target and keeps from one call to the next; the caller holds it.

    - costs: `costs` if given (fixed), else measured by `measure_verify_costs` once per setting (`costs_for`);
    - each decoding path's `Fallback` (`fallback`): a pause under way, its backoff, the timed rounds and plain steps;
    - each decoding path's `RoundOverhead` (`round_overhead`): what its rounds spend beside the measured forwards;
    - whether the target verifies draft trees exactly, per attention implementation (`supports_trees`).

    Pass one planner to every call that should share this (`speculative_generate(..., planner=planner)`; for
    `target.generate(..., assistant_model=draft)` as `GenerationConfig(..., dflash_planner=planner)`). A planner is
    a handle, never copied: `copy.deepcopy` (which `generate` applies to its generation config) returns it as is.
    Measured costs and tree support are kept per target object (`id(target)`), so one planner may serve several.
    """

    costs: VerifyCosts | None = None
    _measured: dict[tuple, VerifyCosts] = field(default_factory=dict, init=False, repr=False)
    _fallbacks: dict[tuple[str, VerifyCosts], Fallback] = field(default_factory=dict, init=False, repr=False)
    _overheads: dict[tuple[str, VerifyCosts], RoundOverhead] = field(default_factory=dict, init=False, repr=False)
    _tree_support: dict[tuple[int, str | None], bool] = field(default_factory=dict, init=False, repr=False)

    def __deepcopy__(self, memo: dict) -> VerifyPlanner:
        return self

    def costs_for(
        self, target: PreTrainedModel, draft: PreTrainedModel, batch_size: int, max_tokens: int | None = None
    ) -> VerifyCosts:
        """The fixed `costs`, else `measure_verify_costs` over at least `max_tokens` (default: the block size) new
        tokens, measured once per (block size, batch size, device, dtype, kernels: whether `optimize_for_cpu`
        prepared the target, its attention implementation and torch's thread count): a later request for fewer tokens
        gets the same object, one for more measures again and keeps the longer curve."""
        if self.costs is not None:
            return self.costs
        max_tokens = max_tokens or draft.config.block_size
        kernels = (is_optimized_for_cpu(target), target.config._attn_implementation, torch.get_num_threads())
        key = (id(target), draft.config.block_size, batch_size, str(target.device), str(target.dtype), kernels)
        known = self._measured.get(key)
        if known is None or len(known.verify) < max_tokens:
            known = self._measured[key] = measure_verify_costs(target, draft, batch_size, max_tokens=max_tokens)
            logger.info(f"Measured verify costs (relative to one token): {known.relative()}")
        return known

    def fallback(self, costs: VerifyCosts, path: str) -> Fallback:
        """The `Fallback` of one decoding `path` (named by its caller: `speculative_generate` by its plan and
        sampling, `generate(assistant_model=draft)` by its sampling) planning with `costs`. Paths keep apart because
        their rounds take different times."""
        key = (path, costs)
        if key not in self._fallbacks:
            self._fallbacks[key] = Fallback(costs)
        return self._fallbacks[key]

    def measured(self, costs: VerifyCosts) -> bool:
        """Whether `costs` are ones this planner measured (`costs_for`), not fixed by a caller."""
        return any(known is costs for known in self._measured.values())

    def round_overhead(self, costs: VerifyCosts, path: str) -> RoundOverhead:
        """The `RoundOverhead` of one decoding `path` planning with measured `costs`, learned across calls."""
        key = (path, costs)
        if key not in self._overheads:
            self._overheads[key] = RoundOverhead()
        return self._overheads[key]

    def supports_trees(self, target: PreTrainedModel) -> bool:
        """`supports_tree_verification(target)`, checked once per target and attention implementation."""
        key = (id(target), getattr(target.config, "_attn_implementation", None))
        if key not in self._tree_support:
            self._tree_support[key] = supports_tree_verification(target)
        return self._tree_support[key]


def _time_draft(target, draft, hidden_states, batch_size: int, repeats: int) -> float:
    """Median seconds of one draft forward over a block and its LM head, conditioned on the last forward's tokens."""
    block_size = draft.config.block_size
    features = context_features(hidden_states, list(draft.config.target_layer_ids), block_size)
    anchors = torch.zeros(batch_size, 1, dtype=torch.long, device=target.device)
    positions = torch.arange(features.shape[1] + block_size, device=target.device).expand(batch_size, -1)
    timings = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = synchronized_clock(target.device)
        hidden = draft_forward(draft, target.get_input_embeddings(), anchors, features, positions)
        greedy_head_step(draft, target.get_output_embeddings(), hidden[:, 1:], anchors[:, 0])
        timings.append(synchronized_clock(target.device) - start)
    return median(timings[1:])
