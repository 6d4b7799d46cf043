"""Whole-block tau against training data size and steps: does more regenerated data make the drafter better?

Each point trains a drafter on N records of one regenerated file with the same recipe and optimizer budget: the first
N of one seeded shuffle of the records the largest point takes, so a smaller point's records are inside a larger one's
and every point holds records written early and late in the same shares (the regeneration changed on the way: records
after the first 11,199 hold the engine's generated ids, earlier ones its text re-tokenized), then measures greedy
whole-block tau (`speculative_generate` without verify costs: the drafter's acceptance, free of the planner and of
timing) on held-out prompts of the training distribution and on the first prompts of the three benchmark sets.
`--eval_steps` also measures the checkpoints a point saved on the way, for tau against steps.

Everything resumes: a subset file, a finished drafter or a measured (point, step) is never redone (a point measured
at every step is not even trained, so the report outlives the drafters), an interrupted
training continues from its latest checkpoint (`--resume_from_checkpoint`), and the target's features are kept per
sequence on disk in fp16 (`--target_features_storage disk`), shared by all points (a 3x subset holds the 1x one).
The report (JSON, rewritten after every measurement) and its plot go where `--output` says; the last thing printed is
its table (markdown). `--baseline NAME=FOLDER` also measures an existing drafter once (the committed one), as a row
of the table, with its weights' `hf_dflash.adapters.draft_fingerprint` (a later run with other weights in FOLDER is
refused: name them anew).

    python benchmarks/scripts/scaling_curve.py --records ../data/records.jsonl --held_out ../data/held_out.jsonl \
        --work ../data/scaling --points 1x:1906:8 3x:5718:8 10x:19060:8 --max_steps 1600 --eval_steps 400 800 \
        --eval_steps_points 10x --output benchmarks/results/scaling/scaling_smollm2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peft_acceptance import WHOLE_BLOCK_GREEDY, acceptance_by_dataset, taus  # noqa: E402

from hf_dflash.adapters import draft_fingerprint  # noqa: E402
from hf_dflash.atomic_files import atomic_path  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.data.sources import prompts_from_jsonl  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402

# The training recipe every point shares (the committed drafter's stage 1, single stage, its data size the variable).
RECIPE = [
    "--num_draft_layers", "2", "--draft_init", "target", "--target_layer_ids", "1", "8", "14", "20", "27",
    "--layer_types", "sliding_attention", "full_attention", "--sliding_window", "32", "--num_anchors", "64",
    "--per_device_train_batch_size", "8", "--learning_rate", "3e-3", "--logging_steps", "50",
    "--draft_vocab_size", "8192", "--cache_target_features", "true", "--target_features_storage", "disk",
    "--target_features_dtype", "float16", "--report_to", "none", "--save_strategy", "steps", "--use_cpu", "true",
    "--seed", "0", "--disable_tqdm", "true", "--acceptance_holdout", "0",
]  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One drafter of the curve: `name`, trained on the first `records` records with block size `block_size`."""

    name: str
    records: int
    block_size: int

    @classmethod
    def parse(cls, spec: str) -> Point:
        name, records, block_size = spec.split(":")
        return cls(name, int(records), int(block_size))


def subset(records: Path, count: int, draw_from: int, folder: Path) -> Path:
    """The first `count` of the first `draw_from` lines of `records` in a seeded shuffle, written once (atomically);
    refused if the file holds fewer than `draw_from` complete lines."""
    path = folder / f"records-{count}-of-{draw_from}.jsonl"
    if path.is_file():
        return path
    with open(records, encoding="utf-8") as file:
        lines = list(itertools.islice(file, draw_from))
    if len(lines) < draw_from or not lines[-1].endswith("\n"):
        complete = len(lines) - (bool(lines) and not lines[-1].endswith("\n"))
        raise SystemExit(f"{records} holds {complete} complete records, not {draw_from}: regenerate more first.")
    random.Random(0).shuffle(lines)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text("".join(lines[:count]), encoding="utf-8")
    return path


def train(point: Point, data: Path, work: Path, max_steps: int, save_steps: int) -> Path:
    """Train (or finish training) the point's drafter; its folder once the final model is saved."""
    output = work / point.name
    if (output / "config.json").is_file():
        return output
    command = ["hf-dflash", "train", "--target", "smollm2-135m-instruct", "--data", str(data)]
    command += ["--output_dir", str(output), "--block_size", str(point.block_size), "--max_steps", str(max_steps)]
    command += ["--save_steps", str(save_steps), "--target_features_dir", str(work / "features"), *RECIPE]
    if any(output.glob("checkpoint-*")):
        command += ["--resume_from_checkpoint", "true"]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    return output


def steps_to_measure(
    point: Point, eval_steps: list[int], eval_points: list[str] | None, max_steps: int, done: set[tuple[str, int]]
) -> list[int]:
    """The steps at which `point`'s drafter is still to be measured: its final one, and `eval_steps` if it is one of
    `eval_points` (every point when None), less the (point, step) pairs in `done`."""
    steps = [max_steps] if eval_points is not None and point.name not in eval_points else [*eval_steps, max_steps]
    return [step for step in steps if (point.name, step) not in done]


def measure(target, tokenizer, draft, prompts: dict, max_new_tokens: int) -> dict:
    """The loaded drafter `draft`'s whole-block tau per prompt set, with the per-prompt runs and the wall time."""
    start = time.perf_counter()
    acceptance = acceptance_by_dataset(target, tokenizer, draft, prompts, max_new_tokens)
    return {"tau": taus(acceptance), "acceptance": acceptance, "wall_s": round(time.perf_counter() - start)}


def load_report(path: Path, conditions: dict) -> dict:
    """The report so far; one measured under other conditions is refused rather than mixed in."""
    if not path.is_file():
        return {"conditions": conditions, "results": []}
    report = json.loads(path.read_text())
    differing = [
        key
        for key in ("prompts", "max_new_tokens", "verify", "recipe")
        if report["conditions"][key] != conditions[key]
    ]
    if differing:
        raise SystemExit(f"{path} was measured with another {', '.join(differing)}; write to another --output.")
    return report


def baseline_measured(report: dict, name: str, folder: str, fingerprint: str) -> bool:
    """Whether the baseline row `name` holds the weights of `fingerprint` (`draft_fingerprint` of the drafter loaded
    from `folder`) already (False: none yet, measure it). A row of other weights, or of none recorded, is refused: a
    committed folder's path outlives the weights it held."""
    rows = [r for r in report["results"] if r["point"] == name and r["step"] is None]
    if not rows:
        return False
    if rows[0].get("draft_fingerprint") != fingerprint:
        raise SystemExit(f"baseline {name!r} was measured on other weights than {folder}'s; give it another NAME.")
    return True


def save(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(report, indent=1) + "\n")


def plot(report: dict, path: Path):
    """Tau per prompt set (one colour each) against records (final drafters; a line style per block size, the
    baseline drafters as lines across, a style each) and against steps (per point), saved to `path`; returns the
    (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    results, sets = report["results"], list(report["conditions"]["prompts"])
    final = report["conditions"]["max_steps"]
    colour = {name: f"C{index}" for index, name in enumerate(sets)}
    fig, (by_data, by_steps) = plt.subplots(1, 2, figsize=(11, 4))
    block_sizes = sorted({r["block_size"] for r in results if r["records"] is not None})
    styles = dict(zip(block_sizes, ["o-", "s--", "^:"]))
    for (block_size, style), name in itertools.product(styles.items(), sets):
        points = sorted(
            (r["records"], r["tau"][name]) for r in results if r["step"] == final and r["block_size"] == block_size
        )
        if points:
            by_data.plot(*zip(*points), style, color=colour[name])
    baselines = [r for r in results if r["records"] is None]
    line_styles = itertools.cycle([":", "--", "-."])
    baseline_styles = {r["point"]: {"linestyle": next(line_styles), "linewidth": 1} for r in baselines}
    for baseline, name in itertools.product(baselines, sets):
        by_data.axhline(baseline["tau"][name], color=colour[name], **baseline_styles[baseline["point"]])
    for point, name in itertools.product(sorted({r["point"] for r in results}), sets):
        points = sorted((r["step"], r["tau"][name]) for r in results if r["point"] == point)
        if len(points) > 1:
            by_steps.plot(*zip(*points), "o-", color=colour[name], label=f"{name}, {point}")
    keys = [Line2D([], [], color=colour[name], label=name) for name in sets]
    keys += [
        Line2D([], [], color="k", linestyle=style[1:], marker=style[0], label=f"block {block_size}")
        for block_size, style in styles.items()
    ]
    keys += [
        Line2D([], [], color="k", label=f"{r['point']} drafter", **baseline_styles[r["point"]]) for r in baselines
    ]
    by_data.legend(handles=keys, fontsize=7)
    by_data.set(xscale="log", xlabel="training records", ylabel="whole-block tau (greedy)", title="tau against data")
    by_steps.set(xlabel="optimizer steps", ylabel="whole-block tau (greedy)", title="tau against steps")
    if by_steps.get_legend_handles_labels()[0]:  # nothing is drawn there until a point's checkpoints are measured
        by_steps.legend(fontsize=7)
    for axes in (by_data, by_steps):
        axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def table(report: dict) -> str:
    """Markdown: one row per (point, step), tau per prompt set with the share of the target's tokens inside the
    drafter's vocabulary beside it."""
    sets = list(report["conditions"]["prompts"])
    lines = [
        "| drafter | records | block | steps | " + " | ".join(sets) + " |",
        "|---|---|---|---|" + "---|" * len(sets),
    ]
    for r in report["results"]:
        cells = []
        for name in sets:
            inside = r["acceptance"][name].get("in_draft_vocabulary")
            cells.append(f"{r['tau'][name]:.2f}" + ("" if inside is None else f" ({inside:.1%})"))
        records = "-" if r["records"] is None else f"{r['records']:,}"
        steps = "-" if r["step"] is None else f"{r['step']:,}"
        lines.append(f"| {r['point']} | {records} | {r['block_size']} | {steps} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", required=True, type=Path, help="regenerated records, in pool order")
    parser.add_argument("--held_out", required=True, type=Path, help="held-out prompts of the same pool (.jsonl)")
    parser.add_argument("--work", required=True, type=Path, help="subsets, drafters and features (outside the repo)")
    parser.add_argument("--points", nargs="+", required=True, help="NAME:RECORDS:BLOCK_SIZE")
    parser.add_argument("--max_steps", type=int, default=1600)
    parser.add_argument(
        "--save_steps", type=int, default=200, help="checkpoint interval: a stopped run loses at most this many steps"
    )
    parser.add_argument("--eval_steps", type=int, nargs="*", default=[], help="checkpoints also measured")
    parser.add_argument(
        "--eval_steps_points", nargs="*", default=None, help="points whose --eval_steps are measured (default: all)"
    )
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:50", "humaneval:50", "mt-bench:50"])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--baseline", nargs="*", default=[], help="NAME=FOLDER: an existing drafter, measured once")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()
    points = [Point.parse(spec) for spec in args.points]
    unknown = set(args.eval_steps_points or []) - {point.name for point in points}
    if unknown:
        parser.error(f"--eval_steps_points names no point of --points: {', '.join(sorted(unknown))}")

    prompts = {"held-out": prompts_from_jsonl(args.held_out)}
    prompts |= {name: load_prompts(name, count) for name, count in (split_set_limit(d, None) for d in args.datasets)}
    conditions = {
        "prompts": {name: len(items) for name, items in prompts.items()},
        "max_new_tokens": args.max_new_tokens,
        "verify": WHOLE_BLOCK_GREEDY,
        "recipe": " ".join(RECIPE),
        "max_steps": args.max_steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "command": " ".join(sys.argv),
    }
    report = load_report(args.output, conditions)
    done = {(r["point"], r["step"]) for r in report["results"]}
    target, tokenizer = load_target_and_tokenizer("smollm2-135m-instruct", device="cpu")
    for name, folder in (spec.split("=", 1) for spec in args.baseline):
        draft = load_draft(folder, target)
        fingerprint = draft_fingerprint(draft)
        if not baseline_measured(report, name, folder, fingerprint):
            result = measure(target, tokenizer, draft, prompts, args.max_new_tokens)
            row = {"point": name, "records": None, "block_size": draft.config.block_size, "step": None}
            report["results"].append(row | {"drafter": folder, "draft_fingerprint": fingerprint, **result})
            save(report, args.output)
    draw_from = max(point.records for point in points)
    for point in points:
        steps = steps_to_measure(point, args.eval_steps, args.eval_steps_points, args.max_steps, done)
        if not steps:  # measured already, perhaps from records and a drafter since lost: nothing to train again
            continue
        data = subset(args.records, point.records, draw_from, args.work)
        drafter = train(point, data, args.work, args.max_steps, args.save_steps)
        for step in steps:
            folder = drafter if step == args.max_steps else drafter / f"checkpoint-{step}"
            result = measure(target, tokenizer, load_draft(str(folder), target), prompts, args.max_new_tokens)
            report["results"].append(
                {"point": point.name, "records": point.records, "block_size": point.block_size, "step": step, **result}
            )
            print(f"{point.name} step {step}: tau {result['tau']} ({result['wall_s']} s)", flush=True)
            save(report, args.output)
            plot(report, args.output.with_suffix(".png"))
    print(table(report))


if __name__ == "__main__":
    main()
