"""The benchmark's arithmetic: medians, speedups, token counts, output comparison, and the report's summaries.

Design: pure functions over the timed runs (`TimedRun`) and the per-prompt table they make; no model and no clock.

- `median` is `statistics.median` (the mean of the two middle values for an even count), `None` for no values: the
  one median of the benchmark;
- tokens/s per prompt use the median time over repeats; a dataset reports the median over prompts, the speedup as a
  ratio of medians and as the median of per-prompt ratios, each computed on the prompts both methods ran, against
  the plain variant with the higher median tokens/s there;
- `tokens_per_target_forward` counts the target's top-level forward calls (prefill included), so it is the same
  measurement for every path (1.0 for plain decoding).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hf_dflash.bench.config import BASELINE
from hf_dflash.bench.report import DatasetSummary, MethodSummary, Mismatch, PromptRun, SpeculativeStatsSummary
from hf_dflash.decoding.speculative import SpeculativeStats
from hf_dflash.model.generation_dflash import cut_at_stop


def median(values: Sequence[float]) -> float | None:
    """Median (`statistics.median`: the mean of the two middle values for an even count), or `None` for no values."""
    return statistics.median(values) if len(values) else None


def ratio_of_medians(values: Sequence[float], baseline: Sequence[float]) -> float | None:
    """`median(values) / median(baseline)`; `None` when either is empty."""
    if not len(values) or not len(baseline):
        return None
    return median(values) / median(baseline)


def median_of_ratios(values: Sequence[float], baseline: Sequence[float]) -> float | None:
    """Median of the paired ratios `values[i] / baseline[i]` (same prompts, same order)."""
    if len(values) != len(baseline):
        raise ValueError(f"Paired ratios need equal lengths, got {len(values)} and {len(baseline)}.")
    return median([v / b for v, b in zip(values, baseline)])


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or `None` when identical."""
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def count_new_tokens(generated: torch.LongTensor, eos_token_ids: Sequence[int]) -> list[int]:
    """`[b, n]` generated ids -> per row, the tokens up to and including the first EOS (all of them if none)."""
    return [len(cut_at_stop(row, eos_token_ids)) for row in generated.tolist()]


@dataclass
class TimedRun:
    """One generation of one prompt by one method: its time, new tokens, target forwards and statistics."""

    prompt_id: str
    method: str
    repeat: int
    seconds: float
    new_tokens: int
    target_forwards: int
    tokens: list[int]
    stats: SpeculativeStats | None = field(default=None, repr=False)


def find_mismatches(runs: Sequence[TimedRun]) -> list[Mismatch]:
    """Every run whose new tokens differ from the baseline's first run on the same prompt."""
    reference = {r.prompt_id: r.tokens for r in runs if r.method == BASELINE and r.repeat == 0}
    mismatches = []
    for run in runs:
        expected = reference[run.prompt_id]
        index = first_difference(expected, run.tokens)
        if index is not None:
            mismatches.append(
                Mismatch(
                    prompt_id=run.prompt_id,
                    method=run.method,
                    repeat=run.repeat,
                    first_difference=index,
                    expected_tokens=len(expected),
                    got_tokens=len(run.tokens),
                    expected=expected[index : index + 5],
                    got=run.tokens[index : index + 5],
                )
            )
    return mismatches


def per_prompt_table(runs: Sequence[TimedRun]) -> dict[str, dict[str, PromptRun]]:
    """prompt id -> method -> new tokens, times over repeats, tokens/s at the median time, tokens per target forward."""
    seconds: dict[str, dict[str, list[float]]] = {}
    first: dict[tuple[str, str], TimedRun] = {}
    for run in runs:
        seconds.setdefault(run.prompt_id, {}).setdefault(run.method, []).append(run.seconds)
        first.setdefault((run.prompt_id, run.method), run)
    return {
        prompt_id: {method: _prompt_run(first[prompt_id, method], times) for method, times in methods.items()}
        for prompt_id, methods in seconds.items()
    }


def _prompt_run(run: TimedRun, seconds: list[float]) -> PromptRun:
    """A method's entry for one prompt: `run`'s tokens and forwards (greedy repeats are identical), every repeat's
    seconds and the rate at their median."""
    return PromptRun(
        new_tokens=run.new_tokens,
        target_forwards=run.target_forwards,
        seconds=seconds,
        tokens_per_s=run.new_tokens / median(seconds),
        tokens_per_target_forward=run.new_tokens / max(run.target_forwards, 1),
    )


def summarize(
    per_prompt: dict[str, dict[str, PromptRun]],
    prompt_ids: Sequence[str],
    methods: Sequence[str],
    baselines: Sequence[str] = (BASELINE,),
) -> DatasetSummary:
    """Per method over `prompt_ids`: median tokens/s and the two speedups vs the faster of the `baselines` (the plain
    variants; higher median tokens/s over these prompts), each on the prompts both ran."""

    def rates(method: str, ids: Sequence[str]) -> list[float]:
        return [per_prompt[i][method].tokens_per_s for i in ids]

    def ran(method: str) -> list[str]:
        return [i for i in prompt_ids if method in per_prompt.get(i, {})]

    plain_rates = {name: median(rates(name, ran(name))) for name in baselines}
    base = max(baselines, key=lambda name: plain_rates[name] or 0.0)
    rows = {}
    for method in methods:
        ids = [i for i in ran(method) if base in per_prompt[i]]
        tokens = sum(per_prompt[i][method].new_tokens for i in ids)
        forwards = sum(per_prompt[i][method].target_forwards for i in ids)
        rows[method] = MethodSummary(
            prompts=len(ids),
            tokens_per_s=median(rates(method, ids)),
            speedup_ratio_of_medians=ratio_of_medians(rates(method, ids), rates(base, ids)),
            speedup_median_of_ratios=median_of_ratios(rates(method, ids), rates(base, ids)),
            tokens_per_target_forward=tokens / forwards if forwards else None,
        )
    return DatasetSummary(baseline=base, plain_tokens_per_s=plain_rates, methods=rows)


def speculative_summary(
    runs: Sequence[TimedRun], prompt_ids: Sequence[str], method: str = "ours"
) -> SpeculativeStatsSummary | None:
    """`method`'s tau, histogram, drafted rounds, tree rounds and plain steps (first repeat: greedy repeats are
    identical), verified nodes per drafted round and draft/verify time per step (a drafted round or a plain step; all
    repeats); `None` if it has no `SpeculativeStats`."""
    ids = set(prompt_ids)
    ours = [r for r in runs if r.method == method and r.stats is not None and r.prompt_id in ids]
    if not ours:
        return None
    first = SpeculativeStats()
    for run in ours:
        if run.repeat == 0:
            first.merge(copy.deepcopy(run.stats))
    rounds = sum(r.stats.num_rounds for r in ours)
    steps = rounds + sum(r.stats.plain_steps for r in ours)
    return SpeculativeStatsSummary(
        tau=first.tau,
        tau_histogram=first.histogram,
        rounds=first.num_rounds,
        tree_rounds=first.tree_rounds,
        plain_steps=first.plain_steps,
        draft_ms_per_step=1000 * sum(r.stats.draft_time_s for r in ours) / max(steps, 1),
        verify_ms_per_step=1000 * sum(r.stats.verify_time_s for r in ours) / max(steps, 1),
        verified_drafts_per_round=sum(r.stats.verified_drafts for r in ours) / max(rounds, 1),
        verify_over_bare_forward=verify_over_bare_forward(ours),
    )


def verify_over_bare_forward(runs) -> float | None:
    """The runs' verify seconds over the bare forwards of the same steps (`SpeculativeStats.bare_forward_s`), or
    None when they planned without measured costs."""
    bare = sum(r.stats.bare_forward_s for r in runs)
    return round(sum(r.stats.verify_time_s for r in runs) / bare, 3) if bare > 0 else None
