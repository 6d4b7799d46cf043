"""What ships with the committed drafters: remote code equal to the package's, and a z-lab copy engines read right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_dflash import DFlashForDrafting

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "hf_dflash"
DRAFTERS = sorted(path.parent for path in (ROOT / "drafters").glob("*/config.json"))
HUB_FILES = ("configuration_dflash.py", "modeling_dflash.py", "generation_dflash.py")


@pytest.mark.parametrize("folder", DRAFTERS, ids=lambda path: path.name)
@pytest.mark.parametrize("name", HUB_FILES)
def test_remote_code_copies_equal_the_package(folder, name):
    assert (folder / name).read_bytes() == (PACKAGE / name).read_bytes(), (
        f"{folder / name} differs from src/hf_dflash/{name}: re-export the drafter "
        f"(python scripts/export_drafter.py {folder.relative_to(ROOT)} <destination> --target <its target>)."
    )


@pytest.mark.parametrize("folder", DRAFTERS, ids=lambda path: path.name)
def test_committed_zlab_copy_is_read_as_trained(folder):
    draft = DFlashForDrafting.from_pretrained(folder)
    config = draft.config
    zlab_config = json.loads((folder / "zlab" / "config.json").read_text())
    with safe_open(folder / "zlab" / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
        shapes = {key: tuple(weights.get_slice(key).get_shape()) for key in keys}
        d2t = weights.get_tensor("d2t") if "d2t" in keys else None

    assert config.input_embedding_scale is not None  # recorded, so every export can carry it
    assert zlab_config["dflash_config"]["input_embedding_scale"] == config.input_embedding_scale
    assert zlab_config["rope_parameters"] == config.rope_parameters
    assert "partial_rotary_factor" not in zlab_config["rope_parameters"]
    if not config.causal_sliding_attention:
        assert zlab_config["is_causal"] is False and zlab_config["dflash_config"]["causal"] is False
    assert set(draft.state_dict()) <= keys
    if config.draft_vocab_size is not None:
        assert shapes["lm_head.weight"] == (config.draft_vocab_size, config.hidden_size)
        assert torch.equal(d2t, draft.d2t)
    reloaded = DFlashForDrafting.from_pretrained(folder / "zlab")
    for name, tensor in draft.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
