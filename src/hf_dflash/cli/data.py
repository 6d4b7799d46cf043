"""`hf-dflash data`: regenerate training responses with the target itself, into a resumable JSONL of records.

`run` first refuses what cannot run (a missing or malformed prompts file, an unknown source, a benchmark set that is not
installed, an unwritable output, an unknown target) before the target loads. The prompts come from
`hf_dflash.data.sources.training_prompts` (benchmark items filtered out); the responses from
the loaded target (`regenerate_responses`) or, with `--server_url`, from an OpenAI-compatible server serving it
(`hf_dflash.data.server`), for which only the target's tokenizer and generation config are loaded. The command shows
the data modules' progress log on stderr and prints a summary of the records, JSON last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from hf_dflash.offline import (
    EVALUATION_SETS,
    KNOWN_PROMPT_SETS,
    SYNTHETIC_SOURCE,
    check_training_source,
    prompt_set_path,
)

from .errors import LOAD_ERRORS, UsageError, usage_errors
from .flags import (
    add_bool_flag,
    add_cpu_kernel_flag,
    add_target_flags,
    check_input_file,
    check_output_file,
    check_target,
    positive_int,
    prepare_cpu_kernels,
    target_arguments,
)


def make_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `data` command's parser to `subparsers` and return it."""
    parser = subparsers.add_parser(
        "data",
        help="regenerate training responses with the target itself (resumable JSONL)",
        description="Answer training prompts with the target itself and write one record a line (input_ids, "
        "loss_mask on the response, prompt_len) to --output, the file `hf-dflash train --data` reads. Rerunning the "
        "same command resumes.",
        usage="hf-dflash data --source SOURCE [--source ...] --output FILE.jsonl [--target T] [flags]",
        epilog=PROMPTS_FILE_HELP,
    )
    add_target_flags(parser)
    group = parser.add_argument_group("prompts")
    group.add_argument(
        "--source",
        action="append",
        required=True,
        metavar="SOURCE",
        help=f"where prompts come from: {', '.join(training_set_names())}, synthetic (written by the target), or a "
        "prompts file ending .jsonl (below); repeat for several",
    )
    group.add_argument("--num_prompts", type=positive_int, default=1000, help="prompts per source")
    group.add_argument(
        "--unfiltered_evaluation_set",
        action="append",
        default=[],
        metavar="NAME",
        help="let this benchmark set's items into the training data (e.g. when its package is not installed); repeat",
    )
    group = parser.add_argument_group("generation")
    group.add_argument("--max_new_tokens", type=positive_int, default=256, help="tokens per response at most")
    group.add_argument("--max_prompt_tokens", type=positive_int, default=512, help="longer prompts are skipped")
    group.add_argument("--batch_size", type=positive_int, default=8, help="prompts answered together")
    add_bool_flag(group, "do_sample", help="sample responses (default: greedy)")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --do_sample)")
    group.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling's p (with --do_sample)")
    group.add_argument("--seed", type=int, default=0, help="seed of the sampling and of the synthetic prompts")
    add_cpu_kernel_flag(group)
    _add_server_flags(parser)
    group = parser.add_argument_group("output")
    group.add_argument("--output", required=True, help="JSONL of records; rerun the same command to resume")
    return parser


# The prompts-file format `--source FILE.jsonl` reads (`hf_dflash.data.sources.prompts_from_jsonl`).
PROMPTS_FILE_HELP = """\
a prompts file (--source FILE.jsonl) holds one JSON object a line, either
  {"prompt": "What is 2 + 2?"}                                  one user turn
  {"messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"}]}  a chat, cut after its last user turn
("from"/"value" turns, as ShareGPT writes them, work too); "id" and "source" are kept when given. A line whose
prompt is empty or only whitespace, or whose chat has no user turn with text, is refused with its file:line."""


def training_set_names() -> list[str]:
    """The packaged prompt sets that may be training sources (every one but the benchmark sets)."""
    return [name for name in KNOWN_PROMPT_SETS if name not in EVALUATION_SETS]


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Regeneration through an OpenAI-compatible server instead of the loaded target."""
    group = parser.add_argument_group("server (instead of the loaded target)")
    group.add_argument(
        "--server_url",
        default=None,
        help="regenerate through this OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp) serving --target, "
        "e.g. http://localhost:8000/v1; --target then only supplies the tokenizer and chat template",
    )
    group.add_argument("--server_model", default=None, help="model name the server knows (default: its first model)")
    group.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight with --server_url")
    group.add_argument("--max_retries", type=int, default=5, help="retries of a failed request, with backoff")
    group.add_argument("--request_timeout", type=float, default=300.0, help="seconds before a request is retried")
    group.add_argument(
        "--server_extra_body",
        type=json_object,
        default=None,
        metavar="JSON",
        help="JSON of engine-specific request fields, e.g. '{\"add_special_tokens\": false}' on vLLM (the chat "
        "template already holds BOS); the OPENAI_API_KEY environment variable, when set, is sent as the API key",
    )


def json_object(text: str) -> dict:
    """A JSON object given as a flag's value."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {type(value).__name__}")
    return value


def check(args: argparse.Namespace) -> None:
    """Refuse what cannot run, before the heavy imports: an unknown or uninstalled source, a missing prompts file, a
    source the server cannot answer, sampling settings out of range, an unwritable output, an unknown target."""
    for source in args.source:
        with usage_errors(ValueError, ModuleNotFoundError, FileNotFoundError):
            check_training_source(source)
            if source in KNOWN_PROMPT_SETS:
                prompt_set_path(source)  # installed, with its data file
        if source.endswith(".jsonl"):
            check_input_file(source, "--source")
    if args.server_url and SYNTHETIC_SOURCE in args.source:
        raise UsageError("--source synthetic needs the target itself. Drop --server_url for it (run it separately)")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UsageError(
            f"--temperature {args.temperature} --top_p {args.top_p}: the temperature must be above 0 and top_p in "
            "(0, 1]"
        )
    check_output_file(args.output, "--output")
    check_target(args)


def run(args: argparse.Namespace) -> int:
    """Regenerate the responses of `--source`'s prompts into `--output` (resuming it) and summarize the records."""
    check(args)
    from pathlib import Path

    from hf_dflash.data.chat import end_of_turn_ids
    from hf_dflash.data.evaluation import evaluation_prompts
    from hf_dflash.data.records import records_summary
    from hf_dflash.data.sources import check_training_sources, training_prompts

    _show_progress_log()
    start = time.perf_counter()
    output = Path(args.output)
    with usage_errors(ValueError, OSError, ModuleNotFoundError, RuntimeError):  # all before the target loads
        check_training_sources(args.source)  # every line of a prompts file
        evaluation = evaluation_prompts(args.unfiltered_evaluation_set)
    with usage_errors(*LOAD_ERRORS):
        target, tokenizer, generation_config = _load(args)
    if target is not None:
        prepare_cpu_kernels(args.cpu_kernels, target)
    stop_ids = end_of_turn_ids(generation_config, tokenizer)
    prompts = training_prompts(
        args.source,
        args.num_prompts,
        target=target,
        tokenizer=tokenizer,
        seed=args.seed,
        batch_size=args.batch_size,
        synthetic_cache=output.with_name(f"{output.stem}.synthetic-prompts.jsonl"),
        evaluation=evaluation,
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
        tokenizer, generation_config = loading.load_tokenizer_and_generation_config(target_arguments(args))
        return None, tokenizer, generation_config
    target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
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
