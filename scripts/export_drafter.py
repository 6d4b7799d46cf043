"""Copy a trained drafter into a smaller dtype for committing or publishing, with its z-lab copy and model card.

python scripts/export_drafter.py runs/smollm2-b8 drafters/smollm2-135m-instruct --dtype bfloat16 \
    --target smollm2-135m-instruct \
    [--acceptance-json benchmarks/results/bench_smollm2.json --acceptance-json benchmarks/results/bench_smollm2_mtbench.json]

`--target` (a packaged target name or a local folder) gives the z-lab copy of a reduced-vocabulary drafter its LM
head (the target head's rows of the draft vocabulary, which vLLM needs) and records the target's embedding scale.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_dflash import DFlashForDrafting, DFlashLayouts
from hf_dflash.atomic_files import created_mode
from hf_dflash.bench.config import BASELINE
from hf_dflash.bench.report import BenchmarkReport
from hf_dflash.loading import load_target_and_tokenizer
from hf_dflash.model.modeling_dflash import input_embedding_scale
from hf_dflash.model_card import (
    TRAINING_INFO_FILE,
    card_info_from_folder,
    merged_acceptance,
    write_model_card,
    write_training_info,
)
from hf_dflash.training.trainer import verify_saved_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="drafter folder written by `hf-dflash train`")
    parser.add_argument("destination")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--acceptance-json", action="append", default=[], help="benchmark report whose tau/speed-up go in the card"
    )
    parser.add_argument("--target", help="the drafter's target: a packaged name, a local folder or a Hub id")
    args = parser.parse_args()
    source, destination = Path(args.source), Path(args.destination)
    dtype = getattr(torch, args.dtype)
    replace_folder(destination, lambda folder: export(source, folder, dtype, args.target, args.acceptance_json))
    size = sum(path.stat().st_size for path in destination.rglob("*.safetensors")) / 2**20
    print(f"{destination}: {args.dtype}, {size:.1f} MiB of weights (both layouts)")


def export(source: Path, folder: Path, dtype: torch.dtype, target_name: str | None, reports: list[str]) -> None:
    """Write the drafter of `source` in `dtype`, its z-lab copy (`zlab/`), `training_info.json` and card into the
    empty `folder`, checking that both copies load back to the same weights."""
    draft = DFlashForDrafting.from_pretrained(source).to(dtype)
    target = load_export_target(target_name, dtype) if target_name else None
    if target is not None and draft.config.input_embedding_scale is None:  # drafters saved before it was recorded
        draft.config.input_embedding_scale = input_embedding_scale(target)
    draft.save_pretrained(folder)
    draft.save_pretrained(folder / "zlab", layout=DFlashLayouts.ZLAB, target=target)
    verify_saved_draft(draft, folder)
    verify_saved_draft(draft, folder / "zlab")
    info = json.loads((source / TRAINING_INFO_FILE).read_text()) if (source / TRAINING_INFO_FILE).is_file() else {}
    measured = {}
    for report in reports:
        measured |= acceptance_from_report(Path(report))
    if measured:
        info["acceptance"] = merged_acceptance(source, measured)
    write_training_info(folder, info)
    for leftover in ("training_args.bin",):
        (folder / leftover).unlink(missing_ok=True)
    write_model_card(folder, card_info_from_folder(folder))
    shutil.rmtree(folder / ".cache", ignore_errors=True)


def replace_folder(destination: Path, write: Callable[[Path], None]) -> None:
    """Run `write` on a new sibling folder, then put that folder in `destination`'s place: a failed export leaves
    `destination` as it was (absent, or the earlier export), never half-written."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{destination.name}.new.", dir=destination.parent))
    new.chmod(created_mode(directory=True))  # a folder as `mkdir` makes it, not mkdtemp's private 0700
    old = new.with_name(new.name.replace(".new.", ".old."))
    try:
        write(new)
        if destination.exists():
            destination.rename(old)
        new.rename(destination)
    except BaseException:
        if old.exists() and not destination.exists():
            old.rename(destination)
        raise
    finally:
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def load_export_target(name_or_folder: str, dtype: torch.dtype) -> PreTrainedModel:
    """The drafter's target, named as every `hf-dflash` command names one (a packaged name, a folder or a Hub id),
    on the CPU: the export only reads its head rows and embedding scale."""
    return load_target_and_tokenizer(name_or_folder, device="cpu", dtype=dtype, tokenizer_required=False)[0]


def acceptance_from_report(path: Path) -> dict:
    """`{dataset: {tau, speedup, conditions}}` from an `hf-dflash bench` JSON report: `ours`'s tau and its median of
    per-prompt speedups per prompt set, against the set's baseline (the faster plain variant), which the conditions
    name with the CPU kernels the run prepared."""
    report = BenchmarkReport.read(path)
    conditions = report.conditions
    described = (
        f"hf-dflash bench, greedy, batch 1, {conditions.max_new_tokens} new tokens, {conditions.cpu}, "
        f"{conditions.torch_threads} threads, {conditions.target_dtype}"
    )
    if conditions.cpu_kernels is not None:
        described += f", CPU kernels: {conditions.cpu_kernels}"
    if conditions.verify_costs_relative is not None:
        described += ", speculative_generate(verify_costs='auto')"
    acceptance = {}
    for dataset, summary in report.datasets.items():
        if dataset == "all":  # the card lists each prompt set
            continue
        ours = summary.methods.get("ours")
        tau = ours.speculative.tau if ours is not None and ours.speculative is not None else None
        tau = summary.extra.get("tau") if tau is None else tau  # a report from before per-method statistics
        speedup = ours.speedup_median_of_ratios if ours is not None else None
        acceptance[dataset] = {
            "tau": round(float("nan") if tau is None else tau, 2),
            "speedup": round(float("nan") if speedup is None else speedup, 2),
            "conditions": f"{summary.methods['plain'].prompts} prompts; {described}; speed-up against "
            f"{summary.baseline or BASELINE}",
        }
    return acceptance


if __name__ == "__main__":
    main()
