"""`hf-dflash bench`: time every decoding path on real prompts against the fastest plain decoding.

The flags become a `hf_dflash.bench.harness.BenchmarkConfig`; the harness runs it and this command writes the JSON
report (atomically) and its plot, prints the table, the failures and the report itself as the last line, and exits 1
when outputs differ or a run failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from .flags import (
    add_cpu_kernel_flag,
    add_draft_flags,
    add_target_flags,
    prepare_cpu_kernels,
    target_arguments,
    target_gguf,
)


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` command's parser to `subparsers` and return it."""
    from hf_dflash.bench.config import PEER_ENGINES

    parser = subparsers.add_parser(
        "bench",
        help="time every decoding path on real prompts against the fastest plain decoding; check identical outputs",
    )
    add_target_flags(parser)
    add_draft_flags(parser)
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=["gsm8k", "humaneval", "mt-bench"],
        help="prompt sets; NAME:N takes the first N prompts of NAME instead of --limit (e.g. mt-bench:10)",
    )
    parser.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    _add_method_flags(parser)
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--do_sample",
        action="store_true",
        help="sample (outputs are then not compared); adds ours_argmax, the draft's argmax proposed with a one-hot q",
    )
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10)
    parser.add_argument("--draft_block_sizes", nargs="*", type=int, default=[4, 8, 16], help="empty: skip")
    parser.add_argument(
        "--batch_sizes", nargs="*", type=int, default=[1, 4, 8], help="batched ours vs batched plain; empty: skip"
    )
    parser.add_argument(
        "--verify",
        choices=["auto", "all"],
        default="auto",
        help="`ours` and `assisted`: plan each round from the target's measured forward costs (auto: a tree, a chain "
        "or a plain step) or verify every proposal (all); ours_chain always plans from the measured costs",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=[],
        choices=PEER_ENGINES,
        help="serving engines also run on the prompts, plain and with the drafter (needs scripts/install_engines.sh, "
        "with --openvino for OpenVINO)",
    )
    parser.add_argument(
        "--peer_target_gguf",
        default=None,
        help="the target's GGUF for the llama.cpp peer (default for a packaged target: its package's GGUF)",
    )
    add_cpu_kernel_flag(parser)
    parser.add_argument("--output", default="bench.json", help="JSON report")
    parser.add_argument("--plot", default=None, help="PNG plot; default: next to --output")
    return parser


def _add_method_flags(parser: argparse.ArgumentParser) -> None:
    """Which decoding paths run, on how many prompts, and at which plain thread counts."""
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="subset of: plain prompt_lookup native assisted ours ours_chain ours_tree16 ours_full_block ours_argmax "
        "(default: all; ours_chain and ours_tree16 run greedy only, ours_argmax under --do_sample only)",
    )
    parser.add_argument("--full_comparison_limit", type=int, default=None, help="first M prompts of a dataset run all")
    parser.add_argument(
        "--core_methods",
        nargs="+",
        default=None,
        help="what prompts past --full_comparison_limit run (default: plain assisted ours; every plain variant runs "
        "on every prompt)",
    )
    parser.add_argument(
        "--plain_threads",
        nargs="*",
        type=int,
        default=[],
        metavar="N",
        help="also time plain generate at these torch thread counts (method plain_threadsN; the default count is "
        "`plain`); every speedup is against the faster plain of each dataset",
    )


def benchmark_config(args: argparse.Namespace):
    """The `BenchmarkConfig` the parsed flags describe (the harness's defaults where a flag is left out)."""
    from hf_dflash.bench.harness import BenchmarkConfig

    defaults = BenchmarkConfig()
    return BenchmarkConfig(
        datasets=tuple(args.datasets),
        limit=args.limit,
        methods=tuple(args.methods or defaults.methods),
        full_comparison_limit=args.full_comparison_limit,
        core_methods=tuple(args.core_methods or defaults.core_methods),
        plain_threads=tuple(args.plain_threads),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        do_sample=args.do_sample,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        draft_block_sizes=tuple(args.draft_block_sizes),
        batch_sizes=tuple(args.batch_sizes),
        verify_costs="auto" if args.verify == "auto" else None,
        peers=tuple(args.peers),
        peer_target_gguf=target_gguf(args.target, args.peer_target_gguf) if "llama.cpp" in args.peers else None,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, write its report and plot; 0 when every output matched and no run failed, else 1."""
    from hf_dflash import bench, loading
    from hf_dflash.atomic_files import write_text_atomic

    target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
    draft = loading.load_draft(args.draft, target, revision=args.draft_revision, base_draft=args.base_draft)
    preparation = prepare_cpu_kernels(args.cpu_kernels, target, draft)
    report = bench.run_benchmark(benchmark_config(args), target, tokenizer, draft, preparation=preparation)
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
