"""Acceptance of drafters on a target and on its fine-tuned version (docs/fine-tuned-targets.md; the measurements:
benchmarks/notes/2026-12-01-fine-tuned-targets.md).

For each (target, drafter) pair it runs greedy `speculative_generate` verifying the whole block every round (so tau
is the drafter's acceptance, free of the planner and of timing) on the first prompts of GSM8K, HumanEval and MT-Bench,
and prints one JSON document last: tau per pair and prompt set, with the conditions.

    python benchmarks/scripts/peft_acceptance.py --target_adapter benchmarks/results/peft/telegraph-stop-target-lora \
        --datasets gsm8k:16 humaneval:40 mt-bench:16 \
        --pair base:base:drafters/smollm2-135m-instruct --pair tuned:base:drafters/smollm2-135m-instruct \
        --pair tuned:lora:drafters/smollm2-135m-instruct-telegraph-lora --pair tuned:full:runs/drafter-full \
        --output benchmarks/results/peft/acceptance_more_stubs.json

A pair is `TARGET:NAME:DRAFTER`, TARGET `base` or `tuned` (the target with `--target_adapter` merged), DRAFTER a
drafter folder or a drafter adapter folder (`hf_dflash.loading.load_draft` reads both). `--datasets humaneval:40`
takes a set's first 40 prompts instead of `--limit`; `--reuse REPORT ...` reads the pairs earlier reports measured
under the same conditions on the same weights (`hf_dflash.adapters.draft_fingerprint` of the loaded drafter) instead
of running them again
(greedy whole-block tau is deterministic; pairs on the base target also from a report on another `--target_adapter`).
`--card_acceptance lora=runs/card.json` also writes the `lora` pair's tau per set for
`hf-dflash card DIR --acceptance_json runs/card.json` (the drafter's card).

When the pairs include `base:base:D` and `tuned:base:D` (the base drafter on both targets), every other `tuned` pair
gets `share_of_loss_recovered` per set: `(tau - tau_tuned_base) / (tau_base_base - tau_tuned_base)`, null where the
fine-tune costs the base drafter no tau, with a 90% interval from a paired bootstrap over the prompts (the same
resampled prompts for the three pairs), because a share of a loss of 0.1 tau measured on 16 prompts is noisy.
`fine_tune_cost` gives the loss itself per set with its 90% interval: where the interval holds zero, the prompts do
not resolve a loss and no share of it means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash import speculative_generate  # noqa: E402
from hf_dflash.adapters import draft_fingerprint  # noqa: E402
from hf_dflash.data.chat import encode_prompt  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402

DATASETS = ("gsm8k", "humaneval", "mt-bench")
WHOLE_BLOCK_GREEDY = "whole block every round (speculative_generate, no verify_costs), greedy"
# the conditions greedy whole-block tau depends on: a report that matches them need not run again
REUSE_KEYS = ("target", "prompts", "max_new_tokens", "verify")


def acceptance_by_dataset(target, tokenizer, draft, prompts: dict, max_new_tokens: int) -> dict[str, dict]:
    """Per prompt set: whole-block tau of `draft`, and per prompt the tokens committed and the target forwards
    (rounds) it took, for paired comparisons. A drafter with a reduced vocabulary also gets `in_draft_vocabulary`:
    the share of the generated tokens it could propose at all (each one outside ends an accepted run)."""
    results = {}
    vocabulary = None if draft.draft_token_ids is None else draft.draft_token_ids.tolist()
    for name, items in prompts.items():
        committed, rounds, generated = [], [], []
        for prompt in items:
            ids = torch.tensor([encode_prompt(tokenizer, prompt)])
            out = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, do_sample=False)
            committed.append(sum(out.stats.acceptance_lengths))
            rounds.append(len(out.stats.acceptance_lengths))
            generated += out.sequences[0, ids.shape[1] : ids.shape[1] + out.num_new_tokens[0]].tolist()
        results[name] = {"tau": round(sum(committed) / sum(rounds), 3), "committed": committed, "rounds": rounds}
        if vocabulary is not None:
            results[name]["in_draft_vocabulary"] = round(share_inside(generated, vocabulary), 4)
    return results


def share_inside(tokens: list[int], vocabulary: list[int]) -> float:
    """The share of `tokens` that `vocabulary` holds (1.0 for no tokens)."""
    kept = set(vocabulary)
    return sum(token in kept for token in tokens) / len(tokens) if tokens else 1.0


def taus(acceptance: dict[str, dict]) -> dict[str, float]:
    """Tau per prompt set of an `acceptance_by_dataset` result."""
    return {name: runs["tau"] for name, runs in acceptance.items()}


def differing_conditions(earlier: dict, conditions: dict) -> list[str]:
    """Which of `REUSE_KEYS` an earlier report's conditions hold other values of (empty: its runs can be reused)."""
    return [key for key in REUSE_KEYS if earlier.get(key) != conditions[key]]


def set_tau(run: dict, indices: list[int]) -> float:
    """Tau of one prompt set's `acceptance_by_dataset` entry over the prompts `indices` (repeats count twice)."""
    return sum(run["committed"][i] for i in indices) / sum(run["rounds"][i] for i in indices)


def resampled(statistic, prompts: int, samples: int, seed: int) -> list[float]:
    """`statistic(indices)` over `samples` resamples of the prompts with replacement, sorted; resamples where it is
    None are left out."""
    rng = random.Random(seed)
    indices = list(range(prompts))
    return sorted(s for _ in range(samples) if (s := statistic(rng.choices(indices, k=prompts))) is not None)


def interval_90(values: list[float], digits: int) -> list[float] | None:
    """The 5th and 95th percentiles of sorted `values`, rounded to `digits` (None when there are none)."""
    if not values:
        return None
    return [round(values[int(0.05 * len(values))], digits), round(values[int(0.95 * len(values)) - 1], digits)]


def share_of_loss_recovered(
    base_base: dict, tuned_base: dict, tuned_new: dict, samples: int = 2000, seed: int = 0
) -> dict | None:
    """`(tau_new - tau_tuned_base) / (tau_base_base - tau_tuned_base)` of one prompt set (each argument that set's
    `acceptance_by_dataset` entry), with a 90% paired-bootstrap interval over prompts; None when the fine-tune costs
    the base drafter no tau there. Resamples in which it costs none have no share and are left out: `resamples` says
    how many of `samples` are left."""

    def share(indices: list[int]) -> float | None:
        base, tuned, new = (set_tau(run, indices) for run in (base_base, tuned_base, tuned_new))
        return (new - tuned) / (base - tuned) if base > tuned else None

    point = share(list(range(len(base_base["committed"]))))
    if point is None:
        return None
    values = resampled(share, len(base_base["committed"]), samples, seed)
    # interval None: the loss rests on too few prompts for any resample to keep it
    return {"share": round(point, 2), "interval_90": interval_90(values, 2), "resamples": len(values)}


def fine_tune_cost(base_base: dict, tuned_base: dict, samples: int = 2000, seed: int = 0) -> dict:
    """What the fine-tune costs the base drafter on one prompt set, `tau_base_base - tau_tuned_base`, with a 90%
    paired-bootstrap interval over prompts: an interval that holds zero is a loss these prompts do not resolve, and
    no share of it can be judged."""

    point, interval = tau_difference(base_base, tuned_base, samples, seed)
    return {"cost": point, "interval_90": interval}


def tau_difference(first: dict, second: dict, samples: int = 2000, seed: int = 0) -> tuple[float, list[float] | None]:
    """`tau_first - tau_second` of one prompt set (each argument that set's `acceptance_by_dataset` entry, on the same
    prompts), and its 90% paired-bootstrap interval over the prompts, both to 3 digits."""

    def difference(indices: list[int]) -> float:
        return set_tau(first, indices) - set_tau(second, indices)

    point = difference(list(range(len(first["committed"]))))
    return round(point, 3), interval_90(resampled(difference, len(first["committed"]), samples, seed), 3)


def base_drafter_runs(results: list[dict]) -> tuple[dict, dict] | None:
    """The base drafter's acceptance on the base target and on the fine-tuned one, when the run measured both."""
    by_key = {(r["target"], r["drafter"]): r["acceptance"] for r in results}
    if ("base", "base") not in by_key or ("tuned", "base") not in by_key:
        return None
    return by_key["base", "base"], by_key["tuned", "base"]


def add_shares(results: list[dict]) -> None:
    """Give every tuned pair other than the base drafter its `share_of_loss_recovered`, when the run measured the
    base drafter on both targets."""
    if (base := base_drafter_runs(results)) is None:
        return
    base_base, tuned_base = base
    for result in results:
        if result["target"] == "tuned" and result["drafter"] != "base":
            result["share_of_loss_recovered"] = {
                name: share_of_loss_recovered(base_base[name], tuned_base[name], runs)
                for name, runs in result["acceptance"].items()
            }


def fine_tune_costs(results: list[dict]) -> dict[str, dict] | None:
    """Per prompt set, `fine_tune_cost` of the base drafter, when the run measured it on both targets."""
    if (base := base_drafter_runs(results)) is None:
        return None
    base_base, tuned_base = base
    return {name: fine_tune_cost(runs, tuned_base[name]) for name, runs in base_base.items()}


def card_acceptance(results: list[dict], name: str, conditions: dict, report: str) -> dict:
    """What the drafter of the tuned pair `name` measured, as `hf-dflash card DIR --acceptance_json` reads it:
    `{"acceptance": {set: {"tau", "speedup", "conditions"}}}`, each set's conditions naming the fine-tune, the base
    drafter's tau on it and the share of its loss won back where the run has them."""
    by_key = {(r["target"], r["drafter"]): r for r in results}
    pair, base = by_key["tuned", name], by_key.get(("tuned", "base"))
    acceptance = {}
    for dataset, tau in pair["tau"].items():
        text = (
            f"first {conditions['prompts'][dataset]} prompts, whole block, greedy, {conditions['max_new_tokens']} new "
            f"tokens, on {conditions['target']} fine-tuned by {conditions['target_adapter']}"
        )
        if base is not None:
            text += f"; the base drafter alone: tau {base['tau'][dataset]}"
        share = (pair.get("share_of_loss_recovered") or {}).get(dataset)
        if share is not None and share["interval_90"] is not None:
            low, high = share["interval_90"]
            text += f", {share['share']:.0%} of its loss won back (90% interval {low:.0%}-{high:.0%})"
        acceptance[dataset] = {"tau": tau, "speedup": None, "conditions": f"{text} ({report})"}
    return {"acceptance": acceptance}


def reusable_results(paths: list[str], conditions: dict) -> dict[tuple[str, str, str], dict]:
    """Results of earlier reports, keyed by (target, drafter name, the drafter's `draft_fingerprint`), when they were
    measured under the same conditions: greedy whole-block tau is deterministic, so the reference pairs need not run
    again. The fingerprint, not the path, names the weights measured (a folder's path outlives what was committed
    there; a Hub id's revision moves). Pairs on the base target are read from a report of another fine-tune too (the
    adapter plays no part in them). A result that recorded no fingerprint (a report older than the record) is never
    reused."""
    results = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        if differing := differing_conditions(report["conditions"], conditions):
            raise SystemExit(f"--reuse {path}: measured with other {', '.join(differing)}; rerun its pairs instead.")
        same_adapter = report["conditions"].get("target_adapter") == conditions["target_adapter"]
        for result in report["results"]:
            if "acceptance" in result and (same_adapter or result["target"] == "base"):
                if result.get("draft_fingerprint") is None:
                    print(
                        f"--reuse {path}: {result['target']}:{result['drafter']} recorded no drafter fingerprint, so "
                        "it is not reused"
                    )
                    continue
                key = (result["target"], result["drafter"], result["draft_fingerprint"])
                results[key] = {name: value for name, value in result.items() if name != "share_of_loss_recovered"}
                results[key]["reused_from"] = result.get("reused_from", path)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--target_adapter", required=True, help="the fine-tune (a PEFT adapter of --target)")
    parser.add_argument("--pair", action="append", required=True, help="TARGET:NAME:DRAFTER; repeat")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), help="NAME or NAME:N (its first N prompts)")
    parser.add_argument("--limit", type=int, default=5, help="first prompts of each set without :N")
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument(
        "--reuse", nargs="+", default=[], help="earlier reports: their pairs measured the same way are read"
    )
    parser.add_argument("--output", required=True)
    parser.add_argument(
        "--card_acceptance",
        metavar="NAME=PATH",
        default=None,
        help="also write the tuned pair NAME's acceptance to PATH, for `hf-dflash card DIR --acceptance_json PATH`",
    )
    args = parser.parse_args()
    pairs = [tuple(pair.split(":", 2)) for pair in args.pair]
    if any(len(pair) != 3 or pair[0] not in ("base", "tuned") for pair in pairs):
        parser.error(f"--pair takes TARGET:NAME:DRAFTER with TARGET base or tuned, got {args.pair}")
    card_name, _, card_path = (args.card_acceptance or "").partition("=")
    if args.card_acceptance and (not card_path or ("tuned", card_name) not in [pair[:2] for pair in pairs]):
        parser.error(f"--card_acceptance takes NAME=PATH, NAME a tuned pair's name; got {args.card_acceptance!r}")

    prompts = {
        name: load_prompts(name, count) for name, count in (split_set_limit(d, args.limit) for d in args.datasets)
    }
    conditions = {
        "target": args.target,
        "target_adapter": args.target_adapter,
        "prompts": {name: len(items) for name, items in prompts.items()},
        "max_new_tokens": args.max_new_tokens,
        "verify": WHOLE_BLOCK_GREEDY,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
    }
    reused = reusable_results(args.reuse, conditions)
    targets = {}
    results = []
    for which, name, drafter in pairs:
        if which not in targets:
            adapter = {"target_adapter": args.target_adapter, "merge_target_adapter": True} if which == "tuned" else {}
            targets[which] = load_target_and_tokenizer(args.target, device="cpu", **adapter)
        target, tokenizer = targets[which]
        draft = load_draft(drafter, target)
        fingerprint = draft_fingerprint(draft)
        if (key := (which, name, fingerprint)) in reused:
            results.append(reused[key])
            continue
        start = time.perf_counter()
        acceptance = acceptance_by_dataset(target, tokenizer, draft, prompts, args.max_new_tokens)
        results.append(
            {
                "target": which,
                "drafter": name,
                "path": drafter,
                "draft_fingerprint": fingerprint,
                "tau": taus(acceptance),
                "acceptance": acceptance,
            }
        )
        print(f"{which} target, {name} drafter: {taus(acceptance)} ({time.perf_counter() - start:.0f} s)", flush=True)
    add_shares(results)
    report = {"conditions": conditions, "fine_tune_cost": fine_tune_costs(results), "results": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    if args.card_acceptance:
        card = card_acceptance(results, card_name, conditions, args.output)
        Path(card_path).write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
