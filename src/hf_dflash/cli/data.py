"""`hf-dflash data`: regenerate training responses with the target itself, into a resumable JSONL of records.

The prompts come from `hf_dflash.data.regenerate.training_prompts` (benchmark items filtered out); the responses from
the loaded target (`regenerate_responses`) or, with `--server_url`, from an OpenAI-compatible server serving it
(`hf_dflash.data.server`), for which only the target's tokenizer and generation config are loaded. The command shows
the data modules' progress log on stderr and prints a summary of the records, JSON last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from .flags import add_cpu_kernel_flag, add_target_flags, prepare_cpu_kernels, target_arguments


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `data` command's parser to `subparsers` and return it."""
    parser = subparsers.add_parser(
        "data", help="regenerate training responses with the target itself (resumable JSONL)"
    )
    add_target_flags(parser)
    parser.add_argument(
        "--source", action="append", required=True, help="sharegpt, math500, synthetic or a prompts .jsonl; repeat"
    )
    parser.add_argument("--num_prompts", type=int, default=1000, help="prompts per source")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--max_prompt_tokens", type=int, default=512, help="longer prompts are skipped")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--do_sample", action="store_true", help="sample responses (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    add_cpu_kernel_flag(parser)
    parser.add_argument("--output", required=True, help="JSONL of records; rerun the same command to resume")
    _add_server_flags(parser)
    parser.add_argument(
        "--unfiltered_evaluation_set",
        action="append",
        default=[],
        metavar="NAME",
        help="let this benchmark set's items into the training data (e.g. when its package is not installed); repeat",
    )
    return parser


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Regeneration through an OpenAI-compatible server instead of the loaded target."""
    parser.add_argument(
        "--server_url",
        default=None,
        help="regenerate through this OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp) serving --target, "
        "e.g. http://localhost:8000/v1; --target then only supplies the tokenizer and chat template",
    )
    parser.add_argument("--server_model", default=None, help="model name the server knows (default: its first model)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight with --server_url")
    parser.add_argument("--max_retries", type=int, default=5, help="retries of a failed request, with backoff")
    parser.add_argument("--request_timeout", type=float, default=300.0, help="seconds before a request is retried")
    parser.add_argument(
        "--server_extra_body",
        type=json.loads,
        default=None,
        help="JSON of engine-specific request fields, e.g. '{\"add_special_tokens\": false}' on vLLM (the chat "
        "template already holds BOS); the OPENAI_API_KEY environment variable, when set, is sent as the API key",
    )


def run(args: argparse.Namespace) -> int:
    """Regenerate the responses of `--source`'s prompts into `--output` (resuming it) and summarize the records."""
    from pathlib import Path

    from hf_dflash.data.chat import end_of_turn_ids
    from hf_dflash.data.records import records_summary
    from hf_dflash.data.sources import training_prompts

    _show_progress_log()
    start = time.perf_counter()
    output = Path(args.output)
    target, tokenizer, generation_config = _load(args)
    stop_ids = end_of_turn_ids(generation_config, tokenizer)
    prompts = training_prompts(
        args.source,
        args.num_prompts,
        target=target,
        tokenizer=tokenizer,
        seed=args.seed,
        batch_size=args.batch_size,
        synthetic_cache=output.with_name(f"{output.stem}.synthetic-prompts.jsonl"),
        unfiltered_evaluation_sets=args.unfiltered_evaluation_set,
        progress=True,
    )
    _regenerate(args, target, tokenizer, prompts, output, stop_ids)
    counts = records_summary(output, stop_ids)
    summary = {"path": counts["path"], "records": counts["records"], "prompts": len(prompts)} | counts
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(
        f"{summary['records']} records ({summary['ended_with_eos']} ended their turn, the rest hit --max_new_tokens), "
        f"{summary['supervised_tokens']} supervised tokens, {summary['wall_s']} s -> {output}"
    )
    print(json.dumps(summary))
    return 0


def _show_progress_log() -> None:
    """Show the data modules' progress notes (resume, filtered prompts) on stderr."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("hf_dflash").addHandler(handler)
    logging.getLogger("hf_dflash").setLevel(logging.INFO)


def _load(args: argparse.Namespace):
    """(target, tokenizer, generation config): the target is None with `--server_url`, whose server answers."""
    from hf_dflash import loading

    if args.server_url:  # the served target answers; only its tokenizer and generation config are read here
        if "synthetic" in args.source:
            raise SystemExit("hf-dflash data: --source synthetic needs the target itself; drop --server_url for it.")
        tokenizer, generation_config = loading.load_tokenizer_and_generation_config(target_arguments(args))
        return None, tokenizer, generation_config
    target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
    prepare_cpu_kernels(args.cpu_kernels, target)
    return target, tokenizer, target.generation_config


def _regenerate(args: argparse.Namespace, target, tokenizer, prompts: list, output, stop_ids: list[int]) -> None:
    """Regenerate the responses locally on the loaded target, or through the server at `--server_url`."""
    from hf_dflash.data.regenerate import regenerate_responses

    sampling = {"do_sample": args.do_sample, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    budget = {"max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens}
    if not args.server_url:
        regenerate_responses(target, tokenizer, prompts, output, batch_size=args.batch_size, **sampling, **budget)
        return
    from hf_dflash.data.server import regenerate_responses_with_server

    regenerate_responses_with_server(
        tokenizer,
        prompts,
        output,
        server_url=args.server_url,
        model=args.server_model,
        stop_ids=stop_ids,
        concurrency=args.concurrency,
        max_retries=args.max_retries,
        timeout_s=args.request_timeout,
        api_key=os.environ.get("OPENAI_API_KEY"),
        extra_body=args.server_extra_body,
        **sampling,
        **budget,
    )
