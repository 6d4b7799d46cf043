"""How much of a target's responses a reduced draft vocabulary can propose, on records it was not chosen from.

`hf-dflash train --draft_vocab_size K` keeps the K tokens seen most often in the training responses
(`hf_dflash.training.script.frequent_response_tokens`); a token outside them ends every accepted run it falls in, and
no training of the drafter's layers lifts that ceiling. This chooses the K tokens from the first `--train` records of
a regenerated file and measures, per source, the share of the response tokens of the last `--test` records they hold,
for each K; `--drafter` adds the vocabulary of committed drafters, as they were trained.

    python benchmarks/scripts/draft_vocab_coverage.py --records ../data/records.jsonl --train 1906 5718 \
        --test 2000 --sizes 8192 12288 16384 --drafter drafters/smollm2-135m-instruct \
        --output benchmarks/results/data/draft_vocab_coverage.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from safetensors import safe_open

from hf_dflash.atomic_files import atomic_path
from hf_dflash.training.script import response_token_counts


def read_records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.endswith("\n")]


def columns(records: list[dict]) -> dict[str, list]:
    """The two columns `response_token_counts` reads, of `records`."""
    return {"input_ids": [r["input_ids"] for r in records], "loss_mask": [r["loss_mask"] for r in records]}


def coverage(vocabulary: set[int], counts_by_source: dict[str, Counter]) -> dict[str, float]:
    """Share of the response tokens inside `vocabulary`, per source and over all (`"all"`)."""
    shares = {}
    for source, counts in [*sorted(counts_by_source.items()), ("all", sum(counts_by_source.values(), Counter()))]:
        inside = sum(count for token, count in counts.items() if token in vocabulary)
        shares[source] = round(inside / sum(counts.values()), 4)
    return shares


def drafter_vocabulary(folder: Path) -> set[int]:
    """The target ids a saved drafter drafts over (its `d2t` offsets: target id = draft id + d2t[draft id])."""
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        if "d2t" not in weights.keys():
            raise SystemExit(f"{folder} drafts over the full vocabulary: nothing to measure.")
        d2t = weights.get_tensor("d2t")
    return {index + int(offset) for index, offset in enumerate(d2t.tolist())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", required=True, type=Path)
    parser.add_argument("--train", type=int, nargs="+", required=True, help="vocabularies from the first N records")
    parser.add_argument("--test", type=int, required=True, help="measured on the last N records")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 12288, 16384])
    parser.add_argument("--drafter", type=Path, nargs="*", default=[])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    records = read_records(args.records)
    if max(args.train) + args.test > len(records):
        raise SystemExit(f"{args.records} holds {len(records)} records, fewer than {max(args.train)} + {args.test}.")
    test = records[-args.test :]
    counts_by_source = defaultdict(Counter)
    for record in test:
        counts_by_source[record["source"]] += response_token_counts(columns([record]))
    results = [
        {"train_records": n, "draft_vocab_size": size, "coverage": coverage(vocabulary, counts_by_source)}
        for n in args.train
        for counts in [response_token_counts(columns(records[:n]))]
        for size in args.sizes
        for vocabulary in [{token for token, _ in counts.most_common(size)}]
    ]
    results += [
        {"drafter": str(d), "coverage": coverage(drafter_vocabulary(d), counts_by_source)} for d in args.drafter
    ]
    report = {
        "records": str(args.records),
        "test_records": args.test,
        "test_tokens": {source: sum(counts.values()) for source, counts in sorted(counts_by_source.items())},
        "command": " ".join(sys.argv),
        "results": results,
    }
    text = json.dumps(report, indent=1) + "\n"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.output) as tmp:
            Path(tmp).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
