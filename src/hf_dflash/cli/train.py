"""`hf-dflash train`: train a drafter for a target on a regenerated dataset, then save and card it.

Its flags are every field of `TrainScriptArguments` and `DFlashTrainingArguments` (all of transformers'
`TrainingArguments`), parsed by `HfArgumentParser` (`hf_dflash.training.script.train_argument_parser`), which needs
transformers: so the subparser made here only names the command (it declares no flags and no `--help` of its own,
the top-level parser leaves every flag after `train` unparsed, and `main` hands them on as `args.unparsed_flags`),
and `run` builds the real parser, whose `--help` lists DFlash's flags by group, then the `TrainingArguments` ones.
`run` checks the flags, the target, the drafter to continue, the output folder and every record of `--data` before
any model loads.

Importing `TrainingArguments` costs seconds (torch, peft), so `--help` is rendered once and kept in a cache file
(`train_help_cache`) keyed by everything the text can depend on: the package's source, the versions of transformers,
peft and accelerate, and the terminal width. Later `--help`s print the file without importing either.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

from .errors import usage_errors
from .flags import HelpFormatter, RaisesUsageErrors, check_input_file, check_model, check_output_folder

DESCRIPTION = """\
Train a DFlash drafter for --target on the records `hf-dflash data` wrote (--data), then save it with its model card
in --output_dir. DFlash's own flags come first; every transformers TrainingArguments field is a flag too (listed
last). A boolean flag is --flag alone or --flag true|false. Under `accelerate launch -m hf_dflash.cli train ...` it
trains on several processes."""


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `train` command's parser to `subparsers` (flags left to `HfArgumentParser`) and return it."""
    parser = subparsers.add_parser(
        "train",
        help="train a drafter (run `hf-dflash train --help` for its flags)",
        description="Train a drafter. Every TrainingArguments field is a flag: `hf-dflash train --help` lists them.",
        add_help=False,  # `--help` goes on to the parser `run` builds, whose help lists the training flags
    )
    parser.set_defaults(takes_unparsed_flags=True)
    return parser


def train_parser() -> argparse.ArgumentParser:
    """The `hf-dflash train` parser (`train_argument_parser`), with this command line's help and errors."""
    from transformers import HfArgumentParser

    from hf_dflash.training.script import train_argument_parser

    class TrainFlagParser(RaisesUsageErrors, HfArgumentParser):
        """`HfArgumentParser` whose errors are one-line `UsageError`s, like every other command's."""

    return train_argument_parser(
        TrainFlagParser,
        prog="hf-dflash train",
        usage="hf-dflash train --data FILE.jsonl --output_dir DIR [--target T] [flags]",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )


HELP_PACKAGES = ("transformers", "peft", "accelerate")  # whose fields `train --help` lists


def train_help_cache() -> Path:
    """The file that holds `hf-dflash train --help` for this installation and terminal width."""
    package = Path(__file__).resolve().parent.parent
    key = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):  # every source file: no list of the ones that declare flags to keep
        key.update(path.read_bytes())
    for name in HELP_PACKAGES:
        key.update(_installed_version(name).encode())
    key.update(str(shutil.get_terminal_size().columns).encode())
    cache = Path(os.environ.get("HF_DFLASH_CACHE") or Path.home() / ".cache" / "hf_dflash")
    return cache / "help" / f"train-{key.hexdigest()[:16]}.txt"


def _installed_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def print_help() -> None:
    """`hf-dflash train --help`: from its cache file, or rendered by the parser (and cached)."""
    from hf_dflash.atomic_files import write_text_atomic

    cache = train_help_cache()
    if cache.is_file():
        sys.stdout.write(cache.read_text())
        return
    text = train_parser().format_help()
    try:
        write_text_atomic(cache, text)
    except OSError:  # a read-only home: the help still prints, only slower next time
        pass
    sys.stdout.write(text)


def run(args: argparse.Namespace) -> int:
    """Parse `args.unparsed_flags`, check them, train, print the summary (on the main process)."""
    if {"-h", "--help"} & set(args.unparsed_flags):
        print_help()
        raise SystemExit(0)  # as argparse ends every other command's --help
    parser = train_parser()
    from transformers.utils import logging as hf_logging

    from hf_dflash.training.script import check_train_inputs, parse_train_args, train, training_records

    with usage_errors(ValueError):  # the dataclasses' own checks (`__post_init__`)
        script, training_args = parse_train_args(args.unparsed_flags, parser=parser)
    check_model(script.target, "target", "--target", revision=script.revision)
    if script.init_draft is not None:
        check_model(script.init_draft, "drafter", "--init_draft")
    check_input_file(script.data, "--data")
    check_output_folder(training_args.output_dir, "--output_dir")
    with usage_errors(ValueError, OSError):
        check_train_inputs(script, training_args)
        dataset = training_records(script)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.INFO if training_args.should_log else hf_logging.WARNING)  # the progress
    try:
        with usage_errors(OSError, ModuleNotFoundError):  # a model that cannot be loaded (missing, corrupt)
            result = train(script, training_args, dataset=dataset)
    finally:
        hf_logging.set_verbosity(verbosity)
    if training_args.process_index == 0:
        print(result.summary())
    return 0
