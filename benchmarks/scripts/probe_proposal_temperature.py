"""Sampling acceptance against the temperature of the draft's proposal distribution `q`.

Speculative sampling is lossless for any `q`; `speculative_generate` draws proposals from the draft's logits warped
like the target's (its temperature, its top-p nucleus). A drafter trained on the target's greedy continuations may be
flatter or sharper than the target's warped distribution, and the acceptance `sum(min(p, q))` is highest where `q`
is closest to `p`. This probe replaces the temperature of `q` alone (the target keeps `--temperature`) and measures
tau with every round verifying the whole block (no planner, no timing: it may run beside other work), over the same
prompts and seeds for each draft temperature.

    python benchmarks/scripts/probe_proposal_temperature.py --draft_temperatures 1.0 0.85 0.7 0.6 0.5 0.4 \
        --datasets gsm8k:12 humaneval:12 --seeds 0 1 --output proposal_temperature.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from transformers import LogitsProcessorList, TemperatureLogitsWarper  # noqa: E402

import hf_dflash.decoding.speculative as speculative  # noqa: E402
from hf_dflash.atomic_files import write_text_atomic  # noqa: E402
from hf_dflash.data.chat import encode_prompt  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="drafters/smollm2-135m-instruct")
    parser.add_argument("--draft_temperatures", type=float, nargs="+", required=True)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:12", "humaneval:12"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


def at_draft_temperature(draft_temperature: float):
    """`speculative.proposal_warpers` with the sampling temperature replaced by `draft_temperature` (for `q` only)."""
    original = speculative.proposal_warpers

    def proposal_warpers(warpers: LogitsProcessorList) -> LogitsProcessorList:
        return LogitsProcessorList(
            TemperatureLogitsWarper(draft_temperature) if isinstance(w, TemperatureLogitsWarper) else w
            for w in original(warpers)
        )

    return proposal_warpers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer = load_target_and_tokenizer(args.target, dtype=torch.bfloat16)
    draft = load_draft(args.draft, target)
    prompts = [p for entry in args.datasets for p in load_prompts(*split_set_limit(entry, None))]
    original = speculative.proposal_warpers
    results = {}
    for draft_temperature in args.draft_temperatures:
        speculative.proposal_warpers = at_draft_temperature(draft_temperature)
        taus: dict[str, list[float]] = {}
        for seed in args.seeds:
            for prompt in prompts:
                torch.manual_seed(seed)
                out = speculative.speculative_generate(
                    target,
                    draft,
                    torch.tensor([encode_prompt(tokenizer, prompt)]),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=True,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    top_k=0,
                )
                taus.setdefault(prompt.dataset, []).append(out.stats.tau)
        results[str(draft_temperature)] = {name: sum(v) / len(v) for name, v in taus.items()}
        print(draft_temperature, results[str(draft_temperature)], flush=True)
    speculative.proposal_warpers = original
    report = {
        "conditions": {
            "target": args.target,
            "draft": args.draft,
            "datasets": args.datasets,
            "seeds": args.seeds,
            "max_new_tokens": args.max_new_tokens,
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": 0},
            "verify": "whole block every round (no verify_costs); tau is the mean over prompts and seeds",
            "command": "python benchmarks/scripts/probe_proposal_temperature.py " + " ".join(sys.argv[1:]),
        },
        "tau_by_draft_temperature": results,
    }
    write_text_atomic(args.output, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
