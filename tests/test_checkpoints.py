"""Checkpoint layouts: hf-dflash (default, with remote code), z-lab (vLLM / SGLang) and transformers-native.

Every load must give back exactly the weights and the forward outputs that were saved; a save must never leave a
half-written folder behind.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from helpers import HUB_FILES, PAD, VOCAB, make_draft, make_target
from safetensors import safe_open
from transformers import AutoModel, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.cache_utils import DFlashCache

from hf_dflash import DFlashConfig, DFlashForDrafting
from hf_dflash.model.modeling_dflash import NATIVE_KEY_MAPPING

HIDDEN = 64  # helpers' llama target


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Perturb every parameter (norms included), so that a weight loaded into the wrong slot changes the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator) * scale
            parameter.add_(noise.to(parameter.dtype))
    return model


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def draft(target):
    return randomize(make_draft(target, block_size=4, num_hidden_layers=2), seed=3)


def draft_inputs(config, num_context: int, start: int = 0, seed: int = 0, dtype=torch.float32):
    """Random `(noise_embeds, context_hidden_states, position_ids)` for one draft call."""
    generator = torch.Generator().manual_seed(seed)
    num_features = len(config.target_layer_ids)
    noise = torch.randn(1, config.block_size, config.hidden_size, generator=generator)
    context = torch.randn(1, num_context, num_features * config.hidden_size, generator=generator)
    positions = torch.arange(start, start + num_context + config.block_size)[None]
    return noise.to(dtype), context.to(dtype), positions


@torch.no_grad()
def cached_rounds(model, config, context_lengths=(5, 3, 1, 4)) -> list[torch.Tensor]:
    """Outputs of several draft calls sharing a `DFlashCache`, the way the native generator drives it: context of the
    newly committed tokens, then the block, which is cropped after each call."""
    cache = DFlashCache(config=config)
    cache.activate_past_recording()
    outputs, start = [], 0
    for call, num_context in enumerate(context_lengths):
        noise, context, positions = draft_inputs(config, num_context, start, seed=call)
        cache.set_previous_accepted_tokens(num_context)  # read by the native model's mask sizes only
        outputs.append(
            model(
                noise_embeds=noise, context_hidden_states=context, position_ids=positions, cache=cache
            ).last_hidden_state.clone()
        )
        cache.crop(-config.block_size)
        start += num_context
    return outputs


@torch.no_grad()
def uncached(model, config, num_context: int = 6) -> torch.Tensor:
    noise, context, positions = draft_inputs(config, num_context, seed=11)
    return model(noise_embeds=noise, context_hidden_states=context, position_ids=positions).last_hidden_state


def assert_same_outputs(model_a, model_b, config_a, config_b=None) -> None:
    config_b = config_b or config_a
    torch.testing.assert_close(uncached(model_a, config_a), uncached(model_b, config_b), rtol=0, atol=0)
    for out_a, out_b in zip(cached_rounds(model_a, config_a), cached_rounds(model_b, config_b), strict=True):
        torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)


def assert_same_weights(model_a, model_b) -> None:
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert sorted(state_a) == sorted(state_b)
    for name, tensor in state_a.items():
        assert torch.equal(tensor, state_b[name]), name


def folder_snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# ---------------------------------------------------------------------------------------------------------------------
# hf-dflash layout (default)
# ---------------------------------------------------------------------------------------------------------------------


def test_default_layout_round_trip(draft, tmp_path):
    draft.save_pretrained(tmp_path)

    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["model_type"] == "dflash"
    assert config_json["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlashForDrafting",
    }
    for name in HUB_FILES:
        assert (tmp_path / name).is_file(), name
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert not any("embed" in key or "lm_head" in key or "rotary" in key for key in weights.keys())

    by_class = DFlashForDrafting.from_pretrained(tmp_path).eval()
    by_auto = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    for loaded in (by_class, by_auto):
        for field in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers"):
            assert getattr(loaded.config, field) == getattr(draft.config, field), field
        assert loaded.config.block_size == 4 and loaded.config.mask_token_id == PAD
        assert loaded.config.num_target_layers == 3
        assert_same_weights(draft, loaded)
        assert_same_outputs(draft, loaded, draft.config)


def test_remote_code_files_import_nothing_from_hf_dflash(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    for name in HUB_FILES:
        tree = ast.parse((tmp_path / name).read_text(), filename=name)
        imported = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: must be a sibling copied next to the weights
                    assert f"{module}.py" in HUB_FILES, (name, module)
                else:
                    imported.append(module)
        offending = [module for module in imported if module.split(".")[0] == "hf_dflash"]
        assert not offending, f"{name} imports {offending}"


FRESH_PROCESS_SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import json
    import sys


    class BlockHfDflash(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_dflash" or name.startswith("hf_dflash."):
                raise ImportError(f"{name} is blocked in this test")
            return None


    sys.meta_path.insert(0, BlockHfDflash())
    try:
        import hf_dflash  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_dflash should not be importable here")

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, GenerationMixin

    draft_dir, target_dir = sys.argv[1], sys.argv[2]
    draft = AutoModel.from_pretrained(draft_dir, trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()

    routing = GenerationMixin._get_candidate_generator
    AutoModel.from_pretrained(draft_dir, trust_remote_code=True)  # a second draft must not wrap again
    rewrapped = GenerationMixin._get_candidate_generator is not routing

    generators = []
    def spy(self, *args, **kwargs):
        generator = routing(self, *args, **kwargs)
        generators.append(type(generator).__name__)
        return generator
    GenerationMixin._get_candidate_generator = spy

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        assisted = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=30)
        plain = target.generate(ids, do_sample=False, max_new_tokens=30)
    print("RESULT " + json.dumps({
        "assisted": assisted.tolist(),
        "plain": plain.tolist(),
        "generators": generators,
        "draft_module": type(draft).__module__,
        "hf_dflash_modules": sorted(m for m in sys.modules if m.split(".")[0] == "hf_dflash"),
        "rewrapped": rewrapped,
    }))
    """
)


@pytest.mark.parametrize("overrides", [{}, {"variant": "dflash2", "selector_rank": 8}], ids=["dflash", "dflash2"])
def test_fresh_process_without_hf_dflash_routes_to_dflash(tmp_path, overrides):
    target = make_target("llama", seed=4)
    draft = randomize(make_draft(target, block_size=4, **overrides), seed=5)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS_SCRIPT, str(tmp_path / "draft"), str(tmp_path / "target")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    report = json.loads(line.removeprefix("RESULT "))

    assert report["hf_dflash_modules"] == []
    assert report["draft_module"].startswith("transformers_modules."), report["draft_module"]
    assert not report["rewrapped"]
    assert report["generators"] == ["DFlashCandidateGenerator"]
    assert len(report["plain"][0]) == 7 + 30
    assert report["assisted"] == report["plain"]


# ---------------------------------------------------------------------------------------------------------------------
# z-lab layout (vLLM, SGLang)
# ---------------------------------------------------------------------------------------------------------------------


def zlab_key_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a z-lab DFlash checkpoint, with its shape."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "norm.weight": (hidden,),
        "fc.weight": (hidden, len(config.target_layer_ids) * hidden),
        "hidden_norm.weight": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        layer = f"layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_out, hidden),
            layer + "self_attn.k_proj.weight": (kv_out, hidden),
            layer + "self_attn.v_proj.weight": (kv_out, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_out),
            layer + "self_attn.q_norm.weight": (head_dim,),
            layer + "self_attn.k_norm.weight": (head_dim,),
            layer + "mlp.gate_proj.weight": (config.intermediate_size, hidden),
            layer + "mlp.up_proj.weight": (config.intermediate_size, hidden),
            layer + "mlp.down_proj.weight": (hidden, config.intermediate_size),
        }
    return shapes


def test_zlab_layout_written_and_reloaded(draft, tmp_path):
    draft.save_pretrained(tmp_path, layout="z-lab")

    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["model_type"] == "qwen3"
    assert config_json["architectures"] == ["DFlashDraftModel"]
    assert config_json["block_size"] == 4
    assert config_json["num_target_layers"] == 3
    assert config_json["dflash_config"] == {
        "mask_token_id": PAD,
        "target_layer_ids": draft.config.target_layer_ids,
        "input_embedding_scale": 1.0,
        "causal": False,
    }
    assert config_json["is_causal"] is False
    assert "auto_map" not in config_json
    assert "mask_token_id" not in config_json and "target_layer_ids" not in config_json
    assert config_json["rope_theta"] == draft.config.rope_parameters["rope_theta"]
    assert config_json["hidden_size"] == HIDDEN and config_json["vocab_size"] == VOCAB
    assert config_json["dtype"] == "float32"

    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        shapes = {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}
    assert shapes == zlab_key_shapes(draft.config)

    loaded = DFlashForDrafting.from_pretrained(tmp_path).eval()
    for field in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "hidden_size"):
        assert getattr(loaded.config, field) == getattr(draft.config, field), field
    assert loaded.config.rope_parameters["rope_theta"] == draft.config.rope_parameters["rope_theta"]
    assert_same_weights(draft, loaded)
    assert_same_outputs(draft, loaded, draft.config)


def test_zlab_layout_bf16_round_trip(draft, tmp_path):
    draft_bf16 = DFlashForDrafting._from_config(draft.config, dtype=torch.bfloat16).eval()
    draft_bf16.load_state_dict(draft.state_dict())
    draft_bf16.save_pretrained(tmp_path, layout="z-lab")

    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(key).dtype for key in weights.keys()} == {torch.bfloat16}

    loaded = DFlashForDrafting.from_pretrained(tmp_path).eval()
    assert loaded.dtype == torch.bfloat16
    assert_same_weights(draft_bf16, loaded)
    with torch.no_grad():
        noise, context, positions = draft_inputs(loaded.config, 5, dtype=torch.bfloat16)
        expected = draft_bf16(noise_embeds=noise, context_hidden_states=context, position_ids=positions)
        got = loaded(noise_embeds=noise, context_hidden_states=context, position_ids=positions)
    assert torch.equal(expected.last_hidden_state, got.last_hidden_state)


def test_from_target_bf16_keeps_rope_frequencies_fp32(tmp_path):
    target_bf16 = make_target("llama", dtype=torch.bfloat16)
    draft_bf16 = make_draft(target_bf16, block_size=4)
    assert draft_bf16.dtype == torch.bfloat16
    assert draft_bf16.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(draft_bf16.rotary_emb.inv_freq, target_bf16.model.rotary_emb.inv_freq)


def published_zlab_checkpoint(folder: Path, dtype: torch.dtype, sliding: bool = False) -> dict[str, torch.Tensor]:
    """Hand-written files shaped like z-lab/Qwen3-4B-DFlash-b16 (transformers 4.57 era config), tiny."""
    hidden, layers, head_dim = 32, 2, 8
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},  # a file the checkpoint does not ship
        "block_size": 8,
        "bos_token_id": 1,
        "dflash_config": {"mask_token_id": 100, "target_layer_ids": [1, 3, 5]},
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * layers,
        "max_position_embeddings": 512,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "num_target_layers": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 16 if sliding else None,
        "tie_word_embeddings": True,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": sliding,
        "vocab_size": 128,
    }
    shapes = zlab_key_shapes(
        DFlashConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map")})
    )
    generator = torch.Generator().manual_seed(7)
    weights = {key: (torch.randn(shape, generator=generator) * 0.2).to(dtype) for key, shape in shapes.items()}
    safetensors.torch.save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_published_zlab_checkpoint_loads(dtype, tmp_path):
    weights = published_zlab_checkpoint(tmp_path, dtype)
    loaded = DFlashForDrafting.from_pretrained(tmp_path).eval()

    assert loaded.config.mask_token_id == 100
    assert loaded.config.target_layer_ids == [1, 3, 5]
    assert loaded.config.block_size == 8
    assert loaded.config.num_target_layers == 8
    assert loaded.config.rope_parameters["rope_theta"] == 1_000_000
    assert loaded.config.layer_types == ["full_attention"] * 2
    assert loaded.dtype == dtype
    state = loaded.state_dict()
    assert sorted(state) == sorted(weights)
    for key, tensor in weights.items():
        assert torch.equal(state[key], tensor), key
    with torch.no_grad():
        noise, context, positions = draft_inputs(loaded.config, 3, dtype=dtype)
        out = loaded(noise_embeds=noise, context_hidden_states=context, position_ids=positions).last_hidden_state
    assert out.shape == (1, 8, 32) and torch.isfinite(out).all()


def test_published_zlab_sliding_checkpoint_loads(tmp_path):
    published_zlab_checkpoint(tmp_path, torch.float32, sliding=True)
    loaded = DFlashForDrafting.from_pretrained(tmp_path)
    assert loaded.config.layer_types == ["sliding_attention"] * 2
    assert loaded.config.sliding_window == 16
    assert all(layer.self_attn.sliding_window == 16 for layer in loaded.layers)
    assert loaded.config.causal_sliding_attention  # no causality key: vLLM and SGLang run such layers causally


def test_zlab_checkpoint_with_causal_full_layers_is_refused(tmp_path):
    published_zlab_checkpoint(tmp_path, torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_causal": True}))
    with pytest.raises(ValueError, match="full-attention draft layers causal"):
        DFlashForDrafting.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# transformers-native layout (`muse_glimmer_assistant`)
# ---------------------------------------------------------------------------------------------------------------------


def native_assistant(layer_types: list[str], sliding_window: int = 2048, seed: int = 8) -> MuseGlimmerAssistantModel:
    config = MuseGlimmerAssistantConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256,
        block_size=4,
        mask_token_id=120,
        target_layer_ids=[0, 2],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return randomize(MuseGlimmerAssistantModel(config), seed=seed, scale=0.3).eval()


def test_native_layout_matches_transformers(tmp_path):
    native = native_assistant(["full_attention"] * 3)
    native.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "muse_glimmer_assistant"

    ours = DFlashForDrafting.from_pretrained(tmp_path).eval()
    assert (ours.config.block_size, ours.config.mask_token_id, ours.config.target_layer_ids) == (4, 120, [0, 2])
    assert ours.fc.weight.shape == (32, 64)
    assert torch.equal(ours.fc.weight, native.encoder.fc.weight)
    assert torch.equal(ours.hidden_norm.weight, native.encoder.output_norm_enc.weight)
    assert_same_outputs(native, ours, native.config, ours.config)


def test_native_layout_matches_transformers_with_padding_mask(tmp_path):
    """A keep-mask over all keys (a left-padded context slot) is read the same way by both models."""
    native = native_assistant(["full_attention"] * 2)
    native.save_pretrained(tmp_path)
    ours = DFlashForDrafting.from_pretrained(tmp_path).eval()
    noise, context, positions = draft_inputs(ours.config, 6, seed=2)
    keep = torch.ones(1, 6 + 4, dtype=torch.long)
    keep[:, :2] = 0
    with torch.no_grad():
        expected = native(
            noise_embeds=noise, context_hidden_states=context, position_ids=positions, attention_mask=keep
        )
        got = ours(noise_embeds=noise, context_hidden_states=context, position_ids=positions, attention_mask=keep)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sliding_window", [3, 6])
def test_native_sliding_window_counts_one_more_key(sliding_window, tmp_path):
    """transformers' bidirectional sliding mask keeps keys at distance <= window (`abs(q - kv) <= sliding_window`);
    ours, like Qwen3's causal one, keeps distance < window. A native window w is therefore our window w + 1."""
    native = native_assistant(["sliding_attention", "full_attention"], sliding_window=sliding_window)
    native.save_pretrained(tmp_path)
    fields = native.config.to_dict()
    for name in ("model_type", "architectures", "transformers_version", "dtype"):
        fields.pop(name, None)
    fields["sliding_window"] = sliding_window + 1
    ours = DFlashForDrafting.from_pretrained(
        tmp_path, config=DFlashConfig(**fields), key_mapping=NATIVE_KEY_MAPPING
    ).eval()
    # The native model cannot run its sliding layers without a cache (its mask ignores the context), so compare the
    # cached rounds only; they cross the window several times.
    for expected, got in zip(cached_rounds(native, native.config), cached_rounds(ours, ours.config), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # boolean vs additive mask in SDPA


def test_native_sliding_layout_matches_transformers(tmp_path):
    native = native_assistant(["sliding_attention", "full_attention"], sliding_window=3)
    native.save_pretrained(tmp_path)
    ours = DFlashForDrafting.from_pretrained(tmp_path).eval()
    for expected, got in zip(cached_rounds(native, native.config), cached_rounds(ours, ours.config), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # boolean vs additive mask in SDPA


# ---------------------------------------------------------------------------------------------------------------------
# Incomplete checkpoints and failed saves
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["hf-dflash", "z-lab"])
def test_missing_weight_raises(draft, layout, tmp_path):
    draft.save_pretrained(tmp_path, layout=layout)
    weights = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del weights["layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        DFlashForDrafting.from_pretrained(tmp_path)


def test_missing_native_weight_raises(tmp_path):
    native_assistant(["full_attention"] * 2).save_pretrained(tmp_path)
    weights = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del weights["encoder.output_norm_enc.weight"]
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    with pytest.raises(ValueError, match=r"hidden_norm\.weight"):
        DFlashForDrafting.from_pretrained(tmp_path)


def failing_save_file(tensors, filename, *args, **kwargs):
    """Write part of the file, then fail like a full disk would."""
    Path(filename).write_bytes(b"\x00" * 128)
    raise OSError("No space left on device")


@pytest.mark.parametrize("layout", ["hf-dflash", "z-lab"])
def test_failed_save_leaves_nothing_half_written(draft, layout, tmp_path, monkeypatch):
    fresh, previous = tmp_path / "fresh", tmp_path / "previous"
    draft.save_pretrained(previous, layout=layout)
    before = folder_snapshot(previous)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", failing_save_file)
    monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
    changed = randomize(make_draft(make_target("llama"), block_size=4, num_hidden_layers=2), seed=9)
    for folder in (fresh, previous):
        with pytest.raises(OSError, match="No space left"):
            changed.save_pretrained(folder, layout=layout)

    assert not fresh.exists()
    assert folder_snapshot(previous) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["previous"]  # no temporary folder left behind


def test_failed_save_from_state_dict_leaves_nothing(draft, tmp_path, monkeypatch):
    """A failure before any weight file is written (the config is already in the temporary folder)."""

    def broken_state_dict(*args, **kwargs):
        raise RuntimeError("state_dict failed")

    monkeypatch.setattr(draft, "state_dict", broken_state_dict)
    for layout in ("hf-dflash", "z-lab"):
        with pytest.raises(RuntimeError, match="state_dict failed"):
            draft.save_pretrained(tmp_path / "out", layout=layout)
    assert list(tmp_path.iterdir()) == []


def test_unknown_layout_raises(draft, tmp_path):
    with pytest.raises(ValueError, match=r"Unknown layout 'vllm'.*'hf-dflash'.*'z-lab'"):
        draft.save_pretrained(tmp_path / "out", layout="vllm")
    assert list(tmp_path.iterdir()) == []


def test_resave_sharded_over_unsharded_loads_new_weights(target, tmp_path):
    draft = randomize(make_draft(target, block_size=4), seed=10)
    draft.save_pretrained(tmp_path)
    randomize(draft, seed=11)
    draft.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    assert_same_weights(draft, DFlashForDrafting.from_pretrained(tmp_path))
