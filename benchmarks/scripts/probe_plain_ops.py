"""Which operators plain decoding runs two ways: `generate`, and `speculative_generate` with drafting switched off
(every step a plain step of our loop), on SmolLM2-135M-Instruct with the committed drafter. Prints both profiles'
operator counts and self CPU milliseconds side by side, largest difference first: an operator our plain step runs
and `generate` does not (or many more of them) is overhead the fallback's plain steps pay.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_plain_ops.py 1 32   # torch threads, new tokens
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from torch.profiler import ProfilerActivity, profile

from hf_dflash import DFlashForDrafting, speculative_generate
from hf_dflash.decoding import policy
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target

torch.set_num_threads(int(sys.argv[1]))
max_new_tokens = int(sys.argv[2])
target, tokenizer = load_target("smollm2-135m-instruct")
draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(torch.float32).eval()
messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
ids = ids["input_ids"]
policy.Fallback.should_draft = lambda self: False  # every step plain; the costs below are never planned on
costs = policy.VerifyCosts(verify=(1.0,) * 17, draft=0.0)


def ours() -> torch.Tensor:
    return speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, verify_costs=costs).sequences


def plain() -> torch.Tensor:
    with torch.no_grad():
        mask = torch.ones_like(ids)
        return target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)


tables = {}
for name, run in (("generate", plain), ("ours", ours)):
    run()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        new_tokens = run().shape[1] - ids.shape[1]
    events = prof.key_averages()
    tables[name] = {event.key: (event.count, event.self_cpu_time_total / 1000) for event in events}
    print(f"{name}: {new_tokens} new tokens, {sum(ms for _, ms in tables[name].values()):.0f} ms self CPU in all")
print(f"{'operator':48s} {'n generate':>10s} {'n ours':>8s} {'ms generate':>11s} {'ms ours':>8s}")
zero = (0, 0.0)
for key in sorted(
    set(tables["generate"]) | set(tables["ours"]),
    key=lambda key: -abs(tables["ours"].get(key, zero)[1] - tables["generate"].get(key, zero)[1]),
)[:30]:
    (n_plain, ms_plain), (n_ours, ms_ours) = tables["generate"].get(key, zero), tables["ours"].get(key, zero)
    print(f"{key[:48]:48s} {n_plain:10d} {n_ours:8d} {ms_plain:11.1f} {ms_ours:8.1f}")
