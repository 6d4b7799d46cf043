"""Write training prompts shaped like the benchmarks' tasks, without any benchmark item, for `hf-dflash data`.

A drafter learns the target's answers to the prompts it sees. ShareGPT's code and math prompts are broad (web
scraping, SQL, essays about statistics); the benchmarks ask for two narrow things: complete a self-contained
Python function from its signature and docstring (HumanEval) and solve a grade-school word problem step by step
(GSM8K). This writes prompts of those two shapes from sources that hold no benchmark item:

- ``functions``: public top-level functions of this interpreter's standard library that have a docstring,
  cut to signature + docstring and put after the same instruction the HumanEval prompts use;
- ``word-problems``: arithmetic word problems built from templates with random names, items and numbers;
- ``multi-step-problems``: the same, from longer templates that take three to five steps, as GSM8K's do.

`hf-dflash data` still drops any prompt that contains a benchmark item.

    python scripts/shaped_prompts.py --functions 400 --word-problems 400 --output runs/shaped.jsonl
    python scripts/shaped_prompts.py --seed 1 --functions 400 --word-problems 0 --multi-step-problems 600 \
        --exclude runs/shaped.jsonl --output runs/shaped2.jsonl

Ids carry the seed, so files written with different seeds can feed one `hf-dflash data` output (which skips ids
it already holds); ``--exclude`` leaves out prompts an earlier file already has (the function pool is finite).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import itertools
import random
import sysconfig
from collections.abc import Collection
from pathlib import Path

from hf_dflash.data.evaluation import comparable_text, normalize_text
from hf_dflash.data.prompts import HUMANEVAL_INSTRUCTION, Prompt
from hf_dflash.data.sources import prompts_from_jsonl, write_prompts_jsonl

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
MULTI_STEP_TEMPLATES = [
    "{a} bakes {n1} {item} for a school fair. {a} sells {frac} of them in the morning and {n3} more in the "
    "afternoon. Each one sells for ${p1}. How much money does {a} make, and how many are left?",
    "{a} has ${big}. {a} buys {n2} notebooks for ${p1} each and a backpack that costs {k} times as much as one "
    "notebook. How much money does {a} have left?",
    "A school has {n4} students. {pct}% of them take the bus, {frac} of the rest walk, and the others are driven "
    "by their parents. How many students are driven?",
    "{a}, {b} and {c} collect {item}. {a} has {n1}, {b} has {n3} fewer than {a}, and {c} has {k} times as many as "
    "{b}. How many {item} do the three have in all?",
    "{a} works {n2} hours on weekdays and {n3} hours on Saturday. {a} is paid ${p1} an hour on weekdays and "
    "${p2} an hour on Saturday. How much does {a} earn in {k} weeks?",
    "A car uses one gallon of gas every {n2} miles. {a} drives {n4} miles to visit {b} and back again. Gas costs "
    "${p1} a gallon. How much does the trip cost?",
    "{a} is saving for a ${big} game console. {a} gets ${n2} a week in allowance and earns ${p1} for each lawn "
    "mowed. If {a} mows {n3} lawns a week, how many weeks will it take to save enough?",
    "A rectangular garden is {n1} feet long and {n2} feet wide. {a} puts a fence around it. Fencing costs ${p1} "
    "a foot. How much does the fence cost, and what is the area of the garden?",
    "{a} read {n1} pages on Monday. On Tuesday {a} read {k} times as many pages as on Monday, and on Wednesday "
    "{n3} fewer pages than on Tuesday. The book has {n5} pages. How many pages are left to read?",
    "A store buys {item} at ${p1} for each box of {n2}. It sells each one for ${p2}. How much profit does the "
    "store make if it buys and sells {n3} boxes?",
    "{a} is {n2} years old. {b} is {n3} years older than {a}, and {c} is twice as old as {b}. What is the sum of "
    "their ages in {k} years?",
    "A pool holds {n5} gallons. One hose fills {n2} gallons a minute and a second hose {k} gallons a minute. "
    "After {n3} minutes the second hose breaks. How many minutes does it take to fill the pool in all?",
    "{a} orders {n2} pizzas for a party. Each pizza is cut into {k} slices. There are {n1} guests and each guest "
    "eats {n3} slices. How many more pizzas are needed, or how many slices are left over?",
    "A movie ticket costs ${p1} for adults and ${p2} for children. {a} takes {n3} adults and {n2} children to "
    "the movies and buys popcorn for ${n3} each person. How much does {a} spend in all?",
    "{a} runs {n2} laps around a {n4}-meter track every day from Monday to Friday and twice as many laps on "
    "Saturday. How many kilometers does {a} run in a week?",
    "A farmer has {n1} chickens and {n2} cows. Each chicken lays {n3} eggs a week, and the farmer sells eggs at "
    "${p1} a dozen. How many legs are on the farm, and how much money do the eggs bring in each week?",
    "{a} bought a phone for ${big} and paid {pct}% up front. {a} pays the rest in {n2} equal monthly payments. "
    "How much is each payment?",
    "There were {n5} people at a concert. {frac} of them were children, and {pct}% of the adults bought a "
    "T-shirt for ${p1}. How much money did the T-shirt stand take in?",
    "{a} can type {n4} words in {n2} minutes. {b} types {n3} words a minute faster than {a}. How long will it "
    "take {b} to type a {n5}-word essay?",
    "A train leaves at {hour}:00 and travels at {n1} miles an hour for {n2} hours, then stops for {n3} hours "
    "and travels {n4} more miles at the same speed. At what time does it arrive, and how far did it go?",
    "{a} has {n1} {item}. {a} gives {frac} of them to {b}, then buys {n2} packs of {n3}. Then {a} shares all of "
    "them equally with {k} friends, keeping a share too. How many does each person get?",
    "A class of {n1} students goes on a trip. Each bus holds {n2} students and costs ${big} to rent. Tickets "
    "for the museum cost ${p1} for each student. What is the total cost, and how much is it for each student?",
    "{a} makes lemonade. Each pitcher needs {n3} lemons and makes {n2} cups. {a} sells cups for ${p1} and "
    "lemons cost ${k} for a bag of {n2}. How much profit does {a} make selling {n1} cups?",
    "{a}'s monthly rent is ${n5}. Utilities are {pct}% of the rent and food is ${n4} a week. {a} earns ${p2} "
    "an hour and works {n1} hours a week. How much can {a} save in a month of four weeks?",
]
FRACTIONS = ["half", "a third", "a quarter", "two thirds", "three quarters"]


def stdlib_functions(limit: int, seed: int, taken: Collection[str] = frozenset()) -> list[Prompt]:
    """Public top-level standard-library functions with a docstring, as signature + docstring to complete;
    a stub whose prompt's `comparable_text` is in ``taken`` is not used."""
    return _chosen_stubs(_stdlib_stubs(), limit, seed, taken)


def package_functions(
    packages: Collection[str], limit: int, seed: int, taken: Collection[str] = frozenset()
) -> list[Prompt]:
    """Like `stdlib_functions`, from installed packages' source (located with `importlib.util.find_spec`, never
    imported): their public top-level functions with a docstring, as signature + docstring to complete."""
    return _chosen_stubs(_package_stubs(tuple(sorted(packages))), limit, seed, taken)


def _chosen_stubs(stubs: dict[str, str], limit: int, seed: int, taken: Collection[str]) -> list[Prompt]:
    """Up to ``limit`` of ``stubs`` (stub -> where it comes from) not in ``taken``, drawn by ``seed``, as prompts."""
    stubs = {stub: path for stub, path in stubs.items() if normalize_text(_function_prompt(stub)) not in taken}
    chosen = random.Random(seed).sample(sorted(stubs), min(limit, len(stubs)))
    return [
        Prompt(
            id=f"functions/{seed}/{index}/{stubs[stub]}",
            dataset="functions",
            messages=[{"role": "user", "content": _function_prompt(stub)}],
        )
        for index, stub in enumerate(chosen)
    ]


@functools.cache
def _package_stubs(packages: tuple[str, ...]) -> dict[str, str]:
    """Every usable stub of the named installed packages -> ``"<package>/<module path>"``."""
    stubs = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{package!r} is not an installed package; install it or leave it out")
        _add_folder_stubs(stubs, Path(spec.submodule_search_locations[0]), package)
    return stubs


def _function_prompt(stub: str) -> str:
    return f"{HUMANEVAL_INSTRUCTION}```python\n{stub}\n```"


@functools.cache
def _stdlib_stubs() -> dict[str, str]:
    """Every usable stub of this interpreter's standard library -> ``"stdlib/<module path>"`` (parsed once)."""
    stubs = {}
    _add_folder_stubs(stubs, Path(sysconfig.get_paths()["stdlib"]), "stdlib")
    return stubs


def _add_folder_stubs(stubs: dict[str, str], root: Path, name: str) -> None:
    """Add the stubs of every module under `root` (test, demo and GUI folders skipped) as ``"<name>/<module path>"``;
    a stub seen before keeps its first place."""
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_STDLIB_DIRS & set(relative.parts):
            continue
        for stub in _function_stubs(path):
            stubs.setdefault(stub, f"{name}/{relative.with_suffix('')}")


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
    return _fill_templates(WORD_PROBLEM_TEMPLATES, count, seed, "word-problems", multi_step=False)


def multi_step_problems(count: int, seed: int) -> list[Prompt]:
    """Word problems of three to five steps from ``MULTI_STEP_TEMPLATES``, with random names and numbers."""
    return _fill_templates(MULTI_STEP_TEMPLATES, count, seed, "multi-step-problems", multi_step=True)


def _fill_templates(templates: list[str], count: int, seed: int, kind: str, multi_step: bool) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for index, template in enumerate(itertools.islice(itertools.cycle(templates), count)):
        names = rng.sample(NAMES, 3 if multi_step else 2)
        values = {
            "a": names[0], "b": names[1], "item": rng.choice(ITEMS), "k": rng.randint(2, 5),
            "pct": rng.choice([10, 20, 25, 50]), "n1": rng.randint(5, 60), "n2": rng.randint(2, 12),
            "n3": rng.randint(1, 9), "p1": rng.randint(2, 25), "big": rng.choice([50, 100, 120, 200, 300]),
        }  # fmt: skip
        if multi_step:
            values |= {
                "c": names[2], "frac": rng.choice(FRACTIONS), "p2": rng.randint(3, 40), "n4": rng.randint(10, 400),
                "n5": rng.randint(100, 2000), "hour": rng.randint(1, 11),
            }  # fmt: skip
        content = template.format(**values)
        prompts.append(
            Prompt(id=f"{kind}/{seed}/{index}", dataset=kind, messages=[{"role": "user", "content": content}])
        )
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", type=int, default=400, help="standard-library function prompts")
    parser.add_argument("--word-problems", type=int, default=400, help="templated word problems")
    parser.add_argument("--multi-step-problems", type=int, default=0, help="templated multi-step word problems")
    parser.add_argument(
        "--exclude", action="append", default=[], help="a prompts .jsonl whose prompts to skip; repeat"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    taken = {comparable_text(prompt) for path in args.exclude for prompt in prompts_from_jsonl(path)}
    functions = stdlib_functions(args.functions, args.seed, taken)
    problems = word_problems(args.word_problems, args.seed) + multi_step_problems(args.multi_step_problems, args.seed)
    problems = [problem for problem in problems if comparable_text(problem) not in taken]
    # Interleaved, so that a partial data run still covers both shapes.
    prompts = [p for pair in itertools.zip_longest(functions, problems) for p in pair if p is not None]
    write_prompts_jsonl(prompts, args.output)
    print(f"{len(prompts)} prompts (functions: {len(functions)}, word problems: {len(problems)}) -> {args.output}")


if __name__ == "__main__":
    main()
