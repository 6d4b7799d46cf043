"""Peer rows: the same prompts through a serving engine, plain and with the same drafter, beside our paths.

Design: an engine is a `PeerEngine` (`name`, the `weights` it runs, `plain` and `dflash` over the benchmark's
prompts, each returning one `llama_cpp.EngineRun` per prompt); `measure_peers` runs the prompts through both modes of
every engine and reduces them per dataset to `PeerRow`s, which the report keeps beside the timed methods
(`report.peers`). Two engines: `LlamaCppPeer` (its tools, one process per prompt, the prompt as chat-rendered text)
and `OpenVinoPeer` (GenAI's pipeline in its own venv, one process for all prompts, the prompt's token ids).

What a row measures is the engine's own: its tokens/s is the figure the engine reports for the generation (llama.cpp's
tools: the decode loop after the prompt is processed; GenAI: its throughput metric), the median over prompts; its
mean accepted length is committed tokens over drafted target steps, over all prompts (tau's definition);
`agrees_with_plain` counts prompts where the engine's DFlash text agrees with its own plain text as far as both go
(greedy decoding should change nothing). Engines run their own weights (llama.cpp: a GGUF; OpenVINO: an IR), so their
text may differ from ours; rows say which weights.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from transformers import PreTrainedModel
from transformers.utils import logging

from hf_dflash.bench.config import PEER_ENGINES, BenchmarkPrompt
from hf_dflash.bench.report import PeerRow
from hf_dflash.engines import llama_cpp, openvino
from hf_dflash.engines.llama_cpp import EngineRun

logger = logging.get_logger(__name__)

# GenAI's default KV cache on CPU is u8, which flips near-ties between 8-token and one-token forwards; in f32 its DFlash
# text equals its plain text (benchmarks/results/engine_parity_openvino.json). The inference precision is asked for
# too: on CPUs with AVX512-BF16 it defaults to bf16, and GenAI's paged attention then refuses an f32 cache.
OPENVINO_PROPERTIES = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


class PeerEngine(Protocol):
    """A serving engine: plain decoding and DFlash decoding with our drafter, one run per prompt."""

    name: str
    weights: str

    def plain(self, prompts: Sequence[BenchmarkPrompt], tokenizer, max_new_tokens: int) -> list[EngineRun]: ...

    def dflash(self, prompts: Sequence[BenchmarkPrompt], tokenizer, max_new_tokens: int) -> list[EngineRun]: ...


@dataclass(frozen=True)
class LlamaCppPeer:
    """llama.cpp's tools: `llama-simple` plain, `llama-speculative-simple --spec-type draft-dflash` with the draft."""

    target_gguf: Path
    draft_gguf: Path
    block_size: int
    threads: int = 2
    name: str = "llama.cpp"

    @property
    def weights(self) -> str:
        return self.target_gguf.name

    def plain(self, prompts: Sequence[BenchmarkPrompt], tokenizer, max_new_tokens: int) -> list[EngineRun]:
        texts = rendered_texts(prompts, tokenizer)
        return [llama_cpp.run_plain(self.target_gguf, text, max_new_tokens=max_new_tokens) for text in texts]

    def dflash(self, prompts: Sequence[BenchmarkPrompt], tokenizer, max_new_tokens: int) -> list[EngineRun]:
        return [
            llama_cpp.run_speculative(
                self.target_gguf,
                text,
                max_new_tokens=max_new_tokens,
                draft_tokens=self.block_size - 1,
                draft_gguf=self.draft_gguf,
                threads=self.threads,
            )
            for text in rendered_texts(prompts, tokenizer)
        ]


@dataclass(frozen=True)
class OpenVinoPeer:
    """OpenVINO GenAI's `LLMPipeline` on an `export_openvino` folder (fp32 IR, KV cache in f32), plain and with the
    drafter (`num_assistant_tokens = block_size - 1`), all prompts in one process."""

    ir: Path
    block_size: int
    threads: int = 2
    name: str = "openvino"
    weights: str = "IR fp32, KV cache f32"

    def plain(self, prompts: Sequence[BenchmarkPrompt], tokenizer, max_new_tokens: int) -> list[EngineRun]:
        return self._run(prompts, max_new_tokens, with_draft=False)

    def dflash(self, prompts: Sequence[BenchmarkPrompt], tokenizer, max_new_tokens: int) -> list[EngineRun]:
        return self._run(prompts, max_new_tokens, with_draft=True)

    def _run(self, prompts: Sequence[BenchmarkPrompt], max_new_tokens: int, with_draft: bool) -> list[EngineRun]:
        runs = openvino.run_openvino(
            self.ir,
            [prompt.input_ids.tolist() for prompt in prompts],
            max_new_tokens=max_new_tokens,
            with_draft=with_draft,
            block_size=self.block_size,
            properties=OPENVINO_PROPERTIES,
            threads=self.threads,
        )
        return [
            EngineRun(
                text=run.text,
                new_tokens=run.new_tokens,
                tokens_per_s=run.tokens_per_s,
                mean_accepted_length=run.mean_accepted_length if with_draft else None,
                draft_passes=run.drafted_steps if with_draft else None,
            )
            for run in runs
        ]


def rendered_texts(prompts: Sequence[BenchmarkPrompt], tokenizer) -> list[str]:
    """The prompts as text with their special tokens (the chat template as rendered), for engines that tokenize."""
    return [tokenizer.decode(prompt.input_ids, skip_special_tokens=False) for prompt in prompts]


def llama_cpp_peer(
    draft: PreTrainedModel, target: PreTrainedModel, target_gguf: str | os.PathLike, folder: str | os.PathLike
) -> LlamaCppPeer:
    """Export `draft` to a GGUF in `folder` (llama.cpp's converter, reduced vocabulary kept) for the target whose
    transformers folder `target` was loaded from and whose GGUF is `target_gguf`."""
    target_folder = _target_folder(target, "llama.cpp's converter")
    draft_gguf = llama_cpp.export_draft_gguf(draft, target, target_folder, target_gguf, Path(folder) / "draft.gguf")
    return LlamaCppPeer(Path(target_gguf), Path(draft_gguf), draft.config.block_size)


def _target_folder(target: PreTrainedModel, reader: str) -> Path:
    """The local folder `target` was loaded from, which an engine's exporter reads."""
    folder = Path(target.config.name_or_path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{reader} reads the target's own folder, and {target.config.name_or_path!r} is none: load the target "
            "from a local folder (or a packaged target) to compare with that engine."
        )
    return folder


def openvino_peer(draft: PreTrainedModel, target: PreTrainedModel, folder: str | os.PathLike) -> OpenVinoPeer:
    """Export target and drafter to OpenVINO IR (fp32) in `folder/openvino` from the target's own folder."""
    ir = openvino.export_openvino(draft, _target_folder(target, "OpenVINO's exporter"), Path(folder) / "openvino")
    return OpenVinoPeer(ir, draft.config.block_size)


def measure_peers(
    engines: Sequence[PeerEngine],
    prompts: Sequence[BenchmarkPrompt],
    tokenizer,
    max_new_tokens: int,
) -> list[PeerRow]:
    """Every prompt through each engine plain and with DFlash; one `PeerRow` per engine, mode and dataset."""
    rows = []
    for engine in engines:
        plain = engine.plain(prompts, tokenizer, max_new_tokens)
        dflash = engine.dflash(prompts, tokenizer, max_new_tokens)
        if not len(plain) == len(dflash) == len(prompts):
            raise RuntimeError(f"{engine.name} answered {len(plain)} / {len(dflash)} runs for {len(prompts)} prompts.")
        by_dataset: dict[str, list[tuple[EngineRun, EngineRun]]] = defaultdict(list)
        for prompt, pair in zip(prompts, zip(plain, dflash)):
            by_dataset[prompt.dataset].append(pair)
        for dataset, pairs in by_dataset.items():
            rows += peer_rows(engine.name, engine.weights, dataset, pairs)
        logger.info(f"{engine.name}: {len(prompts)} prompts plain and with DFlash")
    return rows


def peer_rows(engine: str, weights: str, dataset: str, pairs: list[tuple[EngineRun, EngineRun]]) -> list[PeerRow]:
    """The plain and DFlash rows of one engine on one dataset from its (plain, DFlash) run per prompt."""
    plain, dflash = zip(*pairs)
    committed = sum(run.mean_accepted_length * run.draft_passes for run in dflash)
    common = {"engine": engine, "weights": weights, "dataset": dataset, "prompts": len(pairs)}
    return [
        PeerRow(mode="plain", tokens_per_s=statistics.median(r.tokens_per_s for r in plain), **common),
        PeerRow(
            mode="dflash",
            tokens_per_s=statistics.median(r.tokens_per_s for r in dflash),
            mean_accepted_length=round(committed / sum(run.draft_passes for run in dflash), 3),
            agrees_with_plain=sum(llama_cpp.texts_agree(p.text, d.text) for p, d in pairs),
            **common,
        ),
    ]


def build_peers(
    names: Sequence[str], draft: PreTrainedModel, target: PreTrainedModel, target_gguf: str | os.PathLike | None
) -> tuple[list[PeerEngine], tempfile.TemporaryDirectory]:
    """The engines named (`PEER_ENGINES`), with what they read exported into a temporary folder (returned, so the
    caller decides when it goes)."""
    unknown = [name for name in names if name not in PEER_ENGINES]
    if unknown:
        raise ValueError(f"Unknown peer engine(s) {unknown}; choose from {list(PEER_ENGINES)}.")
    if "llama.cpp" in names and target_gguf is None:
        raise ValueError("The llama.cpp peer runs the target's GGUF: pass it (--peer_target_gguf FILE).")
    folder = tempfile.TemporaryDirectory(prefix="hf-dflash-peers-")
    try:
        engines = []
        if "llama.cpp" in names:
            engines.append(llama_cpp_peer(draft, target, target_gguf, folder.name))
        if "openvino" in names:
            engines.append(openvino_peer(draft, target, folder.name))
    except BaseException:
        folder.cleanup()  # a failed export leaves nothing behind
        raise
    return engines, folder


__all__ = [
    "LlamaCppPeer",
    "OpenVinoPeer",
    "PeerEngine",
    "build_peers",
    "llama_cpp_peer",
    "measure_peers",
    "openvino_peer",
    "peer_rows",
    "rendered_texts",
]
