"""What a command is asked to load, checked before anything loads.

`TargetArguments` holds the target flags every command shares (`hf-dflash train` parses it with `HfArgumentParser`,
the other commands add its fields to their own parsers). `check_model_name` says what a name given for a target or a
drafter is (a packaged target, a local folder, or a Hub id) and refuses one that is none of them, naming the packaged
targets and the closest one to a typo, so a wrong `--target` is answered in well under a second instead of after
the imports and a failed download.

This module imports only the standard library and `hf_dflash.offline` (and `huggingface_hub` inside a check): the
command line builds its parsers from it without importing torch or transformers.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from .offline import KNOWN_TARGETS

DEFAULT_TARGET = "smollm2-135m-instruct"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # `hf_dflash.loading.DTYPES` maps them to torch dtypes

# What `check_model_name` found a name to be.
PACKAGED, FOLDER, HUB = "packaged", "folder", "hub"
# The file that makes a folder a saved model; a drafter folder may hold a PEFT adapter instead (`hf_dflash.adapters`).
MODEL_FILES = {"target": ("config.json",), "drafter": ("config.json", "adapter_config.json")}
HUB_QUESTION_TIMEOUT_S = 5.0  # how long a check waits for the Hub to say whether a model exists


@dataclass
class TargetArguments:
    """Which target to load, from where, onto which device and in which dtype (the flags of every command)."""

    target: str = field(
        default=DEFAULT_TARGET,
        metadata={"help": f"A packaged target ({', '.join(KNOWN_TARGETS)}), a model folder, or a Hub id."},
    )
    revision: str | None = field(
        default=None, metadata={"help": "Hub revision (branch, tag or commit) of --target (default: main)."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the target's own modeling code from its folder or Hub repo."}
    )
    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda, cuda:1, mps, ... (default: the first accelerator, else cpu)."}
    )
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "The weights' dtype, auto: the checkpoint's own (default: bfloat16 on an accelerator, float32 on "
            "the CPU).",
            "aliases": ["--target_dtype"],  # the name `hf-dflash train` used before
            "choices": [*DTYPE_NAMES, "auto"],
        },
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "eager, sdpa, flash_attention_2, flex_attention, ... (default: transformers')."},
    )
    target_adapter: str | None = field(
        default=None,
        metadata={"help": "A PEFT adapter of --target (folder or Hub id), e.g. your LoRA fine-tune, run unmerged."},
    )
    merge_target_adapter: bool = field(
        default=False, metadata={"help": "Merge --target_adapter into the target's weights (merge_and_unload)."}
    )


def is_path_like(name: str) -> bool:
    """Whether `name` can only be a path: a Hub id is `name` or `owner/name`, never `./x`, `/x`, `~/x` or `a/b/c`."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def check_model_name(name: str, what: str = "target", *, revision: str | None = None, hub_check: bool = False) -> str:
    """What `name`, given for a `what` ("target" or "drafter"), is: `PACKAGED` (a target of `KNOWN_TARGETS`),
    `FOLDER` (a local folder holding a saved model) or `HUB` (a Hub id), without loading anything.

    With `hub_check`, a name that can only be a Hub id is looked up: one that is not in the local cache is refused
    when the Hub is offline (`HF_HUB_OFFLINE`) or says it has no such model (a network error lets it through: loading
    will tell). Without it, such a name is taken as a Hub id unasked (as `from_pretrained` takes it).

    Raises `FileNotFoundError` for a path that does not exist, and `ValueError` for a file given as a folder, a folder
    that holds no saved model, a revision of a packaged target, and an unknown name (listing the packaged targets
    and the closest of them).
    """
    if what == "target" and name in KNOWN_TARGETS:
        if revision is not None:
            raise ValueError(f"{name!r} is a packaged target from PyPI; it has no Hub revision (drop --revision).")
        return PACKAGED
    path = Path(name).expanduser()
    if path.exists():
        _check_folder(path, what)
        return FOLDER
    if is_path_like(name):
        packaged = f"a packaged name ({', '.join(KNOWN_TARGETS)}), " if what == "target" else ""
        raise FileNotFoundError(
            f"{what.capitalize()} folder {name!r} does not exist. A {what} is {packaged}a local folder, or a Hub id "
            "such as owner/name."
        )
    return _check_hub_id(name, what, revision) if hub_check else HUB


def _check_folder(path: Path, what: str) -> None:
    """Refuse a file, or a folder without the file that makes it a saved model."""
    if not path.is_dir():
        raise ValueError(
            f"{what.capitalize()} {str(path)!r} is a file, not a model folder. Pass the folder that holds config.json "
            "and the weights."
        )
    if not any((path / name).is_file() for name in MODEL_FILES[what]):
        raise ValueError(
            f"{what.capitalize()} folder {str(path)!r} holds no {' or '.join(MODEL_FILES[what])}: it is not a saved "
            "model. Pass the folder save_pretrained wrote."
        )


def _check_hub_id(name: str, what: str, revision: str | None) -> str:
    """`HUB` for a Hub id that is cached, or that the Hub may have; raise `ValueError` for one it cannot be."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, MODEL_FILES[what][0], revision=revision)
    except HFValidationError:
        raise ValueError(_unknown(name, what, "nor a valid Hub id")) from None
    if isinstance(cached, str):
        return HUB
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            _unknown(name, what, "nor a Hub id in the local cache")
            + " With HF_HUB_OFFLINE set only downloaded models load: unset it to download from the Hub."
        )
    if _hub_lacks(name):
        raise ValueError(_unknown(name, what, "nor a model the Hub has (a private one needs `hf auth login`)"))
    return HUB


def _hub_lacks(name: str) -> bool:
    """Whether the Hub answers that it has no model `name`; False when it cannot be asked (no network, a timeout)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().repo_info(name, timeout=HUB_QUESTION_TIMEOUT_S)
    except GatedRepoError:  # there, but not open to this user: loading will say so
        return False
    except RepositoryNotFoundError:
        return True
    except Exception:  # network trouble: loading will ask again and say what went wrong
        return False
    return False


def _unknown(name: str, what: str, hub: str) -> str:
    """ "unknown target 'x': not a packaged target (...) or a folder, <hub>; did you mean ...?" and the fix."""
    if what != "target":
        return (
            f"unknown {what} {name!r}: not a folder here, {hub}. Pass the drafter's folder (the committed ones are in "
            "the git repository's drafters/ folder) or its Hub id (owner/name)."
        )
    close = difflib.get_close_matches(name, KNOWN_TARGETS, n=1, cutoff=0.6)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown target {name!r}: not a packaged target ({', '.join(KNOWN_TARGETS)}), not a folder here, {hub}.{guess} "
        "Pass a packaged name, a model folder, or a Hub id (owner/name)."
    )


__all__ = ["DEFAULT_TARGET", "DTYPE_NAMES", "TargetArguments", "check_model_name", "is_path_like"]
