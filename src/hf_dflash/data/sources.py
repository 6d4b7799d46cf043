"""Training prompts from their sources: packaged sets, JSONL files, ``datasets.Dataset`` columns, or the target.

``training_prompts`` turns source specs into one list of prompts: a packaged set (``"sharegpt"``, ``"math500"``),
a path ending in ``.jsonl`` (``prompts_from_jsonl``), or ``"synthetic"``: prompts written by the target itself
(``synthesize_prompts``: it is fed only its chat template's user header and writes the user turn; cached beside
the output so a resumed run does not sample them again). The benchmark sets are refused as sources and every
prompt that equals or contains one of their items is dropped (``hf_dflash.data.evaluation``), as are repeated ids
and texts. Chat lists are cut after their last user message, which the target then answers
(``hf_dflash.data.regenerate``). A prompt of the user's own (a JSONL line, a dataset row) without a user turn with
text is refused, naming its file and line or row: it is a mistake to fix, not a prompt to answer.
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
from hf_dflash.data.prompts import Prompt, load_prompts, prompt_set_path, user_turn_problem
from hf_dflash.data.regenerate import generate_responses
from hf_dflash.data.tokens import pad_token_id_for
from hf_dflash.offline import SYNTHETIC_SOURCE as SYNTHETIC_SOURCE  # prompts written by the target itself
from hf_dflash.offline import check_training_source

logger = transformers.utils.logging.get_logger(__name__)


def prompts_from_jsonl(path: str | os.PathLike, source: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL file: one JSON object a line, with ``"prompt"`` (the text of one user turn) or
    ``"messages"`` (a chat list of ``{"role", "content"}``, or ShareGPT's ``{"from", "value"}``); blank lines are
    skipped.

    A line's ``"id"`` and ``"source"`` are kept when present; otherwise the id is ``"<source>/<line index>"``
    and ``source`` defaults to the file's stem. Chat lists are cut after their last user message (the
    target answers it). Raises ``ValueError`` naming ``file:line`` for a line that is not a JSON object, has
    neither field, or gives no user turn with text to answer (an empty or whitespace-only prompt, a chat list without
    a user message, or whose last user message is empty): such a line is refused, never written as a record.
    """
    path = Path(path)
    source = source or path.stem
    prompts = []
    with open(path, encoding="utf-8") as file:
        for index, line in enumerate(file):
            if not line.strip():
                continue
            where = f"{path}:{index + 1}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error})") from error
            if not isinstance(record, dict) or ("messages" not in record and "prompt" not in record):
                example = '{"prompt": "Hi"} or {"messages": [{"role": "user", "content": "Hi"}]}'
                raise ValueError(
                    f"{where}: a prompt line needs a 'messages' list or a 'prompt' string, e.g. {example}"
                )
            value = record["messages"] if "messages" in record else record["prompt"]
            prompt_id = str(record.get("id", f"{source}/{index}"))
            prompts.append(_to_prompt(value, prompt_id, record.get("source", source), where))
    return prompts


def prompts_from_dataset(
    dataset: datasets.Dataset, column: str = "messages", source: str = "dataset", id_column: str | None = None
) -> list[Prompt]:
    """Prompts from a ``datasets.Dataset`` column of chat lists (``"messages"``) or strings (``"prompt"``).

    Ids are ``"<source>/<row index>"``, or ``"<source>/<id_column value>"``. Chat lists are cut after their
    last user message. Raises ``ValueError`` naming the row for one without a user turn with text, as
    ``prompts_from_jsonl`` does for a line.
    """
    if column not in dataset.column_names:
        raise ValueError(f"The dataset has no column {column!r}; columns: {', '.join(dataset.column_names)}.")
    ids = dataset[id_column] if id_column else range(len(dataset))
    return [
        _to_prompt(value, f"{source}/{item_id}", source, f"row {row} ({source}/{item_id}) of column {column!r}")
        for row, (item_id, value) in enumerate(zip(ids, dataset[column]))
    ]


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
        check_training_source(source)
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


def check_training_sources(sources: Iterable[str]) -> None:
    """Raise what ``training_prompts`` would raise about ``sources`` before anything is generated or loaded: a
    ``ValueError`` for an evaluation set, an unknown spec, or a JSONL line that is not a prompt (naming file:line),
    ``FileNotFoundError`` for a missing JSONL file, and ``ModuleNotFoundError`` / ``FileNotFoundError`` naming the pip
    command for a packaged set that is not installed."""
    for source in sources:
        check_training_source(source)
        if source.endswith(".jsonl"):
            prompts_from_jsonl(source)
        elif source != SYNTHETIC_SOURCE:
            prompt_set_path(source)


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


def _to_prompt(value: str | list[dict], prompt_id: str, source: str, where: str) -> Prompt:
    """A prompt from a string (one user turn) or a chat list cut after its last user message; `ValueError` naming
    `where` (a file:line or a row) for one without a user turn with text (`prompts.user_turn_problem`)."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and all(isinstance(message, dict) for message in value):
        messages = chat_messages(value)
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages))
        messages = messages[: last_user + 1]
    else:
        raise ValueError(f"{where}: a prompt is a string or a list of messages, not {type(value).__name__}")
    problem = user_turn_problem(messages)
    if problem is not None:
        raise ValueError(f"{where}: {problem}. Give it a user turn with text, or remove it")
    return Prompt(id=prompt_id, dataset=source, messages=messages)


def _is_degenerate(text: str) -> bool:
    """Too short to be a task, or mostly the same few words over and over."""
    words = text.split()
    return len(text) < 10 or (len(words) >= 12 and len(set(words)) < 0.3 * len(words))
