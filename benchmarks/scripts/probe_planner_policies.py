"""Modelled speedup of planner variants on the committed drafter, from the costs measured in the run (no timing):
the planner with trees, without the fallback, chains only, and the draft's probabilities scaled by 0.8 / 0.6.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_planner_policies.py gsm8k 8 128   # dataset, prompts, new tokens
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash import DFlashForDrafting, speculative_generate
from hf_dflash.bench.harness import load_benchmark_prompts
from hf_dflash.decoding import policy, speculative
from hf_dflash.decoding.policy import VerifyCosts, VerifyPlanner
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target

target, tok = load_target("smollm2-135m-instruct")
draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(torch.float32).eval()
ds = sys.argv[1]
n = int(sys.argv[2])
tokens = int(sys.argv[3])
prompts = load_benchmark_prompts(tok, [ds], n)
costs = VerifyPlanner().costs_for(target, draft, 1, 17)
log = []
orig = speculative.SpeculativeStats.record_plan


def rec(self, tree, drafted):
    log.append(tree.num_nodes if drafted else -1)
    return orig(self, tree, drafted)


speculative.SpeculativeStats.record_plan = rec


def run(name, fallback=True, scale=1.0, tree=None):
    log.clear()
    rec_orig = policy.Fallback.record
    if not fallback:
        policy.Fallback.record = lambda *a, **k: None
    bn = VerifyCosts.best_plan
    if scale != 1.0:
        VerifyCosts.best_plan = lambda self, pp, overhead=None: bn(self, pp * scale, overhead)
    toks = 0
    taus = []
    planner = VerifyPlanner(costs=costs)  # the fallback's judgement carries from prompt to prompt
    for p in prompts:
        o = speculative_generate(
            target, draft, p.input_ids[None], max_new_tokens=tokens, verify_costs=costs, planner=planner, tree=tree
        )
        toks += o.num_new_tokens[0]
        taus += o.stats.acceptance_lengths
    policy.Fallback.record = rec_orig
    VerifyCosts.best_plan = bn
    cost = sum(costs.verify[0] if k < 0 else costs.draft + costs.verify[k] for k in log)  # prefill excluded
    plain_cost = (toks - len(prompts)) * costs.verify[0]
    print(
        f"{name:22s} modelled speedup {plain_cost / cost:.3f}  tau {sum(taus) / len(taus):.3f}  plain steps {sum(k < 0 for k in log)}  rounds {sum(k >= 0 for k in log)} nodes/round {sum(k for k in log if k >= 0) / max(1, sum(k >= 0 for k in log)):.2f}",
        flush=True,
    )


run("auto")
run("auto no fallback", fallback=False)
run("chain no fallback", fallback=False, tree=False)
for s in (0.8, 0.6):
    run(f"auto scale {s}", scale=s)
    run(f"auto nofb scale {s}", fallback=False, scale=s)
