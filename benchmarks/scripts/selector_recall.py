"""Where a DFlash2 drafter's selector stands, per slot, along the target's own greedy output on held-out prompts.

For the first prompts of each set the target writes its greedy continuation once; at an anchor every block along it
the drafter drafts one block (its context: the target's features of every token before the anchor, in one draft
forward, which is what the decoding loop's cached forwards compute). Per drafted slot k it records:

- `recall_at_1`: the target's token is the unary argmax (what a DFlash v1 chain proposes);
- `recall_at_k`: it is among the K candidates (what any selector can choose from);
- `selector_accuracy`: after the true previous token (a candidate of its slot), the lattice scores it best (teacher forcing: the walk's own
  state whenever the chain is still right, which is the only state acceptance depends on);

and per block the accepted length (bonus excluded) of three chains checked against the continuation: the unary argmax
chain, the selector's walked chain, and an oracle that takes the target's token whenever it is a candidate. Prints one
JSON document last.

    python benchmarks/scripts/selector_recall.py --draft runs/dflash2 --datasets gsm8k:8 humaneval:8 mt-bench:8 \
        --max_new_tokens 128 --output runs/selector_recall.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hf_dflash.atomic_files import write_text_atomic  # noqa: E402
from hf_dflash.data.chat import encode_prompt  # noqa: E402
from hf_dflash.data.prompts import load_prompts, split_set_limit  # noqa: E402
from hf_dflash.loading import load_draft, load_target_and_tokenizer  # noqa: E402
from hf_dflash.model.generation_dflash import context_features, noise_block  # noqa: E402
from hf_dflash.model.selector_dflash import walk_lattice  # noqa: E402


def accepted_length(proposed: list[int], truth: list[int]) -> int:
    """How many leading proposals equal the truth."""
    length = 0
    for token, expected in zip(proposed, truth):
        if token != expected:
            break
        length += 1
    return length


@torch.no_grad()
def block_measures(target, draft, sequence: torch.LongTensor, prompt_len: int) -> list[dict]:
    """Per anchor (every block along the continuation): the slots' hits and the three chains' accepted lengths."""
    block = draft.config.block_size
    lm_head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    out = target(sequence[None], output_hidden_states=[i + 1 for i in draft.config.target_layer_ids])
    features = context_features(out.hidden_states, list(draft.config.target_layer_ids), sequence.shape[0])
    results = []
    for anchor in range(prompt_len, sequence.shape[0] - block + 1, block):  # an anchor every B tokens
        truth = sequence[anchor + 1 : anchor + block].tolist()  # the target's tokens at slots 1..B-1
        embeds = embed(noise_block(sequence[anchor : anchor + 1][None], block, draft.config.mask_token_id))
        positions = torch.arange(anchor + block)[None]  # context 0..anchor-1, then the block from the anchor
        hidden = draft(noise_embeds=embeds, context_hidden_states=features[:, :anchor], position_ids=positions)
        hidden = hidden.last_hidden_state[:, 1:]  # [1, B-1, H]
        lattice = draft.selector_lattice(hidden, lm_head, sequence[anchor : anchor + 1])
        candidates = draft.to_target_ids(lattice.candidate_ids)[0]  # [B-1, K]
        walked = draft.to_target_ids(walk_lattice(lattice).draft_ids)[0].tolist()
        truth_tensor = torch.tensor(truth)
        is_truth = candidates == truth_tensor[:, None]  # [B-1, K]
        previous = torch.cat([torch.zeros(1, dtype=torch.long), is_truth[:-1].long().argmax(-1)])
        teacher_forced = lattice.scores[0, torch.arange(len(truth)), previous].argmax(-1)  # [B-1]
        found = is_truth.any(-1)
        # slot 0's rows all follow the anchor; later rows follow the true previous token when it was a candidate
        selector_hits = found & (teacher_forced == is_truth.long().argmax(-1))
        selector_hits[1:] &= found[:-1]
        results.append(
            {
                "recall_at_1": (candidates[:, 0] == truth_tensor).tolist(),
                "recall_at_k": found.tolist(),
                "selector_accuracy": selector_hits.tolist(),
                "unary_chain": accepted_length(candidates[:, 0].tolist(), truth),
                "walked_chain": accepted_length(walked, truth),
                "oracle_top_k": accepted_length([t if f else -1 for t, f in zip(truth, found.tolist())], truth),
            }
        )
    return results


def summary(blocks: list[dict]) -> dict:
    """Per-slot rates and mean chain lengths (plus 1: tokens per round with the bonus, as tau counts)."""
    slots = len(blocks[0]["recall_at_1"])
    per_slot = {
        name: [round(sum(b[name][k] for b in blocks) / len(blocks), 4) for k in range(slots)]
        for name in ("recall_at_1", "recall_at_k", "selector_accuracy")
    }
    chains = {
        f"tau_{name}": round(1 + sum(b[name] for b in blocks) / len(blocks), 3)
        for name in ("unary_chain", "walked_chain", "oracle_top_k")
    }
    return {"blocks": len(blocks), **per_slot, **chains}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", required=True, help="a DFlash2 drafter (folder or Hub id)")
    parser.add_argument("--datasets", nargs="+", default=["gsm8k:8", "humaneval:8", "mt-bench:8"])
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    target, tokenizer = load_target_and_tokenizer(args.target, dtype="float32")
    draft = load_draft(args.draft, target).eval()
    if draft.config.variant != "dflash2":
        raise SystemExit(f"{args.draft} is a DFlash (v1) drafter; this measures a DFlash2 drafter's selector.")
    report = {}
    for dataset in args.datasets:
        name, limit = split_set_limit(dataset, None)
        blocks = []
        for prompt in load_prompts(name, limit=limit):
            ids = torch.tensor([encode_prompt(tokenizer, prompt)])
            with torch.no_grad():
                sequence = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0]
            blocks += block_measures(target, draft, sequence, ids.shape[1])
        report[name] = summary(blocks)
    report["conditions"] = {
        "draft": args.draft,
        "target": args.target,
        "prompts": args.datasets,
        "max_new_tokens": args.max_new_tokens,
        "dtype": "float32",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - start),
    }
    text = json.dumps(report, indent=1)
    write_text_atomic(args.output, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
