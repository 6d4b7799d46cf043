"""`hf-dflash export`: a drafter written for one serving engine, with the commands that serve it.

    hf-dflash export --draft DIR --engine llama.cpp [--target smollm2-135m-instruct] --output OUT
    hf-dflash export --draft DIR --engine openvino [--target smollm2-135m-instruct | FOLDER] --output OUT
    hf-dflash export --draft DIR --engine vllm|sglang --target HUB_ID_OR_FOLDER --output OUT

`hf_dflash.engines.export.export_for_engine` does the work; llama.cpp needs its tools built
(`bash scripts/install_engines.sh`) and the target's GGUF: a packaged target's own, or `--target_gguf`; OpenVINO its
venv (`bash scripts/install_engines.sh --openvino`) and the target's transformers folder (a packaged target's own).
"""

from __future__ import annotations

import argparse
import json

from hf_dflash.engines import ENGINES

from .errors import LOAD_ERRORS, UsageError, usage_errors
from .flags import (
    add_bool_flag,
    add_draft_flags,
    add_target_flags,
    check_draft,
    check_input_file,
    check_output_folder,
    check_target,
    target_arguments,
    target_gguf,
)


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `export` command's parser to `subparsers` and return it."""
    parser = subparsers.add_parser(
        "export",
        help="write a drafter for a serving engine (llama.cpp, OpenVINO, vLLM, SGLang)",
        description="Write a drafter in a serving engine's format, with serving.json and the commands that serve it.",
        usage="hf-dflash export --draft DIR --engine ENGINE --output DIR [--target T] [flags]",
    )
    add_target_flags(parser)
    add_draft_flags(parser)
    group = parser.add_argument_group("engine")
    group.add_argument("--engine", required=True, choices=ENGINES, help="the serving engine to write for")
    group.add_argument(
        "--target_gguf", default=None, help="llama.cpp: the target's GGUF (default: a packaged target's own)"
    )
    add_bool_flag(
        group,
        "full_vocabulary",
        help="no reduced draft vocabulary: the draft drafts over the target's head (engines that take no d2t)",
    )
    group = parser.add_argument_group("output")
    group.add_argument("--output", required=True, help="folder to write (the engine's files and serving.json)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Export; 0 (a drafter or target the engine cannot serve raises `UsageError`, the reason in its message)."""
    check_target(args)
    check_draft(args)
    check_output_folder(args.output, "--output")
    if args.target_gguf is not None:
        check_input_file(args.target_gguf, "--target_gguf")
    engine_target = _engine_target(args)  # a missing engine or target file is refused before anything loads
    from hf_dflash import loading
    from hf_dflash.engines.export import export_for_engine

    with usage_errors(*LOAD_ERRORS):
        target, _ = loading.load_target_from_arguments(target_arguments(args))
        draft = loading.load_draft(args.draft, target, revision=args.draft_revision, base_draft=args.base_draft)
    with usage_errors(ValueError, FileNotFoundError):
        recipe = export_for_engine(
            draft, target, args.engine, args.output, target_id=args.target, full_vocabulary=args.full_vocabulary,
            **engine_target,
        )  # fmt: skip
    for command in recipe.commands:
        print(command)
    print(json.dumps({"engine": recipe.engine, "draft": recipe.draft, "serving": f"{args.output}/serving.json"}))
    return 0


def _engine_target(args: argparse.Namespace) -> dict:
    """What the engine needs of the target beyond the loaded model (llama.cpp, OpenVINO), checked up front."""
    if args.engine == "llama.cpp":
        return _llama_cpp_target(args)
    if args.engine == "openvino":
        from hf_dflash.engines.openvino import find_openvino

        with usage_errors(FileNotFoundError):
            find_openvino()
        return {"target_folder": _target_folder(args.target)}
    return {}


def _llama_cpp_target(args: argparse.Namespace) -> dict:
    """The target's transformers folder and GGUF, for a packaged target name or a folder with `--target_gguf`."""
    gguf = target_gguf(args.target, args.target_gguf)
    if gguf is None:
        raise UsageError(
            f"--engine llama.cpp needs the target's GGUF and {args.target} is not a packaged target. Pass --target_gguf"
        )
    return {"target_folder": _target_folder(args.target), "target_gguf": gguf}


def _target_folder(target: str) -> str:
    """The target's transformers folder an engine's exporter reads: a packaged target's converted one, else `target`."""
    from hf_dflash.offline import KNOWN_TARGETS

    if target not in KNOWN_TARGETS:
        return target
    from hf_dflash.targets import converted_target_folder

    with usage_errors(ModuleNotFoundError, OSError):
        return str(converted_target_folder(target))
