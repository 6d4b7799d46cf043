"""The parser every `hf-dflash` command is built from, the flags several commands share, and the checks they run
before anything loads.

`FlagParser` answers to both spellings of a long flag (`--max_new_tokens`, `--max-new-tokens`, as `HfArgumentParser`
does), turns argparse's errors into a `UsageError` (one line, exit status 2) and prints each flag's default once
(`HelpFormatter`). `add_dataclass_flags` makes a dataclass's fields flags with their help and defaults, so a default
is written once, in the dataclass: the target flags of every command come from `hf_dflash.arguments.TargetArguments`
(as `hf-dflash train`'s do through `HfArgumentParser`), `bench`'s from `BenchmarkConfig`. A boolean flag is the same
in every command: `--flag` alone or `--flag true|false`.

The checks (`check_input_file`, `check_output_file`, `check_output_folder`, `check_model`) raise `UsageError` and
run before the heavy imports. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

from hf_dflash.arguments import TargetArguments, check_model_name, is_path_like

from .errors import UsageError, usage_errors

TRUE_WORDS, FALSE_WORDS = ("true", "yes", "y", "1", "t"), ("false", "no", "n", "0", "f")
Flags = argparse._ActionsContainer  # what flags are added to: a parser or one of its argument groups


class HelpFormatter(argparse.HelpFormatter):
    """Each flag once, in its underscore spelling (the dash one is accepted too), with its help followed by its
    default, once: not when the help already states it, nor for a default that means "none" (None, an empty list). In
    the description and epilog, a paragraph is wrapped and an indented line (a table, an example) kept as it is."""

    def __init__(self, prog: str, **kwargs):
        super().__init__(prog, max_help_position=36, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks, paragraph = [], []
        for line in text.splitlines():
            if line.strip() and not line.startswith(" "):
                paragraph.append(line)
                continue
            if paragraph:
                blocks.append(super()._fill_text(" ".join(paragraph), width, indent))
                paragraph = []
            blocks.append(indent + line)
        if paragraph:
            blocks.append(super()._fill_text(" ".join(paragraph), width, indent))
        return "\n".join(blocks)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [name for name in action.option_strings if not (name.startswith("--") and "-" in name[2:])]
        default_metavar = self._get_default_metavar_for_optional(action)
        metavar = self._format_args(action, default_metavar) if action.nargs != 0 else ""
        return ", ".join(shown or action.option_strings) + (f" {metavar}" if metavar else "")

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str):
        if action.metavar is None and _long_choices(action):  # the choices go into the help instead
            return lambda tuple_size: (default_metavar,) * tuple_size
        return super()._metavar_formatter(action, default_metavar)

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if action.metavar is None and _long_choices(action):
            text = f"{text} One of: {', '.join(str(choice) for choice in action.choices)}."
        if action.help is argparse.SUPPRESS or "default" in text.lower() or action.dest == "help":
            return text
        if default is None or default is argparse.SUPPRESS or (isinstance(default, (list, tuple)) and not default):
            return text
        if isinstance(default, bool):
            default = str(default).lower()
        elif isinstance(default, (list, tuple)):
            default = " ".join(str(value) for value in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _long_choices(action: argparse.Action) -> bool:
    """Whether the choices of `action` are too many to show as its value (`{a,b,...}`)."""
    return bool(action.choices) and len(",".join(str(choice) for choice in action.choices)) > 40


class RaisesUsageErrors:
    """Mix into an `ArgumentParser` (ours, or `HfArgumentParser` for `train`): its errors (unknown flag, bad value,
    missing flag) become a `UsageError` naming the command, instead of a usage block and `sys.exit(2)`."""

    def error(self, message: str) -> typing.NoReturn:
        raise parser_error(self.prog, message)


def parser_error(prog: str, message: str) -> UsageError:
    """The `UsageError` of a flag the parser of `prog` refuses, with where to look (or where `--debug` goes)."""
    fix = f"Run `{prog} --help` for the flags."
    if "unrecognized arguments: --debug" in message and prog != "hf-dflash":
        fix = f"--debug goes before the command: `hf-dflash --debug {prog.removeprefix('hf-dflash ')} ...`."
    return UsageError(f"{message}. {fix}", prog=prog)


class FlagParser(RaisesUsageErrors, argparse.ArgumentParser):
    """An `ArgumentParser` whose long flags answer to both spellings, whose errors are `UsageError`s, and whose help
    prints defaults once (`HelpFormatter`); sub-commands and argument groups inherit the spellings."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        return super().add_argument(*both_spellings(names), **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = _FlagGroup(self, *args, **kwargs)  # as argparse's own add_argument_group, with the two spellings
        self._action_groups.append(group)
        return group


class _FlagGroup(argparse._ArgumentGroup):
    """An argument group of a `FlagParser`: its long flags answer to both spellings too."""

    def add_argument(self, *names, **kwargs):
        return super().add_argument(*both_spellings(names), **kwargs)


def both_spellings(names: tuple[str, ...]) -> list[str]:
    """`("--max-new-tokens",)` -> `["--max_new_tokens", "--max-new-tokens"]`: the documented underscore spelling
    first (as transformers' flags), then the dash one."""
    spellings = ["--" + name[2:].replace("-", "_") if name.startswith("--") else name for name in names]
    spellings += ["--" + name[2:].replace("_", "-") for name in spellings if name.startswith("--")]
    return list(dict.fromkeys(spellings))


def parse_bool(text: str) -> bool:
    """`true`/`false` (and yes/no, 1/0) as `HfArgumentParser` reads a boolean flag's value."""
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bool_flag(
    parser: Flags, name: str, *, help: str, default: bool = False, aliases: tuple[str, ...] = ()
) -> None:
    """`--name` alone or `--name true|false`, as `HfArgumentParser` spells the booleans of `hf-dflash train`."""
    parser.add_argument(
        f"--{name}", *aliases, nargs="?", const=True, default=default, type=parse_bool, metavar="BOOL", help=help
    )


def add_dataclass_flags(parser: Flags, cls: type, *, skip: tuple[str, ...] = ()) -> dict[str, Flags]:
    """The fields of the dataclass `cls` (but `skip`) as flags of `parser` (or an argument group), with the help and
    default of each field: `bool` is `add_bool_flag`, `X | None` takes an X, `tuple[X, ...]` and `list[X]` take zero or
    more (`nargs` in `metadata` may ask for one or more); `metadata` may add `aliases`, `choices`, `metavar`, and `group`,
    the section of `--help` to list it in. Returns those sections by title (for the caller's own flags)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Flags] = {}
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.init:
            continue
        kind = _without_none(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        help, aliases = field.metadata.get("help"), tuple(field.metadata.get("aliases", ()))
        title = field.metadata.get("group")
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        container = groups[title] if title else parser
        if kind is bool:
            add_bool_flag(container, field.name, help=help, default=default, aliases=aliases)
            continue
        options: dict[str, Any] = {"help": help, "default": default}
        if typing.get_origin(kind) in (tuple, list):
            kind = typing.get_args(kind)[0]
            options |= {"nargs": "*", "default": list(default)}
        if kind is not str:
            options["type"] = kind
        options |= {key: field.metadata[key] for key in ("choices", "metavar", "nargs") if key in field.metadata}
        container.add_argument(f"--{field.name}", *aliases, **options)
    return groups


def _without_none(kind: Any) -> Any:
    """`X` of `X | None`."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else kind
    return kind


def dataclass_values(cls: type, args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parsed values of `cls`'s fields (but `skip`), tuples where the field is a tuple: `cls(**values)` builds it."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.init:
            continue
        value = getattr(args, field.name)
        tuple_field = typing.get_origin(_without_none(hints[field.name])) is tuple
        values[field.name] = tuple(value) if tuple_field and value is not None else value
    return values


def add_target_flags(parser: argparse.ArgumentParser) -> None:
    """The fields of `TargetArguments` as flags, with their defaults and help (one definition for every command)."""
    group = parser.add_argument_group("target", "the model to decode (or to draft for), as every command names it")
    add_dataclass_flags(group, TargetArguments)


def target_arguments(args: argparse.Namespace) -> TargetArguments:
    """The `TargetArguments` a command's parsed flags name."""
    return TargetArguments(**dataclass_values(TargetArguments, args))


def check_target(args: argparse.Namespace) -> str:
    """Refuse a `--target` that is neither a packaged target, a model folder, nor a Hub id there is (and a
    `--target_adapter` folder that does not exist) before anything loads; returns what the target is (`PACKAGED`,
    `FOLDER` or `HUB`)."""
    kind = check_model(args.target, "target", "--target", revision=args.revision)
    adapter = args.target_adapter
    if adapter is not None and (is_path_like(adapter) or Path(adapter).expanduser().exists()):
        check_input_folder(adapter, "--target_adapter")
    return kind


def check_model(name: str, what: str, flag: str, revision: str | None = None) -> str:
    """`hf_dflash.arguments.check_model_name` (asking the Hub about an uncached id) with a `UsageError` naming the
    flag; returns what the name is (`PACKAGED`, `FOLDER` or `HUB`)."""
    try:
        return check_model_name(name, what, revision=revision, hub_check=True)
    except (ValueError, OSError) as error:
        raise UsageError(f"{flag}: {error}") from error


def check_input_file(path: str, flag: str) -> Path:
    """`path` as a `Path`; a `UsageError` unless it is an existing file."""
    file = Path(path).expanduser()
    if not file.exists():
        raise UsageError(f"{flag}: {path} does not exist. Check the path (relative paths start at {os.getcwd()}).")
    if not file.is_file():
        raise UsageError(f"{flag}: {path} is a folder, not a file. Pass the file itself.")
    return file


def check_input_folder(path: str, flag: str) -> Path:
    """`path` as a `Path`; a `UsageError` unless it is an existing folder."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise UsageError(f"{flag}: {path} {what}. Pass an existing folder.")
    return folder


def check_output_file(path: str, flag: str) -> Path:
    """`path` as a `Path`; a `UsageError` unless a file can be written there (its missing parents are created)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UsageError(f"{flag}: {path} is a folder. Pass a file name, e.g. {Path(path) / 'out.json'}.")
    if file.exists() and not os.access(file, os.W_OK):
        raise UsageError(f"{flag}: {path} is not writable. Choose another file or fix its permissions.")
    _check_parent_writable(file, flag, path)
    return file


def check_output_folder(path: str, flag: str) -> Path:
    """`path` as a `Path`; a `UsageError` unless it is a writable folder or one that can be created."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag}: {path} is a file. Pass a folder (it is created if missing).")
    if folder.is_dir():
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{flag}: {path} is not writable. Choose another folder or fix its permissions.")
        return folder
    _check_parent_writable(folder, flag, path)
    return folder


def _check_parent_writable(path: Path, flag: str, given: str) -> None:
    """A `UsageError` unless the nearest existing folder above `path` is a folder this process may write into."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag}: {given} lies under {parent}, which is a file. Choose another path.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: cannot write under {parent} (permission denied). Choose another path.")


def target_gguf(target: str, given: str | None) -> str | None:
    """The target's GGUF for llama.cpp: `given` (a `--*target_gguf` flag), else a packaged target's own, else None."""
    from hf_dflash.offline import KNOWN_TARGETS

    if given or target not in KNOWN_TARGETS:
        return given
    from hf_dflash.targets import locate_gguf

    with usage_errors(ModuleNotFoundError, FileNotFoundError):
        return str(locate_gguf(target))


def add_draft_flags(parser: argparse.ArgumentParser) -> None:
    """`--draft` (required), `--draft_revision` and `--base_draft`: the drafter a command loads
    (`hf_dflash.loading.load_draft`, which merges a drafter adapter onto its base)."""
    group = parser.add_argument_group("drafter")
    group.add_argument(
        "--draft",
        required=True,
        help="drafter folder or Hub id (the committed drafters are in the git repository's drafters/ folder)",
    )
    group.add_argument("--draft_revision", default=None, help="Hub revision of --draft (default: main)")
    group.add_argument(
        "--base_draft", default=None, help="the base drafter of a --draft adapter folder (default: the one it records)"
    )


def check_draft(args: argparse.Namespace) -> None:
    """Refuse a `--draft` (and `--base_draft`) that names no drafter, before anything loads."""
    check_model(args.draft, "drafter", "--draft", revision=getattr(args, "draft_revision", None))
    if getattr(args, "base_draft", None) is not None:
        check_model(args.base_draft, "drafter", "--base_draft")


def add_cpu_kernel_flag(parser: Flags) -> None:
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
