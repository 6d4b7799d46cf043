"""What a prefill costs in exact CPU mode against fast mode: SmolLM2-135M-Instruct in bf16, one 200-token prompt of
random ids, median of 5 forwards after a warm-up, each into a fresh cache.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_exact_prefill.py --tokens 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from transformers.cache_utils import DynamicCache

from hf_dflash.decoding.cpu_kernels import optimize_for_cpu
from hf_dflash.targets import load_target


def prefill_seconds(target, ids: torch.LongTensor) -> float:
    cache = DynamicCache(config=target.config)
    start = time.perf_counter()
    target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def median_ms(target, ids: torch.LongTensor, repeats: int) -> float:
    prefill_seconds(target, ids)  # warm-up
    return 1000 * statistics.median(prefill_seconds(target, ids) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        preparation = optimize_for_cpu(target, exact=True)
        exact = median_ms(target, ids, args.repeats)
        preparation.undo()
        optimize_for_cpu(target, exact=False)
        fast = median_ms(target, ids, args.repeats)
    print(f"{args.tokens}-token prefill, median of {args.repeats}: exact {exact:.0f} ms, fast {fast:.0f} ms")


if __name__ == "__main__":
    main()
