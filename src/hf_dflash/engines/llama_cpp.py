"""llama.cpp: our drafters as GGUF files, and llama.cpp's own tools run on them.

Design: llama.cpp is built outside the repository by `scripts/install_engines.sh` (from the pinned
`llama-cpp-python` sdist, which vendors a llama.cpp with DFlash) and found here by the same rule
(`find_llama_cpp`: `$HF_DFLASH_ENGINES`, else `~/.cache/hf_dflash/engines`). Everything goes through the engine's
own programs, so what is measured is what a user of llama.cpp gets:

- `export_draft_gguf` writes the drafter through llama.cpp's converter (`convert_hf_to_gguf.py`, with the vendored
  `gguf-py`). The z-lab export with a reduced draft vocabulary (`d2t` + the head's rows) is labelled
  `DSparkDraftModel`, the converter class that maps `d2t` (written as absolute ids, which llama.cpp's DFlash runtime
  reads); its `DFlashModel` class refuses `d2t`. With `full_vocabulary=True` it stays `DFlashDraftModel` and borrows
  the target's head at run time. A DFlash2 drafter's selector codebooks go out indexed by target token id (`[V, R]`,
  zero rows outside a reduced draft vocabulary), as llama.cpp's DFlash2 graph reads them. A target whose llama.cpp
  graph does not record layer inputs (the hidden states
  DFlash conditions on) is refused before anything is written, naming the graph file.
- `run_speculative` runs `llama-speculative-simple --spec-type draft-dflash` (or a draft-free method) on one prompt and reads back the text, the
  speed and llama.cpp's mean accepted length (tokens per target step, our tau); `run_plain` runs `llama-simple`
  (greedy) for the engine's own output without a drafter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel
from transformers.utils import logging

from hf_dflash.atomic_files import atomic_path

logger = logging.get_logger(__name__)

INSTALL_HINT = "run `bash scripts/install_engines.sh` (builds llama.cpp's tools from the pinned sdist, ~6 min)"


def engines_dir() -> Path:
    """Where `scripts/install_engines.sh` builds the engines: `$HF_DFLASH_ENGINES`, else `~/.cache/hf_dflash/engines`."""
    return Path(os.environ.get("HF_DFLASH_ENGINES") or Path.home() / ".cache" / "hf_dflash" / "engines")


@dataclass(frozen=True)
class LlamaCpp:
    """A llama.cpp source tree with its tools built in `build/bin`."""

    root: Path

    def tool(self, name: str) -> Path:
        """The built program `name` (e.g. `llama-speculative-simple`)."""
        path = self.root / "build" / "bin" / name
        if not path.is_file():
            raise FileNotFoundError(f"llama.cpp's {name} is not built in {path.parent}: {INSTALL_HINT}.")
        return path

    @property
    def converter(self) -> Path:
        return self.root / "convert_hf_to_gguf.py"

    def graph_source(self, architecture: str) -> Path:
        """The file of llama.cpp's compute graph for a GGUF `general.architecture` (e.g. `llama`, `gemma3`)."""
        return self.root / "src" / "models" / f"{architecture.replace('_', '-')}.cpp"


def find_llama_cpp(folder: str | os.PathLike | None = None) -> LlamaCpp:
    """The llama.cpp that `scripts/install_engines.sh` built in `folder` (default `engines_dir()`)."""
    folder = Path(folder) if folder is not None else engines_dir()
    trees = sorted(folder.glob("llama-cpp-python-*/vendor/llama.cpp"))
    if not trees:
        raise FileNotFoundError(f"llama.cpp is not installed in {folder}: {INSTALL_HINT}.")
    return LlamaCpp(trees[-1])


def gguf_architecture(path: str | os.PathLike) -> str:
    """`general.architecture` of a GGUF file (`llama`, `gemma3`, ...)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def unsupported_target_reason(llama_cpp: LlamaCpp, architecture: str) -> str | None:
    """Why llama.cpp cannot serve a DFlash drafter for a target of this GGUF architecture, or `None` when it can.

    DFlash conditions on the target's hidden states; llama.cpp hands them to the drafter only from graphs that record
    each layer's input (`res->t_layer_inp`)."""
    graph = llama_cpp.graph_source(architecture)
    if not graph.is_file():
        return f"llama.cpp has no graph for architecture {architecture!r} ({graph} does not exist)"
    if "t_layer_inp" not in graph.read_text(encoding="utf-8"):
        return (
            f"llama.cpp's {architecture} graph ({graph.relative_to(llama_cpp.root)}) does not record its layers' "
            "inputs (t_layer_inp), which a DFlash drafter conditions on, so llama.cpp cannot run DFlash for it"
        )
    return None


def export_draft_gguf(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    target_folder: str | os.PathLike,
    target_gguf: str | os.PathLike,
    output: str | os.PathLike,
    *,
    full_vocabulary: bool = False,
    outtype: str = "f32",
    llama_cpp: LlamaCpp | None = None,
) -> Path:
    """Write `draft` as a GGUF file llama.cpp's DFlash runtime reads, through llama.cpp's own converter.

    Args:
        draft, target: the drafter and its target (the target's head gives a reduced-vocabulary draft its rows).
        target_folder: the target's transformers folder (its tokenizer goes into the GGUF).
        target_gguf: the target's GGUF, checked for an architecture llama.cpp can serve DFlash for.
        output: the `.gguf` to write (whole or not at all).
        full_vocabulary: export no `d2t` and no head (the draft then uses the target's head), instead of the reduced
            draft vocabulary.
        outtype: the converter's `--outtype` (`f32`, `bf16`, `f16`, `q8_0`).
    """
    llama_cpp = llama_cpp or find_llama_cpp()
    reason = unsupported_target_reason(llama_cpp, gguf_architecture(target_gguf))
    if reason is not None:
        raise ValueError(f"Cannot export a drafter for {Path(target_gguf).name} to llama.cpp: {reason}.")
    with tempfile.TemporaryDirectory(prefix="hf-dflash-gguf-") as scratch:
        folder = Path(scratch) / "z-lab"
        head_source = None if full_vocabulary else target  # the reduced head's rows come from the target's head
        draft.save_pretrained(folder, layout="z-lab", target=head_source, full_vocabulary=full_vocabulary)
        reduced = "d2t" in _tensor_names(folder)
        if reduced:
            _relabel(folder / "config.json", "DSparkDraftModel")  # the converter class that maps d2t
            if draft.config.variant == "dflash2":
                _codebooks_over_vocabulary(folder / "model.safetensors", draft)
        with atomic_path(output) as partial:
            _convert(llama_cpp, folder, Path(target_folder), partial, outtype)
    logger.info(f"Wrote {output} ({'reduced' if reduced else 'full'} draft vocabulary)")
    return Path(output)


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for part in folder.glob("*.safetensors"):
        with safe_open(part, "pt") as file:
            names |= set(file.keys())
    return names


def _codebooks_over_vocabulary(weights_path: Path, draft: PreTrainedModel) -> None:
    """Rewrite a reduced-vocabulary DFlash2 export's codebooks `[V_d, R]` as `[V, R]` indexed by target id."""
    from safetensors.torch import load_file, save_file

    from hf_dflash.model.layouts_dflash import SELECTOR_CODEBOOKS, codebook_over_vocabulary

    tensors = load_file(weights_path)
    for name in SELECTOR_CODEBOOKS:
        tensors[name] = codebook_over_vocabulary(tensors[name], draft.draft_token_ids.cpu(), draft.config)
    save_file(tensors, str(weights_path), metadata={"format": "pt"})


def _relabel(config_path: Path, architecture: str) -> None:
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config_path.write_text(json.dumps(config, indent=2))


def _convert(llama_cpp: LlamaCpp, folder: Path, target_folder: Path, output: Path, outtype: str) -> None:
    command = [
        sys.executable,
        str(llama_cpp.converter),
        str(folder),
        "--target-model-dir",
        str(target_folder),
        "--outfile",
        str(output),
        "--outtype",
        outtype,
    ]
    gguf_py = os.pathsep.join([str(llama_cpp.root / "gguf-py"), os.environ.get("PYTHONPATH", "")])
    environment = os.environ | {"PYTHONPATH": gguf_py}  # the vendored gguf-py knows the DFlash architectures
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0 or output.stat().st_size == 0:  # `output` is the empty temporary file until written
        raise RuntimeError(f"llama.cpp's converter failed ({' '.join(command)}):\n{result.stderr[-3000:]}")


@dataclass(frozen=True)
class EngineRun:
    """One generation by a llama.cpp tool: the new text, its token count, tokens/s and, with a drafter, llama.cpp's
    mean accepted length (tokens per target step: our tau) and draft passes."""

    text: str
    new_tokens: int
    tokens_per_s: float
    mean_accepted_length: float | None = None
    draft_passes: int | None = None


def run_speculative(
    target_gguf: str | os.PathLike,
    prompt: str,
    *,
    max_new_tokens: int,
    draft_tokens: int,
    draft_gguf: str | os.PathLike | None = None,
    spec_type: str = "draft-dflash",
    threads: int = 2,
    llama_cpp: LlamaCpp | None = None,
) -> EngineRun:
    """`llama-speculative-simple --spec-type <spec_type>` on one (already templated) prompt, greedy: with the DFlash
    drafter `draft_gguf`, or with a draft-free method (`ngram-simple`) to see the engine's multi-token verification
    without DFlash."""
    llama_cpp = llama_cpp or find_llama_cpp()
    command = [str(llama_cpp.tool("llama-speculative-simple")), "-m", str(target_gguf)]
    command += ["-md", str(draft_gguf)] if draft_gguf is not None else []
    command += [
        "--spec-type", spec_type, "--spec-draft-n-max", str(draft_tokens), "-p", prompt, "-n", str(max_new_tokens),
        "--temp", "0", "--top-k", "1", "-t", str(threads), "-lv", "4",
    ]  # fmt: skip
    result = _run(command)
    run = parse_speculative_log(result.stdout, result.stderr, prompt)
    if draft_gguf is not None and run.mean_accepted_length is None:
        raise RuntimeError(f"llama-speculative-simple printed no DFlash statistics:\n{result.stderr[-3000:]}")
    return run


def _run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def parse_speculative_log(stdout: str, stderr: str, prompt: str) -> EngineRun:
    """Read `llama-speculative-simple`'s printout: the text after the echoed prompt, `decoded N tokens in S seconds,
    speed: X t/s` and the statistics line of the drafting method (`#gen drafts = P`, `#mean acc len = T`), which a
    method that never drafted (an n-gram draft on a prompt without repeats) does not print."""
    decoded = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+) t/s", stderr)
    if decoded is None:
        raise RuntimeError(f"llama-speculative-simple's log did not show its counts:\n{stderr[-3000:]}")
    accepted = re.search(r"#mean acc len\s*=\s*([\d.]+)", stderr)
    passes = re.search(r"#gen drafts\s*=\s*(\d+)", stderr)
    return EngineRun(
        text=stdout.split(prompt, 1)[-1],
        new_tokens=int(decoded.group(1)),
        tokens_per_s=float(decoded.group(3)),
        mean_accepted_length=float(accepted.group(1)) if accepted else None,
        draft_passes=int(passes.group(1)) if passes else None,
    )


def texts_agree(first: str, second: str) -> bool:
    """Whether two generations agree as far as both go: the tools stop at slightly different lengths (a drafted
    round may run past the budget) and pad the end with newlines."""
    first, second = first.rstrip(), second.rstrip()
    shorter = min(len(first), len(second))
    return first[:shorter] == second[:shorter]


def run_plain(
    target_gguf: str | os.PathLike, prompt: str, *, max_new_tokens: int, llama_cpp: LlamaCpp | None = None
) -> EngineRun:
    """`llama-simple` (greedy, no drafter) on one (already templated) prompt."""
    llama_cpp = llama_cpp or find_llama_cpp()
    result = _run([str(llama_cpp.tool("llama-simple")), "-m", str(target_gguf), "-n", str(max_new_tokens), prompt])
    timing = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", result.stderr)
    if timing is None:
        raise RuntimeError(f"llama-simple's log did not show its timing:\n{result.stderr[-3000:]}")
    runs = int(timing.group(2))
    return EngineRun(
        text=result.stdout.split(prompt, 1)[-1], new_tokens=runs, tokens_per_s=runs / (float(timing.group(1)) / 1000)
    )
