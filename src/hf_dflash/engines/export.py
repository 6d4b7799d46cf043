"""One export per serving engine: the files the engine reads, and the commands that serve them.

- `llama.cpp`: `draft.gguf` through llama.cpp's own converter (`llama_cpp.export_draft_gguf`; the reduced draft
  vocabulary is kept unless `full_vocabulary`), served with the target's GGUF and `--spec-draft-n-max B-1`.
- `openvino`: `target/` and `draft/` IR through optimum-intel (`openvino.export_openvino`, always the full
  vocabulary), served by OpenVINO GenAI's `LLMPipeline` with prefix caching off and `num_assistant_tokens B-1`.
- `vllm`: the z-lab folder (`save_pretrained(layout="z-lab")`, reduced vocabulary with `d2t`), `num_speculative_tokens
  B-1`.
- `sglang`: the same folder (SGLang drafts over the target's head and ignores `d2t`), `--speculative-num-draft-tokens B`.

Each export also writes `serving.json`: the engine, the draft's block size and tapped target layers, the commands and
the engine settings they rely on. vLLM and SGLang were not run here (no GPU); their commands come from their loaders
and docs. llama.cpp's and OpenVINO's are the ones `benchmarks/scripts/engine_parity*.py` run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from transformers import PreTrainedModel

from hf_dflash.atomic_files import write_text_atomic
from hf_dflash.engines import ENGINES, llama_cpp, openvino


@dataclass(frozen=True)
class ServingRecipe:
    """What an export wrote and how to serve it."""

    engine: str
    draft: str  # the file or folder the engine reads
    block_size: int
    target_layer_ids: list[int]
    commands: list[str]
    tested_here: bool  # whether this machine ran the engine on such an export
    settings: dict = field(default_factory=dict)  # engine settings the commands rely on

    def write(self, folder: str | os.PathLike) -> Path:
        return write_text_atomic(Path(folder) / "serving.json", json.dumps(asdict(self), indent=1) + "\n")


def export_for_engine(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    engine: str,
    output: str | os.PathLike,
    *,
    target_id: str,
    target_folder: str | os.PathLike | None = None,
    target_gguf: str | os.PathLike | None = None,
    full_vocabulary: bool = False,
) -> ServingRecipe:
    """Write what `engine` reads into the folder `output`, with `serving.json`; returns the recipe.

    Args:
        target_id: how the engine names the target (a Hub id or folder for vLLM/SGLang).
        target_folder: llama.cpp: the target's transformers folder (its tokenizer); OpenVINO: the folder (or Hub id)
            optimum-cli exports the target from.
        target_gguf: llama.cpp only: the target's GGUF.
        full_vocabulary: export no reduced draft vocabulary (the draft then uses the target's head).
    """
    if engine not in ENGINES:
        raise ValueError(f"Unknown engine {engine!r}; hf-dflash exports for {', '.join(ENGINES)}.")
    output = Path(output)
    block_size, layers = draft.config.block_size, list(draft.config.target_layer_ids)
    if engine == "llama.cpp":
        if target_folder is None or target_gguf is None:
            raise ValueError("llama.cpp needs the target's GGUF and its transformers folder (for the tokenizer).")
        output.mkdir(parents=True, exist_ok=True)
        gguf = llama_cpp.export_draft_gguf(
            draft, target, target_folder, target_gguf, output / "draft.gguf", full_vocabulary=full_vocabulary
        )
        common = f"-m {target_gguf} -md {gguf} --spec-type draft-dflash --spec-draft-n-max {block_size - 1}"
        commands = [f"llama-server {common} --jinja", f"llama-speculative-simple {common} -p PROMPT --temp 0"]
        recipe = ServingRecipe(engine, str(gguf), block_size, layers, commands, tested_here=True)
    elif engine == "openvino":
        if target_folder is None:
            raise ValueError("OpenVINO needs the target's transformers folder (or Hub id) to export it to IR.")
        openvino.export_openvino(draft, target_folder, output)
        settings = {"scheduler_config.enable_prefix_caching": False, "num_assistant_tokens": block_size - 1}
        commands = [_openvino_command(output, block_size)]
        recipe = ServingRecipe(engine, str(output / "draft"), block_size, layers, commands, True, settings)
    else:
        head_source = None if full_vocabulary else target  # the reduced head's rows come from the target's head
        draft.save_pretrained(output, layout="z-lab", target=head_source, full_vocabulary=full_vocabulary)
        command = _zlab_command(engine, target_id, output, block_size)
        settings = {"dflash2": DFLASH2_READERS[engine]} if draft.config.variant == "dflash2" else {}
        recipe = ServingRecipe(engine, str(output), block_size, layers, [command], False, settings)
    recipe.write(output)
    return recipe


# What each engine needs to serve a DFlash2 export (DFlash2DraftModel) with its selector, from the engines' public code.
DFLASH2_READERS = {
    "vllm": "vLLM reads DFlash2DraftModel in its V2 model runner only; the V1 runner serves it as DFlash without the "
    "selector",
    "sglang": "SGLang reads DFlash2DraftModel with its DFlash algorithm and walks the selector's chain",
}


def _openvino_command(folder: Path, block_size: int) -> str:
    """Python run in the OpenVINO venv: GenAI's pipeline with the drafter (it refuses DFlash with prefix caching on)."""
    return (
        'python -c "import openvino_genai as g; s = g.SchedulerConfig(); s.enable_prefix_caching = False; '
        f"p = g.LLMPipeline('{folder}/target', 'CPU', draft_model=g.draft_model('{folder}/draft', 'CPU'), "
        f"scheduler_config=s); c = p.get_generation_config(); c.num_assistant_tokens = {block_size - 1}; "
        "c.max_new_tokens = 256; print(p.generate('PROMPT', c))\""
    )


def _zlab_command(engine: str, target_id: str, folder: Path, block_size: int) -> str:
    if engine == "vllm":
        config = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": block_size - 1})
        return f"vllm serve {target_id} --speculative-config '{config}'"
    return (
        f"python -m sglang.launch_server --model-path {target_id} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {folder} --speculative-num-draft-tokens {block_size}"
    )
