"""`benchmarks/scripts/replay_verify_policy.py`: the rounds it records are the loop's own, and its replay arithmetic is right."""

from pathlib import Path
from types import SimpleNamespace

import torch
from helpers import load_module, make_oracle, make_target
from test_generation import random_prompt

from hf_dflash.decoding.policy import VerifyCosts

replay_verify_policy = load_module(
    Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "replay_verify_policy.py"
)


def _record(p_wrong: float, max_new_tokens: int = 40):
    target = make_target("qwen3")
    prompt = random_prompt(16, seed=5)
    with torch.no_grad():
        reference = target.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False)[0]
    draft = make_oracle(target, [reference], p_wrong, block_size=8)
    return replay_verify_policy.record_rounds(target, draft, [SimpleNamespace(input_ids=prompt)], max_new_tokens)


def test_recorded_rounds_cover_the_generation_and_accept_what_the_draft_got_right():
    perfect = _record(p_wrong=0.0)
    assert all(accepted == len(confidences) == 7 for confidences, accepted in perfect[:-1])
    noisy = _record(p_wrong=0.4)
    assert any(accepted < len(confidences) for confidences, accepted in noisy)
    for rounds in (perfect, noisy):
        committed = sum(accepted + 1 for _, accepted in rounds)
        assert 40 - 1 <= committed <= 40  # a last round with nothing to draft commits its bonus token unrecorded


def test_replay_counts_committed_tokens_and_costs():
    costs = VerifyCosts(verify=(1.0, 1.2, 1.5), draft=0.5)
    rounds = [([0.9, 0.8], 2), ([0.1, 0.9], 0)]
    verify_all = replay_verify_policy.replay(rounds, lambda c, _: len(c), costs)
    # tokens (2 + 1) + (0 + 1) = 4; cost 2 * (0.5 + 1.5) = 4
    assert verify_all == {"tokens_per_cost": 1.0, "verified": 2.0, "tau": 2.0}
    verify_none = replay_verify_policy.replay(rounds, lambda c, _: 0, costs)
    assert verify_none["tau"] == 1.0 and verify_none["tokens_per_cost"] == 2 / 3


def test_oracle_keeps_every_accepted_token_at_the_cheapest_count():
    costs = VerifyCosts(verify=(1.0, 1.1, 1.9, 1.6), draft=0.0)  # 4 tokens measured cheaper than 3, as seen on CPUs
    assert replay_verify_policy.oracle_num_draft(costs, num_proposals=3, accepted=0) == 0
    assert replay_verify_policy.oracle_num_draft(costs, num_proposals=3, accepted=2) == 3
    assert replay_verify_policy.oracle_num_draft(costs, num_proposals=2, accepted=2) == 2
    rounds = [([0.5, 0.5, 0.5], accepted) for accepted in (0, 1, 2, 3)]
    policies = replay_verify_policy.compare_policies(rounds, costs)
    best_other = max(r["tokens_per_cost"] for name, r in policies.items() if name != "oracle")
    assert policies["oracle"]["tokens_per_cost"] > best_other
