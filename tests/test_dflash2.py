"""DFlash2 drafters: the published layout, the selector's math against plain loops, losslessness and bad input.

The reference computations here are written from the DFlash2 spec (`research/dflash2.md` on the shelf) with plain
Python loops over indices, not with the library's code: the convolution `sum_tau (base[tau, c] + D[t, tau, c // gs])
* x[t - tau, c]` inside a block, the unary transform `cap * tanh(z * m / cap)`, the top-K candidates, the lattice
`U[c] + sum_r A[pred, r] * P[r] * B[c, r]` and the greedy walk conditioned on its own previous choice.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from datasets import Dataset
from helpers import (
    FAMILIES,
    PAD,
    VOCAB,
    greedy_reference,
    left_pad,
    make_draft,
    make_oracle,
    make_target,
    save_target_and_records,
)
from safetensors import safe_open
from safetensors.torch import save_file
from test_sampling import SETTINGS, chi_square_pvalue, exact_joint, peaky_target, samples_from_generate
from test_training import _args, _regenerated

from hf_dflash import DFlashConfig, DFlashForDrafting, speculative_generate
from hf_dflash.model.modeling_dflash import read_draft_config
from hf_dflash.model.selector_dflash import DFlashSublayerConv
from hf_dflash.training import DFlashTrainer, DFlashTrainingArguments
from hf_dflash.training.draft_init import dflash2_from_dflash, reduce_selector_rank, set_selector_top_k
from hf_dflash.training.loss import SelectorTerm, block_loss, selector_cross_entropy

HIDDEN, RANK, TOP_K, BLOCK = 64, 8, 4, 4
SELECTOR = {"variant": "dflash2", "selector_rank": RANK, "selector_top_k": TOP_K}


# ---------------------------------------------------------------------------------------------------------------------
# A checkpoint in the published layout, built by hand
# ---------------------------------------------------------------------------------------------------------------------


def published_config() -> dict:
    """A `DFlash2DraftModel` config.json shaped like the released ones (Muse-Glimmer's keys), sizes scaled down."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "is_causal": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "max_position_embeddings": 512,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": 3,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 64,
        "tie_word_embeddings": False,
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": VOCAB,
        "dflash_config": {
            "block_size": BLOCK,
            "mask_token_id": PAD,
            "target_layer_ids": [0, 2],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": RANK,
            "selector_top_k": TOP_K,
            "output_multiplier": 0.5,
            "final_logit_softcapping": 20.0,
        },
    }


def published_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the released checkpoints' safetensors header (names and shape pattern), random values."""
    generator = torch.Generator().manual_seed(seed)
    groups = HIDDEN // 16

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    tensors = {
        "fc.weight": rand(HIDDEN, 2 * HIDDEN),
        "hidden_norm.weight": 1 + rand(HIDDEN),
        "norm.weight": 1 + rand(HIDDEN),
        "candidate_selector.hidden_projection.weight": rand(RANK, HIDDEN),
        "candidate_selector.predecessor_codebook": rand(VOCAB, RANK, scale=1.0),
        "candidate_selector.successor_codebook": rand(VOCAB, RANK, scale=1.0),
    }
    for i in range(2):
        layer = f"layers.{i}."
        tensors |= {
            layer + "input_layernorm.weight": 1 + rand(HIDDEN),
            layer + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
            layer + "self_attn.q_proj.weight": rand(64, HIDDEN),
            layer + "self_attn.k_proj.weight": rand(32, HIDDEN),
            layer + "self_attn.v_proj.weight": rand(32, HIDDEN),
            layer + "self_attn.o_proj.weight": rand(HIDDEN, 64),
            layer + "self_attn.q_norm.weight": 1 + rand(16),
            layer + "self_attn.k_norm.weight": 1 + rand(16),
            layer + "mlp.gate_proj.weight": rand(96, HIDDEN),
            layer + "mlp.up_proj.weight": rand(96, HIDDEN),
            layer + "mlp.down_proj.weight": rand(HIDDEN, 96),
            layer + "attention_conv.base_kernel": 1 + rand(2, 2, HIDDEN),
            layer + "attention_conv.kernel_projection.weight": rand(2 * 2 * groups, HIDDEN),
            layer + "mlp_conv.base_kernel": 1 + rand(2, 2, HIDDEN),
            layer + "mlp_conv.kernel_projection.weight": rand(2 * 2 * groups, HIDDEN),
        }
    return tensors


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture
def published(tmp_path):
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(published_config()))
    save_file(published_tensors(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_published_checkpoint_loads_every_tensor(published):
    draft = DFlashForDrafting.from_pretrained(published)
    config = draft.config
    assert config.variant == "dflash2" and config.block_size == BLOCK and config.mask_token_id == PAD
    assert (config.selector_rank, config.selector_top_k, config.conv_group_size) == (RANK, TOP_K, 16)
    assert config.output_multiplier == 0.5 and config.final_logit_softcapping == 20.0
    assert config.target_layer_ids == [0, 2] and not config.causal_sliding_attention
    state = draft.state_dict()
    for name, tensor in published_tensors().items():
        assert torch.equal(state[name], tensor), name
    alone = read_draft_config(published).to_dict() | {"_name_or_path": config.name_or_path}
    assert alone == config.to_dict()  # the config alone, read the same way


def test_published_checkpoint_round_trips_through_the_zlab_layout(published, target, tmp_path):
    draft = DFlashForDrafting.from_pretrained(published)
    draft.save_pretrained(tmp_path / "out", layout="z-lab", target=target)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    original = published_config()
    assert written["architectures"] == ["DFlash2DraftModel"] and written["model_type"] == "qwen3"
    assert written["is_causal"] is False
    for key, value in original["dflash_config"].items():
        assert written["dflash_config"][key] == value, key
    assert written["dflash_config"]["sample_from_anchor"] is False
    assert "variant" not in written and "selector_rank" not in written  # nested only, as published
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(published_tensors())
        for name, tensor in published_tensors().items():
            assert torch.equal(weights.get_tensor(name), tensor), name
    reloaded = DFlashForDrafting.from_pretrained(tmp_path / "out")
    assert reloaded.config.input_embedding_scale == 1.0  # measured on the target by the export, as for v1
    ignored = {"_name_or_path": None, "input_embedding_scale": None}
    assert reloaded.config.to_dict() | ignored == draft.config.to_dict() | ignored


# ---------------------------------------------------------------------------------------------------------------------
# The math, against plain loops
# ---------------------------------------------------------------------------------------------------------------------


def loop_conv(x, coefficients, base, side, group_size, block_size):
    """`out[b, t, c] = sum_tau (base[side, tau, c] + D[b, t, side, tau, c // gs]) * x[b, t - tau, c]`, in-block."""
    batch, length, hidden = x.shape
    out = torch.zeros_like(x)
    for b in range(batch):
        for t in range(length):
            for c in range(hidden):
                total = 0.0
                for tau in range(base.shape[1]):
                    if t % block_size >= tau:
                        weight = base[side, tau, c] + coefficients[b, t, side, tau, c // group_size]
                        total += float(weight) * float(x[b, t - tau, c])
                out[b, t, c] = total
    return out


def test_convolution_matches_the_loop_inside_each_block(published):
    draft = DFlashForDrafting.from_pretrained(published)
    conv = draft.layers[0].attention_conv
    x = torch.randn(2, 3 * BLOCK, HIDDEN)  # three blocks side by side, as in training
    coefficients = conv.coefficients(torch.randn(2, 3 * BLOCK, HIDDEN))
    assert coefficients.shape == (2, 3 * BLOCK, 2, 2, HIDDEN // 16)
    with torch.no_grad():
        for side in (0, 1):
            expected = loop_conv(x, coefficients, conv.base_kernel, side, 16, BLOCK)
            torch.testing.assert_close(conv(x, coefficients, side), expected, rtol=1e-5, atol=1e-5)


def loop_selector(draft, hidden, head_weight, anchors, temperature=None, uniforms=None):
    """Candidates, lattice, walked chain and each slot's candidate mass (the unary softmax's share on the candidates)
    from the spec's formulas, one index at a time."""
    config, selector = draft.config, draft.state_dict()
    projection = selector["candidate_selector.hidden_projection.weight"]
    predecessor = selector["candidate_selector.predecessor_codebook"]
    successor = selector["candidate_selector.successor_codebook"]
    cap, multiplier, top_k = config.final_logit_softcapping, config.output_multiplier, config.selector_top_k
    batch, slots, _ = hidden.shape
    all_candidates, all_scores, chains, masses = [], [], [], []
    for b in range(batch):
        candidates, scores, mass = [], [], []
        for i in range(slots):
            unary = []
            for v in range(head_weight.shape[0]):
                z = sum(float(hidden[b, i, h]) * float(head_weight[v, h]) for h in range(hidden.shape[-1]))
                unary.append(cap * math.tanh(z * multiplier / cap))
            order = sorted(range(len(unary)), key=lambda v: -unary[v])[:top_k]
            mass.append(sum(math.exp(unary[c]) for c in order) / sum(math.exp(u) for u in unary))
            projected = [
                sum(float(projection[r, h]) * float(hidden[b, i, h]) for h in range(HIDDEN)) for r in range(RANK)
            ]
            previous = [int(anchors[b])] * top_k if i == 0 else candidates[i - 1]
            lattice = [
                [
                    unary[c]
                    + sum(float(predecessor[p, r]) * projected[r] * float(successor[c, r]) for r in range(RANK))
                    for c in order
                ]
                for p in previous
            ]
            candidates.append(order)
            scores.append(lattice)
        chain, previous_choice = [], 0
        for i in range(slots):
            row = scores[i][previous_choice]
            previous_choice = max(range(top_k), key=lambda c: (row[c], -c))
            chain.append(candidates[i][previous_choice])
        all_candidates.append(candidates)
        all_scores.append(scores)
        chains.append(chain)
        masses.append(mass)
    return torch.tensor(all_candidates), torch.tensor(all_scores), torch.tensor(chains), torch.tensor(masses)


def test_candidates_lattice_and_chain_match_the_spec(published, target):
    draft = DFlashForDrafting.from_pretrained(published).eval()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, BLOCK - 1, HIDDEN, generator=generator) * 3
    anchors = torch.tensor([7, 30])
    head = target.get_output_embeddings()
    expected = loop_selector(draft, hidden, head.weight.detach(), anchors)
    expected_candidates, expected_scores, expected_chain, expected_mass = expected
    with torch.no_grad():
        lattice = draft.selector_lattice(hidden, head, anchors)
        tokens, candidates, chain = draft.select_chain(hidden, head, anchors)
    assert torch.equal(lattice.candidate_ids, expected_candidates)
    assert torch.equal(candidates, expected_candidates)
    torch.testing.assert_close(lattice.scores, expected_scores.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lattice.candidate_mass, expected_mass.float(), rtol=1e-4, atol=1e-6)
    assert bool((expected_mass < 0.999).all())  # the candidates leave some mass out: the check could fail
    assert torch.equal(tokens, expected_chain)
    unary_argmax = expected_candidates[..., 0]
    assert not torch.equal(tokens, unary_argmax)  # the pairwise scores changed some choice: they were checked


def test_a_zero_successor_codebook_proposes_the_unary_argmax(published, target):
    draft = DFlashForDrafting.from_pretrained(published).eval()
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.zero_()
        hidden = torch.randn(3, BLOCK - 1, HIDDEN) * 3
        tokens, _, _ = draft.select_chain(hidden, target.get_output_embeddings(), torch.tensor([1, 2, 3]))
        assert torch.equal(tokens, (hidden @ target.get_output_embeddings().weight.T).argmax(-1))


def test_an_anchor_outside_the_draft_vocabulary_adds_no_pairwise_score(target):
    draft = make_draft(target, block_size=BLOCK, draft_vocab_size=40, **SELECTOR)
    draft.set_draft_vocabulary(torch.arange(0, 80, 2))
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_()
        hidden = torch.randn(1, BLOCK - 1, HIDDEN)
        head = target.get_output_embeddings()
        outside = draft.selector_lattice(hidden, head, torch.tensor([3]))  # odd: not a draft token
        inside = draft.selector_lattice(hidden, head, torch.tensor([4]))
    assert draft.to_draft_ids(torch.tensor([3, 4, 78])).tolist() == [-1, 2, 39]
    unary = draft.candidate_selector.unary_logits(draft.draft_logits(hidden, head)).topk(TOP_K).values
    torch.testing.assert_close(outside.scores[0, 0, 0], unary[0, 0])
    assert not torch.allclose(inside.scores[0, 0, 0], unary[0, 0])


# ---------------------------------------------------------------------------------------------------------------------
# Conversion from v1, and the Hub files
# ---------------------------------------------------------------------------------------------------------------------


def test_a_converted_v1_drafter_proposes_what_v1_does(target):
    v1 = make_draft(target, block_size=BLOCK)
    with torch.no_grad():
        for parameter in v1.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    v2 = dflash2_from_dflash(v1, selector_rank=RANK, selector_top_k=TOP_K)
    assert v2.config.variant == "dflash2" and v1.config.variant == "dflash"
    prompt = torch.randint(0, VOCAB - 1, (1, 9))
    out_v1 = speculative_generate(target, v1, prompt, max_new_tokens=24, optimize_cpu=False)
    out_v2 = speculative_generate(target, v2, prompt, max_new_tokens=24, optimize_cpu=False)
    assert out_v1.stats.acceptance_lengths == out_v2.stats.acceptance_lengths
    embeds = target.get_input_embeddings()(torch.randint(0, VOCAB - 1, (2, BLOCK)))
    context = torch.randn(2, 5, 2 * HIDDEN)
    with torch.no_grad():
        hidden_v1 = v1(noise_embeds=embeds, context_hidden_states=context).last_hidden_state
        hidden_v2 = v2(noise_embeds=embeds, context_hidden_states=context).last_hidden_state
        tokens, _, _ = v2.select_chain(hidden_v2[:, 1:], target.get_output_embeddings(), torch.tensor([1, 2]))
    assert torch.equal(hidden_v1, hidden_v2)
    assert torch.equal(tokens, v1.draft_logits(hidden_v1[:, 1:], target.get_output_embeddings()).argmax(-1))


def test_a_v1_config_is_written_without_dflash2_fields(target, tmp_path):
    make_draft(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert not {"variant", "selector_rank", "conv_group_size"} & set(config)


# ---------------------------------------------------------------------------------------------------------------------
# Losslessness
# ---------------------------------------------------------------------------------------------------------------------


def steered_dflash2(target, references, seed: int = 1, selector_scale: float = 0.6):
    """An oracle drafter (unary logits favour the target's own continuation, 20% wrong) with a random selector that
    overrules the unary argmax at some slots (more of them the larger `selector_scale`)."""
    draft = make_oracle(target, references, p_wrong=0.2, block_size=6, seed=seed, **SELECTOR)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        selector = draft.candidate_selector
        selector.predecessor_codebook.copy_(torch.randn(selector.predecessor_codebook.shape, generator=generator))
        selector.successor_codebook.copy_(torch.randn(selector.successor_codebook.shape, generator=generator))
        selector.hidden_projection.weight.mul_(selector_scale)
    return draft


def count_overruled_slots(draft) -> list[int]:
    """Record, per lattice the drafter scores, how many slots its greedy walk chose other than their best unary
    candidate (both decoding paths score the lattice through `selector_lattice`)."""
    from hf_dflash.model.selector_dflash import walk_lattice

    counts, selector_lattice = [], draft.selector_lattice

    def spy(*args, **kwargs):
        lattice = selector_lattice(*args, **kwargs)
        counts.append(int((walk_lattice(lattice).draft_ids != lattice.candidate_ids[..., 0]).sum()))
        return lattice

    draft.selector_lattice = spy
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_generate_is_lossless_on_a_ragged_batch(family):
    target = make_target(family)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 8)]
    references = [greedy_reference(target, prompt, 30) for prompt in prompts]
    ids, mask = left_pad(prompts)
    draft = steered_dflash2(target, references)  # indexed by position, which counts a row's own tokens only
    overruled = count_overruled_slots(draft)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=30, optimize_cpu=False)
    for row, reference in enumerate(references):
        assert out.sequences[row, ids.shape[1] : ids.shape[1] + 30].tolist() == reference[-30:].tolist()
    # the comparison covered accepted runs, and chains in which the selector overruled the unary argmax
    assert max(out.stats.acceptance_lengths) >= 4 and sum(overruled) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_assistant_is_lossless(family, generator_spy):
    target = make_target(family)
    prompt = torch.randint(0, VOCAB - 1, (7,), generator=torch.Generator().manual_seed(3))
    reference = greedy_reference(target, prompt, 30)
    draft = steered_dflash2(target, [reference], selector_scale=2.0)  # one prompt: overrule more often
    overruled = count_overruled_slots(draft)
    out = target.generate(prompt[None], assistant_model=draft, do_sample=False, max_new_tokens=30)
    assert out[0].tolist() == reference.tolist()
    assert generator_spy == ["DFlashCandidateGenerator"] and sum(overruled) > 0


def dflash2_sampling_draft(target, top_k: int = 3) -> DFlashForDrafting:
    """A vague DFlash2 drafter over a 6-token vocabulary: q is zero outside each slot's 3 candidates."""
    torch.manual_seed(7)
    draft = DFlashForDrafting.from_target(
        target,
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=5,
        variant="dflash2",
        selector_rank=4,
        selector_top_k=top_k,
        conv_group_size=8,
    ).eval()
    with torch.no_grad():
        draft.norm.weight.mul_(0.05)
        draft.candidate_selector.successor_codebook.normal_(0, 1.0)
        draft.candidate_selector.predecessor_codebook.normal_(0, 1.0)
    return draft


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("generation_kwargs", SETTINGS, ids=["plain", "temperature-topk-topp"])
def test_sampling_with_the_selector_samples_the_target_distribution(family, generation_kwargs):
    target = peaky_target(family)
    draft = dflash2_sampling_draft(target)
    exact = exact_joint(target, generation_kwargs)
    torch.manual_seed(0)
    out = speculative_generate(
        target,
        draft,
        torch.tensor([[1, 4, 2, 0, 3]]).expand(6000, -1),
        max_new_tokens=4,
        optimize_cpu=False,
        **generation_kwargs,
    )
    samples = [tuple(row) for row in out.sequences[:, 5:8].tolist()]
    assert out.stats.histogram[1] > 0 and out.stats.histogram[3] > 0  # rejections and full acceptances
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_generate_with_assistant_samples_with_the_selector():
    target = peaky_target()
    draft = dflash2_sampling_draft(target)
    exact = exact_joint(target, SETTINGS[1])
    torch.manual_seed(1)
    assert chi_square_pvalue(samples_from_generate(target, draft, 1500, SETTINGS[1]), exact) > 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------


def test_a_hidden_size_the_groups_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="not divisible by conv_group_size 16"):
        DFlashConfig(hidden_size=72, num_attention_heads=4, vocab_size=VOCAB, variant="dflash2")


def test_more_candidates_than_the_draft_vocabulary_is_refused():
    with pytest.raises(ValueError, match="selector_top_k=64 must be between 1 and the draft vocabulary"):
        DFlashConfig(
            hidden_size=HIDDEN,
            num_attention_heads=4,
            vocab_size=VOCAB,
            draft_vocab_size=32,
            variant="dflash2",
            selector_top_k=64,
        )


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="variant must be one of"):
        DFlashConfig(hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB, variant="dflash3")


@pytest.mark.parametrize("missing", ["candidate_selector.successor_codebook", "layers.1.mlp_conv.base_kernel"])
def test_a_checkpoint_missing_dflash2_tensors_is_refused(tmp_path, missing):
    (tmp_path / "config.json").write_text(json.dumps(published_config()))
    tensors = published_tensors()
    del tensors[missing]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"DFlash2 drafter but lacks its weights \\['{missing}'\\]"):
        DFlashForDrafting.from_pretrained(tmp_path)


def test_dflash2_weights_under_a_v1_config_are_refused(tmp_path):
    config = published_config()
    config["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(published_tensors(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds DFlash2 weights"):
        DFlashForDrafting.from_pretrained(tmp_path)


def test_a_sample_from_anchor_checkpoint_is_refused(tmp_path):
    config = published_config()
    config["dflash_config"]["sample_from_anchor"] = True
    with pytest.raises(ValueError, match="sample_from_anchor"):
        DFlashConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})


def test_transformers_native_path_is_refused_for_dflash2(target):
    draft = make_draft(target, **SELECTOR)
    with pytest.raises(ValueError, match="only hf-dflash's generator runs"):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=draft, speculation_type="dflash", max_new_tokens=4)


def test_lattice_tree_takes_the_best_paths_of_the_lattice():
    """Against every path of a small random lattice, enumerated: the tree holds the N most probable prefixes, each
    with its path probability (the product of its transitions), parents before children, best first."""
    from itertools import product

    from hf_dflash.decoding.tree import ROOT, lattice_tree

    generator = torch.Generator().manual_seed(0)
    slots, k, num_nodes = 3, 3, 7
    candidates = torch.randint(0, 50, (1, slots, k), generator=generator)
    transitions = torch.rand(1, slots, k, k, generator=generator).softmax(-1)
    transitions[:, 0] = transitions[:, 0, :1]  # the first slot follows the bonus token alone
    paths = {}  # every prefix (candidate indices) -> its probability
    for length in range(1, slots + 1):
        for path in product(range(k), repeat=length):
            prob = float(transitions[0, 0, 0, path[0]])
            for depth in range(1, length):
                prob *= float(transitions[0, depth, path[depth - 1], path[depth]])
            paths[path] = prob
    best = sorted(paths.values(), reverse=True)[:num_nodes]
    tree = lattice_tree(candidates, transitions, num_nodes)
    parents, depths = tree.parents[0].tolist(), tree.depths[0].tolist()
    for node, parent in enumerate(parents):  # parents first, one depth up
        assert parent < node and depths[node] == (1 if parent == ROOT else depths[parent] + 1)
    probs = tree.path_probs[0].tolist()
    assert probs == sorted(probs, reverse=True)
    assert torch.allclose(torch.tensor(probs), torch.tensor(best), rtol=1e-6)
    # each node's token is its slot's candidate, and its probability its path's
    for node in range(num_nodes):
        path, index = [], node
        while index != ROOT:
            path.append(index)
            index = parents[index]
        indices = [int((candidates[0, depths[i] - 1] == tree.tokens[0, i]).nonzero()[0]) for i in reversed(path)]
        assert paths[tuple(indices)] == pytest.approx(probs[node], rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_neox"])
@pytest.mark.parametrize("costs", [False, True], ids=["tree-8", "planned"])
def test_greedy_dflash2_trees_from_the_lattice_are_lossless_on_a_ragged_batch(family, costs):
    from hf_dflash import VerifyCosts

    target = make_target(family)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11, 8)]
    references = [greedy_reference(target, prompt, 30) for prompt in prompts]
    ids, mask = left_pad(prompts)
    draft = steered_dflash2(target, references)
    verify_costs = VerifyCosts(verify=tuple(1.0 + 0.02 * n for n in range(17)), draft=0.1) if costs else None
    out = speculative_generate(
        target, draft, ids, mask, max_new_tokens=30, tree=8, verify_costs=verify_costs, optimize_cpu=False
    )
    for row, reference in enumerate(references):
        assert out.sequences[row, ids.shape[1] : ids.shape[1] + 30].tolist() == reference[-30:].tolist()
    assert out.stats.tree_rounds > 0 and max(out.stats.acceptance_lengths) >= 4


def test_a_v1_drafter_has_no_selector(target):
    with pytest.raises(ValueError, match="no candidate selector"):
        make_draft(target).select_chain(torch.zeros(1, 3, HIDDEN), target.get_output_embeddings(), torch.tensor([1]))


def test_the_selector_conv_is_a_module_of_each_layer(target):
    draft = make_draft(target, **SELECTOR)
    assert all(isinstance(layer.attention_conv, DFlashSublayerConv) for layer in draft.layers)
    assert all(layer.attention_conv is None for layer in make_draft(target).layers)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def loop_selector_loss(selector, hidden, logits, labels, predecessors):
    """The K-way cross-entropy of each row's label among its top-K unary candidates, row by row (0 if absent)."""
    losses = []
    for row in range(hidden.shape[0]):
        unary = selector.unary_logits(logits[row])
        values, candidates = unary.topk(selector.top_k)
        if int(labels[row]) not in candidates.tolist():
            losses.append(torch.tensor(0.0))
            continue
        projected = selector.hidden_projection(hidden[row])
        previous = selector.predecessor_codebook[int(predecessors[row])]
        scores = torch.stack(
            [
                values[j] + (previous * projected * selector.successor_codebook[int(c)]).sum()
                for j, c in enumerate(candidates)
            ]
        )
        losses.append(-scores.log_softmax(-1)[candidates.tolist().index(int(labels[row]))])
    return torch.stack(losses)


def test_selector_cross_entropy_matches_the_loop(target):
    draft = make_draft(target, **SELECTOR)
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_()
    hidden = torch.randn(12, HIDDEN)
    logits = draft.draft_logits(hidden, target.get_output_embeddings())
    labels = logits.topk(6).indices[torch.arange(12), torch.arange(12) % 6]  # ranks 0..5: some outside the top 4
    predecessors = torch.randint(0, VOCAB, (12,))
    loss, found, picked = selector_cross_entropy(draft.candidate_selector, hidden, logits, labels, predecessors)
    expected = loop_selector_loss(draft.candidate_selector, hidden, logits, labels, predecessors)
    torch.testing.assert_close(loss, expected)
    assert found.tolist() == [rank < TOP_K for rank in (torch.arange(12) % 6).tolist()]
    assert (picked <= found).all()


def test_the_dflash2_block_loss_is_the_v1_loss_plus_the_weighted_selector_term(target):
    draft = make_draft(target, block_size=BLOCK, **SELECTOR)
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_()
    hidden = torch.randn(2, 3 * BLOCK, HIDDEN)
    labels = torch.randint(0, VOCAB, (2, 3 * BLOCK))
    weights = torch.rand(2, 3 * BLOCK) * (torch.arange(3 * BLOCK) % BLOCK != 0)
    predecessors = torch.randint(0, VOCAB, (2, 3 * BLOCK))
    head = lambda states: draft.draft_logits(states, target.get_output_embeddings())  # noqa: E731
    v1 = block_loss(hidden, head, labels, weights, BLOCK)
    term = SelectorTerm(draft.candidate_selector, predecessors, weight=0.7)
    v2 = block_loss(hidden, head, labels, weights, BLOCK, chunk_size=5, selector=term)
    rows = weights.flatten() > 0
    selector_loss, found, picked = selector_cross_entropy(
        draft.candidate_selector, hidden.flatten(0, 1)[rows], head(hidden).flatten(0, 1)[rows],
        labels.flatten()[rows], predecessors.flatten()[rows],
    )  # fmt: skip
    expected = v1.weighted_sum + 0.7 * (selector_loss * weights.flatten()[rows]).sum()
    torch.testing.assert_close(v2.weighted_sum, expected)
    assert torch.equal(v2.correct, v1.correct) and v2.in_candidates.sum() == found.sum()
    assert v2.selector_correct.sum() == picked.sum()


def test_a_dflash2_drafter_trains_logs_its_selector_and_saves(tmp_path):
    target = make_target("llama")
    records, prompts = _regenerated(target, num_sequences=4, new_tokens=40)
    v1 = make_draft(target, block_size=8, num_hidden_layers=1)
    draft = dflash2_from_dflash(v1, selector_rank=RANK, selector_top_k=TOP_K).train()
    args = _args(tmp_path, max_steps=12, learning_rate=3e-3, logging_steps=4, real_acceptance_steps=6,
                 save_strategy="steps", save_steps=12)  # fmt: skip
    trainer = DFlashTrainer(
        model=draft, target=target, args=args, train_dataset=Dataset.from_list(records), acceptance_prompts=prompts[:2]
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "sel_acc_1" in entry]
    assert logs and all(
        0 <= entry["sel_recall_1"] <= 1 and entry["sel_acc_1"] <= entry["sel_recall_1"] for entry in logs
    )
    assert logs[-1]["sel_tau"] >= 1.0
    assert not torch.equal(
        draft.candidate_selector.successor_codebook, torch.zeros_like(draft.candidate_selector.successor_codebook)
    )
    assert not torch.equal(draft.layers[0].attention_conv.kernel_projection.weight, torch.zeros(1))  # the convs train
    info = json.loads((tmp_path / "out" / "checkpoint-12" / "training_info.json").read_text())
    assert [entry["step"] for entry in info["training"]["selector_by_step"]] == [6, 12]
    assert len(info["training"]["selector_by_step"][-1]["recall_at_k"]) == 7
    reloaded = DFlashForDrafting.from_pretrained(tmp_path / "out" / "checkpoint-12")
    assert reloaded.config.variant == "dflash2"


def test_train_command_converts_a_v1_drafter(tmp_path):
    from hf_dflash.cli import main

    save_target_and_records(tmp_path, num_records=6, new_tokens=30)
    start = make_draft(make_target("llama"), block_size=4, num_hidden_layers=1)
    start.save_pretrained(tmp_path / "v1")
    argv = ["train", "--data", str(tmp_path / "data.jsonl"), "--target", str(tmp_path / "target")]
    argv += ["--init_draft", str(tmp_path / "v1"), "--variant", "dflash2", "--selector_rank", "8"]
    argv += ["--selector_top_k", "4", "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--block_size", "4"]
    argv += ["--acceptance_holdout", "2", "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no"]
    argv += ["--disable_tqdm", "true"]
    assert main(argv) == 0
    trained = DFlashForDrafting.from_pretrained(tmp_path / "out")
    assert trained.config.variant == "dflash2" and trained.config.selector_rank == 8
    info = json.loads((tmp_path / "out" / "training_info.json").read_text())
    assert info["training"]["draft_init"].startswith("converted to DFlash2 from the DFlash drafter")
    assert trained.candidate_selector.successor_codebook.abs().sum() > 0  # two steps moved it from zero


def test_narrowing_a_selector_keeps_its_strongest_components(published, target, tmp_path):
    draft = DFlashForDrafting.from_pretrained(published).eval()
    selector = draft.candidate_selector
    with torch.no_grad():
        selector.successor_codebook[:, [1, 4, 6]] = 0.0  # three components that add nothing
        selector.predecessor_codebook[:, 3] *= 1e-3  # the weakest of the rest, and hidden_projection scaled up to
        selector.hidden_projection.weight[3] *= 1e3  # make up for it: the product, not one factor, is the strength
        hidden, anchors = torch.randn(2, BLOCK - 1, HIDDEN) * 3, torch.tensor([7, 30])
        head = target.get_output_embeddings()
        before = draft.selector_lattice(hidden, head, anchors).scores
        kept = reduce_selector_rank(draft, 5)
        after = draft.selector_lattice(hidden, head, anchors).scores
    assert kept.tolist() == [0, 2, 3, 5, 7]
    assert draft.config.selector_rank == 5 and selector.successor_codebook.shape == (VOCAB, 5)
    assert selector.hidden_projection.weight.shape == (5, HIDDEN)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)  # only zero terms were dropped
    draft.save_pretrained(tmp_path / "narrow")
    reloaded = DFlashForDrafting.from_pretrained(tmp_path / "narrow")
    assert reloaded.config.selector_rank == 5
    assert torch.equal(reloaded.candidate_selector.predecessor_codebook, selector.predecessor_codebook)
    with pytest.raises(ValueError, match="can only be narrowed"):
        reduce_selector_rank(draft, 6)
    with pytest.raises(ValueError, match="draft vocabulary"):
        set_selector_top_k(draft, VOCAB + 1)


def test_train_command_narrows_a_dflash2_drafter_it_continues(tmp_path):
    from hf_dflash.cli import main

    save_target_and_records(tmp_path, num_records=6, new_tokens=30)
    start = make_draft(make_target("llama"), block_size=4, num_hidden_layers=1, **SELECTOR)
    start.save_pretrained(tmp_path / "v2")
    argv = ["train", "--data", str(tmp_path / "data.jsonl"), "--target", str(tmp_path / "target")]
    argv += ["--init_draft", str(tmp_path / "v2"), "--variant", "dflash2", "--max_steps", "1", "--block_size", "4"]
    argv += ["--acceptance_holdout", "2", "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no"]
    argv += ["--disable_tqdm", "true"]
    assert main([*argv, "--output_dir", str(tmp_path / "kept")]) == 0
    kept = DFlashForDrafting.from_pretrained(tmp_path / "kept").config
    assert (kept.selector_rank, kept.selector_top_k) == (RANK, TOP_K)  # not reset to the new-drafter defaults
    narrowed_argv = [*argv, "--output_dir", str(tmp_path / "narrow"), "--selector_rank", "4", "--selector_top_k", "3"]
    assert main(narrowed_argv) == 0
    narrowed = DFlashForDrafting.from_pretrained(tmp_path / "narrow")
    assert (narrowed.config.selector_rank, narrowed.config.selector_top_k) == (4, 3)
    assert narrowed.candidate_selector.predecessor_codebook.shape[1] == 4
    info = json.loads((tmp_path / "narrow" / "training_info.json").read_text())
    assert "narrowed from rank 8 to 4" in info["training"]["draft_init"]
    assert main([*argv, "--output_dir", str(tmp_path / "regroup"), "--conv_group_size", "32"]) == 2  # before a load
    assert not (tmp_path / "regroup").exists()
    start.save_pretrained(tmp_path / "zlab", layout="z-lab")  # read in its own layout, also before a load
    argv[argv.index(str(tmp_path / "v2"))] = str(tmp_path / "zlab")
    assert main([*argv, "--output_dir", str(tmp_path / "wide"), "--selector_rank", str(2 * RANK)]) == 2


def test_dflash2_flags_without_the_dflash2_variant_are_refused(tmp_path):
    with pytest.raises(ValueError, match="variant='dflash2'"):
        DFlashTrainingArguments(output_dir=str(tmp_path), use_cpu=True, selector_rank=64)


# ---------------------------------------------------------------------------------------------------------------------
# Serving exports
# ---------------------------------------------------------------------------------------------------------------------


def test_a_full_vocabulary_export_writes_the_codebooks_by_target_id(target, tmp_path):
    draft = make_draft(target, block_size=BLOCK, draft_vocab_size=40, **SELECTOR)
    draft.set_draft_vocabulary(torch.arange(0, 80, 2))
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_()
    draft.save_pretrained(tmp_path, layout="z-lab", full_vocabulary=True)
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert "d2t" not in weights.keys()
        for name in ("predecessor_codebook", "successor_codebook"):
            written = weights.get_tensor(f"candidate_selector.{name}")
            ours = getattr(draft.candidate_selector, name).detach()
            assert written.shape == (VOCAB, RANK)
            assert torch.equal(written[0:80:2], ours) and not written[1:80:2].any() and not written[80:].any()
    reloaded = DFlashForDrafting.from_pretrained(tmp_path)  # a full-vocabulary DFlash2 drafter
    assert reloaded.config.draft_vocab_size is None and reloaded.config.variant == "dflash2"


def test_openvino_and_vllm_exports_say_what_dflash2_needs(target, tmp_path):
    from hf_dflash.engines import openvino
    from hf_dflash.engines.export import export_for_engine

    draft = make_draft(target, block_size=BLOCK, **SELECTOR)
    assert "DFlash2 drafter" in openvino.unsupported_draft_reason(draft.config)
    recipe = export_for_engine(draft, target, "vllm", tmp_path / "vllm", target_id="org/target")
    assert "V2 model runner" in recipe.settings["dflash2"]
    written = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]


def test_the_card_of_a_dflash2_drafter_names_its_architecture_and_what_serves_it(target, tmp_path):
    from hf_dflash.model_card import card_info_from_folder, render_model_card

    draft = make_draft(target, block_size=BLOCK, **SELECTOR)
    for layout in ("hf-dflash", "z-lab"):
        folder = tmp_path / layout
        draft.save_pretrained(folder, layout=layout, **({"target": target} if layout == "z-lab" else {}))
        (folder / "training_info.json").write_text(json.dumps({
            "base_model": "org/target",
            "training": {"selector_by_step": [{"step": 6, "recall_at_k": [0.9, 0.8], "accuracy": [0.7, 0.5]}]},
        }))  # fmt: skip
        card = str(render_model_card(card_info_from_folder(folder)))
        assert '"DFlash2DraftModel"' in card and "VLLM_USE_V2_MODEL_RUNNER=1" in card
        assert "step 6: 0.90/0.70 0.80/0.50" in card


def test_a_planned_sampled_chain_still_samples_the_target_distribution():
    """With measured costs the planner cuts chains (here to one of three proposals) under sampling too."""
    from hf_dflash import VerifyCosts

    target = peaky_target("llama")
    draft = dflash2_sampling_draft(target)
    exact = exact_joint(target, SETTINGS[0])
    costs = VerifyCosts(verify=(1.0, 1.05, 9.0, 9.0), draft=0.0)  # a second proposal never pays
    torch.manual_seed(5)
    out = speculative_generate(target, draft, torch.tensor([[1, 4, 2, 0, 3]]).expand(6000, -1), max_new_tokens=4,
                               optimize_cpu=False, verify_costs=costs, **SETTINGS[0])  # fmt: skip
    samples = [tuple(row) for row in out.sequences[:, 5:8].tolist()]
    assert out.stats.verified_drafts_per_round == 1 and out.stats.histogram[2] > 0
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_a_sampled_chain_is_cut_before_anything_is_drawn(monkeypatch):
    """The planned length of a sampled chain is the same whatever the draws: a length chosen after seeing them would
    make the accepted tokens depend on the cut (the walk's later rows depend on its earlier draws)."""
    from hf_dflash import VerifyCosts
    from hf_dflash.decoding import speculative

    planned, plan = [], speculative._planned
    monkeypatch.setattr(speculative, "_planned", lambda *args: planned.append(plan(*args)) or planned[-1])
    target = peaky_target("llama")
    draft = dflash2_sampling_draft(target)
    # costs at which planning from the drawn tokens' probabilities (times the candidate mass) cuts the first chain to
    # 1 or 2 proposals by seed
    costs = VerifyCosts(verify=(1.0, 1.01, 1.04, 1.3), draft=0.0)
    first_lengths, first_draws = set(), set()
    for seed in range(24):
        torch.manual_seed(seed)
        planned.clear()
        speculative_generate(target, draft, torch.tensor([[1, 4, 2, 0, 3]]), max_new_tokens=4, optimize_cpu=False,
                             verify_costs=costs, **SETTINGS[0])  # fmt: skip
        first_lengths.add(planned[0].num_nodes)  # the first round's: its state is the same for every seed
        first_draws.add(tuple(planned[0].tokens[0].tolist()))
    assert len(first_draws) > 5 and len(first_lengths) == 1 and first_lengths != {0}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exact_cpu_mode_bf16_greedy_with_a_dflash2_drafter_is_plain_decoding(family):
    """bf16 in exact CPU mode, target and DFlash2 drafter prepared by `optimize_for_cpu` (its conv and selector
    projections too): both paths give plain decoding's tokens."""
    from hf_dflash import optimize_for_cpu

    target = make_target(family, dtype=torch.bfloat16)
    optimize_for_cpu(target, exact=True)
    prompt = torch.randint(0, VOCAB - 1, (10,), generator=torch.Generator().manual_seed(2))
    reference = greedy_reference(target, prompt, 40)
    draft = steered_dflash2(target, [reference]).to(torch.bfloat16)
    ours = speculative_generate(target, draft, prompt[None], max_new_tokens=40)  # prepares the drafter too
    assert ours.sequences[0].tolist() == reference.tolist() and max(ours.stats.acceptance_lengths) >= 3
    with torch.no_grad():
        assisted = target.generate(prompt[None], assistant_model=draft, max_new_tokens=40, do_sample=False)
    assert assisted[0].tolist() == reference.tolist()


def test_resizing_a_dflash2_vocabulary_moves_the_codebook_rows_with_their_tokens(target):
    draft = make_draft(target, block_size=BLOCK, draft_vocab_size=8, **SELECTOR)
    draft.set_draft_vocabulary(torch.tensor([2, 4, 6, 8, 10, 12, 14, 16]))
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_()
    before = draft.candidate_selector.successor_codebook.detach().clone()
    draft.resize_draft_vocabulary(torch.tensor([1, 4, 8, 9, 12, 30]))
    after = draft.candidate_selector.successor_codebook.detach()
    assert after.shape == (6, RANK) and draft.candidate_selector.predecessor_codebook.shape == (6, RANK)
    assert torch.equal(after[[1, 2, 4]], before[[1, 3, 5]])  # tokens 4, 8, 12 keep their rows
    assert not after[[0, 3, 5]].any()  # tokens 1, 9, 30 are new: zero rows


@pytest.mark.parametrize("length", [8, 6])  # whole blocks of 4 (shifted inside each block), and a partial one
def test_block_causal_shift_moves_each_slot_back_inside_its_block(length):
    from hf_dflash.model.selector_dflash import block_causal_shift

    x = torch.randn(2, length, 3, 5, generator=torch.Generator().manual_seed(0))
    for tau in range(4):
        expected = torch.zeros_like(x)
        for t in range(length):
            if t % 4 >= tau:
                expected[:, t] = x[:, t - tau]
        assert torch.equal(block_causal_shift(x, tau, 4), expected), tau


def test_a_lattice_trees_probabilities_carry_the_candidates_mass(monkeypatch):
    """The planner's probability of a lattice node: the softmax over the K candidates times the share of the slot's
    unary softmax those candidates hold, so each row of transitions sums to that share, not to one."""
    from hf_dflash.decoding import speculative

    target = make_target("llama")
    prompt = torch.randint(0, VOCAB - 1, (6,), generator=torch.Generator().manual_seed(2))
    draft = make_draft(target, block_size=BLOCK, **SELECTOR)  # random: its unary softmax is spread
    seen, masses, lattice_tree, selector_lattice = [], [], speculative.lattice_tree, draft.selector_lattice

    def spy_lattice(*args, **kwargs):
        lattice = selector_lattice(*args, **kwargs)
        masses.append(lattice.candidate_mass)
        return lattice

    monkeypatch.setattr(draft, "selector_lattice", spy_lattice)
    monkeypatch.setattr(
        speculative, "lattice_tree", lambda ids, probs, n: seen.append(probs) or lattice_tree(ids, probs, n)
    )
    speculative_generate(target, draft, prompt[None], max_new_tokens=12, tree=8, optimize_cpu=False)
    assert seen and len(seen) == len(masses)
    for transitions, mass in zip(seen, masses):
        torch.testing.assert_close(transitions.sum(-1), mass[..., None].expand(-1, -1, transitions.shape[2]))
    assert any(bool((mass < 0.999).any()) for mass in masses)  # some rows do not sum to one: the check could fail
