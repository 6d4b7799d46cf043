"""Two CPU attention functions for transformers' `AttentionInterface`; `optimize_for_cpu` selects one, no model code
is forked.

`"sdpa_gqa"` (fast): transformers' sdpa path copies every key and value head `heads / kv_heads` times (`repeat_kv`)
whenever a forward has more than one new token and a mask, which on a 2-core CPU costs more than the attention itself
(SmolLM2-135M, 8 new tokens: 40 of 105 ms). This calls `scaled_dot_product_attention(..., enable_gqa=True)` with the
mask instead, as transformers already does for one new token.

`"row_invariant"` (exact): every output row computed the same way however many query rows share the call. For one new
token transformers calls sdpa without a mask, for several with one, and the CPU flash kernel blocks queries and keys
by their counts, so the row of a verify forward sums in another order than the one-token forward of the same token.
Here each row is computed from its own query and its allowed keys (from the mask: causal, padding, holes a ragged
batch leaves, a draft tree's ancestors), in cache order, the same way whatever else shares the call: by a small C++
kernel (`row_invariant_attention.cpp`, built on first use by `hf_dflash.decoding.compiled_kernels`; a loop per row),
or, where it cannot be built (no compiler or ninja, said once), in pure torch, for each query row:

1. its allowed keys are gathered to the front, in cache order, so the row sees the same key sequence wherever the
   cache put them;
2. that sequence is cut into fixed chunks of `KEY_CHUNK` keys from its first key; the last chunk is padded with
   masked keys, which contribute exact zeros;
3. scores and probability-weighted values come from batched products whose every entry has one fixed shape
   (`[KEY_CHUNK, head_dim] x [head_dim, heads per kv head]` and `[heads per kv head, KEY_CHUNK] x [KEY_CHUNK,
   head_dim]`), row-major and 64-byte aligned, so neither the number of query rows nor the number of chunks changes
   how an entry is summed;
4. the softmax max is exact in any order; the chunks' sums are added in chunk order, one at a time, so chunks
   beyond a row's keys (fully masked: exact zeros) change nothing.

The pure-torch version gathers each query row's keys and values and runs many small products, which costs far more
than the kernel (`benchmarks/scripts/probe_forward_rows.py` measures exact against fast mode).
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compiled_kernels import compiled_attention

# Not "*flash*": transformers reads such names as flash-attention kernels.
EXACT_ATTENTION = "row_invariant"
FAST_ATTENTION = "sdpa_gqa"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the compiled kernel's (others: the torch version)
KEY_CHUNK = 64  # keys per fixed-shape product
# Every entry of a batched product starts on a 64-byte boundary: CPU BLAS kernels sum an entry in another order when
# its rows are misaligned (MKL fp32: entries of 3 x 65 floats gave other results at odd offsets).
ALIGN_BYTES = 64


def gqa_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention without `repeat_kv`: `query` `[b, h, q, d]`, `key`/`value` `[b, h_kv, kv, d]`
    -> `([b, q, h, d], None)`. Other arguments (attention sinks, ...) go to transformers' own sdpa function."""
    if any(kwargs.get(name) is not None for name in ("s_aux", "sinks", "position_bias")):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        is_causal=bool(is_causal),
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def exact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`query` `[b, h, q, d]`, `key`/`value` `[b, h_kv, kv, d]`, `attention_mask` `[b, 1, q, kv]` (bool, or additive
    0 / dtype-min) -> `([b, q, h, d], None)`, as transformers' attention functions return."""
    if dropout and module.training:
        raise ValueError(f"'{EXACT_ATTENTION}' attention has no dropout; call model.eval() (it is for inference).")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"'{EXACT_ATTENTION}' attention does not support attention sinks; use exact=False.")
    batch, heads, num_queries, head_dim = query.shape
    keep = allowed_keys(attention_mask, batch, num_queries, key.shape[2], key.device)  # [b, q, kv]
    scaling = head_dim**-0.5 if scaling is None else scaling
    kernel = compiled_attention() if query.device.type == "cpu" and query.dtype in KERNEL_DTYPES else None
    if kernel is None:
        return _chunked_attention(query, key, value, keep, scaling, softcap), None
    group = heads // key.shape[1]
    queries = query.view(batch, key.shape[1], group, num_queries, head_dim).transpose(2, 3)  # [b, h_kv, q, g, d]
    out = kernel(queries, key.to(query.dtype), value.to(query.dtype), keep.contiguous(), scaling, softcap or 0.0)
    return out.to(query.dtype), None  # [b, q, h, d]


def _chunked_attention(query, key, value, keep, scaling: float, softcap) -> torch.Tensor:
    """The pure-torch version: `[b, q, h, d]` from fixed-shape products over each row's keys in fixed chunks."""
    batch, heads, num_queries, head_dim = query.shape
    group_padded, value_width = _aligned_widths(heads // key.shape[1], head_dim, query.element_size())
    counts = keep.sum(-1)  # [b, q]
    num_chunks = max(1, -(-int(counts.max()) // KEY_CHUNK))
    # one sequence, chains: each row's allowed keys are already first and in order, no gather needed
    in_place = torch.equal(keep, torch.arange(keep.shape[-1], device=keep.device) < counts[..., None])
    order = None if in_place else compact_order(keep)
    chunk_keys = _rows_of_chunks(key, order, num_queries, num_chunks)  # [b, h_kv, q, n, C, d]
    # values, then a column of ones (the same product then also sums each row's probabilities, in the same order),
    # then zeros up to an aligned width
    ones = value.new_ones(*value.shape[:-1], 1)
    values = torch.cat([value, ones, value.new_zeros(*value.shape[:-1], value_width - head_dim - 1)], dim=-1)
    chunk_values = _rows_of_chunks(values, order, num_queries, num_chunks)  # [b, h_kv, q, n, C, d']
    probs = _chunk_probabilities(query, chunk_keys, counts, group_padded, scaling, softcap)  # [b, h_kv, q, n, C, g']
    out = _weighted_values(probs, chunk_values, heads // key.shape[1], head_dim)  # [b, h_kv, q, g, d]
    out = out.permute(0, 2, 1, 3, 4).reshape(batch, num_queries, heads, head_dim)
    return out.to(query.dtype)


def _chunk_probabilities(query, chunk_keys, counts, group_padded: int, scaling, softcap) -> torch.Tensor:
    """Unnormalised softmax weights `[b, h_kv, q, n, C, g']` (fp32) of each row's queries over its chunks of keys,
    from one batched product of fixed-shape entries `[C, d] x [d, g']`."""
    batch, kv_heads, num_queries, num_chunks, _, head_dim = chunk_keys.shape
    group = query.shape[1] // kv_heads
    # [b, h_kv, q, n, d, g']: each row's queries of one kv head (zero-padded to g'), repeated for each chunk
    queries = query.view(batch, kv_heads, group, num_queries, head_dim).permute(0, 1, 3, 4, 2)
    queries = torch.nn.functional.pad(queries, (0, group_padded - group))
    queries = queries[:, :, :, None].expand(-1, -1, -1, num_chunks, -1, -1)
    entries = batch * kv_heads * num_queries * num_chunks
    scores = torch.bmm(
        _dense(chunk_keys.reshape(entries, KEY_CHUNK, head_dim)),
        _dense(queries.reshape(entries, head_dim, group_padded)),
    )  # [E, C, g']
    scores = scores.view(batch, kv_heads, num_queries, num_chunks, KEY_CHUNK, group_padded).float()
    scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    in_row = torch.arange(num_chunks * KEY_CHUNK, device=scores.device) < counts[..., None]  # [b, q, n * C]
    scores = scores.masked_fill(~in_row.view(batch, 1, num_queries, num_chunks, KEY_CHUNK, 1), float("-inf"))
    row_max = scores.amax(dim=(3, 4), keepdim=True)  # exact in any order
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # a row with no key (padding) stays finite
    return torch.exp(scores - row_max)


def _weighted_values(probs: torch.Tensor, chunk_values: torch.Tensor, group: int, head_dim: int) -> torch.Tensor:
    """`[b, h_kv, q, g, d]` (fp32): the probability-weighted values of each chunk (fixed-shape entries
    `[g', C] x [C, d']`), added chunk by chunk in order, over the probabilities' sum (the ones column)."""
    batch, kv_heads, num_queries, num_chunks, _, group_padded = probs.shape
    value_width = chunk_values.shape[-1]
    entries = batch * kv_heads * num_queries * num_chunks
    weights = _dense(probs.transpose(-1, -2).to(chunk_values.dtype).reshape(entries, group_padded, KEY_CHUNK))
    partial = torch.bmm(weights, _dense(chunk_values.reshape(entries, KEY_CHUNK, value_width)))  # [E, g', d']
    partial = partial.view(batch, kv_heads, num_queries, num_chunks, group_padded, value_width)
    out = partial[:, :, :, 0].float()
    for chunk in range(1, num_chunks):  # one chunk at a time, in order
        out = out + partial[:, :, :, chunk].float()
    total = out[..., :group, head_dim : head_dim + 1].clamp(min=torch.finfo(out.dtype).tiny)  # [b, h_kv, q, g, 1]
    return out[..., :group, :head_dim] / total


def _dense(entries: torch.Tensor) -> torch.Tensor:
    """`entries` with row-major strides: a reshape may return a view whose strides the BLAS reads as a transposed
    operand (with one query row it does), and a transposed operand is summed by another kernel."""
    batch, rows, cols = entries.shape
    if entries.stride() == (rows * cols, cols, 1):
        return entries
    return entries.clone(memory_format=torch.contiguous_format)


def _aligned_widths(group: int, head_dim: int, element_size: int) -> tuple[int, int]:
    """Query heads per kv head padded so a `[d, g']` entry fills whole 64-byte lines, and the value width `d'`
    (values, the ones column, zeros) that makes `[C, d']` and `[g', d']` entries do so."""
    per_line = ALIGN_BYTES // element_size  # elements per 64 bytes
    group_multiple = per_line // math.gcd(per_line, head_dim)
    return -(-group // group_multiple) * group_multiple, -(-(head_dim + 1) // per_line) * per_line


def allowed_keys(mask: torch.Tensor | None, batch: int, num_queries: int, num_keys: int, device) -> torch.Tensor:
    """`[b, q, kv]` bool: which keys each query row attends to (`None`: causal, queries the last `q` keys)."""
    if mask is None:
        rows = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)
        return (torch.arange(num_keys, device=device)[None] <= rows).expand(batch, -1, -1)
    if mask.ndim != 4 or mask.shape[1] != 1:
        raise ValueError(
            f"'{EXACT_ATTENTION}' attention expects a [batch, 1, queries, keys] mask, got {tuple(mask.shape)}."
        )
    mask = mask[:, 0, :, :num_keys]
    if mask.dtype == torch.bool:
        return mask.expand(batch, num_queries, num_keys)
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | blocked).all()):
        raise ValueError(f"'{EXACT_ATTENTION}' attention takes boolean or 0/-inf masks, not additive biases.")
    return (~blocked).expand(batch, num_queries, num_keys)


def compact_order(keep: torch.Tensor) -> torch.LongTensor:
    """`keep` `[b, q, kv]` -> `[b, q, kv]`: the slots of each row's allowed keys first, in cache order."""
    return torch.argsort((~keep).to(torch.uint8), dim=-1, stable=True)


def _rows_of_chunks(
    states: torch.Tensor, order: torch.LongTensor | None, num_queries: int, num_chunks: int
) -> torch.Tensor:
    """`[b, h_kv, kv, d]` -> `[b, h_kv, q, n, C, d]`: each query row's allowed keys (or values) first (`order`, or
    already so when `None`), cut or padded with zeros to `n` chunks."""
    batch, kv_heads, num_keys, head_dim = states.shape
    length = num_chunks * KEY_CHUNK
    if length > num_keys:  # pad with zero keys (masked by the counts)
        states = torch.cat([states, states.new_zeros(batch, kv_heads, length - num_keys, head_dim)], dim=2)
        if order is not None:
            order = torch.cat([order, order.new_full((batch, num_queries, length - num_keys), num_keys)], dim=-1)
    if order is None:  # the same keys for every row, in place: a view (one row) or one copy per row
        rows = states[:, :, None, :length].expand(-1, -1, num_queries, -1, -1)
    else:
        index = order[:, None, :, :length, None].expand(batch, kv_heads, num_queries, length, head_dim)
        rows = states[:, :, None].expand(-1, -1, num_queries, -1, -1).gather(3, index)
    return rows.reshape(batch, kv_heads, num_queries, num_chunks, KEY_CHUNK, head_dim)


def exact_attention_mask(*args, **kwargs):
    """transformers' boolean sdpa mask, never skipped: exact attention needs the mask even where sdpa's causal flag
    would stand in for it."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register_cpu_attention() -> None:
    """Make `attn_implementation="row_invariant"` and `"sdpa_gqa"` available to every transformers model (once per
    process)."""
    AttentionInterface.register(EXACT_ATTENTION, exact_attention_forward)
    AttentionMaskInterface.register(EXACT_ATTENTION, exact_attention_mask)
    AttentionInterface.register(FAST_ATTENTION, gqa_sdpa_forward)
    AttentionMaskInterface.register(FAST_ATTENTION, sdpa_mask)


__all__ = [
    "EXACT_ATTENTION",
    "FAST_ATTENTION",
    "exact_attention_forward",
    "gqa_sdpa_forward",
    "register_cpu_attention",
]
