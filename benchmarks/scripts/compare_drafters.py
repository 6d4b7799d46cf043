"""Two drafters of one target on the same prompts: which one the target accepts more of. The check before a committed
drafter is replaced (it is replaced only if the candidate measures better on every prompt set).

For each drafter it runs greedy `speculative_generate` verifying the whole block every round (tau is the drafter's
acceptance, free of the round planner and of timing, so the two need not run at the same time) on the first prompts
of GSM8K, HumanEval and MT-Bench, and prints one JSON document last: each drafter's tau per set, the candidate's gain
with a 90% interval from a paired bootstrap over the prompts, and whether it gains on every set.

    python benchmarks/scripts/compare_drafters.py --current drafters/smollm2-135m-instruct --candidate runs/smollm2-s3 \
        --datasets gsm8k:50 humaneval:50 mt-bench:50 --max_new_tokens 128 --output runs/compare.json

`better_on_every_set` compares the measured taus; `resolved_on_every_set` asks more, a gain whose whole interval lies
above zero on every set. `--reuse REPORT` reads the current drafter's runs from an earlier report measured the same
way (greedy whole-block tau is deterministic) on the same weights (a folder's path names whatever was committed there
last, so each drafter's entry records `hf_dflash.adapters.draft_fingerprint` of the loaded drafter), so a second
candidate costs one drafter's time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peft_acceptance import (  # noqa: E402
    DATASETS,
    WHOLE_BLOCK_GREEDY,
    acceptance_by_dataset,
    differing_conditions,
    tau_difference,
    taus,
)

from hf_dflash.adapters import draft_fingerprint  # noqa: E402
from hf_dflash.atomic_files import write_text_atomic  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402


def gains(current: dict[str, dict], candidate: dict[str, dict]) -> dict[str, dict]:
    """Per prompt set, the candidate's tau minus the current drafter's, with its 90% paired-bootstrap interval (each
    argument `acceptance_by_dataset`'s result on the same prompts)."""
    result = {}
    for name, runs in candidate.items():
        gain, interval = tau_difference(runs, current[name])
        result[name] = {"gain": gain, "interval_90": interval}
    return result


def verdict(set_gains: dict[str, dict]) -> dict[str, bool]:
    """Whether the candidate gains on every set (`better_on_every_set`), and whether every gain's 90% interval lies
    above zero (`resolved_on_every_set`)."""
    return {
        "better_on_every_set": all(gain["gain"] > 0 for gain in set_gains.values()),
        "resolved_on_every_set": all(
            gain["interval_90"] is not None and gain["interval_90"][0] > 0 for gain in set_gains.values()
        ),
    }


def reused_current(path: str | None, fingerprint: str, conditions: dict) -> dict | None:
    """The current drafter's runs from an earlier report of this script, when it measured the same weights (the
    loaded drafter's `fingerprint`, `draft_fingerprint`) under the same conditions; None without `--reuse`."""
    if path is None:
        return None
    report = json.loads(Path(path).read_text())
    differing = differing_conditions(report["conditions"], conditions)
    if report["current"].get("draft_fingerprint") != fingerprint:
        differing.append("current drafter's weights (or none recorded)")
    if differing:
        raise SystemExit(f"--reuse {path}: measured with another {', '.join(differing)}; drop --reuse to rerun it.")
    return report["current"]["acceptance"]


def measure(target, tokenizer, name: str, draft, prompts: dict, max_new_tokens: int) -> dict:
    """The loaded drafter `draft`'s `acceptance_by_dataset`, timed and printed under `name`."""
    start = time.perf_counter()
    acceptance = acceptance_by_dataset(target, tokenizer, draft, prompts, max_new_tokens)
    print(f"{name}: tau {taus(acceptance)} ({time.perf_counter() - start:.0f} s)", flush=True)
    return acceptance


def drafter_entry(path: str, fingerprint: str, acceptance: dict) -> dict:
    """A drafter's part of the report: where it is, its weights' `draft_fingerprint`, its tau per set and its runs
    per prompt."""
    return {"path": path, "draft_fingerprint": fingerprint, "tau": taus(acceptance), "acceptance": acceptance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--current", required=True, help="the committed drafter (a folder or Hub id)")
    parser.add_argument("--candidate", required=True, help="the drafter that would replace it")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), help="NAME or NAME:N (its first N prompts)")
    parser.add_argument("--limit", type=int, default=10, help="first prompts of each set without :N")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--reuse", default=None, help="an earlier report: its current drafter's runs are read")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    prompts = {
        name: load_prompts(name, count) for name, count in (split_set_limit(d, args.limit) for d in args.datasets)
    }
    conditions = {
        "target": args.target,
        "prompts": {name: len(items) for name, items in prompts.items()},
        "max_new_tokens": args.max_new_tokens,
        "verify": WHOLE_BLOCK_GREEDY,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "command": " ".join(sys.argv),
    }
    target, tokenizer = load_target_and_tokenizer(args.target, device="cpu")
    drafts = {path: load_draft(path, target) for path in (args.current, args.candidate)}
    fingerprints = {path: draft_fingerprint(draft) for path, draft in drafts.items()}
    current = reused_current(args.reuse, fingerprints[args.current], conditions)
    if current is None:
        current = measure(target, tokenizer, args.current, drafts[args.current], prompts, args.max_new_tokens)
    candidate = measure(target, tokenizer, args.candidate, drafts[args.candidate], prompts, args.max_new_tokens)
    set_gains = gains(current, candidate)
    report = {
        "conditions": conditions,
        "current": drafter_entry(args.current, fingerprints[args.current], current),
        "candidate": drafter_entry(args.candidate, fingerprints[args.candidate], candidate),
        "gain": set_gains,
        **verdict(set_gains),
    }
    write_text_atomic(args.output, json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
