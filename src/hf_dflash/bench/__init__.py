"""`hf-dflash bench`: every decoding path timed on real prompts and checked against plain decoding.

The modules, by job: `config` (method names, `BenchmarkConfig`), `methods` (the decoding paths compared),
`statistics` (medians, speedups, summaries), `harness` (`run_benchmark`: prompts, warm-up, timed runs, batched
throughput), `draft_step` (the draft's step time), `report` (the report's dataclasses, their JSON form,
`render_table`, `failures`), `plot` (`save_plot`), `paths` (one prompt by the three paths, what `hf-dflash demo`
shows) and `peers` (serving engines on the same prompts, plain and with the drafter).
"""

import importlib
from typing import Any

# The public names by module, imported on first use (PEP 562): `hf-dflash bench --help` reads `config`'s defaults
# and method names without importing the harness (and torch).
_MODULES = {
    "config": ("ALL_METHODS", "BenchmarkConfig", "BenchmarkPrompt"),
    "harness": ("load_benchmark_prompts", "measure_batch_throughput", "run_benchmark"),
    "methods": ("default_methods", "plain_thread_methods", "plain_threads_name"),
    "paths": ("PathComparison", "compare_decoding_paths"),
    "plot": ("save_plot",),
    "report": (
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
        "failures",
        "render_table",
    ),
    "statistics": ("median",),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'hf_dflash.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hf_dflash.bench.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


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
