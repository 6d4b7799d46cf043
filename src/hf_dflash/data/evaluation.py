"""Keeping evaluation items out of training data: the benchmark sets, and a filter for prompts that hold their items.

A drafter measured on prompts it was trained on would be measured wrongly, so the benchmark sets
(``EVALUATION_SETS``) are never a training source, and every training prompt that equals or contains one of
their items is dropped (``hf_dflash.data.sources.training_prompts``). Prompts are compared in a normal form
(``comparable_text``: the user text, lowercased, whitespace collapsed). A benchmark set that is not installed
raises (``evaluation_prompts``) unless the caller opts out of it by name, since its items could otherwise reach
the training data unnoticed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import transformers

from hf_dflash.data.prompts import Prompt, get_prompt_set_spec, load_prompts
from hf_dflash.offline import EVALUATION_SETS as EVALUATION_SETS  # never a training source; filtered out of all others

logger = transformers.utils.logging.get_logger(__name__)

# Eval items at least this long (normalised chars) are also caught inside longer prompts; shorter ones only on
# exact match (a short question such as "hi" would match far too much as a substring).
CONTAINS_MIN_CHARS = 64


def normalize_text(text: str) -> str:
    """Lowercase with whitespace runs collapsed to one space: the form prompts are compared in."""
    return " ".join(text.lower().split())


def prompt_text(prompt: Prompt) -> str:
    """The user-written text of a prompt (its user messages, joined by newlines)."""
    return "\n".join(message["content"] for message in prompt.messages if message["role"] == "user")


def comparable_text(prompt: Prompt) -> str:
    """A prompt's user text, normalised: the key repeats and evaluation items are recognised by."""
    return normalize_text(prompt_text(prompt))


class EvaluationFilter:
    """Tells whether a prompt's normalised text equals or contains one of the evaluation prompts'.

    Exact matches are a set lookup. For containment, each evaluation text of at least ``CONTAINS_MIN_CHARS``
    characters is indexed by its first ``CONTAINS_MIN_CHARS`` characters; every window of that length in the
    candidate is looked up and a hit is confirmed with a substring test (linear in the candidate's length).
    """

    def __init__(self, evaluation_prompts: Iterable[Prompt]):
        self.exact: set[str] = set()
        self.by_prefix: dict[str, list[str]] = {}
        for prompt in evaluation_prompts:
            text = comparable_text(prompt)
            self.exact.add(text)
            if len(text) >= CONTAINS_MIN_CHARS:
                self.by_prefix.setdefault(text[:CONTAINS_MIN_CHARS], []).append(text)

    def __contains__(self, prompt: Prompt) -> bool:
        text = comparable_text(prompt)
        if text in self.exact:
            return True
        for start in range(len(text) - CONTAINS_MIN_CHARS + 1):
            for candidate in self.by_prefix.get(text[start : start + CONTAINS_MIN_CHARS], ()):
                if text.startswith(candidate, start):
                    return True
        return False


def evaluation_prompts(unfiltered: Collection[str] = ()) -> list[Prompt]:
    """Every item of the evaluation sets (``EVALUATION_SETS``) except those named in ``unfiltered``.

    A set that cannot be loaded (its package missing, or installed without its data file) raises
    ``RuntimeError`` naming the package and the ways out, since its items could otherwise reach the training
    data unnoticed. A set named in ``unfiltered`` is not loaded, with a warning that its items are not kept out.
    """
    unfiltered = {unfiltered} if isinstance(unfiltered, str) else set(unfiltered)
    unknown = sorted(unfiltered - set(EVALUATION_SETS))
    if unknown:
        raise ValueError(f"Unknown evaluation sets {unknown}; the evaluation sets are {', '.join(EVALUATION_SETS)}.")
    items, missing = [], []
    for name in EVALUATION_SETS:
        if name in unfiltered:
            logger.warning(f"Evaluation set {name!r} is opted out of the filter: its items may reach training data.")
            continue
        try:
            items += load_prompts(name)
        except (ModuleNotFoundError, FileNotFoundError) as error:
            missing.append((name, error))
    if missing:
        raise RuntimeError(_missing_evaluation_sets_message(missing)) from missing[0][1]
    return items


def _missing_evaluation_sets_message(missing: list[tuple[str, Exception]]) -> str:
    """What to do when evaluation sets cannot be loaded to keep their items out of the training data."""
    names = [name for name, _ in missing]
    details = "; ".join(
        f"{name!r} (package {get_prompt_set_spec(name).distribution!r}): {error}" for name, error in missing
    )
    flags = " ".join(f"--unfiltered_evaluation_set {name}" for name in names)
    return (
        f"Cannot keep evaluation sets {', '.join(map(repr, names))} out of the training data: {details}. Install the "
        "benchmark packages with scripts/install_offline_assets.sh, or pass the evaluation items explicitly "
        f"(evaluation=[...]), or opt out by name (unfiltered_evaluation_sets={tuple(names)!r}; hf-dflash data: {flags})."
    )
