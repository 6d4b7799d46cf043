"""What ships with the committed drafters: remote code equal to the package's, and a z-lab copy engines read right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import HUB_FILES
from safetensors import safe_open

from hf_dflash import DFlashForDrafting

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "hf_dflash" / "model"
DRAFTERS = sorted(path.parent for path in (ROOT / "drafters").glob("*/config.json"))


@pytest.mark.parametrize("folder", DRAFTERS, ids=lambda path: path.name)
@pytest.mark.parametrize("name", HUB_FILES)
def test_remote_code_copies_equal_the_package(folder, name):
    assert (folder / name).read_bytes() == (PACKAGE / name).read_bytes(), (
        f"{folder / name} differs from src/hf_dflash/{name}: re-export the drafter "
        f"(python scripts/export_drafter.py {folder.relative_to(ROOT)} <destination> --target <its target>)."
    )


@pytest.mark.parametrize("folder", DRAFTERS, ids=lambda path: path.name)
def test_committed_drafter_exports_what_engines_need(folder, tmp_path):
    """The committed drafter records what its z-lab export needs without the target (the head's rows, which need it,
    are checked against SmolLM2 itself in tests/test_real_model.py)."""
    draft = DFlashForDrafting.from_pretrained(folder)
    config = draft.config
    assert config.input_embedding_scale is not None  # recorded, so every export can carry it
    draft.save_pretrained(tmp_path, layout="z-lab", full_vocabulary=True)
    zlab_config = json.loads((tmp_path / "config.json").read_text())
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())

    assert zlab_config["dflash_config"]["input_embedding_scale"] == config.input_embedding_scale
    assert zlab_config["rope_parameters"] == config.rope_parameters
    assert "partial_rotary_factor" not in zlab_config["rope_parameters"]
    if not config.causal_sliding_attention:
        assert zlab_config["is_causal"] is False and zlab_config["dflash_config"]["causal"] is False
    assert keys == set(draft.state_dict()) - {"d2t"}
    reloaded = DFlashForDrafting.from_pretrained(tmp_path)
    for name, tensor in reloaded.state_dict().items():
        ours = draft.state_dict()[name]
        if name.endswith("_codebook") and draft.draft_token_ids is not None:  # DFlash2: rows by target id now
            outside = torch.ones(tensor.shape[0], dtype=torch.bool)
            outside[draft.draft_token_ids] = False
            assert torch.equal(tensor[draft.draft_token_ids], ours) and not tensor[outside].any(), name
            continue
        assert torch.equal(ours, tensor), name


ADAPTERS = sorted(path.parent for path in (ROOT / "drafters").glob("*/dflash_adapter.json"))


@pytest.mark.parametrize("folder", ADAPTERS, ids=lambda path: path.name)
def test_committed_adapters_fit_their_committed_base_drafter(folder):
    """A drafter adapter is tied to its base's weights (fingerprint): re-exporting the base drafter must not silently
    invalidate it, and it must merge into a plain drafter that changes the base."""
    from hf_dflash.adapters import load_draft_adapter, read_base_drafter_record

    base_path = ROOT / read_base_drafter_record(folder)["name_or_path"]
    base = DFlashForDrafting.from_pretrained(base_path)
    merged = load_draft_adapter(DFlashForDrafting.from_pretrained(base_path), folder, merge=True)
    assert isinstance(merged, DFlashForDrafting) and torch.equal(merged.d2t, base.d2t)
    assert not torch.equal(merged.layers[0].self_attn.q_proj.weight, base.layers[0].self_attn.q_proj.weight)
    assert (folder / "README.md").is_file()
