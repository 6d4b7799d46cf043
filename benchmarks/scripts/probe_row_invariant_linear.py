"""Microseconds per bf16 linear call of SmolLM2's weight shapes: oneDNN's packed kernel unpadded, the same in exact
mode's padded 16-row chunks, and the compiled row-invariant kernel, at 1 / 4 / 9 / 16 rows.

OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_row_invariant_linear.py

Each kernel cycles over 8 copies of a random weight (2 for the 49,152-row head), median of 5 passes.
"""

import functools
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash.decoding import cpu_kernels
from hf_dflash.decoding.compiled_kernels import compiled_linear

SHAPES = [(192, 576), (576, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = (1, 4, 9, 16)


def median_us(call, operands: list[torch.Tensor], repeats: int) -> float:
    call(operands[0])
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(repeats):
            call(operands[i % len(operands)])
        times.append((time.perf_counter() - start) / repeats * 1e6)
    return round(statistics.median(times), 1)


def times_at(x, out_features: int, onednn, compiled, chunked, repeats: int) -> dict[str, float]:
    """The three kernels' microseconds on input `x` `[rows, in]`."""
    rows = x.shape[0]
    padded = functools.partial(cpu_kernels.prepared_product, chunked)
    return {
        f"onednn_{rows}": median_us(lambda p: cpu_kernels.packed_linear(x, p, None), onednn, repeats),
        f"chunked_{rows}": median_us(
            lambda p: padded(lambda chunk: cpu_kernels.packed_linear(chunk, p, None), x), onednn, repeats
        ),
        f"compiled_{rows}": median_us(
            lambda p: cpu_kernels.row_invariant_linear(x, p, None, out_features), compiled, repeats
        ),
    }


def main() -> None:
    if compiled_linear() is None:
        raise SystemExit("the compiled row-invariant linear is not available here (see the warning above)")
    pack, _ = compiled_linear()
    chunked = cpu_kernels.LinearKernel((True,) * len(cpu_kernels.MEASURED_ROWS), chunk_rows=cpu_kernels.CHUNK_ROWS)
    print(f"torch threads: {torch.get_num_threads()}")
    for out_features, in_features in SHAPES:
        weights = [
            (torch.randn(out_features, in_features) * 0.05).bfloat16() for _ in range(2 if out_features > 10000 else 8)
        ]
        onednn = [cpu_kernels.pack_weight(w) for w in weights]
        compiled = [pack(w) for w in weights]
        repeats = 20 if out_features > 10000 else 100
        row = {}
        for rows in ROWS:
            x = torch.randn(rows, in_features).bfloat16()
            row |= times_at(x, out_features, onednn, compiled, chunked, repeats)
        print((out_features, in_features), row, flush=True)


if __name__ == "__main__":
    main()
