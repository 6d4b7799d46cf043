"""CPU kernels that make a forward over a block cost little more than one token, and optionally give it exactly the
same per-token logits.

On x86 CPUs torch sends an fp32 `F.linear` to MKL's sgemm, whose small-M kernels (2-16 rows) cost 2-4x the 1-row
product, so verifying a block of drafts costs 1.7-2.4x a plain decoding step (SmolLM2-135M, 2 cores) and
speculative decoding buys nothing. torch's own oneDNN ops with a prepacked weight
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, what inductor emits for frozen CPU linears) cost
about what the 1-row product costs up to about 8 rows (16 on AVX-512), when the weights come from memory.

`optimize_for_cpu(model)` swaps the class of every CPU `nn.Linear` (PEFT's LoRA base layers included) for
`PreparedLinear`, which routes each call to the stock or the packed kernel by its row count, as measured once per
weight shape on the running CPU (`KernelChoices`), or in bf16 every call to exact mode's compiled kernel (below) where
that is at least as fast at every measured row count. Parameters are not touched: `state_dict()` and
`save_pretrained()` write the original weights, linears that share a weight (a tied head used by target and drafter)
share one packed copy, a weight changed in place (training, a merged adapter) is packed again, and
`CPUPreparation.undo()` restores the stock modules. A model on transformers' default `sdpa` attention also switches to
`"sdpa_gqa"` (`hf_dflash.decoding.cpu_attention`), which skips the key/value head copies sdpa makes for multi-token forwards.
Accelerator models are left as they are.

With `exact=True` a forward over `k` tokens gives per-token logits bitwise equal to `k` one-token forwards of the same
prepared model, so greedy speculative decoding is token-identical to plain decoding in any dtype:

- every linear uses one kernel for every row count, a kernel checked to be row-invariant on this CPU for that shape
  (a row's result does not depend on how many rows share the call), and a 1-row input is padded to 2 rows (the
  1-row kernels are gemv-like and sum in another order); where no kernel is, and always in bf16 and fp16 (whose
  rounded outputs hide summation-order differences from such a check: `always_chunked`), every product runs in
  fixed chunks of `CHUNK_ROWS` rows (the last one padded with zeros), checked the same way; a bf16 linear may instead
  run the compiled row-invariant kernel (`hf_dflash.decoding.compiled_kernels`, CPUs with AVX512-BF16: each output
  element summed in one order whatever the row count, so no padding), measured and checked like the others and
  taken where it is the cheapest;
- attention goes through `"row_invariant"` (`hf_dflash.decoding.cpu_attention`, registered with transformers'
  `AttentionInterface`), whose reduction order depends on neither the number of query rows nor the key count.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D
from transformers.utils import logging

from .compiled_kernels import compiled_linear
from .cpu_attention import EXACT_ATTENTION, FAST_ATTENTION, register_cpu_attention

logger = logging.get_logger(__name__)

MEASURED_ROWS = (1, 2, 4, 8, 16, 32)  # row counts timed per weight shape; others use the next measured count up
COLD_BYTES = 64 * 2**20  # kernels are timed on weight copies this large together: beyond the caches, as in a forward
# row counts exact mode checks against each row alone (block sizes, trees of 16 + 1, batches of them)
INVARIANCE_ROWS = (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 68)
# exact mode's calls in 16 bits, and where no unchunked kernel passes the check: products over exactly this many rows
CHUNK_ROWS = 16


# -- the two kernels -------------------------------------------------------------------------------------------------


def packed_kernels_available() -> bool:
    """Whether this torch build has the oneDNN linear ops (`mkldnn._reorder_linear_weight`, `_linear_pointwise`)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight `[out, in]` in oneDNN's blocked layout (a prepack hint of 2 rows: row-invariant from 2 rows up)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the packed weight; `x` `[..., in]` -> `[..., out]`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_row_invariant(weight: torch.Tensor) -> torch.Tensor:
    """The weight `[out, in]` bf16 in the compiled row-invariant kernel's layout (`compiled_linear` must be built)."""
    return compiled_linear()[0](weight.detach())


def row_invariant_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """The compiled row-invariant bf16 product (`compiled_linear`) on `x` `[..., in]` with a weight packed by its
    `pack` -> `[..., out_features]`."""
    _, linear = compiled_linear()
    rows = x.reshape(-1, x.shape[-1])
    return linear(rows, packed, bias, out_features).view(*x.shape[:-1], out_features)


def stock_linear_over_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on `x` `[..., in]` as one `[n, in]` product -> `[..., out]`. On a CPU, torch's stock bf16 linear over
    a 3-D input without default strides (a slice such as `hidden[:, -1:]`, which transformers' LM heads take at
    prefill) runs a slow oneDNN path: 64 against 1.5 ms at SmolLM2's 49,152-row head on a Xeon
    (`benchmarks/scripts/probe_sliced_linear.py`). The rows are also what the kernel choice measured and checked."""
    rows = x.reshape(-1, x.shape[-1])  # a view where it can be
    return F.linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def pad_to_two_rows(x: torch.Tensor) -> torch.Tensor:
    """`[1, ..., 1, in]` -> `[2, in]`: the row twice, so a 1-row product takes the multi-row kernel."""
    row = x.reshape(1, x.shape[-1])
    return torch.cat([row, row])


def in_fixed_chunks(product, x: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """`product` over `x` `[..., in]` in calls of exactly `chunk_rows` rows each (the last padded with zeros), so
    every call has one shape whatever the row count; -> `[..., out]`. The padding is one `torch.cat` with a shared
    block of zeros: `F.pad` and a split took several ops, which cost a 1-row bf16 product 9-14 us more (about 2.5 ms
    a SmolLM2 token on 1 thread of a 2-core EPYC; more at 2 threads, where each op wakes the other thread)."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 0:
        return product(x)
    missing = -count % chunk_rows
    if missing:
        rows = torch.cat([rows, zero_rows(missing, rows.shape[-1], rows.dtype, rows.device)])
    if rows.shape[0] == chunk_rows:
        out = product(rows)
    else:
        out = torch.cat([product(chunk) for chunk in rows.split(chunk_rows)])
    return out[:count].reshape(*x.shape[:-1], -1)


@functools.lru_cache(maxsize=256)
def zero_rows(num_rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A `[num_rows, width]` block of zeros, made once per shape and only ever read (the padding's source)."""
    return torch.zeros(num_rows, width, dtype=dtype, device=device)


# -- measured choices ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearKernel:
    """What a prepared linear of one weight shape does: which row counts go to the packed kernel (`packed_rows[i]`
    for `MEASURED_ROWS[i]`), and in exact mode whether 1-row inputs are padded to 2 rows or every product runs in
    chunks of `chunk_rows` rows (0: not), or every product goes to the compiled row-invariant kernel
    (`row_invariant`, bf16: no padding)."""

    packed_rows: tuple[bool, ...]
    pad_single_row: bool = False
    chunk_rows: int = 0
    row_invariant: bool = False

    def uses_packed(self, rows: int) -> bool:
        for measured, packed in zip(MEASURED_ROWS, self.packed_rows):
            if rows <= measured:
                return packed
        return self.packed_rows[-1]

    @property
    def uses_any_packed(self) -> bool:
        return any(self.packed_rows)


@dataclass
class KernelChoices:
    """Kernel choices per weight shape `(out, in, dtype, exact, torch threads)`, measured on first use and then kept.
    Pass one object to several `optimize_for_cpu` calls (target and drafter) to measure each shape once."""

    repeats: int = 3
    choices: dict[tuple, LinearKernel] = field(default_factory=dict)

    def choose(self, weight: torch.Tensor, exact: bool) -> LinearKernel:
        key = (*weight.shape, str(weight.dtype), exact, torch.get_num_threads())
        if key not in self.choices:
            self.choices[key] = self._measure(weight, exact)
        return self.choices[key]

    def _measure(self, weight: torch.Tensor, exact: bool) -> LinearKernel:
        packed = _try_pack(weight)
        x = torch.randn(
            MEASURED_ROWS[-1], weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0)
        )
        # Timed on copies of the weight that together exceed the caches, as a forward meets its weights (from memory):
        # with one hot copy the stock 1-row kernel looks 1.2-2x faster than it runs in a model.
        weights = _cold_copies(weight)
        stock_us = [
            median_us(lambda w, rows=rows: F.linear(x[:rows], w), weights, self.repeats) for rows in MEASURED_ROWS
        ]
        packed_us = None
        if packed is not None:
            packs = [packed] + [pack_weight(w) for w in weights[1:]]
            packed_us = [
                median_us(lambda p, rows=rows: packed_linear(x[:rows], p, None), packs, self.repeats)
                for rows in MEASURED_ROWS
            ]
        if not exact:
            return self._fast_choice(weight, stock_us, packed_us)
        return self._exact_choice(weight, packed, stock_us, packed_us)

    def _fast_choice(self, weight, stock_us, packed_us) -> LinearKernel:
        """Per row count the faster of the stock and the packed kernel; the compiled row-invariant kernel instead
        where it is at least as fast as both at every measured row count."""
        best_us = [min(p, s) for p, s in zip(packed_us, stock_us)] if packed_us is not None else stock_us
        compiled = self._compiled(weight)
        if compiled is not None and all(c <= b for c, b in zip(compiled[0], best_us)):
            return compiled[1]
        return LinearKernel(tuple(packed_us is not None and p < s for p, s in zip(packed_us or stock_us, stock_us)))

    def _exact_choice(self, weight, packed, stock_us, packed_us) -> LinearKernel:
        """One kernel for all row counts: the faster (over the multi-row counts) of those checked row-invariant with
        a 1-row input padded to 2 rows; else, in fixed chunks of `CHUNK_ROWS` rows, the faster of those checked so.
        16-bit weights go to chunks directly (`always_chunked`). A bf16 weight's compiled row-invariant kernel
        (`_compiled`) competes with either."""
        kernels = [(False, stock_us, lambda x: F.linear(x, weight))]
        if packed is not None:
            kernels.insert(0, (True, packed_us, lambda x: packed_linear(x, packed, None)))
        compiled = self._compiled(weight)  # where there is one, it competes with the padded products
        for chunk_rows in (0, CHUNK_ROWS) if not always_chunked(weight.dtype) else (CHUNK_ROWS,):
            candidates = [(_exact_cost(compiled[0], 0), compiled[1])] if compiled is not None else []
            for uses_packed, times, product in kernels:
                kernel = LinearKernel((uses_packed,) * len(MEASURED_ROWS), not chunk_rows, chunk_rows)
                if _row_invariant(functools.partial(prepared_product, kernel, product), weight):
                    candidates.append((_exact_cost(times, chunk_rows), kernel))
            if candidates:
                return min(candidates, key=lambda candidate: candidate[0])[1]
        raise RuntimeError(
            f"optimize_for_cpu(exact=True): no linear kernel of this torch build is row-invariant for a "
            f"{tuple(weight.shape)} {weight.dtype} weight on this CPU, even in fixed chunks of {CHUNK_ROWS} rows, so "
            "a block forward cannot match one-token forwards bitwise. Use exact=False (greedy outputs then match "
            "plain decoding except where logits tie within rounding), or another dtype."
        )

    def _compiled(self, weight: torch.Tensor) -> tuple[list[float], LinearKernel] | None:
        """The compiled row-invariant bf16 kernel for `weight`: its microseconds at `MEASURED_ROWS`, measured as the
        others (on cold copies, its own packed layout), and its `LinearKernel`, where it passes the same check; None
        where it does not apply, is not built or fails the check."""
        if weight.dtype != torch.bfloat16 or weight.shape[1] % 2 or compiled_linear() is None:
            return None
        packs = [pack_row_invariant(w) for w in _cold_copies(weight)]
        x = torch.randn(MEASURED_ROWS[-1], weight.shape[1], generator=torch.Generator().manual_seed(0)).to(
            weight.dtype
        )
        times = [
            median_us(
                lambda p, rows=rows: row_invariant_linear(x[:rows], p, None, weight.shape[0]), packs, self.repeats
            )
            for rows in MEASURED_ROWS
        ]
        kernel = LinearKernel((False,) * len(MEASURED_ROWS), row_invariant=True)
        product = functools.partial(row_invariant_linear, packed=packs[0], bias=None, out_features=weight.shape[0])
        checked = _row_invariant(functools.partial(prepared_product, kernel, product), weight)
        return (times, kernel) if checked else None


def always_chunked(dtype: torch.dtype) -> bool:
    """Whether exact mode runs every product of this dtype in `CHUNK_ROWS`-row chunks without trying others. A 16-bit
    product rounds its fp32 sums to 16 bits, which hides most differences in summation order from a check: on a Xeon
    with AMX a 2-row-padded bf16 kernel passed `_row_invariant` for one random input and failed it for another on most
    of SmolLM2's weights, so a passing check proves nothing there. Calls of always the same number of rows sum every
    row the same way by construction (the chunked products passed for every weight and input tried)."""
    return dtype in (torch.bfloat16, torch.float16)


def _exact_cost(times_us: list[float], chunk_rows: int) -> float:
    """Microseconds over the measured multi-row counts, as exact mode runs them (in chunks: whole chunks)."""
    if not chunk_rows:
        return sum(times_us[1:])
    per_chunk = times_us[MEASURED_ROWS.index(chunk_rows)]
    return sum(-(-rows // chunk_rows) * per_chunk for rows in MEASURED_ROWS[1:])


def prepared_product(kernel: LinearKernel, product, x: torch.Tensor) -> torch.Tensor:
    """`product(x)` (`x` `[..., in]` -> `[..., out]`) with exact mode's padding: a 1-row input as 2 rows, or every
    call in chunks of `kernel.chunk_rows` rows."""
    if kernel.chunk_rows:
        return in_fixed_chunks(product, x, kernel.chunk_rows)
    if kernel.pad_single_row and x.numel() == x.shape[-1]:
        return product(pad_to_two_rows(x))[:1].reshape(*x.shape[:-1], -1)
    return product(x)


def _try_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed weight, or `None` (logged) where this torch or CPU cannot pack or run it."""
    if not packed_kernels_available():
        _log_fallback_once("this torch build has no oneDNN linear ops")
        return None
    try:
        packed = pack_weight(weight)
        packed_linear(torch.zeros(2, weight.shape[1], dtype=weight.dtype), packed, None)
        return packed
    except RuntimeError as error:  # e.g. bf16 packing needs avx512bw/avx_ne_convert
        _log_fallback_once(f"oneDNN cannot pack a {weight.dtype} weight here ({str(error).splitlines()[0]})")
        return None


@functools.cache
def _log_autograd_once() -> None:
    logger.warning(
        "optimize_for_cpu: prepared linears run the stock kernels while autograd records (their oneDNN ops have no "
        "backward), so neither their speed nor exact mode's bitwise match holds there. Generate under "
        "torch.no_grad() (generate() does), or call model.requires_grad_(False) for inference."
    )


@functools.cache
def _log_fallback_once(reason: str) -> None:
    logger.warning(f"optimize_for_cpu: stock kernels for these linears, because {reason}.")


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and enough copies of it (2 to 64) to hold `COLD_BYTES` together."""
    count = max(2, min(64, -(-COLD_BYTES // (weight.numel() * weight.element_size()))))
    return [weight.detach()] + [weight.detach().clone() for _ in range(count - 1)]


def median_us(run, operands: list[torch.Tensor], repeats: int) -> float:
    """Median microseconds of `run(operand)`, per operand, over `repeats` passes through all of `operands`."""
    run(operands[0])  # warm-up (first-call allocation, oneDNN primitive creation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for operand in operands:
            run(operand)
        times.append((time.perf_counter() - start) / len(operands))
    return 1e6 * sorted(times)[len(times) // 2]


def _row_invariant(product, weight: torch.Tensor) -> bool:
    """Whether the first rows of `product` over each of `INVARIANCE_ROWS` rows equal, bitwise, each row alone
    (`product` pads as the prepared linear will)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(max(INVARIANCE_ROWS), weight.shape[1], generator=generator).to(weight.dtype)
    alone = torch.cat([product(x[i : i + 1]) for i in range(8)])  # [8, out]
    return all(torch.equal(product(x[:rows])[: min(rows, 8)], alone[: min(rows, 8)]) for rows in INVARIANCE_ROWS)


# -- the prepared module ---------------------------------------------------------------------------------------------


@dataclass
class PackedWeight:
    """A weight's packed copies (oneDNN's blocked layout, `packed`; the compiled row-invariant kernel's,
    `row_invariant`) and the `weight._version` they were packed from (shared by linears that share a weight)."""

    packed: torch.Tensor | None
    version: int
    row_invariant: torch.Tensor | None = None

    def current(self, weight: torch.Tensor) -> torch.Tensor | None:
        self._repack_if_changed(weight)
        return self.packed

    def current_row_invariant(self, weight: torch.Tensor) -> torch.Tensor | None:
        self._repack_if_changed(weight)
        return self.row_invariant

    def _repack_if_changed(self, weight: torch.Tensor) -> None:
        if weight._version == self.version:
            return
        if self.packed is not None:  # changed in place: pack again
            self.packed = pack_weight(weight)
        if self.row_invariant is not None:
            self.row_invariant = pack_row_invariant(weight)
        self.version = weight._version

    def pack_for(self, kernel: LinearKernel, weight: torch.Tensor) -> int:
        """Pack the copies `kernel` needs that are not held (another mode's kernel may have left them out); the
        bytes added."""
        self._repack_if_changed(weight)
        added = 0
        if kernel.uses_any_packed and self.packed is None:
            self.packed, added = pack_weight(weight), added + weight.numel() * weight.element_size()
        if kernel.row_invariant and self.row_invariant is None:
            self.row_invariant = pack_row_invariant(weight)
            added += weight.numel() * weight.element_size()
        return added


class PreparedLinear(nn.Linear):
    """An `nn.Linear` that routes each call to the stock or the packed kernel (`CPUPreparation` sets its class and
    its two attributes; `undo` resets them). Parameters and `state_dict` are the stock module's own."""

    kernel: LinearKernel
    packed_weight: PackedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)  # moved off the CPU, or autocast: stock
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            _log_autograd_once()  # the oneDNN ops have no backward
            return F.linear(x, self.weight, self.bias)
        return prepared_product(self.kernel, self._product, x)  # exact mode's padding, if any

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel.row_invariant:
            packed = self.packed_weight.current_row_invariant(self.weight)
            return row_invariant_linear(x, packed, self.bias, self.out_features)
        if self.kernel.uses_packed(x.numel() // x.shape[-1]):
            return packed_linear(x, self.packed_weight.current(self.weight), self.bias)
        return stock_linear_over_rows(x, self.weight, self.bias)


# -- preparing a model -----------------------------------------------------------------------------------------------


@dataclass
class CPUPreparation:
    """What `optimize_for_cpu` did to one model, and how to undo it (`undo`)."""

    model: nn.Module
    exact: bool
    choices: KernelChoices
    linears: list[nn.Linear] = field(default_factory=list)  # the modules whose class was swapped
    attention: str | None = None  # the attention implementation set, if any
    previous_attention: str | None = None  # ... and the one it replaced
    packed_bytes: int = 0  # memory the packed copies add

    @property
    def active(self) -> bool:
        return bool(self.linears) or self.attention is not None

    def undo(self) -> None:
        """Restore stock linears and the previous attention implementation."""
        self._use(prepared=False)
        for linear in self.linears:
            del linear.kernel, linear.packed_weight
        self.linears, self.attention, self.previous_attention, self.packed_bytes = [], None, None, 0

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the stock kernels inside the block (the benchmark's stock baseline), the prepared ones after it."""
        self._use(prepared=False)
        try:
            yield
        finally:
            self._use(prepared=True)

    @contextlib.contextmanager
    def fast(self) -> Iterator[None]:
        """Run fast mode's kernels and attention inside the block, this exact preparation's after it: the benchmark's
        `plain_fast` baseline, plain decoding at its fastest without leaving exact mode. The first entry measures the
        fast choices (once per shape) and packs the weights they need that exact mode left unpacked; later entries only
        switch. A fast preparation runs as it is."""
        if not self.exact:
            yield
            return
        exact_kernels = [linear.kernel for linear in self.linears]
        for linear in self.linears:
            linear.kernel = self.choices.choose(linear.weight, exact=False)
            self.packed_bytes += linear.packed_weight.pack_for(linear.kernel, linear.weight)
        if self.attention is not None:
            self.model.set_attn_implementation(
                _fast_mode_attention(self.previous_attention) or self.previous_attention
            )
        try:
            yield
        finally:
            for linear, kernel in zip(self.linears, exact_kernels):
                linear.kernel = kernel
            if self.attention is not None:
                self.model.set_attn_implementation(self.attention)

    def _use(self, prepared: bool) -> None:
        """Switch the swapped linears and the attention to the prepared or the stock implementation."""
        for linear in self.linears:
            linear.__class__ = PreparedLinear if prepared else nn.Linear
        if self.attention is not None:
            self.model.set_attn_implementation(self.attention if prepared else self.previous_attention)

    def summary(self) -> str:
        packed = sum(linear.kernel.uses_any_packed for linear in self.linears)
        compiled = sum(linear.kernel.row_invariant for linear in self.linears)
        mode = "exact" if self.exact else "fast"
        return (
            f"{len(self.linears)} linears prepared ({mode}), {packed} of them packed for some row counts"
            + (f", {compiled} on the compiled row-invariant kernel" if compiled else "")
            + f" (+{self.packed_bytes / 2**20:.0f} MiB)"
            + (f", attention '{self.attention}'" if self.attention is not None else "")
        )


def optimize_for_cpu(model: nn.Module, exact: bool = False, choices: KernelChoices | None = None) -> CPUPreparation:
    """Prepare a CPU model (a target, or a DFlash drafter) so that a forward over a block costs little more than one
    token.

    Args:
        model: any `PreTrainedModel` (PEFT-wrapped ones too). A model on an accelerator is returned unprepared.
        exact: also make a forward over `k` tokens give logits bitwise equal to `k` one-token forwards (see the module
            docstring); greedy speculative decoding is then token-identical to plain decoding with the same
            preparation in any dtype. Costs more per verify forward (`benchmarks/scripts/probe_forward_rows.py`).
        choices: measured kernel choices to reuse (`CPUPreparation.choices` of a model prepared before).

    Returns:
        a `CPUPreparation`; `.undo()` restores the stock model. Kernels missing from this torch build (or unable to
        pack this dtype on this CPU) are logged once and the stock kernel is kept.
    """
    choices = choices or KernelChoices()
    preparation = CPUPreparation(model, exact, choices)
    if _on_accelerator(model):
        logger.info("optimize_for_cpu: the model is not on the CPU; left as it is.")
        return preparation
    if is_optimized_for_cpu(model):
        raise ValueError("optimize_for_cpu: this model is already prepared; call .undo() on its preparation first.")
    if exact:
        _check_other_products(model)
    packed_by_weight: dict[int, PackedWeight] = {}
    try:
        for module in model.modules():
            if type(module) is nn.Linear:
                _prepare_linear(module, preparation, packed_by_weight)
        _switch_attention(model, preparation)
    except Exception:
        preparation.undo()  # a failed preparation leaves the model as it was
        raise
    logger.info(f"optimize_for_cpu: {preparation.summary()}")
    return preparation


def optimize_target_and_draft_for_cpu(
    target: nn.Module, draft: nn.Module | None = None, exact: bool = False
) -> CPUPreparation:
    """`optimize_for_cpu` on a target (`exact` as asked) and its drafter, each weight shape measured once, and the
    drafter's product with the target head's rows of its reduced vocabulary (`DFlashForDrafting.draft_head`), which
    `optimize_for_cpu(draft)` alone cannot reach. The drafter is prepared fast: its numbers decide what is proposed,
    never what is kept. A drafter already prepared is kept. Returns the target's preparation."""
    preparation = optimize_for_cpu(target, exact=exact)
    if draft is not None and not is_optimized_for_cpu(draft):
        optimize_draft_for_cpu(draft, target, preparation.choices)
    return preparation


def optimize_draft_for_cpu(
    draft: nn.Module, target: nn.Module, choices: KernelChoices | None = None
) -> CPUPreparation:
    """A drafter of `target` prepared as `optimize_target_and_draft_for_cpu` prepares one: fast kernels, and its
    product with the target head's rows of a reduced vocabulary. For another drafter of a target prepared before
    (pass that preparation's `choices`, so each weight shape is measured once); the target is left as it is. Returns
    the drafter's preparation (`.undo()` restores it)."""
    preparation = optimize_for_cpu(draft, choices=choices)
    _prepare_draft_head(target, draft, preparation)
    return preparation


def _prepare_draft_head(target: nn.Module, draft: nn.Module, preparation: CPUPreparation) -> None:
    """A drafter over a reduced vocabulary multiplies its hidden states by the target head's rows of that vocabulary
    (`DFlashForDrafting.draft_head`, an `nn.Linear` it caches): prepared like its own linears (SmolLM2's 8,192 rows at
    7 rows of input, one Zen 4 core: 0.34 ms on the compiled bf16 kernel against 0.85 stock). Over the whole
    vocabulary the drafter uses the target's head, prepared with the target."""
    head_of = getattr(draft, "draft_head", None)
    lm_head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head_of is None or lm_head is None or getattr(draft, "draft_token_ids", None) is None:
        return
    head = head_of(lm_head)
    if head.weight.device.type == "cpu" and not isinstance(head, PreparedLinear):
        _prepare_linear(head, preparation, {})


def _prepare_linear(linear: nn.Linear, preparation: CPUPreparation, packed_by_weight: dict[int, PackedWeight]) -> None:
    kernel = preparation.choices.choose(linear.weight, preparation.exact)
    key = id(linear.weight)
    if key not in packed_by_weight:  # tied weights (one shape, so one kernel) share one packed copy
        packed = pack_weight(linear.weight) if kernel.uses_any_packed else None
        row_invariant = pack_row_invariant(linear.weight) if kernel.row_invariant else None
        packed_by_weight[key] = PackedWeight(packed, linear.weight._version, row_invariant)
        copies = sum(copy is not None for copy in (packed, row_invariant))
        preparation.packed_bytes += copies * linear.weight.numel() * linear.weight.element_size()
    linear.__class__ = PreparedLinear
    linear.kernel, linear.packed_weight = kernel, packed_by_weight[key]
    preparation.linears.append(linear)


def _check_other_products(model: nn.Module) -> None:
    """Exact mode: products this module does not prepare (transformers' `Conv1D`, GPT-2's) must be row-invariant
    with the stock kernel on this CPU, else a block forward cannot match one-token forwards; in 16 bits they are
    refused (`always_chunked`)."""
    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            weight, bias = module.weight, module.bias  # [in, out]
            if always_chunked(weight.dtype):
                raise ValueError(
                    f"optimize_for_cpu(exact=True): {name} is a {weight.dtype} Conv1D, whose row invariance a check "
                    "cannot vouch for in 16 bits (exact mode runs 16-bit linears in fixed chunks, and does not "
                    "prepare Conv1D). Use float32 (the Conv1D is then checked) or exact=False."
                )
            if not _row_invariant(lambda x, w=weight, b=bias: torch.addmm(b, x, w), weight.t()):
                raise ValueError(
                    f"optimize_for_cpu(exact=True): {name} is a Conv1D whose {weight.dtype} product is not "
                    "row-invariant on this CPU, so a block forward cannot match one-token forwards bitwise. Use "
                    "exact=False, or bfloat16 (row-invariant here)."
                )


def _on_accelerator(model: nn.Module) -> bool:
    return any(parameter.device.type != "cpu" for parameter in model.parameters())


def _switch_attention(model: nn.Module, preparation: CPUPreparation) -> None:
    """Exact mode: `"row_invariant"` attention (required). Fast mode: `"sdpa_gqa"` where the model uses transformers'
    default `"sdpa"` (an explicit choice such as `"eager"` is kept)."""
    if not hasattr(model, "set_attn_implementation"):
        if preparation.exact:
            raise ValueError(
                "optimize_for_cpu(exact=True) needs a transformers PreTrainedModel (set_attn_implementation)."
            )
        return
    previous = model.config._attn_implementation
    wanted = EXACT_ATTENTION if preparation.exact else _fast_mode_attention(previous)
    if wanted is None:
        return
    register_cpu_attention()
    model.set_attn_implementation(wanted)
    preparation.attention, preparation.previous_attention = wanted, previous


def _fast_mode_attention(previous: str | None) -> str | None:
    """The attention fast mode sets over `previous`: `"sdpa_gqa"` over transformers' default `"sdpa"`, else none (an
    explicit choice such as `"eager"` is kept)."""
    return FAST_ATTENTION if previous == "sdpa" else None


def is_optimized_for_cpu(model: nn.Module) -> bool:
    """Whether `optimize_for_cpu` prepared any linear of `model` (and it was not undone)."""
    return any(isinstance(module, PreparedLinear) for module in model.modules())


__all__ = [
    "CPUPreparation",
    "KernelChoices",
    "LinearKernel",
    "PreparedLinear",
    "is_optimized_for_cpu",
    "optimize_for_cpu",
    "optimize_target_and_draft_for_cpu",
    "packed_kernels_available",
]
