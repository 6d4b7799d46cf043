"""`hf-dflash bench`: every decoding path timed on real prompts and checked against plain decoding.

The modules, by job: `config` (method names, `BenchmarkConfig`), `methods` (the decoding paths compared),
`statistics` (medians, speedups, summaries), `harness` (`run_benchmark`: prompts, warm-up, timed runs, batched
throughput), `draft_step` (the draft's step time), `report` (the report's dataclasses, their JSON form,
`render_table`, `failures`), `plot` (`save_plot`), `paths` (one prompt by the three paths, what `hf-dflash demo`
shows) and `peers` (serving engines on the same prompts, plain and with the drafter).
"""

from hf_dflash.bench.config import ALL_METHODS, BenchmarkConfig, BenchmarkPrompt
from hf_dflash.bench.harness import load_benchmark_prompts, measure_batch_throughput, run_benchmark
from hf_dflash.bench.methods import default_methods, plain_thread_methods, plain_threads_name
from hf_dflash.bench.paths import PathComparison, compare_decoding_paths
from hf_dflash.bench.plot import save_plot
from hf_dflash.bench.report import (
    BatchThroughput,
    BenchmarkReport,
    Conditions,
    DatasetSummary,
    DraftStepTime,
    MethodSummary,
    Mismatch,
    PeerRow,
    PromptRecord,
    PromptRun,
    SpeculativeStatsSummary,
    SubBenchmarkError,
    failures,
    render_table,
)
from hf_dflash.bench.statistics import median

__all__ = [
    "ALL_METHODS",
    "BatchThroughput",
    "BenchmarkConfig",
    "BenchmarkPrompt",
    "BenchmarkReport",
    "Conditions",
    "DatasetSummary",
    "DraftStepTime",
    "MethodSummary",
    "Mismatch",
    "PathComparison",
    "PeerRow",
    "PromptRecord",
    "PromptRun",
    "SpeculativeStatsSummary",
    "SubBenchmarkError",
    "compare_decoding_paths",
    "default_methods",
    "failures",
    "load_benchmark_prompts",
    "measure_batch_throughput",
    "median",
    "plain_thread_methods",
    "plain_threads_name",
    "render_table",
    "run_benchmark",
    "save_plot",
]
