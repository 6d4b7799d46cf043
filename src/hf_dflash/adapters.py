"""LoRA adapters on a DFlash drafter: adapt a base drafter to a fine-tuned target instead of training a new one.

A fine-tuned target says other things than its base, so the base's drafter accepts less. A LoRA on the drafter's
own layers (attention and MLP projections; the drafter has no embedding or LM head, those are the target's) warm-
starts from the base drafter, keeps its reduced-vocabulary map (``d2t`` is a buffer of the base, never trained) and
trains a small fraction of its weights (``DFlashTrainer(..., peft_config=LoraConfig(...))``).

An adapter folder is what PEFT writes (``adapter_config.json``, ``adapter_model.safetensors``) plus
``dflash_adapter.json``: the base drafter's name, its config and a fingerprint of its weights. Loading
(``load_draft_adapter``) checks the fingerprint, so an adapter is never applied silently to a drafter it was not
trained on; ``merge_and_unload()`` of the result is a plain ``DFlashForDrafting`` that exports to the z-lab layout.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging

from hf_dflash.model.configuration_dflash import DFlashConfig
from hf_dflash.model.modeling_dflash import DFlashForDrafting

from .atomic_files import write_text_atomic

logger = logging.get_logger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's
BASE_DRAFTER_FILE = "dflash_adapter.json"  # ours: which drafter the adapter was trained on
# The projections of every draft layer; `fc` (the context projection) and the norms stay the base's by default.
DRAFT_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (peft is imported on first use, not with the package)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a local folder holding a PEFT adapter (``adapter_config.json``)."""
    return (Path(path).expanduser() / ADAPTER_CONFIG_FILE).is_file()


def draft_fingerprint(draft: DFlashForDrafting) -> str:
    """A SHA-256 of the drafter's weights and buffers, rounded to bfloat16 so the same checkpoint loaded in float32 or
    bfloat16 gives the same fingerprint."""
    digest = hashlib.sha256()
    for name, tensor in sorted(draft.state_dict().items()):
        digest.update(name.encode())
        value = tensor.detach().cpu()
        value = value.to(torch.bfloat16).view(torch.int16) if value.is_floating_point() else value
        digest.update(value.contiguous().numpy().tobytes())
    return digest.hexdigest()


def add_draft_adapter(draft: DFlashForDrafting, peft_config: Any):
    """``draft`` wrapped by PEFT with ``peft_config`` (a ``peft.PeftConfig``, e.g. ``LoraConfig(r=16)``); without
    ``target_modules`` the LoRA goes on every draft layer's projections (``DRAFT_LORA_MODULES``)."""
    from peft import get_peft_model

    if is_peft_model(draft):
        raise ValueError(
            "peft_config was given but the drafter is already a PeftModel: pass the PeftModel alone to train its "
            "adapter, or merge it first (draft = draft.merge_and_unload()) to put a new adapter on the merged drafter."
        )
    if not isinstance(draft, DFlashForDrafting):
        raise TypeError(f"A draft adapter goes on a DFlashForDrafting, not a {type(draft).__name__}.")
    if peft_config.task_type is not None:
        raise ValueError(
            f"peft_config.task_type is {peft_config.task_type!r}; a drafter is no causal LM of its own (it has no head "
            "and takes no input_ids): leave task_type unset."
        )
    config = copy.deepcopy(peft_config)
    if config.target_modules is None:
        config.target_modules = list(DRAFT_LORA_MODULES)
    return get_peft_model(draft, config)


def base_drafter_record(model: Any) -> dict:
    """``{name_or_path, fingerprint, config}`` of the drafter under an adapter (``model`` a PeftModel on a drafter, or
    the plain drafter an adapter is about to go on): what ``dflash_adapter.json`` holds."""
    base = (
        copy.deepcopy(model).unload() if is_peft_model(model) else model
    )  # LoRA layers out, base weights as they were
    return {
        "name_or_path": base.config._name_or_path or None,
        "fingerprint": draft_fingerprint(base),
        "config": base.config.to_dict(),
    }


def save_base_drafter_record(record: dict, folder: str | os.PathLike) -> Path:
    """Write ``record`` (``base_drafter_record``) as ``dflash_adapter.json`` next to a saved adapter."""
    return write_text_atomic(
        Path(folder) / BASE_DRAFTER_FILE, json.dumps(record, indent=2, sort_keys=True, default=str) + "\n"
    )


def read_base_drafter_record(folder: str | os.PathLike) -> dict:
    """The ``dflash_adapter.json`` of an adapter folder; raises if the folder has none (not an hf-dflash adapter)."""
    path = Path(folder).expanduser() / BASE_DRAFTER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no {BASE_DRAFTER_FILE}: it is not a drafter adapter written by DFlashTrainer, so nothing "
            "says which drafter it belongs to. Load it with PeftModel.from_pretrained(base_draft, folder) yourself."
        )
    return json.loads(path.read_text())


def base_drafter_config(folder: str | os.PathLike) -> DFlashConfig:
    """The config of the drafter an adapter folder was trained on."""
    return DFlashConfig(**read_base_drafter_record(folder)["config"])


def load_draft_adapter(base_draft: DFlashForDrafting, adapter: str | os.PathLike, *, merge: bool = False):
    """``base_draft`` with the drafter adapter ``adapter`` (a folder written by ``DFlashTrainer``), for inference.

    Raises ``ValueError`` when ``base_draft`` is not the drafter the adapter was trained on (its weights' fingerprint
    differs). Returns a ``PeftModel``, or the merged ``DFlashForDrafting`` when ``merge``.
    """
    from peft import PeftModel

    record = read_base_drafter_record(adapter)
    if draft_fingerprint(base_draft) != record["fingerprint"]:
        raise ValueError(
            f"Adapter {adapter} was trained on the drafter {record.get('name_or_path')!r}, and the drafter given "
            f"({base_draft.config._name_or_path or 'in memory'}) has other weights. Load the adapter onto that "
            "drafter (hf_dflash.loading.load_draft(adapter, target, base_draft=...))."
        )
    model = PeftModel.from_pretrained(base_draft, str(adapter), is_trainable=False).eval()
    return model.merge_and_unload().eval() if merge else model


def verify_saved_adapter(model: Any, folder: str | os.PathLike) -> None:
    """Reload the adapter weights saved in ``folder`` and check they equal ``model``'s trainable adapter weights."""
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    saved = load_peft_weights(str(folder), device="cpu")
    expected = get_peft_model_state_dict(model)
    if saved.keys() != expected.keys():
        raise RuntimeError(f"{folder}: saved adapter weights {sorted(saved)} differ from {sorted(expected)}.")
    for name, tensor in expected.items():
        if not torch.equal(saved[name], tensor.detach().cpu().to(saved[name].dtype)):
            raise RuntimeError(
                f"{folder}: adapter weight {name} changed on save/reload; the adapter is not trustworthy."
            )


__all__ = [
    "DRAFT_LORA_MODULES",
    "add_draft_adapter",
    "base_drafter_record",
    "base_drafter_config",
    "draft_fingerprint",
    "is_adapter_folder",
    "is_peft_model",
    "load_draft_adapter",
    "read_base_drafter_record",
    "save_base_drafter_record",
    "verify_saved_adapter",
]
