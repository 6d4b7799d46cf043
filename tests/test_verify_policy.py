"""Verifying only the proposals worth their cost (`verify_costs`): the choice itself, and that the output stays the
target's own, greedy token for token and sampled by a chi-square test. Where the fallback's judgement of measured
seconds matters, the loops read a modelled clock (`ModelledDevice`), never wall time, so no result depends on the
machine's load."""

import functools

import pytest
import torch
from helpers import greedy_reference, left_pad, make_draft, make_oracle, make_target
from test_draft_tree import tree_oracle
from test_generation import random_prompt
from test_sampling import PROMPT, SETTINGS, chi_square_pvalue, exact_joint, peaky_target, random_draft
from transformers import GenerationConfig

from hf_dflash import speculative_generate
from hf_dflash.decoding import policy, speculative
from hf_dflash.decoding.policy import Fallback, RoundOverhead, VerifyCosts, VerifyPlanner, measure_verify_costs
from hf_dflash.model import generation_dflash

USELESS_DRAFT_COSTS = VerifyCosts(verify=(1.0, 1.12, 1.24, 1.36), draft=0.13)  # SmolLM2's shape on a CPU


class ModelledDevice:
    """A clock that advances by the modelled cost of each forward instead of wall time, so that the fallback's
    judgement of measured seconds is the same on a loaded machine as on an idle one: a target forward over n new
    tokens takes `costs.verify[n - 1]` (growing by the last step beyond them), a draft forward `costs.draft`."""

    def __init__(self):
        self.costs, self.now = None, 0.0

    def attach(self, target, draft, costs: VerifyCosts = USELESS_DRAFT_COSTS) -> None:
        self.costs = costs
        target.register_forward_pre_hook(self._bill_target, with_kwargs=True)
        draft.register_forward_pre_hook(self._bill_draft)

    def clock(self, device: torch.device) -> float:
        return self.now

    def _bill_target(self, module, args, kwargs) -> None:
        num_tokens = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[1]
        verify = self.costs.verify
        step = verify[-1] - verify[-2] if len(verify) > 1 else 0.0
        self.now += verify[min(num_tokens, len(verify)) - 1] + step * max(0, num_tokens - len(verify))

    def _bill_draft(self, module, args) -> None:
        self.now += self.costs.draft


@pytest.fixture
def modelled_device(monkeypatch):
    """`attach(target, draft, costs)`: both decoding loops read the modelled clock from then on."""
    device = ModelledDevice()
    monkeypatch.setattr(speculative, "synchronized_clock", device.clock)
    monkeypatch.setattr(generation_dflash, "synchronized_clock", device.clock)
    return device


def quadratic_costs(block_size: int, growth: float) -> VerifyCosts:
    """Verify over n tokens costs 1 + growth * (n - 1)^2: steep growth keeps few proposals, flat keeps them all."""
    return VerifyCosts(verify=tuple(1.0 + growth * (n - 1) ** 2 for n in range(1, block_size + 1)), draft=0.0)


def test_best_num_draft_maximises_expected_tokens_per_second():
    costs = VerifyCosts(verify=(1.0, 1.1, 1.2, 3.0), draft=0.0)
    # expected tokens for k = 0..3: 1, 1.9, 2.71, 2.781; per cost: 1, 1.73, 2.26, 0.93
    assert costs.best_num_draft(torch.tensor([[0.9, 0.9, 0.1]])) == 2
    assert costs.best_num_draft(torch.tensor([[0.05, 0.9, 0.9]])) == 0  # the first proposal is already doubtful
    gpu_like = VerifyCosts(verify=(1.0,) * 8, draft=0.1)
    assert gpu_like.best_num_draft(torch.full((1, 7), 0.3)) == 7  # verifying is free: keep every proposal


def test_best_num_draft_adds_up_the_rows_of_a_batch():
    costs = VerifyCosts(verify=(1.0, 1.5), draft=0.0)
    assert costs.best_num_draft(torch.tensor([[0.4]])) == 0  # 1.4 / 1.5 < 1
    assert costs.best_num_draft(torch.tensor([[0.4], [0.9]])) == 1  # (2 + 1.3) / 1.5 > 2
    assert costs.best_num_draft(torch.tensor([[0.9, 0.9]])) == 1  # cannot verify more than B tokens costed


def test_best_num_draft_counts_the_draft_cost():
    confident = torch.tensor([[0.6, 0.6]])  # expected tokens 1, 1.6, 1.96
    verify = (1.0, 1.7, 2.2)
    assert VerifyCosts(verify=verify, draft=0.0).best_num_draft(confident) == 0  # 1 > 0.94 > 0.89
    assert VerifyCosts(verify=verify, draft=2.0).best_num_draft(confident) == 2  # 0.33 < 0.43 < 0.47


def test_best_num_nodes_counts_every_node_a_tree_may_accept():
    costs = VerifyCosts(verify=(1.0, 1.1, 1.2, 1.3, 3.0), draft=0.0)
    chain_probs = torch.tensor([[0.5, 0.25, 0.125]])  # a chain: expected 1.5, 1.75, 1.875, per cost best at 2
    tree_probs = torch.tensor([[0.5, 0.4, 0.35, 0.3]])  # siblings: expected 1.5, 1.9, 2.25, 2.55
    assert costs.best_num_nodes(chain_probs) == 2  # 1.75 / 1.2 = 1.46 beats 1.36 and 1.44
    assert costs.best_num_nodes(tree_probs) == 3  # 2.25 / 1.3 = 1.73 beats 1.9 / 1.2 and 2.55 / 3.0
    assert costs.best_num_draft(torch.tensor([[0.5, 0.5, 0.5]])) == costs.best_num_nodes(chain_probs)


def test_round_overhead_fits_fixed_and_per_node_seconds():
    overhead = RoundOverhead(window=8, min_rounds=4)
    for num_nodes in (0, 2, 4):
        overhead.record(num_nodes, 0.010 + 0.002 * num_nodes)
    assert overhead.fixed_and_per_node == (0.0, 0.0)  # too few rounds to judge
    assert overhead.seconds(3).tolist() == [0.0] * 4
    overhead.record(6, 0.010 + 0.002 * 6)
    fixed, per_node = overhead.fixed_and_per_node
    assert fixed == pytest.approx(0.010) and per_node == pytest.approx(0.002)
    assert overhead.seconds(2).tolist() == pytest.approx([0.010, 0.012, 0.014])


def test_round_overhead_clamps_an_outlier_and_never_goes_negative():
    overhead = RoundOverhead(window=16, min_rounds=4)
    for num_nodes in (1, 3, 5, 7) * 3:
        overhead.record(num_nodes, 0.004 + 0.001 * num_nodes)
    overhead.record(3, 0.5)  # a prompt's first draft read the whole prompt
    fixed, per_node = overhead.fixed_and_per_node
    assert fixed == pytest.approx(0.004, abs=0.002) and per_node == pytest.approx(0.001, abs=0.0005)
    faster = RoundOverhead(window=8, min_rounds=4)
    for num_nodes in (0, 2, 4, 6):
        faster.record(num_nodes, 0.003 - 0.001 * num_nodes)  # rounds faster than the modelled forwards
    assert faster.seconds(6).tolist() == pytest.approx([0.003, 0.002, 0.001, 0.0, 0.0, 0.0, 0.0])


def test_round_overhead_keeps_its_slope_while_the_plans_keep_one_length():
    overhead = RoundOverhead(window=8, min_rounds=4)
    for num_nodes in (0, 2, 4, 6):
        overhead.record(num_nodes, 0.001 * num_nodes)
    for _ in range(8):  # the plan settled on 3 nodes: the window's node counts no longer vary
        overhead.record(3, 0.003)
    assert overhead.fixed_and_per_node == pytest.approx((0.0, 0.001))
    for _ in range(8):  # ... and its rounds now spend 1 ms more
        overhead.record(3, 0.004)
    fixed, per_node = overhead.fixed_and_per_node
    assert per_node == pytest.approx(0.001) and fixed == pytest.approx(0.001)


def test_best_num_nodes_weighs_a_rounds_overhead():
    costs = VerifyCosts(verify=(1.0, 1.1, 1.2, 1.3), draft=0.0)
    probs = torch.tensor([[0.5, 0.25, 0.125]])  # a chain: expected 1, 1.5, 1.75, 1.875
    assert costs.best_num_nodes(probs) == 2  # 1.75 / 1.2 = 1.46 beats 1.5 / 1.1 and 1.875 / 1.3

    def overhead(fixed: float, per_node: float) -> RoundOverhead:
        learned = RoundOverhead(min_rounds=2)
        for num_nodes in (0, 3):
            learned.record(num_nodes, fixed + per_node * num_nodes)
        return learned

    assert costs.best_num_nodes(probs, overhead(0.0, 0.2)) == 1  # 1.5 / 1.3 beats 1.75 / 1.6 and 1 / 1
    assert costs.best_num_nodes(probs, overhead(2.0, 0.0)) == 3  # 1.875 / 3.3 beats 1.75 / 3.2


def test_plans_learn_what_rounds_spend_beside_their_measured_forwards(monkeypatch, modelled_device):
    """Measured costs (`"auto"`, here the modelled device's) plus 0.05 s a verified node that no forward spends: the
    planner learns the 0.05 and verifies fewer proposals than a planner told the forwards alone, still exactly."""
    target = make_target("llama")
    prompt = random_prompt(12, seed=4)
    reference = greedy_reference(target, prompt, 60)
    draft = make_oracle(target, [reference], p_wrong=0.3, block_size=8)
    costs = quadratic_costs(8, 0.002)
    modelled_device.attach(target, draft, costs)
    monkeypatch.setattr(policy, "measure_verify_costs", lambda *args, **kwargs: costs)
    original_accept = speculative.accept

    def billed_accept(setup, proposal, target_logits):
        modelled_device.now += 0.05 * proposal.tree.num_nodes
        return original_accept(setup, proposal, target_logits)

    monkeypatch.setattr(speculative, "accept", billed_accept)
    run = functools.partial(speculative_generate, target, draft, prompt[None], max_new_tokens=60, tree=False)
    measured, fixed, given = VerifyPlanner(), VerifyPlanner(costs=costs), VerifyPlanner()
    learned = run(verify_costs="auto", planner=measured)
    told = run(verify_costs="auto", planner=fixed)
    assert learned.sequences[0].tolist() == told.sequences[0].tolist() == reference.tolist()
    overheads = {path.rsplit(", ", 1)[1]: overhead for (path, _), overhead in measured._overheads.items()}
    assert set(overheads) == {"chain rounds", "tree rounds"}
    overhead = overheads["chain rounds"]  # chains only (`tree=False`): the tree rounds' overhead never learned
    assert overhead.fixed_and_per_node == pytest.approx((0.0, 0.05), abs=1e-6)
    assert overheads["tree rounds"].fixed_and_per_node == (0.0, 0.0)
    assert learned.stats.verified_drafts_per_round < told.stats.verified_drafts_per_round
    # the costs the planner measured, passed back as an object (as the benchmark does): the same path learns on
    rounds_before = list(overhead._rounds)
    run(verify_costs=measured.costs_for(target, draft, batch_size=1), planner=measured)
    assert (
        overheads["chain rounds"] is overhead and overhead._rounds != rounds_before and len(measured._overheads) == 2
    )
    run(verify_costs=costs, planner=given)  # costs a caller fixed are the whole model, as are a planner's own
    assert not fixed._overheads and not given._overheads


@pytest.mark.parametrize("tree_bill", [0.0, 0.5])
def test_a_tree_is_weighed_against_the_argmax_chain_by_what_its_rounds_spend(monkeypatch, modelled_device, tree_bill):
    """Measured costs and a modelled clock that bills every round verifying a real tree `tree_bill` seconds beside
    its forwards (a tree mask and a cache gather that cost): billed, the planner learns it and verifies chains
    instead; not billed, trees where a sibling is worth its node (6 of 36 rounds with this drafter). The tokens are
    the target's either way."""
    target = make_target("llama")
    prompt = random_prompt(12, seed=6)
    reference = greedy_reference(target, prompt, 80)
    draft = tree_oracle(target, [reference], 0.3, 0.2)
    costs = quadratic_costs(17, 0.002)
    modelled_device.attach(target, draft, costs)
    monkeypatch.setattr(policy, "measure_verify_costs", lambda *args, **kwargs: costs)
    original_verify = speculative.verify

    def billed_verify(setup, state, tree):
        modelled_device.now += 0.0 if tree.is_chain else tree_bill
        return original_verify(setup, state, tree)

    monkeypatch.setattr(speculative, "verify", billed_verify)
    planner = VerifyPlanner()
    run = functools.partial(
        speculative_generate, target, draft, prompt[None], max_new_tokens=80, verify_costs="auto", planner=planner
    )
    calls = [run() for _ in range(3)]
    assert all(call.sequences[0].tolist() == reference.tolist() for call in calls)
    if tree_bill:  # tree rounds until the planner has timed enough of them to learn their cost, then none
        assert sum(call.stats.tree_rounds for call in calls) <= RoundOverhead().min_rounds
        assert calls[-1].stats.tree_rounds == 0
    else:
        assert calls[-1].stats.tree_rounds >= 4  # where a sibling is worth its node


def test_fallback_pauses_drafting_that_does_not_pay_and_backs_off():
    costs = VerifyCosts(verify=(1.0, 1.5, 2.0), draft=0.5)
    fallback = Fallback(costs, window=4, min_rounds=2, first_backoff=3, max_backoff=6, reference_plain_steps=1)
    fallback.record(committed=2, num_rows=1, seconds=2.0)
    assert fallback.should_draft()
    fallback.record(committed=2, num_rows=1, seconds=2.0)  # a judgement is due, but no plain step was timed yet
    assert not fallback.should_draft()
    fallback.record_plain(seconds=1.0)  # plain decoding: 1 token per second
    fallback.record(committed=2, num_rows=1, seconds=2.0)  # 1 token per second: the same as plain decoding
    assert fallback.should_draft()
    fallback.record(committed=1, num_rows=1, seconds=2.0)  # 7 tokens in 8 s < 1 per s
    assert [fallback.should_draft() for _ in range(4)] == [False, False, False, True]
    fallback.record(committed=1, num_rows=1, seconds=2.0)
    fallback.record(committed=1, num_rows=1, seconds=2.0)  # the probe failed too: twice the pause
    assert [fallback.should_draft() for _ in range(7)] == [False] * 6 + [True]
    for _ in range(4):  # a full window that pays resets the pause
        fallback.record(committed=3, num_rows=1, seconds=2.0)
    assert fallback.backoff == 3 and fallback.should_draft()


def test_fallback_judges_rounds_by_their_measured_seconds_against_measured_plain_steps():
    """The modelled costs say a round verifying one node costs 2 s and a plain step 1 s; what the loop timed wins."""
    costs = VerifyCosts(verify=(1.0, 1.5), draft=0.5)
    fallback = Fallback(costs, window=4, min_rounds=2, reference_plain_steps=0)
    for _ in range(2):
        fallback.record(committed=2, num_rows=1, seconds=2.2)  # 0.91 tokens/s: slower than the modelled 1/s
    assert not fallback.should_draft()
    fallback = Fallback(costs, window=4, min_rounds=2, reference_plain_steps=0)
    for seconds in (1.5, 1.6, 3.0):  # plain steps really take 2.0 s on average (the last `window`)
        fallback.record_plain(seconds)
    assert fallback.plain_seconds == pytest.approx(6.1 / 3)
    for _ in range(2):
        fallback.record(committed=2, num_rows=1, seconds=2.2)  # 0.91 tokens/s beats plain's 0.49/s
    assert fallback.should_draft()
    for seconds in (0.5, 0.5, 0.5, 0.5):  # the window keeps the last 4 plain steps: 0.5 s each
        fallback.record_plain(seconds)
    fallback.record(committed=2, num_rows=1, seconds=2.2)  # 6 tokens in 6.6 s < 2 per s
    assert not fallback.should_draft()


def test_fallback_judges_a_batch_against_plain_decoding_of_every_row():
    costs = VerifyCosts(verify=(1.0, 1.5), draft=0.0)
    fallback = Fallback(costs, window=2, min_rounds=2, reference_plain_steps=0)
    for _ in range(2):
        fallback.record(committed=5, num_rows=4, seconds=1.5)  # 5 tokens in 1.5 s < 4 rows per s
    assert not fallback.should_draft()


def test_a_useless_draft_costs_little_more_than_plain_decoding(modelled_device):
    """A draft that is never right, yet sure of itself: after a few rounds the loop decodes plainly, probing now and
    then, so its cost stays near plain decoding's. Costs shaped like SmolLM2's on this CPU (a draft 0.13x a
    step, 2 tokens 1.12x), linear beyond the first step so that the totals give the exact cost; the loop's clock
    bills the same costs."""
    target = make_target("llama")
    prompt = random_prompt(10, seed=2)
    reference = greedy_reference(target, prompt, 200)
    draft = make_oracle(target, [reference], p_wrong=1.0, block_size=4)
    modelled_device.attach(target, draft)
    costs = USELESS_DRAFT_COSTS  # verify(n) = 1 + 0.12 (n - 1)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=200, verify_costs=costs, tree=False)
    stats = out.stats
    assert out.sequences[0].tolist() == reference.tolist()
    assert stats.plain_steps > 150
    # The fallback judges measured seconds, in which a useless round (a draft, then a forward over more tokens) is
    # always slower than a plain step: 4 rounds, 2 timed plain steps, 1 more round, then probes of 4 rounds after
    # pauses of 8, 16, 32, 64 and 128 steps (248 >= 199 steps).
    assert stats.num_rounds <= 5 + 4 * 5
    cost = stats.num_rounds * (0.13 + 1.0) + 0.12 * stats.verified_drafts + stats.plain_steps * 1.0
    assert cost / (200 - 1) < 1.06  # 199 plain steps after the prefill


def test_the_fallback_judgement_carries_from_one_call_to_the_next(modelled_device):
    """Each prompt must not pay the probes again: a second call with the same planner goes on with the pause the
    first one reached (a probe of 4 rounds, then 256 steps), while another decoding path or a new planner start
    afresh."""
    target = make_target("llama")
    prompt = random_prompt(10, seed=2)
    reference = greedy_reference(target, prompt, 200)
    draft = make_oracle(target, [reference], p_wrong=1.0, block_size=4)
    modelled_device.attach(target, draft)
    costs = USELESS_DRAFT_COSTS
    planner = VerifyPlanner()
    run = functools.partial(
        speculative_generate, target, draft, prompt[None], max_new_tokens=200, tree=False, verify_costs=costs
    )
    first, second = run(planner=planner), run(planner=planner)
    assert first.sequences[0].tolist() == second.sequences[0].tolist() == reference.tolist()
    assert first.stats.num_rounds > 10  # probes after pauses of 8, 16, 32, 64
    assert second.stats.num_rounds <= 4
    assert planner.fallback(costs, "a path") is planner.fallback(costs, "a path")
    assert planner.fallback(costs, "a path") is not planner.fallback(costs, "another path")
    other_path = run(planner=planner, tree=3)  # trees take other times: judged apart
    assert other_path.sequences[0].tolist() == reference.tolist()
    assert other_path.stats.num_rounds > 10
    assert run(planner=VerifyPlanner()).stats.num_rounds > 10  # a new planner probes afresh
    assert run().stats.num_rounds > 10  # no planner: nothing carries over


def test_a_planner_is_shared_not_copied_and_keeps_no_state_on_the_models():
    import copy

    target = make_target("llama")
    draft = make_draft(target, block_size=4)
    planner = VerifyPlanner(costs=VerifyCosts(verify=(1.0, 1.1, 1.2, 1.3), draft=0.1))
    assert copy.deepcopy(planner) is planner  # `generate` deep-copies its generation config
    before = (set(vars(target)), set(vars(draft)))
    speculative_generate(
        target, draft, random_prompt(6, 1)[None], max_new_tokens=6, verify_costs="auto", planner=planner
    )
    assert (set(vars(target)), set(vars(draft))) == before
    assert planner.costs_for(target, draft, batch_size=1) is planner.costs  # fixed costs are never measured


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_with_a_costed_useless_drafter_skips_drafting_and_stays_exact(do_sample, modelled_device):
    target = make_target("llama")
    prompt = random_prompt(10, seed=2)
    reference = greedy_reference(target, prompt, 120)
    draft = make_oracle(target, [reference], p_wrong=1.0, block_size=4)
    modelled_device.attach(target, draft)
    planner = VerifyPlanner(costs=USELESS_DRAFT_COSTS)
    calls = []
    draft.register_forward_hook(lambda *args: calls.append(1))
    sampling = {"do_sample": True, "top_k": 1} if do_sample else {"do_sample": False}  # top-k 1: sampling = greedy
    config = GenerationConfig(max_new_tokens=120, dflash_planner=planner, **sampling)
    out = target.generate(prompt[None], assistant_model=draft, generation_config=config)
    assert out[0].tolist() == reference.tolist()
    assert len(calls) < 40  # the fallback paused drafting for most of the 119 steps after the prefill
    first_call = len(calls)
    out = target.generate(prompt[None], assistant_model=draft, generation_config=config)
    assert out[0].tolist() == reference.tolist()
    assert len(calls) - first_call < first_call  # the next call goes on with the pause the first one reached


@pytest.mark.parametrize(
    "bad", [{"verify": (), "draft": 0.0}, {"verify": (1.0, 0.0), "draft": 0.0}, {"verify": (1.0,), "draft": -1.0}]
)
def test_invalid_costs_are_refused(bad):
    with pytest.raises(ValueError, match="VerifyCosts needs"):
        VerifyCosts(**bad)


def test_unknown_verify_costs_value_is_refused():
    target = make_target("llama")
    with pytest.raises(ValueError, match="verify_costs must be None, 'auto' or a VerifyCosts"):
        speculative_generate(
            target, make_draft(target), random_prompt(5, 0)[None], max_new_tokens=3, verify_costs="on"
        )


def test_measured_costs_cover_the_block_and_are_cached_per_batch_size():
    target = make_target("llama")
    draft = make_draft(target, block_size=4)
    costs = measure_verify_costs(target, draft, context_length=16, repeats=1)
    assert len(costs.verify) == 4 and all(cost > 0 for cost in costs.verify) and costs.draft > 0
    planner = VerifyPlanner()
    once = planner.costs_for(target, draft, batch_size=1)
    assert planner.costs_for(target, draft, batch_size=1) is once
    assert planner.costs_for(target, draft, batch_size=2) is not once
    assert VerifyPlanner().costs_for(target, draft, batch_size=1) is not once  # memory is the planner's
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads != 1 else 2)  # forwards cost otherwise at another thread count
    try:
        assert planner.costs_for(target, draft, batch_size=1) is not once
    finally:
        torch.set_num_threads(threads)
    assert planner.costs_for(target, draft, batch_size=1) is once


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("growth", [0.05, 0.3])
@pytest.mark.parametrize("p_wrong", [0.0, 0.3])
def test_greedy_identical_when_verifying_fewer_proposals(family, growth, p_wrong, modelled_device):
    target = make_target(family)
    prompt = random_prompt(20, seed=11)
    with torch.no_grad():
        reference = target.generate(prompt[None], max_new_tokens=50, do_sample=False)[0]
    draft = make_oracle(target, [reference], p_wrong, block_size=8)
    modelled_device.attach(target, draft, quadratic_costs(8, growth))
    ours = speculative_generate(
        target, draft, prompt[None], max_new_tokens=50, verify_costs=quadratic_costs(8, growth)
    )
    assert ours.sequences[0].tolist() == reference.tolist()
    per_round = ours.stats.verified_drafts / ours.stats.num_rounds
    assert 0 < per_round < 7  # proposals were really cut, and some were still verified
    assert ours.stats.tau > 1


def test_batched_rows_stay_exact_when_verifying_fewer_proposals(modelled_device):
    target = make_target("qwen2")
    prompts = [random_prompt(n, seed=200 + n) for n in (4, 25, 13)]
    input_ids, attention_mask = left_pad(prompts)
    with torch.no_grad():
        references = [target.generate(p[None], max_new_tokens=40, do_sample=False)[0] for p in prompts]
    draft = make_oracle(target, references, p_wrong=0.2, block_size=8, seed=3)
    modelled_device.attach(target, draft, quadratic_costs(8, 0.1))
    out = speculative_generate(
        target, draft, input_ids, attention_mask, max_new_tokens=40, verify_costs=quadratic_costs(8, 0.1)
    )
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        new = reference[len(prompt) :].tolist()
        assert out.sequences[row, input_ids.shape[1] : input_ids.shape[1] + len(new)].tolist() == new
    assert out.stats.verified_drafts < 7 * out.stats.num_rounds


@pytest.mark.parametrize("generation_kwargs", SETTINGS, ids=["plain", "temperature-topk-topp"])
def test_sampling_stays_lossless_when_verifying_fewer_proposals(generation_kwargs):
    """Only the first of the two proposals of the first round is verified, chosen before sampling."""
    target = peaky_target("llama")
    draft = random_draft(target)
    exact = exact_joint(target, generation_kwargs)
    torch.manual_seed(2)
    n = 6000
    costs = VerifyCosts(verify=(1.0, 1.0, 100.0, 100.0), draft=0.0)
    out = speculative_generate(
        target, draft, PROMPT.expand(n, -1), max_new_tokens=4, verify_costs=costs, **generation_kwargs
    )
    histogram = out.stats.histogram
    assert histogram[1] > 0 and histogram[2] > 0 and histogram[3] == 0  # one proposal verified, never two
    samples = [tuple(row) for row in out.sequences[:, PROMPT.shape[1] : PROMPT.shape[1] + 3].tolist()]
    assert chi_square_pvalue(samples, exact) > 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_with_a_costed_drafter_proposes_fewer_and_stays_exact(family, monkeypatch, modelled_device):
    from hf_dflash import DFlashCandidateGenerator

    target = make_target(family)
    prompt = random_prompt(15, seed=12)
    with torch.no_grad():
        reference = target.generate(prompt[None], max_new_tokens=40, do_sample=False)[0]
    draft = make_oracle(target, [reference], p_wrong=0.3, block_size=8)
    modelled_device.attach(target, draft, quadratic_costs(8, 0.1))
    planner = VerifyPlanner(costs=quadratic_costs(8, 0.1))
    proposed = []
    original = DFlashCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        proposed.append(candidates.shape[1] - input_ids.shape[1])
        return candidates, logits

    monkeypatch.setattr(DFlashCandidateGenerator, "get_candidates", recording)
    config = GenerationConfig(max_new_tokens=40, do_sample=False, dflash_planner=planner)
    out = target.generate(prompt[None], assistant_model=draft, generation_config=config)
    assert out[0].tolist() == reference.tolist()
    assert 0 < max(proposed) < 7  # proposals were cut short, and some were still proposed


def test_sliding_window_batches_decoded_row_by_row_are_costed_per_row():
    target = make_target("gemma3")  # sliding-window layers: a batch is decoded one row at a time
    draft = make_draft(target, block_size=4)
    input_ids, attention_mask = left_pad([random_prompt(6, seed=1), random_prompt(9, seed=2)])
    planner = VerifyPlanner()
    speculative_generate(
        target, draft, input_ids, attention_mask, max_new_tokens=5, verify_costs="auto", planner=planner
    )
    assert [key[2] for key in planner._measured] == [1]  # (target, block size, batch size, ...)
