"""Write a large, diverse pool of training prompts for `hf-dflash data`, and a held-out slice of it, from sources
that ship in PyPI packages or in this interpreter, none of them an evaluation set.

Sources (``--counts SOURCE=N``, ``all`` for every prompt a source has):

- ``sharegpt``: ShareGPT first turns (the `hf_dflash.data.prompts` set);
- ``sharegpt-turns``: a later user turn of a ShareGPT conversation, with the conversation before it as history
  (one turn per conversation, chosen by the seed; history and turn capped in characters);
- ``chitchat``: the BYU chit-chat corpus of human-human dialogues (``pip install --no-deps chitchat-dataset==0.9.0``),
  cut after one speaker's turn, the first speaker as the user;
- ``functions``: signature + docstring stubs to complete, from the standard library and installed packages
  (`shaped_prompts.stdlib_functions` / `package_functions`);
- ``word-problems`` / ``multi-step-problems``: templated arithmetic word problems (`shaped_prompts`).

Well-known evaluation sets are left out on purpose, not only the three benchmark sets: MATH-500, AIME, GPQA and
CHAMP are what other people measure drafters on. `hf-dflash data` still drops every prompt holding a GSM8K,
HumanEval or MT-Bench item. The pool is shuffled by the seed, so any prefix of it is a sample of every source;
``--held_out N`` prompts (spread over the sources) go to a second file and never into the pool.

    python scripts/prompt_pool.py --counts sharegpt=all sharegpt-turns=5000 chitchat=2500 functions=3000 \
        word-problems=1200 multi-step-problems=1200 --held_out 60 --seed 0 \
        --output ../data/pool.jsonl --held_out_output ../data/held_out.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_prompts import multi_step_problems, package_functions, stdlib_functions, word_problems  # noqa: E402

from hf_dflash.data.evaluation import comparable_text  # noqa: E402
from hf_dflash.data.prompts import Prompt, iter_json_array, load_prompts, prompt_set_path  # noqa: E402
from hf_dflash.data.sources import chat_messages, write_prompts_jsonl  # noqa: E402

# Installed packages whose functions become completion prompts, beside the standard library.
FUNCTION_PACKAGES = (
    "transformers", "torch", "numpy", "pandas", "sympy", "scipy", "networkx", "accelerate", "peft", "datasets",
    "huggingface_hub", "jinja2", "matplotlib", "PIL", "mpmath", "_pytest", "psutil", "requests", "dill", "click",
)  # fmt: skip
SOURCES = ("sharegpt", "sharegpt-turns", "chitchat", "functions", "word-problems", "multi-step-problems")
MAX_TURN_CHARS = 2000  # a later ShareGPT turn, as the first-turn set caps it
MAX_HISTORY_CHARS = 3000  # the conversation before it
MAX_CHITCHAT_TURNS = 8  # a dialogue is cut after one of its first turns
CHITCHAT = ("chitchat_dataset", "dataset.json", "pip install --no-deps chitchat-dataset==0.9.0")


def sharegpt_later_turns(limit: int | None, seed: int) -> list[Prompt]:
    """One later user turn per ShareGPT conversation, with the turns before it (user/assistant) as history."""
    rng = random.Random(seed)
    prompts = []
    for index, record in enumerate(iter_json_array(prompt_set_path("sharegpt"))):
        messages = _sharegpt_messages(record.get("conversations") or [])
        later_users = [i for i, m in enumerate(messages) if m["role"] == "user" and i > 0]
        usable = [i for i in later_users if _fits(messages[: i + 1])]
        if usable:
            cut = rng.choice(usable)
            prompts.append(Prompt(f"sharegpt-turns/{index}/{cut}", "sharegpt-turns", messages[: cut + 1]))
    return _sample(prompts, limit, seed)


def _sharegpt_messages(turns: list[dict]) -> list[dict]:
    """ShareGPT turns as chat messages (`chat_messages`, stripped), if they alternate user/assistant from a user turn;
    else []."""
    messages = [{"role": m["role"], "content": m["content"].strip()} for m in chat_messages(turns)]
    alternating = all(m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(messages))
    return messages if alternating and all(m["content"] for m in messages) else []


def _fits(messages: list[dict]) -> bool:
    history = sum(len(m["content"]) for m in messages[:-1])
    return len(messages[-1]["content"]) <= MAX_TURN_CHARS and history <= MAX_HISTORY_CHARS


def chitchat_dialogues(limit: int | None, seed: int) -> list[Prompt]:
    """Human-human chit-chat cut after one of a dialogue's first turns (consecutive messages of one speaker are one
    turn); the first speaker is the user."""
    module, data_file, pip = CHITCHAT
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ValueError(f"the chitchat source needs its package: {pip}")
    dialogues = json.loads((Path(spec.submodule_search_locations[0]) / data_file).read_text(encoding="utf-8"))
    rng = random.Random(seed)
    prompts = []
    for key, dialogue in dialogues.items():
        turns = [" ".join(m["text"].strip() for m in turn).strip() for turn in dialogue["messages"] if turn]
        turns = turns[: next((i for i, turn in enumerate(turns) if not turn), len(turns))]  # up to an empty turn
        user_turns = [i for i in range(min(len(turns), MAX_CHITCHAT_TURNS)) if i % 2 == 0]
        if not user_turns:
            continue
        cut = rng.choice(user_turns)
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": turns[i]} for i in range(cut + 1)]
        prompts.append(Prompt(f"chitchat/{key}/{cut}", "chitchat", messages))
    return _sample(prompts, limit, seed)


def code_functions(limit: int | None, seed: int) -> list[Prompt]:
    """Function stubs: the standard library's first (all of them when `limit` allows), then installed packages'."""
    limit = sys.maxsize if limit is None else limit
    stdlib = stdlib_functions(limit, seed)
    taken = {comparable_text(prompt) for prompt in stdlib}
    return stdlib + package_functions(FUNCTION_PACKAGES, limit - len(stdlib), seed, taken)


def _sample(prompts: list[Prompt], limit: int | None, seed: int) -> list[Prompt]:
    return prompts if limit is None else random.Random(seed).sample(prompts, min(limit, len(prompts)))


def source_prompts(source: str, limit: int | None, seed: int) -> list[Prompt]:
    """Up to ``limit`` prompts of one of ``SOURCES`` (all with None)."""
    if source == "sharegpt":
        return _sample(load_prompts("sharegpt"), limit, seed)
    if source == "sharegpt-turns":
        return sharegpt_later_turns(limit, seed)
    if source == "chitchat":
        return chitchat_dialogues(limit, seed)
    if source == "functions":
        return code_functions(limit, seed)
    count = 10**5 if limit is None else limit
    if source == "word-problems":
        return word_problems(count, seed)
    if source == "multi-step-problems":
        return multi_step_problems(count, seed)
    raise ValueError(f"unknown source {source!r}; choose from {', '.join(SOURCES)}")


def unique(prompts: list[Prompt]) -> Iterator[Prompt]:
    """Prompts whose id and user text were not seen before, in order."""
    ids, texts = set(), set()
    for prompt in prompts:
        text = comparable_text(prompt)
        if prompt.id not in ids and text not in texts:
            ids.add(prompt.id)
            texts.add(text)
            yield prompt


def split_held_out(prompts: list[Prompt], count: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(pool, held out): ``count`` prompts spread evenly over the sources, taken out of the shuffled pool."""
    by_source = defaultdict(list)
    for prompt in prompts:
        by_source[prompt.dataset].append(prompt)
    rng = random.Random(seed)
    held_ids = set()
    sources = sorted(by_source)
    for index in range(count):
        candidates = [p for p in by_source[sources[index % len(sources)]] if p.id not in held_ids]
        held_ids.add(rng.choice(candidates).id)
    return [p for p in prompts if p.id not in held_ids], [p for p in prompts if p.id in held_ids]


def parse_counts(entries: list[str]) -> dict[str, int | None]:
    counts = {}
    for entry in entries:
        source, _, count = entry.partition("=")
        if source not in SOURCES or not count:
            raise SystemExit(f"--counts takes SOURCE=N or SOURCE=all with SOURCE one of {', '.join(SOURCES)}")
        counts[source] = None if count == "all" else int(count)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", nargs="+", required=True, help="SOURCE=N or SOURCE=all")
    parser.add_argument("--held_out", type=int, default=0, help="prompts kept out of the pool, over the sources")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    parser.add_argument("--held_out_output", default=None)
    args = parser.parse_args()
    if args.held_out and not args.held_out_output:
        raise SystemExit("--held_out needs --held_out_output")

    prompts = [
        p for source, limit in parse_counts(args.counts).items() for p in source_prompts(source, limit, args.seed)
    ]
    prompts = list(unique(prompts))
    random.Random(args.seed).shuffle(prompts)
    pool, held_out = split_held_out(prompts, args.held_out, args.seed)
    write_prompts_jsonl(pool, args.output)
    if args.held_out_output:
        write_prompts_jsonl(held_out, args.held_out_output)
    sizes = defaultdict(int)
    for prompt in pool:
        sizes[prompt.dataset] += 1
    print(json.dumps({"pool": len(pool), "held_out": len(held_out), "by_source": dict(sorted(sizes.items()))}))


if __name__ == "__main__":
    main()
