"""`hf-dflash card DIR`: write or refresh the model card (README.md) of a drafter folder.

The card is built from the folder (`hf_dflash.model_card.card_info_from_folder`); `--acceptance_json` adds measured
sets to the acceptance `training_info.json` records, and the facts given as flags (acceptance, license) are recorded
there only after the card was written, so a refused card changes nothing.
"""

from __future__ import annotations

import argparse
import json

from .errors import usage_errors
from .flags import check_input_file, check_input_folder


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `card` command's parser to `subparsers` and return it."""
    parser = subparsers.add_parser(
        "card",
        help="write or refresh the model card (README.md) of a drafter folder",
        description="Write the model card (README.md) of a drafter folder from its config.json and training_info.json.",
    )
    parser.add_argument("dir", metavar="DIR", help="drafter folder (config.json, optional training_info.json)")
    parser.add_argument("--base_model", default=None, help="target repo id (default: from training_info.json)")
    parser.add_argument(
        "--repo_id",
        default=None,
        help="Hub repo id of the drafter, used in the card's snippets (default: <your-org>/<target>-DFlash-b<B>)",
    )
    parser.add_argument(
        "--base_drafter", default=None, help="a drafter adapter's base drafter (Hub id); default: training_info.json"
    )
    parser.add_argument(
        "--license", default=None, help="license of the drafter (default apache-2.0; kept for later cards)"
    )
    parser.add_argument(
        "--acceptance_json",
        default=None,
        help='JSON {dataset: {"tau", "speedup", "conditions"}}: added to the acceptance in training_info.json (a set '
        "measured again replaces its entry), which the card shows",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the card; 0 (the folder or the measured acceptance that cannot make one raises `UsageError`)."""
    check_input_folder(args.dir, "DIR")
    if args.acceptance_json:
        check_input_file(args.acceptance_json, "--acceptance_json")
    from hf_dflash.model_card import card_info_from_folder, record_card_facts, write_model_card

    with usage_errors(FileNotFoundError, ValueError):
        acceptance = _measured_acceptance(args.dir, args.acceptance_json)
        info = card_info_from_folder(
            args.dir,
            base_model=args.base_model,
            drafter_repo_id=args.repo_id,
            base_drafter=args.base_drafter,
            license=args.license,
            acceptance=acceptance,
        )
    path = write_model_card(args.dir, info)
    facts = {"acceptance": acceptance, "license": args.license}
    if any(value is not None for value in facts.values()):  # after the card: a failed card changes nothing
        record_card_facts(args.dir, {name: value for name, value in facts.items() if value is not None})
    measured = ", ".join(f"{name} tau {result['tau']:.2f}" for name, result in info.acceptance.items())
    print(path)
    print(
        f"drafter for {info.base_model}: block size {info.block_size}, {info.num_hidden_layers} layers, "
        f"{info.layout} layout; {measured or 'acceptance not measured yet'}"
    )
    return 0


def _measured_acceptance(folder: str, acceptance_json: str | None) -> dict | None:
    """The folder's recorded acceptance with the sets of `--acceptance_json` merged in; None without that flag."""
    if not acceptance_json:
        return None
    from hf_dflash.model_card import merged_acceptance

    with open(acceptance_json) as file:
        measured = json.load(file)
    if isinstance(measured, dict) and "acceptance" in measured:  # a bare mapping or a document with that key
        measured = measured["acceptance"]
    return merged_acceptance(folder, measured)
