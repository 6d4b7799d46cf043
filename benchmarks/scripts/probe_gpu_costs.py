"""What verifying and drafting cost on a GPU at Qwen3-8B's shapes: the numbers the round planner plans from.

    python benchmarks/scripts/probe_gpu_costs.py --device cuda --output benchmarks/results/gpu_costs_qwen3_8b_shapes.json

A Qwen3-8B-shaped target (hidden 4096, 36 layers, 32 heads, 8 KV heads, MLP 12288, vocabulary 151936) with random
weights, built directly on the device in bfloat16, and DFlash drafters of 1 and 5 layers built for it
(`DFlashForDrafting.from_target`, block 16). Measured, nothing else running:

- the target's forward over n = 1 .. 32 new tokens after a 512-token cache, median over repeats with the sizes
  interleaved (`verify_policy.measure_verify_costs`, what `verify_costs="auto"` measures), in ms and relative to one
  token: a flat curve means verifying a whole block costs about one decoding step;
- each drafter's step at blocks 4, 8 and 16 (`benchmark.time_draft_forward`: forward over `[anchor, MASK x (B-1)]`
  after a cached 512-token context, plus the target's LM head on the B-1 drafted slots).

Random weights: these are costs only, nothing about acceptance. Prints one JSON document as the last line (with the
conditions: device, versions, dtype, shapes) and writes it to `--output`. Shrink the shapes for a CPU smoke run:

    python benchmarks/scripts/probe_gpu_costs.py --device cpu --dtype float32 --layers 2 --hidden 64 --heads 4 --kv-heads 2 \\
        --intermediate 96 --vocab 256 --context 32 --repeats 1 --draft-repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from hf_dflash import DFlashForDrafting  # noqa: E402
from hf_dflash.bench.draft_step import time_draft_forward  # noqa: E402
from hf_dflash.bench.harness import cpu_model  # noqa: E402
from hf_dflash.decoding.policy import measure_verify_costs  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--attn-implementation", default="sdpa", help="the target's attention (as served)")
    shapes = parser.add_argument_group("target shapes (Qwen3-8B by default)")
    shapes.add_argument("--layers", type=int, default=36)
    shapes.add_argument("--hidden", type=int, default=4096)
    shapes.add_argument("--heads", type=int, default=32)
    shapes.add_argument("--kv-heads", type=int, default=8)
    shapes.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads (128 for Qwen3-8B)")
    shapes.add_argument("--intermediate", type=int, default=12288)
    shapes.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--draft-block-size", type=int, default=16, help="the drafters' trained block size")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16], help="draft steps timed at these")
    parser.add_argument("--context", type=int, default=512, help="cached tokens before each timed forward")
    parser.add_argument("--max-tokens", type=int, default=32, help="verify forwards over 1 .. this many tokens")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes over every verify size")
    parser.add_argument("--draft-repeats", type=int, default=20, help="timed draft steps per block size")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON document here")
    return parser.parse_args(argv)


def build_target(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """A random Qwen3 causal LM of the given shapes, initialised on `device` in `dtype` (no host copy)."""
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads,
        max_position_embeddings=40960,
        tie_word_embeddings=False,  # Qwen3-8B has its own LM head
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    with device:
        target = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn_implementation)
    return target.eval()


def build_draft(target, num_layers: int, block_size: int) -> DFlashForDrafting:
    torch.manual_seed(1)
    # the last embedding row: Qwen3's tokenizer (151669 tokens) never emits the padded rows past it
    mask_token_id = target.config.vocab_size - 1
    draft = DFlashForDrafting.from_target(
        target, num_hidden_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id
    )
    return draft.eval()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model() if device.type == "cpu" else device.type


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    target = build_target(args, device, dtype)
    drafts = [build_draft(target, n, args.draft_block_size) for n in args.draft_layers]
    costs = measure_verify_costs(
        target, drafts[0], batch_size=1, context_length=args.context, repeats=args.repeats, max_tokens=args.max_tokens
    )
    draft_steps = []
    for draft in drafts:
        draft_steps += time_draft_forward(target, draft, args.block_sizes, args.draft_repeats, args.context)
    text_config = target.config
    report = {
        "conditions": {
            "device": str(device),
            "device_name": device_name(device),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "dtype": args.dtype,
            "attn_implementation": args.attn_implementation,
            "weights": "random (costs only)",
            "target": {
                "model_type": text_config.model_type,
                "hidden_size": text_config.hidden_size,
                "num_hidden_layers": text_config.num_hidden_layers,
                "num_attention_heads": text_config.num_attention_heads,
                "num_key_value_heads": text_config.num_key_value_heads,
                "head_dim": text_config.head_dim,
                "intermediate_size": text_config.intermediate_size,
                "vocab_size": text_config.vocab_size,
                "parameters": _parameters(target),
            },
            "drafts": [
                {
                    "num_hidden_layers": draft.config.num_hidden_layers,
                    "target_layer_ids": list(draft.config.target_layer_ids),
                    "block_size": draft.config.block_size,
                    "parameters": _parameters(draft),
                }
                for draft in drafts
            ],
            "batch_size": 1,
            "context_length": args.context,
            "verify_repeats": args.repeats,
            "draft_repeats": args.draft_repeats,
            "command": " ".join(
                ["python benchmarks/scripts/probe_gpu_costs.py", *(sys.argv[1:] if argv is None else argv)]
            ),
        },
        # the target's forward over n new tokens (what verifying n - 1 drafts plus the bonus costs)
        "verify": [
            {"tokens": n, "ms": round(1000 * seconds, 4), "relative": round(seconds / costs.verify[0], 3)}
            for n, seconds in enumerate(costs.verify, start=1)
        ],
        # one draft forward over a block without cached context + its LM head, as the planner counts it
        "planner_draft_ms": {"draft_layers": drafts[0].config.num_hidden_layers, "ms": round(1000 * costs.draft, 4)},
        "draft_step": draft_steps,
    }
    if device.type == "cuda":
        report["conditions"]["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    for row in report["verify"]:
        print(f"verify {row['tokens']:>3} tokens: {row['ms']:8.3f} ms  ({row['relative']:.2f}x one token)")
    for step in draft_steps:
        print(f"draft {step['draft_layers']} layer(s), block {step['block_size']:>2}: {step['median_ms']:8.3f} ms")
    document = json.dumps(report, allow_nan=False)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(document)
    return report


if __name__ == "__main__":
    main()
