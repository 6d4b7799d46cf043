"""Swap some training records of an `hf-dflash data` file for another file's, keeping its held-out records last.

The data-diversity ablation (issue 17) compares two drafters trained on the same number of records, one of them
with part of its prompts from another source (prompts the target wrote itself, `--source synthetic`), judged on
the same held-out prompts. `hf-dflash train --acceptance_holdout N` holds out a file's last N records, so this keeps
them last and untouched, and replaces as many of the other records as `--add` holds (chosen at random, `--seed`),
keeping the order of those that stay:

    python scripts/swap_records.py --data benchmarks/results/ablation/data.jsonl --add runs/synthetic.jsonl --count 211 \
        --holdout 8 --output runs/ablate/data-synthetic-third.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from hf_dflash.atomic_files import write_text_atomic


def swap_records(records: list[str], added: list[str], holdout: int, seed: int) -> list[str]:
    """`records` (JSONL lines) with `len(added)` of the first `len(records) - holdout` replaced by `added` (appended
    after those kept), the last `holdout` lines last and unchanged."""
    training, held_out = records[: len(records) - holdout], records[len(records) - holdout :]
    if len(added) > len(training):
        raise ValueError(
            f"Cannot swap {len(added)} records into {len(training)} training records; pass a smaller --count."
        )
    ids = {json.loads(line)["id"] for line in records}
    if clashes := sorted(ids & {json.loads(line)["id"] for line in added}):
        raise ValueError(f"--add holds records already in --data (ids {clashes[:3]}...): it must be another source.")
    dropped = set(random.Random(seed).sample(range(len(training)), len(added)))
    kept = [line for index, line in enumerate(training) if index not in dropped]
    return kept + added + held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="the hf-dflash data file to change")
    parser.add_argument("--add", required=True, help="an hf-dflash data file of another source")
    parser.add_argument("--count", type=int, required=True, help="how many of --add's first records to swap in")
    parser.add_argument("--holdout", type=int, required=True, help="the --acceptance_holdout the trainings will use")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    records = Path(args.data).read_text().splitlines()
    added = Path(args.add).read_text().splitlines()
    if len(added) < args.count:
        raise SystemExit(f"{args.add} holds {len(added)} records, fewer than --count {args.count}.")
    swapped = swap_records(records, added[: args.count], args.holdout, args.seed)
    write_text_atomic(args.output, "\n".join(swapped) + "\n")
    print(f"{args.output}: {len(swapped)} records, {args.count} of them from {args.add}")


if __name__ == "__main__":
    main()
