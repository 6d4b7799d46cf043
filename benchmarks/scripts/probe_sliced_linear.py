"""What a linear costs on a 3-D slice of hidden states against the same rows as a 2-D input, stock and packed, fp32 and
bf16, at the two heads the loops multiply by slices: the drafter's 8,192-row draft-vocabulary head over
`hidden[:, 1:8]` (`DFlashForDrafting.draft_logits`) and SmolLM2's 49,152-row head over `hidden[:, -1:]` (transformers'
`logits_to_keep` at prefill). Random weights of those shapes (the cost does not depend on the values); medians of
`--repeats` calls after a warm-up (`cpu_kernels.median_us`, as the kernel choice times), one process, nothing else
running.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_sliced_linear.py \
        --output benchmarks/results/probe_sliced_linear_xeon.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_dflash.bench.harness import cpu_model  # noqa: E402
from hf_dflash.decoding.cpu_kernels import (  # noqa: E402
    median_us,
    pack_weight,
    packed_kernels_available,
    packed_linear,
)

HIDDEN = 576  # SmolLM2-135M
CASES = {  # name: (head rows, positions in the hidden states, the slice the loop takes)
    "draft head, hidden[:, 1:8] of 8": (8192, 8, slice(1, 8)),
    "target head, hidden[:, -1:] of 200 (prefill)": (49152, 200, slice(-1, None)),
}


def packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, packed, None)


def measure(dtype: torch.dtype, repeats: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, (out_features, positions, taken) in CASES.items():
        weight = torch.randn(out_features, HIDDEN, generator=generator).to(dtype)
        hidden = torch.randn(1, positions, HIDDEN, generator=generator).to(dtype)
        sliced = hidden[:, taken]  # [1, n, H]: contiguous, strides not the default ones
        flat = sliced.reshape(-1, HIDDEN)  # [n, H]: a view
        row = {"case": name, "dtype": str(dtype), "rows": flat.shape[0], "strides": list(sliced.stride())}
        products = {"stock": (F.linear, weight)}
        if packed_kernels_available():
            products["packed"] = (packed_product, pack_weight(weight))
        for kernel, (product, operand) in products.items():
            for shape, x in (("3d_slice", sliced), ("2d_rows", flat)):
                run = functools.partial(product, x)  # run(operand): the product on x
                row[f"{kernel}_{shape}_ms"] = round(median_us(run, [operand], repeats) / 1000, 3)
        row["stock_slice_over_rows"] = round(row["stock_3d_slice_ms"] / row["stock_2d_rows_ms"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    results = [row for dtype in (torch.float32, torch.bfloat16) for row in measure(dtype, args.repeats)]
    conditions = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "command": " ".join(["python", *sys.argv]),
    }
    with open(args.output, "w", encoding="utf-8") as file:
        json.dump({"conditions": conditions, "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
