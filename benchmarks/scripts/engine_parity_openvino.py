"""The committed SmolLM2 drafter in OpenVINO GenAI against hf-dflash, on the same prompts and the same target weights.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/engine_parity_openvino.py --datasets gsm8k:10 humaneval:10 \
        mt-bench:5 --output benchmarks/results/engine_parity_openvino.json

Needs `bash scripts/install_engines.sh --openvino`. The target is the packaged SmolLM2-135M-Instruct's fp32 weights
(the dequantized GGUF): GenAI runs them as fp32 IR, hf-dflash and transformers in fp32 torch. Every prompt goes in as
the same token ids (chat template applied by hf-dflash), greedy, `--max_new_tokens`:

- hf-dflash: `speculative_generate` verifying the whole block every round, its tau; transformers' plain greedy ids;
- GenAI plain (`LLMPipeline`, its default stateful path), plain through its paged-attention pipeline (the path
  DFlash's verification takes) and with the drafter (`num_assistant_tokens = B - 1`, prefix caching off), each under
  every `--settings` entry: `default` (the device's own precisions: on CPU an fp32 inference precision and a u8
  KV cache) and `f32` (`INFERENCE_PRECISION_HINT` and `KV_CACHE_PRECISION` f32).

Reported: GenAI's mean accepted length (tokens per drafted target step, as tau) beside ours, and on how many prompts
each pair of generations agrees token for token as far as both go, with the first position where they part. The last
line printed is the report as JSON (without the per-prompt records, which go to `--output`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash import loading, speculative_generate  # noqa: E402
from hf_dflash.atomic_files import write_text_atomic  # noqa: E402
from hf_dflash.data.chat import encode_prompt  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.engines import openvino  # noqa: E402
from hf_dflash.targets import converted_target_folder  # noqa: E402

TARGET = "smollm2-135m-instruct"
SETTINGS = {"default": {}, "f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}}


def ours(target, draft, ids: list[int], max_new_tokens: int) -> dict:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids) :].tolist()
    out = speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens, tree=False, optimize_cpu=False)
    lengths = out.stats.acceptance_lengths
    dflash = out.sequences[0, len(ids) : len(ids) + out.num_new_tokens[0]].tolist()
    return {
        "transformers_plain": plain,
        "hf_dflash": dflash,
        "tau": out.stats.tau,
        "committed": sum(lengths),
        "steps": len(lengths),
    }


def first_difference(first: list[int], second: list[int]) -> int | None:
    """The first position where two generations differ, as far as both go; `None` when they agree."""
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:10", "humaneval:10", "mt-bench:5"])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--ir", default=None, help="an existing export_openvino folder (default: export to a temp)")
    parser.add_argument("--output", default="benchmarks/results/engine_parity_openvino.json")
    args = parser.parse_args()

    torch.set_num_threads(2)
    target, tokenizer = loading.load_target_and_tokenizer(TARGET, device="cpu", dtype="float32")
    draft = loading.load_draft(loading.committed_drafter(TARGET), target)
    block_size = draft.config.block_size
    prompts = [p for entry in args.datasets for p in load_prompts(*split_set_limit(entry, None))]
    ids = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    records = [
        {"id": p.id, "prompt_tokens": len(i)} | ours(target, draft, i, args.max_new_tokens)
        for p, i in zip(prompts, ids)
    ]
    print(f"hf-dflash and transformers ran {len(records)} prompts", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        ir = Path(args.ir) if args.ir else openvino.export_openvino(draft, converted_target_folder(TARGET), scratch)
        run = dict(max_new_tokens=args.max_new_tokens, block_size=block_size)
        for setting in args.settings:
            properties = SETTINGS[setting]
            modes = {
                "plain": dict(with_draft=False),
                "plain_paged": dict(with_draft=False, paged=True),
                "dflash": dict(with_draft=True),
            }
            for mode, flags in modes.items():
                runs = openvino.run_openvino(ir, ids, properties=properties, **flags, **run)
                for record, engine_run in zip(records, runs):
                    record[f"openvino_{mode}_{setting}"] = {
                        "token_ids": engine_run.token_ids,
                        "target_steps": engine_run.target_steps,
                        "accepted_tokens": engine_run.accepted_tokens,
                        "mean_accepted_length": engine_run.mean_accepted_length,
                    }
                print(f"OpenVINO {mode} ({setting}) ran {len(runs)} prompts", flush=True)
    report = summarize(records, args, block_size - 1)
    write_text_atomic(args.output, dumps(report))
    print(json.dumps({key: value for key, value in report.items() if key != "prompts"}))


def _ids(record: dict, key: str) -> list[int]:
    value = record[key]
    return value["token_ids"] if isinstance(value, dict) else value


def dumps(report: dict) -> str:
    """The report as JSON, one line per prompt record (their token lists would take a line per token)."""
    head = json.dumps({key: value for key, value in report.items() if key != "prompts"}, indent=1)
    records = ",\n  ".join(json.dumps(record) for record in report["prompts"])
    return head[: -len("\n}")] + ',\n "prompts": [\n  ' + records + "\n ]\n}\n"


def summarize(records: list[dict], args: argparse.Namespace, num_assistant_tokens: int) -> dict:
    def agreement(first: str, second: str) -> dict:
        parts = [first_difference(_ids(r, first), _ids(r, second)) for r in records]
        return {"agree": sum(p is None for p in parts), "first_difference": [p for p in parts if p is not None]}

    def mean_accepted_length(key: str) -> float:
        runs = [r[key] for r in records]
        committed = sum(run["mean_accepted_length"] * (run["target_steps"] - 1) for run in runs)
        return committed / sum(run["target_steps"] - 1 for run in runs)

    comparisons = {}
    for setting in args.settings:
        plain, paged, dflash = (f"openvino_{mode}_{setting}" for mode in ("plain", "plain_paged", "dflash"))
        comparisons[setting] = {
            "openvino dflash == openvino plain": agreement(dflash, plain),
            "openvino dflash == openvino plain, paged": agreement(dflash, paged),
            "openvino plain, paged == openvino plain": agreement(paged, plain),
            "openvino plain == transformers plain": agreement(plain, "transformers_plain"),
            "openvino dflash == transformers plain": agreement(dflash, "transformers_plain"),
        }
    return {
        "command": "python benchmarks/scripts/engine_parity_openvino.py " + " ".join(sys.argv[1:]),
        "conditions": {
            "target": f"{TARGET} fp32 (GenAI: fp32 IR by optimum-cli; hf-dflash and transformers: fp32 torch)",
            "settings": {name: SETTINGS[name] for name in args.settings},
            "threads": 2,
            "num_assistant_tokens": num_assistant_tokens,
            "max_new_tokens": args.max_new_tokens,
        },
        "prompts_run": len(records),
        "tau_ours_whole_block": sum(r["committed"] for r in records) / sum(r["steps"] for r in records),
        "mean_accepted_length_openvino": {s: mean_accepted_length(f"openvino_dflash_{s}") for s in args.settings},
        "hf_dflash == transformers plain": agreement("hf_dflash", "transformers_plain"),
        "identical_tokens": comparisons,
        "prompts": records,
    }


if __name__ == "__main__":
    main()
