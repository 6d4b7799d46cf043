"""Sampling is lossless: tokens drafted by `q` and accepted/rejected by Leviathan's rule follow the target's own
distribution. We compare sampled (t1, t2, t3) against the target's exact joint distribution, enumerated over a small
vocabulary, with a chi-square test; a negative control shows the test does reject a biased sampler."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, LlamaConfig, Qwen3Config
from transformers.generation import TopPLogitsWarper

from hf_dflash import DFlashForDrafting, optimize_for_cpu, speculative_generate
from hf_dflash.decoding import compiled_kernels, cpu_kernels, speculative
from hf_dflash.decoding.speculative import (
    NucleusOfTopCandidates,
    TopPBySortedValues,
    _sampling_warpers,
    accept_sampled_lazily,
    proposal_warpers,
)
from hf_dflash.model.generation_dflash import sample_categorical

VOCAB = 6
PROMPT = torch.tensor([[1, 4, 2, 0, 3]])


SMALL = {"vocab_size": VOCAB, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
CONFIGS = {
    "llama": lambda: LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **SMALL
    ),
    "qwen3": lambda: Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **SMALL,
    ),
    "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False, **SMALL),
}


def peaky_target(family: str = "llama", seed: int = 0):
    """A tiny target with context-dependent, far-from-uniform next-token distributions."""
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(25.0)
    return target


def exact_joint(target, generation_kwargs: dict, length: int = 3) -> dict[tuple, float]:
    """P(t1..t_length | PROMPT) under the target with the same warpers `generate` applies."""
    warpers = _sampling_warpers(target.generation_config.__class__(**generation_kwargs))
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        ids = torch.cat(
            [PROMPT.expand(len(prefixes), -1), torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)], 1
        )
        with torch.no_grad():
            logits = target(ids).logits[:, -1].float()
        probs = warpers(ids, logits).softmax(-1)
        joint = {
            prefix + (t,): joint[prefix] * float(probs[i, t])
            for i, prefix in enumerate(prefixes)
            for t in range(VOCAB)
        }
    return {k: v for k, v in joint.items() if v > 0}


def chi_square_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    n = len(samples)
    counts = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    assert set(counts) <= set(exact), "sampled a sequence the target gives probability zero"
    big = [cell for cell, p in exact.items() if p * n >= 5]
    observed = [counts.get(cell, 0) for cell in big]
    expected = [exact[cell] * n for cell in big]
    rest_expected = n - sum(expected)
    if rest_expected > 1e-9:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    total = sum(expected)
    return float(chisquare(observed, [e * n / total for e in expected]).pvalue)


def random_draft(target) -> DFlashForDrafting:
    torch.manual_seed(7)
    # losslessness does not need an unused mask row
    draft = DFlashForDrafting.from_target(target, num_hidden_layers=1, block_size=4, mask_token_id=VOCAB - 1).eval()
    with torch.no_grad():  # a vague draft (q near uniform): accepted often enough that both paths run
        draft.norm.weight.mul_(0.05)
    return draft


def test_the_random_draft_is_in_eval_mode():
    draft = random_draft(peaky_target())
    assert not any(module.training for module in draft.modules())


def samples_from_generate(target, draft, n: int, generation_kwargs: dict) -> list[tuple]:
    """(t1, t2, t3) of `n` runs of `target.generate(..., assistant_model=draft)`."""
    samples = []
    for _ in range(n):
        out = target.generate(PROMPT, max_new_tokens=4, assistant_model=draft, **generation_kwargs)
        samples.append(tuple(out[0, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist()))
    return samples


SETTINGS = [
    {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
    {"do_sample": True, "temperature": 0.7, "top_k": 4, "top_p": 0.9},
]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("generation_kwargs", SETTINGS, ids=["plain", "temperature-topk-topp"])
@pytest.mark.parametrize("sample_proposals", [True, False], ids=["q-samples", "argmax-one-hot-q"])
def test_speculative_generate_samples_the_target_distribution(family, generation_kwargs, sample_proposals):
    target = peaky_target(family)
    draft = random_draft(target)
    exact = exact_joint(target, generation_kwargs)
    n = 6000
    torch.manual_seed(0)
    # one batch of n identical prompts; 4 new tokens so the first round drafts 2 (t2, t3) and t4 is a bonus
    out = speculative_generate(
        target,
        draft,
        PROMPT.expand(n, -1),
        max_new_tokens=4,
        sample_proposals=sample_proposals,
        **generation_kwargs,
    )
    samples = [tuple(row) for row in out.sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist()]
    histogram = out.stats.histogram
    assert histogram[1] > 0  # rejections happened
    if sample_proposals or not generation_kwargs["top_k"]:  # the random draft's argmax is rarely in the target's top-4
        assert histogram[3] > 0  # ... and full acceptances
    assert chi_square_pvalue(samples, exact) > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("chunked", [False, True], ids=["as-chosen", "16-row-chunks"])
def test_exact_cpu_mode_samples_the_target_distribution(monkeypatch, family, chunked):
    """The fp32 target in exact CPU mode (the compiled row-invariant attention; linears as this CPU's check chooses,
    or forced into 16-row chunks as where no kernel passes), sampled by `speculative_generate` against the prepared
    target's own enumerated distribution."""
    if chunked:
        monkeypatch.setattr(cpu_kernels, "_row_invariant", lambda product, weight: product.args[0].chunk_rows > 0)
    target = peaky_target(family)
    preparation = optimize_for_cpu(target, exact=True)
    if chunked:
        assert all(linear.kernel.chunk_rows for linear in preparation.linears)
    draft = random_draft(target)
    generation_kwargs = SETTINGS[1]
    exact = exact_joint(target, generation_kwargs)
    torch.manual_seed(4)
    out = speculative_generate(target, draft, PROMPT.expand(3000, -1), max_new_tokens=4, **generation_kwargs)
    samples = [tuple(row) for row in out.sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist()]
    assert out.stats.histogram[1] > 0 and out.stats.histogram[3] > 0
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_generate_with_assistant_samples_the_target_distribution():
    target = peaky_target()
    draft = random_draft(target)
    generation_kwargs = SETTINGS[1]
    exact = exact_joint(target, generation_kwargs)
    torch.manual_seed(1)
    assert chi_square_pvalue(samples_from_generate(target, draft, 1500, generation_kwargs), exact) > 1e-3


@pytest.mark.parametrize("generation_kwargs", SETTINGS, ids=["plain", "temperature-topk-topp"])
@pytest.mark.parametrize("sample_proposals", [True, False], ids=["q-samples", "argmax-one-hot-q"])
def test_reduced_draft_vocabulary_samples_the_target_distribution(generation_kwargs, sample_proposals):
    """q is zero outside the draft vocabulary (warped there, spread over the whole vocabulary after); tokens outside
    still come from the residual with the target's odds."""
    target = peaky_target("qwen3")
    torch.manual_seed(7)
    draft = DFlashForDrafting.from_target(
        target, num_hidden_layers=1, block_size=4, mask_token_id=VOCAB - 1, draft_vocab_size=3
    ).eval()
    draft.set_draft_vocabulary(torch.tensor([0, 2, 3]))
    with torch.no_grad():
        draft.norm.weight.mul_(0.05)
    exact = exact_joint(target, generation_kwargs)
    torch.manual_seed(2)
    out = speculative_generate(
        target,
        draft,
        PROMPT.expand(6000, -1),
        max_new_tokens=4,
        sample_proposals=sample_proposals,
        **generation_kwargs,
    )
    samples = [tuple(row) for row in out.sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist()]
    assert out.stats.histogram[1] > 0
    if sample_proposals or not generation_kwargs["top_k"]:
        assert out.stats.histogram[3] > 0
    assert chi_square_pvalue(samples, exact) > 1e-3
    if sample_proposals:
        torch.manual_seed(3)
        assert chi_square_pvalue(samples_from_generate(target, draft, 1000, generation_kwargs), exact) > 1e-3


def test_the_chi_square_test_rejects_a_biased_sampler(monkeypatch):
    """Negative control: accepting every draft (u = 0 in the acceptance test) samples from `q`, not `p`; the same
    test must reject it, or the tests above would prove nothing."""
    target = peaky_target()
    draft = random_draft(target)
    exact = exact_joint(target, SETTINGS[0])
    monkeypatch.setattr(torch, "rand_like", torch.zeros_like)
    torch.manual_seed(0)
    out = speculative_generate(target, draft, PROMPT.expand(6000, -1), max_new_tokens=4, **SETTINGS[0])
    samples = [tuple(row) for row in out.sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist()]
    samples = [sample for sample in samples if sample in exact]
    assert chi_square_pvalue(samples, exact) < 1e-6


def test_enumeration_covers_the_whole_distribution():
    assert abs(sum(exact_joint(peaky_target(), SETTINGS[0]).values()) - 1.0) < 1e-5


def test_sampled_acceptance_asks_for_a_positions_target_distribution_only_where_every_draft_before_it_was_accepted():
    vocab, num_draft = 5, 3
    draft_ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    q = torch.nn.functional.one_hot(draft_ids, vocab).float()  # [2, 3, V]: each draft certain under q
    p = torch.full((2, num_draft + 1, vocab), 0.0)
    p[0, :, 4] = 1.0  # row 0: the target never proposes the drafted tokens, so it rejects at position 0 -> token 4
    p[1, :num_draft] = q[1]  # row 1: the target agrees at every position, then its own token is 0
    p[1, num_draft, 0] = 1.0
    asked = []

    def target_probs_at(rows, position):
        asked.append((rows.tolist(), position))
        return p[rows, position]

    num_accepted, next_token = accept_sampled_lazily(draft_ids, q, target_probs_at)
    assert num_accepted.tolist() == [0, 3] and next_token.tolist() == [4, 0]
    assert asked == [([0, 1], 0), ([1], 1), ([1], 2), ([1], 3)]  # row 0's later positions are never warped


def test_a_proposal_nucleus_is_top_p_among_its_candidates():
    scores = torch.randn(50, 1000, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.zeros(50, 1, dtype=torch.long)
    nucleus = TopPLogitsWarper(0.9)(ids, scores.clone()).isfinite()
    assert torch.equal(NucleusOfTopCandidates(0.9, candidates=1000)(ids, scores.clone()).isfinite(), nucleus)
    capped = NucleusOfTopCandidates(0.9, candidates=20)(ids, scores.clone()).isfinite()
    assert (capped.sum(-1) == torch.minimum(nucleus.sum(-1), torch.tensor(20))).all() and not (capped & ~nucleus).any()
    warpers = proposal_warpers(
        _sampling_warpers(GenerationConfig(do_sample=True, temperature=0.7, top_p=0.95, top_k=0))
    )
    assert [type(w).__name__ for w in warpers] == ["TemperatureLogitsWarper", "NucleusOfTopCandidates"]


def test_sample_categorical_draws_each_row_from_its_own_unnormalised_distribution():
    probs = torch.tensor(
        [[[0.0, 2.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 3.0]], [[5.0, 0.0, 0.0, 0.0, 0.0], [1.0] * 5]]
    )
    torch.manual_seed(0)
    draws = torch.stack([sample_categorical(probs) for _ in range(4000)])  # [n, 2, 2]
    assert draws.shape == (4000, 2, 2) and draws.dtype == torch.long
    for row, col in ((0, 0), (0, 1), (1, 0), (1, 1)):
        counts = torch.bincount(draws[:, row, col], minlength=5)
        expected = probs[row, col] / probs[row, col].sum() * 4000
        assert counts[expected == 0].sum() == 0, "drew a token of zero mass"
        if (expected > 0).sum() > 1:
            assert chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-3


def test_sample_categorical_never_draws_past_the_last_token_with_mass(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda shape, device=None: torch.ones(shape, device=device))  # u = 1, the edge
    assert sample_categorical(torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])).tolist() == [1, 3]
    monkeypatch.setattr(torch, "rand", lambda shape, device=None: torch.zeros(shape, device=device))  # u = 0
    assert sample_categorical(torch.tensor([[0.0, 0.0, 0.3, 0.7]])).tolist() == [2]


@pytest.mark.parametrize("bad", [[0.0, 0.0], [float("nan"), 1.0]])
def test_sample_categorical_rejects_a_row_without_mass(bad):
    with pytest.raises(ValueError, match="sums to zero"):
        sample_categorical(torch.tensor([[0.5, 0.5], bad]))


@pytest.mark.parametrize("sort", ["compiled", "numpy"])
def test_top_p_by_sorted_values_is_the_top_p_warper_bit_for_bit(monkeypatch, sort):
    if sort == "numpy":
        monkeypatch.setattr(speculative, "compiled_sort", lambda: None)
    elif compiled_kernels.compiled_sort() is None:
        pytest.skip("the compiled sort cannot be built here (no compiler or ninja)")
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(64, 1, dtype=torch.long)
    scores = torch.randn(64, 2000, generator=generator) * torch.linspace(0.5, 8, 64)[:, None]  # flat to peaked
    scores[:8, ::3] = float("-inf")  # rows a top-k warper already cut
    scores[8:16] = scores[8:16].round()  # many ties, away from the boundary and across it
    fallbacks = []
    warper_call = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda *args: fallbacks.append(1) or warper_call(*args))
    for top_p in (0.0, 0.5, 0.9, 0.95, 1.0):
        for rows in (slice(0, 8), slice(8, 16), slice(16, 64), slice(20, 21)):
            expected = warper_call(TopPLogitsWarper(top_p), ids[rows], scores[rows].clone())
            fallbacks.clear()
            got = TopPBySortedValues(top_p)(ids[rows], scores[rows].clone())
            assert torch.equal(got, expected), (top_p, rows)
            if rows != slice(8, 16):  # continuous scores never tie at the boundary: no fallback to the index sort
                assert not fallbacks, (top_p, rows)
    # top-p 0.5 keeps some of three tied tokens: only the warper's index order says which
    tied = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    fallbacks.clear()
    assert torch.equal(
        TopPBySortedValues(0.5)(ids[:1], tied.clone()), warper_call(TopPLogitsWarper(0.5), ids[:1], tied)
    )
    assert fallbacks == [1]
    # a NaN: the sorts place it differently, so the warper's own sort decides
    with_nan = scores[16:18].clone()
    with_nan[0, 5] = float("nan")
    fallbacks.clear()
    got, expected = (
        TopPBySortedValues(0.9)(ids[:2], with_nan.clone()),
        warper_call(TopPLogitsWarper(0.9), ids[:2], with_nan),
    )
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert fallbacks == [1]


def test_the_compiled_sort_gives_numpys_sorted_values():
    sort = compiled_kernels.compiled_sort()
    if sort is None:
        pytest.skip("the compiled sort cannot be built here (no compiler or ninja)")
    generator = torch.Generator().manual_seed(0)
    rows = [
        torch.randn(3, 49152, generator=generator) * 3,  # a vocabulary's logits
        (torch.randn(2, 5000, generator=generator) * 4).round(),  # many ties
        torch.full((1, 300), 2.5),  # one value: every digit the same, no pass runs
        torch.tensor([[0.0, -0.0, float("-inf"), float("inf"), 1e-40, -1e-40, 3.0, -3.0, 3.0, -0.0]]),
        torch.randn(4, 1, generator=generator),
        torch.empty(2, 0),
    ]
    warped = torch.randn(2, 1000, generator=generator)
    warped[:, ::2] = float("-inf")  # a top-k warper's output
    for values in [*rows, warped, torch.randn(3, 777, generator=generator).t()]:  # the last one not contiguous
        expected = torch.from_numpy(np.sort(values.numpy(), axis=-1))
        assert torch.equal(sort(values), expected)  # as values: -0.0 and +0.0 compare equal, in either order
    with pytest.raises(RuntimeError, match="2D float32"):
        sort(torch.zeros(3, dtype=torch.float64)[None])


def test_without_the_compiled_sort_top_p_says_why_and_keeps_its_bits(monkeypatch):
    warnings = []
    monkeypatch.setattr(compiled_kernels, "_missing_tools", lambda: "ninja is not installed; `pip install ninja`")
    monkeypatch.setattr(compiled_kernels.logger, "warning", warnings.append)
    compiled_kernels.compiled_sort.cache_clear()
    compiled_kernels._built.cache_clear()
    try:
        scores = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 3
        ids = torch.zeros(4, 1, dtype=torch.long)
        got = TopPBySortedValues(0.9)(ids, scores.clone())
        TopPBySortedValues(0.9)(ids, scores.clone())
    finally:
        compiled_kernels.compiled_sort.cache_clear()
        compiled_kernels._built.cache_clear()
    assert torch.equal(got, TopPLogitsWarper(0.9)(ids, scores.clone()))
    assert len(warnings) == 1 and "pip install ninja" in warnings[0] and "NumPy's sort" in warnings[0]
