"""Plain decoding and target forward costs at 1 and 2 torch threads (alternated), first 3 GSM8K prompts, 64 tokens.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_threads.py
"""

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from hf_dflash import DFlashForDrafting
from hf_dflash.bench.harness import load_benchmark_prompts
from hf_dflash.decoding.policy import measure_verify_costs
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target

target, tok = load_target("smollm2-135m-instruct")
draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(torch.float32).eval()
prompts = load_benchmark_prompts(tok, ["gsm8k"], 3)
for threads in (1, 2, 1, 2):
    torch.set_num_threads(threads)
    t = 0
    n = 0
    for p in prompts:
        s = time.perf_counter()
        with torch.no_grad():
            out = target.generate(p.input_ids[None], max_new_tokens=64, do_sample=False)
        t += time.perf_counter() - s
        n += out.shape[1] - p.input_ids.shape[0]
    c = measure_verify_costs(target, draft, 1, max_tokens=17)
    print(
        threads,
        "plain tok/s",
        round(n / t, 2),
        "verify ms",
        [round(1000 * x, 1) for x in c.verify],
        "draft ms",
        round(1000 * c.draft, 1),
        flush=True,
    )
