"""Copy a trained drafter into a smaller dtype for committing or publishing, with its z-lab copy and model card.

python scripts/export_drafter.py runs/smollm2-b8 drafters/smollm2-135m-instruct --dtype bfloat16 \
    --target smollm2-135m-instruct \
    [--acceptance-json benchmarks/bench_smollm2.json --acceptance-json benchmarks/bench_smollm2_mtbench.json]

`--target` (a packaged target name or a local folder) gives the z-lab copy of a reduced-vocabulary drafter its LM
head (the target head's rows of the draft vocabulary, which vLLM needs) and records the target's embedding scale.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_dflash import DFlashForDrafting, DFlashLayouts
from hf_dflash.loading import load_target_and_tokenizer
from hf_dflash.model_card import (
    TRAINING_INFO_FILE,
    card_info_from_folder,
    merged_acceptance,
    write_model_card,
    write_training_info,
)
from hf_dflash.modeling_dflash import input_embedding_scale
from hf_dflash.trainer import verify_saved_draft


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
    draft = DFlashForDrafting.from_pretrained(source).to(dtype)
    target = load_export_target(args.target, dtype) if args.target else None
    if target is not None and draft.config.input_embedding_scale is None:  # drafters saved before it was recorded
        draft.config.input_embedding_scale = input_embedding_scale(target)
    draft.save_pretrained(destination)
    draft.save_pretrained(destination / "zlab", layout=DFlashLayouts.ZLAB, target=target)
    verify_saved_draft(draft, destination)
    verify_saved_draft(draft, destination / "zlab")
    info = json.loads((source / TRAINING_INFO_FILE).read_text()) if (source / TRAINING_INFO_FILE).is_file() else {}
    measured = {}
    for report in args.acceptance_json:
        measured |= acceptance_from_report(Path(report))
    if measured:
        info["acceptance"] = merged_acceptance(source, measured)
    write_training_info(destination, info)
    for leftover in ("training_args.bin",):
        (destination / leftover).unlink(missing_ok=True)
    write_model_card(destination, card_info_from_folder(destination))
    size = sum(path.stat().st_size for path in destination.rglob("*.safetensors")) / 2**20
    print(f"{destination}: {args.dtype}, {size:.1f} MiB of weights (both layouts)")
    shutil.rmtree(destination / ".cache", ignore_errors=True)


def load_export_target(name_or_folder: str, dtype: torch.dtype) -> PreTrainedModel:
    """The drafter's target, named as every `hf-dflash` command names one (a packaged name, a folder or a Hub id),
    on the CPU: the export only reads its head rows and embedding scale."""
    return load_target_and_tokenizer(name_or_folder, device="cpu", dtype=dtype, tokenizer_required=False)[0]


def acceptance_from_report(path: Path) -> dict:
    """`{dataset: {tau, speedup, conditions}}` from an `hf-dflash bench` JSON report."""
    report = json.loads(path.read_text())
    conditions = report["conditions"]
    described = (
        f"hf-dflash bench, greedy, batch 1, {conditions['max_new_tokens']} new tokens, {conditions['cpu']}, "
        f"{conditions['torch_threads']} threads, {conditions['target_dtype']}"
    )
    if "verify_costs_relative" in conditions:
        described += ", speculative_generate(verify_costs='auto')"
    acceptance = {}
    for dataset, summary in report["datasets"].items():
        if dataset == "all":  # the card lists each prompt set
            continue
        ours = summary["methods"].get("ours", {})
        acceptance[dataset] = {
            "tau": round(summary.get("tau", float("nan")), 2),
            "speedup": round(ours.get("speedup_median_of_ratios", float("nan")), 2),
            "conditions": f"{summary['methods']['plain']['prompts']} prompts; {described}",
        }
    return acceptance


if __name__ == "__main__":
    main()
