"""Where a round's time goes against a plain step's, on the committed SmolLM2 drafter (what the fallback judges).

1. Each step of `speculative_generate(verify_costs="auto")`, timed from one fallback decision to the next: plain
   steps, and drafted rounds by the number of nodes they verified, beside the modelled seconds of the same round.
2. Plain decoding two ways, alternated per prompt: `generate`, and `speculative_generate` with drafting switched off
   (every step a plain step of our loop), in ms per token.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_step_times.py mt-bench 4 96   # dataset, prompts, new tokens
"""

import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash import DFlashForDrafting, speculative_generate
from hf_dflash.bench.harness import load_benchmark_prompts
from hf_dflash.decoding import policy, speculative
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target

torch.set_num_threads(2)
target, tokenizer = load_target("smollm2-135m-instruct")
draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(torch.float32).eval()
dataset, num_prompts, max_new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = [prompt.input_ids[None] for prompt in load_benchmark_prompts(tokenizer, [dataset], num_prompts)]
should_draft, record, record_plan = (
    policy.Fallback.should_draft,
    policy.Fallback.record,
    speculative.SpeculativeStats.record_plan,
)
planner = policy.VerifyPlanner()  # one for every run, as a caller holding it would
decisions, nodes, committed = [], [], []  # clock of each fallback decision (None: a run ended); per round


def timed_should_draft(self):
    decisions.append((time.perf_counter(), should_draft(self)))
    return decisions[-1][1]


def counted_record(self, tokens, rows, seconds):
    committed.append(tokens)
    return record(self, tokens, rows, seconds)


def counted_record_plan(self, tree, drafted):
    if drafted:
        nodes.append(tree.num_nodes)
    return record_plan(self, tree, drafted)


def speculative_run(ids, drafting=True):
    policy.Fallback.should_draft = timed_should_draft if drafting else lambda self: False
    out = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, verify_costs="auto", planner=planner)
    decisions.append((time.perf_counter(), None))
    return out.sequences.shape[1] - ids.shape[1]


def plain(ids):
    with torch.no_grad():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out.shape[1] - ids.shape[1]


policy.Fallback.record, speculative.SpeculativeStats.record_plan = counted_record, counted_record_plan
for ids in prompts:
    speculative_run(ids)
costs = planner.costs_for(target, draft, 1, 17)  # what the loop planned with (trees up to 16 nodes)
durations = [
    (1000 * (end - start), drafted)
    for (start, drafted), (end, _) in zip(decisions, decisions[1:])
    if drafted is not None
]
plain_ms = [ms for ms, drafted in durations if not drafted]
rounds = {}  # nodes -> [(ms, tokens)]
for (ms, _), num_nodes, tokens in zip([d for d in durations if d[1]], nodes, committed):
    rounds.setdefault(num_nodes, []).append((ms, tokens))
print(
    f"{len(plain_ms)} plain steps: median {statistics.median(plain_ms):.1f} ms (modelled {1000 * costs.verify[0]:.1f})"
)
for num_nodes, measured in sorted(rounds.items()):
    modelled = 1000 * costs.seconds(num_nodes) if num_nodes < len(costs.verify) else float("nan")
    print(
        f"{len(measured)} rounds verifying {num_nodes} nodes: median {statistics.median(ms for ms, _ in measured):.1f} ms "
        f"(modelled {modelled:.1f}), {sum(t for _, t in measured) / len(measured):.2f} tokens each"
    )

timings = {"generate": [], "our plain steps": []}
for _ in range(2):
    for ids in prompts:
        for name, run in (("generate", plain), ("our plain steps", lambda i: speculative_run(i, drafting=False))):
            start = time.perf_counter()
            new = run(ids)
            timings[name].append(1000 * (time.perf_counter() - start) / new)
for name, values in timings.items():
    print(f"{name}: median {statistics.median(values):.1f} ms a token over {len(values)} runs")
