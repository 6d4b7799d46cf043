"""What a target forward over more tokens costs on this CPU, with stock kernels and with `optimize_for_cpu` (fast and
exact): SmolLM2-135M's forward over 1..N new tokens after a 300-token cache (as `verify_costs="auto"` times it), in
float32 and bfloat16, plus whether the exact preparation's block forward equals one-token forwards bitwise. Where
exact mode finds no row-invariant kernel on this CPU, the setup is recorded as `unavailable`, with the reason.

Verifying k proposals pays only where a forward over k + 1 tokens costs little more than one token.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_forward_rows.py [--max_tokens 32] [--dtypes float32] [--output report.json]

The last line printed is the report as one JSON document.
"""

import argparse
import json
import os
import platform

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from transformers.cache_utils import DynamicCache

from hf_dflash import DFlashForDrafting
from hf_dflash.decoding.cpu_kernels import optimize_target_and_draft_for_cpu
from hf_dflash.decoding.policy import measure_verify_costs
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target

SETUPS = ("stock", "fast", "exact")


@torch.no_grad()
def block_equals_single_tokens(target, context: int = 300, new: int = 8) -> bool:
    """Whether one forward over `new` tokens gives the logits of `new` one-token forwards, bitwise."""
    ids = torch.randint(0, target.config.vocab_size, (1, context + new), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=target.config)
    target(input_ids=ids[:, :context], cache=cache, use_cache=True)
    block = target(input_ids=ids[:, context:], cache=cache, use_cache=True).logits
    cache.crop(-new)
    singles = [
        target(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(context, context + new)
    ]
    return torch.equal(block, torch.cat(singles, dim=1))


def measure(dtype: torch.dtype, setup: str, max_tokens: int) -> dict:
    target, _ = load_target("smollm2-135m-instruct", dtype=dtype)
    draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(dtype).eval()
    if setup != "stock":
        try:
            optimize_target_and_draft_for_cpu(target, draft, exact=setup == "exact")
        except RuntimeError as error:  # exact mode finds no row-invariant kernel for some weight on this CPU
            return {"unavailable": str(error)}
    costs = measure_verify_costs(target, draft, 1, context_length=300, repeats=7, max_tokens=max_tokens)
    return {
        "one_token_ms": round(1000 * costs.verify[0], 2),
        "relative": costs.relative(),
        "draft_ms": round(1000 * costs.draft, 2),
        "block_equals_single_tokens": block_equals_single_tokens(target),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--output", default=None, help="also write the JSON report here")
    args = parser.parse_args()
    report = {
        "conditions": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "processor": platform.processor() or platform.machine(),
            "context_tokens": 300,
        },
        "results": {},
    }
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for setup in args.setups:
            result = measure(dtype, setup, args.max_tokens)
            report["results"][f"{name}/{setup}"] = result
            if "unavailable" in result:
                print(f"{name:8s} {setup:5s} unavailable: {result['unavailable']}")
                continue
            shown = ", ".join(f"{n}: {r:.2f}x" for n, r in enumerate(result["relative"], 1) if n in (2, 4, 8, 16, 32))
            print(
                f"{name:8s} {setup:5s} one token {result['one_token_ms']:.1f} ms, draft {result['draft_ms']:.1f} ms; "
                f"{shown}; block == single tokens: {result['block_equals_single_tokens']}"
            )
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
