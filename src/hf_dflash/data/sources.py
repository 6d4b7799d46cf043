"""Training prompts from their sources: packaged sets, JSONL files, ``datasets.Dataset`` columns, or the target.

``training_prompts`` turns source specs into one list of prompts: a packaged set (``"sharegpt"``, ``"math500"``),
a path ending in ``.jsonl`` (``prompts_from_jsonl``), or ``"synthetic"``: prompts written by the target itself
(``synthesize_prompts``: it is fed only its chat template's user header and writes the user turn; cached beside
the output so a resumed run does not sample them again). The benchmark sets are refused as sources and every
prompt that equals or contains one of their items is dropped (``hf_dflash.data.evaluation``), as are repeated ids
and texts. Chat lists are cut after their last user message, which the target then answers
(``hf_dflash.data.regenerate``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable
from pathlib import Path

import datasets
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_dflash.atomic_files import atomic_path
from hf_dflash.data.chat import end_of_turn_ids, user_header
from hf_dflash.data.evaluation import (
    EVALUATION_SETS,
    EvaluationFilter,
    comparable_text,
    evaluation_prompts,
    normalize_text,
)
from hf_dflash.data.prompts import KNOWN_PROMPT_SETS, Prompt, load_prompts
from hf_dflash.data.regenerate import generate_responses
from hf_dflash.data.tokens import pad_token_id_for

logger = transformers.utils.logging.get_logger(__name__)

# Prompts written by the target itself (``synthesize_prompts``).
SYNTHETIC_SOURCE = "synthetic"


def prompts_from_jsonl(path: str | os.PathLike, source: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL file whose lines hold ``"messages"`` (a chat list) or ``"prompt"`` (a string).

    A line's ``"id"`` and ``"source"`` are kept when present; otherwise the id is ``"<source>/<line index>"``
    and ``source`` defaults to the file's stem. Chat lists are cut after their last user message (the
    target answers it); lines without a user message are skipped.
    """
    path = Path(path)
    source = source or path.stem
    prompts, skipped = [], 0
    with open(path, encoding="utf-8") as file:
        for index, line in enumerate(file):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{index + 1}: not valid JSON ({error})") from error
            if "messages" not in record and "prompt" not in record:
                raise ValueError(f"{path}:{index + 1}: a prompt line needs a 'messages' list or a 'prompt' string")
            value = record["messages"] if "messages" in record else record["prompt"]
            prompt = _to_prompt(value, str(record.get("id", f"{source}/{index}")), record.get("source", source))
            if prompt is None:
                skipped += 1
            else:
                prompts.append(prompt)
    if skipped:
        logger.warning(f"{path}: skipped {skipped} lines without a user message")
    return prompts


def prompts_from_dataset(
    dataset: datasets.Dataset, column: str = "messages", source: str = "dataset", id_column: str | None = None
) -> list[Prompt]:
    """Prompts from a ``datasets.Dataset`` column of chat lists (``"messages"``) or strings (``"prompt"``).

    Ids are ``"<source>/<row index>"``, or ``"<source>/<id_column value>"``. Chat lists are cut after their
    last user message; rows without one are skipped.
    """
    if column not in dataset.column_names:
        raise ValueError(f"The dataset has no column {column!r}; columns: {', '.join(dataset.column_names)}.")
    ids = dataset[id_column] if id_column else range(len(dataset))
    prompts = [_to_prompt(value, f"{source}/{item_id}", source) for item_id, value in zip(ids, dataset[column])]
    kept = [prompt for prompt in prompts if prompt is not None]
    if len(kept) < len(prompts):
        logger.warning(f"Skipped {len(prompts) - len(kept)} rows of column {column!r} without a user message")
    return kept


def write_prompts_jsonl(prompts: Iterable[Prompt], path: str | os.PathLike) -> Path:
    """Write prompts as JSONL (``id``, ``source``, ``messages``) that ``prompts_from_jsonl`` reads back; atomic."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as file:
        for prompt in prompts:
            file.write(json.dumps({"id": prompt.id, "source": prompt.dataset, "messages": prompt.messages}) + "\n")
    return path


def synthesize_prompts(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    n: int,
    *,
    seed: int = 0,
    batch_size: int = 8,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 0.95,
    progress: bool = False,
) -> list[Prompt]:
    """Up to ``n`` user prompts written by the target itself: fed only its chat template's user header, it
    samples a user turn until the end of the turn.

    Turns that never end within ``max_new_tokens``, empty or very short ones, repetitive ones and duplicates
    are dropped; sampling stops after ``4 * n`` attempts. Ids are ``"synthetic/<i>"``; the result depends only
    on ``seed`` (and the hardware), and the caller's RNG state is left as it was.
    """
    header_ids = tokenizer(user_header(tokenizer), add_special_tokens=False).input_ids
    stop_ids = end_of_turn_ids(target, tokenizer)
    pad_token_id = pad_token_id_for(target, tokenizer)
    texts: list[str] = []
    seen: set[str] = set()
    attempts, max_attempts = 0, 4 * n
    with tqdm(total=n, desc="synthesizing prompts", unit="prompt", disable=not progress) as bar:
        while len(texts) < n and attempts < max_attempts:
            rows = min(batch_size, max_attempts - attempts)
            responses = generate_responses(
                target,
                [header_ids] * rows,
                pad_token_id=pad_token_id,
                stop_ids=stop_ids,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                seed=seed * 1_000_003 + attempts,
            )
            attempts += rows
            for response in responses:
                if not response or response[-1] not in stop_ids:  # never ended its turn
                    continue
                text = tokenizer.decode(response[:-1], skip_special_tokens=True).strip()
                key = normalize_text(text)
                if _is_degenerate(text) or key in seen or len(texts) == n:
                    continue
                seen.add(key)
                texts.append(text)
                bar.update(1)
    if len(texts) < n:
        logger.warning(f"Synthesized only {len(texts)} of {n} prompts in {attempts} attempts")
    return [
        Prompt(id=f"{SYNTHETIC_SOURCE}/{i}", dataset=SYNTHETIC_SOURCE, messages=[{"role": "user", "content": text}])
        for i, text in enumerate(texts)
    ]


def training_prompts(
    sources: list[str],
    limit_per_source: int | None = None,
    *,
    target: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    batch_size: int = 8,
    synthetic_cache: str | os.PathLike | None = None,
    evaluation: Iterable[Prompt] | None = None,
    unfiltered_evaluation_sets: Collection[str] = (),
    progress: bool = False,
) -> list[Prompt]:
    """Training prompts from source specs: a packaged set (``"sharegpt"``, ``"math500"``), ``"synthetic"``
    (written by ``target``; needs ``target`` and ``tokenizer``) or a path ending in ``.jsonl``.

    Up to ``limit_per_source`` prompts are taken from each source. An evaluation set (``EVALUATION_SETS``) as a
    source raises ``ValueError``. Prompts equal to or containing an evaluation item are dropped, as are repeated
    ids and repeated texts. The evaluation items are ``evaluation`` when given, else every set of
    ``EVALUATION_SETS`` but those named in ``unfiltered_evaluation_sets`` (see ``evaluation_prompts``: a set
    that is not installed raises ``RuntimeError`` rather than letting its items through).
    Synthetic prompts are read from ``synthetic_cache`` when it holds enough of them, else synthesized and
    written there, so a resumed run does not sample them again.
    """
    for source in sources:
        _check_source(source)
    if SYNTHETIC_SOURCE in sources and (target is None or tokenizer is None):
        raise ValueError("The 'synthetic' source needs the target and its tokenizer (target=..., tokenizer=...).")
    if evaluation is not None and unfiltered_evaluation_sets:
        raise ValueError("Pass either evaluation= (the items to filter) or unfiltered_evaluation_sets=, not both.")
    if evaluation is None:
        evaluation = evaluation_prompts(unfiltered_evaluation_sets)
    evaluation_filter = EvaluationFilter(evaluation)
    prompts: list[Prompt] = []
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    for source in sources:
        loaded = _load_source(source, limit_per_source, target, tokenizer, seed, batch_size, synthetic_cache, progress)
        kept = []
        for prompt in loaded:
            text = comparable_text(prompt)
            if prompt.id in seen_ids or text in seen_texts:
                continue
            seen_ids.add(prompt.id)
            seen_texts.add(text)
            kept.append(prompt)
        overlapping = {prompt.id for prompt in kept if prompt in evaluation_filter}
        if overlapping:
            logger.warning(
                f"{source}: dropped {len(overlapping)} prompts that equal or contain an evaluation item "
                f"({', '.join(EVALUATION_SETS)}), e.g. {min(overlapping)}"
            )
            kept = [prompt for prompt in kept if prompt.id not in overlapping]
        logger.info(f"{source}: {len(kept)} training prompts ({len(loaded) - len(kept)} dropped)")
        prompts += kept
    return prompts


def _check_source(source: str) -> None:
    """Raise ``ValueError`` for an evaluation set or an unknown source spec."""
    if source in EVALUATION_SETS:
        raise ValueError(
            f"{source!r} is an evaluation set ({', '.join(EVALUATION_SETS)}) and cannot be a training source: "
            "the drafter would be measured on prompts it was trained on. Use 'sharegpt', 'math500', 'synthetic' "
            "or a .jsonl file of your own prompts."
        )
    if source != SYNTHETIC_SOURCE and source not in KNOWN_PROMPT_SETS and not source.endswith(".jsonl"):
        known = sorted({SYNTHETIC_SOURCE, *KNOWN_PROMPT_SETS} - set(EVALUATION_SETS))
        raise ValueError(f"Unknown training source {source!r}; use one of {', '.join(known)} or a path ending .jsonl.")


def _load_source(source, limit, target, tokenizer, seed, batch_size, synthetic_cache, progress) -> list[Prompt]:
    if source.endswith(".jsonl"):
        return prompts_from_jsonl(source)[:limit]
    if source != SYNTHETIC_SOURCE:
        return load_prompts(source, limit)
    if limit is None:
        raise ValueError("The 'synthetic' source needs a number of prompts (limit_per_source).")
    if synthetic_cache is not None and Path(synthetic_cache).exists():
        cached = prompts_from_jsonl(synthetic_cache)
        if len(cached) >= limit:
            logger.info(f"Read {limit} synthetic prompts from {synthetic_cache}")
            return cached[:limit]
    prompts = synthesize_prompts(target, tokenizer, limit, seed=seed, batch_size=batch_size, progress=progress)
    if synthetic_cache is not None:
        write_prompts_jsonl(prompts, synthetic_cache)
    return prompts


# ShareGPT's "from" names of the two sides (its other names, "system", "bing", "bard", are kept as they are)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant"}


def chat_messages(value: list[dict]) -> list[dict]:
    """`{"role", "content"}` messages from a chat list in either spelling: the chat template's, or ShareGPT's
    `{"from", "value"}` (`SHAREGPT_ROLES`). A missing content is read as ""."""
    messages = []
    for message in value:
        role = message.get("role") or message.get("from")  # `or`: Arrow fills a missing struct field with None
        content = message.get("content")
        content = message.get("value") if content is None else content  # "" stays "": an empty turn, not a missing one
        messages.append({"role": SHAREGPT_ROLES.get(role, role), "content": content or ""})
    return messages


def _to_prompt(value: str | list[dict], prompt_id: str, source: str) -> Prompt | None:
    """A prompt from a string (one user turn) or a chat list cut after its last user message; None if none."""
    if isinstance(value, str):
        return Prompt(id=prompt_id, dataset=source, messages=[{"role": "user", "content": value}])
    messages = chat_messages(value)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        return None
    return Prompt(id=prompt_id, dataset=source, messages=messages[: last_user + 1])


def _is_degenerate(text: str) -> bool:
    """Too short to be a task, or mostly the same few words over and over."""
    words = text.split()
    return len(text) < 10 or (len(words) >= 12 and len(set(words)) < 0.3 * len(words))
