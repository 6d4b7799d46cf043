"""Peer rows: the same prompts through a serving engine, plain and with the same drafter, beside our paths.

Design: an engine is a `PeerEngine` (`name`, the `weights` it runs, `plain` and `dflash` on one chat-rendered prompt
text, each returning a `llama_cpp.EngineRun`); `measure_peers` runs every prompt through both modes of every engine
and reduces them per dataset to `PeerRow`s, which the report keeps beside the timed methods (`report.peers`).

What a row measures is the engine's own: its tokens/s is the figure the engine prints for the generation (for
llama.cpp's tools, the decode loop after the prompt is processed), the median over prompts; its mean accepted length
is committed tokens over target steps, over all prompts (tau's definition); `agrees_with_plain` counts prompts where
the engine's DFlash text agrees with its own plain text as far as both go (greedy decoding should change nothing).
Engines run their own weights (llama.cpp: a GGUF), so their text may differ from ours; rows say which weights.
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

from hf_dflash.bench.config import BenchmarkPrompt
from hf_dflash.bench.report import PeerRow
from hf_dflash.engines import llama_cpp
from hf_dflash.engines.llama_cpp import EngineRun

logger = logging.get_logger(__name__)

PEER_ENGINES = ("llama.cpp",)


class PeerEngine(Protocol):
    """A serving engine run on one prompt at a time: plain decoding and DFlash decoding with our drafter."""

    name: str
    weights: str

    def plain(self, prompt: str, max_new_tokens: int) -> EngineRun: ...

    def dflash(self, prompt: str, max_new_tokens: int) -> EngineRun: ...


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

    def plain(self, prompt: str, max_new_tokens: int) -> EngineRun:
        return llama_cpp.run_plain(self.target_gguf, prompt, max_new_tokens=max_new_tokens)

    def dflash(self, prompt: str, max_new_tokens: int) -> EngineRun:
        return llama_cpp.run_speculative(
            self.target_gguf,
            prompt,
            max_new_tokens=max_new_tokens,
            draft_tokens=self.block_size - 1,
            draft_gguf=self.draft_gguf,
            threads=self.threads,
        )


def llama_cpp_peer(
    draft: PreTrainedModel, target: PreTrainedModel, target_gguf: str | os.PathLike, folder: str | os.PathLike
) -> LlamaCppPeer:
    """Export `draft` to a GGUF in `folder` (llama.cpp's converter, reduced vocabulary kept) for the target whose
    transformers folder `target` was loaded from and whose GGUF is `target_gguf`."""
    target_folder = Path(target.config.name_or_path)
    if not (target_folder / "config.json").is_file():
        raise ValueError(
            f"llama.cpp's converter reads the target's own folder, and {target.config.name_or_path!r} is none: load "
            "the target from a local folder (or a packaged target) to compare with llama.cpp."
        )
    draft_gguf = llama_cpp.export_draft_gguf(draft, target, target_folder, target_gguf, Path(folder) / "draft.gguf")
    return LlamaCppPeer(Path(target_gguf), Path(draft_gguf), draft.config.block_size)


def measure_peers(
    engines: Sequence[PeerEngine],
    prompts: Sequence[BenchmarkPrompt],
    tokenizer,
    max_new_tokens: int,
) -> list[PeerRow]:
    """Every prompt (rendered back to text with its special tokens) through each engine plain and with DFlash; one
    `PeerRow` per engine, mode and dataset."""
    rows = []
    for engine in engines:
        runs: dict[str, list[tuple[EngineRun, EngineRun]]] = defaultdict(list)
        for prompt in prompts:
            text = tokenizer.decode(prompt.input_ids, skip_special_tokens=False)
            runs[prompt.dataset].append((engine.plain(text, max_new_tokens), engine.dflash(text, max_new_tokens)))
        for dataset, pairs in runs.items():
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
        engines = [llama_cpp_peer(draft, target, target_gguf, folder.name)] if "llama.cpp" in names else []
    except BaseException:
        folder.cleanup()  # a failed export leaves nothing behind
        raise
    return engines, folder


__all__ = ["LlamaCppPeer", "PEER_ENGINES", "PeerEngine", "build_peers", "llama_cpp_peer", "measure_peers", "peer_rows"]
