"""The committed SmolLM2 drafter in llama.cpp against hf-dflash, on the same prompts and the same target weights.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/engine_parity.py --datasets gsm8k:10 humaneval:10 mt-bench:5 \
        --output benchmarks/results/engine_parity_llama_cpp.json

Needs `bash scripts/install_engines.sh`. The target is the packaged SmolLM2-135M-Instruct: llama.cpp runs its Q4_1
GGUF, hf-dflash the fp32 dequantization of the same file. Per prompt (chat template applied, greedy, `--max_new_tokens`):

- hf-dflash: `speculative_generate` verifying the whole block every round (DFlash as published), its tau;
- llama.cpp with DFlash (`llama-speculative-simple --spec-type draft-dflash --spec-draft-n-max B-1`), the drafter
  exported both ways (`reduced`: the 8,192-token draft vocabulary with `d2t`; `full`: the target's head), its mean
  accepted length (tokens per target step, as tau) and tokens/s;
- llama.cpp's speculative tool with a draft-free method (`ngram-simple`): the engine's own multi-token
  verification without DFlash, to tell what DFlash changes from what batched verification changes;
- llama.cpp plain (`llama-simple`, greedy, one token per forward) and its tokens/s.

Aggregates: tau and mean accepted length as committed tokens / target steps over all prompts. The last line printed is
the report as JSON.
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
from hf_dflash.data.chat import apply_chat_template, encode_prompt  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.engines import llama_cpp  # noqa: E402
from hf_dflash.targets import converted_target_folder, locate_gguf  # noqa: E402

TARGET = "smollm2-135m-instruct"


def ours(target, draft, tokenizer, prompt, max_new_tokens: int) -> dict:
    ids = torch.tensor([encode_prompt(tokenizer, prompt)])
    out = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, tree=False, optimize_cpu=False)
    text = tokenizer.decode(out.sequences[0, ids.shape[1] : ids.shape[1] + out.num_new_tokens[0]])
    lengths = out.stats.acceptance_lengths
    return {"tau": out.stats.tau, "committed": sum(lengths), "steps": len(lengths), "text": text}


def engine(runs: dict[str, llama_cpp.EngineRun]) -> dict:
    return {
        name: {
            "mean_accepted_length": run.mean_accepted_length,
            "draft_passes": run.draft_passes,
            "tokens_per_s": run.tokens_per_s,
            "new_tokens": run.new_tokens,
            "text": run.text,
        }
        for name, run in runs.items()
    }


def aggregate(records: list[dict], key: str) -> float:
    if key == "ours":
        return sum(r["ours"]["committed"] for r in records) / sum(r["ours"]["steps"] for r in records)
    runs = [r["llama.cpp"][key] for r in records]
    committed = sum(run["mean_accepted_length"] * run["draft_passes"] for run in runs)
    return committed / sum(run["draft_passes"] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:10", "humaneval:10", "mt-bench:5"])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--output", default="benchmarks/results/engine_parity_llama_cpp.json")
    args = parser.parse_args()

    torch.set_num_threads(2)
    target, tokenizer = loading.load_target_and_tokenizer(TARGET, device="cpu", dtype="float32")
    draft = loading.load_draft(loading.committed_drafter(TARGET), target)
    target_gguf = locate_gguf(TARGET)
    draft_tokens = draft.config.block_size - 1
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        ggufs = {
            vocabulary: llama_cpp.export_draft_gguf(
                draft, target, converted_target_folder(TARGET), target_gguf, Path(scratch) / f"{vocabulary}.gguf",
                full_vocabulary=vocabulary == "full",
            )
            for vocabulary in ("reduced", "full")
        }  # fmt: skip
        for entry in args.datasets:
            name, count = split_set_limit(entry, None)
            for prompt in load_prompts(name, limit=count):
                text = apply_chat_template(tokenizer, prompt)
                run = dict(max_new_tokens=args.max_new_tokens, draft_tokens=draft_tokens)
                runs = {
                    f"dflash_{vocabulary}": llama_cpp.run_speculative(target_gguf, text, draft_gguf=path, **run)
                    for vocabulary, path in ggufs.items()
                }
                runs["ngram_simple"] = llama_cpp.run_speculative(target_gguf, text, spec_type="ngram-simple", **run)
                runs["plain"] = llama_cpp.run_plain(target_gguf, text, max_new_tokens=args.max_new_tokens)
                record = {"id": prompt.id, "ours": ours(target, draft, tokenizer, prompt, args.max_new_tokens)}
                record["llama.cpp"] = engine(runs)
                records.append(record)
                print(
                    prompt.id, round(record["ours"]["tau"], 2), runs["dflash_reduced"].mean_accepted_length, flush=True
                )
    report = summarize(records, args, draft_tokens)
    write_text_atomic(args.output, json.dumps(report, indent=1) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "prompts"}))


def summarize(records: list[dict], args: argparse.Namespace, draft_tokens: int) -> dict:
    def same(first: str, second: str) -> int:
        """Prompts where the two texts agree as far as both go (`llama_cpp.texts_agree`)."""
        return sum(
            llama_cpp.texts_agree(
                *[(r["llama.cpp"][k] if k in r["llama.cpp"] else r[k])["text"] for k in (first, second)]
            )
            for r in records
        )

    def rate(key: str) -> float:
        runs = [r["llama.cpp"][key] for r in records]
        return sum(run["new_tokens"] for run in runs) / sum(run["new_tokens"] / run["tokens_per_s"] for run in runs)

    return {
        "command": "python benchmarks/scripts/engine_parity.py " + " ".join(sys.argv[1:]),
        "conditions": {
            "target": f"{TARGET} (llama.cpp: Q4_1 GGUF; hf-dflash: its fp32 dequantization)",
            "llama_cpp": str(llama_cpp.find_llama_cpp().root),
            "threads": 2,
            "spec_draft_n_max": draft_tokens,
            "max_new_tokens": args.max_new_tokens,
        },
        "prompts_run": len(records),
        "tau_ours_whole_block": aggregate(records, "ours"),
        "mean_accepted_length": {key: aggregate(records, key) for key in ("dflash_reduced", "dflash_full")},
        "tokens_per_s": {key: rate(key) for key in ("plain", "ngram_simple", "dflash_reduced", "dflash_full")},
        "identical_text_of": len(records),
        "identical_text": {
            "dflash_reduced == dflash_full": same("dflash_reduced", "dflash_full"),
            "dflash_reduced == ngram_simple": same("dflash_reduced", "ngram_simple"),
            "dflash_reduced == plain (llama-simple)": same("dflash_reduced", "plain"),
            "ngram_simple == plain (llama-simple)": same("ngram_simple", "plain"),
            "dflash_reduced == ours (hf-dflash on the fp32 weights)": same("dflash_reduced", "ours"),
        },
        "prompts": records,
    }


if __name__ == "__main__":
    main()
