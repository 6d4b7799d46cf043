"""`hf-dflash train`: train a drafter for a target on a regenerated dataset, then save and card it.

Its flags are every field of `TrainScriptArguments` and `DFlashTrainingArguments` (all of transformers'
`TrainingArguments`), parsed by `HfArgumentParser` in `hf_dflash.training.script.parse_train_args`, not by argparse.
So the subparser made here only names the command: it declares no flags and no `--help` of its own, the top-level
parser leaves every flag after `train` unparsed, and `main` hands them on as `args.unparsed_flags`;
`hf-dflash train --help` therefore prints `HfArgumentParser`'s help, which lists every training flag.
"""

from __future__ import annotations

import argparse


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `train` command's parser to `subparsers` (flags left to `HfArgumentParser`) and return it."""
    parser = subparsers.add_parser(
        "train",
        help="train a drafter (run `hf-dflash train --help` for its options)",
        description="Train a drafter. Every TrainingArguments field is a flag: `hf-dflash train --help` lists them.",
        add_help=False,  # `--help` goes on to HfArgumentParser, whose help lists the training flags
    )
    parser.set_defaults(takes_unparsed_flags=True)
    return parser


def run(args: argparse.Namespace) -> int:
    """Parse `args.unparsed_flags` with `HfArgumentParser`, train, print the summary (on the main process)."""
    from transformers.utils import logging as hf_logging

    from hf_dflash.training.script import parse_train_args, train

    script, training_args = parse_train_args(args.unparsed_flags)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.INFO if training_args.should_log else hf_logging.WARNING)  # the progress
    try:
        result = train(script, training_args)
    finally:
        hf_logging.set_verbosity(verbosity)
    if training_args.process_index == 0:
        print(result.summary())
    return 0
