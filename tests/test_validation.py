"""Bad target/draft pairs get a clear error (what is wrong, and what to do) through both entry points, and the
`generate(..., assistant_model=draft)` routing leaves every other candidate strategy alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import PAD, VOCAB, load_module, make_draft, make_target
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import GenerationMixin, PreTrainedTokenizerFast

import hf_dflash
from hf_dflash import (
    DFlashConfig,
    DFlashForDrafting,
    check_draft_fits_target,
    choose_mask_token_id,
    enable_dflash_generate,
    speculative_generate,
)
from hf_dflash.model.generation_dflash import keeps_recurrent_state

PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
ENTRY_POINTS = ["generate", "speculative_generate"]


def run(entry_point: str, target, draft, input_ids=PROMPT, **kwargs):
    with torch.no_grad():
        if entry_point == "generate":
            return target.generate(input_ids, assistant_model=draft, do_sample=False, max_new_tokens=6, **kwargs)
        return speculative_generate(target, draft, input_ids, max_new_tokens=6, **kwargs)


def tiny_llama(seed: int = 0, **overrides):
    """A Llama like helpers' target (hidden 64, 3 layers, vocab 96), with fields overridden."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.2,  # varied greedy continuations, so that equality checks mean something
    )
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**(fields | overrides))
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()


def draft_from_config(**overrides) -> DFlashForDrafting:
    """A drafter built by hand, for targets `from_target` cannot read."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        block_size=4,
        mask_token_id=PAD,
        num_target_layers=2,
    )
    torch.manual_seed(0)
    return DFlashForDrafting(DFlashConfig(**(fields | overrides))).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def draft(target):
    return make_draft(target, block_size=4)


# ---------------------------------------------------------------------------------------------------------------------
# A draft that does not fit the target
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_hidden_size_mismatch(entry_point, target):
    other = make_draft(tiny_llama(hidden_size=32), block_size=4)
    with pytest.raises(ValueError, match=r"hidden size is 32 but the target's is 64.*from_target\(target\)"):
        run(entry_point, target, other)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_vocab_mismatch(entry_point, target):
    other = make_draft(tiny_llama(vocab_size=80, pad_token_id=79), block_size=4, mask_token_id=79)
    with pytest.raises(ValueError, match=r"vocabulary of 80 tokens but the target's embedding has 96 rows.*tokenizer"):
        run(entry_point, target, other)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("layer_ids", [[0, 3], [-1, 1]])
def test_target_layer_ids_outside_target(entry_point, layer_ids, target):
    other = make_draft(target, block_size=4, target_layer_ids=layer_ids)
    with pytest.raises(ValueError, match=r"outside the target's 3 decoder layers \(valid ids: 0\.\.2\)"):
        run(entry_point, target, other)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_draft_for_deeper_target(entry_point, target):
    other = make_draft(tiny_llama(num_hidden_layers=8), block_size=4, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"include \[3, 5\].*built for a deeper target"):
        run(entry_point, target, other)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("mask_token_id", [VOCAB, 1000, -1])
def test_mask_token_outside_embedding(entry_point, mask_token_id, target):
    other = make_draft(target, block_size=4)
    other.config.mask_token_id = mask_token_id  # after construction, past the config's own check
    with pytest.raises(
        ValueError, match=rf"mask_token_id={mask_token_id} is outside the target's embedding.*reserved"
    ):
        run(entry_point, target, other)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_dtype_mismatch(entry_point, target, draft):
    target_bf16 = tiny_llama().to(torch.bfloat16)
    with pytest.raises(
        TypeError, match=r"draft is torch\.float32 but the target is torch\.bfloat16.*draft\.to\(target\.dtype\)"
    ):
        run(entry_point, target_bf16, draft)


def test_batch_of_two_on_the_transformers_path(target, draft):
    with pytest.raises(
        ValueError, match=r"one sequence at a time \(got a batch of 2\).*hf_dflash\.speculative_generate"
    ):
        run("generate", target, draft, PROMPT.repeat(2, 1))
    assert run("speculative_generate", target, draft, PROMPT.repeat(2, 1)).sequences.shape == (2, 8 + 6)


def tiny_qwen3_next():
    config = transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(config).eval()


def tiny_mamba():
    config = transformers.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config).eval()


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_stateful_hybrid_target(entry_point):
    stateful = tiny_qwen3_next()
    with pytest.raises(ValueError, match=r"cannot be rolled back"):
        make_draft(stateful, block_size=4)  # from_target refuses it too
    other = draft_from_config(target_layer_ids=[0, 1])
    with pytest.raises(
        ValueError, match=r"Qwen3NextForCausalLM keeps a recurrent.*cannot be rolled back.*plain `generate`"
    ):
        run(entry_point, stateful, other)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_stateful_recurrent_target(entry_point):
    mamba = tiny_mamba()
    with pytest.raises(ValueError, match=r"MambaForCausalLM keeps a recurrent.*cannot be rolled back"):
        run(entry_point, mamba, draft_from_config(target_layer_ids=[0, 1]))


@pytest.mark.parametrize(
    ("build", "stateful"), [(tiny_qwen3_next, True), (tiny_mamba, True), (lambda: make_target("gemma3"), False)]
)
def test_recurrent_state_is_found_from_the_cache_layers(build, stateful):
    """transformers >= 5.25 no longer sets `_is_stateful`; the check must not depend on it."""
    target = build()
    target._is_stateful = False  # what transformers < 5.25 set on attention-only models
    assert keeps_recurrent_state(target) is stateful


def tiny_qwen2_vl():
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    vision = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=1, patch_size=2, temporal_patch_size=1)
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision)
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_multi_axis_position_target(entry_point):
    vl = tiny_qwen2_vl()
    assert "mrope_section" in vl.config.get_text_config().rope_parameters
    with pytest.raises(ValueError, match=r"mRoPE"):
        make_draft(vl, block_size=4)  # from_target refuses it too
    other = draft_from_config(target_layer_ids=[0, 1])
    with pytest.raises(
        ValueError, match=r"Qwen2VLForConditionalGeneration uses multi-axis \(mRoPE\) positions.*text-only"
    ):
        run(entry_point, vl, other)


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated")
def test_multi_axis_position_legacy_rope_scaling(draft):
    """Older configs carry `mrope_section` in `rope_scaling`."""
    target = tiny_llama()
    target.config.rope_parameters = None
    target.config.rope_scaling = {"type": "mrope", "mrope_section": [2, 3, 3]}
    with pytest.raises(ValueError, match=r"multi-axis \(mRoPE\)"):
        check_draft_fits_target(target, draft)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_encoder_decoder_target(entry_point):
    torch.manual_seed(0)
    t5_config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    t5 = transformers.T5ForConditionalGeneration(t5_config).eval()
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration is an encoder-decoder model.*decoder-only"):
        run(entry_point, t5, draft_from_config(target_layer_ids=[0, 1]))


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("field", ["mask_token_id", "target_layer_ids"])
def test_draft_config_missing_dflash_fields(entry_point, field, target):
    fields = {"mask_token_id": PAD, "target_layer_ids": [0, 2], "num_target_layers": None, field: None}
    with pytest.raises(ValueError, match=field):
        run(entry_point, target, draft_from_config(**fields))


@pytest.mark.parametrize("build", [tiny_mamba, tiny_qwen2_vl], ids=["stateful", "mrope"])
def test_from_target_rejects_unsupported_targets(build):
    with pytest.raises(ValueError, match=r"cannot be rolled back|mRoPE"):
        DFlashForDrafting.from_target(build(), mask_token_id=PAD)


def test_from_target_rejects_encoder_decoder():
    torch.manual_seed(0)
    bart_config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
    )
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4)
    )
    for model in (transformers.BartForConditionalGeneration(bart_config), t5):
        with pytest.raises(ValueError, match="encoder-decoder"):
            DFlashForDrafting.from_target(model.eval(), mask_token_id=PAD)


# ---------------------------------------------------------------------------------------------------------------------
# DFlashConfig fields
# ---------------------------------------------------------------------------------------------------------------------

CONFIG_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, mask_token_id=PAD)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(block_size=1), r"block_size must be >= 2 \(the anchor plus at least one drafted token\), got 1"),
        (dict(block_size=0), r"block_size must be >= 2"),
        (dict(layer_types=["full_attention"]), r"layer_types has 1 entries for 2 layers; give one per layer"),
        (dict(layer_types=["full_attention", "sliding_attention"]), r"set `sliding_window`"),
        (dict(target_layer_ids=[1, 1]), r"target_layer_ids must be distinct, got \[1, 1\]"),
        (dict(mask_token_id=VOCAB), rf"mask_token_id={VOCAB} is outside the vocabulary \[0, {VOCAB}\).*reserved"),
        (dict(mask_token_id=-1), r"mask_token_id=-1 is outside the vocabulary"),
    ],
)
def test_config_field_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(**(CONFIG_BASE | overrides))


def test_config_nested_fields_lifted():
    config = DFlashConfig(
        **CONFIG_BASE | dict(mask_token_id=None, dflash_config={"mask_token_id": 7, "block_size": 8})
    )
    assert (config.mask_token_id, config.block_size) == (7, 8)
    with pytest.raises(ValueError, match=r"block_size must be >= 2"):
        DFlashConfig(**CONFIG_BASE | dict(dflash_config={"block_size": 1}))


# ---------------------------------------------------------------------------------------------------------------------
# choose_mask_token_id
# ---------------------------------------------------------------------------------------------------------------------

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(60)]  # 63 ids; the target has 96 embedding rows
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def word_tokenizer(words=WORDS, added_specials=(), **special_tokens) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer: `words` get ids 0.., then `added_specials` are added as special tokens."""
    special_tokens = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"} | special_tokens
    model = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token=special_tokens["unk_token"]))
    model.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, **special_tokens)
    tokenizer.add_tokens(list(added_specials), special_tokens=True)
    return tokenizer


def full_tokenizer(added_specials=(), unk_token=None, **special_tokens) -> PreTrainedTokenizerFast:
    """A tokenizer that covers all 96 embedding rows (no padded rows), by default with no unknown token."""
    words = WORDS + [f"v{i}" for i in range(VOCAB - len(WORDS) - len(added_specials))]
    tokenizer = word_tokenizer(words, added_specials, unk_token=unk_token, **special_tokens)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == VOCAB
    return tokenizer


def mask_target(pad_token_id=None, bos_token_id=1, eos_token_id=2, vocab_size=VOCAB):
    return tiny_llama(
        vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id
    )


def test_mask_token_prefers_reserved_special_token():
    tokenizer = word_tokenizer(added_specials=["<|im_start|>", "<|reserved_special_token_0|>", "<|reserved_1|>"])
    assert tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>") == 64
    assert len(tokenizer) < VOCAB  # padded rows exist, yet the reserved token wins
    assert choose_mask_token_id(mask_target(pad_token_id=0), tokenizer) == 64


@pytest.mark.parametrize("name", ["<mask>", "<|unused_3|>", "[PLACEHOLDER]", "<pad>"])
def test_mask_token_name_hints(name):
    tokenizer = word_tokenizer(added_specials=["<|endoftext|>", name])
    assert choose_mask_token_id(mask_target(), tokenizer) == 64


def test_mask_token_skips_eos_bos_and_rows_past_the_embedding():
    # The EOS is named like a pad token, and the only reserved token has no embedding row: both are skipped.
    tokenizer = word_tokenizer(eos_token="<|pad|>", added_specials=["<|pad|>"] + [f"<x{i}>" for i in range(32)])
    tokenizer.add_tokens(["<|reserved_0|>"], special_tokens=True)
    assert tokenizer.eos_token_id == 63 and tokenizer.convert_tokens_to_ids("<|reserved_0|>") == 96
    target = mask_target(pad_token_id=5)
    assert len(tokenizer) > VOCAB  # no padded rows either
    assert choose_mask_token_id(target, tokenizer) == 5  # rule 3: the config's pad id


def test_mask_token_padded_rows_past_the_tokenizer():
    tokenizer = word_tokenizer()  # no hinted special token
    assert choose_mask_token_id(mask_target(pad_token_id=0), tokenizer) == len(WORDS)


def test_mask_token_pad_id_without_tokenizer():
    assert choose_mask_token_id(mask_target(pad_token_id=0)) == 0


def test_mask_token_unused_special_token_last():
    """Rule 4 (SmolLM2: pad is EOS, no padded rows): the last special token outside BOS/EOS/PAD and the template."""
    specials = ["<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"]
    tokenizer = full_tokenizer(specials, pad_token="</s>")
    assert choose_mask_token_id(mask_target(pad_token_id=2), tokenizer) == VOCAB - 1  # <empty_output>


@pytest.mark.parametrize(
    "ids",
    [
        dict(pad_token_id=None),
        dict(pad_token_id=2, eos_token_id=2),  # pad == eos: the target emits it
        dict(pad_token_id=1, bos_token_id=1),
        dict(pad_token_id=3, eos_token_id=[2, 3]),  # one of several EOS ids
    ],
)
def test_mask_token_nothing_qualifies(ids):
    with pytest.raises(ValueError, match=r"Could not find an unused embedding row.*mask_token_id=.*tokenizer="):
        choose_mask_token_id(mask_target(**ids))


def test_mask_token_nothing_qualifies_with_full_tokenizer():
    # Every special token is BOS, EOS (= pad) or used by the chat template.
    tokenizer = full_tokenizer(["<|im_start|>", "<|im_end|>"], pad_token="</s>")
    with pytest.raises(ValueError, match=r"Could not find an unused embedding row"):
        choose_mask_token_id(mask_target(pad_token_id=2), tokenizer)


def test_mask_token_never_the_unknown_token():
    tokenizer = full_tokenizer(["<|im_start|>", "<|im_end|>"], pad_token="</s>", unk_token="<unk>")
    assert tokenizer.unk_token_id == 0
    with pytest.raises(ValueError, match=r"Could not find an unused embedding row"):
        choose_mask_token_id(mask_target(pad_token_id=2), tokenizer)


def test_from_target_uses_the_mask_rule():
    tokenizer = word_tokenizer(added_specials=["<|reserved_special_token_0|>"])
    target = mask_target()
    assert DFlashForDrafting.from_target(target, tokenizer=tokenizer).config.mask_token_id == 63
    with pytest.raises(ValueError, match=r"Could not find an unused embedding row"):
        DFlashForDrafting.from_target(target)


# ---------------------------------------------------------------------------------------------------------------------
# Routing of generate(..., assistant_model=...)
# ---------------------------------------------------------------------------------------------------------------------


def greedy(target, **kwargs):
    with torch.no_grad():
        return target.generate(PROMPT, do_sample=False, max_new_tokens=20, **kwargs)


def test_routing_picks_dflash_generator(target, draft, generator_spy):
    reference = greedy(target)
    assert generator_spy == []
    assert torch.equal(greedy(target, assistant_model=draft), reference)
    assert generator_spy == ["DFlashCandidateGenerator"]


def test_routing_keeps_native_dflash_when_asked(target, draft, generator_spy):
    reference = greedy(target)
    assert torch.equal(greedy(target, assistant_model=draft, speculation_type="dflash"), reference)
    assert generator_spy == ["DFlashTokenCandidateGenerator"]


def test_routing_falls_through_for_an_ordinary_assistant(target, generator_spy):
    assistant = tiny_llama(seed=1, num_hidden_layers=1)
    reference = greedy(target)
    assert torch.equal(greedy(target, assistant_model=assistant), reference)
    assert generator_spy == ["AssistedCandidateGenerator"]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(prompt_lookup_num_tokens=3), "PromptLookupCandidateGenerator"),
        (dict(assistant_early_exit=2), "EarlyExitCandidateGenerator"),
    ],
)
@pytest.mark.parametrize("with_draft", [False, True])
def test_routing_leaves_other_strategies_alone(kwargs, expected, with_draft, target, draft, generator_spy):
    reference = greedy(target)
    extra = dict(assistant_model=draft) if with_draft else {}
    assert torch.equal(greedy(target, **kwargs, **extra), reference)
    assert generator_spy == [expected]


def test_enable_dflash_generate_is_idempotent(target, draft, tmp_path):
    routing = GenerationMixin._get_candidate_generator
    validation = GenerationMixin._validate_generation_mode
    assert getattr(routing, "_dflash_routing", False) and getattr(validation, "_dflash_routing", False)

    assert enable_dflash_generate() is True
    assert hf_dflash.enable_dflash_generate() is True
    make_draft(target, block_size=4)
    draft.save_pretrained(tmp_path)
    DFlashForDrafting.from_pretrained(tmp_path)

    # A trust_remote_code copy of generation_dflash.py (a separate module object) must not wrap a second time.
    remote = load_module(tmp_path / "generation_dflash.py", name="remote_generation_dflash")
    assert remote.enable_dflash_generate() is True

    assert GenerationMixin._get_candidate_generator is routing
    assert GenerationMixin._validate_generation_mode is validation
    assert routing.__wrapped__.__name__ == "_get_candidate_generator"
    assert not getattr(routing.__wrapped__, "_dflash_routing", False)  # exactly one layer of wrapping
    assert not getattr(validation.__wrapped__, "_dflash_routing", False)
