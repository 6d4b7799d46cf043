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
import sys

from .flags import add_draft_flags, add_target_flags, target_arguments, target_gguf


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `export` command's parser to `subparsers` and return it."""
    from hf_dflash.engines.export import ENGINES

    parser = subparsers.add_parser(
        "export", help="write a drafter for a serving engine (llama.cpp, OpenVINO, vLLM, SGLang)"
    )
    add_target_flags(parser)
    add_draft_flags(parser)
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--output", required=True, help="folder to write (the engine's files and serving.json)")
    parser.add_argument(
        "--target_gguf", default=None, help="llama.cpp: the target's GGUF (default: a packaged target's own)"
    )
    parser.add_argument(
        "--full_vocabulary",
        action="store_true",
        help="no reduced draft vocabulary: the draft drafts over the target's head (engines that take no d2t)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Export; 0, or 2 when the engine cannot serve this drafter or target (the reason is printed)."""
    from hf_dflash import loading
    from hf_dflash.engines.export import export_for_engine

    engine_target = _engine_target(args)  # a missing engine or target file is refused before anything loads
    target, _ = loading.load_target_from_arguments(target_arguments(args))
    draft = loading.load_draft(args.draft, target, revision=args.draft_revision, base_draft=args.base_draft)
    try:
        recipe = export_for_engine(
            draft, target, args.engine, args.output, target_id=args.target, full_vocabulary=args.full_vocabulary,
            **engine_target,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-dflash export: error: {error}", file=sys.stderr)
        return 2
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

        try:
            find_openvino()
        except FileNotFoundError as error:
            raise SystemExit(f"hf-dflash export: error: {error}") from None
        return {"target_folder": _target_folder(args.target)}
    return {}


def _llama_cpp_target(args: argparse.Namespace) -> dict:
    """The target's transformers folder and GGUF, for a packaged target name or a folder with `--target_gguf`."""
    gguf = target_gguf(args.target, args.target_gguf)
    if gguf is None:
        raise SystemExit(f"hf-dflash export: error: --engine llama.cpp needs --target_gguf for {args.target}")
    return {"target_folder": _target_folder(args.target), "target_gguf": gguf}


def _target_folder(target: str) -> str:
    """The target's transformers folder an engine's exporter reads: a packaged target's converted one, else `target`."""
    from hf_dflash.targets import KNOWN_TARGETS, converted_target_folder

    return str(converted_target_folder(target)) if target in KNOWN_TARGETS else target
