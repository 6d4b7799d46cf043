"""The `hf-dflash` command line: `main` dispatches to one module per command.

    hf-dflash demo  [--target T] [--draft DIR] [--prompt TEXT] [--max_new_tokens N]
    hf-dflash data  [--target T] --source sharegpt --source synthetic --num_prompts N --output FILE.jsonl
    hf-dflash train [--target T] --data FILE.jsonl --output_dir DIR [--block_size 8 ...] (every TrainingArguments flag)
    hf-dflash bench [--target T] --draft DIR [--datasets gsm8k humaneval mt-bench:10] [--plain_threads 1]
    hf-dflash card  DIR
    hf-dflash export --draft DIR --engine llama.cpp|vllm|sglang --output OUT

Each command module (`demo`, `data`, `train`, `card`, `bench`, `export`) has `make_parser(subparsers)`, which adds its
subparser, and `run(args) -> int`, the exit code; the flags several commands share are in `flags`. Heavy imports
happen inside `run`. `train`'s flags are `HfArgumentParser`'s, not argparse's: its subparser asks (by the default
`takes_unparsed_flags`) for the flags the parser leaves unparsed, which every other command refuses.
"""

from __future__ import annotations

import sys

from . import bench, card, data, demo, export, train
from .flags import FlagParser

COMMANDS = {"train": train, "demo": demo, "card": card, "bench": bench, "data": data, "export": export}


def main(argv: list[str] | None = None) -> int:
    """Run `hf-dflash` on `argv` (default: `sys.argv[1:]`) and return its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = FlagParser(prog="hf-dflash", description="Speculative decoding with DFlash drafters.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.make_parser(subparsers)
    args, unparsed = parser.parse_known_args(argv)
    if unparsed and not getattr(args, "takes_unparsed_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")
    args.unparsed_flags = unparsed
    return COMMANDS[args.command].run(args)


__all__ = ["main"]
