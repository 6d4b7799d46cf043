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
from hf_dflash.trainer import DFlashTrainer, DFlashTrainingArguments

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
