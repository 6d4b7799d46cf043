"""How often a regenerated record's response tokens are the target's own greedy choice, read back by the target.

Records regenerated through an engine (`scripts/regenerate_pool.sh`: llama-server on an F32 GGUF of the target's
weights) are the engine's greedy outputs, which part from the in-process target's where two tokens nearly tie. This
runs the HF target over each sampled record (teacher forcing, one record a forward: no padding) and counts, at every
response position, whether the record's token is the target's argmax given the record's own prefix. Where it is not,
it keeps the gap between the two logits and the target's probability of its own choice: a near-tie there is a label the
target itself would give at another batch size or kernel; a large gap would be a wrong label.

`--ranges` measures slices of the file apart (records written before and after a change to the regeneration), each
`START:END[:STEP]` as a Python slice of its records (every `--every`-th when STEP is left out).

    python benchmarks/scripts/label_agreement.py --records ../data/records.jsonl --ranges 0:11199:50 11199::4 \
        --output benchmarks/results/data/label_agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash.atomic_files import atomic_path  # noqa: E402
from hf_dflash.loading import load_target_and_tokenizer  # noqa: E402


@torch.no_grad()
def record_disagreements(target, input_ids: list[int], loss_mask: list[int]) -> tuple[int, list[dict]]:
    """`(response tokens, disagreements)` of one record: each response position whose token is not the target's
    argmax given the tokens before it, with the logit gap and the target's probability of its own choice."""
    ids = torch.tensor([input_ids])
    logits = target(input_ids=ids).logits[0, :-1].float()  # [T-1, V]: position i predicts token i+1
    labels = ids[0, 1:]  # [T-1]
    response = torch.tensor(loss_mask[1:], dtype=torch.bool)  # [T-1]
    predicted = logits.argmax(-1)  # [T-1]
    disagreements = []
    for position in torch.nonzero(response & (predicted != labels)).flatten().tolist():
        row = logits[position]
        disagreements.append(
            {
                "token": position + 1,
                "logit_gap": round(float(row[predicted[position]] - row[labels[position]]), 4),
                "target_choice_probability": round(float(row.softmax(-1)[predicted[position]]), 4),
            }
        )
    return int(response.sum()), disagreements


def record_slice(spec: str, every: int) -> slice:
    """`START:END[:STEP]` as a slice (START 0, END the file's end, STEP `every` when left out)."""
    start, end, step = (spec.split(":") + [""])[:3]
    return slice(int(start or 0), int(end) if end else None, int(step or every))


def summary(per_record: list[tuple[int, list[dict]]]) -> dict:
    """Agreement over all response tokens, the records holding any disagreement, and the gaps where they part."""
    tokens = sum(count for count, _ in per_record)
    parted = [d for _, found in per_record for d in found]
    gaps = sorted(d["logit_gap"] for d in parted)
    return {
        "records": len(per_record),
        "response_tokens": tokens,
        "tokens_agreeing": tokens - len(parted),
        "share_agreeing": round((tokens - len(parted)) / max(tokens, 1), 6),
        "records_with_a_disagreement": sum(1 for _, found in per_record if found),
        "logit_gap_median": round(statistics.median(gaps), 4) if gaps else None,
        "logit_gap_max": gaps[-1] if gaps else None,
        "disagreements": parted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", required=True, type=Path)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--every", type=int, default=50, help="read every N-th record (spread over the file)")
    parser.add_argument("--ranges", nargs="+", default=["0:"], help="START:END[:STEP] slices, each measured apart")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()

    with open(args.records, encoding="utf-8") as file:
        lines = [line for line in file if line.endswith("\n")]
    target, _ = load_target_and_tokenizer(args.target, device="cpu")
    measured = {}
    for spec in args.ranges:
        records = [json.loads(line) for line in lines[record_slice(spec, args.every)]]
        measured[spec] = summary([record_disagreements(target, r["input_ids"], r["loss_mask"]) for r in records])
    report = {
        "question": "Are the engine-regenerated records the target's own greedy outputs, token by token?",
        "conditions": f"{args.target} in fp32 on {platform.machine()} ({os.cpu_count()} CPU cores), torch "
        f"{torch.__version__}; the record slices of {args.records.name} that `ranges` names",
        "command": " ".join(["python", *sys.argv]),
        "ranges": measured,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.output) as tmp:
        Path(tmp).write_text(json.dumps(report, indent=1) + "\n")
    for spec, result in measured.items():
        print(spec, {key: value for key, value in result.items() if key != "disagreements"})


if __name__ == "__main__":
    main()
