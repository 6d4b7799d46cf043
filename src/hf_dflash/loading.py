"""One way to load a target and its drafter, for every `hf-dflash` command and for the Python API.

A target is named three ways: a packaged offline target (``hf_dflash.targets.KNOWN_TARGETS``, converted from its
PyPI GGUF once), a local model folder, or a Hub id (with ``revision``; ``trust_remote_code`` is passed on only when
asked for). It is loaded straight onto one device (``device``; default: the first accelerator present, else the
CPU) in one dtype (``dtype``; default: bfloat16 on an accelerator, float32 on the CPU) with the attention
implementation asked for, in eval mode; its tokenizer pads on the left. The drafter (a folder or a Hub id) is then
moved to the target's device and dtype and checked against the target.

``TargetArguments`` (``hf_dflash.arguments``, re-exported here) holds those choices with the help text of their flags,
and ``check_model_name`` the rules of naming a model, so that the command line checks a name before torch loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging

from hf_dflash.model.generation_dflash import check_draft_fits_target
from hf_dflash.model.modeling_dflash import DFlashForDrafting

from .adapters import is_adapter_folder, load_draft_adapter, read_base_drafter_record
from .arguments import DEFAULT_TARGET, DTYPE_NAMES, FOLDER, PACKAGED, TargetArguments, check_model_name, is_path_like
from .offline import committed_drafter as committed_drafter  # re-exported: it used to live here
from .targets import KNOWN_TARGETS, converted_target_folder, default_cache_dir, prepare_tokenizer

logger = logging.get_logger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def default_device() -> torch.device:
    """The first accelerator present (CUDA, then MPS), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` (None: ``default_device()``); raises if that device is not present."""
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"Unknown device {str(device)!r} ({error}); use cpu, cuda, cuda:N or mps.") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"Device {device} was asked for but CUDA is not available here; use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"Device {device} does not exist: this machine has {torch.cuda.device_count()} GPU(s).")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("Device mps was asked for but MPS is not available here; use --device cpu.")
    return device


def same_device(first: torch.device, second: torch.device) -> bool:
    """Whether two devices are the same one (``cuda`` is ``cuda:0``)."""
    return first.type == second.type and (first.index or 0) == (second.index or 0)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | str:
    """``dtype`` as a ``torch.dtype`` (or ``"auto"``, the checkpoint's own); None: bfloat16 off the CPU, else float32."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {', '.join(DTYPES)} or auto.")
    return DTYPES[dtype]


def load_target_and_tokenizer(
    target: str | os.PathLike = DEFAULT_TARGET,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
    target_adapter: str | os.PathLike | None = None,
    merge_target_adapter: bool = False,
    tokenizer_required: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM target onto ``device`` in ``dtype``, in eval mode, with its tokenizer padding on the left.

    Args:
        target: a packaged target name (``hf_dflash.targets.KNOWN_TARGETS``), a model folder, or a Hub id.
        revision: the Hub revision of ``target``.
        trust_remote_code: run the target's own modeling code (passed on to transformers only when True).
        device: where the weights go (see ``resolve_device``); dtype: see ``resolve_dtype``.
        attn_implementation: passed on to ``from_pretrained`` (None: transformers' default).
        target_adapter: a PEFT adapter (folder or Hub id) loaded onto the target: the result is a ``PeftModel``,
            or with ``merge_target_adapter`` a plain model with the adapter merged into its weights. Its folder's
            tokenizer, when it has one, replaces the base's.
        tokenizer_required: when False, a target without a tokenizer loads with ``None`` instead of raising.

    Raises ``FileNotFoundError`` for a path that does not exist, ``OSError`` naming the three ways to name a
    target when transformers cannot load it, and ``OSError`` naming a truncated or corrupt weights file and how to
    get a whole one.
    """
    device = resolve_device(device)
    source = _target_source(str(target), revision)
    remote = {"trust_remote_code": True} if trust_remote_code else {}
    loading = {"revision": revision, "dtype": resolve_dtype(dtype, device), "device_map": device}
    if attn_implementation is not None:
        loading["attn_implementation"] = attn_implementation
    try:
        with _named_weights_errors(source, revision, "Target"):
            model = AutoModelForCausalLM.from_pretrained(source, **loading, **remote)
    except OSError as error:
        if isinstance(error.__cause__, SafetensorError):
            raise
        raise OSError(
            f"Cannot load target {str(target)!r}: {error}\nA target is a packaged name ({', '.join(KNOWN_TARGETS)}), "
            "a model folder, or a Hub id (the Hub needs network access: unset HF_HUB_OFFLINE)."
        ) from error
    tokenizer_source = source
    if target_adapter is not None:
        model = apply_target_adapter(model, str(target_adapter), merge=merge_target_adapter)
        tokenizer_source = _adapter_tokenizer_source(str(target_adapter)) or source
    return model.eval(), _load_tokenizer(tokenizer_source, revision, remote, tokenizer_required)


def apply_target_adapter(model: PreTrainedModel, adapter: str, *, merge: bool = False) -> PreTrainedModel:
    """``model`` with the PEFT adapter ``adapter`` (a folder or a Hub id) loaded for inference: a ``PeftModel``, or the
    plain model with the adapter merged into its weights when ``merge``."""
    from peft import PeftModel

    source = _folder_or_hub_id(adapter, "Target adapter")
    try:
        adapted = PeftModel.from_pretrained(model, source, is_trainable=False)
    except RuntimeError as error:
        if "size mismatch" not in str(error):
            raise
        raise ValueError(
            f"Target adapter {adapter} does not fit this target: its weights have other shapes ({error}). An adapter "
            "that resized the vocabulary needs the resized base: resize it as the fine-tune did "
            "(model.resize_token_embeddings(n)), save it as a folder and pass that folder as --target."
        ) from error
    adapted = adapted.merge_and_unload() if merge else adapted
    return adapted.eval()


def load_target_from_arguments(
    arguments: TargetArguments, **overrides
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """``load_target_and_tokenizer`` with the ``TargetArguments`` fields of ``arguments`` (a subclass's other fields
    are left out; ``overrides`` replace or add keywords)."""
    named = {field.name: getattr(arguments, field.name) for field in fields(TargetArguments)}
    return load_target_and_tokenizer(**(named | overrides))


def load_tokenizer_and_generation_config(
    arguments: TargetArguments,
) -> tuple[PreTrainedTokenizerBase, GenerationConfig]:
    """The target's tokenizer (padding on the left) and generation config, without its weights: what regenerating
    data through a server that serves the target needs locally."""
    source = _target_source(arguments.target, arguments.revision)
    remote = {"trust_remote_code": True} if arguments.trust_remote_code else {}
    try:
        generation_config = GenerationConfig.from_pretrained(source, revision=arguments.revision, **remote)
    except OSError:  # no generation_config.json: the model config's own EOS
        config = AutoConfig.from_pretrained(source, revision=arguments.revision, **remote)
        generation_config = GenerationConfig.from_model_config(config)
    return _load_tokenizer(source, arguments.revision, remote, required=True), generation_config


def load_draft(
    draft: str | os.PathLike,
    target: PreTrainedModel,
    *,
    revision: str | None = None,
    base_draft: str | os.PathLike | None = None,
    merge_adapter: bool = True,
) -> DFlashForDrafting:
    """Load a drafter (a folder or a Hub id, any layout ``DFlashForDrafting.from_pretrained`` reads) onto the
    target's device in the target's dtype, in eval mode, and check that it fits the target.

    A drafter adapter folder (``hf_dflash.adapters``) is loaded onto its base drafter (``base_draft``, default: the
    one it records), after checking that base is the drafter it was trained on, and merged into it unless
    ``merge_adapter=False`` (then a ``PeftModel`` is returned; both draft the same tokens).
    """
    if is_adapter_folder(draft):
        base = load_draft(base_draft or read_base_drafter_record(draft)["name_or_path"], target, revision=revision)
        return load_draft_adapter(base, Path(draft).expanduser(), merge=merge_adapter).to(target.device)
    source = _folder_or_hub_id(str(draft), "Drafter")
    with _named_weights_errors(source, revision, "Drafter"):
        model = DFlashForDrafting.from_pretrained(source, revision=revision, dtype=target.dtype)
    model = model.to(target.device).eval()
    check_draft_fits_target(target, model, max_batch_size=None)
    return model


@contextmanager
def _named_weights_errors(source: str, revision: str | None, what: str) -> Iterator[None]:
    """Raise safetensors' own error for a truncated or corrupt weights file ("incomplete metadata, file not fully
    covered", which names no file) as an ``OSError`` naming the file and how to get a whole one."""
    try:
        yield
    except SafetensorError as error:
        folder = _local_folder(source, revision)
        broken = [str(path) for path in _broken_safetensors(folder)] if folder is not None else []
        named = ", ".join(broken) or f"a .safetensors file of {source}"
        raise OSError(f"{what} weights file {named} is truncated or corrupt ({error}). {_refetch(source)}") from error


def _local_folder(source: str, revision: str | None) -> Path | None:
    """The folder holding ``source``'s files: itself, or its snapshot in the local Hub cache (None if there is none)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, local_files_only=True))
    except Exception:  # not cached: nothing local to name
        return None


def _broken_safetensors(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``folder`` whose header safetensors refuses."""
    from safetensors import safe_open

    broken = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError):
            broken.append(path)
    return broken


def _refetch(source: str) -> str:
    """How to replace the weights of ``source`` with whole ones."""
    if Path(source).is_dir() and Path(source).resolve().is_relative_to(default_cache_dir().resolve()):
        return f"Delete the converted folder {source} and run again: it is converted anew from its package's GGUF."
    if Path(source).is_dir():
        return "Copy the model folder again, or save it again with save_pretrained."
    return f"Download it again: hf download {source} --force-download."


def _target_source(target: str, revision: str | None) -> str:
    """What ``from_pretrained`` reads: a packaged target's converted folder, a local folder, or the Hub id."""
    kind = check_model_name(target, "target", revision=revision)
    if kind == PACKAGED:
        return str(converted_target_folder(target))
    return str(Path(target).expanduser()) if kind == FOLDER else target


def _folder_or_hub_id(name: str, what: str) -> str:
    """An existing folder (user home expanded), or ``name`` as a Hub id; a path that does not exist raises."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return str(folder)
    if is_path_like(name):
        raise FileNotFoundError(
            f"{what} folder {name!r} does not exist. A {what.lower()} is a local folder, or a Hub id."
        )
    return name


def _adapter_tokenizer_source(adapter: str) -> str | None:
    """An adapter folder that holds its own tokenizer (a fine-tune that added tokens saves one there), else None."""
    folder = Path(adapter).expanduser()
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return str(folder) if folder.is_dir() and any((folder / name).is_file() for name in names) else None


def _load_tokenizer(source: str, revision: str | None, remote: dict, required: bool) -> PreTrainedTokenizerBase | None:
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, **remote)
    except (OSError, ValueError) as error:
        if required:
            raise OSError(
                f"{source} has no tokenizer this command can use ({error}); save one next to the model."
            ) from error
        logger.warning(f"{source} has no tokenizer ({error}); continuing without one.")
        return None
    return prepare_tokenizer(tokenizer)


__all__ = [
    "TargetArguments",
    "apply_target_adapter",
    "committed_drafter",
    "default_device",
    "load_draft",
    "load_target_and_tokenizer",
    "load_target_from_arguments",
    "load_tokenizer_and_generation_config",
    "resolve_device",
    "same_device",
    "resolve_dtype",
]
