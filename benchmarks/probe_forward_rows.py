"""What a target forward over more tokens costs on this CPU, and how much of it is the matrix products: SmolLM2-135M's
forward over 1..8 new tokens after a 256-token cache (as `verify_costs="auto"` times it), and its MLP's two matrix
products alone at 1, 2, 4 and 8 rows, each in float32 and bfloat16, then plain decoding's speed in each dtype.

Verifying k proposals pays only where a forward over k + 1 tokens costs little more than one; this splits that cost
into the products (the BLAS library's kernels for the CPU at hand) and the rest.

OMP_WAIT_POLICY=PASSIVE python benchmarks/probe_forward_rows.py
"""

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.nn.functional as F

from hf_dflash import DFlashForDrafting
from hf_dflash.benchmark import load_benchmark_prompts, median
from hf_dflash.cli import committed_drafter
from hf_dflash.targets import load_target
from hf_dflash.verify_policy import measure_verify_costs

ROWS = (1, 2, 4, 8)


def median_seconds(run, repeats: int = 200) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return median(times)


def matmul_costs(dtype: torch.dtype, hidden: int = 576, intermediate: int = 1536) -> dict[int, float]:
    """Microseconds of the MLP's up and down products at each row count."""
    up, down = torch.randn(intermediate, hidden, dtype=dtype), torch.randn(hidden, intermediate, dtype=dtype)
    costs = {}
    for rows in ROWS:
        x, h = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, intermediate, dtype=dtype)
        costs[rows] = 1e6 * median_seconds(lambda x=x, h=h: (F.linear(x, up), F.linear(h, down)))
    return costs


def plain_tokens_per_second(target, prompts, max_new_tokens: int = 64) -> float:
    new, seconds = 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        with torch.no_grad():
            out = target.generate(prompt.input_ids[None], max_new_tokens=max_new_tokens, do_sample=False)
        seconds += time.perf_counter() - start
        new += out.shape[1] - prompt.input_ids.shape[0]
    return new / seconds


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    for dtype in (torch.float32, torch.bfloat16):
        target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
        draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(dtype).eval()
        with torch.no_grad():
            costs = measure_verify_costs(target, draft, 1, repeats=9, max_tokens=8)
        one = costs.verify[0]
        products = matmul_costs(dtype)
        prompts = load_benchmark_prompts(tokenizer, ["gsm8k"], 2)
        speed = plain_tokens_per_second(target, prompts)
        print(f"\n{str(dtype).removeprefix('torch.')}: plain decoding {speed:.1f} tok/s")
        print("  forward over n tokens, ms (x one token):", end="")
        print(", ".join(f" {n}: {1000 * t:.1f} ({t / one:.2f}x)" for n, t in enumerate(costs.verify, start=1)))
        print("  MLP products at n rows, us (x one row):", end="")
        print(", ".join(f" {n}: {t:.0f} ({t / products[1]:.2f}x)" for n, t in products.items()))


if __name__ == "__main__":
    main()
