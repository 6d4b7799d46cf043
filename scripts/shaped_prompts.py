"""Write training prompts shaped like the benchmarks' tasks, without any benchmark item, for `hf-dflash data`.

A drafter learns the target's answers to the prompts it sees. ShareGPT's code and math prompts are broad (web
scraping, SQL, essays about statistics); the benchmarks ask for two narrow things: complete a self-contained
Python function from its signature and docstring (HumanEval) and solve a grade-school word problem step by step
(GSM8K). This writes prompts of those two shapes from sources that hold no benchmark item:

- ``functions``: public top-level functions of this interpreter's standard library that have a docstring,
  cut to signature + docstring and put after the same instruction the HumanEval prompts use;
- ``word-problems``: arithmetic word problems built from templates with random names, items and numbers.

`hf-dflash data` still drops any prompt that contains a benchmark item.

    python scripts/shaped_prompts.py --functions 400 --word-problems 400 --output runs/shaped.jsonl
"""

from __future__ import annotations

import argparse
import ast
import functools
import itertools
import random
import sysconfig
from pathlib import Path

from hf_dflash.data import write_prompts_jsonl
from hf_dflash.prompts import HUMANEVAL_INSTRUCTION, Prompt

# Standard-library folders that hold tests, demos or GUI code rather than self-contained functions.
SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip"}
MAX_FUNCTION_LINES = 40
DOCSTRING_CHARS = (40, 800)

NAMES = ["Maria", "James", "Aisha", "Tom", "Lena", "Carlos", "Priya", "Ben", "Sofia", "Omar", "Grace", "Ken"]
ITEMS = ["apples", "pencils", "stickers", "cupcakes", "marbles", "books", "cookies", "toy cars", "shells", "eggs"]
WORD_PROBLEM_TEMPLATES = [
    "{a} has {n1} {item}. {b} gives {a} {n2} more, and then {a} gives away {n3}. How many {item} does {a} have now?",
    "{a} buys {n1} packs of {item}. Each pack has {n2} {item} and costs ${p1}. How many {item} does {a} get, "
    "and how much does {a} spend?",
    "A shop sells {item} for ${p1} each. {a} buys {n1} of them and pays with a ${big} bill. How much change "
    "does {a} get?",
    "{a} reads {n1} pages a day for {n2} days and then {n3} pages on the last day. How many pages did {a} read?",
    "{a} earns ${p1} an hour and works {n1} hours a week. How much does {a} earn in {n2} weeks?",
    "{a} has {n1} {item} and {b} has {k} times as many. How many {item} do they have together?",
    "A farmer has {n1} cows. Each cow gives {n2} liters of milk a day. The farmer sells the milk for ${p1} a "
    "liter. How much money does the farmer make in a week?",
    "{a} wants to save ${big} for a bike. {a} already has ${n1} and saves ${n2} each week. How many weeks "
    "until {a} can buy the bike?",
    "A class of {n1} students shares {n3} {item} equally, and the teacher keeps what is left. How many {item} "
    "does each student get, and how many does the teacher keep?",
    "{a} ran {n2} miles on Monday, twice as far on Tuesday, and {n3} miles less than Tuesday on Wednesday. How "
    "many miles did {a} run in the three days?",
    "A recipe needs {n2} cups of flour for {k} dozen {item}. How many cups of flour are needed for {n1} dozen?",
    "{a} bought a jacket for ${big}. It was on sale for {pct}% off. How much did {a} save, and what was the "
    "final price?",
    "There are {n1} {item} in a box. {a} eats {pct}% of them and {b} eats {n3}. How many are left?",
    "{a} is {n2} years old. {b} is {k} times as old as {a}. How old will {b} be in {n3} years?",
    "A bus carries {n1} people. At the first stop {n3} get off and {n2} get on. At the second stop half of "
    "the people get off. How many people are still on the bus?",
    "{a} plants {n1} rows of tomatoes with {n2} plants in each row. Each plant gives {k} tomatoes. {a} sells "
    "them at ${p1} for each tomato. How much money does {a} make?",
]


def stdlib_functions(limit: int, seed: int) -> list[Prompt]:
    """Public top-level standard-library functions with a docstring, as signature + docstring to complete."""
    stubs = _stdlib_stubs()
    chosen = random.Random(seed).sample(sorted(stubs), min(limit, len(stubs)))
    return [
        Prompt(
            id=f"functions/{stubs[stub]}/{index}",
            dataset="functions",
            messages=[{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}```python\n{stub}\n```"}],
        )
        for index, stub in enumerate(chosen)
    ]


@functools.cache
def _stdlib_stubs() -> dict[str, str]:
    """Every usable stub of this interpreter's standard library -> ``"stdlib/<module path>"`` (parsed once)."""
    stubs = {}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if SKIPPED_STDLIB_DIRS & set(relative.parts):
            continue
        for stub in _function_stubs(path):
            stubs.setdefault(stub, f"stdlib/{relative.with_suffix('')}")
    return stubs


def _function_stubs(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    stubs = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.args.args:
            continue
        docstring = ast.get_docstring(node)
        too_long = node.end_lineno - node.lineno > MAX_FUNCTION_LINES
        if docstring is None or too_long or not DOCSTRING_CHARS[0] <= len(docstring) <= DOCSTRING_CHARS[1]:
            continue
        node.decorator_list = []
        node.body = node.body[:1]  # the docstring only
        stubs.append(ast.unparse(node))
    return stubs


def word_problems(count: int, seed: int) -> list[Prompt]:
    """Grade-school arithmetic word problems from ``WORD_PROBLEM_TEMPLATES`` with random names and numbers."""
    rng = random.Random(seed)
    templates = itertools.islice(itertools.cycle(WORD_PROBLEM_TEMPLATES), count)
    prompts = []
    for index, template in enumerate(templates):
        a, b = rng.sample(NAMES, 2)
        values = {
            "a": a, "b": b, "item": rng.choice(ITEMS), "k": rng.randint(2, 5), "pct": rng.choice([10, 20, 25, 50]),
            "n1": rng.randint(5, 60), "n2": rng.randint(2, 12), "n3": rng.randint(1, 9),
            "p1": rng.randint(2, 25), "big": rng.choice([50, 100, 120, 200, 300]),
        }  # fmt: skip
        content = template.format(**values)
        prompts.append(
            Prompt(
                id=f"word-problems/{index}", dataset="word-problems", messages=[{"role": "user", "content": content}]
            )
        )
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", type=int, default=400, help="standard-library function prompts")
    parser.add_argument("--word-problems", type=int, default=400, help="templated word problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    functions = stdlib_functions(args.functions, args.seed)
    problems = word_problems(args.word_problems, args.seed)
    # Interleaved, so that a partial data run still covers both shapes.
    prompts = [p for pair in itertools.zip_longest(functions, problems) for p in pair if p is not None]
    write_prompts_jsonl(prompts, args.output)
    print(f"{len(prompts)} prompts (functions: {len(functions)}, word problems: {len(problems)}) -> {args.output}")


if __name__ == "__main__":
    main()
