"""`ours` planning with its learned round overhead against the same measured costs without it, beside plain decoding.

OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_round_overhead.py \
    --datasets gsm8k:10 [--do_sample --temperature 0.7 --top_p 0.95 --top_k 0] --output report.json

`ours` plans with the benchmark's measured costs and learns what its rounds spend beside them (`RoundOverhead`);
`ours_forwards_only` gets the same `VerifyCosts` object as fixed costs (`VerifyPlanner(costs=...)`), so it plans from
the forwards alone. Both run through `run_benchmark` on the same prompts, alternated, with the usual baselines
(`--plain_threads` included), identity checks and per-round statistics; the fits the planner learned are added to
the report's conditions (`round_overhead_ms`: fixed and per-node milliseconds per decoding path).
"""

import argparse
import functools
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash import bench, loading
from hf_dflash.atomic_files import write_text_atomic
from hf_dflash.bench.config import BenchmarkConfig
from hf_dflash.bench.methods import _ours, benchmark_verify_costs, default_methods
from hf_dflash.cli.flags import prepare_cpu_kernels
from hf_dflash.decoding.policy import VerifyPlanner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cpu_kernels", default="exact", choices=["off", "fast", "exact"])
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:10"])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--plain_threads", nargs="*", type=int, default=[])
    parser.add_argument("--do_sample", action="store_true")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top_p", type=float)
    parser.add_argument("--top_k", type=int)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    target, tokenizer = loading.load_target_and_tokenizer("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    draft = loading.load_draft(args.draft, target)
    preparation = prepare_cpu_kernels(args.cpu_kernels, target, draft)
    planner = VerifyPlanner()
    fixed = VerifyPlanner(costs=benchmark_verify_costs(target, draft, planner))  # the very object `ours` plans from
    methods = default_methods(planner=planner) | {
        "ours_forwards_only": functools.partial(_ours, planner=fixed, costed=True)
    }
    config = BenchmarkConfig(
        datasets=tuple(args.datasets),
        max_new_tokens=args.max_new_tokens,
        methods=("ours", "ours_forwards_only"),
        plain_threads=tuple(args.plain_threads),
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        draft_block_sizes=(),
        batch_sizes=(),
    )
    report = bench.run_benchmark(
        config, target, tokenizer, draft, methods=methods, preparation=preparation, planner=planner
    )
    report.conditions.target = "smollm2-135m-instruct"
    report.conditions.extra |= {
        "command": "python " + " ".join(sys.argv),
        "draft_path": args.draft,
        "round_overhead_ms": {
            path: [round(1000 * seconds, 3) for seconds in overhead.fixed_and_per_node]
            for (path, _), overhead in planner._overheads.items()
        },
    }
    write_text_atomic(args.output, json.dumps(report.to_json(), indent=1) + "\n")
    print(bench.render_table(report))
    print(json.dumps(report.conditions.extra["round_overhead_ms"]))


if __name__ == "__main__":
    main()
