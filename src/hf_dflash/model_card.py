"""Model cards for DFlash drafters, rendered from the Jinja template `hub_cards/dflash_drafter.md`.

info = card_info_from_folder("out/qwen3-8b-dflash", base_model="Qwen/Qwen3-8B")   # config.json + training_info.json
write_model_card("out/qwen3-8b-dflash", info)                                      # README.md, shown by the Hub

Every number in a card comes from the drafter's `config.json` or from what the caller measured (`training` and
`acceptance` in `DrafterCardInfo`, usually from the trainer's `training_info.json`). Nothing is filled in from the
paper: without measurements the card says "not measured yet".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from transformers.utils import logging

from hf_dflash.model.configuration_dflash import DFlashConfig
from hf_dflash.model.layouts_dflash import config_dict_from_layout, detect_layout

from .adapters import ADAPTER_CONFIG_FILE, base_drafter_config, is_adapter_folder
from .atomic_files import write_text_atomic

logger = logging.get_logger(__name__)

TEMPLATE = "dflash_drafter.md"
TRAINING_INFO_FILE = "training_info.json"  # written by the trainer next to the weights
ADAPTER_LAYOUT = "lora-adapter"  # a PEFT adapter on a drafter (hf_dflash.adapters), not a drafter of its own
ZLAB_SUBFOLDER = "zlab"  # where a repo in the hf-dflash layout keeps its copy in the z-lab (vLLM/SGLang) layout
DEFAULT_TAGS = ["dflash", "speculative-decoding", "arxiv:2602.06036", "hf-dflash", "draft-model"]

# Labels of the `training` keys the trainer writes, in table order; other keys follow with their name as label.
TRAINING_LABELS = {
    "data": "Training data",
    "data_sources": "Training data",
    "num_sequences": "Sequences",
    "chat_template": "Chat template",
    "max_length": "Max sequence length",
    "anchors_per_sequence": "Anchors per sequence",
    "gamma": "Loss decay gamma",
    "loss_decay_gamma": "Loss decay gamma",
    "steps": "Optimizer steps",
    "epochs": "Epochs",
    "batch_size": "Batch size",
    "learning_rate": "Learning rate",
    "wall_time": "Wall time",
    "wall_time_s": "Wall time",
    "resumed_from_step": "Resumed from step (wall and CPU time count from there)",
    "machine": "Machine",
    "held_out_tau_by_step": "Held-out tau during training",
    "selector_by_step": "DFlash2 selector during training (training batches, per slot: recall@K / accuracy)",
    "trainable_parameters": "Trainable parameters (the adapter)",
    "drafter_parameters": "Frozen parameters (the base drafter)",
}
# `training` keys the trainer also writes that the table already shows from config.json.
CONFIG_TRAINING_KEYS = {"block_size", "num_draft_layers", "target_layer_ids"}


@dataclass
class DrafterCardInfo:
    """What a drafter's model card says. `training` and `acceptance` hold measured facts only.

    `training` keys (all optional): `data` (list of sources), `num_sequences`, `chat_template` (bool),
    `max_length`, `anchors_per_sequence`, `gamma` (loss decay), `steps`, `epochs`, `batch_size`, `learning_rate`,
    `wall_time` (text) or `wall_time_s` (seconds), `resumed_from_step` (the run that wrote the times took over
    there), `machine`, `held_out_tau_by_step` (`[[step, tau], ...]`, what
    the trainer measured on held-out prompts while training); other keys are listed under their own name.
    `acceptance` maps a dataset name to `{"tau": float, "speedup": float | None, "conditions": str}`.
    `engines` maps a serving engine to what running this drafter in it measured: `{"mean_accepted_length",
    "hf_dflash_tau"` (on the same prompts), `"plain_tokens_per_s", "dflash_tokens_per_s", "conditions", "command"}`.
    """

    base_model: str  # the target: a Hub repo id (goes into the metadata) or a name
    block_size: int
    num_hidden_layers: int
    target_layer_ids: list[int]
    mask_token_id: int | None = None
    num_target_layers: int | None = None
    target_name: str | None = None  # human name of the target; default: the repo id's last part
    target_adapter: str | None = None  # the PEFT adapter the target runs with (a fine-tune of base_model)
    base_drafter: str | None = None  # set for a drafter adapter: the drafter it adapts
    adapter: dict[str, Any] = field(default_factory=dict)  # a drafter adapter's settings (r, alpha, modules, bytes)
    drafter_repo_id: str | None = None  # used in the snippets; default "<your-org>/<target>-DFlash-b<B>"
    license: str = "apache-2.0"
    layout: str = "hf-dflash"  # checkpoint layout at the repo root: "hf-dflash" or "z-lab"
    zlab_subfolder: str | None = None  # subfolder holding a z-lab-layout copy (what vLLM and SGLang read)
    # What serving engines must read right (from config.json): the reduced vocabulary, the layers, the embedding scale.
    vocab_size: int | None = None
    draft_vocab_size: int | None = None
    layer_types: list[str] = field(default_factory=list)
    causal_sliding_attention: bool = False
    variant: str = "dflash"  # "dflash2": convolutions and a candidate selector (DFlash2DraftModel)
    input_embedding_scale: float | None = None
    training: dict[str, Any] = field(default_factory=dict)
    acceptance: dict[str, dict[str, Any]] = field(default_factory=dict)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)  # dataset repo ids for the metadata
    extra_tags: list[str] = field(default_factory=list)


def render_model_card(info: DrafterCardInfo) -> ModelCard:
    """The model card (YAML metadata + markdown body) of a drafter."""
    if info.block_size < 2:
        raise ValueError(
            f"block_size must be >= 2 (the anchor plus at least one drafted token), got {info.block_size}."
        )
    short_name = info.base_model.rstrip("/").split("/")[-1]
    repo_id = info.drafter_repo_id or f"<your-org>/{short_name}-DFlash-b{info.block_size}"
    base_model_is_repo = _is_hub_repo_id(info.base_model)
    if not base_model_is_repo:
        logger.warning(f"base_model {info.base_model!r} is not a Hub repo id; it is left out of the card metadata.")
    card_data = ModelCardData(
        base_model=info.base_model if base_model_is_repo else None,
        library_name="transformers",
        license=info.license,
        tags=list(dict.fromkeys(DEFAULT_TAGS + list(info.extra_tags))),
        datasets=list(info.datasets) or None,
        inference=False,  # a drafter cannot generate on its own, so no widget
    )
    local_dir = repo_id.split("/")[-1].strip("<>")
    if info.layout == "z-lab":
        serve_model = repo_id
    elif info.zlab_subfolder:
        serve_model = f"{local_dir}/{info.zlab_subfolder}"
    else:
        serve_model = f"{local_dir}-zlab"
    return ModelCard.from_template(
        card_data,
        template_path=str(resources.files("hf_dflash") / "hub_cards" / TEMPLATE),
        title=f"{'DFlash2' if info.variant == 'dflash2' else 'DFlash'} drafter {'adapter ' if info.base_drafter else ''}"
        f"for {info.target_name or short_name}",
        base_model=info.base_model,
        base_model_is_repo=base_model_is_repo,
        repo_id=repo_id,
        block_size=info.block_size,
        num_speculative_tokens=info.block_size - 1,
        target_layers_text=("layer " if len(info.target_layer_ids) == 1 else "layers ")
        + ", ".join(str(i) for i in info.target_layer_ids),
        layout=info.layout,
        variant=info.variant,
        zlab_subfolder=info.zlab_subfolder,
        local_dir=local_dir,
        serve_model=serve_model,
        chat_template=info.training.get("chat_template"),
        base_drafter=info.base_drafter,
        target_adapter=info.target_adapter,
        target_adapter_ref=_loadable_reference(info.target_adapter),
        adapter_text=_adapter_text(info.adapter),
        serving_notes=_serving_notes(info),
        training_rows=_training_rows(info),
        acceptance_rows=_acceptance_rows(info.acceptance),
        engine_rows=_engine_rows(info.engines),
    )


def _engine_rows(engines: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    """(engine, accepted length, hf-dflash tau, plain tok/s, DFlash tok/s, conditions, command) per measured engine."""
    rows = []
    for engine, measured in engines.items():
        numbers = [
            measured.get(key)
            for key in ("mean_accepted_length", "hf_dflash_tau", "plain_tokens_per_s", "dflash_tokens_per_s")
        ]
        if not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
            raise ValueError(
                f"The {engine} measurement needs numbers for mean_accepted_length, hf_dflash_tau, plain_tokens_per_s "
                f"and dflash_tokens_per_s; got {measured!r}."
            )
        texts = [f"{numbers[0]:.2f}", f"{numbers[1]:.2f}", f"{numbers[2]:.1f}", f"{numbers[3]:.1f}"]
        rows.append((engine, *texts, measured.get("conditions", ""), measured.get("command", "")))
    return rows


def _loadable_reference(adapter: str | None) -> str:
    """What the card's `PeftModel.from_pretrained(target, ...)` line loads: the target adapter's folder or Hub id, or
    a placeholder when the card was given a description of it instead (a recipe, a sentence)."""
    if adapter and not any(character.isspace() for character in adapter):
        return adapter
    return "<the target's adapter: folder or Hub id>"


def write_model_card(folder: str | os.PathLike, info: DrafterCardInfo) -> Path:
    """Render the card into `folder/README.md`; the file is replaced whole (temp file + `os.replace`)."""
    folder = Path(folder)
    text = str(render_model_card(info))
    return write_text_atomic(folder / "README.md", text)


def card_info_from_folder(folder: str | os.PathLike, **overrides: Any) -> DrafterCardInfo:
    """Card info from a saved drafter: `config.json` (hf-dflash or z-lab layout), then `training_info.json` if
    present, then `overrides` (`None` values are ignored)."""
    folder = Path(folder)
    config, layout = _drafter_config(folder)
    values: dict[str, Any] = {
        "block_size": config.block_size,
        "num_hidden_layers": config.num_hidden_layers,
        "target_layer_ids": list(config.target_layer_ids or []),
        "mask_token_id": config.mask_token_id,
        "num_target_layers": config.num_target_layers,
        "layout": layout,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "layer_types": list(config.layer_types),
        "causal_sliding_attention": config.causal_sliding_attention,
        "input_embedding_scale": config.input_embedding_scale,
        "variant": config.variant,
    }
    if layout == ADAPTER_LAYOUT:
        values["adapter"] = _adapter_settings(folder)
    if (folder / ZLAB_SUBFOLDER / "config.json").is_file():
        values["zlab_subfolder"] = ZLAB_SUBFOLDER
    if (folder / TRAINING_INFO_FILE).is_file():
        known = {f.name for f in fields(DrafterCardInfo)}
        for name, value in json.loads((folder / TRAINING_INFO_FILE).read_text()).items():
            if name in known:
                values[name] = value
            else:
                logger.warning(f"Ignoring unknown key {name!r} in {folder / TRAINING_INFO_FILE}.")
    values |= {name: value for name, value in overrides.items() if value is not None}
    if not values.get("base_model"):
        raise ValueError(
            f"The target of {folder} is unknown: pass base_model= (CLI: --base-model) or write it into "
            f"{TRAINING_INFO_FILE}."
        )
    return DrafterCardInfo(**values)


def merged_acceptance(folder: str | os.PathLike, measured: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The acceptance recorded in `folder/training_info.json` with `measured` (`{dataset: {"tau", "speedup",
    "conditions"}}`) over it: a set measured again replaces its entry, the others stay."""
    if not isinstance(measured, dict):
        raise ValueError(f'Acceptance must map a dataset to {{"tau", "speedup", "conditions"}}, got {measured!r}.')
    for dataset, result in measured.items():
        tau = result.get("tau") if isinstance(result, dict) else None
        if isinstance(tau, bool) or not isinstance(tau, (int, float)):
            raise ValueError(f'Acceptance of {dataset!r} needs a numeric "tau", got {result!r}.')
    path = Path(folder) / TRAINING_INFO_FILE
    recorded = json.loads(path.read_text()).get("acceptance", {}) if path.is_file() else {}
    return recorded | measured


def record_card_facts(folder: str | os.PathLike, facts: dict[str, Any]) -> Path:
    """Write `facts` (card fields such as `acceptance` or `license`) into `folder/training_info.json` (created if
    missing), so that every later card of the folder shows them."""
    path = Path(folder) / TRAINING_INFO_FILE
    info = json.loads(path.read_text()) if path.is_file() else {}
    return write_training_info(folder, info | facts)


def write_training_info(folder: str | os.PathLike, info: dict[str, Any]) -> Path:
    """Write `folder/training_info.json`, replaced whole (temp file + `os.replace`): what the card reads."""
    return write_text_atomic(
        Path(folder) / TRAINING_INFO_FILE, json.dumps(info, indent=2, sort_keys=True, default=str) + "\n"
    )


def _drafter_config(folder: Path) -> tuple[DFlashConfig, str]:
    """The drafter's config and the folder's layout: `config.json` (hf-dflash or z-lab), or for an adapter folder the
    config of the drafter it adapts (`dflash_adapter.json`)."""
    if is_adapter_folder(folder):
        return base_drafter_config(folder), ADAPTER_LAYOUT
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; is it a saved DFlash drafter?")
    config_dict = json.loads(config_path.read_text())
    layout = detect_layout(config_dict)
    # lifts z-lab's nested `dflash_config` and reads DFlash2 from its architecture, as loading does
    return DFlashConfig(**config_dict_from_layout(config_dict, layout)), layout


def _adapter_settings(folder: Path) -> dict[str, Any]:
    """What a drafter adapter's card states: PEFT type, rank, alpha, modules, and the adapter file's size."""
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    modules = config.get("target_modules") or []
    weights = sorted(folder.glob("adapter_model.*"))
    return {
        "peft_type": config.get("peft_type"),
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": sorted(modules) if isinstance(modules, list) else modules,
        "bytes": weights[0].stat().st_size if weights else None,
    }


def _serving_notes(info: DrafterCardInfo) -> list[str]:
    """What each serving engine reads of this drafter, where one reads it differently from how it was trained (rules
    read from the engines' loaders: vLLM `qwen3_dflash.py`, SGLang `models/dflash.py`, llama.cpp `conversion/qwen.py`)."""
    notes = []
    if info.variant == "dflash2":
        notes.append(
            "**DFlash2** (`DFlash2DraftModel`: sublayer convolutions and a candidate selector). vLLM runs its selector "
            "only with the V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`; the V1 runner serves it as DFlash without "
            "the selector); llama.cpp reads it through `hf-dflash export --engine llama.cpp`; OpenVINO GenAI does not "
            "run DFlash2."
        )
    if info.draft_vocab_size is not None:
        of_vocab = f" of {info.vocab_size}" if info.vocab_size else ""
        notes.append(
            f"**Reduced vocabulary** ({info.draft_vocab_size}{of_vocab} tokens). The z-lab export carries "
            "`lm_head.weight` (the target head's rows of those tokens) beside `d2t`: vLLM drafts over them as trained. "
            "SGLang ignores both and drafts over the target's whole head. llama.cpp's converter maps `d2t` only in "
            "its DSpark class, which `hf-dflash export --engine llama.cpp` uses. The authors' reference model takes "
            'no `d2t`: for it write `save_pretrained(folder, layout="z-lab", full_vocabulary=True)`.'
        )
    if "sliding_attention" in info.layer_types and not info.causal_sliding_attention:
        notes.append(
            "**Sliding-window layers attend bidirectionally** inside the block, as trained. The export says so "
            "(`is_causal: false`, `dflash_config.causal: false`), which vLLM reads; SGLang runs `sliding_attention` "
            "draft layers causally whatever the config says, so expect lower acceptance there."
        )
    if len(set(info.layer_types)) > 1:
        notes.append(
            "vLLM serves drafters that mix sliding and full-attention layers only with its V2 model runner: set "
            "`VLLM_USE_V2_MODEL_RUNNER=1`."
        )
    if info.input_embedding_scale not in (None, 1.0):
        notes.append(
            f"**Scaled embedding.** The target scales its embedding rows by {info.input_embedding_scale:g} and the "
            "drafter was trained on the scaled rows. The export records it as `dflash_config.input_embedding_scale`, "
            "which newer readers (DFlash2-style configs) apply; DFlash v1 readers (vLLM's and SGLang's DFlash) embed "
            "with the raw rows, so expect lower acceptance there."
        )
    return notes


def _adapter_text(adapter: dict[str, Any]) -> str:
    """`rank 16, alpha 32, 1.2 MB` for a drafter adapter's settings."""
    parts = [f"rank {adapter['r']}" if adapter.get("r") else None]
    parts.append(f"alpha {adapter['lora_alpha']}" if adapter.get("lora_alpha") else None)
    parts.append(_format_bytes(adapter["bytes"]) if adapter.get("bytes") else None)
    return ", ".join(part for part in parts if part) or "LoRA"


def _training_rows(info: DrafterCardInfo) -> list[tuple[str, str]]:
    rows = [
        ("Target", f"`{info.base_model}`"),
        ("Block size", f"{info.block_size} ({info.block_size - 1} drafted tokens per block)"),
        ("Draft layers", str(info.num_hidden_layers)),
        ("Target layers read", ", ".join(str(i) for i in info.target_layer_ids) or "-"),
    ]
    if info.num_target_layers is not None:
        rows[-1] = (rows[-1][0], f"{rows[-1][1]} (of {info.num_target_layers})")
    if info.target_adapter:
        rows.insert(1, ("Target adapter", f"`{info.target_adapter}`"))
    if info.base_drafter:
        rows.append(("Base drafter (frozen)", f"`{info.base_drafter}`"))
        rows.append(("Adapter", f"{_adapter_text(info.adapter)} on {_cell(info.adapter.get('target_modules') or [])}"))
    if info.mask_token_id is not None:
        rows.append(("Mask token id", str(info.mask_token_id)))
    order = list(TRAINING_LABELS)
    keys = sorted(info.training, key=lambda k: order.index(k) if k in order else len(order))
    for key in keys:
        value = info.training[key]
        if value is None or key in CONFIG_TRAINING_KEYS:
            continue
        label = TRAINING_LABELS.get(key, key.replace("_", " ").capitalize())
        if key == "wall_time_s":
            value = _format_duration(value)
        elif key == "chat_template" and value is False:
            value = "none (prompts as raw text: a base model)"
        elif key == "held_out_tau_by_step":
            value = ", ".join(f"step {step}: {float(tau):.2f}" for step, tau in value)
        elif key == "selector_by_step":
            value = "; ".join(_selector_text(entry) for entry in value)
        rows.append((label, _cell(value)))
    return rows


def _selector_text(entry: dict[str, Any]) -> str:
    pairs = zip(entry["recall_at_k"], entry["accuracy"])
    return f"step {entry['step']}: " + " ".join(f"{recall:.2f}/{accuracy:.2f}" for recall, accuracy in pairs)


def _acceptance_rows(acceptance: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    rows = []
    for dataset, result in acceptance.items():
        speedup = result.get("speedup")
        rows.append(
            (
                _cell(dataset),
                f"{float(result['tau']):.2f}",
                "not measured" if speedup is None else f"{float(speedup):.2f}x",
                _cell(result.get("conditions") or ""),
            )
        )
    return rows


def _cell(value: Any) -> str:
    """A value as one markdown table cell."""
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(item) for item in value)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _format_bytes(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


def _format_duration(seconds: float) -> str:
    minutes = round(float(seconds) / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _is_hub_repo_id(name: str) -> bool:
    """`org/name` that is not a local path (what the Hub accepts as `base_model`)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1 or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
