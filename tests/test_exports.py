"""z-lab exports read the way the serving engines' loaders read them.

Each `*_reading` function below applies one engine's documented loader rule to an exported folder (keys, shapes,
causality, rotary width, embedding scale), as read from that engine's code:

- vLLM `model_executor/models/qwen3_dflash.py`: `draft_vocab_size` (default `vocab_size`) rows of head; its own
  `lm_head.weight` only if the checkpoint has one, else the target's head is shared; logits placed at
  `arange(draft_vocab_size) + d2t`; per layer causal = top-level `is_causal`, else `dflash_config.causal`, else
  `sliding_attention`; rotary over `head_dim * partial_rotary_factor`; the block embedded with the raw rows (DFlash v1)
  or scaled by `dflash_config.input_embedding_scale` (newer readers).
- SGLang `srt/models/dflash.py`: unknown keys (`d2t`, `lm_head.weight`) ignored, so it drafts over the target's whole
  head; `sliding_attention` layers causal, full ones not; rotary over the whole head.

The assertions compare each reading with what the drafter computes in hf-dflash (what was trained), on targets of
several families, with and without a reduced vocabulary and sliding-window layers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import PAD, VOCAB, make_draft, make_target
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PhiConfig
from transformers.utils import logging as hf_logging

from hf_dflash import DFlashForDrafting

FAMILIES = ["llama", "gpt_neox", "phi3", "gemma3"]
DRAFT_VOCAB = 40


def export_target(family: str):
    if family == "phi":  # Phi-1/2: partial_rotary_factor 0.5 (not among the helpers' families)
        torch.manual_seed(0)
        config = PhiConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return make_target(family)


def export_draft(target, reduced: bool, sliding: bool) -> DFlashForDrafting:
    overrides = {}
    if reduced:
        overrides["draft_vocab_size"] = DRAFT_VOCAB
    if sliding:
        overrides |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    draft = make_draft(target, block_size=4, **overrides)
    if reduced:
        draft.set_draft_vocabulary(torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB])
    return draft


# ---------------------------------------------------------------------------------------------------------------------
# The engines' readings of an exported folder
# ---------------------------------------------------------------------------------------------------------------------


def vllm_reading(folder: Path, target) -> dict:
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    nested = config.get("dflash_config", {})
    draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
    head = weights["lm_head.weight"] if "lm_head.weight" in weights else target.get_output_embeddings().weight
    offsets = weights.get("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]

    def causal(layer_type: str) -> bool:
        if config.get("is_causal") is not None:
            return bool(config["is_causal"])
        if nested.get("causal") is not None:
            return bool(nested["causal"])
        return layer_type == "sliding_attention"

    rope = config["rope_parameters"]
    return {
        "head_rows": head.detach()[:draft_vocab].float(),  # the logits processor keeps the first V_d columns
        "token_ids": torch.arange(draft_vocab) + offsets if draft_vocab != VOCAB else torch.arange(VOCAB),
        "causal": [causal(t) for t in layer_types],
        "rotary_dim": int(config["head_dim"] * rope.get("partial_rotary_factor", 1.0)),
        "rope_theta": rope["rope_theta"],
        "embedding_scale": nested.get("input_embedding_scale", 1.0),
        "num_features": weights["fc.weight"].shape[1] // config["hidden_size"],
        "target_layer_ids": nested["target_layer_ids"],
        "mask_token_id": nested["mask_token_id"],
    }


def sglang_reading(folder: Path, target) -> dict:
    config = json.loads((folder / "config.json").read_text())
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return {
        "head_rows": target.get_output_embeddings().weight.detach().float(),
        "token_ids": torch.arange(VOCAB),
        "causal": [t == "sliding_attention" for t in layer_types],
    }


def trained_causality(draft) -> list[bool]:
    return [t == "sliding_attention" and draft.config.causal_sliding_attention for t in draft.config.layer_types]


def draft_argmax(draft, target, hidden: torch.Tensor) -> torch.Tensor:
    """Target ids hf-dflash proposes from draft hidden states `[n, H]`."""
    with torch.no_grad():
        return draft.to_target_ids(draft.draft_logits(hidden, target.get_output_embeddings()).argmax(-1))


def engine_argmax(reading: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Target ids an engine proposes from the same hidden states, through the head it read."""
    logits = torch.full((hidden.shape[0], VOCAB), float("-inf"))
    logits[:, reading["token_ids"]] = hidden.float() @ reading["head_rows"].T
    return logits.argmax(-1)


# ---------------------------------------------------------------------------------------------------------------------
# vLLM reads what was trained
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocab", "reduced-vocab"])
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_reads_the_export_as_trained(family, reduced, sliding, tmp_path):
    target = export_target(family)
    draft = export_draft(target, reduced, sliding)
    draft.save_pretrained(tmp_path, layout="z-lab", target=target)
    reading = vllm_reading(tmp_path, target)

    hidden = torch.randn(64, draft.config.hidden_size, generator=torch.Generator().manual_seed(5))
    assert torch.equal(engine_argmax(reading, hidden), draft_argmax(draft, target, hidden))
    assert reading["causal"] == trained_causality(draft)
    assert reading["rotary_dim"] == 2 * draft.rotary_emb.inv_freq.numel()
    assert reading["rope_theta"] == draft.config.rope_parameters["rope_theta"]
    assert reading["num_features"] == len(reading["target_layer_ids"]) == len(draft.config.target_layer_ids)
    assert reading["mask_token_id"] == draft.config.mask_token_id
    assert DFlashForDrafting.from_pretrained(tmp_path).config.causal_sliding_attention is False  # as trained
    ids = torch.arange(VOCAB)
    embedding = target.get_input_embeddings()
    with torch.no_grad():  # the block as the drafter was trained on it, from the raw rows the engine holds
        assert torch.allclose(embedding(ids[None])[0], embedding.weight[ids] * reading["embedding_scale"], atol=1e-6)


def test_causal_sliding_drafter_is_exported_with_the_legacy_rule(tmp_path):
    target = make_target("llama")
    draft = make_draft(
        target,
        block_size=4,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        causal_sliding_attention=True,
    )
    draft.save_pretrained(tmp_path, layout="z-lab", target=target)
    config = json.loads((tmp_path / "config.json").read_text())

    assert "is_causal" not in config and "causal" not in config["dflash_config"]
    assert vllm_reading(tmp_path, target)["causal"] == trained_causality(draft) == [True, False]
    assert sglang_reading(tmp_path, target)["causal"] == [True, False]
    assert DFlashForDrafting.from_pretrained(tmp_path).config.causal_sliding_attention is True


def test_reduced_vocabulary_head_is_the_target_heads_draft_rows(tmp_path):
    target = make_target("llama")
    draft = export_draft(target, reduced=True, sliding=False)
    draft.save_pretrained(tmp_path, layout="z-lab", target=target)
    weights = load_file(tmp_path / "model.safetensors")

    assert weights["lm_head.weight"].shape == (DRAFT_VOCAB, draft.config.hidden_size)
    expected = target.get_output_embeddings().weight.detach()[draft.draft_token_ids]
    assert torch.equal(weights["lm_head.weight"], expected)
    assert torch.equal(torch.arange(DRAFT_VOCAB) + weights["d2t"], draft.draft_token_ids)
    reloaded = DFlashForDrafting.from_pretrained(tmp_path)  # the head is ignored on load, d2t kept
    assert torch.equal(reloaded.draft_token_ids, draft.draft_token_ids)


def test_full_vocabulary_export_has_no_reduced_vocabulary(tmp_path):
    target = make_target("llama")
    draft = export_draft(target, reduced=True, sliding=False)
    draft.save_pretrained(tmp_path, layout="z-lab", full_vocabulary=True)
    config = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(tmp_path / "model.safetensors")

    assert "draft_vocab_size" not in config
    assert "d2t" not in weights and "lm_head.weight" not in weights
    reading = vllm_reading(tmp_path, target)  # shares the target's whole head
    reloaded = DFlashForDrafting.from_pretrained(tmp_path).eval()
    assert reloaded.draft_token_ids is None
    hidden = torch.randn(32, draft.config.hidden_size, generator=torch.Generator().manual_seed(6))
    assert torch.equal(engine_argmax(reading, hidden), draft_argmax(reloaded, target, hidden))
    assert torch.equal(engine_argmax(sglang_reading(tmp_path, target), hidden), draft_argmax(reloaded, target, hidden))


# ---------------------------------------------------------------------------------------------------------------------
# Where an engine cannot read what was trained, the export says so
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def export_warnings(caplog):
    hf_logging.enable_propagation()
    caplog.set_level(logging.WARNING, logger="hf_dflash")
    yield caplog
    hf_logging.disable_propagation()


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("reduced", [False, True], ids=["whole-vocab", "reduced-vocab"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_export_warns_exactly_where_sglang_misreads(family, reduced, sliding, tmp_path, export_warnings):
    target = export_target(family)
    draft = export_draft(target, reduced, sliding)
    draft.save_pretrained(tmp_path, layout="z-lab", target=target)
    reading = sglang_reading(tmp_path, target)
    text = export_warnings.text

    hidden = torch.randn(64, draft.config.hidden_size, generator=torch.Generator().manual_seed(5))
    misreads_vocabulary = not torch.equal(engine_argmax(reading, hidden), draft_argmax(draft, target, hidden))
    assert misreads_vocabulary == reduced  # the random reduced vocabulary misses some full-vocabulary argmaxes
    assert ("SGLang ignores both" in text) == reduced
    assert (reading["causal"] != trained_causality(draft)) == sliding
    assert ("SGLang runs `sliding_attention` draft layers causally" in text) == sliding
    assert ("input_embedding_scale" in text) == (family == "gemma3")


def test_gemma3_export_records_the_sqrt_hidden_embedding_scale(tmp_path):
    target = make_target("gemma3")
    draft = export_draft(target, reduced=False, sliding=False)
    assert draft.config.input_embedding_scale == pytest.approx(64**0.5)
    draft.save_pretrained(tmp_path, layout="z-lab")
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["input_embedding_scale"] == (
        pytest.approx(8.0)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Rotary settings
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt_neox", "phi"])
def test_from_target_keeps_only_the_rotary_keys_the_draft_uses(family):
    target = export_target(family)
    assert target.config.rope_parameters["partial_rotary_factor"] < 1
    draft = make_draft(target)
    assert draft.config.rope_parameters == {
        "rope_type": "default",
        "rope_theta": target.config.rope_parameters["rope_theta"],
    }


def test_loading_an_older_checkpoint_drops_partial_rotary_factor(tmp_path, export_warnings):
    draft = make_draft(make_target("llama"))
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.25  # as hf-dflash copied it from a GPT-NeoX target
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = DFlashForDrafting.from_pretrained(tmp_path)
    assert "partial_rotary_factor" not in loaded.config.rope_parameters
    assert "Dropping rope_parameters ['partial_rotary_factor']" in export_warnings.text
    assert torch.equal(loaded.rotary_emb.inv_freq, draft.rotary_emb.inv_freq)  # the rotary it always had


def test_yarn_scaling_keys_are_kept():
    target = make_target("llama")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    draft = make_draft(target, rope_parameters={**yarn, "partial_rotary_factor": 0.5})
    assert draft.config.rope_parameters == yarn


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing written
# ---------------------------------------------------------------------------------------------------------------------


def test_reduced_vocabulary_export_without_target_names_both_fixes(tmp_path):
    draft = export_draft(make_target("llama"), reduced=True, sliding=False)
    with pytest.raises(ValueError, match=r"pass `target=`.*`full_vocabulary=True`"):
        draft.save_pretrained(tmp_path / "out", layout="z-lab")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left either


def test_export_with_another_targets_embedding_scale_is_refused(tmp_path):
    draft = export_draft(make_target("llama"), reduced=False, sliding=False)
    with pytest.raises(ValueError, match="embedding scale is 1, this one scales by 8"):
        draft.save_pretrained(tmp_path / "out", layout="z-lab", target=make_target("gemma3"))
    assert not (tmp_path / "out").exists()


def test_export_accepts_a_bfloat16_targets_rounded_scale_and_records_the_exact_one(tmp_path):
    """Gemma-3-270m records sqrt(640) = 25.298; loaded in bfloat16 it scales by 25.25. Here: 8.03 recorded, and a
    target whose bfloat16 scale is 8.0 (the nearest bfloat16); in float32 the same 0.4% is another target."""
    target = make_target("gemma3")
    draft = export_draft(target, reduced=False, sliding=False)
    draft.config.input_embedding_scale = 8.03
    with pytest.raises(ValueError, match="embedding scale is 8.03, this one scales by 8"):
        draft.save_pretrained(tmp_path / "fp32", layout="z-lab", target=target)
    draft.save_pretrained(tmp_path / "bf16", layout="z-lab", target=target.to(torch.bfloat16))
    assert (
        json.loads((tmp_path / "bf16" / "config.json").read_text())["dflash_config"]["input_embedding_scale"] == 8.03
    )


def test_export_of_a_drafter_without_recorded_scale_needs_the_target(tmp_path):
    target = make_target("gemma3")
    draft = export_draft(target, reduced=False, sliding=False)
    draft.config.input_embedding_scale = None  # a checkpoint from before the field existed
    with pytest.raises(ValueError, match="pass `target=`"):
        draft.save_pretrained(tmp_path / "out", layout="z-lab")
    draft.save_pretrained(tmp_path / "out", layout="z-lab", target=target)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dflash_config"]["input_embedding_scale"] == pytest.approx(8.0)


def test_biased_target_head_needs_the_full_vocabulary_export(tmp_path):
    target = export_target("phi")  # Phi-1/2's LM head has a bias, which an engine's draft head cannot hold
    draft = export_draft(target, reduced=True, sliding=False)
    with pytest.raises(ValueError, match="full_vocabulary=True"):
        draft.save_pretrained(tmp_path / "out", layout="z-lab", target=target)
    assert not (tmp_path / "out").exists()
    draft.save_pretrained(tmp_path / "out", layout="z-lab", full_vocabulary=True)
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_export_options_are_refused_for_the_hf_layout(tmp_path):
    draft = make_draft(make_target("llama"))
    with pytest.raises(ValueError, match="layout='z-lab'"):
        draft.save_pretrained(tmp_path, full_vocabulary=True)
