"""What the frozen target gives the trainer, computed once per training set (`cache_target_features`).

For each training sequence: the draft's context features `[T, n*H]` and, for distillation (`distill_top_k`), the
target's `k` largest logits over the draft vocabulary with their draft-vocabulary indices `[T, k]`. Kept in memory
(fp32, on the CPU) and, with `target_features_dir`, in one safetensors file there whose name is a digest of
everything the values depend on (the target's weights, tapped layers, `max_length`, `k`, the draft vocabulary and the
token ids of every sequence): a later run on the same target and data (another variant of an ablation, the next
stage of a recipe) reads it instead of running the target again, and a changed target or data never matches it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.utils import logging

from .adapters import draft_fingerprint
from .atomic_files import atomic_path
from .modeling_dflash import DFlashForDrafting

logger = logging.get_logger(__name__)


@dataclass
class TargetCache:
    """Per training sequence i: `features[i]` `[T_i, n*H]`, and `top_logits[i]` / `top_ids[i]` `[T_i, k]` (the
    target's k largest logits over the draft vocabulary and their indices in it) when cached for distillation."""

    features: list[torch.Tensor]
    top_logits: list[torch.Tensor] | None = None
    top_ids: list[torch.Tensor] | None = None

    def batch_features(self, rows: list[int], seq_len: int, device: torch.device) -> torch.Tensor:
        """`[b, T, n*H]` features of the batch's rows, zero-padded on the right like the tokens."""
        return _padded([self.features[row][:seq_len] for row in rows], device)

    def batch_top_logits(
        self, rows: list[int], seq_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[b, T, k]` top-k logits and draft-vocabulary indices of the batch's rows (padding: zeros)."""
        if self.top_logits is None or self.top_ids is None:
            raise ValueError("This cache holds no target logits: build it with top_k > 0 (distill_top_k).")
        logits = _padded([self.top_logits[row][:seq_len] for row in rows], device)
        return logits, _padded([self.top_ids[row][:seq_len] for row in rows], device)


def _padded(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True).to(device)


def top_k_over_draft_vocabulary(
    logits: torch.Tensor, draft_token_ids: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., V]` target logits -> the `k` largest over the draft vocabulary (`[..., k]` fp32) and their indices in
    that vocabulary (`[..., k]`), the draft's label space."""
    if draft_token_ids is not None:
        logits = logits[..., draft_token_ids.to(logits.device)]
    values, indices = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
    return values, indices


@torch.no_grad()
def build_target_cache(
    target: PreTrainedModel,
    dataset: Any,
    draft: DFlashForDrafting,
    max_length: int,
    top_k: int = 0,
    folder: str | os.PathLike | None = None,
) -> TargetCache:
    """One target forward per training sequence (or none, when `folder` already holds this exact cache)."""
    from tqdm.auto import tqdm

    from .trainer import target_forward  # the training forward's own feature extraction

    path = None
    if folder is not None:
        path = Path(folder) / f"target-cache-{cache_key(target, dataset, draft, max_length, top_k)}.safetensors"
        if path.is_file():
            logger.info(f"Reading the target's features from {path}.")
            return _read(path, len(dataset), top_k > 0)
    layer_ids = list(draft.config.target_layer_ids)
    cache = TargetCache(features=[], top_logits=[] if top_k else None, top_ids=[] if top_k else None)
    for input_ids in tqdm(dataset["input_ids"], desc="caching target features"):
        ids = torch.tensor(input_ids[:max_length], device=target.device)[None]
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        features, logits = target_forward(target, batch, layer_ids, want_logits=top_k > 0)
        cache.features.append(features[0].float().cpu())
        if top_k:
            values, indices = top_k_over_draft_vocabulary(logits[0], draft.draft_token_ids, top_k)
            cache.top_logits.append(values.cpu())
            cache.top_ids.append(indices.cpu())
    if path is not None:
        _write(cache, path)
    return cache


def cache_key(target: PreTrainedModel, dataset: Any, draft: DFlashForDrafting, max_length: int, top_k: int) -> str:
    """A digest of everything the cached values depend on."""
    digest = hashlib.sha256()
    vocabulary = draft.draft_token_ids
    settings = {
        "target_weights": draft_fingerprint(target),  # bf16-rounded digest of every weight: an adapter changes it
        "target_layer_ids": list(draft.config.target_layer_ids),
        "max_length": max_length,
        "top_k": top_k,
        "draft_vocabulary": None if vocabulary is None or not top_k else vocabulary.tolist(),
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for input_ids in dataset["input_ids"]:
        digest.update(json.dumps(input_ids[:max_length]).encode())
    return digest.hexdigest()[:20]


def _write(cache: TargetCache, path: Path) -> None:
    """One safetensors file, written next to its final name and renamed: a killed run leaves no partial cache."""
    tensors = {f"features.{i}": tensor for i, tensor in enumerate(cache.features)}
    if cache.top_logits is not None:
        tensors |= {f"top_logits.{i}": tensor for i, tensor in enumerate(cache.top_logits)}
        tensors |= {f"top_ids.{i}": tensor for i, tensor in enumerate(cache.top_ids)}
    with atomic_path(path) as tmp:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(tmp))
    logger.info(f"Kept the target's features in {path}.")


def _read(path: Path, num_rows: int, with_logits: bool) -> TargetCache:
    tensors = load_file(str(path))

    def column(name: str) -> list[torch.Tensor]:
        return [tensors[f"{name}.{i}"] for i in range(num_rows)]

    if not with_logits:
        return TargetCache(features=column("features"))
    return TargetCache(features=column("features"), top_logits=column("top_logits"), top_ids=column("top_ids"))


__all__ = ["TargetCache", "build_target_cache", "cache_key", "top_k_over_draft_vocabulary"]
