"""A user's own target, end to end: `hf-dflash data`, `train`, `bench` and `card` on a model folder, each command in its
own process with `--target <folder> --device cpu`, as docs/training.md's "From your model to a drafter" runs them.

The target is a tiny random Llama saved with a real tokenizer (SmolLM2's, with its chat template), so every command
meets what a user's folder holds. Marked slow: four fresh processes (about a minute on 2 cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_dflash import DFlashForDrafting
from hf_dflash.data.chat import encode_prompt
from hf_dflash.data.sources import prompts_from_jsonl
from hf_dflash.targets import converted_target_folder

pytestmark = pytest.mark.slow
ABLATE = Path(__file__).parents[1] / "benchmarks" / "scripts" / "ablate.py"


def hf_dflash(*argv: str, cwd) -> subprocess.CompletedProcess:
    """Run `hf-dflash ARGV` in a fresh process, which must exit 0; returns the finished process."""
    result = subprocess.run(
        [sys.executable, "-m", "hf_dflash.cli", *argv], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"hf-dflash {argv[0]} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder holding `model/` (tiny Llama + SmolLM2's tokenizer) and `prompts.jsonl` (12 prompts)."""
    root = tmp_path_factory.mktemp("pipeline")
    tokenizer = AutoTokenizer.from_pretrained(converted_target_folder("smollm2-135m-instruct"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    lines = [json.dumps({"prompt": f"Write a short note number {i} about ships and the sea."}) for i in range(12)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_data_train_bench_and_card_run_on_a_model_folder(workspace):
    target = ["--target", "./model", "--device", "cpu"]

    hf_dflash("data", *target, "--source", "prompts.jsonl", "--num_prompts", "12", "--max_new_tokens", "24",
              "--output", "data.jsonl", cwd=workspace)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(workspace / "model")
    records = [json.loads(line) for line in (workspace / "data.jsonl").read_text().splitlines()]
    prompts = {prompt.id: prompt for prompt in prompts_from_jsonl(workspace / "prompts.jsonl")}
    assert sorted(record["id"] for record in records) == sorted(prompts)
    for record in records:  # the target's chat template, then its own response under the loss mask
        prompt_ids = encode_prompt(tokenizer, prompts[record["id"]])
        assert record["input_ids"][: record["prompt_len"]] == prompt_ids
        assert record["loss_mask"] == [0] * len(prompt_ids) + [1] * (len(record["input_ids"]) - len(prompt_ids))

    hf_dflash("train", *target, "--data", "data.jsonl", "--output_dir", "drafter", "--max_steps", "4",
              "--block_size", "4", "--acceptance_holdout", "2", "--per_device_train_batch_size", "2",
              "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", cwd=workspace)  # fmt: skip
    info = json.loads((workspace / "drafter" / "training_info.json").read_text())
    assert info["training"]["steps"] == 4 and info["training"]["num_sequences"] == 10
    draft = DFlashForDrafting.from_pretrained(workspace / "drafter")
    assert draft.config.block_size == 4 and draft.config.mask_token_id < len(tokenizer)

    result = hf_dflash("bench", *target, "--draft", "drafter", "--datasets", "gsm8k:2", "--max_new_tokens", "16",
                       "--methods", "ours", "--draft_block_sizes", "--batch_sizes", "--output", "bench.json",
                       cwd=workspace)  # fmt: skip
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["identical"] and not report["failures"] and report["identity_checked"]
    assert report["conditions"]["device"] == "cpu" and report["conditions"]["target"] == "./model"
    ours = report["datasets"]["gsm8k"]["methods"]["ours"]
    assert ours["prompts"] == 2 and ours["tau"] >= 1.0 and ours["rounds"] + ours["plain_steps"] > 0

    result = hf_dflash("card", "drafter", "--base_model", "me/my-model", cwd=workspace)
    card = (workspace / "drafter" / "README.md").read_text()
    assert "base_model: me/my-model" in card and "held-out tau" in result.stdout


def test_the_ablation_harness_trains_each_variant_once_and_measures_it(workspace):
    hf_dflash("data", "--target", "./model", "--device", "cpu", "--source", "prompts.jsonl", "--num_prompts", "12",
              "--max_new_tokens", "24", "--output", "ablation-data.jsonl", cwd=workspace)  # fmt: skip
    command = [
        sys.executable, str(ABLATE), "--target", "./model", "--data", "ablation-data.jsonl", "--runs", "runs",
        "--output", "report/ablation.json", "--holdout", "2", "--curve_steps", "2", "--limit", "1",
        "--max_new_tokens", "8", "--hf_dflash", f"{sys.executable} -m hf_dflash.cli",
        "--common", "--max_steps 4 --block_size 4 --per_device_train_batch_size 2 --disable_tqdm true",
        "--variant", "baseline=", "--variant", "init-target=--draft_init target",
    ]  # fmt: skip
    one_thread = os.environ | {"OMP_NUM_THREADS": "1"}  # recorded per variant: trainings may run side by side
    subprocess.run(command, cwd=workspace, check=True, capture_output=True, timeout=600, env=one_thread)
    report = json.loads((workspace / "report" / "ablation.json").read_text())
    assert list(report["variants"]) == ["baseline", "init-target"]
    for name, init in (("baseline", "random"), ("init-target", "target")):
        row = report["variants"][name]
        info = json.loads((workspace / "runs" / name / "training_info.json").read_text())
        assert info["training"]["draft_init"] == init and info["training"]["steps"] == 4
        assert row["cpu_min"] > row["train_cpu_min"] > 0 and row["draft_step_ms"] > 0
        assert row["training_threads"] == "1"
        assert info["training"]["train_cpu_s"] == pytest.approx(60 * row["train_cpu_min"], abs=0.6)
        minutes = [step_minutes for step_minutes, _ in row["held_out_curve"]]
        assert minutes == pytest.approx([row["train_cpu_min"] / 2, row["train_cpu_min"]], abs=0.01)
        assert sorted(row["acceptance"]) == ["gsm8k", "held-out", "humaneval", "mt-bench"]
        assert all(
            r["tau_whole_block"] >= 1 and r["planner_tokens_per_forward"] >= 1 for r in row["acceptance"].values()
        )
    table = (workspace / "report" / "ablation.md").read_text()
    assert table.count("\n| baseline |") + table.count("\n| init-target |") == 2
    assert (workspace / "report" / "ablation.png").stat().st_size > 0

    # A rerun with one more variant trains and measures only that one.
    trained = (workspace / "runs" / "baseline.log").stat().st_mtime_ns
    subprocess.run([*command, "--variant", "accept-1.0=--acceptance_loss_weight 1"], cwd=workspace, check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    rerun = json.loads((workspace / "report" / "ablation.json").read_text())
    assert list(rerun["variants"]) == ["baseline", "init-target", "accept-1.0"]
    assert (workspace / "runs" / "accept-1.0.log").is_file()  # a dotted name keeps its whole name
    assert rerun["variants"]["baseline"] == report["variants"]["baseline"]
    assert "accept-1.0=" in rerun["variants"]["accept-1.0"]["measured_by"]  # each row keeps the run that measured it
    assert "accept-1.0=" not in rerun["variants"]["baseline"]["measured_by"]
    assert (workspace / "runs" / "baseline.log").stat().st_mtime_ns == trained

    # A trained variant is never reused for another command: the harness stops and says so.
    changed = [arg.replace("--max_steps 4", "--max_steps 5") for arg in command]
    refused = subprocess.run(changed, cwd=workspace, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "trained by another command" in refused.stderr
