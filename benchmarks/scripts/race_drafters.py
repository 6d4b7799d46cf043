"""Two drafters of one target timed in one benchmark run: which one makes the target faster on this machine.

`compare_drafters.py` settles which drafter the target accepts more of; speed also depends on what a draft step
costs and on how the round planner uses each drafter's probabilities. Timed in two separate `hf-dflash bench` runs,
two drafters a few percent apart cannot be told apart on a machine whose speed drifts between runs. Here one run of
the bench harness times plain decoding (every plain variant, the fastest is the baseline), `ours` with the current
drafter and `ours_candidate` with the candidate, rotated per prompt, so drift hits all alike. Each drafter plans from
its own `VerifyPlanner` (its own measured draft cost) and is prepared for the CPU as `hf-dflash bench` prepares one;
every greedy output must equal plain decoding's. The report is `hf-dflash bench`'s, with the candidate's path in its
conditions.

    OMP_NUM_THREADS=1 python benchmarks/scripts/race_drafters.py --current drafters/smollm2-135m-instruct \
        --candidate drafters/smollm2-135m-instruct-dflash2 --datasets gsm8k:50 humaneval:50 mt-bench:10 \
        --max_new_tokens 128 --output race.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash import bench, loading  # noqa: E402
from hf_dflash.atomic_files import write_text_atomic  # noqa: E402
from hf_dflash.bench.config import BenchmarkConfig  # noqa: E402
from hf_dflash.bench.methods import default_methods  # noqa: E402
from hf_dflash.decoding.cpu_kernels import optimize_draft_for_cpu, optimize_target_and_draft_for_cpu  # noqa: E402
from hf_dflash.decoding.policy import VerifyPlanner  # noqa: E402

CANDIDATE = "ours_candidate"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--current", required=True, help="the drafter `ours` runs")
    parser.add_argument("--candidate", required=True, help="the drafter `ours_candidate` runs")
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:10", "humaneval:10", "mt-bench:6"])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cpu_kernels", default="exact", choices=["exact", "fast"])
    parser.add_argument("--output", required=True, help="the JSON report")
    return parser.parse_args(argv)


def candidate_method(candidate: torch.nn.Module, planner: VerifyPlanner):
    """`ours` with `candidate` in place of the harness's drafter, planning from its own planner."""
    ours = default_methods(planner=planner)["ours"]

    def run(target, _current, input_ids, attention_mask, **generation_kwargs):
        return ours(target, candidate, input_ids, attention_mask, **generation_kwargs)

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target, tokenizer = loading.load_target_and_tokenizer(args.target, dtype=getattr(torch, args.dtype))
    current = loading.load_draft(args.current, target)
    candidate = loading.load_draft(args.candidate, target)
    preparation = optimize_target_and_draft_for_cpu(target, current, exact=args.cpu_kernels == "exact")
    optimize_draft_for_cpu(candidate, target, preparation.choices)
    config = BenchmarkConfig(
        datasets=tuple(args.datasets),
        max_new_tokens=args.max_new_tokens,
        methods=("plain", "ours", CANDIDATE),
        batch_sizes=(),
        draft_block_sizes=(),
        verify_costs="auto",
    )
    planner = VerifyPlanner()
    methods = default_methods(planner=planner) | {CANDIDATE: candidate_method(candidate, VerifyPlanner())}
    report = bench.run_benchmark(
        config, target, tokenizer, current, methods=methods, preparation=preparation, planner=planner
    )
    report.conditions.target = args.target
    report.conditions.extra |= {
        "command": "python benchmarks/scripts/race_drafters.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "draft_path": args.current,
        "candidate_path": args.candidate,
    }
    output = write_text_atomic(args.output, json.dumps(report.to_json(), indent=1) + "\n")
    print(bench.render_table(report))
    print(f"report: {output}")
    for failure in report.failures:
        print(f"race_drafters: FAILED: {failure}", file=sys.stderr)
    return 0 if report.identical and not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
