"""Checkpoint layouts of a DFlash drafter: which one a `config.json` is in, and the published z-lab layout written out.

Three layouts are read: hf-dflash's own (`model_type: "dflash"`, flat fields, remote code), z-lab's (`model_type:
"qwen3"`, `architectures: ["DFlashDraftModel"]` or `["DFlash2DraftModel"]`, a nested `dflash_config`; what vLLM,
SGLang and llama.cpp's converter read) and transformers' native assistant (`muse_glimmer_assistant`). Weight names are
shared by all three (the native one after `NATIVE_KEY_MAPPING`). Folders are written atomically.

This file is copied next to the weights by `save_pretrained`; it imports only torch, transformers, the standard
library and its sibling `configuration_dflash.py`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .configuration_dflash import DFLASH2_FIELDS, DFlashConfig
from .selector_dflash import reindex_rows

logger = logging.get_logger(__name__)

ZLAB_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
NATIVE_MODEL_TYPE = "muse_glimmer_assistant"
# transformers' native assistant calls the context projection `encoder.{fc,output_norm_enc}`.
NATIVE_KEY_MAPPING = {r"^encoder\.fc\.": "fc.", r"^encoder\.output_norm_enc\.": "hidden_norm."}
WEIGHT_FILE_PREFIXES = ("model.safetensors", "model-", "pytorch_model")
SELECTOR_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


class DFlashLayouts:
    """Names of the checkpoint layouts `DFlashForDrafting` reads and writes."""

    HF = "hf-dflash"  # model_type "dflash", flat DFlash fields, auto_map for trust_remote_code
    ZLAB = "z-lab"  # model_type "qwen3", architectures ["DFlashDraftModel"] or ["DFlash2DraftModel"], nested
    # dflash_config (vLLM, SGLang)
    NATIVE = "transformers-native"  # model_type "muse_glimmer_assistant" (read only)


def detect_layout(config_dict: dict) -> str:
    """Which layout a raw `config.json` dict is in."""
    if config_dict.get("model_type") == NATIVE_MODEL_TYPE:
        return DFlashLayouts.NATIVE
    if "dflash_config" in config_dict or set(ZLAB_ARCHITECTURES.values()) & set(
        config_dict.get("architectures") or []
    ):
        return DFlashLayouts.ZLAB
    return DFlashLayouts.HF


def config_dict_from_layout(config_dict: dict, layout: str) -> dict:
    """A z-lab or transformers-native `config.json` dict -> `DFlashConfig` keyword arguments (a copy)."""
    config_dict = dict(config_dict)
    if layout == DFlashLayouts.NATIVE and config_dict.get("sliding_window"):
        config_dict["sliding_window"] += 1  # native masks keep |q - k| <= w, ours (Qwen3's) q - k < w
    if ZLAB_ARCHITECTURES["dflash2"] in (config_dict.get("architectures") or []):
        config_dict["variant"] = "dflash2"
    for name in ("model_type", "architectures", "auto_map", "transformers_version"):
        config_dict.pop(name, None)
    return config_dict


def zlab_config_dict(config: DFlashConfig, full_vocabulary: bool = False) -> dict:
    """The `config.json` that vLLM, SGLang and llama.cpp's converter read: Qwen3 fields, top-level `block_size`, a
    nested `dflash_config`, and causality spelled out the way vLLM resolves it.

    `full_vocabulary=True` leaves out `draft_vocab_size` (the engines then draft over the target's whole head). A
    DFlash2 drafter is `DFlash2DraftModel`, its fields (and `block_size`) in `dflash_config` as the published ones.
    """
    config_dict = config.to_dict()
    nested = ("mask_token_id", "target_layer_ids", "input_embedding_scale", "causal_sliding_attention")
    for name in ("auto_map", "_name_or_path", "transformers_version", "variant", *nested, *DFLASH2_FIELDS):
        config_dict.pop(name, None)
    if full_vocabulary:
        config_dict.pop("draft_vocab_size", None)
    config_dict["model_type"] = "qwen3"
    config_dict["architectures"] = [ZLAB_ARCHITECTURES[config.variant]]
    config_dict["rope_theta"] = config.rope_parameters.get("rope_theta")  # engines predating rope_parameters
    config_dict["dflash_config"] = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": config.target_layer_ids,
        "input_embedding_scale": config.input_embedding_scale,
    }
    if config.variant == "dflash2":
        config_dict["dflash_config"] |= {"block_size": config.block_size, "sample_from_anchor": False}
        config_dict["dflash_config"] |= {name: getattr(config, name) for name in DFLASH2_FIELDS}
    if not config.causal_sliding_attention:
        # vLLM: top-level `is_causal`, then `dflash_config.causal`, else `sliding_attention` layers run causally.
        # A causal-sliding drafter writes neither, so that rule gives causal sliding and bidirectional full layers.
        config_dict["is_causal"] = False
        config_dict["dflash_config"]["causal"] = False
    if "sliding_attention" in config.layer_types:
        config_dict["use_sliding_window"] = True  # or transformers' Qwen3Config drops `sliding_window`
    return config_dict


def zlab_state_dict(draft: Any, target: PreTrainedModel | None, full_vocabulary: bool) -> dict:
    """The drafter's weights in the z-lab layout (CPU, contiguous).

    A reduced draft vocabulary is written as vLLM reads one: `d2t` and the draft's own head `lm_head.weight`
    (`[draft_vocab_size, H]`, the target head's rows of the draft ids). Without that head vLLM would share the target's
    full head and misplace its logits. `full_vocabulary=True` writes neither, so engines share the target's head; a
    DFlash2 drafter's codebooks are then written over the whole vocabulary (`[V, R]`, zero rows outside the draft
    vocabulary: such a token adds no pairwise score, as in the drafter).
    """
    state_dict = {name: tensor.detach().cpu().contiguous() for name, tensor in draft.state_dict().items()}
    if draft.config.draft_vocab_size is None:
        return state_dict
    if full_vocabulary:
        del state_dict["d2t"]
        for name in SELECTOR_CODEBOOKS:
            if name in state_dict:
                state_dict[name] = codebook_over_vocabulary(
                    state_dict[name], draft.draft_token_ids.cpu(), draft.config
                )
        return state_dict
    if target is None:
        raise ValueError(
            f"This drafter proposes from a reduced vocabulary ({draft.config.draft_vocab_size} tokens), which vLLM reads "
            "only with the draft's own LM head: pass `target=` (its head's rows are written as `lm_head.weight`), or "
            "`full_vocabulary=True` to export for readers that draft over the whole vocabulary (SGLang, llama.cpp)."
        )
    head = target.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            "The target's LM head has a bias, which the engines' draft head cannot hold; export with "
            "`full_vocabulary=True` so that they share the target's head."
        )
    if head.weight.shape[1] != draft.config.hidden_size:
        raise ValueError(
            f"The target's LM head is {tuple(head.weight.shape)}, not [vocab, {draft.config.hidden_size}]: pass the "
            "target this drafter was built for."
        )
    token_ids = draft.draft_token_ids.to(head.weight.device)
    state_dict["lm_head.weight"] = head.weight.detach()[token_ids].to(draft.dtype).cpu().contiguous()
    return state_dict


def codebook_over_vocabulary(
    codebook: torch.Tensor, draft_token_ids: torch.Tensor, config: DFlashConfig
) -> torch.Tensor:
    """`[V_d, R]` codebook rows of the draft ids -> `[V, R]` indexed by target id, zero elsewhere."""
    every_token = torch.arange(config.vocab_size, device=codebook.device)
    return reindex_rows(codebook, draft_token_ids.to(codebook.device), every_token).contiguous()


def warn_about_zlab_readers(config: DFlashConfig, full_vocabulary: bool) -> None:
    """Say which serving engine reads this export differently from how the drafter was trained."""
    if config.variant == "dflash2" and config.draft_vocab_size is not None and not full_vocabulary:
        logger.warning(
            f"z-lab DFlash2 export with a reduced draft vocabulary ({config.draft_vocab_size} tokens): the selector's "
            "codebooks are written over the draft ids, which only hf-dflash reads; the DFlash2 engines index them by "
            "target token id. Export with `full_vocabulary=True` for vLLM and SGLang; `hf-dflash export --engine "
            "llama.cpp` rewrites them by target id."
        )
    if config.draft_vocab_size is not None and not full_vocabulary:
        logger.warning(
            f"z-lab export with a reduced draft vocabulary ({config.draft_vocab_size} tokens, `lm_head.weight` + "
            "`d2t`): vLLM drafts over it as trained; SGLang ignores both and drafts over the target's whole head; "
            "the authors' reference model takes no `d2t` (export with `full_vocabulary=True` for it), and llama.cpp "
            "maps it only through `hf-dflash export --engine llama.cpp`."
        )
    if "sliding_attention" in config.layer_types and not config.causal_sliding_attention:
        logger.warning(
            "This drafter's sliding-window layers attend bidirectionally inside the block. vLLM reads `is_causal: "
            "false`; SGLang runs `sliding_attention` draft layers causally whatever the config says, so its "
            "acceptance will be lower than measured here."
        )
    if config.input_embedding_scale not in (None, 1.0):
        logger.warning(
            f"The target scales its embedding rows by {config.input_embedding_scale:g}; the export records it as "
            "`dflash_config.input_embedding_scale`, which DFlash v1 readers (vLLM's and SGLang's DFlash) ignore: "
            "they embed the block with the raw rows, so acceptance there will be lower than measured here."
        )


def write_folder_atomically(save_directory: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run `write(tmp_dir)` then move its files into `save_directory`; a failure leaves nothing half-written."""
    target = Path(save_directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        target.mkdir(exist_ok=True)
        written = {path.name for path in tmp.iterdir()}
        for stale in target.iterdir():  # weights of an earlier save would shadow or mix with the new ones
            if stale.name not in written and stale.name.startswith(WEIGHT_FILE_PREFIXES):
                stale.unlink()
        for path in tmp.iterdir():
            os.replace(path, target / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "DFlashLayouts",
    "NATIVE_KEY_MAPPING",
    "ZLAB_ARCHITECTURES",
    "config_dict_from_layout",
    "detect_layout",
    "warn_about_zlab_readers",
    "write_folder_atomically",
    "zlab_config_dict",
    "zlab_state_dict",
]
