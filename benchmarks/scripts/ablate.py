"""Controlled ablations of the training levers: same data, same steps, one change at a time, judged by real
acceptance on prompts the drafter never saw.

Each variant is one `hf-dflash train` run: the shared flags (`--common`) plus the variant's own, on the same
regenerated data, from the same seed. The run logs the real tau on the data's held-out records
(`--acceptance_holdout`, training-distribution prompts) every `--curve_steps` steps. Variants are compared by the
CPU time of their optimizer steps alone (`train_cpu_s`, measured by the training process: not loading, caching the
target's features or the held-out tau), beside the whole child's CPU time (`getrusage`). Each finished drafter is then measured here, greedy, on the held-out prompts and the first
`--limit` prompts of GSM8K, HumanEval and MT-Bench: whole-block tau (every proposal verified: the drafter's acceptance
alone), and tokens per target forward with the round planner on target verify costs measured once for all variants
and each drafter's own measured draft step (the planner's choice, free of timing noise between variants).

    python benchmarks/scripts/ablate.py --data runs/ablate/data.jsonl --runs runs/ablate --output benchmarks/results/ablation/ablation.json \
        --common "--block_size 8 --num_draft_layers 2 --max_steps 150 --learning_rate 5e-3" \
        --variant baseline= --variant init-target="--draft_init target" \
        --variant acceptance-0.5="--acceptance_loss_weight 0.5"

A variant whose folder already holds a trained drafter is not trained again, and one already in `--output` is not
measured again: a stopped run continues where it stopped. `--train_only` trains without measuring (CPU time is the
child's own, so trainings may share the machine; the measurements time the draft step and the verify costs, so run
them alone). The report is written after every variant, with a
Markdown table (`ablation.md`) and a plot of held-out tau against CPU-minutes (`ablation.png`) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash import speculative_generate  # noqa: E402
from hf_dflash.bench.draft_step import time_draft_forward  # noqa: E402
from hf_dflash.data.chat import encode_prompt  # noqa: E402
from hf_dflash.data.prompts import load_prompts  # noqa: E402
from hf_dflash.data.records import load_training_dataset  # noqa: E402
from hf_dflash.decoding.policy import VerifyCosts, measure_verify_costs  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402
from hf_dflash.training.script import held_out_prompts  # noqa: E402

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")
HELD_OUT = "held-out"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` -> (name, flag list); `baseline=` has no flags of its own."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"--variant takes NAME=FLAGS (e.g. 'init-target=--draft_init target'): {text!r}"
        )
    return name, shlex.split(flags)


def train_command(target: str, data: str, folder: Path, common: list[str], flags: list[str], args) -> list[str]:
    """The `hf-dflash train` command line of one variant (its own flags last: they win over `--common`)."""
    return [
        *(["hf-dflash"] if args.hf_dflash is None else shlex.split(args.hf_dflash)),
        "train",
        *["--target", target, "--data", data, "--output_dir", str(folder), "--device", "cpu"],
        *["--acceptance_holdout", str(args.holdout), "--real_acceptance_steps", str(args.curve_steps)],
        *["--real_acceptance_max_new_tokens", str(args.curve_max_new_tokens)],
        *["--report_to", "none", "--save_strategy", "no", "--seed", str(args.seed)],
        *common,
        *flags,
    ]


def train_variant(command: list[str], folder: Path) -> dict:
    """Run one training (unless its folder already holds a trained drafter); its CPU and wall minutes."""
    info_path, cost_path = folder / "training_info.json", folder / "ablation_cost.json"
    if info_path.is_file() and cost_path.is_file():
        cost = json.loads(cost_path.read_text())
        if cost["command"] != shlex.join(command):
            raise SystemExit(
                f"{folder} was trained by another command:\n  {cost['command']}\nnot\n  {shlex.join(command)}\n"
                "Give the variant a new name, or delete that folder to train it again."
            )
        return cost
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    log = folder.parent / f"{folder.name}.log"  # not with_suffix: "acceptance-0.5" would become "acceptance-0.log"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        subprocess.run(command, check=True, stdout=stream, stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cost = {
        "cpu_min": round(((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)) / 60, 2),
        "wall_min": round((time.perf_counter() - start) / 60, 2),
        "training_threads": os.environ.get("OMP_NUM_THREADS", "torch default"),
        "command": shlex.join(command),
    }
    cost_path.write_text(json.dumps(cost, indent=1) + "\n")
    return cost


def acceptance(target, draft, prompt_sets: dict[str, list[list[int]]], costs, max_new_tokens: int) -> dict:
    """Per prompt set: whole-block tau, and tokens per target forward with the planner on `costs`."""
    results = {}
    for name, prompts in prompt_sets.items():
        lengths, planned_tokens, planned_forwards = [], 0, 0
        for ids in prompts:
            input_ids = torch.tensor([ids])
            whole = speculative_generate(target, draft, input_ids, max_new_tokens=max_new_tokens, do_sample=False)
            lengths += whole.stats.acceptance_lengths
            planned = speculative_generate(
                target, draft, input_ids, max_new_tokens=max_new_tokens, do_sample=False, verify_costs=costs
            ).stats
            planned_tokens += planned.new_tokens
            planned_forwards += planned.num_rounds + planned.plain_steps
        results[name] = {
            "tau_whole_block": round(sum(lengths) / max(len(lengths), 1), 3),
            "planner_tokens_per_forward": round(planned_tokens / max(planned_forwards, 1), 3),
        }
    return results


def training_cpu_minutes(folder: Path) -> float:
    """CPU-minutes of the run's optimizer steps alone (`train_cpu_s`: not loading, caching or the held-out tau)."""
    return json.loads((folder / "training_info.json").read_text())["training"]["train_cpu_s"] / 60


def tau_curve(folder: Path) -> list[list[float]]:
    """`[[training CPU-minutes, held-out tau], ...]` from the run's `held_out_tau_by_step` (minutes pro rata by
    step)."""
    training = json.loads((folder / "training_info.json").read_text())["training"]
    steps, minutes = max(training["steps"], 1), training_cpu_minutes(folder)
    return [[round(minutes * step / steps, 2), tau] for step, tau in training.get("held_out_tau_by_step", [])]


def render_markdown(report: dict) -> str:
    """The table: one row per variant, tau per prompt set (whole block / planner), cost, draft step."""
    sets = [HELD_OUT, *BENCHMARKS]
    header = (
        "| variant | training CPU min | draft step ms | "
        + " | ".join(f"{s} tau (planner tok/fwd)" for s in sets)
        + " |"
    )
    lines = [header, "|" + "---|" * (3 + len(sets))]
    for name, row in report["variants"].items():
        cells = [
            f"{row['acceptance'][s]['tau_whole_block']:.3f} ({row['acceptance'][s]['planner_tokens_per_forward']:.2f})"
            for s in sets
        ]
        lines.append(
            f"| {name} | {row['train_cpu_min']:.1f} | {row['draft_step_ms']:.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def save_plot(report: dict, path: Path) -> None:
    """Held-out tau against CPU-minutes per variant (the training-time curve), and each variant's final points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for index, (name, row) in enumerate(report["variants"].items()):
        curve = row["held_out_curve"]
        # Ten colours cycle; seven markers beside them keep the first seventy variants apart.
        marker = "osD^vP*"[index % 7]
        axes.plot([x for x, _ in curve], [y for _, y in curve], marker=marker, label=name)
    axes.set_xlabel("CPU-minutes of the optimizer steps")
    axes.set_ylabel(f"real tau, {report['conditions']['holdout']} held-out prompts (whole block)")
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--data", required=True, help="JSONL of `hf-dflash data`, shared by every variant")
    parser.add_argument("--runs", required=True, help="folder of the variants' drafters")
    parser.add_argument("--output", required=True, help="the report (JSON); ablation.md and .png go beside it")
    parser.add_argument("--common", default="", help="flags of every variant's `hf-dflash train`")
    parser.add_argument("--variant", action="append", type=parse_variant, required=True, help="NAME=FLAGS; repeat")
    parser.add_argument("--holdout", type=int, default=8, help="held-out records (training-distribution prompts)")
    parser.add_argument("--curve_steps", type=int, default=50, help="held-out tau every this many steps")
    parser.add_argument("--curve_max_new_tokens", type=int, default=48)
    parser.add_argument("--limit", type=int, default=10, help="first prompts of each benchmark set")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf_dflash", default=None, help="how to run the CLI (default: hf-dflash)")
    parser.add_argument(
        "--train_only",
        action="store_true",
        help="train the variants, measure none (measure later, on a quiet machine)",
    )
    args = parser.parse_args()

    output = Path(args.output)
    report = json.loads(output.read_text()) if output.is_file() else {"variants": {}}
    report["conditions"] = {
        "target": args.target,
        "data": args.data,
        "common": args.common,
        "holdout": args.holdout,
        "benchmark_prompts": {name: args.limit for name in BENCHMARKS},
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "command": shlex.join([sys.executable, *sys.argv]),
    }
    target, tokenizer = load_target_and_tokenizer(args.target, device="cpu")
    prompt_sets = {
        HELD_OUT: [ids[0].tolist() for ids in held_out_prompts(load_training_dataset(args.data), args.holdout)]
    }
    prompt_sets |= {name: [encode_prompt(tokenizer, p) for p in load_prompts(name, args.limit)] for name in BENCHMARKS}
    verify_seconds = report["conditions"].get("verify_costs_s")  # kept from an earlier, stopped run
    for name, flags in args.variant:
        folder = Path(args.runs) / name
        command = train_command(args.target, args.data, folder, shlex.split(args.common), flags, args)
        cost = train_variant(command, folder)
        if args.train_only or name in report["variants"]:
            continue
        draft = load_draft(str(folder), target)
        if verify_seconds is None:  # measured once for every variant: the planner's choices differ by the drafter
            verify_seconds = list(measure_verify_costs(target, draft, max_tokens=draft.config.block_size).verify)
            report["conditions"]["verify_costs_s"] = verify_seconds
        draft_ms = time_draft_forward(target, draft, [draft.config.block_size])[0]["median_ms"]
        costs = VerifyCosts(verify=tuple(verify_seconds), draft=draft_ms / 1000)  # each drafter's own step cost
        report["variants"][name] = {
            "flags": shlex.join(flags),
            **cost,
            "train_cpu_min": round(training_cpu_minutes(folder), 2),
            "draft_step_ms": round(draft_ms, 2),
            "acceptance": acceptance(target, draft, prompt_sets, costs, args.max_new_tokens),
            "held_out_curve": tau_curve(folder),
            "measured_by": report["conditions"]["command"],  # conditions keep only the latest invocation's
        }
        print(f"{name}: {json.dumps(report['variants'][name]['acceptance'])}", flush=True)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=1) + "\n")
        output.with_suffix(".md").write_text(render_markdown(report))
        save_plot(report, output.with_suffix(".png"))


if __name__ == "__main__":
    main()
