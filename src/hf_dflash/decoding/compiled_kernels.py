"""hf-dflash's compiled CPU kernels, built once per machine with torch's C++ extension loader, then loaded from its
cache (`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`). Exact mode's two, built together:

- the row-invariant attention (`row_invariant_attention.cpp`) computes each output row from its query and its allowed
  keys in one fixed order, as the module docstring of `hf_dflash.decoding.cpu_attention` asks, without the pure-torch
  version's gathers and many small products (a one-token fp32 step of SmolLM2 on the Xeon,
  `benchmarks/scripts/probe_forward_rows.py`: exact mode 71.3 ms with that version against 42.4 in fast mode, 43.1
  with this kernel against 33.5 in a later run);
- the row-invariant bf16 linear (`row_invariant_linear.cpp`, on CPUs with AVX512-BF16) sums each output element in
  one fixed order whatever the row count, so exact mode's bf16 products need no padding to a fixed row count
  (`hf_dflash.decoding.cpu_kernels`).

And, built on its own (a sampling user in fast mode waits for no exact kernel), the radix sort of a row's float32
values (`sorted_values.cpp`) that sampling's top-p warper `TopPBySortedValues` sorts with: the same sorted values as
NumPy's sort, about 0.2 against 1.0 ms a row of SmolLM2's 49,152 tokens on one Zen 4 core.

Building needs a C++ compiler and `ninja`; where either is missing, `compiled_attention()`, `compiled_linear()` and
`compiled_sort()` return `None` and say why once, and exact mode uses the pure-torch attention and the padded
products, the warper NumPy's sort.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# each group of sources is one build, loaded on first use
SOURCES = {
    "row_invariant": [
        Path(__file__).with_name(name) for name in ("row_invariant_attention.cpp", "row_invariant_linear.cpp")
    ],
    "sort": [Path(__file__).with_name("sorted_values.cpp")],
}
# No FP contraction: a fused multiply-add rounds once where a product and a sum round twice, and the compiler may fuse
# in one copy of a loop (vectorized) and not in another (its remainder). No trapping math: lets GCC vectorize floor()
# (values are unchanged; FP exceptions are not trapped anyway).
COMPILER_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math"]


def _build_name(group: str) -> str:
    """One build per group's sources, flags, torch version and CPU (`-march=native` code runs only where it was
    built: a home directory shared by machines of different CPUs keeps one build each)."""
    settings = f"{torch.__version__}:{_cpu_features()}:{' '.join(COMPILER_FLAGS)}"
    sources = b"".join(source.read_bytes() for source in SOURCES[group])
    digest = hashlib.sha256(sources + settings.encode()).hexdigest()[:12]
    return f"hf_dflash_{group}_kernels_{digest}"


def _cpu_features() -> str:
    """The CPU's instruction-set flags where Linux lists them, else torch's CPU capability (AVX2, AVX512, ...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _missing_tools() -> str | None:
    """Why the kernel cannot be built here, or None."""
    if sys.platform == "win32":
        return "the build flags are GCC/Clang's, and this is Windows"
    compiler = next((name for name in ("c++", "g++", "clang++") if shutil.which(name)), None)
    if compiler is None:
        return "no C++ compiler (c++, g++ or clang++) is on the PATH; install one (e.g. `apt install g++`)"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed; `pip install ninja`"
    return None


@functools.cache
def _built(group: str) -> str | None:
    """Build (exact mode's about a minute on 2 cores) and load a group's kernels on first use; `None`, or why they
    are not there."""
    reason = _missing_tools()
    if reason is not None:
        return reason
    try:
        from torch.utils.cpp_extension import load

        load(
            name=_build_name(group),
            sources=[str(source) for source in SOURCES[group]],
            extra_cflags=COMPILER_FLAGS,
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as error:  # a failed compile or link
        return f"building them failed ({str(error).strip().splitlines()[-1]})"
    return None


@functools.cache
def compiled_attention() -> Callable[..., torch.Tensor] | None:
    """`torch.ops.hf_dflash.row_invariant_attention`, or None (logged once, with the fix) where it cannot be built."""
    reason = _built("row_invariant")
    if reason is None:
        return torch.ops.hf_dflash.row_invariant_attention
    logger.warning(
        f"Exact CPU attention: the compiled kernel is not available because {reason}. Using the pure-torch version, "
        "which gives the same guarantee at a much higher cost per forward."
    )
    return None


@functools.cache
def compiled_linear() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """`(pack, linear)`: `torch.ops.hf_dflash.pack_row_invariant_linear` (`[N, K]` bf16 -> the kernel's layout) and
    `row_invariant_linear(x [M, K], packed, bias, N)`, or None (logged once) where they cannot be built or this CPU
    has no AVX512-BF16 (the source then registers neither)."""
    reason = _built("row_invariant")
    if reason is None and not hasattr(torch.ops.hf_dflash, "row_invariant_linear"):
        reason = "this CPU has no AVX512-BF16 (it was built without it)"
    if reason is None:
        return torch.ops.hf_dflash.pack_row_invariant_linear, torch.ops.hf_dflash.row_invariant_linear
    logger.warning(
        f"Exact CPU products: the compiled row-invariant bf16 linear is not available because {reason}. bf16 products "
        "run in padded chunks of 16 rows instead, which gives the same guarantee at a higher cost per 1-row step."
    )
    return None


@functools.cache
def compiled_sort() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`torch.ops.hf_dflash.sorted_values` (`[n, V]` float32 -> each row's values ascending), or None (logged once)
    where it cannot be built."""
    reason = _built("sort")
    if reason is None:
        return torch.ops.hf_dflash.sorted_values
    logger.warning(
        f"Top-p sampling on the CPU: the compiled sort is not available because {reason}. Using NumPy's sort, which "
        "gives the same result at about 1 ms more a warped row."
    )
    return None


__all__ = ["compiled_attention", "compiled_linear", "compiled_sort"]
