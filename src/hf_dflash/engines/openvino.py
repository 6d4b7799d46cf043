"""OpenVINO GenAI: our drafters as OpenVINO IR, and GenAI's `LLMPipeline` run on them.

Design: optimum-intel 2.2.0 (the IR export) and openvino-genai 2026.4.1 pin `transformers<5.6` and
`huggingface-hub<1.22`, which clash with hf-dflash's own, so they live in their own venv
(`bash scripts/install_engines.sh --openvino`, found by `find_openvino` under the same engines folder as llama.cpp)
and everything here drives that venv's programs by subprocess:

- `export_openvino` writes `target/` and `draft/` IR with `optimum-cli export openvino`. The draft goes through our
  z-lab export with the full vocabulary (`model_type: qwen3`, `architectures: ["DFlashDraftModel"]`, the form
  optimum-intel's DFlash exporter takes): GenAI ignores `d2t` and a draft head and grafts the target's embedding and
  head onto the draft at load time. It finds the target's hidden states by node name (`layers.{id}/`, the residual
  add that ends each decoder layer: the layer's output, our `hidden_states[id + 1]`) when optimum-intel wrote no
  layer metadata (it writes some only for Qwen3-family targets). A drafter GenAI would run differently from how it
  was trained (an embedding scale, causal sliding-window layers) is refused before anything is written.
- `run_openvino` runs `openvino_runner.py` (shipped beside this module, standard library + openvino_genai only) in
  the venv: a JSON request on stdin, a JSON report on the last stdout line, read back by `parse_runner_report`.
  Greedy, one prompt at a time, with or without the drafter (DFlash needs prefix caching off and
  `num_assistant_tokens = block_size - 1`).

GenAI's `get_num_draft_tokens()` reports 0 for DFlash, so the target's steps come from the per-step token counts
(`perf_metrics.raw_metrics.m_batch_sizes`, one entry per target forward): `target_steps` counts them all, the
prompt's included, and `OpenVinoRun.mean_accepted_length` is tokens per drafted step (the prompt's step and its one
token left out), which is how hf-dflash's tau and llama.cpp's `#mean acc len` count.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel
from transformers.utils import logging

from hf_dflash.engines.llama_cpp import engines_dir

logger = logging.get_logger(__name__)

INSTALL_HINT = (
    "run `bash scripts/install_engines.sh --openvino` (OpenVINO GenAI + optimum-intel in their own venv, ~2 min once)"
)
VENV_NAME = "openvino-venv"
MARKER = "hf-dflash-pins.txt"  # written last by install_engines.sh
RUNNER = Path(__file__).with_name("openvino_runner.py")
ZLAB_ARCHITECTURE = "DFlashDraftModel"  # what optimum-intel's DFlash exporter requires, with model_type qwen3
RUN_FIELDS = ("token_ids", "text", "new_tokens", "target_steps", "step_tokens", "accepted_tokens", "tokens_per_s")


@dataclass(frozen=True)
class OpenVino:
    """The venv `scripts/install_engines.sh --openvino` built."""

    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def optimum_cli(self) -> Path:
        return self.venv / "bin" / "optimum-cli"


def find_openvino(folder: str | os.PathLike | None = None) -> OpenVino:
    """The OpenVINO venv in `folder` (default `engines_dir() / "openvino-venv"`), complete (its marker written)."""
    venv = Path(folder) if folder is not None else engines_dir() / VENV_NAME
    if not (venv / "bin" / "python").is_file() or not (venv / MARKER).is_file():
        raise FileNotFoundError(f"OpenVINO GenAI is not installed in {venv}: {INSTALL_HINT}.")
    return OpenVino(venv)


def unsupported_draft_reason(config) -> str | None:
    """Why OpenVINO GenAI would run this drafter differently from how it was trained, or `None` when it would not.

    `config` is the drafter's `DFlashConfig`."""
    if getattr(config, "variant", "dflash") == "dflash2":
        return (
            "it is a DFlash2 drafter, and GenAI's DFlash pipeline has neither its sublayer convolutions nor its "
            "candidate selector (export it for llama.cpp, vLLM or SGLang)"
        )
    scale = config.input_embedding_scale
    if scale not in (None, 1.0):
        return (
            f"the target scales its embedding rows by {scale:g}, and GenAI embeds the draft block with the target's "
            "raw rows (it grafts the embedding Gather, not the scale after it)"
        )
    if "sliding_attention" in config.layer_types and config.causal_sliding_attention:
        return (
            "its sliding-window layers attend causally inside the block, and optimum-intel's DFlash draft attends "
            "bidirectionally in every layer"
        )
    if config.block_size < 2:
        return f"its block size is {config.block_size}; DFlash drafts block_size - 1 >= 1 tokens"
    return None


def export_openvino(
    draft: PreTrainedModel,
    target_folder: str | os.PathLike,
    output: str | os.PathLike,
    *,
    weight_format: str = "fp32",
    openvino: OpenVino | None = None,
) -> Path:
    """Write `output/target` and `output/draft` (OpenVINO IR) for GenAI's DFlash pipeline; returns `output`.

    Args:
        draft: the drafter (a reduced draft vocabulary is exported whole: GenAI drafts over the target's head).
        target_folder: the target's transformers folder (or a Hub id optimum-cli can load), tokenizer included.
        output: the folder to write; `target/` and `draft/` are replaced whole once both exports succeeded.
        weight_format: optimum-cli's `--weight-format` (`fp32`, `fp16`, `int8`, `int4`) for both models.
    """
    reason = unsupported_draft_reason(draft.config)
    if reason is not None:
        raise ValueError(f"OpenVINO GenAI cannot serve this drafter as trained: {reason}.")
    openvino = openvino or find_openvino()
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".hf-dflash-openvino-", dir=output) as scratch:
        scratch = Path(scratch)
        zlab = scratch / "z-lab"
        draft.save_pretrained(zlab, layout="z-lab", full_vocabulary=True)  # GenAI ignores d2t and a draft head
        _check_zlab_config(zlab / "config.json")
        _optimum_export(openvino, str(target_folder), scratch / "target", weight_format, [])
        remote = ["--trust-remote-code", "--disable-convert-tokenizer"]  # the draft loads through optimum's patcher
        _optimum_export(openvino, str(zlab), scratch / "draft", weight_format, remote)
        for name in ("target", "draft"):
            shutil.rmtree(output / name, ignore_errors=True)
            os.replace(scratch / name, output / name)
    logger.info(f"Wrote OpenVINO IR to {output}/target and {output}/draft ({weight_format})")
    return output


def _check_zlab_config(path: Path) -> None:
    config = json.loads(path.read_text())
    if config.get("model_type") != "qwen3" or (config.get("architectures") or [None])[0] != ZLAB_ARCHITECTURE:
        raise ValueError(
            f"optimum-intel exports a DFlash draft only as model_type 'qwen3' with architectures "
            f"['{ZLAB_ARCHITECTURE}']; the z-lab export wrote {config.get('model_type')!r}, "
            f"{config.get('architectures')!r}."
        )


def _optimum_export(openvino: OpenVino, model: str, output: Path, weight_format: str, extra: list[str]) -> None:
    command = [
        str(openvino.optimum_cli), "export", "openvino", "--model", model, "--task", "text-generation-with-past",
        "--weight-format", weight_format, *extra, str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=_venv_environment(openvino))
    if result.returncode != 0 or not (output / "openvino_model.xml").is_file():
        raise RuntimeError(f"optimum-cli failed ({' '.join(command)}):\n{result.stderr[-3000:]}")


def _venv_environment(openvino: OpenVino) -> dict[str, str]:
    """Our environment without what would make the venv's python import our packages (PYTHONPATH, our venv)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    environment["PATH"] = os.pathsep.join([str(openvino.venv / "bin"), environment.get("PATH", "")])
    return environment


@dataclass(frozen=True)
class OpenVinoRun:
    """One greedy generation by GenAI's `LLMPipeline`: the new tokens and text, the target's forwards (the prompt's
    included), the draft tokens it kept and tokens/s."""

    token_ids: list[int]
    text: str
    new_tokens: int
    target_steps: int
    step_tokens: list[int]  # tokens committed by each target forward
    accepted_tokens: int
    tokens_per_s: float

    @property
    def drafted_steps(self) -> int:
        """Target forwards after the prompt's (each verified a drafted block when a drafter ran)."""
        return max(self.target_steps - 1, 0)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per drafted target step (as hf-dflash's tau), `None` when no step drafted."""
        if self.drafted_steps == 0:
            return None
        return (self.new_tokens - self.step_tokens[0]) / self.drafted_steps


def run_openvino(
    ir: str | os.PathLike,
    prompts: Sequence[Sequence[int] | str],
    *,
    max_new_tokens: int,
    with_draft: bool,
    block_size: int | None = None,
    properties: Mapping[str, str] | None = None,
    paged: bool = False,
    threads: int = 2,
    device: str = "CPU",
    openvino: OpenVino | None = None,
) -> list[OpenVinoRun]:
    """GenAI's `LLMPipeline` on an `export_openvino` folder, greedy, one run per prompt.

    Args:
        prompts: token-id lists, or texts already rendered in the chat template (not templated again).
        with_draft: verify the drafter's blocks (`num_assistant_tokens = block_size - 1`), else plain decoding.
        properties: OpenVINO device properties for target and draft (`{"KV_CACHE_PRECISION": "f32"}`).
        paged: plain decoding through GenAI's continuous-batching (paged attention) pipeline, the path DFlash's
            verification takes, instead of the default stateful one.
    """
    request = runner_request(
        ir, prompts, max_new_tokens=max_new_tokens, with_draft=with_draft, block_size=block_size,
        properties=properties, paged=paged, threads=threads, device=device,
    )  # fmt: skip
    openvino = openvino or find_openvino()
    result = subprocess.run(
        [str(openvino.python), "-I", str(RUNNER)],  # -I: the runner's folder holds this `openvino.py`, not the package
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=_venv_environment(openvino),
    )
    if result.returncode != 0:
        raise RuntimeError(f"openvino_runner.py failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return parse_runner_report(result.stdout, expected=len(prompts))


def runner_request(
    ir: str | os.PathLike,
    prompts: Sequence[Sequence[int] | str],
    *,
    max_new_tokens: int,
    with_draft: bool,
    block_size: int | None,
    properties: Mapping[str, str] | None = None,
    paged: bool = False,
    threads: int = 2,
    device: str = "CPU",
) -> dict:
    """The runner's JSON request, after checking the arguments (a mistake fails here, not inside the venv)."""
    ir = Path(ir)
    needed = ["target", "draft"] if with_draft else ["target"]
    missing = [name for name in needed if not (ir / name / "openvino_model.xml").is_file()]
    if missing:
        raise FileNotFoundError(f"{ir} has no {' or '.join(missing)} IR: write it with `export_openvino`.")
    if not prompts:
        raise ValueError("No prompts to run.")
    for prompt in prompts:
        if isinstance(prompt, str):
            continue
        if not prompt or not all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            raise ValueError("A prompt is a non-empty list of token ids or a rendered text.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}.")
    if with_draft and (block_size is None or block_size < 2):
        raise ValueError(
            f"DFlash needs the drafter's block size (>= 2) to draft block_size - 1 tokens, not {block_size}."
        )
    if with_draft and paged:
        raise ValueError("`paged` is for plain decoding; the drafter always runs through the paged pipeline.")
    return {
        "ir": str(ir),
        "prompts": [prompt if isinstance(prompt, str) else list(prompt) for prompt in prompts],
        "max_new_tokens": max_new_tokens,
        "with_draft": with_draft,
        "block_size": block_size,
        "properties": dict(properties or {}),
        "paged": paged,
        "threads": threads,
        "device": device,
    }


def parse_runner_report(stdout: str, expected: int | None = None) -> list[OpenVinoRun]:
    """The runs in `openvino_runner.py`'s report (the last stdout line), checked for their fields and counts."""
    lines = stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError as error:
        raise RuntimeError(f"openvino_runner.py's last line is not JSON ({error}):\n{stdout[-1000:]}") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list):
        raise RuntimeError(f"openvino_runner.py printed no report with runs:\n{stdout[-1000:]}")
    runs = []
    for index, entry in enumerate(report["runs"]):
        missing = [name for name in RUN_FIELDS if name not in entry]
        if missing:
            raise RuntimeError(f"openvino_runner.py's run {index} lacks {', '.join(missing)}.")
        run = OpenVinoRun(**{name: entry[name] for name in RUN_FIELDS})
        if sum(run.step_tokens) != run.new_tokens or len(run.step_tokens) != run.target_steps:
            raise RuntimeError(
                f"openvino_runner.py's run {index}: {run.new_tokens} new tokens in {run.target_steps} steps, but the "
                f"per-step counts sum to {sum(run.step_tokens)} over {len(run.step_tokens)} steps."
            )
        runs.append(run)
    if expected is not None and len(runs) != expected:
        raise RuntimeError(f"openvino_runner.py reported {len(runs)} runs for {expected} prompts.")
    return runs
