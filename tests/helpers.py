"""Tiny in-process targets of many families, and an oracle drafter whose acceptance we can dial."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_outputs import BaseModelOutputWithPast

from hf_dflash import DFlashForDrafting
from hf_dflash.data import tokens

# The remote-code files `save_pretrained` copies next to a drafter's weights (and the committed drafters carry).
HUB_FILES = tuple(
    sorted(path.name for path in (Path(__file__).parent.parent / "src/hf_dflash/model").glob("*_dflash.py"))
)

VOCAB = 96
PAD = VOCAB - 1  # never emitted by the rigged targets below; doubles as the mask token

_COMMON = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": None, "eos_token_id": None}
# The same small shape for every Llama-like family; what differs per family is spelled out.
_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    **_COMMON,
}
FAMILY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_LLAMA_LIKE),
    "qwen2": lambda: Qwen2Config(**_LLAMA_LIKE),
    "qwen3": lambda: Qwen3Config(head_dim=16, **_LLAMA_LIKE),
    "mistral": lambda: MistralConfig(sliding_window=48, **_LLAMA_LIKE),
    "gemma2": lambda: Gemma2Config(head_dim=16, sliding_window=32, **_LLAMA_LIKE),
    "gemma3": lambda: Gemma3TextConfig(head_dim=16, sliding_window=32, **_LLAMA_LIKE),
    "phi3": lambda: Phi3Config(**_LLAMA_LIKE),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=512, **_COMMON),
    "gpt_neox": lambda: GPTNeoXConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, **_COMMON
    ),
    "opt": lambda: OPTConfig(
        hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4, word_embed_proj_dim=64, **_COMMON
    ),
}
FAMILIES = sorted(FAMILY_CONFIGS)


def make_target(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random causal LM of `family`, fp32, eval mode, eager attention (exact and deterministic on CPU)."""
    torch.manual_seed(seed)
    config = FAMILY_CONFIGS[family]()
    target = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    return target.eval()


def make_draft(target, block_size: int = 8, num_hidden_layers: int = 2, seed: int = 1, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("mask_token_id", PAD)
    draft = DFlashForDrafting.from_target(
        target, num_hidden_layers=num_hidden_layers, block_size=block_size, **overrides
    )
    return draft.eval()


def left_pad(prompts: list[torch.Tensor], pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into `[b, L]` ids and mask."""
    return tokens.left_pad(prompts, pad_id)


class OracleDraft(DFlashForDrafting):
    """A real drafter (its forward and cache run as usual) whose outputs are then steered so that the target's LM head
    proposes the target's own greedy continuation, each token replaced by a wrong one with probability `p_wrong`.

    `references[r][pos]` is row r's token at position `pos` (prompt + greedy continuation, no padding). This lets the
    losslessness tests reach long accepted runs, EOS and budget cuts inside accepted blocks, and ragged batches.
    """

    def steer(self, target, references: list[torch.Tensor], p_wrong: float, seed: int = 0) -> OracleDraft:
        weight = target.get_output_embeddings().weight.detach().float()  # [V, H]
        self.token_states = torch.linalg.pinv(weight) * 50.0  # [H, V]: column t makes token t the argmax
        self.references = references
        self.p_wrong = p_wrong
        self.generator = torch.Generator().manual_seed(seed)
        return self

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, **kwargs):
        out = super().forward(noise_embeds, context_hidden_states, position_ids=position_ids, **kwargs)
        block = noise_embeds.shape[1]
        hidden = out.last_hidden_state.clone()
        for row in range(hidden.shape[0]):
            reference = self.references[row if len(self.references) > 1 else 0]
            for slot, position in enumerate(position_ids[row, -block:].tolist()):
                token = int(reference[position]) if position < len(reference) else 0
                if torch.rand((), generator=self.generator) < self.p_wrong:
                    token = (token + 1 + int(torch.randint(VOCAB - 2, (), generator=self.generator))) % (VOCAB - 1)
                hidden[row, slot] = self.token_states[:, token].to(hidden.dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=out.cache)


def make_oracle(target, references, p_wrong: float, block_size: int = 8, seed: int = 1, **overrides) -> OracleDraft:
    torch.manual_seed(seed)
    draft = OracleDraft.from_target(target, num_hidden_layers=1, block_size=block_size, mask_token_id=PAD, **overrides)
    return draft.eval().steer(target, references, p_wrong, seed)


def greedy_reference(target, prompt: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """The target's own greedy output for a 1-D prompt (prompt included)."""
    with torch.no_grad():
        out = target.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0]


def save_target_and_records(folder: Path, num_records: int, new_tokens: int) -> None:
    """A tiny Llama saved in `folder/target` and `folder/data.jsonl` of its own greedy continuations of random 6-token
    prompts, as `hf-dflash data` writes them: what the tests that launch `hf-dflash train` processes train on."""
    import json

    target = make_target("llama")
    target.save_pretrained(folder / "target")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(num_records):
        prompt = torch.randint(0, PAD - 1, (1, 6), generator=generator)
        ids = greedy_reference(target, prompt[0], new_tokens).tolist()
        record = {"id": f"t/{i}", "input_ids": ids, "loss_mask": [0] * 6 + [1] * new_tokens, "prompt_len": 6}
        lines.append(json.dumps(record))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """Import a Python file that is not part of a package (``scripts/``, ``benchmarks/``, a saved remote-code copy)."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through the module's entry
    spec.loader.exec_module(module)
    return module


def packaged_target_or_skip(name: str):
    """`(model, tokenizer)` of a packaged real target (`hf_dflash.targets.load_target`); the test is skipped, naming
    the package to install, when its weights are not installed."""
    import pytest

    from hf_dflash import targets

    try:
        return targets.load_target(name)
    except ModuleNotFoundError as error:
        pytest.skip(str(error))
