"""PEFT: LoRA-adapted targets decode, train and load everywhere a plain target does.

Each adapted target has non-zero LoRA weights that change its greedy output (asserted), so a path that ran the base
model instead of the adapted one would fail its identity check."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import PAD, make_draft, make_oracle, make_target
from peft import LoraConfig, PeftModel, get_peft_model

from hf_dflash import DFlashForDrafting, loading, speculative_generate
from hf_dflash.adapters import DRAFT_LORA_MODULES
from hf_dflash.training import DFlashTrainer, DFlashTrainingArguments

FAMILIES = ["llama", "qwen3", "mistral"]
MAX_NEW = 24


def lora_target(family: str, seed: int = 3) -> PeftModel:
    """A tiny target of `family` under a LoRA whose weights are random (non-zero), in eval mode."""
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(make_target(family), config).eval()


def prompt(seed: int = 0, length: int = 7) -> torch.Tensor:
    return torch.randint(0, PAD - 1, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return model.generate(input_ids=input_ids, max_new_tokens=MAX_NEW, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_an_adapted_target_decodes_its_own_output_on_both_paths(family, merged):
    target = lora_target(family)
    target = target.merge_and_unload().eval() if merged else target
    ids = prompt()
    reference = greedy(target, ids)
    assert not torch.equal(reference, greedy(make_target(family), ids))  # the adapter changes what is said
    oracle = make_oracle(target, [reference[0]], p_wrong=0.25, block_size=4)
    out = speculative_generate(target, oracle, ids, torch.ones_like(ids), max_new_tokens=MAX_NEW)
    assert torch.equal(out.sequences, reference) and out.stats.tau > 1.5
    assert torch.equal(greedy(target, ids, assistant_model=oracle), reference)
    draft = DFlashForDrafting.from_target(target, num_hidden_layers=1, block_size=4, mask_token_id=PAD).eval()
    assert torch.equal(speculative_generate(target, draft, ids, torch.ones_like(ids), max_new_tokens=MAX_NEW).sequences,
                       reference)  # fmt: skip


def test_from_target_reads_the_adapted_model_as_the_base_shapes():
    adapted, base = lora_target("qwen3"), make_target("qwen3")
    torch.manual_seed(0)
    from_adapted = DFlashForDrafting.from_target(adapted, num_hidden_layers=1, block_size=4, mask_token_id=PAD)
    torch.manual_seed(0)
    from_base = DFlashForDrafting.from_target(base, num_hidden_layers=1, block_size=4, mask_token_id=PAD)
    assert from_adapted.config.to_dict() | {"_name_or_path": ""} == from_base.config.to_dict() | {"_name_or_path": ""}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainer_learns_from_the_adapted_targets_features(tmp_path, family):
    adapted = lora_target(family)
    merged = lora_target(family).merge_and_unload().eval()
    records = []
    for seed in range(3):
        sequence = greedy(adapted, prompt(seed))[0].tolist()
        records.append({"input_ids": sequence, "loss_mask": [0] * 7 + [1] * (len(sequence) - 7)})
    dataset = Dataset.from_list(records)
    args = DFlashTrainingArguments(
        output_dir=str(tmp_path), block_size=4, num_anchors=8, report_to="none", use_cpu=True, save_strategy="no"
    )
    losses = {}
    for name, target in {"adapted": adapted, "merged": merged, "base": make_target(family)}.items():
        draft = make_draft(adapted, block_size=4, num_hidden_layers=1).train()
        trainer = DFlashTrainer(model=draft, target=target, args=args, train_dataset=dataset)
        batch = trainer.data_collator([dict(dataset[i]) for i in range(3)])
        losses[name] = trainer.compute_loss(draft, batch).item()
    assert losses["adapted"] == pytest.approx(losses["merged"], abs=1e-4)
    assert abs(losses["adapted"] - losses["base"]) > 1e-3  # the features are the adapted target's


@pytest.fixture(scope="module")
def adapter_folders(tmp_path_factory):
    """`target/` (a tiny Llama) and `adapter/` (a LoRA of it with random weights), saved as a user would."""
    root = tmp_path_factory.mktemp("peft")
    make_target("llama").save_pretrained(root / "target")
    lora_target("llama").save_pretrained(root / "adapter")
    return root


@pytest.mark.parametrize("merge", [False, True], ids=["unmerged", "merged"])
def test_the_loader_applies_a_target_adapter_unmerged_or_merged(adapter_folders, merge):
    target, _ = loading.load_target_and_tokenizer(
        adapter_folders / "target",
        target_adapter=adapter_folders / "adapter",
        merge_target_adapter=merge,
        tokenizer_required=False,
    )
    assert isinstance(target, PeftModel) != merge
    assert torch.equal(greedy(target, prompt()), greedy(lora_target("llama"), prompt()))


def test_an_adapter_for_a_resized_vocabulary_names_the_fix(tmp_path, adapter_folders):
    resized = make_target("llama")
    resized.resize_token_embeddings(PAD + 9, mean_resizing=False)
    config = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    get_peft_model(resized, config).save_pretrained(tmp_path / "resized")
    with pytest.raises(ValueError, match="resize_token_embeddings"):
        loading.load_target_and_tokenizer(
            adapter_folders / "target", target_adapter=tmp_path / "resized", tokenizer_required=False
        )
    with pytest.raises(FileNotFoundError, match="Target adapter folder './no-adapter' does not exist"):
        loading.load_target_and_tokenizer(
            adapter_folders / "target", target_adapter="./no-adapter", tokenizer_required=False
        )


# -- LoRA on the drafter ---------------------------------------------------------------------------------------------


def regenerated(target, count: int = 4) -> Dataset:
    """Sequences whose responses `target` wrote itself (greedy), with the loss on the response."""
    records = []
    for seed in range(count):
        sequence = greedy(target, prompt(seed))[0].tolist()
        records.append({"input_ids": sequence, "loss_mask": [0] * 7 + [1] * (len(sequence) - 7)})
    return Dataset.from_list(records)


def training_args(folder, **overrides) -> DFlashTrainingArguments:
    defaults = {"block_size": 4, "num_anchors": 8, "report_to": "none", "use_cpu": True, "save_strategy": "no"}
    defaults |= {"max_steps": 6, "learning_rate": 5e-2, "per_device_train_batch_size": 2, "disable_tqdm": True}
    return DFlashTrainingArguments(output_dir=str(folder), **(defaults | overrides))


@pytest.fixture(scope="module")
def base_drafter(tmp_path_factory):
    """A saved drafter for the base Llama (reduced vocabulary of 64 ids) and the fine-tuned target it will adapt to."""
    folder = tmp_path_factory.mktemp("base-drafter")
    draft = make_draft(make_target("llama"), block_size=4, num_hidden_layers=2, draft_vocab_size=64)
    draft.save_pretrained(folder)
    return folder


def adapt(base_drafter, folder, target, **overrides):
    """Train a rank-4 LoRA on the saved base drafter for `target`; returns the trainer after saving."""
    base = DFlashForDrafting.from_pretrained(base_drafter).train()
    trainer = DFlashTrainer(
        model=base,
        target=target,
        args=training_args(folder, **overrides),
        train_dataset=regenerated(target),
        peft_config=LoraConfig(r=4, lora_alpha=8),
        training_info={"base_model": "org/tiny-llama", "target_adapter": "org/tiny-llama-lora"},
    )
    trainer.train()
    trainer.save_model()
    trainer.create_model_card()
    return trainer


def test_a_drafter_adapter_trains_its_lora_only_and_keeps_the_vocabulary_map(base_drafter, tmp_path):
    target = lora_target("llama")
    base = DFlashForDrafting.from_pretrained(base_drafter)
    trainer = adapt(base_drafter, tmp_path, target)
    model = trainer.model
    # By hand: r * (in + out) per projection; q/k/v/o and gate/up/down of each of the 2 layers, hidden 64, MLP 128.
    config = base.config
    head_dim, q_out = config.head_dim, config.num_attention_heads * config.head_dim
    kv_out, mlp = config.num_key_value_heads * head_dim, config.intermediate_size
    per_layer = (64 + q_out) + 2 * (64 + kv_out) + (q_out + 64) + 2 * (64 + mlp) + (mlp + 64)
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == 4 * per_layer * config.num_hidden_layers
    assert total - trainable == sum(p.numel() for p in base.parameters())
    merged = model.merge_and_unload()
    assert torch.equal(merged.d2t, base.d2t)  # the base's reduced-vocabulary map, untouched
    for name, weight in base.state_dict().items():  # norms, fc and the map stay the base's; projections moved
        moved = not torch.equal(merged.state_dict()[name], weight)
        assert moved == name.endswith(tuple(f"{module}.weight" for module in DRAFT_LORA_MODULES)), name


def test_the_saved_adapter_drafts_losslessly_and_merges_into_a_servable_drafter(base_drafter, tmp_path):
    from hf_dflash.adapters import load_draft_adapter

    target = lora_target("llama")
    adapt(base_drafter, tmp_path / "adapter", target, save_zlab_layout=True)
    files = {path.name for path in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "dflash_adapter.json", "README.md"} <= files
    assert "model.safetensors" not in files  # the adapter only, never the base drafter's weights
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert f"drafter `{base_drafter}`" in card and "`org/tiny-llama-lora`" in card and "rank 4, alpha 8" in card

    ids = prompt(5)
    reference = greedy(target, ids)
    adapted = PeftModel.from_pretrained(DFlashForDrafting.from_pretrained(base_drafter), tmp_path / "adapter").eval()
    out = speculative_generate(target, adapted, ids, torch.ones_like(ids), max_new_tokens=MAX_NEW)
    merged = load_draft_adapter(DFlashForDrafting.from_pretrained(base_drafter), tmp_path / "adapter", merge=True)
    out_merged = speculative_generate(target, merged, ids, torch.ones_like(ids), max_new_tokens=MAX_NEW)
    assert torch.equal(out.sequences, reference) and torch.equal(out_merged.sequences, reference)
    assert out.stats.histogram == out_merged.stats.histogram  # the same proposals, merged or not
    assert torch.equal(greedy(target, ids, assistant_model=merged), reference)

    served = DFlashForDrafting.from_pretrained(tmp_path / "adapter" / "zlab")  # the trainer's merged z-lab copy
    for name, weight in merged.state_dict().items():
        torch.testing.assert_close(served.state_dict()[name], weight)
    via_loader = loading.load_draft(tmp_path / "adapter", target, base_draft=base_drafter)
    assert isinstance(via_loader, DFlashForDrafting) and via_loader.config.draft_vocab_size == 64
    assert torch.equal(via_loader.d2t, merged.d2t)


def test_a_drafters_fingerprint_names_its_weights_not_its_dtype_or_folder(base_drafter, tmp_path):
    """What adapters and the benchmarks' `--reuse` key on: one checkpoint gives one fingerprint in float32 and in
    bfloat16 and from any folder, and a change to any weight gives another."""
    import shutil

    from hf_dflash.adapters import draft_fingerprint

    fingerprint = draft_fingerprint(DFlashForDrafting.from_pretrained(base_drafter))
    shutil.copytree(base_drafter, tmp_path / "copy")
    assert draft_fingerprint(DFlashForDrafting.from_pretrained(tmp_path / "copy", dtype=torch.bfloat16)) == fingerprint
    changed = DFlashForDrafting.from_pretrained(base_drafter)
    with torch.no_grad():
        changed.layers[-1].mlp.down_proj.weight[0, 0] += 0.5
    assert draft_fingerprint(changed) != fingerprint


def test_adapter_mistakes_name_the_fix(base_drafter, tmp_path):
    from hf_dflash.adapters import add_draft_adapter, load_draft_adapter

    target = lora_target("llama")
    adapt(base_drafter, tmp_path / "adapter", target, max_steps=1)
    other = make_draft(make_target("llama"), block_size=4, num_hidden_layers=2, draft_vocab_size=64, seed=7)
    with pytest.raises(ValueError, match="was trained on the drafter .* has other weights"):
        load_draft_adapter(other, tmp_path / "adapter")
    wrapped = add_draft_adapter(DFlashForDrafting.from_pretrained(base_drafter), LoraConfig(r=2))
    with pytest.raises(ValueError, match="already a PeftModel"):
        DFlashTrainer(model=wrapped, target=target, args=training_args(tmp_path), peft_config=LoraConfig(r=2))
    with pytest.raises(ValueError, match="leave task_type unset"):
        add_draft_adapter(DFlashForDrafting.from_pretrained(base_drafter), LoraConfig(r=2, task_type="CAUSAL_LM"))
    from hf_dflash.training.script import TrainScriptArguments

    with pytest.raises(ValueError, match="pass it as --init_draft"):
        TrainScriptArguments(data="d.jsonl", use_peft=True)
    with pytest.raises(ValueError, match="drop --draft_vocab_size"):
        TrainScriptArguments(data="d.jsonl", use_peft=True, init_draft="base", draft_vocab_size=64)


def test_train_command_adapts_a_drafter_to_an_adapted_target(base_drafter, adapter_folders, tmp_path, capsys):
    import json

    from hf_dflash.cli import main

    target = lora_target("llama")
    data = tmp_path / "data.jsonl"
    records = [{"id": f"t/{i}"} | record for i, record in enumerate(regenerated(target, count=6))]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    argv = ["train", "--target", str(adapter_folders / "target"), "--target_adapter", str(adapter_folders / "adapter")]
    argv += [
        "--data",
        str(data),
        "--init_draft",
        str(base_drafter),
        "--use_peft",
        "--lora_r",
        "4",
        "--block_size",
        "4",
    ]
    argv += ["--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--acceptance_holdout", "2", "--device", "cpu"]
    argv += ["--mask_token_id", str(PAD), "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    assert main(argv) == 0
    info = json.loads((tmp_path / "out" / "training_info.json").read_text())
    assert info["target_adapter"] == str(adapter_folders / "adapter") and info["base_drafter"] == str(base_drafter)
    assert info["training"]["draft_init"] == f"adapter on {base_drafter}"  # not the unused default 'random'
    assert info["training"]["trainable_parameters"] < info["training"]["drafter_parameters"]
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 4
    assert "trained 2 steps" in capsys.readouterr().out


def _peft_acceptance_script():
    from pathlib import Path

    from helpers import load_module

    return load_module(Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "peft_acceptance.py")


def test_share_of_loss_recovered_is_the_tau_ratio_with_a_paired_bootstrap_interval():
    script = _peft_acceptance_script()
    runs = lambda committed, rounds: {"committed": committed, "rounds": rounds}  # noqa: E731
    # tau 2.0 on the base target, 1.5 after the fine-tune, 1.75 adapted: half of the 0.5 lost comes back.
    steady = script.share_of_loss_recovered(runs([4, 4], [2, 2]), runs([3, 3], [2, 2]), runs([7, 7], [4, 4]))
    assert steady == {"share": 0.5, "interval_90": [0.5, 0.5], "resamples": 2000}
    # The adapted drafter wins all the loss back on prompt 0 and nothing on prompt 1: 50% overall, and an
    # interval from 0 (prompt 1 drawn twice) to 1 (prompt 0 drawn twice), each a quarter of the resamples.
    mixed = script.share_of_loss_recovered(
        runs([40, 40], [20, 20]), runs([30, 30], [20, 20]), runs([40, 30], [20, 20])
    )
    assert mixed["share"] == 0.5 and mixed["interval_90"] == [0.0, 1.0]
    # A set the fine-tune costs nothing has no share to report.
    assert script.share_of_loss_recovered(runs([3], [2]), runs([3], [2]), runs([4], [2])) is None


def test_fine_tune_cost_is_the_base_drafters_tau_lost_with_a_paired_bootstrap_interval():
    """`fine_tune_cost`: whether the prompts resolve a loss at all, before any share of it is judged."""
    script = _peft_acceptance_script()
    runs = lambda committed, rounds: {"committed": committed, "rounds": rounds}  # noqa: E731
    # tau 2.0 on the base target and 1.5 after the fine-tune on both prompts: a 0.5 loss every resample keeps.
    assert script.fine_tune_cost(runs([4, 4], [2, 2]), runs([3, 3], [2, 2])) == {
        "cost": 0.5,
        "interval_90": [0.5, 0.5],
    }
    # Prompt 0 loses 0.5, prompt 1 gains 0.5: no loss overall, and an interval from -0.5 to 0.5 that holds zero.
    assert script.fine_tune_cost(runs([4, 2], [2, 2]), runs([3, 3], [2, 2])) == {
        "cost": 0.0,
        "interval_90": [-0.5, 0.5],
    }
    results = [
        {"target": "base", "drafter": "base", "acceptance": {"gsm8k": runs([4, 4], [2, 2])}},
        {"target": "tuned", "drafter": "base", "acceptance": {"gsm8k": runs([3, 3], [2, 2])}},
    ]
    assert script.fine_tune_costs(results) == {"gsm8k": {"cost": 0.5, "interval_90": [0.5, 0.5]}}
    assert script.fine_tune_costs(results[:1]) is None


def test_peft_acceptance_reuses_only_pairs_measured_under_the_same_conditions_and_weights(tmp_path):
    import json

    script = _peft_acceptance_script()
    conditions = {"target": "t", "target_adapter": "a", "prompts": {"gsm8k": 2}, "max_new_tokens": 8, "verify": "v"}
    measured = {
        "target": "base",
        "drafter": "base",
        "path": "drafters/d",
        "draft_fingerprint": "f" * 64,
        "tau": {},
        "acceptance": {},
    }
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"conditions": conditions | {"machine": "other"}, "results": [measured]}))

    # Keyed by the weights measured, not by where they lay: a pair whose drafter now loads with other weights (the
    # same path, another commit) looks itself up under another key and runs again.
    key = ("base", "base", "f" * 64)
    assert script.reusable_results([str(report)], conditions) == {key: measured | {"reused_from": str(report)}}
    with pytest.raises(SystemExit, match="other prompts, max_new_tokens; rerun"):
        script.reusable_results([str(report)], conditions | {"prompts": {"gsm8k": 3}, "max_new_tokens": 9})

    # Another fine-tune: the base target's pairs still hold, the fine-tuned target's do not.
    tuned = measured | {"target": "tuned", "drafter": "lora"}
    report.write_text(json.dumps({"conditions": conditions, "results": [measured, tuned]}))
    assert script.reusable_results([str(report)], conditions | {"target_adapter": "b"}) == {
        key: measured | {"reused_from": str(report)}
    }
    assert len(script.reusable_results([str(report)], conditions)) == 2

    # A result that recorded no fingerprint (an older report's file hash, or nothing) is never reused.
    unrecorded = {name: value for name, value in measured.items() if name != "draft_fingerprint"}
    report.write_text(json.dumps({"conditions": conditions, "results": [unrecorded | {"weights_sha256": "f" * 64}]}))
    assert script.reusable_results([str(report)], conditions) == {}


def test_peft_acceptance_writes_a_pairs_acceptance_for_its_card():
    """`--card_acceptance`: the adapted pair's tau per set, with the base drafter's tau and the share of the loss won
    back in its conditions, in the mapping `hf-dflash card --acceptance_json` reads."""
    script = _peft_acceptance_script()
    conditions = {"target": "t", "target_adapter": "a", "prompts": {"humaneval": 2}, "max_new_tokens": 8}
    runs = lambda committed, rounds: {"humaneval": {"committed": committed, "rounds": rounds}}  # noqa: E731
    results = [
        {"target": "base", "drafter": "base", "tau": {"humaneval": 2.0}, "acceptance": runs([40, 40], [20, 20])},
        {"target": "tuned", "drafter": "base", "tau": {"humaneval": 1.5}, "acceptance": runs([30, 30], [20, 20])},
        {"target": "tuned", "drafter": "lora", "tau": {"humaneval": 1.75}, "acceptance": runs([40, 30], [20, 20])},
    ]
    script.add_shares(results)
    entry = script.card_acceptance(results, "lora", conditions, "report.json")["acceptance"]["humaneval"]
    assert entry["tau"] == 1.75 and entry["speedup"] is None
    assert entry["conditions"] == (
        "first 2 prompts, whole block, greedy, 8 new tokens, on t fine-tuned by a; the base drafter alone: tau 1.5, "
        "50% of its loss won back (90% interval 0%-100%) (report.json)"
    )


def test_acceptance_by_dataset_reports_the_share_of_generated_tokens_inside_the_draft_vocabulary(monkeypatch):
    """A reduced-vocabulary drafter's `in_draft_vocabulary` is the share of the target's greedy tokens its vocabulary
    holds (each one outside ends an accepted run); a full-vocabulary drafter has none."""
    from helpers import greedy_reference

    script = _peft_acceptance_script()
    monkeypatch.setattr(script, "encode_prompt", lambda tokenizer, prompt: prompt)  # prompts given as ids
    target = make_target("llama")
    prompts = [torch.randint(PAD, (9,), generator=torch.Generator().manual_seed(seed)).tolist() for seed in (1, 2)]
    generated = [greedy_reference(target, torch.tensor(p), 12)[len(p) :].tolist() for p in prompts]
    emitted = sorted({token for tokens in generated for token in tokens})
    vocabulary = emitted[: len(emitted) // 2] + [token for token in range(40) if token not in emitted][:8]
    draft = make_draft(target, draft_vocab_size=len(vocabulary))
    draft.set_draft_vocabulary(torch.tensor(vocabulary))

    result = script.acceptance_by_dataset(target, None, draft, {"set": prompts}, max_new_tokens=12)["set"]

    inside = sum(token in vocabulary for tokens in generated for token in tokens)
    total = sum(map(len, generated))
    assert 0 < inside < total and result["in_draft_vocabulary"] == round(inside / total, 4)
    full = script.acceptance_by_dataset(target, None, make_draft(target), {"set": prompts}, max_new_tokens=12)
    assert "in_draft_vocabulary" not in full["set"]
