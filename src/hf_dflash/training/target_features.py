"""What the frozen target gives the trainer, computed once per training set (`cache_target_features`).

For each training sequence: the draft's context features `[T, n*H]` and, for distillation (`distill_top_k`), the
target's `k` largest logits over the draft vocabulary with their draft-vocabulary indices `[T, k]`. Kept in memory
(on the CPU) and, with `target_features_dir`, on disk: one safetensors file per sequence, named by a digest of its
token ids, in a folder named by a digest of everything else the values depend on (the target's weights, the tapped
layers, `k`, the draft vocabulary and the stored dtype). A later run on the same target (another variant of an
ablation, the next stage of a recipe, whose data holds the previous stage's) runs the target only on the sequences it
has not seen, and a changed target or setting never matches.

Features take `n * H` values per token (11.5 KB in fp32 for SmolLM2's five tapped layers): 20,000 sequences of 400
tokens would need 92 GB. `storage="disk"` keeps only the file paths in memory and reads each batch's rows from disk;
`dtype=torch.float16` halves memory and disk (features are read back as fp32; fp16 keeps 11 bits of mantissa where
bf16 keeps 8, and its range holds the hidden states of the targets tried, checked when stored).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel
from transformers.utils import logging

from hf_dflash.adapters import draft_fingerprint
from hf_dflash.atomic_files import atomic_path
from hf_dflash.model.generation_dflash import context_features
from hf_dflash.model.modeling_dflash import DFlashForDrafting

logger = logging.get_logger(__name__)


STORAGES = ("memory", "disk")
FEATURE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class TargetCache:
    """Per training sequence i: `features[i]` `[T_i, n*H]`, and `top_logits[i]` / `top_ids[i]` `[T_i, k]` (the
    target's k largest logits over the draft vocabulary and their indices in it) when cached for distillation.

    With `files`, nothing but the paths is held: row i's values are read from `files[i]` when a batch asks for them.
    """

    features: list[torch.Tensor]
    top_logits: list[torch.Tensor] | None = None
    top_ids: list[torch.Tensor] | None = None
    files: list[Path] | None = None

    def append(self, entry: dict[str, torch.Tensor], path: Path | None = None) -> None:
        """Add one sequence: its file's path if this cache reads from disk, else its `features` (and `top_logits` /
        `top_ids` when this cache holds logits)."""
        if self.files is not None:
            self.files.append(path)
            return
        self.features.append(entry["features"])
        if self.top_logits is not None and self.top_ids is not None:
            self.top_logits.append(entry["top_logits"])
            self.top_ids.append(entry["top_ids"])

    def __len__(self) -> int:
        return len(self.files) if self.files is not None else len(self.features)

    def batch_features(self, rows: list[int], seq_len: int, device: torch.device) -> torch.Tensor:
        """`[b, T, n*H]` fp32 features of the batch's rows, zero-padded on the right like the tokens."""
        return _padded([self._row(row, "features", seq_len).float() for row in rows], device)

    def batch_top_logits(
        self, rows: list[int], seq_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[b, T, k]` top-k logits and draft-vocabulary indices of the batch's rows (padding: zeros)."""
        if self.top_logits is None or self.top_ids is None:
            raise ValueError("This cache holds no target logits: build it with top_k > 0 (distill_top_k).")
        logits = _padded([self._row(row, "top_logits", seq_len) for row in rows], device)
        return logits, _padded([self._row(row, "top_ids", seq_len) for row in rows], device)

    def _row(self, row: int, name: str, seq_len: int) -> torch.Tensor:
        if self.files is None:
            return getattr(self, name)[row][:seq_len]
        with safe_open(str(self.files[row]), "pt") as file:
            return file.get_slice(name)[:seq_len]


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
    storage: str = "memory",
    dtype: torch.dtype = torch.float32,
) -> TargetCache:
    """One target forward per training sequence, except for the sequences `folder` already holds for this target and
    setting, which are read instead (new ones are written there). Features are stored in `dtype` (float32 or
    float16); `storage="disk"` (which needs `folder`) keeps only the files' paths in memory."""
    from tqdm.auto import tqdm

    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}.")
    if storage == "disk" and folder is None:
        raise ValueError("storage='disk' reads the features from their files: pass the folder (target_features_dir).")
    if dtype not in FEATURE_DTYPES.values():
        raise ValueError(f"features are stored as one of {list(FEATURE_DTYPES)}, got {dtype}.")
    store = None if folder is None else Path(folder) / settings_key(target, draft, top_k, dtype)
    if folder is not None and any(Path(folder).glob("target-cache-*.safetensors")):
        logger.warning(
            f"{folder} holds target-cache-*.safetensors files of an earlier hf-dflash (one file per training set), "
            "which this version does not read: it keeps one file per sequence. Delete them to free the space."
        )
    cache = TargetCache(
        features=[],
        top_logits=[] if top_k else None,
        top_ids=[] if top_k else None,
        files=[] if storage == "disk" else None,
    )
    num_read = 0
    for input_ids in tqdm(dataset["input_ids"], desc="caching target features"):
        input_ids = list(input_ids[:max_length])
        path = None if store is None else store / f"{sequence_key(input_ids)}.safetensors"
        if path is not None and path.is_file():
            num_read += 1
            entry = None if storage == "disk" else load_file(str(path))
        else:
            entry = _target_entry(target, input_ids, draft, top_k, dtype)
            if path is not None:
                _write(entry, path)
        cache.append(entry, path)
    if store is not None:
        logger.info(f"Target features: read {num_read} of {len(cache)} sequences from {store}.")
    return cache


@torch.no_grad()
def target_forward(
    target: PreTrainedModel, batch: dict[str, torch.Tensor], layer_ids: list[int], want_logits: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[b, T, n*H]` draft context features of every position, and `[b, T, V]` target logits if `want_logits`."""
    out = target(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        output_hidden_states=[i + 1 for i in layer_ids],
        use_cache=False,
        **({} if want_logits else {"logits_to_keep": 1}),
    )
    features = context_features(out.hidden_states, layer_ids, batch["input_ids"].shape[1])
    return features, (out.logits if want_logits else None)


def _target_entry(
    target: PreTrainedModel, input_ids: list[int], draft: DFlashForDrafting, top_k: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One sequence's `{"features": [T, n*H]}` in `dtype`, with `top_logits` / `top_ids` `[T, k]` when `top_k`."""

    ids = torch.tensor(input_ids, device=target.device)[None]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    features, logits = target_forward(target, batch, list(draft.config.target_layer_ids), want_logits=top_k > 0)
    entry = {"features": _stored(features[0].float().cpu(), dtype)}
    if top_k:
        values, indices = top_k_over_draft_vocabulary(logits[0], draft.draft_token_ids, top_k)
        entry |= {"top_logits": values.cpu(), "top_ids": indices.cpu()}
    return entry


def _stored(features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`features` in `dtype`; refused when a value does not fit it (fp16 overflows past 65,504)."""
    if dtype == torch.float32:
        return features
    largest = features.abs().max().item()
    if largest > torch.finfo(dtype).max:
        raise ValueError(
            f"A target feature reaches {largest:.4g}, beyond {dtype}'s range: store the features as float32."
        )
    return features.to(dtype)


def settings_key(
    target: PreTrainedModel, draft: DFlashForDrafting, top_k: int, dtype: torch.dtype = torch.float32
) -> str:
    """A digest of everything but the tokens that the cached values depend on."""
    vocabulary = draft.draft_token_ids
    settings = {
        "target_weights": draft_fingerprint(target),  # bf16-rounded digest of every weight: an adapter changes it
        "target_layer_ids": list(draft.config.target_layer_ids),
        "top_k": top_k,
        "draft_vocabulary": None if vocabulary is None or not top_k else vocabulary.tolist(),
    }
    if dtype != torch.float32:  # fp32 folders keep the names they had before the dtype was a setting
        settings["features_dtype"] = str(dtype)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]


def sequence_key(input_ids: list[int]) -> str:
    """A digest of one sequence's token ids (as truncated to `max_length`: the target is causal, so they are all
    its features depend on)."""
    return hashlib.sha256(json.dumps(input_ids).encode()).hexdigest()[:24]


def _write(entry: dict[str, torch.Tensor], path: Path) -> None:
    """One sequence's file, written next to its final name and renamed: a killed run leaves no partial file."""
    with atomic_path(path) as tmp:
        save_file({name: tensor.contiguous() for name, tensor in entry.items()}, str(tmp))


__all__ = [
    "FEATURE_DTYPES",
    "STORAGES",
    "TargetCache",
    "build_target_cache",
    "sequence_key",
    "settings_key",
    "target_forward",
    "top_k_over_draft_vocabulary",
]
