"""Timed, alternating runs of every decoding path on real prompts, checked token for token against plain decoding.

Design:

- one process, one target, one drafter; a warm-up run of every method first, then for each prompt every method runs
  once per repeat, in an order rotated per prompt and per repeat, so clock drift and background load hit all alike;
- the methods are `bench.methods`'s (`default_methods`); one that cannot differ from another or cannot run in a
  setting (trees under sampling or on a target that cannot verify one) is left out and listed in
  `report.skipped_methods`, one that raises in the warm-up in `report.failed_methods`;
- with a `CPUPreparation` (`optimize_for_cpu` on the target and drafter), `plain` runs the prepared kernels and
  `plain_stock` the stock ones (the preparation suspended for the call), and with an exact one `plain_fast` fast
  mode's (`CPUPreparation.fast`): all are baselines, the fastest counts, and the target's cost curve is recorded for
  prepared and stock kernels; the other plains' outputs are compared with `plain` too, but a difference there
  (products summed in another order) is listed in `stock_differences`, not as a failure;
- the baseline is plain decoding at its fastest thread count: `config.plain_threads` adds `plain_threads{n}`, and
  every speedup of a dataset is computed against whichever plain variant has the higher median tokens/s there
  (`bench.statistics.summarize`); every plain variant runs on every prompt;
- the target's forward time over 1 .. 32 new tokens (and one draft forward) is measured once before the warm-up,
  outside every timing, and recorded in the conditions (seconds and relative to one token); that same `VerifyCosts`
  object is what every costed method plans from (16 tree nodes + the bonus fit in it);
- greedy runs must be token-identical to `plain` on every prompt and repeat, and batched `speculative_generate` to
  batched `target.generate`; mismatches are collected, never hidden, and `report.identical` covers every path;
- `tokens_per_target_forward` counts the target's top-level forward calls with a hook (prefill included); every
  `speculative_generate` method also reports tau and its histogram, verified nodes per round, tree rounds and plain
  steps;
- optional sub-benchmarks: the draft's forward + LM head time per block size (`bench.draft_step`), batched
  throughput of `speculative_generate` (its planner's costs measured at each batch size) vs `target.generate` on
  left-padded batches, and serving engines on the same prompts plain and with the drafter (`bench.peers`); one that
  raises is recorded as a `SubBenchmarkError` so the main results survive;
- `report.failures` lists every failed method, mismatch and failed sub-benchmark: the run passes when it is empty.

`run_benchmark` returns a `BenchmarkReport` (`bench.report`; `to_json()` is the file `hf-dflash bench` writes);
`render_table` and `save_plot` turn it into text and a PNG. Nothing here prints: progress goes through transformers'
tqdm, messages through its logger.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.utils import logging

from hf_dflash.bench.config import (
    BASELINE,
    OTHER_KERNEL_PLAINS,
    STOCK_BASELINE,
    BenchmarkConfig,
    BenchmarkPrompt,
)
from hf_dflash.bench.draft_step import time_draft_forward
from hf_dflash.bench.methods import (
    Method,
    benchmark_verify_costs,
    default_methods,
    extra_thread_counts,
    kernels_of,
    not_applicable,
    other_kernel_plain_methods,
    other_kernel_plains,
    plain_kernels,
    plain_thread_methods,
    plain_threads_name,
)
from hf_dflash.bench.peers import build_peers, measure_peers
from hf_dflash.bench.report import (
    BatchThroughput,
    BenchmarkReport,
    Conditions,
    DatasetSummary,
    DraftStepTime,
    Mismatch,
    PeerRow,
    PromptRecord,
    SubBenchmarkError,
    batch_mismatches,
    failures,
)
from hf_dflash.bench.statistics import (
    TimedRun,
    count_new_tokens,
    find_mismatches,
    median,
    per_prompt_table,
    speculative_summary,
    summarize,
)
from hf_dflash.data.tokens import left_pad, pad_token_id_for
from hf_dflash.decoding.cpu_kernels import CPUPreparation
from hf_dflash.decoding.policy import VerifyCosts, VerifyPlanner
from hf_dflash.decoding.speculative import speculative_generate
from hf_dflash.model.generation_dflash import pad_token_id_of, synchronized_clock, token_ids

logger = logging.get_logger(__name__)

# (prompt, the methods it runs), in prompt order
Plan = list[tuple[BenchmarkPrompt, list[str]]]


# ---------------------------------------------------------------------------------------------------------------------
# Prompts and conditions
# ---------------------------------------------------------------------------------------------------------------------


def load_benchmark_prompts(tokenizer, datasets: Sequence[str], limit: int | None) -> list[BenchmarkPrompt]:
    """The first `limit` prompts of each dataset (`"name:N"`: its first N), chat template applied, tokenized."""
    from hf_dflash.data.chat import encode_prompt
    from hf_dflash.data.prompts import load_prompts, split_set_limit

    prompts = []
    for entry in datasets:
        name, count = split_set_limit(entry, limit)
        for prompt in load_prompts(name, limit=count):
            ids = torch.tensor(encode_prompt(tokenizer, prompt))
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


def benchmark_conditions(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    config: BenchmarkConfig,
    costs: VerifyCosts | None = None,
    stock_costs: VerifyCosts | None = None,
    preparation: CPUPreparation | None = None,
) -> Conditions:
    """Everything a number depends on besides the code: machine, threads, versions, dtype, sizes; with `costs`, the
    target's forward over n = 1 .. 32 new tokens after a 256-token cache, batch 1, and one draft forward (with
    `stock_costs`, the same with the stock kernels)."""
    from importlib.metadata import version

    device = target.device
    conditions = Conditions(
        cpu=cpu_model(),
        cpu_count=os.cpu_count(),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY"),
        torch_threads=torch.get_num_threads(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        hf_dflash=version("hf-dflash"),
        target=getattr(target.config, "_name_or_path", None) or type(target).__name__,
        target_dtype=str(target.dtype).removeprefix("torch."),
        draft_dtype=str(draft.dtype).removeprefix("torch."),
        draft_layers=draft.config.num_hidden_layers,
        block_size=draft.config.block_size,
        max_new_tokens=config.max_new_tokens,
        repeats=config.repeats,
        do_sample=config.do_sample,
        sampling=sampling_settings(config) or None,
    )
    if costs is not None:
        conditions.target_forward_s = list(costs.verify)
        conditions.target_forward_relative = costs.relative()
        conditions.draft_forward_s = costs.draft
        conditions.draft_cost_relative = round(costs.draft / costs.verify[0], 3)
        if config.verify_costs == "auto":
            conditions.verify_costs_relative = costs.relative()  # what `ours` planned from
    conditions.cpu_kernels = preparation.summary() if preparation is not None else "stock"
    if stock_costs is not None:
        conditions.stock_target_forward_s = list(stock_costs.verify)
        conditions.stock_target_forward_relative = stock_costs.relative()
    return conditions


# ---------------------------------------------------------------------------------------------------------------------
# Timed runs
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


def _timed_run(method: Method, target, draft, input_ids, generation_kwargs) -> tuple[float, int, list[int], Any]:
    """(seconds, target forwards, new tokens, stats) of one generation of one prompt."""
    mask = torch.ones_like(input_ids)
    with torch.no_grad(), _ForwardCounter(target) as counter:
        start = synchronized_clock(input_ids.device)
        sequences, stats = method(target, draft, input_ids, mask, **generation_kwargs)
        seconds = synchronized_clock(input_ids.device) - start
    return seconds, counter.calls, sequences[0, input_ids.shape[1] :].tolist(), stats


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


def _methods_for(
    position: int, config: BenchmarkConfig, methods: Sequence[str], baselines: Sequence[str]
) -> list[str]:
    """The methods prompt number `position` (within its dataset) runs: every plain variant at least."""
    if config.full_comparison_limit is None or position < config.full_comparison_limit:
        return list(methods)
    return [m for m in methods if m in config.core_methods or m in baselines]


def _method_table(
    config: BenchmarkConfig,
    methods: dict[str, Method] | None,
    preparation: CPUPreparation | None,
    planner: VerifyPlanner,
) -> tuple[dict[str, Method], list[str]]:
    """The name -> method table (a caller's own entries win) and the baselines: `plain`, `plain_stock` when
    `preparation` is active and `plain_fast` when it is also exact, and each of them at the `plain_threads` counts."""
    if methods is None:
        methods = default_methods(config.prompt_lookup_num_tokens, config.verify_costs, planner)
    kernels = [BASELINE, *other_kernel_plains(preparation)]
    counts = extra_thread_counts(config.plain_threads)
    baselines = kernels + [plain_threads_name(n, variant) for n in counts for variant in kernels]
    methods = plain_thread_methods(config.plain_threads, preparation) | methods  # a caller's own entry wins
    return other_kernel_plain_methods(preparation) | methods, baselines


def _method_names(
    config: BenchmarkConfig,
    methods: dict[str, Method],
    baselines: Sequence[str],
    target: PreTrainedModel,
    draft: PreTrainedModel,
    planner: VerifyPlanner,
) -> tuple[list[str], dict[str, str]]:
    """The methods to run (baselines first) and those left out in this setting, with the reason."""
    names = list(dict.fromkeys([*baselines, *config.methods]))
    unknown = [m for m in names if m not in methods]
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; known: {sorted(methods)}.")
    skipped = not_applicable(names, target, config.do_sample, planner)
    return [m for m in names if m not in skipped], skipped


def _measured_costs(
    target: PreTrainedModel, draft: PreTrainedModel, stock: CPUPreparation | None, planner: VerifyPlanner
) -> tuple[VerifyCosts, VerifyCosts | None]:
    """The target's cost curve, untimed, before the warm-up (the costed methods then plan from that very object), and
    with a `stock` preparation the same with the stock kernels."""
    costs = benchmark_verify_costs(target, draft, planner)
    if stock is None:
        return costs, None
    with stock.suspended():
        return costs, benchmark_verify_costs(target, draft, planner)


def _generation_kwargs(config: BenchmarkConfig, target: PreTrainedModel, tokenizer: Any) -> dict[str, Any]:
    """What every method's generation gets: the budget, greedy or sampling, and the pad token."""
    generation_kwargs = {"max_new_tokens": config.max_new_tokens, "do_sample": config.do_sample}
    return generation_kwargs | sampling_settings(config) | {"pad_token_id": pad_token_id_for(target, tokenizer)}


def sampling_settings(config: BenchmarkConfig) -> dict[str, float | int]:
    """The sampling settings `config` sets (under `do_sample`); the others come from the target's generation
    config."""
    if not config.do_sample:
        return {}
    settings = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k}
    return {name: value for name, value in settings.items() if value is not None}


def _plan(prompts: Sequence[BenchmarkPrompt], config: BenchmarkConfig, names: Sequence[str], baselines) -> Plan:
    """Each prompt with the methods it runs (`full_comparison_limit` counts within its dataset)."""
    plan = []
    position_in_dataset: dict[str, int] = {}
    for prompt in prompts:
        position = position_in_dataset.get(prompt.dataset, 0)
        position_in_dataset[prompt.dataset] = position + 1
        plan.append((prompt, _methods_for(position, config, names, baselines)))
    return plan


def _timed_runs(
    plan: Plan, methods: dict[str, Method], target, draft, generation_kwargs: dict[str, Any], config: BenchmarkConfig
) -> list[TimedRun]:
    """Every method of each prompt once per repeat, in an order rotated per prompt and per repeat."""
    device = target.device
    runs: list[TimedRun] = []
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
                    runs.append(TimedRun(prompt.id, name, repeat, seconds, len(tokens), forwards, tokens, stats))
                    bar.set_postfix_str(f"{prompt.id} {name} {len(tokens) / seconds:.1f} tok/s")
                    bar.update(1)
    return runs


# ---------------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------------


def _compare_outputs(runs: Sequence[TimedRun], do_sample: bool) -> tuple[list[Mismatch], list[Mismatch]]:
    """Greedy outputs against plain's: the mismatches, and the differences of plain on other kernels (`plain_stock`,
    `plain_fast`: not failures)."""
    differences = [] if do_sample else find_mismatches(runs)
    mismatches = [m for m in differences if kernels_of(m.method) not in OTHER_KERNEL_PLAINS]
    for mismatch in mismatches:
        logger.error(f"OUTPUT MISMATCH vs {BASELINE}: {mismatch.to_json()}")
    return mismatches, [m for m in differences if kernels_of(m.method) in OTHER_KERNEL_PLAINS]


def _dataset_summaries(
    runs: Sequence[TimedRun], per_prompt, prompts: Sequence[BenchmarkPrompt], names: Sequence[str], baselines
) -> dict[str, DatasetSummary]:
    """Each dataset's summary (and `"all"` prompts' when there are several), with the speculative statistics."""
    datasets = list(dict.fromkeys(p.dataset for p in prompts))
    summaries = {}
    for name in [*datasets, "all"] if len(datasets) > 1 else datasets:
        ids = [p.id for p in prompts if name == "all" or p.dataset == name]
        summaries[name] = summary = summarize(per_prompt, ids, names, baselines)
        for method in names:
            summary.methods[method].speculative = speculative_summary(runs, ids, method)
    return summaries


def _prompt_records(plan: Plan, names: Sequence[str]) -> list[PromptRecord]:
    return [
        PromptRecord(
            id=prompt.id,
            dataset=prompt.dataset,
            prompt_tokens=int(prompt.input_ids.shape[0]),
            methods=prompt_methods,
            full_comparison=len(prompt_methods) == len(names),
        )
        for prompt, prompt_methods in plan
    ]


def _draft_step_times(target: PreTrainedModel, draft: PreTrainedModel, config: BenchmarkConfig) -> list[DraftStepTime]:
    rows = time_draft_forward(
        target, draft, config.draft_block_sizes, config.draft_timing_repeats, config.draft_context_len
    )
    return [DraftStepTime.from_json(row) for row in rows]


def _run_sub_benchmarks(
    report: BenchmarkReport,
    config: BenchmarkConfig,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[BenchmarkPrompt],
    generation_kwargs: dict[str, Any],
    preparation: CPUPreparation | None,
    tokenizer: Any,
) -> None:
    """The draft-step timing, batched throughput and serving engines into `report`; they must never cost the main
    results: a failure is recorded in the report instead."""
    if config.draft_block_sizes:
        report.draft_forward = _recorded_failure(_draft_step_times)(target, draft, config)
    if config.batch_sizes:
        report.batch = _recorded_failure(measure_batch_throughput)(
            target,
            draft,
            prompts,
            config.batch_sizes,
            generation_kwargs,
            config.repeats,
            config.progress,
            config.verify_costs,
            preparation,
        )
    if config.peers:
        report.peers = _recorded_failure(_peer_rows)(config, target, draft, tokenizer, prompts)


def _peer_rows(
    config: BenchmarkConfig, target: PreTrainedModel, draft: PreTrainedModel, tokenizer: Any, prompts
) -> list[PeerRow]:
    """`config.peers` run on the prompts (`bench.peers`), their exports removed afterwards."""
    engines, folder = build_peers(config.peers, draft, target, config.peer_target_gguf)
    with folder:
        return measure_peers(engines, prompts, tokenizer, config.max_new_tokens)


def run_benchmark(
    config: BenchmarkConfig,
    target: PreTrainedModel,
    tokenizer: Any,
    draft: PreTrainedModel,
    prompts: Sequence[BenchmarkPrompt] | None = None,
    methods: dict[str, Method] | None = None,
    preparation: CPUPreparation | None = None,
    planner: VerifyPlanner | None = None,
) -> BenchmarkReport:
    """Run the benchmark and return its report (`BenchmarkReport`; `to_json()` is what `hf-dflash bench` writes).

    Args:
        config: what to run.
        target, tokenizer, draft: the models; `tokenizer` is only used to load `config.datasets` and for its pad
            token, so it may be `None` when `prompts` are given.
        prompts: tokenized prompts to use instead of loading `config.datasets`.
        methods: name -> method table, default `default_methods(config.prompt_lookup_num_tokens,
            config.verify_costs)`, with `plain_thread_methods(config.plain_threads, preparation)` added where it has
            no entry of that name; every name in `config.methods` must be in it.
        preparation: what `optimize_for_cpu` did to `target` (its drafter prepared alike); adds the `plain_stock`
            baseline and the stock cost curve.
        planner: what the default methods plan with and the cost curves are measured into (a fresh one by default).
    """
    planner = planner if planner is not None else VerifyPlanner()
    methods, baselines = _method_table(config, methods, preparation, planner)
    names, skipped = _method_names(config, methods, baselines, target, draft, planner)
    if config.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {config.repeats}.")
    if prompts is None:
        prompts = load_benchmark_prompts(tokenizer, config.datasets, config.limit)
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    generation_kwargs = _generation_kwargs(config, target, tokenizer)

    stock = preparation if STOCK_BASELINE in baselines else None
    costs, stock_costs = _measured_costs(target, draft, stock, planner)
    failed = _warm_up(target, draft, prompts[0], names, methods, generation_kwargs, config)
    names = [m for m in names if m not in failed]
    baselines = [m for m in baselines if m in names]
    if BASELINE in failed:
        raise RuntimeError(f"The baseline failed during warm-up: {failed[BASELINE]}")

    plan = _plan(prompts, config, names, baselines)
    runs = _timed_runs(plan, methods, target, draft, generation_kwargs, config)
    mismatches, stock_differences = _compare_outputs(runs, config.do_sample)
    per_prompt = per_prompt_table(runs)
    report = BenchmarkReport(
        conditions=benchmark_conditions(target, draft, config, costs, stock_costs, preparation),
        config=dataclasses.replace(config),
        methods=names,
        baselines=baselines,
        skipped_methods=skipped,
        failed_methods=failed,
        prompts=_prompt_records(plan, names),
        identity_checked=not config.do_sample,
        mismatches=mismatches,
        stock_differences=stock_differences,
        datasets=_dataset_summaries(runs, per_prompt, prompts, names, baselines),
        per_prompt=per_prompt,
    )
    stock = preparation if STOCK_BASELINE in baselines else None  # batched stock plain too, unless it failed
    _run_sub_benchmarks(report, config, target, draft, prompts, generation_kwargs, stock, tokenizer)
    crashed = isinstance(report.batch, SubBenchmarkError)  # the batched path ran, but its outputs were never compared
    report.identical = not (failed or mismatches or batch_mismatches(report) or crashed)
    report.failures = failures(report)
    return report


def _recorded_failure(function: Callable) -> Callable:
    """`function`, returning a `SubBenchmarkError` (and logging it) instead of raising."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - reported in the JSON and the log
            logger.error(f"{function.__name__} failed: {error!r}")
            return SubBenchmarkError(error=repr(error))

    return run


# ---------------------------------------------------------------------------------------------------------------------
# Batched throughput
# ---------------------------------------------------------------------------------------------------------------------


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
) -> list[BatchThroughput]:
    """Tokens/s of batched `target.generate` vs batched `speculative_generate(..., verify_costs=verify_costs)` on
    left-padded batches of the first prompts (reused cyclically when there are fewer prompts than the batch size);
    `"auto"` costs are measured at each batch size in the untimed warm-up, and the last run's tau, verified nodes per
    round, tree rounds and plain steps are recorded. Each batch runs `repeats` times per path (median time);
    batches are padded and cut at EOS as the rest of the library does (`pad_token_id_of`, `token_ids`), with
    `generation_kwargs` over `target.generation_config`. With a `preparation`, batched plain decoding also runs
    with the stock kernels (and an exact one's with fast mode's) and the speedup is against the fastest plain."""
    if repeats < 1:
        raise ValueError(f"measure_batch_throughput needs repeats >= 1 timed runs per batch, got {repeats}; pass 1.")
    device = target.device
    ours_kwargs = {"verify_costs": verify_costs, "planner": VerifyPlanner(), "optimize_cpu": False}
    plains = ("plain", *other_kernel_plains(preparation))
    generation = copy.deepcopy(target.generation_config)
    generation.update(**generation_kwargs)
    pad, eos_ids = pad_token_id_of(generation), token_ids(generation.eos_token_id)
    results = []
    for batch_size in logging.tqdm(batch_sizes, desc="batch", disable=not progress):
        chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
        ids, mask = (t.to(device) for t in left_pad([p.input_ids for p in chosen], pad))
        warm = generation_kwargs | {"max_new_tokens": min(8, generation_kwargs["max_new_tokens"])}
        for name in plains:
            with plain_kernels(name, preparation):
                target.generate(input_ids=ids, attention_mask=mask, **warm)
        speculative_generate(target, draft, ids, mask, **warm, **ours_kwargs)
        times: dict[str, list[float]] = {name: [] for name in (*plains, "ours")}
        for repeat in range(repeats):
            order = (*plains, "ours")
            for name in order if repeat % 2 == 0 else order[::-1]:
                start = synchronized_clock(device)
                if name in OTHER_KERNEL_PLAINS:
                    with plain_kernels(name, preparation):
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
        # the other plains' own tokens are not counted or compared: their rates assume prepared plain's token count
        plain_rates = {name: sum(plain_counts) / median(times[name]) for name in plains}
        plain_rate = max(plain_rates.values())
        ours_rate = sum(ours_counts) / median(times["ours"])
        identical = plain_rows == ours_rows
        if not identical and not generation_kwargs.get("do_sample"):
            logger.error(f"Batch {batch_size}: speculative_generate and batched target.generate differ.")
        results.append(
            BatchThroughput(
                batch_size=batch_size,
                prompt_ids=[p.id for p in chosen],
                plain_tokens_per_s=plain_rate,
                plain_tokens_per_s_by_kernels=plain_rates,
                ours_tokens_per_s=ours_rate,
                speedup=ours_rate / plain_rate,
                plain_new_tokens=sum(plain_counts),
                ours_new_tokens=sum(ours_counts),
                identical=identical,
                tau=ours_stats.tau,
                verified_drafts_per_round=ours_stats.verified_drafts_per_round,
                tree_rounds=ours_stats.tree_rounds,
                plain_steps=ours_stats.plain_steps,
            )
        )
    return results


__all__ = [
    "BenchmarkConfig",
    "BenchmarkPrompt",
    "benchmark_conditions",
    "cpu_model",
    "load_benchmark_prompts",
    "measure_batch_throughput",
    "run_benchmark",
]
