"""Acceptance of drafters on a target and on its fine-tuned version: README "Fine-tuned targets".

For each (target, drafter) pair it runs greedy `speculative_generate` verifying the whole block every round (so tau
is the drafter's acceptance, free of the planner and of timing) on the first prompts of GSM8K, HumanEval and MT-Bench,
and prints one JSON document last: tau per pair and prompt set, with the conditions.

    python benchmarks/peft_acceptance.py --target_adapter benchmarks/peft/telegraph-stop-target-lora --limit 16 \
        --pair base:base:drafters/smollm2-135m-instruct --pair tuned:base:drafters/smollm2-135m-instruct \
        --pair tuned:lora:drafters/smollm2-135m-instruct-telegraph-lora --pair tuned:full:runs/drafter-code-full \
        --output benchmarks/peft/acceptance_code_data.json

A pair is `TARGET:NAME:DRAFTER`, TARGET `base` or `tuned` (the target with `--target_adapter` merged), DRAFTER a
drafter folder or a drafter adapter folder (`hf_dflash.loading.load_draft` reads both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash import speculative_generate  # noqa: E402
from hf_dflash.data import encode_prompt  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402
from hf_dflash.prompts import load_prompts  # noqa: E402

DATASETS = ("gsm8k", "humaneval", "mt-bench")


def tau_by_dataset(target, tokenizer, draft, prompts: dict, max_new_tokens: int) -> dict[str, float]:
    """Whole-block tau (tokens committed per target forward) of `draft` on each prompt set."""
    taus = {}
    for name, items in prompts.items():
        lengths = []
        for prompt in items:
            ids = torch.tensor([encode_prompt(tokenizer, prompt)])
            out = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, do_sample=False)
            lengths += out.stats.acceptance_lengths
        taus[name] = round(sum(lengths) / len(lengths), 3)
    return taus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--target_adapter", required=True, help="the fine-tune (a PEFT adapter of --target)")
    parser.add_argument("--pair", action="append", required=True, help="TARGET:NAME:DRAFTER; repeat")
    parser.add_argument("--limit", type=int, default=5, help="first prompts of each set")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    prompts = {name: load_prompts(name, args.limit) for name in DATASETS}
    targets = {}
    results = []
    for pair in args.pair:
        which, name, drafter = pair.split(":", 2)
        if which not in targets:
            adapter = {"target_adapter": args.target_adapter, "merge_target_adapter": True} if which == "tuned" else {}
            targets[which] = load_target_and_tokenizer(args.target, device="cpu", **adapter)
        target, tokenizer = targets[which]
        start = time.perf_counter()
        taus = tau_by_dataset(target, tokenizer, load_draft(drafter, target), prompts, args.max_new_tokens)
        results.append({"target": which, "drafter": name, "path": drafter, "tau": taus})
        print(f"{which} target, {name} drafter: {taus} ({time.perf_counter() - start:.0f} s)", flush=True)
    report = {
        "conditions": {
            "target": args.target,
            "target_adapter": args.target_adapter,
            "prompts": {name: args.limit for name in DATASETS},
            "max_new_tokens": args.max_new_tokens,
            "verify": "whole block every round (speculative_generate, no verify_costs), greedy",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        },
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
