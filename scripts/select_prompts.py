"""Pick ShareGPT first turns on given topics (code, math) as a prompt JSONL for `hf-dflash data --source FILE`.

A drafter learns the target's style on the topics it sees; the benchmarks ask for Python functions (HumanEval)
and arithmetic word problems (GSM8K), so this selects ShareGPT prompts on those topics, interleaved so that a
partial run still covers both. Ids stay `sharegpt/<record index>`, so records another run already answered in the
same data file are skipped on resume, and `hf-dflash data` still drops prompts that contain a benchmark item.

    python scripts/select_prompts.py --topic python --topic math --per-topic 400 --output runs/topics.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import re

from hf_dflash.data.prompts import load_prompts
from hf_dflash.data.sources import write_prompts_jsonl

TOPICS = {
    "python": r"\bpython\b|\bdef \w+\(|\bpandas\b|\bnumpy\b|\bdjango\b|\bflask\b|```py",
    "code": r"\b(function|code|script|javascript|typescript|sql|java|algorithm|regex|class)\b",
    "math": r"\b(how many|how much|calculate|solve|percent|average|equation|probability|total cost|per hour)\b",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topic", action="append", choices=sorted(TOPICS), required=True)
    parser.add_argument("--per-topic", type=int, default=400, help="prompts per topic at most")
    parser.add_argument("--max-chars", type=int, default=1500, help="longer first turns are left out")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    prompts = [p for p in load_prompts("sharegpt") if len(p.messages[0]["content"]) <= args.max_chars]
    chosen, seen = [], set()
    for topic in args.topic:
        pattern = re.compile(TOPICS[topic], re.IGNORECASE)
        matches = [p for p in prompts if p.id not in seen and pattern.search(p.messages[0]["content"])]
        chosen.append(matches[: args.per_topic])
        seen.update(p.id for p in chosen[-1])
    interleaved = [p for group in itertools.zip_longest(*chosen) for p in group if p is not None]
    write_prompts_jsonl(interleaved, args.output)
    print(
        f"{len(interleaved)} prompts ({', '.join(f'{t}: {len(c)}' for t, c in zip(args.topic, chosen))}) -> {args.output}"
    )


if __name__ == "__main__":
    main()
