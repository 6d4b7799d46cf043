"""The flags several `hf-dflash` commands share, and the parser class every command's parser is built from.

Every command that loads a target takes the same target flags (`hf_dflash.loading.TargetArguments`): `--target` (a
packaged name, a model folder or a Hub id), `--revision`, `--trust_remote_code`, `--device`, `--dtype`,
`--attn_implementation`, ... `add_target_flags` adds them from the dataclass's fields, so their defaults and help are
defined once; `target_arguments` reads them back. Flags are documented with underscores, as transformers' are; the
dash spelling (`--max-new-tokens`) is accepted everywhere too (`FlagParser`). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses

from hf_dflash.loading import TargetArguments


class FlagParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose long flags answer to both spellings, `--max_new_tokens` and `--max-new-tokens`, as
    `HfArgumentParser` (behind `hf-dflash train`) does; sub-commands inherit the class."""

    def add_argument(self, *names, **kwargs):
        spellings = ["--" + name[2:].replace("-", "_") if name.startswith("--") else name for name in names]
        spellings += ["--" + name[2:].replace("_", "-") for name in spellings if name.startswith("--")]
        return super().add_argument(*dict.fromkeys(spellings), **kwargs)


def add_target_flags(parser: argparse.ArgumentParser) -> None:
    """The fields of `TargetArguments` as flags, with their defaults and help (one definition for every command)."""
    for field in dataclasses.fields(TargetArguments):
        aliases = field.metadata.get("aliases", [])
        if field.type in (bool, "bool"):
            parser.add_argument(f"--{field.name}", *aliases, action="store_true", help=field.metadata["help"])
        else:
            parser.add_argument(f"--{field.name}", *aliases, default=field.default, help=field.metadata["help"])


def target_arguments(args: argparse.Namespace) -> TargetArguments:
    """The `TargetArguments` a command's parsed flags name."""
    return TargetArguments(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TargetArguments)})


def target_gguf(target: str, given: str | None) -> str | None:
    """The target's GGUF for llama.cpp: `given` (a `--*target_gguf` flag), else a packaged target's own, else None."""
    from hf_dflash.targets import KNOWN_TARGETS, locate_gguf

    if given or target not in KNOWN_TARGETS:
        return given
    return str(locate_gguf(target))


def add_draft_flags(parser: argparse.ArgumentParser) -> None:
    """`--draft` (required), `--draft_revision` and `--base_draft`: the drafter a command loads
    (`hf_dflash.loading.load_draft`, which merges a drafter adapter onto its base)."""
    parser.add_argument(
        "--draft",
        required=True,
        help="drafter folder or Hub id (the committed drafters are in the git repository's drafters/ folder)",
    )
    parser.add_argument("--draft_revision", default=None, help="Hub revision of --draft")
    parser.add_argument(
        "--base_draft", default=None, help="the base drafter of a --draft adapter folder (default: the one it records)"
    )


def add_cpu_kernel_flag(parser: argparse.ArgumentParser) -> None:
    """`--cpu_kernels fast|exact|off`: how a CPU target (and drafter) is prepared (`prepare_cpu_kernels`)."""
    parser.add_argument(
        "--cpu_kernels",
        choices=["fast", "exact", "off"],
        default="fast",
        help="prepare a CPU target and drafter with hf_dflash.optimize_for_cpu: fast (packed oneDNN linears, "
        "attention without key/value copies: a forward over a block costs little more than one token), exact (also "
        "bitwise equal to one-token forwards, so greedy outputs match plain decoding in any dtype; slower), off "
        "(stock)",
    )


def prepare_cpu_kernels(mode: str, target, draft=None):
    """`optimize_for_cpu` on a CPU target (and drafter, fast) as `--cpu_kernels` says; the target's preparation, or
    None when nothing was prepared (`off`, or a target off the CPU)."""
    if mode == "off" or target.device.type != "cpu":
        return None
    from hf_dflash.decoding.cpu_kernels import optimize_target_and_draft_for_cpu

    preparation = optimize_target_and_draft_for_cpu(target, draft, exact=mode == "exact")
    print(f"CPU kernels ({mode}): {preparation.summary()}")
    return preparation
