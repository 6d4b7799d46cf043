"""Plain decoding and target forward costs at 1 and 2 torch threads (alternated), first GSM8K prompts.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_threads.py --dtype bfloat16 --cpu_kernels exact

The counts alternate over `--rounds` rounds, the target prepared afresh at each (`optimize_for_cpu` chooses its
kernels per thread count); medians of ms per new token of plain decoding and of the target's verify cost curve over
1-17 tokens (`measure_verify_costs`, which also times the committed drafter's forward).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash import DFlashForDrafting, optimize_for_cpu
from hf_dflash.bench.harness import load_benchmark_prompts
from hf_dflash.decoding.cpu_kernels import KernelChoices
from hf_dflash.decoding.policy import measure_verify_costs
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--cpu_kernels", choices=["stock", "fast", "exact"], default="fast")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
    draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(dtype).eval()
    prompts = load_benchmark_prompts(tokenizer, ["gsm8k"], args.prompts)
    choices = KernelChoices()  # kernel choices per weight shape and thread count, measured once each
    ms_per_token: dict[int, list[float]] = {1: [], 2: []}
    verify_ms: dict[int, list[list[float]]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            preparation = None
            if args.cpu_kernels != "stock":
                preparation = optimize_for_cpu(target, exact=args.cpu_kernels == "exact", choices=choices)
            for prompt in prompts:
                start = time.perf_counter()
                with torch.no_grad():
                    out = target.generate(prompt.input_ids[None], max_new_tokens=args.max_new_tokens, do_sample=False)
                new_tokens = out.shape[1] - prompt.input_ids.shape[0]
                ms_per_token[threads].append(1000 * (time.perf_counter() - start) / new_tokens)
            costs = measure_verify_costs(target, draft, 1, max_tokens=17)
            verify_ms[threads].append([1000 * cost for cost in costs.verify])
            if preparation is not None:
                preparation.undo()
    for threads in (1, 2):
        curve = [round(statistics.median(column), 1) for column in zip(*verify_ms[threads])]
        print(
            f"{threads} thread(s), {args.dtype} {args.cpu_kernels}: plain {statistics.median(ms_per_token[threads]):.1f} "
            f"ms/token; verify ms over 1..17 tokens {curve}",
            flush=True,
        )


if __name__ == "__main__":
    main()
