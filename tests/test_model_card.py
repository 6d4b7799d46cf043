"""Model cards: metadata, the snippets' numbers, measured numbers only, both checkpoint layouts, the CLI."""

from __future__ import annotations

import json
import re

import pytest
from helpers import PAD, make_draft, make_target
from huggingface_hub import ModelCard

from hf_dflash.cli import main
from hf_dflash.model_card import DrafterCardInfo, card_info_from_folder, render_model_card, write_model_card

TRAINING = {
    "data": ["nvidia/Nemotron-Post-Training-Dataset-v2", "theblackcat102/evol-codealpaca-v1"],
    "num_sequences": 800000,
    "chat_template": True,
    "anchors_per_sequence": 512,
    "gamma": 7.0,
    "steps": 12345,
    "learning_rate": 6e-4,
    "max_length": 3072,
    "machine": "8x H200",
    "held_out_tau_by_step": [[500, 3.1234], [1000, 3.5]],
    "block_size": 16,  # the trainer repeats these config facts; the table shows them once
    "num_draft_layers": 5,
    "target_layer_ids": [1, 9, 17, 25, 33],
}


def filled_info(**changes) -> DrafterCardInfo:
    info = {
        "base_model": "Qwen/Qwen3-8B",
        "target_name": "Qwen3-8B",
        "drafter_repo_id": "someone/Qwen3-8B-DFlash-b16",
        "block_size": 16,
        "num_hidden_layers": 5,
        "target_layer_ids": [1, 9, 17, 25, 33],
        "mask_token_id": 151669,
        "num_target_layers": 36,
        "training": TRAINING,
        "acceptance": {
            "gsm8k": {"tau": 6.537, "speedup": 5.21, "conditions": "H200, bf16, greedy, batch 1"},
            "mt-bench": {"tau": 4.24, "speedup": None, "conditions": "H200, bf16, greedy, batch 1"},
        },
        "datasets": ["nvidia/Nemotron-Post-Training-Dataset-v2"],
        "extra_tags": ["qwen3"],
    }
    return DrafterCardInfo(**(info | changes))


def section(text: str, heading: str) -> str:
    return text.split(f"## {heading}")[1].split("\n## ")[0]


def test_metadata_parses():
    card = ModelCard(str(render_model_card(filled_info())))  # a round trip through the text the Hub stores
    data = card.data.to_dict()
    assert data["base_model"] == "Qwen/Qwen3-8B"
    assert data["license"] == "apache-2.0"
    assert data["library_name"] == "transformers"
    assert data["inference"] is False
    assert data["datasets"] == ["nvidia/Nemotron-Post-Training-Dataset-v2"]
    for tag in ("dflash", "speculative-decoding", "arxiv:2602.06036", "hf-dflash", "draft-model", "qwen3"):
        assert tag in data["tags"]


def test_body_has_snippets_training_and_measured_numbers():
    text = render_model_card(filled_info()).text
    assert "not a standalone model" in text
    assert 'AutoModel.from_pretrained("someone/Qwen3-8B-DFlash-b16", trust_remote_code=True' in text
    assert "assistant_model=draft" in text
    assert "hf_dflash.speculative_generate(target, draft" in text
    assert """vllm serve Qwen/Qwen3-8B \\\n    --speculative-config '{"method": "dflash", "model": """ in text
    assert '"num_speculative_tokens": 15}' in text
    assert "python -m sglang.launch_server --model-path Qwen/Qwen3-8B" in text
    assert "--speculative-algorithm DFLASH" in text
    assert "--speculative-num-draft-tokens 16" in text
    training = section(text, "Training")
    for value in (
        "`Qwen/Qwen3-8B`",
        "| 16 (15 drafted",
        "| 5 |",
        "1, 9, 17, 25, 33 (of 36)",
        "151669",
        "800000",
        "| Chat template | yes |",
        "| 512 |",
        "| 7 |",
        "12345",
        "0.0006",
        "3072",
        "8x H200",
        "nvidia/Nemotron-Post-Training-Dataset-v2, theblackcat102/evol-codealpaca-v1",
        "| Held-out tau during training | step 500: 3.12, step 1000: 3.50 |",
    ):
        assert value in training, value
    for label in ("Block size", "Draft layers", "Target layers read"):
        assert training.count(f"| {label} |") == 1, label
    assert "Num draft layers" not in training and "Target layer ids" not in training
    acceptance = section(text, "Acceptance length")
    assert "| gsm8k | 6.54 | 5.21x | H200, bf16, greedy, batch 1 |" in acceptance
    assert "| mt-bench | 4.24 | not measured |" in acceptance
    assert "Chen, Jian and Liang, Yesheng and Liu, Zhijian" in text and "arXiv:2602.06036" in text


def test_block_size_drives_engine_arguments():
    text = render_model_card(filled_info(block_size=8)).text
    assert '"num_speculative_tokens": 7}' in text and "--speculative-num-draft-tokens 8" in text


def test_serving_points_at_the_zlab_copy():
    text = render_model_card(filled_info(zlab_subfolder="zlab")).text
    assert 'hf download someone/Qwen3-8B-DFlash-b16 --include "zlab/*"' in text
    assert '"model": "Qwen3-8B-DFlash-b16/zlab"' in text
    text = render_model_card(filled_info(layout="z-lab")).text
    assert '"model": "someone/Qwen3-8B-DFlash-b16"' in text
    assert "trust_remote_code" not in text and 'DFlashForDrafting.from_pretrained("someone/' in text
    text = render_model_card(filled_info()).text  # hf-dflash layout only: the card says how to convert
    assert 'save_pretrained("Qwen3-8B-DFlash-b16-zlab", layout="z-lab", target=target)' in text


def test_block_size_drives_llama_cpp_arguments():
    text = render_model_card(filled_info(block_size=8)).text
    assert "--spec-type draft-dflash --spec-draft-n-max 7" in text
    assert "hf-dflash export --draft someone/Qwen3-8B-DFlash-b16 --engine llama.cpp" in text  # through the converter
    assert "-md draft-llama.cpp/draft.gguf" in text


@pytest.mark.parametrize(
    "config, expected, absent",
    [
        ({}, [], ["Reduced vocabulary", "bidirectionally", "V2 model runner", "Scaled embedding"]),
        (
            {"draft_vocab_size": 8192, "vocab_size": 49152},
            ["Reduced vocabulary** (8192 of 49152", "full_vocabulary=True"],
            ["bidirectionally"],
        ),
        (
            {"layer_types": ["sliding_attention", "full_attention"]},
            ["SGLang runs `sliding_attention` draft layers causally", "VLLM_USE_V2_MODEL_RUNNER=1"],
            ["Reduced vocabulary"],
        ),
        (
            {"layer_types": ["sliding_attention"] * 2, "causal_sliding_attention": True},
            [],
            ["bidirectionally", "V2 model runner"],
        ),
        ({"input_embedding_scale": 25.29822}, ["rows by 25.2982", "input_embedding_scale"], ["Reduced vocabulary"]),
    ],
)
def test_serving_notes_say_which_engine_misreads_what(config, expected, absent):
    serving = section(
        render_model_card(filled_info(**config)).text, "Serving with vLLM, SGLang, llama.cpp and OpenVINO"
    )
    for phrase in expected:
        assert phrase in serving
    for phrase in absent:
        assert phrase not in serving
    assert ("What the engines read" in serving) == bool(expected)


def test_card_info_reads_the_serving_facts_from_config(tmp_path):
    target = make_target("gemma3")
    draft = make_draft(
        target, draft_vocab_size=40, layer_types=["sliding_attention", "full_attention"], sliding_window=6
    )
    draft.save_pretrained(tmp_path)
    info = card_info_from_folder(tmp_path, base_model="google/gemma-3-270m")
    assert (info.vocab_size, info.draft_vocab_size) == (96, 40)
    assert info.layer_types == ["sliding_attention", "full_attention"] and not info.causal_sliding_attention
    assert info.input_embedding_scale == pytest.approx(8.0)


@pytest.mark.parametrize("tokenizer_template", [None, "{{ messages }}"])
def test_quick_start_renders_prompts_as_the_drafter_was_trained(tokenizer_template):
    """`prompt_format` records how the training prompts were rendered; the quick start does the same: a base model's
    drafter (raw text) is shown raw text, an instruct model's the chat template."""
    from types import SimpleNamespace

    from hf_dflash.training.script import RESPONSES_TEMPLATE, prompt_format

    recorded = prompt_format(SimpleNamespace(chat_template=tokenizer_template))
    assert recorded == (RESPONSES_TEMPLATE if tokenizer_template else False)
    assert prompt_format(None) is None  # a target without a tokenizer: unknown, not stated
    text = render_model_card(filled_info(training=TRAINING | {"chat_template": recorded})).text
    raw = 'tokenizer("The capital of France is", return_tensors="pt")'
    assert (raw in text) == (not tokenizer_template)
    assert ("tokenizer.apply_chat_template(" in text) == bool(tokenizer_template)
    row = "none (prompts as raw text: a base model)" if not tokenizer_template else RESPONSES_TEMPLATE
    assert f"| Chat template | {row} |" in section(text, "Training")


ENGINE = {
    "mean_accepted_length": 1.5834,
    "hf_dflash_tau": 1.6266,
    "plain_tokens_per_s": 54.397,
    "dflash_tokens_per_s": 28.73,
    "conditions": "25 prompts, 2 threads",
    "command": "python benchmarks/scripts/engine_parity.py",
}


def test_engine_measurements_are_a_table_beside_the_serving_commands():
    text = render_model_card(filled_info(engines={"llama.cpp": ENGINE})).text
    serving = section(text, "Serving with vLLM, SGLang, llama.cpp and OpenVINO")
    row = "| llama.cpp | 1.58 | 1.63 | 54.4 | 28.7 | 25 prompts, 2 threads | `python benchmarks/scripts/engine_parity.py` |"
    assert row in serving
    assert "| engine |" not in render_model_card(filled_info()).text  # nothing measured: no table
    with pytest.raises(ValueError, match="needs numbers for mean_accepted_length"):
        render_model_card(filled_info(engines={"llama.cpp": ENGINE | {"dflash_tokens_per_s": None}}))


def test_without_measurements_no_numbers_are_made_up():
    text = render_model_card(filled_info(acceptance={}, training={}, drafter_repo_id=None)).text
    acceptance = section(text, "Acceptance length")
    assert "Not measured yet" in acceptance
    assert not re.search(r"\d", acceptance)
    assert "tau" not in text.split("## Acceptance length")[0].replace("stats.tau", "")
    assert "<your-org>/Qwen3-8B-DFlash-b16" in text


def test_local_target_name_stays_out_of_metadata():
    card = render_model_card(filled_info(base_model="smollm2-135m-instruct", target_name=None))
    assert "base_model" not in card.data.to_dict()
    assert "# DFlash drafter for smollm2-135m-instruct" in card.text


@pytest.mark.parametrize(
    "target_adapter, loaded",
    [
        ("someone/Qwen3-8B-telegraph-lora", "someone/Qwen3-8B-telegraph-lora"),
        ("a telegram-style LoRA (scripts/finetune_target_lora.py)", "<the target's adapter: folder or Hub id>"),
    ],
)
def test_target_adapter_snippet_loads_a_reference_never_a_description(target_adapter, loaded):
    text = render_model_card(filled_info(target_adapter=target_adapter)).text
    assert f"fine-tuned with the adapter `{target_adapter}`" in text  # the prose names it as given
    snippet_lines = [line for line in text.splitlines() if line.startswith("target = PeftModel.from_pretrained")]
    assert snippet_lines == [
        f'target = PeftModel.from_pretrained(target, "{loaded}")  # the fine-tuned target this drafter serves'
    ]


@pytest.fixture(scope="module")
def draft():
    return make_draft(make_target("qwen3"), block_size=8, num_hidden_layers=2)


@pytest.mark.parametrize("layout", ["hf-dflash", "z-lab"])
def test_card_info_from_folder(tmp_path, draft, layout):
    draft.save_pretrained(tmp_path, layout=layout)
    (tmp_path / "training_info.json").write_text(
        json.dumps({"base_model": "org/tiny", "training": {"steps": 3}, "acceptance": {}, "datasets": ["org/data"]})
    )
    info = card_info_from_folder(tmp_path, drafter_repo_id="org/tiny-dflash")
    assert (info.block_size, info.num_hidden_layers, info.mask_token_id) == (8, 2, PAD)
    assert info.target_layer_ids == draft.config.target_layer_ids and info.num_target_layers == 3
    assert info.layout == layout and info.zlab_subfolder is None
    assert (info.base_model, info.training, info.datasets, info.drafter_repo_id) == (
        "org/tiny",
        {"steps": 3},
        ["org/data"],
        "org/tiny-dflash",
    )


def test_card_info_needs_a_target_and_a_config(tmp_path, draft):
    with pytest.raises(FileNotFoundError, match="config.json"):
        card_info_from_folder(tmp_path, base_model="org/tiny")
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="base-model"):
        card_info_from_folder(tmp_path)
    draft.save_pretrained(tmp_path / "zlab", layout="z-lab")
    assert card_info_from_folder(tmp_path, base_model="org/tiny").zlab_subfolder == "zlab"


def test_write_model_card_is_atomic(tmp_path):
    (tmp_path / "README.md").write_text("old card")
    path = write_model_card(tmp_path, filled_info())
    assert path == tmp_path / "README.md"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]
    assert ModelCard.load(path).data.base_model == "Qwen/Qwen3-8B"


def test_cli_card(tmp_path, draft, capsys):
    draft.save_pretrained(tmp_path)
    measured = tmp_path / "acceptance.json"
    measured.write_text(json.dumps({"gsm8k": {"tau": 2.5, "speedup": 1.3, "conditions": "CPU, fp32"}}))
    argv = ["card", str(tmp_path), "--base-model", "org/tiny", "--repo-id", "org/tiny-dflash", "--license", "mit"]
    assert main(argv + ["--acceptance-json", str(measured)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "README.md") in out and "gsm8k tau 2.50" in out
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.license == "mit" and card.data.base_model == "org/tiny"
    assert "| gsm8k | 2.50 | 1.30x | CPU, fp32 |" in card.text
    assert '"num_speculative_tokens": 7}' in card.text
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert main(["card", str(tmp_path), "--base-model", "org/tiny"]) == 0  # a refresh keeps the license given once
    assert ModelCard.load(tmp_path / "README.md").data.license == "mit"


def test_cli_card_without_config(tmp_path, capsys):
    assert main(["card", str(tmp_path), "--base-model", "org/tiny"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_card_adds_measured_sets_to_the_recorded_ones(tmp_path, draft, capsys):
    """`--acceptance_json` adds sets to the folder's `training_info.json` (a set measured again is replaced, the
    others stay), so a later card without it still shows every measurement."""
    draft.save_pretrained(tmp_path)
    held_out = {"tau": 1.9, "speedup": None, "conditions": "4 held-out prompts"}
    (tmp_path / "training_info.json").write_text(
        json.dumps({"base_model": "org/tiny", "acceptance": {"held-out": held_out, "gsm8k": {"tau": 1.2}}})
    )
    measured = tmp_path / "report.json"
    measured.write_text(json.dumps({"acceptance": {"gsm8k": {"tau": 1.76, "speedup": None, "conditions": "16"}}}))
    assert main(["card", str(tmp_path), "--acceptance_json", str(measured)]) == 0
    assert main(["card", str(tmp_path)]) == 0  # a refresh keeps what was recorded
    card = (tmp_path / "README.md").read_text()
    assert "| held-out | 1.90 |" in card and "| gsm8k | 1.76 |" in card and "| gsm8k | 1.20 |" not in card
    info = json.loads((tmp_path / "training_info.json").read_text())
    assert info["base_model"] == "org/tiny" and set(info["acceptance"]) == {"held-out", "gsm8k"}
    capsys.readouterr()


@pytest.mark.parametrize("measured", [{"gsm8k": {"speedup": 1.3}}, {"gsm8k": {"tau": "fast"}}, ["gsm8k", 1.7]])
def test_cli_card_refuses_acceptance_without_a_numeric_tau(tmp_path, draft, capsys, measured):
    draft.save_pretrained(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps(measured))
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["card", str(tmp_path), "--base_model", "org/tiny", "--acceptance_json", str(tmp_path / "report.json")]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "hf-dflash card: error" in error and '"tau"' in error
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no card, no training_info.json
