"""Timed, alternating runs of every decoding path on real prompts, checked token for token against plain decoding.

Design:

- one process, one target, one drafter; a warm-up run of every method first, then for each prompt every method runs
  once per repeat, in an order rotated per prompt and per repeat, so clock drift and background load hit all alike;
- the methods (`default_methods`): `plain` (`target.generate`), `prompt_lookup` (`prompt_lookup_num_tokens`),
  `native` (transformers' own DFlash path, `speculation_type="dflash"`), `assisted` (`generate(assistant_model=draft)`,
  routed to `DFlashCandidateGenerator`) and four runs of `speculative_generate` with the same drafter: `ours`
  (`config.verify_costs`: "auto" plans each round, a tree, a chain or a plain step), `ours_chain` (the same costs,
  chains only), `ours_tree16` (a fixed best-first tree of 16 nodes every round, no costs) and `ours_full_block`
  (every slot's argmax verified, as published); under sampling `ours_argmax` proposes the draft's argmax with a
  one-hot q beside `ours`'s samples of q. A method that cannot differ from another or cannot run in a setting
  (trees under sampling or on a target that cannot verify one) is left out and listed in `report["skipped_methods"]`;
- with a `CPUPreparation` (`optimize_for_cpu` on the target and drafter), `plain` runs the prepared kernels and
  `plain_stock` the stock ones (the preparation suspended for the call); both are baselines, the faster counts, and
  the target's cost curve is recorded for both; `plain_stock`'s outputs are compared with `plain` too, but a
  difference there (fp32 products summed in another order) is listed in `stock_differences`, not as a failure;
- the baseline is plain decoding at its fastest thread count: `config.plain_threads` adds `plain_threads{n}`
  (`target.generate` at `torch.set_num_threads(n)`, restored afterwards), and every speedup of a dataset is computed
  against whichever plain variant has the higher median tokens/s there (`summary["baseline"]`, all their rates in
  `summary["plain_tokens_per_s"]`); every plain variant runs on every prompt;
- the target's forward time over 1 .. 32 new tokens (and one draft forward) is measured once before the warm-up,
  outside every timing, and recorded in the conditions (seconds and relative to one token); that same `VerifyCosts`
  object is what every costed method plans from (16 tree nodes + the bonus fit in it);
- greedy runs must be token-identical to `plain` on every prompt and repeat, and batched `speculative_generate` to
  batched `target.generate`; mismatches are collected, never hidden, and `report["identical"]` covers every path;
- tokens/s per prompt use the median time over repeats; a dataset reports the median over prompts, the speedup as a
  ratio of medians and as the median of per-prompt ratios, each computed on the prompts both methods ran;
- `tokens_per_target_forward` counts the target's top-level forward calls with a hook (prefill included), so it is
  the same measurement for every path (1.0 for plain decoding); every `speculative_generate` method also reports
  `tau` and its histogram, verified nodes per round, tree rounds and plain steps (`SpeculativeStats`);
- two optional sub-benchmarks: the draft's forward + LM head time per block size (paper, Figure 3), and batched
  throughput of `speculative_generate` (its planner's costs measured at each batch size) vs `target.generate` on
  left-padded batches; one that raises is recorded as `{"error": ...}` so the main results survive;
- `report["failures"]` lists every failed method, mismatch and failed sub-benchmark: the run passes when it is empty.

Functions return plain data (a JSON-ready dict); `render_table` and `save_plot` turn it into text and a PNG. Nothing
here prints: progress goes through transformers' tqdm, messages through its logger.
"""

from __future__ import annotations

import copy
import functools
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from hf_dflash.decoding.cpu_kernels import CPUPreparation
from hf_dflash.decoding.policy import VerifyCosts, VerifyPlanner
from hf_dflash.decoding.speculative import SpeculativeStats, speculative_generate, tree_unsupported_reason
from hf_dflash.model.generation_dflash import noise_block, pad_token_id_of, synchronized_clock, token_ids
from hf_dflash.model.modeling_dflash import DFlashForDrafting

logger = logging.get_logger(__name__)

BASELINE = "plain"
STOCK_BASELINE = "plain_stock"  # plain decoding with the stock kernels, when the target was prepared for the CPU
ALL_METHODS = (
    "plain",
    "prompt_lookup",
    "native",
    "assisted",
    "ours",
    "ours_chain",
    "ours_tree16",
    "ours_full_block",
    "ours_argmax",
)
CORE_METHODS = ("plain", "assisted", "ours")  # what prompts beyond `full_comparison_limit` run (with every plain)
# Left out where they would repeat another method or cannot run (`_not_applicable`):
GREEDY_ONLY = {
    "ours_chain": "under sampling `ours` verifies chains already",
    "ours_tree16": "draft trees are verified for greedy decoding only",
}
SAMPLING_ONLY = {"ours_argmax": "greedy decoding proposes the draft's argmax already (it is `ours`)"}
TREE_METHODS = ("ours_tree16",)
COST_CURVE_TOKENS = 32  # the target's forward is timed over 1 .. 32 new tokens (>= 16 tree nodes + the bonus)
SUB_BENCHMARKS = ("draft_forward", "batch")  # report keys: a list of results, or {"error": ...} if it raised

# A method: (target, draft, input_ids [1, L], attention_mask [1, L], **generation kwargs) -> (sequences, stats | None)
Method = Callable[..., tuple[torch.LongTensor, SpeculativeStats | None]]


@dataclass
class BenchmarkConfig:
    """What `run_benchmark` runs. The prompt sets are read with `hf_dflash.data.prompts` unless prompts are passed in."""

    datasets: tuple[str, ...] = ("gsm8k", "humaneval", "mt-bench")  # "name:N" takes N prompts of it, not `limit`
    limit: int = 10  # prompts per dataset
    methods: tuple[str, ...] = ALL_METHODS  # `plain` and the `plain_threads` variants are always added: baselines
    plain_threads: tuple[int, ...] = ()  # also time `plain` at these torch thread counts; the faster is the baseline
    full_comparison_limit: int | None = None  # only the first M prompts of a dataset run every method; None: all do
    core_methods: tuple[str, ...] = CORE_METHODS  # what the prompts beyond `full_comparison_limit` run
    max_new_tokens: int = 200
    repeats: int = 1
    do_sample: bool = False  # sampled outputs differ between paths by design: the identity check needs greedy
    seed: int = 0
    prompt_lookup_num_tokens: int = 10
    warmup_new_tokens: int = 16  # enough for a couple of draft rounds on every path
    draft_block_sizes: tuple[int, ...] = (4, 8, 16)  # empty: skip the draft-forward timing
    draft_timing_repeats: int = 20
    draft_context_len: int = 128  # cached context the timed draft forward attends to (a typical prompt length)
    batch_sizes: tuple[int, ...] = (1, 4, 8)  # empty: skip the batched-throughput comparison
    verify_costs: str | None = "auto"  # `ours`, `assisted`: "auto" verifies what pays (verify_policy); None: all
    progress: bool = True


@dataclass(frozen=True)
class BenchmarkPrompt:
    """A tokenized prompt: a stable id (`"gsm8k/17"`), its dataset, and `[L]` token ids (chat template applied)."""

    id: str
    dataset: str
    input_ids: torch.LongTensor


# ---------------------------------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------------------------------


def _plain(target, draft, input_ids, attention_mask, **kwargs):
    return target.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs), None


def _plain_stock(target, draft, input_ids, attention_mask, preparation: CPUPreparation, **kwargs):
    """Plain decoding with the stock kernels: the target's preparation suspended for the call."""
    with preparation.suspended():
        return _plain(target, draft, input_ids, attention_mask, **kwargs)


def _plain_with_threads(target, draft, input_ids, attention_mask, num_threads: int, **kwargs):
    """Plain decoding at `num_threads` torch threads; the thread count is restored afterwards."""
    default = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return _plain(target, draft, input_ids, attention_mask, **kwargs)
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


def plain_threads_name(num_threads: int) -> str:
    """The method name of plain decoding at `num_threads` torch threads."""
    return f"plain_threads{num_threads}"


def plain_thread_methods(thread_counts: Sequence[int]) -> dict[str, Method]:
    """`plain_threads{n}`: `target.generate` at `n` torch threads, for each count."""
    return {plain_threads_name(n): functools.partial(_plain_with_threads, num_threads=n) for n in thread_counts}


# ---------------------------------------------------------------------------------------------------------------------
# Statistics (pure)
# ---------------------------------------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float | None:
    """Median, or `None` for no values."""
    return statistics.median(values) if len(values) else None


def ratio_of_medians(values: Sequence[float], baseline: Sequence[float]) -> float | None:
    """`median(values) / median(baseline)`; `None` when either is empty."""
    if not len(values) or not len(baseline):
        return None
    return statistics.median(values) / statistics.median(baseline)


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
    counts = []
    for row in generated.tolist():
        stop = next((i for i, token in enumerate(row) if token in eos_token_ids), None)
        counts.append(len(row) if stop is None else stop + 1)
    return counts


# ---------------------------------------------------------------------------------------------------------------------
# Prompts and conditions
# ---------------------------------------------------------------------------------------------------------------------


def load_benchmark_prompts(tokenizer, datasets: Sequence[str], limit: int | None) -> list[BenchmarkPrompt]:
    """The first `limit` prompts of each dataset (`"name:N"`: its first N), chat template applied, tokenized."""
    from hf_dflash.data.chat import apply_chat_template
    from hf_dflash.data.prompts import load_prompts, split_set_limit

    prompts = []
    for entry in datasets:
        name, count = split_set_limit(entry, limit)
        for prompt in load_prompts(name, limit=count):
            ids = tokenizer(apply_chat_template(tokenizer, prompt), return_tensors="pt").input_ids[0]
            prompts.append(BenchmarkPrompt(prompt.id, prompt.dataset, ids))
    return prompts


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def benchmark_conditions(target: PreTrainedModel, draft: PreTrainedModel, config: BenchmarkConfig) -> dict[str, Any]:
    """Everything a number depends on besides the code: machine, threads, versions, dtype, sizes."""
    from importlib.metadata import version

    device = target.device
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_dflash": version("hf-dflash"),
        "target": getattr(target.config, "_name_or_path", None) or type(target).__name__,
        "target_dtype": str(target.dtype).removeprefix("torch."),
        "draft_dtype": str(draft.dtype).removeprefix("torch."),
        "draft_layers": draft.config.num_hidden_layers,
        "block_size": draft.config.block_size,
        "max_new_tokens": config.max_new_tokens,
        "repeats": config.repeats,
        "do_sample": config.do_sample,
    }


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------------


class _ForwardCounter:
    """Counts a module's top-level forward calls while active."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls = module, 0

    def __enter__(self) -> _ForwardCounter:
        self.handle = self.module.register_forward_hook(self._count)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _count(self, *args) -> None:
        self.calls += 1


@dataclass
class _Run:
    prompt_id: str
    method: str
    repeat: int
    seconds: float
    new_tokens: int
    target_forwards: int
    tokens: list[int]
    stats: SpeculativeStats | None = field(default=None, repr=False)


def _timed_run(method: Method, target, draft, input_ids, generation_kwargs) -> tuple[float, int, list[int], Any]:
    """(seconds, target forwards, new tokens, stats) of one generation of one prompt."""
    mask = torch.ones_like(input_ids)
    with torch.no_grad(), _ForwardCounter(target) as counter:
        start = synchronized_clock(input_ids.device)
        sequences, stats = method(target, draft, input_ids, mask, **generation_kwargs)
        seconds = synchronized_clock(input_ids.device) - start
    return seconds, counter.calls, sequences[0, input_ids.shape[1] :].tolist(), stats


def _methods_for(
    position: int, config: BenchmarkConfig, methods: Sequence[str], baselines: Sequence[str]
) -> list[str]:
    """The methods prompt number `position` (within its dataset) runs: every plain variant at least."""
    if config.full_comparison_limit is None or position < config.full_comparison_limit:
        return list(methods)
    return [m for m in methods if m in config.core_methods or m in baselines]


def _extra_thread_counts(thread_counts: Sequence[int]) -> list[int]:
    """The `plain_threads` counts to time beside `plain`: distinct, and not the default (that is `plain`)."""
    if any(n < 1 for n in thread_counts):
        raise ValueError(f"plain_threads must be thread counts >= 1, got {tuple(thread_counts)}.")
    default = torch.get_num_threads()
    if default in thread_counts:
        logger.info(f"plain_threads: {default} is the default thread count, which `plain` runs at.")
    return [n for n in dict.fromkeys(thread_counts) if n != default]


def _not_applicable(
    names: Sequence[str], target: PreTrainedModel, do_sample: bool, planner: VerifyPlanner
) -> dict[str, str]:
    """The methods that would repeat another one or cannot run in this setting, with the reason."""
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


def run_benchmark(
    config: BenchmarkConfig,
    target: PreTrainedModel,
    tokenizer: Any,
    draft: PreTrainedModel,
    prompts: Sequence[BenchmarkPrompt] | None = None,
    methods: dict[str, Method] | None = None,
    preparation: CPUPreparation | None = None,
    planner: VerifyPlanner | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return the report (a JSON-ready dict; see `render_table` for what it holds).

    Args:
        config: what to run.
        target, tokenizer, draft: the models; `tokenizer` is only used to load `config.datasets` and for its pad
            token, so it may be `None` when `prompts` are given.
        prompts: tokenized prompts to use instead of loading `config.datasets`.
        methods: name -> method table, default `default_methods(config.prompt_lookup_num_tokens,
            config.verify_costs)`, with `plain_thread_methods(config.plain_threads)` added where it has no entry of
            that name; every name in `config.methods` must be in it.
        preparation: what `optimize_for_cpu` did to `target` (its drafter prepared alike); adds the `plain_stock`
            baseline and the stock cost curve.
        planner: what the default methods plan with and the cost curves are measured into (a fresh one by default).
    """
    planner = planner if planner is not None else VerifyPlanner()
    if methods is None:
        methods = default_methods(config.prompt_lookup_num_tokens, config.verify_costs, planner)
    baselines = [BASELINE] + [plain_threads_name(n) for n in _extra_thread_counts(config.plain_threads)]
    methods = plain_thread_methods(config.plain_threads) | methods  # a caller's own entry wins
    if preparation is not None and preparation.active:
        baselines.append(STOCK_BASELINE)
        methods = {STOCK_BASELINE: functools.partial(_plain_stock, preparation=preparation)} | methods
    names = list(dict.fromkeys([*baselines, *config.methods]))
    unknown = [m for m in names if m not in methods]
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; known: {sorted(methods)}.")
    skipped = _not_applicable(names, target, config.do_sample, planner)
    names = [m for m in names if m not in skipped]
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}.")
    if prompts is None:
        prompts = load_benchmark_prompts(tokenizer, config.datasets, config.limit)
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    device = target.device
    generation_kwargs = {"max_new_tokens": config.max_new_tokens, "do_sample": config.do_sample}
    pad_token_id = _pad_token_id(target, tokenizer)
    if pad_token_id is not None:
        generation_kwargs["pad_token_id"] = pad_token_id

    costs = benchmark_verify_costs(target, draft, planner)  # untimed; the costed methods then plan from this object
    stock_costs = None
    if STOCK_BASELINE in baselines:
        with preparation.suspended():
            stock_costs = benchmark_verify_costs(target, draft, planner)
    failed = _warm_up(target, draft, prompts[0], names, methods, generation_kwargs, config)
    names = [m for m in names if m not in failed]
    baselines = [m for m in baselines if m in names]
    if BASELINE in failed:
        raise RuntimeError(f"The baseline failed during warm-up: {failed[BASELINE]}")

    plan = []  # (prompt, methods it runs)
    position_in_dataset: dict[str, int] = {}
    for prompt in prompts:
        position = position_in_dataset.get(prompt.dataset, 0)
        position_in_dataset[prompt.dataset] = position + 1
        plan.append((prompt, _methods_for(position, config, names, baselines)))

    runs: list[_Run] = []
    total = sum(len(m) for _, m in plan) * config.repeats
    with logging.tqdm(total=total, desc="bench", unit="run", disable=not config.progress) as bar:
        for index, (prompt, prompt_methods) in enumerate(plan):
            input_ids = prompt.input_ids.to(device)[None]
            for repeat in range(config.repeats):
                shift = (index + repeat) % len(prompt_methods)
                for name in prompt_methods[shift:] + prompt_methods[:shift]:
                    if config.do_sample:
                        torch.manual_seed(config.seed + index)
                    seconds, forwards, tokens, stats = _timed_run(
                        methods[name], target, draft, input_ids, generation_kwargs
                    )
                    runs.append(_Run(prompt.id, name, repeat, seconds, len(tokens), forwards, tokens, stats))
                    bar.set_postfix_str(f"{prompt.id} {name} {len(tokens) / seconds:.1f} tok/s")
                    bar.update(1)

    differences = [] if config.do_sample else find_mismatches(runs)
    mismatches = [m for m in differences if m["method"] != STOCK_BASELINE]
    stock_differences = [m for m in differences if m["method"] == STOCK_BASELINE]
    for mismatch in mismatches:
        logger.error(f"OUTPUT MISMATCH vs {BASELINE}: {mismatch}")
    per_prompt = _per_prompt(runs)
    datasets = list(dict.fromkeys(p.dataset for p in prompts))
    summaries = {}
    for name in [*datasets, "all"] if len(datasets) > 1 else datasets:
        ids = [p.id for p in prompts if name == "all" or p.dataset == name]
        summaries[name] = summary = summarize(per_prompt, ids, names, baselines)
        for method in names:
            summary["methods"][method] |= _speculative_summary(runs, ids, method)
        summary |= _speculative_summary(runs, ids, "ours")  # also at the top, as before (scripts/export_drafter.py)

    conditions = benchmark_conditions(target, draft, config)
    # The target's forward over n = 1 .. 32 new tokens after a 256-token cache, batch 1, and one draft forward.
    conditions["target_forward_s"] = list(costs.verify)
    conditions["target_forward_relative"] = costs.relative()
    conditions["draft_forward_s"] = costs.draft
    conditions["draft_cost_relative"] = round(costs.draft / costs.verify[0], 3)
    if config.verify_costs == "auto":
        conditions["verify_costs_relative"] = costs.relative()  # what `ours` planned from
    conditions["cpu_kernels"] = preparation.summary() if preparation is not None else "stock"
    if stock_costs is not None:
        conditions["stock_target_forward_s"] = list(stock_costs.verify)
        conditions["stock_target_forward_relative"] = stock_costs.relative()
    report = {
        "conditions": conditions,
        "config": asdict(config),
        "methods": names,
        "baselines": baselines,
        "skipped_methods": skipped,
        "failed_methods": failed,
        "prompts": [
            {
                "id": prompt.id,
                "dataset": prompt.dataset,
                "prompt_tokens": int(prompt.input_ids.shape[0]),
                "methods": prompt_methods,
                "full_comparison": len(prompt_methods) == len(names),
            }
            for prompt, prompt_methods in plan
        ],
        "identity_checked": not config.do_sample,
        "mismatches": mismatches,
        "stock_differences": stock_differences,
        "datasets": summaries,
        "per_prompt": per_prompt,
    }
    # The sub-benchmarks must never cost the main results: a failure is recorded in the report instead.
    if config.draft_block_sizes:
        report["draft_forward"] = _recorded_failure(time_draft_forward)(
            target, draft, config.draft_block_sizes, config.draft_timing_repeats, config.draft_context_len
        )
    if config.batch_sizes:
        report["batch"] = _recorded_failure(measure_batch_throughput)(
            target,
            draft,
            prompts,
            config.batch_sizes,
            generation_kwargs,
            config.repeats,
            config.progress,
            config.verify_costs,
            preparation if STOCK_BASELINE in baselines else None,
        )
    crashed = isinstance(report.get("batch"), dict)  # the batched path ran, but its outputs were never compared
    report["identical"] = not (failed or mismatches or _batch_mismatches(report) or crashed)
    report["failures"] = failures(report)
    return report


def _batch_mismatches(report: dict[str, Any]) -> list[int]:
    """The batch sizes where batched `speculative_generate` differed from batched `target.generate` (greedy only)."""
    batch = report.get("batch")
    if not report["identity_checked"] or not isinstance(batch, list):
        return []
    return [r["batch_size"] for r in batch if not r["identical"]]


def failures(report: dict[str, Any]) -> list[str]:
    """Why a report does not pass, one line each: failed methods, outputs that differ from plain decoding (batched
    ones included) and sub-benchmarks that raised. Empty when every path ran and matched."""
    problems = [f"method {name!r} failed: {error}" for name, error in report["failed_methods"].items()]
    if report["mismatches"]:
        problems.append(f"{len(report['mismatches'])} output(s) differ from {BASELINE}")
    problems += [
        f"batch {size}: speculative_generate differs from target.generate" for size in _batch_mismatches(report)
    ]
    problems += [
        f"{name} sub-benchmark failed: {report[name]['error']}"
        for name in SUB_BENCHMARKS
        if isinstance(report.get(name), dict)
    ]
    return problems


def _recorded_failure(function: Callable) -> Callable:
    """`function`, returning `{"error": ...}` (and logging it) instead of raising."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - reported in the JSON and the log
            logger.error(f"{function.__name__} failed: {error!r}")
            return {"error": repr(error)}

    return run


def _pad_token_id(target: PreTrainedModel, tokenizer: Any) -> int | None:
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        return tokenizer.pad_token_id
    return pad_token_id_of(target.generation_config)


def _warm_up(target, draft, prompt, names, methods, generation_kwargs, config) -> dict[str, str]:
    """Run every method once on a short budget; returns the methods that raised, with their error."""
    kwargs = generation_kwargs | {"max_new_tokens": min(config.warmup_new_tokens, config.max_new_tokens)}
    input_ids = prompt.input_ids.to(target.device)[None]
    failed = {}
    for name in names:
        try:
            _timed_run(methods[name], target, draft, input_ids, kwargs)
        except Exception as error:  # a path that cannot run is a result, reported; the others still run
            logger.error(f"Method {name!r} failed during warm-up and is left out: {error!r}")
            failed[name] = repr(error)
    return failed


def find_mismatches(runs: Sequence[_Run]) -> list[dict[str, Any]]:
    """Every run whose new tokens differ from the baseline's first run on the same prompt."""
    reference = {r.prompt_id: r.tokens for r in runs if r.method == BASELINE and r.repeat == 0}
    mismatches = []
    for run in runs:
        expected = reference[run.prompt_id]
        index = first_difference(expected, run.tokens)
        if index is not None:
            mismatches.append(
                {
                    "prompt_id": run.prompt_id,
                    "method": run.method,
                    "repeat": run.repeat,
                    "first_difference": index,
                    "expected_tokens": len(expected),
                    "got_tokens": len(run.tokens),
                    "expected": expected[index : index + 5],
                    "got": run.tokens[index : index + 5],
                }
            )
    return mismatches


def _per_prompt(runs: Sequence[_Run]) -> dict[str, dict[str, dict[str, Any]]]:
    """prompt id -> method -> new tokens, times over repeats, tokens/s at the median time, tokens per target forward."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        entry = table.setdefault(run.prompt_id, {}).setdefault(
            run.method, {"new_tokens": run.new_tokens, "target_forwards": run.target_forwards, "seconds": []}
        )
        entry["seconds"].append(run.seconds)
    for methods in table.values():
        for entry in methods.values():
            entry["tokens_per_s"] = entry["new_tokens"] / median(entry["seconds"])
            entry["tokens_per_target_forward"] = entry["new_tokens"] / max(entry["target_forwards"], 1)
    return table


def summarize(
    per_prompt: dict, prompt_ids: Sequence[str], methods: Sequence[str], baselines: Sequence[str] = (BASELINE,)
) -> dict[str, Any]:
    """Per method over `prompt_ids`: median tokens/s and the two speedups vs the faster of the `baselines` (the plain
    variants; higher median tokens/s over these prompts), each on the prompts both ran."""

    def rates(method: str, ids: Sequence[str]) -> list[float]:
        return [per_prompt[i][method]["tokens_per_s"] for i in ids]

    def ran(method: str) -> list[str]:
        return [i for i in prompt_ids if method in per_prompt.get(i, {})]

    plain_rates = {name: median(rates(name, ran(name))) for name in baselines}
    base = max(baselines, key=lambda name: plain_rates[name] or 0.0)
    summary = {}
    for method in methods:
        ids = [i for i in ran(method) if base in per_prompt[i]]
        tokens = sum(per_prompt[i][method]["new_tokens"] for i in ids)
        forwards = sum(per_prompt[i][method]["target_forwards"] for i in ids)
        summary[method] = {
            "prompts": len(ids),
            "tokens_per_s": median(rates(method, ids)),
            "speedup_ratio_of_medians": ratio_of_medians(rates(method, ids), rates(base, ids)),
            "speedup_median_of_ratios": median_of_ratios(rates(method, ids), rates(base, ids)),
            "tokens_per_target_forward": tokens / forwards if forwards else None,
        }
    return {"baseline": base, "plain_tokens_per_s": plain_rates, "methods": summary}


def _speculative_summary(runs: Sequence[_Run], prompt_ids: Sequence[str], method: str = "ours") -> dict[str, Any]:
    """`method`'s tau, histogram, drafted rounds, tree rounds and plain steps (first repeat: greedy repeats are
    identical), verified nodes per drafted round and draft/verify time per step (a drafted round or a plain step; all
    repeats); empty if it has no `SpeculativeStats`."""
    ids = set(prompt_ids)
    ours = [r for r in runs if r.method == method and r.stats is not None and r.prompt_id in ids]
    if not ours:
        return {}
    first = SpeculativeStats()
    for run in ours:
        if run.repeat == 0:
            first.merge(copy.deepcopy(run.stats))
    rounds = sum(r.stats.num_rounds for r in ours)
    steps = rounds + sum(r.stats.plain_steps for r in ours)
    return {
        "tau": first.tau,
        "tau_histogram": first.histogram,
        "rounds": first.num_rounds,
        "tree_rounds": first.tree_rounds,
        "plain_steps": first.plain_steps,
        "draft_ms_per_step": 1000 * sum(r.stats.draft_time_s for r in ours) / max(steps, 1),
        "verify_ms_per_step": 1000 * sum(r.stats.verify_time_s for r in ours) / max(steps, 1),
        "verified_drafts_per_round": sum(r.stats.verified_drafts for r in ours) / max(rounds, 1),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Sub-benchmarks
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def time_draft_forward(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    block_sizes: Sequence[int],
    repeats: int = 20,
    context_len: int = 128,
) -> list[dict[str, Any]]:
    """Median time of one draft step (forward over `[anchor, MASK x (B-1)]` + the target's LM head on the B-1
    drafted positions) for a fresh drafter with the same layers, per block size B.

    The step is the one inside the decoding loop: `context_len` context tokens already cached, one new context token.
    """
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    device, num_features = target.device, len(draft.config.target_layer_ids) * draft.config.hidden_size
    results = []
    for block_size in block_sizes:
        config = copy.deepcopy(draft.config)
        config.block_size = block_size
        torch.manual_seed(0)
        with device:  # initialised where it runs: a target-sized drafter is slow to initialise on a CPU and copy
            fresh = DFlashForDrafting(config).to(dtype=draft.dtype).eval()
        cache = DynamicCache(config=fresh.config)
        cache.activate_past_recording()  # sliding draft layers must be able to crop the block back
        anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
        block = embed(noise_block(anchor, block_size, config.mask_token_id))  # [1, B, H]
        context = torch.randn(1, context_len, num_features, device=device, dtype=draft.dtype)
        fresh(block, context, torch.arange(context_len + block_size, device=device)[None], cache=cache)
        cache.crop(-block_size)  # keep the context K/V, as the loop does
        new_context = context[:, :1]
        positions = torch.arange(context_len, context_len + 1 + block_size, device=device)[None]
        step_times, head_times = [], []
        for attempt in range(repeats + 2):  # two warm-up steps
            start = synchronized_clock(device)
            hidden = fresh(block, new_context, positions, cache=cache).last_hidden_state
            head_start = synchronized_clock(device)
            fresh.draft_logits(hidden[:, 1:], lm_head)  # over the draft vocabulary, as the loop does
            end = synchronized_clock(device)
            cache.crop(-(block_size + 1))  # back to `context_len` cached tokens
            if attempt >= 2:
                step_times.append(end - start)
                head_times.append(end - head_start)
        results.append(
            {
                "block_size": block_size,
                "draft_layers": config.num_hidden_layers,
                "median_ms": 1000 * median(step_times),
                "lm_head_median_ms": 1000 * median(head_times),
                "repeats": repeats,
                "context_len": context_len,
            }
        )
        logger.info(f"draft step at block size {block_size}: {results[-1]['median_ms']:.2f} ms")
    return results


def left_pad(rows: Sequence[torch.LongTensor], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-pad 1-D token rows into `[b, L]` ids and attention mask (what batched generation expects), on the rows'
    device."""
    length, device = max(len(r) for r in rows), rows[0].device
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :] = row
        mask[i, length - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def measure_batch_throughput(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[BenchmarkPrompt],
    batch_sizes: Sequence[int],
    generation_kwargs: dict[str, Any],
    repeats: int = 1,
    progress: bool = True,
    verify_costs: str | None = None,
    preparation: CPUPreparation | None = None,
) -> list[dict[str, Any]]:
    """Tokens/s of batched `target.generate` vs batched `speculative_generate(..., verify_costs=verify_costs)` on
    left-padded batches of the first prompts (reused cyclically when there are fewer prompts than the batch size);
    `"auto"` costs are measured at each batch size in the untimed warm-up, and the last run's tau, verified nodes per
    round, tree rounds and plain steps are recorded. Each batch runs `repeats` times per path (median time);
    batches are padded and cut at EOS as the rest of the library does (`pad_token_id_of`, `token_ids`), with
    `generation_kwargs` over `target.generation_config`. With a `preparation`, batched plain decoding also runs
    with the stock kernels and the speedup is against the faster plain."""
    if repeats < 1:
        raise ValueError(f"measure_batch_throughput needs repeats >= 1 timed runs per batch, got {repeats}; pass 1.")
    device = target.device
    ours_kwargs = {"verify_costs": verify_costs, "planner": VerifyPlanner(), "optimize_cpu": False}
    plains = ("plain", STOCK_BASELINE) if preparation is not None else ("plain",)
    generation = copy.deepcopy(target.generation_config)
    generation.update(**generation_kwargs)
    pad, eos_ids = pad_token_id_of(generation), token_ids(generation.eos_token_id)
    results = []
    for batch_size in logging.tqdm(batch_sizes, desc="batch", disable=not progress):
        chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
        ids, mask = (t.to(device) for t in left_pad([p.input_ids for p in chosen], pad))
        warm = generation_kwargs | {"max_new_tokens": min(8, generation_kwargs["max_new_tokens"])}
        target.generate(input_ids=ids, attention_mask=mask, **warm)
        speculative_generate(target, draft, ids, mask, **warm, **ours_kwargs)
        times: dict[str, list[float]] = {name: [] for name in (*plains, "ours")}
        for repeat in range(repeats):
            order = (*plains, "ours")
            for name in order if repeat % 2 == 0 else order[::-1]:
                start = synchronized_clock(device)
                if name == STOCK_BASELINE:
                    with preparation.suspended():
                        target.generate(input_ids=ids, attention_mask=mask, **generation_kwargs)
                elif name == "plain":
                    generated = target.generate(input_ids=ids, attention_mask=mask, **generation_kwargs)
                    generated = generated[:, ids.shape[1] :]
                    plain_counts = count_new_tokens(generated, eos_ids)
                    plain_rows = [row[:n] for row, n in zip(generated.tolist(), plain_counts)]
                else:
                    out = speculative_generate(target, draft, ids, mask, **generation_kwargs, **ours_kwargs)
                    ours_counts, ours_stats = out.num_new_tokens, out.stats
                    ours_rows = [
                        row[ids.shape[1] : ids.shape[1] + n] for row, n in zip(out.sequences.tolist(), ours_counts)
                    ]
                times[name].append(synchronized_clock(device) - start)
        # stock plain's own tokens are not counted or compared: its rate assumes prepared plain's token count
        plain_rates = {name: sum(plain_counts) / median(times[name]) for name in plains}
        plain_rate = max(plain_rates.values())
        ours_rate = sum(ours_counts) / median(times["ours"])
        identical = plain_rows == ours_rows
        if not identical and not generation_kwargs.get("do_sample"):
            logger.error(f"Batch {batch_size}: speculative_generate and batched target.generate differ.")
        results.append(
            {
                "batch_size": batch_size,
                "prompt_ids": [p.id for p in chosen],
                "plain_tokens_per_s": plain_rate,
                "plain_tokens_per_s_by_kernels": plain_rates,
                "ours_tokens_per_s": ours_rate,
                "speedup": ours_rate / plain_rate,
                "plain_new_tokens": sum(plain_counts),
                "ours_new_tokens": sum(ours_counts),
                "identical": identical,
                "tau": ours_stats.tau,
                "verified_drafts_per_round": ours_stats.verified_drafts_per_round,
                "tree_rounds": ours_stats.tree_rounds,
                "plain_steps": ours_stats.plain_steps,
            }
        )
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_table(report: dict[str, Any]) -> str:
    """The report as fixed-width text: the cost curve, per dataset and method (speedups vs the faster plain), each
    `speculative_generate` method's tau, nodes, tree rounds and plain steps, sub-benchmarks, identity verdict."""
    lines = []
    c = report["conditions"]
    lines.append(
        f"{c['target']} ({c['target_dtype']}) | draft {c['draft_layers']} layer(s), block {c['block_size']} | "
        f"max_new_tokens {c['max_new_tokens']} | repeats {c['repeats']} | {c['cpu']} | "
        f"torch {c['torch']} threads {c['torch_threads']} | OMP_WAIT_POLICY={c['OMP_WAIT_POLICY']}"
    )
    if "target_forward_relative" in c:
        relative, shown = c["target_forward_relative"], (1, 2, 4, 8, 16, 17, 32)
        lines.append(
            f"target forward over n tokens, x one token ({1000 * c['target_forward_s'][0]:.1f} ms): "
            + ", ".join(f"{n}: {relative[n - 1]:.2f}" for n in shown if n <= len(relative))
            + f"; draft forward {c['draft_cost_relative']:.2f}"
        )
    if "stock_target_forward_relative" in c:
        relative, shown = c["stock_target_forward_relative"], (1, 2, 4, 8, 16, 17, 32)
        lines.append(
            f"... with stock kernels ({1000 * c['stock_target_forward_s'][0]:.1f} ms): "
            + ", ".join(f"{n}: {relative[n - 1]:.2f}" for n in shown if n <= len(relative))
        )
    if "cpu_kernels" in c:
        lines.append(f"CPU kernels: {c['cpu_kernels']}")
    full = [p["id"] for p in report["prompts"] if p["full_comparison"]]
    if len(full) < len(report["prompts"]):
        core = report["config"].get("core_methods", CORE_METHODS)
        lines.append(
            f"every method ran on: {', '.join(full)}; the other prompts ran only {', '.join(core)} and every plain variant"
        )
    for name, reason in report.get("skipped_methods", {}).items():
        lines.append(f"{name} left out: {reason}")
    header = f"{'dataset':10s} {'method':16s} {'prompts':>7s} {'tok/s':>8s} {'x (medians)':>11s} {'x (per-prompt)':>14s} {'tok/fwd':>8s}"
    lines += ["", header, "-" * len(header)]
    for dataset, summary in report["datasets"].items():
        for method, row in summary["methods"].items():
            lines.append(
                f"{dataset:10s} {method:16s} {row['prompts']:7d} {_fmt(row['tokens_per_s'], 1):>8s} "
                f"{_fmt(row['speedup_ratio_of_medians']):>11s} {_fmt(row['speedup_median_of_ratios']):>14s} "
                f"{_fmt(row['tokens_per_target_forward']):>8s}"
            )
        rates = ", ".join(f"{name} {_fmt(rate, 1)}" for name, rate in summary.get("plain_tokens_per_s", {}).items())
        lines.append(
            f"{dataset:10s} speedups vs {summary.get('baseline', BASELINE)}, the faster plain ({rates} tok/s)"
        )
        for method, row in summary["methods"].items():
            if "tau" in row:
                lines.append(
                    f"{dataset:10s} {method}: tau {row['tau']:.2f}, histogram {row['tau_histogram']}, "
                    f"{row['verified_drafts_per_round']:.2f} nodes verified per round, {row['tree_rounds']} of "
                    f"{row['rounds']} rounds trees, {row['plain_steps']} plain steps, draft "
                    f"{row['draft_ms_per_step']:.1f} + verify {row['verify_ms_per_step']:.1f} ms/step"
                )
    if isinstance(report.get("draft_forward"), list):
        lines += [
            "",
            "draft step (forward + LM head), median ms: "
            + ", ".join(
                f"B={r['block_size']}: {r['median_ms']:.2f} (head {r['lm_head_median_ms']:.2f})"
                for r in report["draft_forward"]
            ),
        ]
    if isinstance(report.get("batch"), list):
        lines.append("")
        for r in report["batch"]:
            lines.append(
                f"batch {r['batch_size']}: plain {r['plain_tokens_per_s']:.1f} tok/s, ours {r['ours_tokens_per_s']:.1f} "
                f"tok/s, x{r['speedup']:.2f}, tau {r['tau']:.2f}, {r['tree_rounds']} tree rounds, "
                f"{r['plain_steps']} plain steps, identical {r['identical']}"
            )
    lines.append("")
    if not report["identity_checked"]:
        lines.append("outputs not compared (sampling)")
    if report.get("stock_differences"):
        lines.append(
            f"plain_stock differs from prepared plain on {len(report['stock_differences'])} prompt(s) "
            "(products summed in another order; not a failure)"
        )
    if report["mismatches"]:
        lines.append(f"OUTPUT MISMATCHES vs plain: {len(report['mismatches'])}")
        lines += [f"  {m}" for m in report["mismatches"]]
    problems = failures(report)
    if problems:
        lines.append(f"FAILED ({len(problems)}):")
        lines += [f"  {problem}" for problem in problems]
    elif report["identity_checked"]:
        batched = ", and every batch matched batched plain" if isinstance(report.get("batch"), list) else ""
        lines.append(f"identical outputs: every method matched plain on all {len(report['prompts'])} prompts{batched}")
    return "\n".join(lines)


def save_plot(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Bars of median tokens/s per method per dataset, and the speedup (ratio of medians), as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    datasets = list(report["datasets"])
    methods = report["methods"]
    figure = Figure(figsize=(max(6, 1.8 * len(datasets) + 3), 7), layout="constrained")
    FigureCanvasAgg(figure)
    rate_axes, speed_axes = figure.subplots(2, 1, sharex=True)
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        rows = [report["datasets"][d]["methods"].get(method, {}) for d in datasets]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        rate_axes.bar(xs, [r.get("tokens_per_s") or 0 for r in rows], width, label=method)
        speed_axes.bar(xs, [r.get("speedup_ratio_of_medians") or 0 for r in rows], width, label=method)
    rate_axes.set_ylabel("tokens/s (median)")
    c = report["conditions"]
    title = f"{Path(str(c['target'])).name}, block {c['block_size']}, {c['max_new_tokens']} new tokens\n{c['cpu']}"
    figure.suptitle(title, fontsize=9)
    figure.legend(*rate_axes.get_legend_handles_labels(), loc="outside lower center", ncols=min(len(methods), 5))
    speed_axes.axhline(1.0, color="grey", linewidth=0.8)
    speed_axes.set_ylabel("speedup vs the faster plain (ratio of medians)")
    speed_axes.set_xticks(range(len(datasets)), datasets)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


__all__ = [
    "ALL_METHODS",
    "BenchmarkConfig",
    "BenchmarkPrompt",
    "benchmark_verify_costs",
    "default_methods",
    "failures",
    "load_benchmark_prompts",
    "median",
    "median_of_ratios",
    "plain_thread_methods",
    "plain_threads_name",
    "ratio_of_medians",
    "render_table",
    "run_benchmark",
    "save_plot",
]
