"""The regenerated records file: one JSON record per line, appended a batch at a time, resumable, validated on load.

A record is::

    {"id": "sharegpt/12", "source": "sharegpt", "prompt_len": 31, "input_ids": [...], "loss_mask": [0, ..., 1]}

written compactly (``separators=(",", ":")``) on one newline-terminated line (``record_line``). ``loss_mask`` is 0
on the prompt (chat template with the assistant header) and 1 on every response token. A crash mid-write tears at
most the last line: ``completed_ids`` counts only newline-terminated lines, ``drop_torn_last_line`` cuts the torn
rest off before a resumed run appends, and ``pending_prompts`` picks what is still to answer.
``load_training_dataset`` reads and validates the file as a ``datasets.Dataset``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
import transformers
from transformers import PreTrainedTokenizerBase

from hf_dflash.data.chat import encode_prompt
from hf_dflash.data.prompts import Prompt, user_turn_problem

logger = transformers.utils.logging.get_logger(__name__)


def record_line(prompt: Prompt, prompt_ids: list[int], response: list[int]) -> str:
    """The file's line for one answer: ``{id, source, prompt_len, input_ids, loss_mask}``, compact, newline-ended."""
    record = {
        "id": prompt.id,
        "source": prompt.dataset,
        "prompt_len": len(prompt_ids),
        "input_ids": prompt_ids + response,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(response),
    }
    return json.dumps(record, separators=(",", ":")) + "\n"


def pending_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Iterable[Prompt], output_path: Path, max_prompt_tokens: int
) -> list[tuple[Prompt, list[int]]]:
    """(prompt, its chat-template ids) of each prompt still to answer: not in ``output_path`` yet (``completed_ids``),
    not a repeated id, and at most ``max_prompt_tokens`` long; what was skipped is logged.

    Raises ``ValueError`` naming the prompt for one that does not end in a user turn with text
    (``prompts.user_turn_problem``): no record is written with an empty user turn."""
    done = completed_ids(output_path)
    todo, already, too_long = [], 0, 0
    for prompt in prompts:
        problem = user_turn_problem(prompt.messages)
        if problem is not None:
            raise ValueError(f"Prompt {prompt.id}: {problem}; give it a user turn with text or leave it out.")
        if prompt.id in done:
            already += 1
            continue
        done.add(prompt.id)  # also drops repeated ids
        ids = encode_prompt(tokenizer, prompt)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        todo.append((prompt, ids))
    if already:
        logger.info(f"{output_path}: resuming; {already} prompts already done, {len(todo)} to go")
    if too_long:
        logger.warning(f"Skipped {too_long} prompts longer than max_prompt_tokens={max_prompt_tokens}")
    return todo


def completed_ids(path: str | os.PathLike) -> set[str]:
    """Ids of the complete records (newline-terminated lines) of a possibly interrupted output file.

    Only reads: a torn last line is not counted and stays in the file (``drop_torn_last_line`` removes it).
    """
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    ids = set()
    for number, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
        if line.strip():
            ids.add(str(_parse_line(path, number, line)["id"]))
    return ids


def drop_torn_last_line(path: str | os.PathLike) -> int:
    """Truncate a partly written last line (what a crash mid-write leaves) off ``path``; returns the bytes cut.

    Everything up to the last newline is kept byte for byte; a missing file or one ending in a newline is left
    as it is (0 bytes cut).
    """
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as file:
        data = file.read()
        end = data.rfind(b"\n") + 1
        if not data[end:]:
            return 0
        logger.warning(f"{path}: dropping a partially written last line ({len(data) - end} bytes)")
        file.truncate(end)
    return len(data) - end


def load_training_dataset(path: str | os.PathLike) -> datasets.Dataset:
    """Read a regenerated JSONL file as a ``datasets.Dataset`` (columns ``id``, ``source``, ``input_ids``,
    ``loss_mask``).

    Raises ``ValueError`` naming the file and line of a record that is not valid JSON, lacks a field, has
    ``input_ids`` and ``loss_mask`` of different lengths, a mask value other than 0/1, or no supervised token.
    """
    path = Path(path)
    columns: dict[str, list] = {"id": [], "source": [], "input_ids": [], "loss_mask": []}
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            record = _parse_line(path, number, line)
            _check_record(path, number, record)
            columns["id"].append(str(record["id"]))
            columns["source"].append(str(record.get("source", "")))
            columns["input_ids"].append(record["input_ids"])
            columns["loss_mask"].append(record["loss_mask"])
    if not columns["id"]:
        raise ValueError(f"{path} holds no records")
    return datasets.Dataset.from_dict(columns)


def records_summary(path: str | os.PathLike, stop_ids: list[int]) -> dict[str, Any]:
    """What a records JSONL holds: records, supervised (loss-masked) tokens, mean response length, how many
    responses ended their turn (a stop id last) rather than at the token budget, and records and supervised tokens
    per prompt source (``by_source``, largest first)."""
    records = load_training_dataset(path)
    supervised_per_record = [sum(mask) for mask in records["loss_mask"]]
    by_source: dict[str, dict[str, int]] = {}
    for source, supervised in zip(records["source"], supervised_per_record):
        counts = by_source.setdefault(source, {"records": 0, "supervised_tokens": 0})
        counts["records"] += 1
        counts["supervised_tokens"] += supervised
    total = sum(supervised_per_record)
    return {
        "path": str(path),
        "records": len(records),
        "supervised_tokens": total,
        "mean_response_tokens": round(total / len(records), 1),
        "ended_with_eos": sum(ids[-1] in stop_ids for ids in records["input_ids"]),
        "by_source": dict(sorted(by_source.items(), key=lambda item: -item[1]["supervised_tokens"])),
    }


def _check_record(path: Path, number: int, record: dict) -> None:
    """Raise ``ValueError`` (naming ``path:number``) for a record ``load_training_dataset`` cannot train on."""
    for key in ("id", "input_ids", "loss_mask"):
        if key not in record:
            raise ValueError(f"{path}:{number}: record has no {key!r}")
    input_ids, loss_mask = record["input_ids"], record["loss_mask"]
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"{path}:{number}: input_ids has {len(input_ids)} tokens but loss_mask has {len(loss_mask)}")
    if not set(loss_mask) <= {0, 1}:
        raise ValueError(f"{path}:{number}: loss_mask holds values other than 0 and 1")
    if not any(loss_mask):
        raise ValueError(f"{path}:{number}: record {record['id']!r} has no supervised token (loss_mask all 0)")


def _parse_line(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}:{number}: not valid JSON ({error}). A torn last line is what an interrupted run leaves: rerun "
            "the same `hf-dflash data` command (or regenerate_responses call) to drop it and finish the file."
        ) from error
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: a record must be a JSON object")
    return record
