"""`hf-dflash` command line. Heavy imports happen inside the subcommands so `--help` is instant.

hf-dflash demo [--draft DIR] [--prompt TEXT] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-dflash", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="generate on a real model with and without a DFlash drafter")
    demo.add_argument("--target", default="smollm2-135m-instruct", help="a packaged real target (hf_dflash.targets)")
    demo.add_argument("--draft", default=None, help="drafter folder; default: a fresh, untrained drafter")
    demo.add_argument(
        "--prompt",
        default="Natalia sold clips to 48 of her friends in April, and then she sold half "
        "as many clips in May. How many clips did Natalia sell altogether in April and May?",
    )
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--block-size", type=int, default=8, help="block size of a fresh drafter")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
    return run_demo(args)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from hf_dflash import DFlashForDrafting, speculative_generate
    from hf_dflash.targets import load_target

    target, tokenizer = load_target(args.target)
    if args.draft:
        draft = DFlashForDrafting.from_pretrained(args.draft).to(target.dtype)
        print(f"drafter: {args.draft}")
    else:
        torch.manual_seed(0)
        draft = DFlashForDrafting.from_target(
            target, num_hidden_layers=1, block_size=args.block_size, tokenizer=tokenizer
        )
        print("drafter: fresh and UNTRAINED (expect tau near 1 and no speed-up; the output is still the target's own)")
    messages = [{"role": "user", "content": args.prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    budget = {"max_new_tokens": args.max_new_tokens, "do_sample": False}

    with torch.no_grad():
        plain, plain_s = _timed(lambda: target.generate(**inputs, **budget))
        assisted, assisted_s = _timed(lambda: target.generate(**inputs, assistant_model=draft, **budget))
        ours, ours_s = _timed(
            lambda: speculative_generate(target, draft, inputs.input_ids, inputs.attention_mask, **budget)
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
    print(f"tau (tokens per target forward): {ours.stats.tau:.2f}")
    print(f"identical output on all three paths: {identical}")
    summary = {"new_tokens": new_tokens, "identical": identical, "tau": ours.stats.tau}
    summary |= {name: round(new_tokens / seconds, 2) for name, seconds in rows}
    print(json.dumps(summary))
    return 0 if identical else 1


def _timed(run):
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
