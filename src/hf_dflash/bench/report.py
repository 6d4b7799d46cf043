"""The benchmark's report as dataclasses, its JSON form, and what reads it: `render_table` and `failures`.

Design:

- one dataclass per part of the report (`Conditions`, per-dataset `DatasetSummary` of `MethodSummary` rows with their
  `SpeculativeSummary`, per-prompt `PromptRun`s, `Mismatch`es, `DraftStepTime`s, `BatchThroughput`s); a sub-benchmark
  that raised is a `SubBenchmarkError` in its place, so the main results survive;
- `to_json()` writes the keys `hf-dflash bench` has always written, in the same order (a `MethodSummary`'s
  speculative statistics sit beside its rates, as before); a field that is `None` and optional is left out, as the
  key was;
- `from_json()` reads every report committed under `benchmarks/results/`: keys this version does not know (an older
  report's, a caller's own such as the CLI's `command`, `draft_path` and `target_adapter`, a hand-written `note`)
  are kept in `extra` and written back, keys an older report lacks stay `None`, so
  `BenchmarkReport.from_json(x).to_json() == x` for a report of this version;
- `failures` says why a report does not pass; `render_table` turns a report into fixed-width text (`bench.plot`
  draws it).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from hf_dflash.bench.config import BASELINE, CORE_METHODS, BenchmarkConfig

SUB_BENCHMARKS = ("draft_forward", "batch", "peers")  # report keys: a list of results, or {"error": ...} if it raised
SHOWN_COST_POINTS = (1, 2, 4, 8, 16, 17, 32)  # the cost curve's points `render_table` prints


def _to_json(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_json()
    if isinstance(value, BenchmarkConfig):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(item) for item in value]
    return value


@dataclass(kw_only=True)
class _Record:
    """A part of the report: its fields are its JSON keys; `extra` keeps the keys it does not model."""

    _optional: ClassVar[frozenset[str]] = frozenset()  # left out of the JSON when None (an older report lacks them)
    _readers: ClassVar[dict[str, Callable[[Any], Any]]] = {}  # field -> reader of its JSON value (nested parts)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        """The record from its JSON form; unknown keys go to `extra`."""
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {key: cls._readers.get(key, _same)(value) for key, value in data.items() if key in names}
        return cls(**known, extra={key: value for key, value in data.items() if key not in names})

    def to_json(self) -> dict[str, Any]:
        """The JSON form: every field (optional ones only when set), then `extra`."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "extra" and not (value is None and f.name in self._optional):
                out[f.name] = _to_json(value)
        return out | self.extra


def _same(value: Any) -> Any:
    return value


def _list_of(cls: type[_Record]) -> Callable[[list], list]:
    return lambda items: [cls.from_json(item) for item in items]


def _dict_of(cls: type[_Record]) -> Callable[[dict], dict]:
    return lambda items: {key: cls.from_json(item) for key, item in items.items()}


@dataclass(kw_only=True)
class SpeculativeStatsSummary(_Record):
    """A `speculative_generate` method's statistics over some prompts: tau and its histogram, drafted rounds, tree
    rounds and plain steps (first repeat), verified nodes per drafted round and draft / verify milliseconds per step
    (a drafted round or a plain step; all repeats)."""

    _optional = frozenset({"verify_over_bare_forward"})

    tau: float
    tau_histogram: list[int]
    rounds: int
    tree_rounds: int
    plain_steps: int
    draft_ms_per_step: float
    verify_ms_per_step: float
    verified_drafts_per_round: float
    # verify time (forward, inputs, acceptance, cache bookkeeping) over the bare forwards of the same token counts,
    # as the planner's costs measured them; None without measured costs
    verify_over_bare_forward: float | None = None


_SPECULATIVE_KEYS = tuple(f.name for f in fields(SpeculativeStatsSummary) if f.name != "extra")


@dataclass(kw_only=True)
class MethodSummary(_Record):
    """One method over a dataset's prompts: median tokens/s, the two speedups against the dataset's baseline (on the
    prompts both ran) and new tokens per target forward; `speculative` for `speculative_generate` methods."""

    prompts: int
    tokens_per_s: float | None
    speedup_ratio_of_medians: float | None
    speedup_median_of_ratios: float | None
    tokens_per_target_forward: float | None
    speculative: SpeculativeStatsSummary | None = None  # in the JSON: its keys beside the others

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MethodSummary:
        """The row; its speculative statistics are read from the keys beside the rates."""
        rest = {key: value for key, value in data.items() if key not in _SPECULATIVE_KEYS}
        row = super().from_json(rest)
        if "tau" in data:
            row.speculative = SpeculativeStatsSummary.from_json({k: data[k] for k in _SPECULATIVE_KEYS if k in data})
        return row

    def to_json(self) -> dict[str, Any]:
        """The row, with the speculative statistics' keys beside the rates."""
        out = super().to_json()
        speculative = out.pop("speculative", None)
        return out | (speculative or {})


@dataclass(kw_only=True)
class DatasetSummary(_Record):
    """A dataset's (or `"all"` prompts') rows: `baseline` is the faster plain variant there, `plain_tokens_per_s` the
    median rate of each plain variant."""

    _optional = frozenset({"baseline", "plain_tokens_per_s"})
    _readers = {"methods": _dict_of(MethodSummary)}

    baseline: str | None = None
    plain_tokens_per_s: dict[str, float | None] | None = None
    methods: dict[str, MethodSummary]


@dataclass(kw_only=True)
class PromptRun(_Record):
    """One method on one prompt: new tokens, target forwards, seconds of each repeat, tokens/s at the median time."""

    new_tokens: int
    target_forwards: int
    seconds: list[float]
    tokens_per_s: float
    tokens_per_target_forward: float


@dataclass(kw_only=True)
class PromptRecord(_Record):
    """A benchmarked prompt: its id, dataset, length and the methods it ran (all of them: `full_comparison`)."""

    id: str
    dataset: str
    prompt_tokens: int
    methods: list[str]
    full_comparison: bool


@dataclass(kw_only=True)
class Mismatch(_Record):
    """A run whose new tokens differ from the baseline's first run on the same prompt: where, and 5 tokens of each."""

    prompt_id: str
    method: str
    repeat: int
    first_difference: int
    expected_tokens: int
    got_tokens: int
    expected: list[int]
    got: list[int]


@dataclass(kw_only=True)
class DraftStepTime(_Record):
    """The median time of one draft step (forward + LM head) at a block size."""

    block_size: int
    draft_layers: int
    median_ms: float
    lm_head_median_ms: float
    repeats: int
    context_len: int


@dataclass(kw_only=True)
class BatchThroughput(_Record):
    """Batched `speculative_generate` against batched `target.generate` at one batch size."""

    _optional = frozenset(
        {"plain_tokens_per_s_by_kernels", "tau", "verified_drafts_per_round", "tree_rounds", "plain_steps"}
    )

    batch_size: int
    prompt_ids: list[str]
    plain_tokens_per_s: float
    plain_tokens_per_s_by_kernels: dict[str, float] | None = None
    ours_tokens_per_s: float
    speedup: float
    plain_new_tokens: int
    ours_new_tokens: int
    identical: bool
    tau: float | None = None
    verified_drafts_per_round: float | None = None
    tree_rounds: int | None = None
    plain_steps: int | None = None


@dataclass(kw_only=True)
class PeerRow(_Record):
    """A serving engine on one dataset's prompts, plain or with the drafter (`bench.peers`): the engine's own
    tokens/s (median over prompts), and for DFlash its mean accepted length and how many texts agree with its plain
    ones."""

    _optional = frozenset({"mean_accepted_length", "agrees_with_plain"})

    engine: str
    mode: str  # "plain" or "dflash"
    weights: str
    dataset: str
    prompts: int
    tokens_per_s: float
    mean_accepted_length: float | None = None
    agrees_with_plain: int | None = None


@dataclass(kw_only=True)
class SubBenchmarkError(_Record):
    """A sub-benchmark that raised, in its place in the report."""

    error: str


def _sub_benchmark(cls: type[_Record]) -> Callable[[Any], Any]:
    return lambda value: SubBenchmarkError.from_json(value) if isinstance(value, dict) else _list_of(cls)(value)


@dataclass(kw_only=True)
class Conditions(_Record):
    """Everything a number depends on besides the code: machine, threads, versions, dtypes, sizes, and the target's
    measured forward costs (seconds over 1 .. 32 new tokens, relative to one; with stock kernels too when the target
    was prepared). `extra` holds what a caller records beside them (the CLI: `command`, `draft_path`,
    `target_adapter`)."""

    _optional = frozenset(
        {
            "sampling",
            "target_forward_s",
            "target_forward_relative",
            "draft_forward_s",
            "draft_cost_relative",
            "verify_costs_relative",
            "cpu_kernels",
            "stock_target_forward_s",
            "stock_target_forward_relative",
        }
    )

    cpu: str
    cpu_count: int | None
    device: str
    gpu: str | None
    OMP_WAIT_POLICY: str | None  # noqa: N815 - the environment variable's name, as the JSON has always had it
    torch_threads: int
    python: str
    torch: str
    transformers: str
    hf_dflash: str
    target: str
    target_dtype: str
    draft_dtype: str
    draft_layers: int
    block_size: int
    max_new_tokens: int
    repeats: int
    do_sample: bool
    sampling: dict[str, float | int] | None = None  # temperature, top_p, top_k set for the run (else the target's)
    target_forward_s: list[float] | None = None
    target_forward_relative: list[float] | None = None
    draft_forward_s: float | None = None
    draft_cost_relative: float | None = None
    verify_costs_relative: list[float] | None = None  # what `ours` planned from, with `verify_costs="auto"`
    cpu_kernels: str | None = None
    stock_target_forward_s: list[float] | None = None
    stock_target_forward_relative: list[float] | None = None


def _config(data: dict[str, Any]) -> BenchmarkConfig:
    names = {f.name for f in fields(BenchmarkConfig)}
    return BenchmarkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names})


@dataclass(kw_only=True)
class BenchmarkReport(_Record):
    """The whole report of `run_benchmark`. `identical`: every path matched plain decoding (batched ones included) and
    nothing failed; `failures`: why not, one line each."""

    _optional = frozenset(
        {"baselines", "skipped_methods", "stock_differences", "draft_forward", "batch", "peers", "failures"}
    )
    _readers = {
        "conditions": Conditions.from_json,
        "config": _config,
        "prompts": _list_of(PromptRecord),
        "mismatches": _list_of(Mismatch),
        "stock_differences": _list_of(Mismatch),
        "datasets": _dict_of(DatasetSummary),
        "per_prompt": lambda table: {prompt: _dict_of(PromptRun)(runs) for prompt, runs in table.items()},
        "draft_forward": _sub_benchmark(DraftStepTime),
        "batch": _sub_benchmark(BatchThroughput),
        "peers": _sub_benchmark(PeerRow),
    }

    conditions: Conditions
    config: BenchmarkConfig
    methods: list[str]
    baselines: list[str] | None = None
    skipped_methods: dict[str, str] | None = None
    failed_methods: dict[str, str]
    prompts: list[PromptRecord]
    identity_checked: bool
    mismatches: list[Mismatch]
    stock_differences: list[Mismatch] | None = None  # plain_stock, plain_fast vs plain: other kernels' sums
    datasets: dict[str, DatasetSummary]
    per_prompt: dict[str, dict[str, PromptRun]]
    draft_forward: list[DraftStepTime] | SubBenchmarkError | None = None
    batch: list[BatchThroughput] | SubBenchmarkError | None = None
    peers: list[PeerRow] | SubBenchmarkError | None = None
    identical: bool = False
    failures: list[str] | None = None

    @classmethod
    def read(cls, path: str | os.PathLike) -> BenchmarkReport:
        """A report from its JSON file."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def batch_mismatches(report: BenchmarkReport) -> list[int]:
    """The batch sizes where batched `speculative_generate` differed from batched `target.generate` (greedy only)."""
    if not report.identity_checked or not isinstance(report.batch, list):
        return []
    return [r.batch_size for r in report.batch if not r.identical]


def failures(report: BenchmarkReport) -> list[str]:
    """Why a report does not pass, one line each: failed methods, outputs that differ from plain decoding (batched
    ones included) and sub-benchmarks that raised. Empty when every path ran and matched."""
    problems = [f"method {name!r} failed: {error}" for name, error in report.failed_methods.items()]
    if report.mismatches:
        problems.append(f"{len(report.mismatches)} output(s) differ from {BASELINE}")
    problems += [
        f"batch {size}: speculative_generate differs from target.generate" for size in batch_mismatches(report)
    ]
    problems += [
        f"{name} sub-benchmark failed: {getattr(report, name).error}"
        for name in SUB_BENCHMARKS
        if isinstance(getattr(report, name), SubBenchmarkError)
    ]
    return problems


def _fmt(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cost_curve(relative: list[float]) -> str:
    return ", ".join(f"{n}: {relative[n - 1]:.2f}" for n in SHOWN_COST_POINTS if n <= len(relative))


def _conditions_lines(report: BenchmarkReport) -> list[str]:
    c = report.conditions
    lines = [
        f"{c.target} ({c.target_dtype}) | draft {c.draft_layers} layer(s), block {c.block_size} | "
        f"max_new_tokens {c.max_new_tokens} | repeats {c.repeats} | {c.cpu} | "
        f"torch {c.torch} threads {c.torch_threads} | OMP_WAIT_POLICY={c.OMP_WAIT_POLICY}"
    ]
    if c.target_forward_relative is not None:
        lines.append(
            f"target forward over n tokens, x one token ({1000 * c.target_forward_s[0]:.1f} ms): "
            f"{_cost_curve(c.target_forward_relative)}; draft forward {c.draft_cost_relative:.2f}"
        )
    if c.stock_target_forward_relative is not None:
        lines.append(
            f"... with stock kernels ({1000 * c.stock_target_forward_s[0]:.1f} ms): "
            + _cost_curve(c.stock_target_forward_relative)
        )
    if c.cpu_kernels is not None:
        lines.append(f"CPU kernels: {c.cpu_kernels}")
    full = [p.id for p in report.prompts if p.full_comparison]
    if len(full) < len(report.prompts):
        core = report.config.core_methods or CORE_METHODS
        lines.append(
            f"every method ran on: {', '.join(full)}; the other prompts ran only {', '.join(core)} and every plain variant"
        )
    lines += [f"{name} left out: {reason}" for name, reason in (report.skipped_methods or {}).items()]
    return lines


def _dataset_lines(dataset: str, summary: DatasetSummary) -> list[str]:
    lines = [
        f"{dataset:10s} {method:16s} {row.prompts:7d} {_fmt(row.tokens_per_s, 1):>8s} "
        f"{_fmt(row.speedup_ratio_of_medians):>11s} {_fmt(row.speedup_median_of_ratios):>14s} "
        f"{_fmt(row.tokens_per_target_forward):>8s}"
        for method, row in summary.methods.items()
    ]
    rates = ", ".join(f"{name} {_fmt(rate, 1)}" for name, rate in (summary.plain_tokens_per_s or {}).items())
    lines.append(f"{dataset:10s} speedups vs {summary.baseline or BASELINE}, the faster plain ({rates} tok/s)")
    for method, row in summary.methods.items():
        if (s := row.speculative) is not None:
            lines.append(
                f"{dataset:10s} {method}: tau {s.tau:.2f}, histogram {s.tau_histogram}, "
                f"{s.verified_drafts_per_round:.2f} nodes verified per round, {s.tree_rounds} of "
                f"{s.rounds} rounds trees, {s.plain_steps} plain steps, draft "
                f"{s.draft_ms_per_step:.1f} + verify {s.verify_ms_per_step:.1f} ms/step"
                + (f" ({s.verify_over_bare_forward:.3f}x the bare forwards)" if s.verify_over_bare_forward else "")
            )
    return lines


def _sub_benchmark_lines(report: BenchmarkReport) -> list[str]:
    lines = []
    if isinstance(report.draft_forward, list):
        steps = ", ".join(
            f"B={r.block_size}: {r.median_ms:.2f} (head {r.lm_head_median_ms:.2f})" for r in report.draft_forward
        )
        lines += ["", f"draft step (forward + LM head), median ms: {steps}"]
    if isinstance(report.batch, list):
        lines.append("")
        for r in report.batch:
            lines.append(
                f"batch {r.batch_size}: plain {r.plain_tokens_per_s:.1f} tok/s, ours {r.ours_tokens_per_s:.1f} "
                f"tok/s, x{r.speedup:.2f}, tau {_fmt(r.tau)}, {r.tree_rounds} tree rounds, "
                f"{r.plain_steps} plain steps, identical {r.identical}"
            )
    if isinstance(report.peers, list):
        lines += ["", "serving engines on the same prompts (their own tok/s figure and weights):"]
        for r in report.peers:
            line = f"  {r.dataset:10s} {r.engine} {r.mode:6s} ({r.weights}): {r.tokens_per_s:.1f} tok/s"
            if r.mode == "dflash":
                line += f", accepted length {_fmt(r.mean_accepted_length)}, "
                line += f"text agrees with its plain on {r.agrees_with_plain}/{r.prompts}"
            lines.append(line)
    return lines


def _verdict_lines(report: BenchmarkReport) -> list[str]:
    lines = [""]
    if not report.identity_checked:
        lines.append("outputs not compared (sampling)")
    for method, count in Counter(m.method for m in report.stock_differences or []).items():
        lines.append(
            f"{method} differs from prepared plain on {count} prompt(s) (products summed in another order; not a failure)"
        )
    if report.mismatches:
        lines.append(f"OUTPUT MISMATCHES vs plain: {len(report.mismatches)}")
        lines += [f"  {m.to_json()}" for m in report.mismatches]
    problems = failures(report)
    if problems:
        lines.append(f"FAILED ({len(problems)}):")
        lines += [f"  {problem}" for problem in problems]
    elif report.identity_checked:
        batched = ", and every batch matched batched plain" if isinstance(report.batch, list) else ""
        lines.append(f"identical outputs: every method matched plain on all {len(report.prompts)} prompts{batched}")
    return lines


def render_table(report: BenchmarkReport) -> str:
    """The report as fixed-width text: the cost curve, per dataset and method (speedups vs the faster plain), each
    `speculative_generate` method's tau, nodes, tree rounds and plain steps, sub-benchmarks, identity verdict."""
    lines = _conditions_lines(report)
    header = f"{'dataset':10s} {'method':16s} {'prompts':>7s} {'tok/s':>8s} {'x (medians)':>11s} {'x (per-prompt)':>14s} {'tok/fwd':>8s}"
    lines += ["", header, "-" * len(header)]
    for dataset, summary in report.datasets.items():
        lines += _dataset_lines(dataset, summary)
    return "\n".join(lines + _sub_benchmark_lines(report) + _verdict_lines(report))


__all__ = [
    "BatchThroughput",
    "BenchmarkReport",
    "Conditions",
    "DatasetSummary",
    "DraftStepTime",
    "MethodSummary",
    "Mismatch",
    "PeerRow",
    "PromptRecord",
    "PromptRun",
    "SpeculativeStatsSummary",
    "SubBenchmarkError",
    "batch_mismatches",
    "failures",
    "render_table",
]
