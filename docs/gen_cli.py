"""The CLI reference, rendered from the parsers: a mkdocs hook (`hooks:` in mkdocs.yml) and a small script.

`docs/cli.md` holds one marker per command, `<!-- cli-help: NAME -->` (`hf-dflash` for the top level). When mkdocs
builds the site, `on_page_markdown` replaces each marker with what `hf-dflash NAME --help` prints, run in-process
through `hf_dflash.cli.main`. Nothing is parsed or copied from the help, so the page says whatever the parsers say,
however their text and groups change. `python docs/gen_cli.py [NAME ...]` prints the rendered help.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys

MARKER = re.compile(r"<!-- cli-help: ([\w.-]+) -->")
TOP_LEVEL = "hf-dflash"
COLUMNS = "100"  # argparse wraps to the terminal's width; a fixed one keeps the page the same on every machine


def commands() -> list[str]:
    """The command names `hf-dflash` dispatches to."""
    from hf_dflash.cli import COMMANDS

    return list(COMMANDS)


def command_help(name: str) -> str:
    """What `hf-dflash NAME --help` prints (`hf-dflash --help` for `TOP_LEVEL`)."""
    from hf_dflash.cli import main

    argv = ["--help"] if name == TOP_LEVEL else [name, "--help"]
    printed = io.StringIO()
    saved_argv, saved_columns = sys.argv, os.environ.get("COLUMNS")
    # `train`'s help comes from HfArgumentParser, which names itself after argv[0].
    sys.argv = [TOP_LEVEL if name == TOP_LEVEL else f"{TOP_LEVEL} {name}"]
    os.environ["COLUMNS"] = COLUMNS
    try:
        with contextlib.redirect_stdout(printed):
            main(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise RuntimeError(f"`hf-dflash {' '.join(argv)}` exited {exit_.code}") from exit_
    else:
        raise RuntimeError(f"`hf-dflash {' '.join(argv)}` printed no help and did not exit")
    finally:
        sys.argv = saved_argv
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns
    return printed.getvalue().rstrip()


def render(markdown: str) -> str:
    """`markdown` with every marker replaced by its command's help as a text block."""
    return MARKER.sub(lambda match: f"```text\n{command_help(match.group(1))}\n```", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: render the CLI reference page."""
    return render(markdown) if page.file.src_uri == "cli.md" else markdown


if __name__ == "__main__":
    for name in sys.argv[1:] or [TOP_LEVEL, *commands()]:
        print(f"## {name}\n\n{command_help(name)}\n")
