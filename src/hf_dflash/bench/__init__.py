"""`hf-dflash bench`: every decoding path timed on real prompts and checked against plain decoding.

The modules, by job: `config` (method names, `BenchmarkConfig`), `methods` (the decoding paths compared),
`statistics` (medians, speedups, summaries), `harness` (`run_benchmark`: prompts, warm-up, timed runs, batched
throughput), `draft_step` (the draft's step time), `report` (the report's dataclasses, their JSON form,
`render_table`, `failures`), `plot` (`save_plot`), `paths` (one prompt by the three paths, what `hf-dflash demo`
shows) and `peers` (serving engines on the same prompts, plain and with the drafter).
"""

from hf_dflash.lazy_names import lazy_names

# The public names by module, imported on first use (PEP 562): `hf-dflash bench --help` reads `config`'s defaults
# and method names without importing the harness (and torch).
_MODULES = {
    "hf_dflash.bench.config": ("ALL_METHODS", "BenchmarkConfig", "BenchmarkPrompt"),
    "hf_dflash.bench.harness": ("load_benchmark_prompts", "measure_batch_throughput", "run_benchmark"),
    "hf_dflash.bench.methods": ("default_methods", "plain_thread_methods", "plain_threads_name"),
    "hf_dflash.bench.paths": ("PathComparison", "compare_decoding_paths"),
    "hf_dflash.bench.plot": ("save_plot",),
    "hf_dflash.bench.report": (
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
    "hf_dflash.bench.statistics": ("median",),
}
__getattr__, __dir__, __all__ = lazy_names(__name__, _MODULES, globals())
