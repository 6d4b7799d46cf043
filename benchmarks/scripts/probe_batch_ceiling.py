"""How fast speculative decoding can be at batch b on this CPU, from what the drafter accepts and what forwards cost.

A batched round drafts every row's block and verifies `[b, k + 1]` tokens in one forward; batched plain decoding
takes one `[b, 1]` forward a token. With the drafter's chain acceptance `reach_j = P(a row accepts at least j
proposals)` (measured along greedy chains verified whole, batch 1: acceptance does not depend on the batch) and the
bare forward costs at batch b (`measure_verify_costs`), the best a chain of k can do is

    speedup(b, k) = (1 + sum_{j <= k} reach_j) * verify_b(1) / (draft_b + verify_b(k + 1)),

every row verifying k proposals (a batch's forward is one rectangle), no loop overhead, no cache holes from ragged
acceptance, no early-finished rows: an upper bound for chains. The report gives it for each b and k, and the best k.

Forward times on a shared machine come in slow phases (the same `[4, 1]` forward took 29 to 55 ms within a minute on
the EPYC this was written on), and noise only ever adds time: each cost is the minimum over `--passes` independent
`measure_verify_costs` calls of one timed pass each, so a slow phase during some sizes does not bend the curve.

OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python benchmarks/scripts/probe_batch_ceiling.py --batch_sizes 1 4 8 \
    --prompts 6 --output benchmarks/results/batch_ceiling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash import DFlashForDrafting
from hf_dflash.bench.harness import load_benchmark_prompts
from hf_dflash.decoding.cpu_kernels import optimize_target_and_draft_for_cpu
from hf_dflash.decoding.policy import VerifyCosts, measure_verify_costs
from hf_dflash.decoding.speculative import speculative_generate
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target


def chain_reach(target, draft, prompts, max_new_tokens: int) -> list[float]:
    """`reach[j - 1]` = the share of rounds that accepted at least j proposals, j = 1 .. B - 1 (whole chains
    verified, greedy)."""
    lengths = []
    for prompt in prompts:
        out = speculative_generate(
            target, draft, prompt.input_ids[None], max_new_tokens=max_new_tokens, tree=False, optimize_cpu=False
        )
        lengths += out.stats.acceptance_lengths  # tokens committed a round: accepted proposals + 1
    block = draft.config.block_size
    return [sum(n > j for n in lengths) / len(lengths) for j in range(1, block)]


def ceilings(reach: list[float], verify: tuple[float, ...], draft: float) -> list[float]:
    """`speedup(b, k)` for k = 1 .. len(verify) - 1 (see the module docstring)."""
    return [(1 + sum(reach[:k])) * verify[0] / (draft + verify[k]) for k in range(1, min(len(verify), len(reach) + 1))]


def quiet_costs(target, draft, batch: int, context: int, passes: int) -> VerifyCosts:
    """Each forward's and the draft's least time over `passes` calls of `measure_verify_costs` (one timed pass each)."""
    runs = [measure_verify_costs(target, draft, batch, context_length=context, repeats=1) for _ in range(passes)]
    verify = tuple(min(costs) for costs in zip(*(run.verify for run in runs)))
    return VerifyCosts(verify=verify, draft=min(run.draft for run in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval"])
    parser.add_argument("--prompts", type=int, default=6, help="prompts a dataset for the acceptance")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the timed forwards")
    parser.add_argument("--passes", type=int, default=9, help="timed passes; each cost is their minimum")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(torch.bfloat16).eval()
    optimize_target_and_draft_for_cpu(target, draft, exact=True)
    prompts = load_benchmark_prompts(tokenizer, [f"{name}:{args.prompts}" for name in args.datasets], None)
    reach = chain_reach(target, draft, prompts, args.max_new_tokens)
    report = {
        "conditions": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
            "dtype": "bfloat16",
            "kernels": "exact",
            "context_tokens": args.context,
            "datasets": args.datasets,
            "prompts_per_dataset": args.prompts,
            "timing": f"each cost the minimum of {args.passes} passes",
        },
        "reach": [round(r, 4) for r in reach],
        "batches": {},
    }
    print("reach (P(at least j accepted), j = 1 ..):", report["reach"])
    with torch.no_grad():
        for batch in args.batch_sizes:
            costs = quiet_costs(target, draft, batch, args.context, args.passes)
            speedups = ceilings(reach, costs.verify, costs.draft)
            best = max(range(len(speedups)), key=speedups.__getitem__)
            report["batches"][str(batch)] = {
                "verify_ms": [round(1000 * cost, 2) for cost in costs.verify],
                "draft_ms": round(1000 * costs.draft, 2),
                "speedup_by_k": [round(s, 3) for s in speedups],
                "best_k": best + 1,
                "ceiling": round(speedups[best], 3),
            }
            print(
                f"batch {batch}: ceiling {speedups[best]:.3f}x at k = {best + 1}; by k {report['batches'][str(batch)]['speedup_by_k']}"
            )
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
