"""The `hf-dflash` command line: `main` dispatches to one module per command.

    hf-dflash demo  [--target T] [--draft DIR] [--prompt TEXT] [--max_new_tokens N]
    hf-dflash data  [--target T] --source sharegpt --source synthetic --num_prompts N --output FILE.jsonl
    hf-dflash train [--target T] --data FILE.jsonl --output_dir DIR [--block_size 8 ...] (every TrainingArguments flag)
    hf-dflash bench [--target T] --draft DIR [--datasets gsm8k humaneval mt-bench:10] [--plain_threads 1]
    hf-dflash card  DIR
    hf-dflash export --draft DIR --engine llama.cpp|vllm|sglang --output OUT

Each command module (`demo`, `data`, `train`, `card`, `bench`, `export`) has `make_parser(subparsers)`, which adds its
subparser, and `run(args) -> int`, the exit code; the flags several commands share are in `flags`. Building the
parsers imports neither torch nor transformers, so `--help` answers at once; each `run` checks what it can (names,
paths, files) before its heavy imports and the model loads. `train`'s flags are `HfArgumentParser`'s (built in its
`run`, since `TrainingArguments` needs transformers): its subparser asks (by `takes_unparsed_flags`) for the flags the
top-level parser leaves unparsed, which every other command refuses.

A user error (a `UsageError` raised by a check or a parser) is printed as one line on stderr,
`hf-dflash <command>: error: <problem>. <fix>`, with exit status 2; `hf-dflash --debug <command> ...` shows its
traceback instead.
"""

from __future__ import annotations

import sys

from . import bench, card, data, demo, export, train
from .errors import UsageError
from .flags import FlagParser, parser_error

COMMANDS = {"train": train, "demo": demo, "card": card, "bench": bench, "data": data, "export": export}


def make_parser() -> FlagParser:
    """The `hf-dflash` parser with every command's subparser (`train`'s flags are parsed in its `run`)."""
    parser = FlagParser(
        prog="hf-dflash",
        description="Lossless speculative decoding with DFlash drafters: run `hf-dflash <command> --help` for a "
        "command's flags.\nFlags are spelled with underscores (--max_new_tokens); the dash spelling works too.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of its one-line message"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>", title="commands")
    for module in COMMANDS.values():
        module.make_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `hf-dflash` on `argv` (default: `sys.argv[1:]`) and return its exit code: 2 for a user error, printed as one
    line on stderr (`--debug` raises it instead, with its traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    try:
        args, unparsed = make_parser().parse_known_args(argv)
        if unparsed and not getattr(args, "takes_unparsed_flags", False):
            raise parser_error(f"hf-dflash {args.command}", f"unrecognized arguments: {' '.join(unparsed)}")
        args.unparsed_flags = unparsed
        return COMMANDS[args.command].run(args)
    except UsageError as error:
        if _debug(argv):
            raise
        prog = error.prog or (f"hf-dflash {command}" if command in COMMANDS else "hf-dflash")
        message = " ".join(str(error).splitlines())
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2


def _debug(argv: list[str]) -> bool:
    """Whether `--debug` (a flag of `hf-dflash` itself) comes before the command."""
    for arg in argv:
        if not arg.startswith("-"):
            return False
        if arg == "--debug":
            return True
    return False


__all__ = ["UsageError", "main", "make_parser"]
