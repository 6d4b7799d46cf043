"""The decoding paths the benchmark compares, by name, and which of them a setting leaves out.

Design: a method is a plain function `(target, draft, input_ids [1, L], attention_mask [1, L], **generation kwargs)
-> (sequences, SpeculativeStats | None)`; its options are bound with `functools.partial`, so the harness times every
path through one call. The methods:

- `plain` (`target.generate`), `plain_stock` (the same with a `CPUPreparation` suspended: the stock kernels),
  `plain_fast` (an exact preparation switched to fast mode's kernels for the call) and `plain_threads{n}` (the same at
  `n` torch threads, restored afterwards): the baselines;
- `prompt_lookup` (`prompt_lookup_num_tokens`), `native` (transformers' own DFlash path, `speculation_type="dflash"`),
  `assisted` (`generate(assistant_model=draft)`, routed to `DFlashCandidateGenerator`);
- four runs of `speculative_generate` with the same drafter: `ours` (`verify_costs`: "auto" plans each round, a tree,
  a chain or a plain step), `ours_chain` (the same costs, chains only), `ours_tree16` (a fixed best-first tree of 16
  nodes every round, no costs) and `ours_full_block` (every slot's argmax verified, as published); under sampling
  `ours_argmax` proposes the draft's argmax with a one-hot q beside `ours`'s samples of q.

All costed methods share one `VerifyPlanner`: "auto" costs are its one measured `VerifyCosts` object
(`benchmark_verify_costs`), so every costed method plans from the same numbers, and each path's fallback judgement
carries from prompt to prompt.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import logging

from hf_dflash.bench.config import (
    BASELINE,
    COST_CURVE_TOKENS,
    FAST_BASELINE,
    GREEDY_ONLY,
    SAMPLING_ONLY,
    STOCK_BASELINE,
    TREE_METHODS,
)
from hf_dflash.decoding.cpu_kernels import CPUPreparation
from hf_dflash.decoding.policy import VerifyCosts, VerifyPlanner
from hf_dflash.decoding.speculative import SpeculativeStats, speculative_generate, tree_unsupported_reason

logger = logging.get_logger(__name__)

# A method: (target, draft, input_ids [1, L], attention_mask [1, L], **generation kwargs) -> (sequences, stats | None)
Method = Callable[..., tuple[torch.LongTensor, SpeculativeStats | None]]


def _plain(target, draft, input_ids, attention_mask, **kwargs):
    return target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs), None


def _plain_on_other_kernels(
    target, draft, input_ids, attention_mask, name: str, preparation: CPUPreparation, **kwargs
):
    """Plain decoding on the kernels of plain variant `name` (`plain_kernels`), for the call."""
    with plain_kernels(name, preparation):
        return _plain(target, draft, input_ids, attention_mask, **kwargs)


def _plain_with_threads(target, draft, input_ids, attention_mask, num_threads: int, plain: Method = _plain, **kwargs):
    """Plain decoding (`plain`: a plain variant's method) at `num_threads` torch threads; the thread count is restored
    afterwards."""
    default = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return plain(target, draft, input_ids, attention_mask, **kwargs)
    finally:
        torch.set_num_threads(default)


def _prompt_lookup(target, draft, input_ids, attention_mask, num_tokens: int = 10, **kwargs):
    out = target.generate(
        input_ids=input_ids, attention_mask=attention_mask, prompt_lookup_num_tokens=num_tokens, **kwargs
    )
    return out, None


def _native(target, draft, input_ids, attention_mask, **kwargs):
    out = target.generate(
        input_ids=input_ids, attention_mask=attention_mask, assistant_model=draft, speculation_type="dflash", **kwargs
    )
    return out, None


def _assisted(target, draft, input_ids, attention_mask, planner: VerifyPlanner | None = None, **kwargs):
    """`generate(assistant_model=draft)`; with a `planner`, greedy decoding verifies only what pays by its costs (the
    benchmark's curve) and every call skips drafting while it does not pay (the planner's fallback)."""
    if planner is not None:
        benchmark_verify_costs(target, draft, planner)  # the generator then plans from this very curve
        kwargs = {"generation_config": GenerationConfig(**kwargs, dflash_planner=planner)}
    out = target.generate(input_ids=input_ids, attention_mask=attention_mask, assistant_model=draft, **kwargs)
    return out, None


def _ours(target, draft, input_ids, attention_mask, planner: VerifyPlanner, costed: bool, **kwargs):
    """`speculative_generate`, planning from the benchmark's curve when `costed`, else verifying every proposal."""
    costs = benchmark_verify_costs(target, draft, planner) if costed else None
    out = speculative_generate(
        target, draft, input_ids, attention_mask, verify_costs=costs, planner=planner, optimize_cpu=False, **kwargs
    )
    return out.sequences[:, : input_ids.shape[1] + out.num_new_tokens[0]], out.stats


def benchmark_verify_costs(target: PreTrainedModel, draft: PreTrainedModel, planner: VerifyPlanner) -> VerifyCosts:
    """The target's forward time over 1 .. max(32, B) new tokens and one draft forward, at batch 1: measured once per
    `planner` (`VerifyPlanner.costs_for`), then the same object every time, so every costed method plans from one set
    of costs, and trees (16 nodes + the bonus) are covered."""
    return planner.costs_for(target, draft, 1, max_tokens=max(COST_CURVE_TOKENS, draft.config.block_size))


def default_methods(
    prompt_lookup_num_tokens: int = 10,
    verify_costs: VerifyCosts | str | None = "auto",
    planner: VerifyPlanner | None = None,
) -> dict[str, Method]:
    """The decoding paths, by name. `ours` and `assisted` verify as `verify_costs` says ("auto": the benchmark's
    measured costs, `None`: every proposal, or given `VerifyCosts`), `ours_chain` plans chains from those costs
    (measured ones when `None`), `ours_tree16` verifies a 16-node tree every round, `ours_full_block` every slot's
    argmax, and `ours_argmax` (sampling) proposes the draft's argmax. All share one `planner` (a fresh one by
    default): one measured curve, and each path's fallback judgement carried from prompt to prompt."""
    if isinstance(verify_costs, VerifyCosts):
        planner = VerifyPlanner(costs=verify_costs)
    planner = planner if planner is not None else VerifyPlanner()
    costed = verify_costs is not None
    return {
        "plain": _plain,
        "prompt_lookup": functools.partial(_prompt_lookup, num_tokens=prompt_lookup_num_tokens),
        "native": _native,
        "assisted": functools.partial(_assisted, planner=planner if costed else None),
        "ours": functools.partial(_ours, planner=planner, costed=costed),
        "ours_chain": functools.partial(_ours, planner=planner, costed=True, tree=False),
        "ours_tree16": functools.partial(_ours, planner=planner, costed=False, tree=16),
        "ours_full_block": functools.partial(_ours, planner=planner, costed=False, tree=False),
        "ours_argmax": functools.partial(_ours, planner=planner, costed=costed, sample_proposals=False),
    }


def other_kernel_plains(preparation: CPUPreparation | None) -> tuple[str, ...]:
    """The plain variants on other kernels than `plain`'s: `plain_stock` beside an active preparation, and
    `plain_fast` beside an exact one."""
    if preparation is None or not preparation.active:
        return ()
    return (STOCK_BASELINE, FAST_BASELINE) if preparation.exact else (STOCK_BASELINE,)


def plain_kernels(name: str, preparation: CPUPreparation | None) -> contextlib.AbstractContextManager:
    """The kernels plain variant `name` runs on: the stock ones (`preparation` suspended), fast mode's (an exact
    `preparation` switched by `CPUPreparation.fast`), or the prepared ones (`plain`)."""
    if name == STOCK_BASELINE:
        return preparation.suspended()
    if name == FAST_BASELINE:
        return preparation.fast()
    return contextlib.nullcontext()


def other_kernel_plain_methods(preparation: CPUPreparation | None) -> dict[str, Method]:
    """`plain_stock` and `plain_fast` (as `other_kernel_plains` says) as methods."""
    return {
        name: functools.partial(_plain_on_other_kernels, name=name, preparation=preparation)
        for name in other_kernel_plains(preparation)
    }


def plain_threads_name(num_threads: int, kernels: str = BASELINE) -> str:
    """The method name of plain variant `kernels` (`plain`, `plain_stock`, `plain_fast`) at `num_threads` torch
    threads: `plain_threads1`, `plain_fast_threads1`."""
    return f"{kernels}_threads{num_threads}"


def kernels_of(method: str) -> str:
    """The plain variant a method name runs the kernels of (`plain_fast_threads1` -> `plain_fast`); other names as
    they are."""
    stem, _, count = method.rpartition("_threads")
    return stem if stem and count.isdigit() else method


def plain_thread_methods(thread_counts: Sequence[int], preparation: CPUPreparation | None = None) -> dict[str, Method]:
    """Every plain variant (`plain` and, beside a `preparation`, `other_kernel_plains`) at each of `thread_counts`
    torch threads: `plain_threads{n}`, `plain_stock_threads{n}`, `plain_fast_threads{n}`. Plain decoding at its
    fastest may be any of them: on a 2-core EPYC under `OMP_WAIT_POLICY=PASSIVE`, bf16 plain decoding ran 1.4x
    faster at 1 thread than at 2."""
    methods = {}
    for n in thread_counts:
        methods[plain_threads_name(n)] = functools.partial(_plain_with_threads, num_threads=n)
        for kernels, plain in other_kernel_plain_methods(preparation).items():
            methods[plain_threads_name(n, kernels)] = functools.partial(
                _plain_with_threads, num_threads=n, plain=plain
            )
    return methods


def extra_thread_counts(thread_counts: Sequence[int]) -> list[int]:
    """The `plain_threads` counts to time beside `plain`: distinct, and not the default (that is `plain`)."""
    if any(n < 1 for n in thread_counts):
        raise ValueError(f"plain_threads must be thread counts >= 1, got {tuple(thread_counts)}.")
    default = torch.get_num_threads()
    if default in thread_counts:
        logger.info(f"plain_threads: {default} is the default thread count, which `plain` runs at.")
    return [n for n in dict.fromkeys(thread_counts) if n != default]


def not_applicable(
    names: Sequence[str], target: PreTrainedModel, do_sample: bool, planner: VerifyPlanner
) -> dict[str, str]:
    """The methods that would repeat another one or cannot run in this setting, with the reason (tree support is
    asked of `planner`, which answers it once)."""
    skipped = {}
    for name in names:
        if name in GREEDY_ONLY and do_sample:
            skipped[name] = GREEDY_ONLY[name]
        elif name in SAMPLING_ONLY and not do_sample:
            skipped[name] = SAMPLING_ONLY[name]
        elif name in TREE_METHODS and (reason := tree_unsupported_reason(target, do_sample, planner)) is not None:
            skipped[name] = reason
    for name, reason in skipped.items():
        logger.info(f"Method {name!r} left out: {reason}.")
    return skipped
