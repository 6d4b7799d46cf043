"""`hf-dflash demo`: one prompt on a real target, decoded three ways, with the tokens/s of each and whether they agree.

The three paths are plain `target.generate`, transformers' `generate(assistant_model=draft)` and
`hf_dflash.speculative_generate`, all greedy on the same inputs and on the models as prepared (`--cpu_kernels`).
`hf_dflash.bench.paths.compare_decoding_paths` does the work; `run` checks the names it is given, loads, prints and
exits 1 when the outputs differ. The drafter is `--draft`, else the one committed for a packaged target in the source
checkout (`hf_dflash.offline.committed_drafter`), else, with `--untrained`, a fresh one. Both drafted paths plan from one `VerifyPlanner`, whose costs are measured before any
timing.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_dflash.bench.paths import PathComparison

from hf_dflash.arguments import PACKAGED
from hf_dflash.offline import committed_drafter

from .errors import LOAD_ERRORS, UsageError, usage_errors
from .flags import (
    add_bool_flag,
    add_cpu_kernel_flag,
    add_target_flags,
    check_draft,
    check_target,
    positive_int,
    prepare_cpu_kernels,
    target_arguments,
)

DEFAULT_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half "
    "as many clips in May. How many clips did Natalia sell altogether in April and May?"
)


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `demo` command's parser to `subparsers` and return it."""
    parser = subparsers.add_parser(
        "demo",
        help="generate on a real model with and without a DFlash drafter",
        usage="hf-dflash demo [--target T] [--draft DIR | --untrained] [--prompt TEXT] [flags]",
        description="Decode one prompt three ways (plain generate, assisted generate with the drafter, "
        "hf_dflash.speculative_generate) and print each one's tokens/s and whether their outputs agree.",
    )
    add_target_flags(parser)
    group = parser.add_argument_group("drafter")
    group.add_argument(
        "--draft",
        default=None,
        help="drafter folder or Hub id (default: the drafter committed for a packaged --target, in a git checkout)",
    )
    add_bool_flag(group, "untrained", help="use a fresh, untrained drafter instead (no speed-up; outputs still match)")
    group.add_argument("--block_size", type=positive_int, default=8, help="block size of an --untrained drafter")
    group = parser.add_argument_group("decoding")
    group.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user turn to answer (default: a GSM8K question)")
    group.add_argument("--max_new_tokens", type=positive_int, default=64, help="tokens to generate on each path")
    add_cpu_kernel_flag(group)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when the three outputs are identical, 1 when not (a user error raises `UsageError`)."""
    draft_path = _check(args)
    import torch

    from hf_dflash import VerifyPlanner, loading
    from hf_dflash.bench.paths import compare_decoding_paths
    from hf_dflash.data.chat import encode_messages

    with usage_errors(*LOAD_ERRORS):
        target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
        draft = _drafter(draft_path, target, tokenizer, args.block_size)
    print(f"target {args.target} on {target.device} in {str(target.dtype).removeprefix('torch.')}")
    prepare_cpu_kernels(args.cpu_kernels, target, draft)
    input_ids = torch.tensor([encode_messages(tokenizer, [{"role": "user", "content": args.prompt}])])
    inputs = {
        "input_ids": input_ids.to(target.device),
        "attention_mask": torch.ones_like(input_ids, device=target.device),
    }
    planner = VerifyPlanner()
    costs = planner.costs_for(target, draft, batch_size=1)  # measured once, before any timing
    print(f"target forward over 1..{len(costs.verify)} tokens costs {costs.relative()} x one token")
    comparison = compare_decoding_paths(target, draft, inputs, max_new_tokens=args.max_new_tokens, planner=planner)
    _print_comparison(comparison, tokenizer)
    return 0 if comparison.identical else 1


def _check(args: argparse.Namespace) -> str | None:
    """The drafter to load (None: a fresh one), after refusing what cannot run: an unknown target first, then a
    missing drafter, an empty prompt."""
    kind = check_target(args)
    if not args.prompt.strip():
        raise UsageError("--prompt is empty. Give the text of a user turn.")
    if args.draft is not None:
        check_draft(args)
        return args.draft
    if args.untrained:
        return None
    draft_path = committed_drafter(args.target) if kind == PACKAGED else None
    if draft_path is None:
        where = (
            "in this install (an installed wheel carries none; they are in the git repository's drafters/ folder)"
            if kind == PACKAGED
            else "(only the packaged targets have one)"
        )
        raise UsageError(
            f"no committed drafter for target {args.target} {where}. Pass --draft DIR or a Hub id, or --untrained "
            "for a fresh drafter"
        )
    return draft_path


def _drafter(draft_path: str | None, target, tokenizer, block_size: int):
    """The drafter at `draft_path`, or a fresh, untrained one (seeded) when there is none."""
    import torch

    from hf_dflash import DFlashForDrafting, loading

    if draft_path:
        draft = loading.load_draft(draft_path, target)
        print(f"drafter: {draft_path}")
        return draft
    torch.manual_seed(0)
    draft = DFlashForDrafting.from_target(target, num_hidden_layers=1, block_size=block_size, tokenizer=tokenizer)
    print("drafter: fresh and UNTRAINED (expect tau near 1 and no speed-up; the output is still the target's own)")
    return draft


def _print_comparison(comparison: PathComparison, tokenizer) -> None:
    """The prompt and the text, each path's rate and seconds, tau, the agreement, and the summary as JSON last."""
    from hf_dflash.bench.paths import PLAIN

    print(
        "prompt:", tokenizer.decode(comparison.sequences[PLAIN][0, : comparison.prompt_len], skip_special_tokens=True)
    )
    print("answer:")
    print(tokenizer.decode(comparison.sequences[PLAIN][0, comparison.prompt_len :], skip_special_tokens=True))
    print()
    rates = comparison.tokens_per_second()
    for name, seconds in comparison.seconds.items():
        print(f"{name:34s} {rates[name]:7.1f} tokens/s   {seconds:6.2f} s")
    stats = comparison.stats
    print(
        f"tau (tokens per target forward): {stats.tau:.2f}, "
        f"{stats.verified_drafts_per_round:.2f} proposals verified per round"
    )
    print(f"identical output on all three paths: {comparison.identical}")
    print(json.dumps(comparison.summary()))
