"""The report as a PNG: bars of median tokens/s per method per dataset, and the speedup (ratio of medians).

Design: matplotlib's Agg canvas on a `Figure` (no pyplot state, no display), imported on call so that the harness
runs without matplotlib.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_dflash.bench.report import BenchmarkReport


def measured_methods(report: BenchmarkReport) -> list[str]:
    """The report's methods that measured tokens/s on at least one dataset (a method skipped for every prompt, as
    the full comparison's are past `--full_comparison_limit 0`, gets no bar and no legend entry)."""
    return [
        method
        for method in report.methods
        if any(
            (row := summary.methods.get(method)) is not None and row.tokens_per_s
            for summary in report.datasets.values()
        )
    ]


def save_plot(report: BenchmarkReport, path: str | os.PathLike) -> Path:
    """Bars of median tokens/s per method per dataset, and the speedup (ratio of medians), as a PNG at `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    datasets = list(report.datasets)
    methods = measured_methods(report)
    figure = Figure(figsize=(max(6, 1.8 * len(datasets) + 3), 7), layout="constrained")
    FigureCanvasAgg(figure)
    rate_axes, speed_axes = figure.subplots(2, 1, sharex=True)
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        rows = [report.datasets[d].methods.get(method) for d in datasets]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        rate_axes.bar(xs, [(r and r.tokens_per_s) or 0 for r in rows], width, label=method)
        speed_axes.bar(xs, [(r and r.speedup_ratio_of_medians) or 0 for r in rows], width, label=method)
    rate_axes.set_ylabel("tokens/s (median)")
    c = report.conditions
    title = f"{Path(str(c.target)).name}, block {c.block_size}, {c.max_new_tokens} new tokens\n{c.cpu}"
    figure.suptitle(title, fontsize=9)
    figure.legend(*rate_axes.get_legend_handles_labels(), loc="outside lower center", ncols=min(len(methods), 5))
    speed_axes.axhline(1.0, color="grey", linewidth=0.8)
    speed_axes.set_ylabel("speedup vs the faster plain (ratio of medians)")
    speed_axes.set_xticks(range(len(datasets)), datasets)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
