"""Draft trees: the best-first shape, the tree mask, greedy acceptance along one path, the cache kept to that path, and
tree verification token-identical to plain `generate` (oracle drafts that force deep paths, sibling hits and misses,
random drafts, ragged batches, EOS, budgets), on every family that verifies a tree exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, VOCAB, OracleDraft, greedy_reference, left_pad, make_draft, make_target
from test_generation import random_prompt
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

from hf_dflash import speculative_generate
from hf_dflash.decoding.policy import VerifyCosts
from hf_dflash.decoding.tree import (
    ROOT,
    DraftTree,
    accept_greedy,
    ancestors,
    best_first_tree,
    chain,
    keep_path,
    supports_tree_verification,
    tree_attention_mask,
)

TREE_FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox", "opt"]  # no sliding window
SLIDING_FAMILIES = ["mistral", "gemma2", "gemma3"]


# -- shape -----------------------------------------------------------------------------------------------------------


def test_best_first_tree_takes_the_nodes_of_highest_path_probability():
    top_ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])  # [1, S=3, K=2]
    top_probs = torch.tensor([[[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]]])
    tree = best_first_tree(top_ids, top_probs, num_nodes=5)
    # path probabilities: 10: .6, 11: .4, 10-20: .54, 11-20: .36, 10-20-30/31: .27 each, 10-21: .06 ...
    assert tree.tokens[0].tolist() == [10, 20, 11, 20, 30]
    assert tree.path_probs[0].tolist() == pytest.approx([0.6, 0.54, 0.4, 0.36, 0.27])
    assert tree.depths[0].tolist() == [1, 2, 1, 2, 3]
    assert tree.parents[0].tolist() == [ROOT, 0, ROOT, 2, 1]  # 11-20 under node 2, 10-20-30 under node 1
    assert not tree.is_chain
    probs = tree.path_probs[0]
    for node, parent in enumerate(tree.parents[0].tolist()):  # prefix-closed, parents first
        assert parent < node and (parent == ROOT or probs[parent] >= probs[node])


def test_a_chain_is_the_tree_with_one_child_per_node():
    tree = chain(torch.tensor([[5, 6, 7]]), torch.tensor([[0.5, 0.5, 0.5]]))
    assert tree.is_chain and tree.parents.tolist() == [[ROOT, 0, 1]] and tree.depths.tolist() == [[1, 2, 3]]
    assert tree.path_probs.tolist() == [[0.5, 0.25, 0.125]]
    assert best_first_tree(torch.tensor([[[5, 9], [6, 9]]]), torch.tensor([[[0.99, 0.01], [0.99, 0.01]]]), 2).is_chain


def test_tree_mask_shows_each_node_the_cache_it_keeps_its_ancestors_and_itself():
    parents = torch.tensor([[ROOT, ROOT, 0]])  # a1, a2 siblings; c1 under a1
    assert ancestors(parents)[0].int().tolist() == [
        [1, 0, 0, 0],  # bonus
        [1, 1, 0, 0],  # a1
        [1, 0, 1, 0],  # a2
        [1, 1, 0, 1],  # c1
    ]
    key_mask = torch.tensor([[0, 1, 1]])  # a left-padding hole
    mask = tree_attention_mask(key_mask, parents, torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    assert ((mask[0, 0] == 0).int()[:, :3] == torch.tensor([0, 1, 1])).all()


# -- acceptance ------------------------------------------------------------------------------------------------------


def _tree(tokens, parents, depths) -> DraftTree:
    tokens, parents, depths = (torch.tensor([row]) for row in (tokens, parents, depths))
    return DraftTree(tokens, parents, depths, torch.ones(tokens.shape))


# nodes: 0: a (d1), 1: b (d1, sibling of a), 2: c under a (d2), 3: d under b (d2), 4: e under d (d3); in the verify
# input (and in `target_ids`, the target's argmax there) the bonus is index 0 and node n is index n + 1
TREE = ([1, 2, 3, 4, 5], [ROOT, ROOT, 0, 1, 3], [1, 1, 2, 2, 3])


@pytest.mark.parametrize(
    "target_ids, path, length, bonus",
    [
        ([1, 3, 0, 7, 0, 0], [0, 1, 3], 3, 7),  # first child and its child: the deep first path
        ([2, 9, 4, 8, 5, 6], [0, 2, 4, 5], 4, 6),  # the sibling, then its whole subtree
        ([9, 0, 0, 0, 0, 0], [0], 1, 9),  # no hit: the bonus alone, then the target's token
        ([2, 9, 7, 8, 5, 6], [0, 2], 2, 7),  # sibling hit, its child missed
    ],
)
def test_greedy_acceptance_follows_the_one_matching_path(target_ids, path, length, bonus):
    got_path, lengths, new_bonus = accept_greedy(_tree(*TREE), torch.tensor([target_ids]))
    assert got_path[0].tolist() == path and lengths.tolist() == [length] and new_bonus.tolist() == [bonus]


def test_batched_acceptance_pads_shorter_paths_with_their_last_node():
    trees = [_tree(*TREE), _tree(*TREE)]
    tree = DraftTree(
        *(torch.cat([getattr(t, f) for t in trees]) for f in ("tokens", "parents", "depths", "path_probs"))
    )
    path, lengths, bonus = accept_greedy(tree, torch.tensor([[2, 9, 4, 8, 5, 6], [9, 0, 0, 0, 0, 0]]))
    assert path.tolist() == [[0, 2, 4, 5], [0, 0, 0, 0]] and lengths.tolist() == [4, 1] and bonus.tolist() == [6, 9]


def test_keep_path_gathers_the_accepted_slots_of_the_verified_tail():
    cache = DynamicCache()
    keys = torch.arange(8.0).view(1, 1, 8, 1).expand(2, 2, 8, 3).contiguous()  # slot s holds value s
    cache.update(keys, keys + 100, layer_idx=0)
    keep_path(cache, num_fed=5, path=torch.tensor([[0, 2, 4], [0, 1, 1]]))  # tail = slots 3..7
    kept = cache.layers[0].keys[:, 0, :, 0]
    assert kept.tolist() == [[0, 1, 2, 3, 5, 7], [0, 1, 2, 3, 4, 4]]
    assert torch.equal(cache.layers[0].values, cache.layers[0].keys + 100)


# -- which targets verify trees ----------------------------------------------------------------------------------------


class MaskIgnoringLlama(LlamaForCausalLM):
    """A target that drops a 4D attention mask: it cannot verify a tree."""

    def forward(self, *args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


def test_the_probe_accepts_exact_targets_and_refuses_one_that_ignores_the_tree_mask():
    assert all(supports_tree_verification(make_target(family)) for family in TREE_FAMILIES)
    target = make_target("llama")
    ignoring = MaskIgnoringLlama(target.config).eval()
    assert not supports_tree_verification(ignoring)
    draft = make_draft(ignoring, block_size=4)
    prompt = random_prompt(10, seed=1)
    with pytest.raises(ValueError, match="does not verify a tree exactly"):
        speculative_generate(ignoring, draft, prompt[None], max_new_tokens=8, tree=8)
    costs = VerifyCosts(verify=(1.0,) * 20, draft=0.0)
    out = speculative_generate(ignoring, draft, prompt[None], max_new_tokens=8, verify_costs=costs)
    assert out.stats.tree_rounds == 0  # the default quietly verifies chains


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sliding_window_targets_verify_chains(family):
    target = make_target(family)
    draft = make_draft(target, block_size=4)
    prompt = random_prompt(10, seed=1)
    with pytest.raises(ValueError, match="sliding-window"):
        speculative_generate(target, draft, prompt[None], max_new_tokens=8, tree=8)
    costs = VerifyCosts(verify=(1.0,) * 20, draft=0.0)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=8, verify_costs=costs)
    assert out.stats.tree_rounds == 0


def test_sampling_with_a_tree_is_refused():
    target = make_target("llama")
    with pytest.raises(ValueError, match="greedy decoding only"):
        speculative_generate(
            target, make_draft(target), random_prompt(5, 0)[None], max_new_tokens=4, do_sample=True, tree=8
        )


# -- losslessness -----------------------------------------------------------------------------------------------------


class TreeOracle(OracleDraft):
    """Per slot, the reference token is the draft's first choice (`right`), its second (`sibling`: the first is a
    wrong token one logit ahead) or neither (`miss`), drawn with the given probabilities."""

    def shape(self, p_sibling: float, p_miss: float) -> TreeOracle:
        self.p_sibling, self.p_miss = p_sibling, p_miss
        return self

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, **kwargs):
        out = super(OracleDraft, self).forward(
            noise_embeds, context_hidden_states, position_ids=position_ids, **kwargs
        )
        hidden = out.last_hidden_state.clone()
        block = noise_embeds.shape[1]
        for row in range(hidden.shape[0]):
            reference = self.references[row if len(self.references) > 1 else 0]
            for slot, position in enumerate(position_ids[row, -block:].tolist()):
                right = int(reference[position]) if position < len(reference) else 0
                wrong = [(right + 1 + i) % (VOCAB - 1) for i in range(2)]
                draw = float(torch.rand((), generator=self.generator))
                first, second = (
                    (right, wrong[0]) if draw >= self.p_sibling + self.p_miss
                    else (wrong[0], right) if draw < self.p_sibling else (wrong[0], wrong[1])
                )  # fmt: skip
                states = self.token_states[:, first] + 0.98 * self.token_states[:, second]  # second: 1 logit behind
                hidden[row, slot] = states.to(hidden.dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=out.cache)


def tree_oracle(target, references, p_sibling, p_miss, block_size=8) -> TreeOracle:
    torch.manual_seed(1)
    draft = TreeOracle.from_target(target, num_hidden_layers=1, block_size=block_size, mask_token_id=PAD)
    return draft.eval().steer(target, references, 0.0, seed=2).shape(p_sibling, p_miss)


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_trees_are_token_identical_and_accept_sibling_hits_chains_miss(family):
    target = make_target(family)
    prompt = random_prompt(12, seed=4)
    reference = greedy_reference(target, prompt, 60)
    tree_out = speculative_generate(
        target, tree_oracle(target, [reference], 0.3, 0.1), prompt[None], max_new_tokens=60, tree=16
    )
    chain_out = speculative_generate(
        target, tree_oracle(target, [reference], 0.3, 0.1), prompt[None], max_new_tokens=60, tree=False
    )

    assert tree_out.sequences[0].tolist() == chain_out.sequences[0].tolist() == reference.tolist()
    assert tree_out.stats.tree_rounds == tree_out.stats.num_rounds > 0
    assert tree_out.stats.tau > chain_out.stats.tau  # siblings the chain cannot propose were accepted


CASES = [  # (family, prompt length, block size, max new tokens, p_sibling, p_miss, tree nodes)
    ("llama", 1, 2, 1, 0.0, 0.0, 4),
    ("llama", 1, 16, 200, 0.2, 0.05, 32),
    ("llama", 300, 4, 40, 0.4, 0.3, 8),
    ("qwen3", 7, 16, 17, 0.0, 0.0, 16),
    ("qwen3", 2, 3, 2, 0.5, 0.0, 3),
    ("gpt_neox", 37, 8, 100, 0.3, 0.3, 16),
    ("opt", 300, 8, 23, 0.6, 0.0, 5),
    ("gpt2", 5, 5, 150, 0.0, 1.0, 12),  # every slot misses: the bonus alone each round
]


@pytest.mark.parametrize(
    ("family", "prompt_len", "block_size", "max_new_tokens", "p_sibling", "p_miss", "nodes"), CASES
)
def test_trees_identical_across_lengths_blocks_budgets_and_shapes(
    family, prompt_len, block_size, max_new_tokens, p_sibling, p_miss, nodes
):
    target = make_target(family)
    prompt = random_prompt(prompt_len, seed=prompt_len)
    reference = greedy_reference(target, prompt, max_new_tokens)
    draft = tree_oracle(target, [reference], p_sibling, p_miss, block_size=block_size)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=max_new_tokens, tree=nodes)
    assert out.sequences[0].tolist() == reference.tolist()
    assert out.num_new_tokens == [max_new_tokens]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_ragged_tree_batches_finish_like_each_row_alone(family):
    target = make_target(family)
    prompts = [random_prompt(length, seed=length) for length in (3, 17, 9)]
    references = [greedy_reference(target, p, 40) for p in prompts]
    eos = int(references[1][len(prompts[1]) + 12])  # row 1 stops early
    references = [greedy_reference(target, p, 40, eos_token_id=eos) for p in prompts]
    input_ids, mask = left_pad(prompts)
    draft = tree_oracle(target, references, 0.3, 0.2)
    draft.references = [
        torch.cat([torch.full((input_ids.shape[1] - len(p),), PAD), r]) for p, r in zip(prompts, references)
    ]
    out = speculative_generate(target, draft, input_ids, mask, max_new_tokens=40, eos_token_id=eos, tree=16)
    width = input_ids.shape[1]
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        new = reference[len(prompt) :].tolist()
        assert out.sequences[row, width : width + len(new)].tolist() == new
        assert out.num_new_tokens[row] == len(new)
    assert out.stats.tree_rounds > 0


def test_random_draft_trees_stay_identical():
    target = make_target("qwen3")
    prompt = random_prompt(30, seed=8)
    reference = greedy_reference(target, prompt, 50)
    out = speculative_generate(target, make_draft(target, block_size=8), prompt[None], max_new_tokens=50, tree=24)
    assert out.sequences[0].tolist() == reference.tolist()
    assert out.stats.tree_rounds == out.stats.num_rounds > 0
    assert out.stats.verified_drafts <= 24 * out.stats.num_rounds
