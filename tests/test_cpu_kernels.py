"""`optimize_for_cpu`: packed linears chosen by measurement, exact mode (row-invariant linears and attention), and
that a prepared model is still the same model (saved weights, tied heads, LoRA, undo, accelerators, fallbacks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import PAD, greedy_reference, left_pad, make_target
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_draft_tree import tree_oracle
from test_generation import random_prompt
from torch import nn
from transformers.cache_utils import DynamicCache

from hf_dflash import is_optimized_for_cpu, optimize_for_cpu, speculative_generate
from hf_dflash.decoding import cpu_attention, cpu_kernels
from hf_dflash.decoding.compiled_kernels import compiled_attention, compiled_linear
from hf_dflash.decoding.cpu_attention import EXACT_ATTENTION, FAST_ATTENTION, exact_attention_forward
from hf_dflash.decoding.cpu_kernels import MEASURED_ROWS, KernelChoices, LinearKernel, PreparedLinear

DTYPES = [torch.float32, torch.bfloat16]
SLIDING = {"mistral", "gemma2", "gemma3"}  # verify chains only (trees would break their windows)
EXACT_FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gpt_neox", "opt", "mistral", "gemma3"]


def forced(packed: bool) -> KernelChoices:
    """Kernel choices that answer `packed` for every shape, instead of measuring (deterministic tests)."""

    class Forced(KernelChoices):
        def choose(self, weight, exact):
            return LinearKernel((packed,) * len(MEASURED_ROWS), pad_single_row=exact)

    return Forced()


# -- row invariance ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_linears_give_a_row_the_same_bits_alone_or_among_up_to_16(dtype):
    target = make_target("llama", dtype=dtype)
    optimize_for_cpu(target, exact=True)
    for linear in (target.model.layers[0].mlp.down_proj, target.model.layers[0].self_attn.q_proj, target.lm_head):
        x = torch.randn(16, linear.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.no_grad():
            alone = torch.cat([linear(x[i : i + 1]) for i in range(16)])
            for rows in range(1, 17):
                assert torch.equal(linear(x[:rows]), alone[:rows]), (linear, rows)


@pytest.fixture(params=["compiled", "torch"])
def exact_attention(request, monkeypatch) -> str:
    """Run a test on the compiled exact attention (which must build on this machine: CI has a compiler and ninja)
    and on the pure-torch version used where it cannot be built."""
    if request.param == "compiled":
        assert compiled_attention() is not None, "the row-invariant attention kernel did not build here"
    else:
        monkeypatch.setattr(cpu_attention, "compiled_attention", lambda: None)
    return request.param


def test_products_in_fixed_chunks_are_the_product_for_any_row_count():
    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    calls = []

    def product(x):
        calls.append(x.shape[0])
        return nn.functional.linear(x, weight)

    for rows in (1, 5, 16, 17, 40):
        calls.clear()
        x = torch.randn(1, rows, 40)
        out = cpu_kernels.in_fixed_chunks(product, x, 16)
        torch.testing.assert_close(out, nn.functional.linear(x, weight))
        assert calls == [16] * -(-rows // 16)  # every call over exactly 16 rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_prepared_linears_take_slices_as_lm_heads_get_them(dtype, packed):
    """transformers' heads take `hidden[:, -1:]` at prefill and the loops pass `hidden[:, 1:6]`: 3-D inputs without
    default strides, which the stock kernel runs as rows (its 3-D bf16 path is slow) and the packed one as they are."""
    linear = nn.Linear(40, 24, bias=True).to(dtype)
    optimize_for_cpu(linear, choices=forced(packed))
    hidden = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    for x in (hidden[:1, -1:], hidden[:1, 1:6], hidden[:, 1:6], hidden.transpose(0, 1)):
        with torch.no_grad():
            got = linear(x)
        expected = x.float() @ linear.weight.float().T + linear.bias.float()
        assert got.shape == (*x.shape[:-1], 24) and got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", torch.float32), ("qwen3", torch.float32), ("llama", torch.bfloat16)]
)
def test_exact_mode_runs_products_in_fixed_chunks_where_no_kernel_is_row_invariant_and_in_16_bits(
    monkeypatch, family, dtype
):
    """fp32 where the unchunked kernels fail the check (forced here); bf16 always, without the compiled row-invariant
    kernel (left out here). The block forward gives the one-token bits and the model's logits."""
    monkeypatch.setattr(cpu_kernels, "compiled_linear", lambda: None)
    if dtype == torch.float32:
        monkeypatch.setattr(cpu_kernels, "_row_invariant", lambda product, weight: product.args[0].chunk_rows > 0)
    target = make_target(family, dtype=dtype)
    ids = random_prompt(12, seed=3)[None]
    with torch.no_grad():
        stock = target(ids).logits.float()
    preparation = optimize_for_cpu(target, exact=True)
    assert {linear.kernel.chunk_rows for linear in preparation.linears} == {cpu_kernels.CHUNK_ROWS}
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits.float(), stock, atol=tolerance, rtol=tolerance)
    block, singles = _block_and_single_token_logits(target)
    assert torch.equal(block, singles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_mode_checks_unchunked_kernels_in_fp32_only(monkeypatch, dtype):
    """A 16-bit product's rounding hides summation-order differences from the check, so bf16 and fp16 go to 16-row
    chunks without trying the unchunked oneDNN or stock kernels; fp32 tries those first. (bf16 also tries the compiled
    kernel, row-invariant by construction.)"""
    checked = []
    check = cpu_kernels._row_invariant

    def spy(product, weight):
        kernel = product.args[0]
        if not kernel.row_invariant:
            checked.append(kernel.chunk_rows)
        return check(product, weight)

    monkeypatch.setattr(cpu_kernels, "_row_invariant", spy)
    optimize_for_cpu(make_target("qwen2", dtype=dtype), exact=True)
    assert (0 in checked) == (dtype == torch.float32)
    assert cpu_kernels.always_chunked(dtype) == (dtype != torch.float32)


def test_a_16_bit_conv1d_is_refused_by_exact_mode_with_the_fix():
    target = make_target("gpt2", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 Conv1D.*Use float32"):
        optimize_for_cpu(target, exact=True)
    assert not is_optimized_for_cpu(target)


def test_where_not_even_chunks_are_row_invariant_exact_mode_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_row_invariant", lambda product, weight: False)
    target = make_target("llama", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="even in fixed chunks of 16 rows.*Use exact=False"):
        optimize_for_cpu(target, exact=True)
    assert not is_optimized_for_cpu(target)


def _attention(query, key, value, mask=None, softcap=None):
    with torch.no_grad():
        return exact_attention_forward(nn.Module(), query, key, value, mask, softcap=softcap)[0]  # [b, q, h, d]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_exact_attention_computes_attention(exact_attention, dtype, softcap):
    """Within rounding of a float64 reference: GQA, a tree-shaped mask with padding, softcapping (Gemma 2), a row
    with no key at all (zeros)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, 4, 24, generator=generator).to(dtype)
    key, value = (torch.randn(2, 2, 37, 24, generator=generator).to(dtype) for _ in "kv")
    mask = torch.rand(2, 1, 4, 37, generator=generator) < 0.6
    mask[1, 0, 2] = False  # a padding row
    out = _attention(query, key, value, mask, softcap).double()
    scores = query.double() @ key.double().repeat_interleave(3, dim=1).transpose(-1, -2) * 24**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    expected = (probs @ value.double().repeat_interleave(3, dim=1)).transpose(1, 2)  # [b, q, h, d]
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    assert not out[1, 2].any()


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (9, 3, 64), (4, 4, 16), (4, 2, 20)])
def test_exact_attention_rows_match_one_query_calls_for_1_to_16_rows(
    exact_attention, dtype, heads, kv_heads, head_dim
):
    generator = torch.Generator().manual_seed(heads)
    for num_keys in (20, 64, 79, 130):
        for num_queries in (1, 2, 5, 16):
            query = torch.randn(1, heads, num_queries, head_dim, generator=generator).to(dtype)
            key, value = (torch.randn(1, kv_heads, num_keys, head_dim, generator=generator).to(dtype) for _ in "kv")
            block = _attention(query, key, value)
            for row in range(num_queries):
                visible = num_keys - num_queries + row + 1  # causal: the keys up to the row's own
                alone = _attention(query[:, :, row : row + 1], key[:, :, :visible], value[:, :, :visible])
                assert torch.equal(block[:, row], alone[:, 0]), (num_keys, num_queries, row)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_attention_sees_through_holes_padding_and_tree_masks(exact_attention, dtype):
    """A row whose allowed keys sit among masked slots (a ragged batch's holes, left padding, a tree's siblings) gets
    the bits of the same keys side by side."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 16, generator=generator).to(dtype)
    key, value = (torch.randn(1, 2, 90, 16, generator=generator).to(dtype) for _ in "kv")
    mask = torch.ones(1, 1, 3, 90, dtype=torch.bool)
    mask[..., :5] = False  # left padding
    mask[..., 40:43] = False  # a hole a shorter accepted path left
    # a tree of the bonus (slot 87) and its two children (88, 89), siblings that do not see each other
    mask[0, 0, 0, 88:] = False
    mask[0, 0, 1, 89] = False
    mask[0, 0, 2, 88] = False
    block = _attention(query, key, value, mask)
    for row in range(3):
        keep = mask[0, 0, row]
        alone = _attention(query[:, :, row : row + 1], key[:, :, keep], value[:, :, keep])
        assert torch.equal(block[:, row], alone[:, 0]), row


def _block_and_single_token_logits(target, context: int = 70, new: int = 9):
    """Logits `[1, new, V]` of one forward over `new` tokens after `context`, and of `new` one-token forwards."""
    ids = torch.randint(0, PAD, (1, context + new), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()  # sliding-window layers crop back
    with torch.no_grad():
        target(input_ids=ids[:, :context], cache=cache, use_cache=True)
        block = target(input_ids=ids[:, context:], cache=cache, use_cache=True).logits
        cache.crop(-new)
        singles = [
            target(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits
            for i in range(context, context + new)
        ]
    return block, torch.cat(singles, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_exact_block_forward_logits_equal_one_token_forwards_bitwise(exact_attention, family, dtype):
    target = make_target(family, dtype=dtype)
    optimize_for_cpu(target, exact=True)
    block, singles = _block_and_single_token_logits(target)
    assert torch.equal(block, singles)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stock_kernels_do_not_give_those_bits_the_control(dtype):
    """Without exact mode the bitwise test above fails for some family, so it shows something on this CPU. Which
    families depends on the CPU: on the AVX2 EPYC of earlier runs llama differed in both dtypes; on a Xeon with
    AMX-BF16 the tiny targets' stock bf16 products give the same bits (some weights' do not: SmolLM2's), and only
    mistral's and gemma3's sdpa (sliding windows) differ."""
    differing = []
    for family in EXACT_FAMILIES:
        target = make_target(family, dtype=dtype)
        target.set_attn_implementation("sdpa")
        block, singles = _block_and_single_token_logits(target)
        if not torch.equal(block, singles):
            differing.append(family)
    assert differing, f"stock {dtype} kernels give every family the exact bits on this CPU"


# -- the compiled row-invariant bf16 linear ---------------------------------------------------------------------------

CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
needs_avx512_bf16 = pytest.mark.skipif(
    "avx512_bf16" not in CPU_FLAGS, reason="the compiled row-invariant linear needs AVX512-BF16"
)


def forced_compiled() -> KernelChoices:
    """Kernel choices that put every exact bf16 product with an even input width on the compiled row-invariant
    kernel, instead of measuring which is faster (deterministic tests)."""

    class Forced(KernelChoices):
        def choose(self, weight, exact):
            if exact and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
                return LinearKernel((False,) * len(MEASURED_ROWS), row_invariant=True)
            return super().choose(weight, exact)

    return Forced()


@needs_avx512_bf16
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(48, 32, False), (100, 64, True), (1, 576, True)])
def test_the_compiled_linear_is_the_product_and_row_invariant(out_features, in_features, bias):
    assert compiled_linear() is not None, "the compiled row-invariant linear did not build on this AVX512-BF16 CPU"
    pack, _ = compiled_linear()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    x = torch.randn(37, in_features, generator=generator).bfloat16()
    packed = pack(weight)
    out = cpu_kernels.row_invariant_linear(x, packed, b, out_features)  # [37, out]
    reference = nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    assert (out.float() - reference).abs().max() <= 2**-7 * reference.abs().max()  # one rounding to bf16
    for start, rows in ((0, 1), (3, 2), (5, 16), (20, 17), (0, 37)):
        part = cpu_kernels.row_invariant_linear(x[start : start + rows], packed, b, out_features)
        assert torch.equal(part, out[start : start + rows])
    assert cpu_kernels.row_invariant_linear(x[None, :5], packed, b, out_features).shape == (1, 5, out_features)


@needs_avx512_bf16
def test_the_compiled_linear_competes_for_even_bf16_weights_only():
    choices = KernelChoices(repeats=1)
    times, kernel = choices._compiled(torch.randn(48, 32).bfloat16())
    assert kernel.row_invariant and len(times) == len(MEASURED_ROWS) and min(times) > 0
    assert not kernel.chunk_rows and not kernel.pad_single_row
    assert choices._compiled(torch.randn(48, 32)) is None  # fp32: oneDNN's and MKL's kernels pass the check
    assert choices._compiled(torch.randn(48, 33).bfloat16()) is None  # the kernel sums input pairs


@needs_avx512_bf16
@pytest.mark.parametrize("compiled_us", [1e-3, 1e9])
def test_fast_mode_takes_the_compiled_linear_only_where_it_is_fastest_at_every_row_count(monkeypatch, compiled_us):
    """Fast mode runs the compiled kernel where it beats the stock and the packed kernel at every measured row count
    (timings replaced here), and an exact preparation switched to fast mode packs the copy it needs."""
    measured = KernelChoices._compiled

    def timed_as_given(self, weight):
        found = measured(self, weight)
        return None if found is None else ([compiled_us] * len(MEASURED_ROWS), found[1])

    monkeypatch.setattr(KernelChoices, "_compiled", timed_as_given)
    chunked = LinearKernel((True,) * len(MEASURED_ROWS), chunk_rows=cpu_kernels.CHUNK_ROWS)

    class ExactChunked(KernelChoices):  # exact mode on the padded chunks, fast mode measured
        def choose(self, weight, exact):
            return chunked if exact else super().choose(weight, exact)

    target = make_target("llama", dtype=torch.bfloat16)
    preparation = optimize_for_cpu(target, exact=True, choices=ExactChunked(repeats=1))
    assert not any(linear.packed_weight.row_invariant is not None for linear in preparation.linears)
    ids = random_prompt(9, seed=5)[None]
    with torch.no_grad():
        exact_logits = target(ids).logits
        with preparation.fast():
            fast_kernels = {linear.kernel.row_invariant for linear in preparation.linears}
            fast_logits = target(ids).logits
        assert torch.equal(target(ids).logits, exact_logits)  # exact mode's kernels again after the block
    assert fast_kernels == {compiled_us < 1}
    has_copies = {linear.packed_weight.row_invariant is not None for linear in preparation.linears}
    assert has_copies == {compiled_us < 1}
    torch.testing.assert_close(fast_logits.float(), exact_logits.float(), atol=0.1, rtol=0.1)


@needs_avx512_bf16
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt_neox", "opt"])
def test_exact_bf16_on_the_compiled_linear_gives_one_token_bits_and_plain_tokens(family):
    target = make_target(family, dtype=torch.bfloat16)
    preparation = optimize_for_cpu(target, exact=True, choices=forced_compiled())
    assert all(linear.kernel.row_invariant for linear in preparation.linears)
    assert "on the compiled row-invariant kernel" in preparation.summary()
    block, singles = _block_and_single_token_logits(target)
    assert torch.equal(block, singles)
    prompt = random_prompt(12, seed=4)
    reference = greedy_reference(target, prompt, 40)
    draft = tree_oracle(target, [reference], 0.3, 0.1).to(torch.bfloat16)
    ours = speculative_generate(
        target, draft, prompt[None], max_new_tokens=40, tree=False if family in SLIDING else 16
    )
    assert ours.sequences[0].tolist() == reference.tolist() and ours.stats.tau > 1.5


@needs_avx512_bf16
def test_a_weight_changed_in_place_is_packed_again_for_the_compiled_linear():
    target = make_target("llama", dtype=torch.bfloat16)
    optimize_for_cpu(target, exact=True, choices=forced_compiled())
    linear = target.model.layers[0].mlp.down_proj
    x = torch.randn(3, linear.in_features).bfloat16()
    with torch.no_grad():
        linear.weight.mul_(-2.0)
        expected = nn.functional.linear(x.float(), linear.weight.float())
        assert (linear(x).float() - expected).abs().max() <= 2**-7 * expected.abs().max()


# -- token identity ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_exact_mode_bf16_greedy_is_token_identical_on_both_paths(family):
    """bf16 can round a block forward's logits differently from one-token forwards with stock kernels; exact mode
    (its linears in 16-row chunks) makes greedy speculative decoding (trees, chains,
    `generate(assistant_model=...)`) plain decoding's tokens."""
    target = make_target(family, dtype=torch.bfloat16)
    optimize_for_cpu(target, exact=True)
    prompt = random_prompt(12, seed=4)
    reference = greedy_reference(target, prompt, 50)
    tree = False if family in SLIDING else 16
    draft = tree_oracle(target, [reference], 0.3, 0.1).to(torch.bfloat16)
    ours = speculative_generate(target, draft, prompt[None], max_new_tokens=50, tree=tree)
    assert ours.sequences[0].tolist() == reference.tolist()
    assert ours.stats.tau > 1.5
    chain = tree_oracle(target, [reference], 0.0, 0.2).to(torch.bfloat16)
    with torch.no_grad():
        assisted = target.generate(prompt[None], assistant_model=chain, max_new_tokens=50, do_sample=False)
    assert assisted[0].tolist() == reference.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_mode_ragged_batches_match_each_row_alone(dtype):
    target = make_target("qwen3", dtype=dtype)
    optimize_for_cpu(target, exact=True)
    prompts = [random_prompt(length, seed=length) for length in (3, 17, 9)]
    references = [greedy_reference(target, p, 30) for p in prompts]
    input_ids, mask = left_pad(prompts)
    draft = tree_oracle(target, references, 0.3, 0.2).to(dtype)
    draft.references = [
        torch.cat([torch.full((input_ids.shape[1] - len(p),), PAD), r]) for p, r in zip(prompts, references)
    ]
    out = speculative_generate(target, draft, input_ids, mask, max_new_tokens=30, tree=16)
    with torch.no_grad():
        plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    width = input_ids.shape[1]
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        new = reference[len(prompt) :].tolist()
        assert out.sequences[row, width:].tolist() == new
        assert plain[row, width:].tolist() == new
    assert out.stats.tree_rounds > 0


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3"])
def test_fast_mode_fp32_is_lossless_against_plain_decoding_on_the_same_kernels(family):
    target = make_target(family)
    preparation = optimize_for_cpu(target, choices=forced(True))
    assert preparation.active and all(isinstance(m, PreparedLinear) for m in preparation.linears)
    prompt = random_prompt(20, seed=3)
    reference = greedy_reference(target, prompt, 40)
    draft = tree_oracle(target, [reference], 0.3, 0.1)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=40, tree=16)
    assert out.sequences[0].tolist() == reference.tolist()


def test_speculative_generate_prepares_a_cpu_target_once_unless_told_not_to():
    target = make_target("llama")
    draft = tree_oracle(target, [greedy_reference(target, random_prompt(8, 1), 10)], 0.0, 0.0)
    speculative_generate(target, draft, random_prompt(8, 1)[None], max_new_tokens=10, optimize_cpu=False)
    assert not is_optimized_for_cpu(target)
    speculative_generate(target, draft, random_prompt(8, 1)[None], max_new_tokens=10)
    assert is_optimized_for_cpu(target) and is_optimized_for_cpu(draft)
    modules = [type(m) for m in target.modules()]
    speculative_generate(target, draft, random_prompt(8, 1)[None], max_new_tokens=10)  # prepared once, kept
    assert [type(m) for m in target.modules()] == modules


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_reduced_vocabulary_drafters_head_is_prepared_with_the_drafter(dtype):
    """The drafter's product with the target head's rows of its vocabulary gets a prepared kernel too, gives the
    logits of the stock product (to rounding in bf16), and greedy decoding stays identical to plain decoding."""
    from helpers import make_draft

    from hf_dflash.decoding.cpu_kernels import optimize_target_and_draft_for_cpu

    target = make_target("llama", dtype=dtype)
    draft = make_draft(target, block_size=4, draft_vocab_size=40).to(dtype)
    draft.set_draft_vocabulary(torch.arange(0, 80, 2))
    lm_head = target.get_output_embeddings()
    hidden = torch.randn(2, 3, target.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    stock = draft.draft_logits(hidden, lm_head)
    assert type(draft.draft_head(lm_head)) is nn.Linear
    optimize_target_and_draft_for_cpu(target, draft, exact=True)
    head = draft.draft_head(lm_head)
    assert isinstance(head, PreparedLinear) and torch.equal(head.weight, lm_head.weight[0:80:2])
    prepared = draft.draft_logits(hidden, lm_head)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert prepared.shape == stock.shape == (2, 3, 40) and torch.allclose(prepared.float(), stock.float(), **tolerance)
    prompt = random_prompt(12, seed=5)
    reference = greedy_reference(target, prompt, 24)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=24)
    assert out.sequences[0].tolist() == reference.tolist()


def test_a_second_drafter_is_prepared_on_a_prepared_target_alone():
    """`optimize_draft_for_cpu` prepares another drafter of a prepared target (its head product too) with the target's
    kernel choices, leaves the target's preparation as it was, and greedy decoding with either drafter stays identical
    to plain decoding."""
    from helpers import make_draft

    from hf_dflash.decoding.cpu_kernels import optimize_draft_for_cpu, optimize_target_and_draft_for_cpu

    target = make_target("llama", dtype=torch.bfloat16)
    first = make_draft(target, block_size=4).to(torch.bfloat16)
    second = make_draft(target, block_size=4, draft_vocab_size=40).to(torch.bfloat16)
    second.set_draft_vocabulary(torch.arange(0, 80, 2))
    preparation = optimize_target_and_draft_for_cpu(target, first, exact=True)
    target_modules = [type(m) for m in target.modules()]
    with pytest.raises(ValueError, match="already prepared"):
        optimize_target_and_draft_for_cpu(target, second, exact=True)
    assert not is_optimized_for_cpu(second)  # the refusal prepared nothing
    second_preparation = optimize_draft_for_cpu(second, target, preparation.choices)
    assert is_optimized_for_cpu(second) and second_preparation.choices is preparation.choices
    assert isinstance(second.draft_head(target.get_output_embeddings()), PreparedLinear)
    assert [type(m) for m in target.modules()] == target_modules
    prompt = random_prompt(12, seed=6)
    reference = greedy_reference(target, prompt, 20)
    for draft in (first, second):
        out = speculative_generate(target, draft, prompt[None], max_new_tokens=20)
        assert out.sequences[0].tolist() == reference.tolist()
    second_preparation.undo()
    assert not is_optimized_for_cpu(second) and is_optimized_for_cpu(target)


# -- the same model ----------------------------------------------------------------------------------------------------


def test_saved_weights_are_the_originals_and_the_head_stays_tied(tmp_path):
    target = make_target("llama")
    target.config.tie_word_embeddings = True
    target.tie_weights()
    original = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    preparation = optimize_for_cpu(target, choices=forced(True))
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert list(target.state_dict()) == list(original)
    target.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(tensor, original[name]), name
    head_bytes = target.lm_head.weight.numel() * 4
    assert preparation.packed_bytes >= head_bytes


def test_linears_sharing_a_weight_share_one_packed_copy():
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False))
    model[1].weight = model[0].weight
    preparation = optimize_for_cpu(model, choices=forced(True))
    assert model[0].packed_weight is model[1].packed_weight
    assert preparation.packed_bytes == 32 * 48 * 4


def test_a_weight_changed_in_place_is_packed_again():
    model = nn.Sequential(nn.Linear(32, 48))
    optimize_for_cpu(model, choices=forced(True))
    x = torch.randn(4, 32)
    with torch.no_grad():
        model[0].weight.mul_(-2.0)
        assert torch.allclose(model(x), nn.functional.linear(x, model[0].weight, model[0].bias), atol=1e-5)


def test_undo_restores_stock_modules_attention_and_bits():
    target = make_target("llama")
    target.set_attn_implementation("sdpa")
    ids = random_prompt(9, seed=2)[None]
    with torch.no_grad():
        stock = target(ids).logits
    preparation = optimize_for_cpu(target, choices=forced(True))
    assert target.config._attn_implementation == FAST_ATTENTION
    with torch.no_grad():
        assert torch.allclose(target(ids).logits, stock, atol=1e-4)
    preparation.undo()
    assert not is_optimized_for_cpu(target) and target.config._attn_implementation == "sdpa"
    assert all(type(m) is not PreparedLinear for m in target.modules())
    with torch.no_grad():
        assert torch.equal(target(ids).logits, stock)
    exact = optimize_for_cpu(target, exact=True)
    assert target.config._attn_implementation == EXACT_ATTENTION
    exact.undo()
    assert target.config._attn_implementation == "sdpa"


def test_an_exact_preparation_runs_fast_modes_kernels_inside_fast_and_its_own_after():
    """`CPUPreparation.fast` (the benchmark's `plain_fast`): inside, the logits of a model prepared fast with the same
    choices, bitwise, and weights exact mode left unpacked packed; after, exact mode's kernels, attention and bits."""

    class ExactStockFastPacked(KernelChoices):
        def choose(self, weight, exact):  # exact: stock kernel in chunks, never packed; fast: packed at every count
            return LinearKernel((not exact,) * len(MEASURED_ROWS), chunk_rows=16 if exact else 0)

    ids = random_prompt(9, seed=2)[None]
    fast_target = make_target("llama")
    fast_target.set_attn_implementation("sdpa")
    optimize_for_cpu(fast_target, choices=ExactStockFastPacked())
    target = make_target("llama")
    target.set_attn_implementation("sdpa")
    preparation = optimize_for_cpu(target, exact=True, choices=ExactStockFastPacked())
    assert preparation.packed_bytes == 0 and all(linear.packed_weight.packed is None for linear in preparation.linears)
    with torch.no_grad():
        exact = target(ids).logits
        with preparation.fast():
            assert target.config._attn_implementation == FAST_ATTENTION
            assert all(linear.packed_weight.packed is not None for linear in preparation.linears)
            assert torch.equal(target(ids).logits, fast_target(ids).logits)
        assert target.config._attn_implementation == EXACT_ATTENTION
        assert all(linear.kernel.chunk_rows == 16 for linear in preparation.linears)
        assert torch.equal(target(ids).logits, exact)
        assert not torch.equal(exact, fast_target(ids).logits)  # the two modes' bits differ: the switch mattered
    assert preparation.packed_bytes > 0  # the copies fast mode packed are counted, and kept for the next entry


def test_a_lora_target_is_prepared_under_its_adapter_and_stays_lossless():
    torch.manual_seed(0)
    base = make_target("llama")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    target = get_peft_model(base, config).eval()
    adapter_before = {k: v.clone() for k, v in target.state_dict().items() if "lora" in k}
    optimize_for_cpu(target, exact=True)
    q_proj = base.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, PreparedLinear)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in adapter_before.items())
    prompt = random_prompt(10, seed=5)
    reference = greedy_reference(target, prompt, 30)
    draft = tree_oracle(base, [reference], 0.2, 0.1)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=30, tree=16)
    assert out.sequences[0].tolist() == reference.tolist()


def test_models_off_the_cpu_are_left_as_they_are(device):
    target = make_target("llama").to("meta" if device == "cpu" else device)
    preparation = optimize_for_cpu(target)
    assert not preparation.active and not is_optimized_for_cpu(target)


def test_without_onednn_ops_the_stock_kernels_run_and_say_so(monkeypatch):
    warnings = []
    monkeypatch.setattr(cpu_kernels, "packed_kernels_available", lambda: False)
    monkeypatch.setattr(cpu_kernels.logger, "warning", warnings.append)
    cpu_kernels._log_fallback_once.cache_clear()
    target = make_target("llama")
    ids = random_prompt(9, seed=2)[None]
    with torch.no_grad():
        stock = target(ids).logits
    preparation = optimize_for_cpu(target)
    assert not any(linear.kernel.uses_any_packed for linear in preparation.linears)
    assert any("no oneDNN linear ops" in message for message in warnings)
    with torch.no_grad():
        assert torch.equal(target(ids).logits, stock)


def test_a_dtype_onednn_cannot_pack_falls_back_with_a_warning(monkeypatch):
    warnings = []

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: this path needs another CPU")

    monkeypatch.setattr(cpu_kernels, "pack_weight", refuse)
    monkeypatch.setattr(cpu_kernels.logger, "warning", warnings.append)
    cpu_kernels._log_fallback_once.cache_clear()
    preparation = optimize_for_cpu(make_target("qwen2"))
    assert preparation.linears and not any(linear.kernel.uses_any_packed for linear in preparation.linears)
    assert any("cannot pack" in message for message in warnings)


def _clear_compiled_kernels(compiled_kernels) -> None:
    cached = (compiled_kernels._built, compiled_kernels.compiled_attention, compiled_kernels.compiled_linear)
    for function in (*cached, compiled_kernels.compiled_sort):
        function.cache_clear()


@pytest.mark.parametrize(
    "missing",
    [
        ("_missing_tools", lambda: "ninja is not installed; `pip install ninja`"),
        ("SOURCES", {"row_invariant": [Path("/nonexistent.cpp")], "sort": [Path("/nonexistent.cpp")]}),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_without_the_compiled_kernels_exact_mode_says_why_and_stays_exact(monkeypatch, missing, dtype):
    """No compiler or ninja, or a build that fails: a warning with the reason for each kernel exact mode asks for
    (the linear in bf16 only), then the pure-torch attention and the padded products, still bitwise exact."""
    from hf_dflash.decoding import compiled_kernels

    warnings = []
    monkeypatch.setattr(compiled_kernels, *missing)
    monkeypatch.setattr(compiled_kernels, "_build_name", lambda group: f"hf_dflash_test_missing_{group}_kernel")
    monkeypatch.setattr(compiled_kernels.logger, "warning", warnings.append)
    _clear_compiled_kernels(compiled_kernels)
    try:
        target = make_target("qwen2", dtype=dtype)
        preparation = optimize_for_cpu(target, exact=True)
        block, singles = _block_and_single_token_logits(target)
        warnings = list(warnings)  # what preparing and running the model said
        assert compiled_kernels.compiled_attention() is None and compiled_kernels.compiled_linear() is None
    finally:
        _clear_compiled_kernels(compiled_kernels)
    assert torch.equal(block, singles)
    assert not any(linear.kernel.row_invariant for linear in preparation.linears)
    expected = "pip install ninja" if missing[0] == "_missing_tools" else "building them failed"
    assert len(warnings) == (2 if dtype == torch.bfloat16 else 1) and all(expected in w for w in warnings)
    assert "pure-torch" in warnings[-1]
    if dtype == torch.bfloat16:
        assert "padded chunks of 16 rows" in warnings[0]


def test_a_failed_preparation_leaves_the_model_stock():
    model = nn.Sequential(nn.Linear(32, 48))  # no set_attn_implementation: exact mode cannot switch its attention
    with pytest.raises(ValueError, match="PreTrainedModel"):
        optimize_for_cpu(model, exact=True)
    assert type(model[0]) is nn.Linear and not hasattr(model[0], "kernel")


def test_preparing_twice_is_refused_with_the_fix():
    target = make_target("llama")
    optimize_for_cpu(target)
    with pytest.raises(ValueError, match="already prepared.*undo"):
        optimize_for_cpu(target)
