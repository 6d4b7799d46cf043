"""Is the verify policy what holds the speedup back? Record real rounds, then replay them under other policies.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/replay_verify_policy.py --draft drafters/smollm2-135m-instruct \
        --datasets gsm8k humaneval mt-bench --limit 8 --max-new-tokens 96

Each round verifies the whole block and records the draft's confidence in each proposal (its probability of its own
argmax) and how many proposals the target accepted. Knowing both, any policy's choice of `k` can be replayed
offline: a round then commits `min(accepted, k) + 1` tokens and costs `draft + verify(k + 1)`, with the costs that
`verify_costs="auto"` measures on this machine (in units of one plain decoding step). The table compares tokens
per unit of cost for: the shipped policy (`VerifyCosts.best_num_draft`), the same policy on rescaled confidences
(is the draft over-confident?), the best fixed `k`, and an oracle that knows how many will be accepted and verifies
the cheapest count that keeps them all (the ceiling for any policy with this draft). Calibration per slot is
printed too. The replay keeps whole-block decoding's round boundaries (a policy that verifies fewer would start
later rounds elsewhere in the same greedy text), so it estimates a policy's effect; it does not re-run it.
The last line is one JSON document.
"""

import argparse
import json
import os
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash import DFlashForDrafting, speculative_generate  # noqa: E402
from hf_dflash.bench.harness import load_benchmark_prompts  # noqa: E402
from hf_dflash.decoding.policy import (  # noqa: E402
    Fallback,
    RoundOverhead,
    VerifyCosts,
    VerifyPlanner,
    measure_verify_costs,
)
from hf_dflash.targets import load_target  # noqa: E402

SCALES = (1.0, 0.8, 0.6)


@dataclass(frozen=True)
class RecordingCosts(VerifyCosts):
    """Verifies every proposal and records the confidences it was asked about (batch 1)."""

    recorded: list[list[float]] = field(default_factory=list)

    def best_plan(self, path_probs: torch.Tensor, overhead: RoundOverhead | None = None) -> tuple[int, float]:
        """A chain's path probabilities are the running products of the proposals' confidences: record those, and
        plan every node (the rate is not asked for: chains only)."""
        previous = torch.cat([path_probs.new_ones(path_probs.shape[0], 1), path_probs[:, :-1]], dim=1)
        self.recorded.append((path_probs / previous)[0].tolist())
        return path_probs.shape[1], 0.0


class NeverFallingBack(VerifyPlanner):
    """A planner whose fallback, on any path, never judges (its window is shorter than the rounds it waits for):
    every step drafts."""

    def fallback(self, costs: VerifyCosts, path: str) -> Fallback:
        return Fallback(costs, window=1, min_rounds=2)


def record_rounds(target, draft, prompts, max_new_tokens: int) -> list[tuple[list[float], int]]:
    """(confidences of the k proposals, number accepted) for every drafted round of every prompt."""
    rounds = []
    for prompt in prompts:
        costs = RecordingCosts(verify=(1.0,) * draft.config.block_size, draft=0.0)
        ids = prompt.input_ids[None]
        out = speculative_generate(
            target,
            draft,
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            verify_costs=costs,
            planner=NeverFallingBack(),
            tree=False,
        )
        # a last step with nothing left to draft is a plain step: neither planned nor counted as a round
        rounds += [(c, length - 1) for c, length in zip(costs.recorded, out.stats.acceptance_lengths)]
    return rounds


def replay(rounds, choose, costs: VerifyCosts) -> dict:
    """Tokens per unit of cost and mean verified proposals when each round verifies `choose(confidences, accepted)`
    proposals (only the oracle looks at `accepted`)."""
    tokens = seconds = verified = 0.0
    for confidences, accepted in rounds:
        k = choose(confidences, accepted)
        tokens += min(accepted, k) + 1
        seconds += costs.draft + costs.verify[k]
        verified += k
    return {"tokens_per_cost": tokens / seconds, "verified": verified / len(rounds), "tau": tokens / len(rounds)}


def calibration(rounds, slots: int = 3) -> list[dict]:
    """Per slot, over rounds that reached it: mean confidence vs the rate it was accepted."""
    rows = []
    for slot in range(slots):
        reached = [(c[slot], accepted > slot) for c, accepted in rounds if len(c) > slot and accepted >= slot]
        if reached:
            confidence = sum(c for c, _ in reached) / len(reached)
            accepted = sum(a for _, a in reached) / len(reached)
            rows.append({"slot": slot + 1, "rounds": len(reached), "confidence": confidence, "accepted": accepted})
    return rows


def oracle_num_draft(costs: VerifyCosts, num_proposals: int, accepted: int) -> int:
    """What an oracle that knows how many proposals will be accepted verifies: the cheapest count keeping them all."""
    return min(range(accepted, num_proposals + 1), key=lambda k: costs.verify[k])


def compare_policies(rounds, costs: VerifyCosts) -> dict:
    """The shipped policy on raw and rescaled confidences, every fixed k, and the oracle."""
    relative = VerifyCosts(
        verify=tuple(v / costs.verify[0] for v in costs.verify), draft=costs.draft / costs.verify[0]
    )
    block = len(relative.verify) - 1
    results = {
        f"policy x{scale}": replay(
            rounds, lambda c, _, s=scale: relative.best_num_draft(s * torch.tensor([c])), relative
        )
        for scale in SCALES
    }
    fixed = {k: replay(rounds, lambda c, _, k=k: min(k, len(c)), relative) for k in range(block + 1)}
    best_k = max(fixed, key=lambda k: fixed[k]["tokens_per_cost"])
    results[f"fixed k={best_k} (best)"] = fixed[best_k]
    results["oracle"] = replay(rounds, lambda c, accepted: oracle_num_draft(relative, len(c), accepted), relative)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    target, tokenizer = load_target(args.target)
    draft = DFlashForDrafting.from_pretrained(args.draft, dtype=target.dtype).eval()
    costs = measure_verify_costs(target, draft)
    report = {"args": vars(args), "verify_costs_relative": costs.relative(), "datasets": {}}
    print(f"verify costs (x one token): {costs.relative()}, draft {costs.draft / costs.verify[0]:.2f}")
    for dataset in args.datasets:
        rounds = record_rounds(
            target, draft, load_benchmark_prompts(tokenizer, [dataset], args.limit), args.max_new_tokens
        )
        policies, slots = compare_policies(rounds, costs), calibration(rounds)
        report["datasets"][dataset] = {"rounds": len(rounds), "policies": policies, "calibration": slots}
        print(f"\n{dataset}: {len(rounds)} rounds")
        for name, r in policies.items():
            print(
                f"  {name:22s} {r['tokens_per_cost']:.3f} tokens per plain step  (tau {r['tau']:.2f}, k {r['verified']:.2f})"
            )
        for row in slots:
            print(
                f"  slot {row['slot']}: confidence {row['confidence']:.2f}, accepted {row['accepted']:.2f} ({row['rounds']} rounds)"
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
