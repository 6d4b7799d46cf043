"""`hf-dflash` command line. Heavy imports happen inside the subcommands so `--help` is instant.

hf-dflash demo [--target T] [--draft DIR] [--prompt TEXT] [--max_new_tokens N]
hf-dflash data [--target T] --source sharegpt --source synthetic --num_prompts N --output FILE.jsonl [--server_url URL]
hf-dflash train [--target T] --data FILE.jsonl --output_dir DIR [--block_size 8 ...]  (and every TrainingArguments flag)
hf-dflash bench [--target T] --draft DIR [--datasets gsm8k humaneval mt-bench:10] [--plain_threads 1] [--do_sample]
hf-dflash card DIR

Every command that loads a target takes the same target flags (`hf_dflash.loading.TargetArguments`): `--target` (a
packaged name, a model folder or a Hub id), `--revision`, `--trust_remote_code`, `--device`, `--dtype`,
`--attn_implementation`. Flags are documented with underscores, as transformers' are; the dash spelling
(`--max-new-tokens`) is accepted everywhere too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from hf_dflash.loading import TargetArguments


class FlagParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose long flags answer to both spellings, `--max_new_tokens` and `--max-new-tokens`, as
    `HfArgumentParser` (behind `hf-dflash train`) does; sub-commands inherit the class."""

    def add_argument(self, *names, **kwargs):
        spellings = ["--" + name[2:].replace("-", "_") if name.startswith("--") else name for name in names]
        spellings += ["--" + name[2:].replace("_", "-") for name in spellings if name.startswith("--")]
        return super().add_argument(*dict.fromkeys(spellings), **kwargs)


def add_target_flags(parser: argparse.ArgumentParser) -> None:
    """The fields of `TargetArguments` as flags, with their defaults and help (one definition for every command)."""
    for field in dataclasses.fields(TargetArguments):
        aliases = field.metadata.get("aliases", [])
        if field.type in (bool, "bool"):
            parser.add_argument(f"--{field.name}", *aliases, action="store_true", help=field.metadata["help"])
        else:
            parser.add_argument(f"--{field.name}", *aliases, default=field.default, help=field.metadata["help"])


def add_cpu_kernel_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cpu_kernels",
        choices=["fast", "exact", "off"],
        default="fast",
        help="prepare a CPU target and drafter with hf_dflash.optimize_for_cpu: fast (packed oneDNN linears, "
        "attention without key/value copies: a forward over a block costs little more than one token), exact (also bitwise "
        "equal to one-token forwards, so greedy outputs match plain decoding in any dtype; slower), off (stock)",
    )


def prepare_cpu_kernels(mode: str, target, draft=None):
    """`optimize_for_cpu` on a CPU target (and drafter, fast) as `--cpu_kernels` says; the target's preparation."""
    if mode == "off" or target.device.type != "cpu":
        return None
    from hf_dflash.decoding.cpu_kernels import optimize_target_and_draft_for_cpu

    preparation = optimize_target_and_draft_for_cpu(target, draft, exact=mode == "exact")
    print(f"CPU kernels ({mode}): {preparation.summary()}")
    return preparation


def target_arguments(args: argparse.Namespace) -> TargetArguments:
    """The `TargetArguments` a command's parsed flags name."""
    return TargetArguments(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TargetArguments)})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # TrainingArguments has its own parser (HfArgumentParser)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return run_train(argv[1:])
    parser = FlagParser(prog="hf-dflash", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("train", help="train a drafter (run `hf-dflash train --help` for its options)")
    demo = commands.add_parser("demo", help="generate on a real model with and without a DFlash drafter")
    add_target_flags(demo)
    demo.add_argument(
        "--draft", default=None, help="drafter folder or Hub id; default: the drafter committed for the target, if any"
    )
    demo.add_argument("--untrained", action="store_true", help="use a fresh, untrained drafter instead")
    demo.add_argument(
        "--prompt",
        default="Natalia sold clips to 48 of her friends in April, and then she sold half "
        "as many clips in May. How many clips did Natalia sell altogether in April and May?",
    )
    demo.add_argument("--max_new_tokens", type=int, default=64)
    demo.add_argument("--block_size", type=int, default=8, help="block size of a fresh drafter")
    add_cpu_kernel_flag(demo)
    card = commands.add_parser("card", help="write or refresh the model card (README.md) of a drafter folder")
    card.add_argument("dir", help="drafter folder (config.json, optional training_info.json)")
    card.add_argument("--base_model", default=None, help="target repo id; default: from training_info.json")
    card.add_argument("--repo_id", default=None, help="Hub repo id of the drafter, used in the card's snippets")
    card.add_argument(
        "--base_drafter", default=None, help="a drafter adapter's base drafter (Hub id); default: training_info.json"
    )
    card.add_argument(
        "--license", default=None, help="license of the drafter (default apache-2.0; kept for later cards)"
    )
    card.add_argument(
        "--acceptance_json",
        default=None,
        help='JSON {dataset: {"tau", "speedup", "conditions"}}: added to the acceptance in training_info.json (a set '
        "measured again replaces its entry), which the card shows",
    )
    bench = commands.add_parser(
        "bench",
        help="time every decoding path on real prompts against the fastest plain decoding; check identical outputs",
    )
    add_target_flags(bench)
    bench.add_argument("--draft", required=True, help="drafter folder or Hub id")
    bench.add_argument("--draft_revision", default=None, help="Hub revision of --draft")
    bench.add_argument(
        "--base_draft", default=None, help="the base drafter of a --draft adapter folder (default: the one it records)"
    )
    bench.add_argument(
        "--datasets",
        nargs="+",
        default=["gsm8k", "humaneval", "mt-bench"],
        help="prompt sets; NAME:N takes the first N prompts of NAME instead of --limit (e.g. mt-bench:10)",
    )
    bench.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    bench.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="subset of: plain prompt_lookup native assisted ours ours_chain ours_tree16 ours_full_block ours_argmax "
        "(default: all; ours_chain and ours_tree16 run greedy only, ours_argmax under --do_sample only)",
    )
    bench.add_argument("--full_comparison_limit", type=int, default=None, help="first M prompts of a dataset run all")
    bench.add_argument(
        "--core_methods",
        nargs="+",
        default=None,
        help="what prompts past --full_comparison_limit run (default: plain assisted ours; every plain variant runs "
        "on every prompt)",
    )
    bench.add_argument(
        "--plain_threads",
        nargs="*",
        type=int,
        default=[],
        metavar="N",
        help="also time plain generate at these torch thread counts (method plain_threadsN; the default count is "
        "`plain`); every speedup is against the faster plain of each dataset",
    )
    bench.add_argument("--max_new_tokens", type=int, default=200)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument(
        "--do_sample",
        action="store_true",
        help="sample (outputs are then not compared); adds ours_argmax, the draft's argmax proposed with a one-hot q",
    )
    bench.add_argument("--prompt_lookup_num_tokens", type=int, default=10)
    bench.add_argument("--draft_block_sizes", nargs="*", type=int, default=[4, 8, 16], help="empty: skip")
    bench.add_argument(
        "--batch_sizes", nargs="*", type=int, default=[1, 4, 8], help="batched ours vs batched plain; empty: skip"
    )
    bench.add_argument(
        "--verify",
        choices=["auto", "all"],
        default="auto",
        help="`ours` and `assisted`: plan each round from the target's measured forward costs (auto: a tree, a chain "
        "or a plain step) or verify every proposal (all); ours_chain always plans from the measured costs",
    )
    add_cpu_kernel_flag(bench)
    bench.add_argument("--output", default="bench.json", help="JSON report")
    bench.add_argument("--plot", default=None, help="PNG plot; default: next to --output")
    data = commands.add_parser("data", help="regenerate training responses with the target itself (resumable JSONL)")
    add_target_flags(data)
    data.add_argument(
        "--source", action="append", required=True, help="sharegpt, math500, synthetic or a prompts .jsonl; repeat"
    )
    data.add_argument("--num_prompts", type=int, default=1000, help="prompts per source")
    data.add_argument("--max_new_tokens", type=int, default=256)
    data.add_argument("--max_prompt_tokens", type=int, default=512, help="longer prompts are skipped")
    data.add_argument("--batch_size", type=int, default=8)
    data.add_argument("--do_sample", action="store_true", help="sample responses (default: greedy)")
    data.add_argument("--temperature", type=float, default=1.0)
    data.add_argument("--top_p", type=float, default=1.0)
    data.add_argument("--seed", type=int, default=0)
    add_cpu_kernel_flag(data)
    data.add_argument("--output", required=True, help="JSONL of records; rerun the same command to resume")
    data.add_argument(
        "--server_url",
        default=None,
        help="regenerate through this OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp) serving --target, "
        "e.g. http://localhost:8000/v1; --target then only supplies the tokenizer and chat template",
    )
    data.add_argument("--server_model", default=None, help="model name the server knows (default: its first model)")
    data.add_argument("--concurrency", type=int, default=8, help="requests in flight with --server_url")
    data.add_argument("--max_retries", type=int, default=5, help="retries of a failed request, with backoff")
    data.add_argument("--request_timeout", type=float, default=300.0, help="seconds before a request is retried")
    data.add_argument(
        "--server_extra_body",
        type=json.loads,
        default=None,
        help="JSON of engine-specific request fields, e.g. '{\"add_special_tokens\": false}' on vLLM (the chat "
        "template already holds BOS); the OPENAI_API_KEY environment variable, when set, is sent as the API key",
    )
    data.add_argument(
        "--unfiltered_evaluation_set",
        action="append",
        default=[],
        metavar="NAME",
        help="let this benchmark set's items into the training data (e.g. when its package is not installed); repeat",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
    if args.command == "data":
        return run_data(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "card":
        return run_card(args)
    return run_demo(args)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from hf_dflash import DFlashForDrafting, loading, speculative_generate
    from hf_dflash.decoding.policy import cached_verify_costs

    target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
    draft_path = args.draft or (None if args.untrained else committed_drafter(args.target))
    if draft_path:
        draft = loading.load_draft(draft_path, target)
        print(f"drafter: {draft_path}")
    else:
        torch.manual_seed(0)
        draft = DFlashForDrafting.from_target(
            target, num_hidden_layers=1, block_size=args.block_size, tokenizer=tokenizer
        )
        print("drafter: fresh and UNTRAINED (expect tau near 1 and no speed-up; the output is still the target's own)")
    print(f"target {args.target} on {target.device} in {str(target.dtype).removeprefix('torch.')}")
    prepare_cpu_kernels(args.cpu_kernels, target, draft)
    messages = [{"role": "user", "content": args.prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt").to(target.device)
    budget = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    costs = cached_verify_costs(target, draft, batch_size=1)  # measured once, before any timing
    draft.verify_costs = costs  # `generate(assistant_model=draft)` verifies by the same costs (greedy)
    print(f"target forward over 1..{len(costs.verify)} tokens costs {costs.relative()} x one token")

    with torch.no_grad():
        plain, plain_s = _timed(lambda: target.generate(**inputs, **budget), target.device)
        assisted, assisted_s = _timed(
            lambda: target.generate(**inputs, assistant_model=draft, **budget), target.device
        )
        ours, ours_s = _timed(
            lambda: speculative_generate(
                target,
                draft,
                inputs.input_ids,
                inputs.attention_mask,
                verify_costs=costs,
                optimize_cpu=False,
                **budget,
            ),
            target.device,
        )
    prompt_len = inputs.input_ids.shape[1]
    new_tokens = plain.shape[1] - prompt_len
    identical = assisted.tolist() == plain.tolist() and ours.sequences.tolist() == plain.tolist()
    print(tokenizer.decode(plain[0, prompt_len:], skip_special_tokens=True))
    print()
    rows = [
        ("target.generate", plain_s),
        ("generate(assistant_model=draft)", assisted_s),
        ("speculative_generate", ours_s),
    ]
    for name, seconds in rows:
        print(f"{name:34s} {new_tokens / seconds:7.1f} tokens/s   {seconds:6.2f} s")
    print(
        f"tau (tokens per target forward): {ours.stats.tau:.2f}, "
        f"{ours.stats.verified_drafts_per_round:.2f} proposals verified per round"
    )
    print(f"identical output on all three paths: {identical}")
    summary = {"new_tokens": new_tokens, "identical": identical, "tau": ours.stats.tau}
    summary |= {name: round(new_tokens / seconds, 2) for name, seconds in rows}
    print(json.dumps(summary))
    return 0 if identical else 1


def committed_drafter(target_name: str) -> str | None:
    """The drafter trained for a packaged target and committed in this repository (`drafters/<target>`), if any."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[3] / "drafters" / target_name
    return str(folder) if (folder / "config.json").is_file() else None


def run_card(args: argparse.Namespace) -> int:
    from hf_dflash.model_card import card_info_from_folder, merged_acceptance, record_card_facts, write_model_card

    acceptance = None
    try:
        if args.acceptance_json:
            with open(args.acceptance_json) as file:
                measured = json.load(file)
            if isinstance(measured, dict) and "acceptance" in measured:  # a bare mapping or a document with that key
                measured = measured["acceptance"]
            acceptance = merged_acceptance(args.dir, measured)
        info = card_info_from_folder(
            args.dir,
            base_model=args.base_model,
            drafter_repo_id=args.repo_id,
            base_drafter=args.base_drafter,
            license=args.license,
            acceptance=acceptance,
        )
    except (FileNotFoundError, ValueError) as error:
        print(f"hf-dflash card: error: {error}", file=sys.stderr)
        return 2
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


def run_bench(args: argparse.Namespace) -> int:

    from hf_dflash import loading
    from hf_dflash.atomic_files import write_text_atomic
    from hf_dflash.bench import harness as benchmark

    target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
    draft = loading.load_draft(args.draft, target, revision=args.draft_revision, base_draft=args.base_draft)
    preparation = prepare_cpu_kernels(args.cpu_kernels, target, draft)
    defaults = benchmark.BenchmarkConfig()
    config = benchmark.BenchmarkConfig(
        datasets=tuple(args.datasets),
        limit=args.limit,
        methods=tuple(args.methods or defaults.methods),
        full_comparison_limit=args.full_comparison_limit,
        core_methods=tuple(args.core_methods or defaults.core_methods),
        plain_threads=tuple(args.plain_threads),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        do_sample=args.do_sample,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        draft_block_sizes=tuple(args.draft_block_sizes),
        batch_sizes=tuple(args.batch_sizes),
        verify_costs="auto" if args.verify == "auto" else None,
    )
    report = benchmark.run_benchmark(config, target, tokenizer, draft, preparation=preparation)
    report["conditions"]["target"] = args.target
    report["conditions"]["target_adapter"] = args.target_adapter
    report["conditions"]["command"] = "hf-dflash " + " ".join(sys.argv[1:])
    report["conditions"]["draft_path"] = args.draft
    output = write_text_atomic(args.output, json.dumps(report, indent=1) + "\n")
    plot = benchmark.save_plot(report, args.plot or output.with_suffix(".png"))
    print(benchmark.render_table(report))
    print(f"report: {output}  plot: {plot}")
    for failure in report["failures"]:
        print(f"hf-dflash bench: FAILED: {failure}", file=sys.stderr)
    print(json.dumps(report))
    return 0 if report["identical"] and not report["failures"] else 1


def _timed(run, device):
    """`run()` and its seconds, read on the device's clock (CUDA and MPS run asynchronously)."""
    from hf_dflash.decoding.policy import synchronized_clock

    start = synchronized_clock(device)
    result = run()
    return result, synchronized_clock(device) - start


def run_data(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from hf_dflash import loading
    from hf_dflash.data.chat import end_of_turn_ids
    from hf_dflash.data.records import load_training_dataset
    from hf_dflash.data.sources import training_prompts

    handler = logging.StreamHandler()  # show the data module's progress notes (resume, filtered prompts)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("hf_dflash").addHandler(handler)
    logging.getLogger("hf_dflash").setLevel(logging.INFO)
    start = time.perf_counter()
    output = Path(args.output)
    if args.server_url:  # the served target answers; only its tokenizer and generation config are read here
        if "synthetic" in args.source:
            raise SystemExit("hf-dflash data: --source synthetic needs the target itself; drop --server_url for it.")
        target = None
        tokenizer, generation_config = loading.load_tokenizer_and_generation_config(target_arguments(args))
    else:
        target, tokenizer = loading.load_target_from_arguments(target_arguments(args))
        generation_config = target.generation_config
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
        unfiltered_evaluation_sets=args.unfiltered_evaluation_set,
        progress=True,
    )
    _regenerate(args, target, tokenizer, prompts, output, stop_ids)
    records = load_training_dataset(output)
    masks = records["loss_mask"]
    supervised = sum(sum(mask) for mask in masks)
    ended = sum(ids[-1] in stop_ids for ids in records["input_ids"])
    summary = {
        "path": str(output),
        "records": len(records),
        "prompts": len(prompts),
        "supervised_tokens": supervised,
        "mean_response_tokens": round(supervised / len(records), 1),
        "ended_with_eos": ended,
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(
        f"{len(records)} records ({ended} ended their turn, the rest hit --max_new_tokens), "
        f"{supervised} supervised tokens, {summary['wall_s']} s -> {output}"
    )
    print(json.dumps(summary))
    return 0


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


def run_train(argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    from hf_dflash.training.script import parse_train_args, train

    script, args = parse_train_args(argv)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.INFO if args.should_log else hf_logging.WARNING)  # the Trainer's progress
    try:
        result = train(script, args)
    finally:
        hf_logging.set_verbosity(verbosity)
    if args.process_index == 0:
        print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
