"""DFlashTrainer and its collator: training must be the inference forward, with the known training bugs pinned."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import PAD, make_draft, make_target
from huggingface_hub import ModelCard, RepoUrl
from transformers.utils import logging as hf_logging

from hf_dflash import DFlashForDrafting, speculative_generate
from hf_dflash.model_card import card_info_from_folder, render_model_card
from hf_dflash.training.arguments import DFlashTrainingArguments
from hf_dflash.training.collator import (
    IGNORE_INDEX,
    DataCollatorForDFlash,
    anchor_candidates,
    default_loss_decay_gamma,
    dense_block_mask,
    flex_mask_mod,
    simulated_acceptance_length,
)
from hf_dflash.training.loss import block_loss, draft_training_forward
from hf_dflash.training.target_features import target_forward
from hf_dflash.training.trainer import DFlashTrainer

B = 4
MASK = PAD


def _collator(**kwargs) -> DataCollatorForDFlash:
    defaults = {"block_size": B, "num_anchors": 2, "mask_token_id": MASK, "pad_token_id": 0}
    return DataCollatorForDFlash(**(defaults | kwargs))


def _args(tmp_path, **kwargs) -> DFlashTrainingArguments:
    defaults = {
        "output_dir": str(tmp_path / "out"),
        "block_size": 8,
        "num_anchors": 40,
        "per_device_train_batch_size": 4,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "warmup_steps": 0.0,
    }
    return DFlashTrainingArguments(**(defaults | kwargs))


def _regenerated(target, num_sequences=4, prompt_len=6, new_tokens=40, seed=0):
    """Sequences whose responses the target wrote itself (greedy), with a loss mask over the response."""
    generator = torch.Generator().manual_seed(seed)
    records, prompts = [], []
    for _ in range(num_sequences):
        prompt = torch.randint(0, PAD - 1, (1, prompt_len), generator=generator)
        with torch.no_grad():
            sequence = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[0]
        records.append({"input_ids": sequence.tolist(), "loss_mask": [0] * prompt_len + [1] * new_tokens})
        prompts.append(prompt)
    return records, prompts


# -- the collator on hand-made sequences -----------------------------------------------------------------------------


def test_labels_are_same_position_tokens_of_the_response_only():
    ids = [10, 11, 12, 13, 14, 15, 16, 17]
    loss_mask = [0, 0, 1, 1, 1, 1, 1, 0]  # prompt 10 11, response 12..16, an unsupervised 17
    batch = _collator().collate_with_anchors(
        [{"input_ids": ids, "loss_mask": loss_mask}], torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    )
    assert batch["noise_ids"].tolist() == [[12, MASK, MASK, MASK, 15, MASK, MASK, MASK]]
    # slot k of the block anchored at a predicts x_{a+k} (no shift); slot 0 and tokens outside the response: no loss
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 13, 14, 15, IGNORE_INDEX, 16, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["position_ids"].tolist() == [list(range(8)) + [2, 3, 4, 5, 5, 6, 7, 8]]
    weights = batch["loss_weights"][0]
    assert weights[0] == 0 and weights[1] == 1.0
    assert weights[2] == pytest.approx(math.exp(-1 / default_loss_decay_gamma(B)))
    assert weights[6] == 0 and weights[7] == 0  # label 17 unsupervised, position 8 past the end


def test_context_is_strictly_before_the_anchor_and_blocks_do_not_leak():
    ids = list(range(20, 30))
    batch = _collator().collate_with_anchors(
        [{"input_ids": ids, "loss_mask": [1] * 10}], torch.tensor([[3, 5]]), torch.tensor([[True, True]])
    )
    mask = batch["draft_attention_mask"][0, 0]  # [N*B, T + N*B]
    context, blocks = mask[:, :10], mask[:, 10:]
    for slot in range(B):
        assert context[slot].tolist() == [t < 3 for t in range(10)]  # `<`, not `<=`: the anchor has no feature
        assert context[B + slot].tolist() == [t < 5 for t in range(10)]
    # overlapping blocks (positions 3..6 and 5..8) still see only themselves
    assert blocks[:B, :B].all() and not blocks[:B, B:].any()
    assert blocks[B:, B:].all() and not blocks[B:, :B].any()


def test_padded_blocks_and_padded_tokens_are_invisible():
    features = [
        {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [1] * 6},
        {"input_ids": [7, 8, 9], "loss_mask": [1] * 3},
    ]
    batch = _collator().collate_with_anchors(
        features, torch.tensor([[4, 5], [2, 0]]), torch.tensor([[True, True], [True, False]])
    )
    mask = batch["draft_attention_mask"][:, 0]
    assert not mask[1, B:].any()  # the second row's padded block sees nothing
    assert (batch["loss_weights"][1, B:] == 0).all() and (batch["labels"][1, B:] == IGNORE_INDEX).all()
    assert mask[1, :B, :6].tolist() == [[True, True, False, False, False, False]] * B  # no padded context keys
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]


def test_anchors_are_supervised_sorted_and_redrawn_each_epoch():
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0])
    assert anchor_candidates(loss_mask).tolist() == [2, 3, 6, 7, 8, 9, 10, 11, 12, 13]
    feature = {"input_ids": list(range(16)), "loss_mask": loss_mask.tolist()}
    collator = _collator(num_anchors=4, seed=3)
    first = collator([feature])["anchor_positions"][0]
    assert collator([feature])["anchor_positions"][0].tolist() == first.tolist()  # deterministic within an epoch
    assert first.tolist() == sorted(first.tolist()) and set(first.tolist()) <= set(
        anchor_candidates(loss_mask).tolist()
    )
    draws = set()
    for epoch in range(6):
        collator.set_epoch(epoch)
        draws.add(tuple(collator([feature])["anchor_positions"][0].tolist()))
    assert len(draws) > 1


def test_reduced_draft_vocabulary_labels_are_draft_indices():
    ids, loss_mask = [10, 11, 12, 13, 14, 15], [1] * 6
    collator = _collator(num_anchors=1, draft_vocabulary=torch.tensor([3, 11, 13, 14]))
    batch = collator.collate_with_anchors(
        [{"input_ids": ids, "loss_mask": loss_mask}], torch.tensor([[1]]), torch.tensor([[True]])
    )
    # block at 1 predicts 12, 13, 14: 12 is outside the draft vocabulary (no loss), 13 -> index 2, 14 -> index 3
    assert batch["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 2, 3]]
    assert batch["loss_weights"][0, 1] == 0 and batch["loss_weights"][0, 2] > 0


def test_fewer_candidates_than_anchors_gives_padded_blocks():
    batch = _collator(num_anchors=5)([{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}])
    assert batch["anchor_valid"].tolist() == [[True, True, False, False, False]]


def test_flex_block_mask_selects_the_same_keys_as_the_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    features = [
        {"input_ids": list(range(1, 13)), "loss_mask": [0, 0] + [1] * 10},
        {"input_ids": [5] * 7, "loss_mask": [1] * 7},
    ]
    batch = _collator(num_anchors=3, seed=1)(features)
    for window in (None, 5):
        args = (batch["anchor_positions"], batch["anchor_valid"], batch["attention_mask"], B, window)
        mask_mod, (batch_size, q_len, kv_len) = flex_mask_mod(*args)
        flex = create_mask(mask_mod, batch_size, None, q_len, kv_len, device="cpu")
        assert torch.equal(flex, dense_block_mask(*args))
        assert flex.any() and not flex.all()


def test_sliding_window_hides_context_older_than_the_window():
    batch = _collator(sliding_window=3).collate_with_anchors(
        [{"input_ids": list(range(20, 30)), "loss_mask": [1] * 10}], torch.tensor([[6, 7]]), torch.tensor([[True] * 2])
    )
    windowed = batch["draft_sliding_attention_mask"][0, 0, :B, :10]
    for slot in range(B):  # the slot at position 6 + slot sees context t with t < 6 and 6 + slot - t < 3
        assert windowed[slot].tolist() == [t < 6 and 6 + slot - t < 3 for t in range(10)]


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_acceptance_length([]) == 1.0


# -- training == inference -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, sliding", [("llama", False), ("qwen3", False), ("gpt2", False), ("gemma3", False), ("llama", True)]
)
def test_training_forward_is_the_inference_forward(family, sliding):
    """Every block the real loop drafted, recomputed by the training forward (all blocks in one pass)."""
    target = make_target(family)
    layers = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6} if sliding else {}
    draft = make_draft(target, block_size=B, num_hidden_layers=2, **layers)
    drafted = []
    hook = draft.register_forward_hook(
        lambda module, args, kwargs, out: drafted.append((int(kwargs["position_ids"][0, -B]), out.last_hidden_state)),
        with_kwargs=True,
    )
    prompt = torch.randint(0, PAD - 1, (1, 9), generator=torch.Generator().manual_seed(0))
    sequence = speculative_generate(target, draft, prompt, max_new_tokens=24).sequences[0]
    hook.remove()
    anchors = torch.tensor([[anchor for anchor, _ in drafted]])
    collator = _collator(num_anchors=anchors.shape[1], sliding_window=6 if sliding else None)
    record = {"input_ids": sequence.tolist(), "loss_mask": [0] * 9 + [1] * (len(sequence) - 9)}
    batch = collator.collate_with_anchors([record], anchors, torch.ones_like(anchors, dtype=torch.bool))
    mask = batch["draft_attention_mask"]
    if sliding:
        mask = {"full_attention": mask, "sliding_attention": batch["draft_sliding_attention_mask"]}
    with torch.no_grad():
        features, _ = target_forward(target, batch, draft.config.target_layer_ids, want_logits=False)
        hidden = draft_training_forward(draft, target.get_input_embeddings(), features, batch, mask)
    lm_head = target.get_output_embeddings()
    for j, (_, inference_hidden) in enumerate(drafted):
        training_hidden = hidden[:, j * B : (j + 1) * B]
        # Same computation, different GEMM shapes (one pass over all blocks vs cached rounds): fp32 rounding only.
        torch.testing.assert_close(training_hidden, inference_hidden, rtol=0, atol=1e-5)
        assert torch.equal(lm_head(training_hidden).argmax(-1), lm_head(inference_hidden).argmax(-1))


def test_a_shifted_label_or_leaky_anchor_would_be_caught():
    """Negative controls: the checks above fail for the two classic bugs."""
    ids, loss_mask = list(range(20, 30)), [1] * 10
    batch = _collator().collate_with_anchors(
        [{"input_ids": ids, "loss_mask": loss_mask}], torch.tensor([[3, 5]]), torch.tensor([[True, True]])
    )
    shifted = batch["labels"][0, 1:B].tolist()
    assert shifted == ids[4:7] and shifted != ids[5:8]  # a next-token shift would give ids[5:8]
    leaky = batch["draft_attention_mask"][0, 0, 0, :10].clone()
    leaky[3] = True  # `<=` at the anchor
    assert leaky.tolist() != [t < 3 for t in range(10)]


# -- loss ------------------------------------------------------------------------------------------------------------


def test_chunked_loss_matches_unchunked_values_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 3 * B, 16, requires_grad=True)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (2, 3 * B))
    weights = torch.rand(2, 3 * B) * (torch.rand(2, 3 * B) > 0.3)
    weights[:, ::B] = 0
    chunked = block_loss(hidden, lm_head, labels, weights, B, chunk_size=5)
    (grad_chunked,) = torch.autograd.grad(chunked.weighted_sum, hidden)
    logits = lm_head(hidden)
    reference = (torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * weights).sum()
    (grad_reference,) = torch.autograd.grad(reference, hidden)
    torch.testing.assert_close(chunked.weighted_sum, reference)
    torch.testing.assert_close(grad_chunked, grad_reference)
    assert chunked.supervised.sum() == (weights > 0).sum() and chunked.supervised[0] == 0


def test_batch_without_anchors_gives_zero_loss_touching_every_parameter(tmp_path):
    target = make_target("llama")
    draft = make_draft(target, block_size=8, num_hidden_layers=1).train()
    trainer = DFlashTrainer(model=draft, target=target, args=_args(tmp_path, num_anchors=2))
    batch = trainer.data_collator([{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}])  # no anchor candidate
    assert not batch["anchor_valid"].any()
    loss = trainer.compute_loss(draft, batch)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is not None for p in draft.parameters() if p.requires_grad)


def test_loss_is_normalised_over_the_optimizer_step(tmp_path):
    """Two micro-batches of one sequence step exactly like one batch of two (loss weights, not means, add up)."""
    target = make_target("llama")
    records, _ = _regenerated(target, num_sequences=2)
    records[1] = {key: value[:30] for key, value in records[1].items()}  # different number of supervised slots
    dataset = Dataset.from_list(records)
    trained = []
    for batch_size, accumulation in [(2, 1), (1, 2)]:
        draft = make_draft(target, block_size=8, num_hidden_layers=1).train()
        args = _args(
            tmp_path,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            optim="sgd",
            learning_rate=1.0,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
        )
        trainer = DFlashTrainer(model=draft, target=target, args=args, train_dataset=dataset)
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(dataset)
        trainer.train()
        trained.append(draft.fc.weight.detach().clone())
    initial = make_draft(target, block_size=8, num_hidden_layers=1).fc.weight
    assert not torch.equal(trained[0], initial)
    torch.testing.assert_close(trained[0], trained[1], rtol=1e-4, atol=1e-6)


# -- end to end --------------------------------------------------------------------------------------------------------


def test_overfitting_a_few_sequences_raises_the_real_acceptance_length(tmp_path):
    target = make_target("llama")
    records, prompts = _regenerated(target)
    draft = make_draft(target, block_size=8, num_hidden_layers=2).train()
    args = _args(tmp_path, max_steps=200, learning_rate=1e-2, logging_steps=100)
    trainer = DFlashTrainer(
        model=draft, target=target, args=args, train_dataset=Dataset.from_list(records), acceptance_prompts=prompts
    )
    before = trainer.measure_real_acceptance(max_new_tokens=40)["real_tau"]
    trainer.train()
    after = trainer.measure_real_acceptance(max_new_tokens=40)["real_tau"]
    assert before < 2 and after > 4, (before, after)
    logged = [entry for entry in trainer.state.log_history if "sim_tau" in entry]
    assert logged and logged[-1]["sim_tau"] > logged[0]["sim_tau"]


def test_checkpoints_hold_the_draft_only_and_reload_identically(tmp_path):
    target = make_target("qwen3")
    records, prompts = _regenerated(target, num_sequences=2, new_tokens=16)
    draft = make_draft(target, block_size=8, num_hidden_layers=1, draft_vocab_size=48).train()
    draft.set_draft_vocabulary(torch.arange(48, 96))
    args = _args(
        tmp_path, max_steps=3, save_strategy="steps", save_steps=3, save_zlab_layout=True, real_acceptance_steps=3
    )
    given_info = {"base_model": "org/tiny-qwen3", "training": {"data": "regenerated"}}
    trainer = DFlashTrainer(
        model=draft,
        target=target,
        args=args,
        train_dataset=Dataset.from_list(records),
        acceptance_prompts=prompts,
        training_info=given_info,
    )
    trainer.train()
    assert given_info == {
        "base_model": "org/tiny-qwen3",
        "training": {"data": "regenerated"},
    }  # the caller's, unchanged
    assert any("real_tau" in entry for entry in trainer.state.log_history)
    checkpoint = tmp_path / "out" / "checkpoint-3"
    from safetensors.torch import load_file

    saved = load_file(checkpoint / "model.safetensors")
    assert set(saved) == set(draft.state_dict())  # no embedding, no LM head, no target
    assert not any("embed" in name or "lm_head" in name for name in saved)
    for folder in (checkpoint, checkpoint / "zlab"):
        reloaded = DFlashForDrafting.from_pretrained(folder)
        assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in draft.state_dict().items())
    zlab_head = load_file(checkpoint / "zlab" / "model.safetensors")["lm_head.weight"]  # what vLLM drafts with
    assert torch.equal(zlab_head, target.get_output_embeddings().weight.detach()[48:96])
    info = json.loads((checkpoint / "training_info.json").read_text())
    assert info["training"]["block_size"] == 8 and info["training"]["steps"] == 3
    assert info["base_model"] == "org/tiny-qwen3"
    logged_tau = [entry["real_tau"] for entry in trainer.state.log_history if "real_tau" in entry]
    assert info["training"]["held_out_tau_by_step"] == [[3, round(logged_tau[0], 3)]]
    card = render_model_card(card_info_from_folder(checkpoint)).text  # no "unknown key" left behind
    assert f"| Held-out tau during training | step 3: {logged_tau[0]:.2f} |" in card


def test_a_save_is_checked_against_the_state_dict_the_trainer_gathered(tmp_path):
    """Under FSDP the drafter module holds shards and the Trainer passes `_save` the gathered state dict: the check
    reads that dict, and it fails when the folder does not hold it."""
    from hf_dflash.training.trainer import verify_saved_draft

    draft = make_draft(make_target("llama"), block_size=4, num_hidden_layers=1)
    draft.save_pretrained(tmp_path)
    gathered = {name: tensor.clone() for name, tensor in draft.state_dict().items()}
    reloaded = verify_saved_draft(gathered, tmp_path)
    assert reloaded.dtype == draft.dtype and torch.equal(reloaded.fc.weight, draft.fc.weight)
    gathered["fc.weight"] += 1
    with pytest.raises(RuntimeError, match="weight fc.weight changed on save/reload"):
        verify_saved_draft(gathered, tmp_path)


def test_push_to_hub_uploads_the_drafter_with_its_model_card(tmp_path, monkeypatch):
    """No Hub endpoint is reachable from CI: `hf_api()` is replaced by a local stand-in that records the upload."""
    import transformers.trainer

    uploads = []

    class LocalHub:
        def create_repo(self, repo_id, **kwargs):
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploads.append((repo_id, {path.name: path.read_bytes() for path in sorted(Path(folder_path).iterdir())}))

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: LocalHub())
    target = make_target("llama")
    records, _ = _regenerated(target, num_sequences=2, new_tokens=16)
    draft = make_draft(target, block_size=8, num_hidden_layers=1).train()
    args = _args(tmp_path, max_steps=1, hub_model_id="org/tiny-llama-dflash", push_to_hub=False)
    trainer = DFlashTrainer(
        model=draft,
        target=target,
        args=args,
        train_dataset=Dataset.from_list(records),
        training_info={"base_model": "org/tiny-llama", "acceptance": {"held-out": {"tau": 2.5}}},
    )
    trainer.train()
    trainer.push_to_hub(license="mit", tags="pushed-tag")
    (repo_id, files), *_ = uploads
    assert repo_id == "org/tiny-llama-dflash"
    card = files["README.md"].decode()
    assert "base_model: org/tiny-llama" in card and "dflash" in card and "assistant_model=" in card and "2.5" in card
    assert "license: mit" in card and "- pushed-tag" in card and '"org/tiny-llama-dflash"' in card
    assert "model.safetensors" in files and "config.json" in files and "modeling_dflash.py" in files


def test_model_card_carries_the_trainer_card_arguments(tmp_path, caplog):
    target = make_target("llama")
    draft = make_draft(target, block_size=8, num_hidden_layers=1)
    trainer = DFlashTrainer(
        model=draft, target=target, args=_args(tmp_path), training_info={"base_model": "org/tiny-llama"}
    )
    trainer.save_model()
    readme = tmp_path / "out" / "README.md"
    with caplog.at_level(logging.WARNING, logger="hf_dflash.training.trainer"):
        trainer.create_model_card(
            license="mit",
            tags=["my-tag", "tiny"],
            model_name="me/tiny-dflash",
            dataset_tags="org/chats",
            language="en",
        )
    card = ModelCard.load(readme)
    assert card.data.license == "mit" and card.data.datasets == ["org/chats"]
    assert {"my-tag", "tiny", "dflash", "speculative-decoding"} <= set(card.data.tags)
    assert 'from_pretrained("me/tiny-dflash"' in card.text
    assert any("no place for language" in record.getMessage() for record in caplog.records)
    trainer.create_model_card(model_name="tiny-dflash", finetuned_from="org/other-target")
    card = ModelCard.load(readme)
    assert card.data.license == "apache-2.0" and card.data.base_model == "org/other-target"
    assert 'from_pretrained("<your-org>/tiny-dflash"' in card.text and "my-tag" not in card.data.tags


# -- arguments -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"block_size": 1}, "block_size"),
        ({"num_anchors": 0}, "num_anchors"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"distill_weight": 1.5}, "distill_weight"),
        ({"loss_decay_gamma": -1.0}, "loss_decay_gamma"),
        ({"remove_unused_columns": True}, "remove_unused_columns"),
    ],
)
def test_bad_training_arguments_are_named(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **bad)


def test_default_gamma_follows_the_paper():
    assert [default_loss_decay_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert DFlashTrainingArguments(output_dir="x", block_size=16, report_to="none").loss_decay_gamma == 7.0


def test_distillation_loss_trains(tmp_path):
    target = make_target("llama")
    records, _ = _regenerated(target, num_sequences=2, new_tokens=16)
    draft = make_draft(target, block_size=8, num_hidden_layers=1).train()
    trainer = DFlashTrainer(model=draft, target=target, args=_args(tmp_path, distill_weight=0.5, max_steps=1))
    batch = trainer.data_collator(records)
    loss = trainer.compute_loss(draft, batch)
    plain = DFlashTrainer(model=draft, target=target, args=_args(tmp_path, max_steps=1)).compute_loss(draft, batch)
    assert torch.isfinite(loss) and loss.item() != pytest.approx(plain.item())


def _saved_target_and_data(tmp_path: Path):
    """A tiny target saved to `tmp_path/target` and 6 records it wrote, as the JSONL `hf-dflash train` reads."""
    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    records, _ = _regenerated(target, num_sequences=6, new_tokens=16)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r | {"id": f"t/{i}", "prompt_len": 6}) + "\n" for i, r in enumerate(records)))
    return target, records, data


def test_train_command_trains_saves_and_cards_a_drafter(tmp_path, monkeypatch, capsys):
    from hf_dflash.cli import main

    target, records, data = _saved_target_and_data(tmp_path)
    out = tmp_path / "drafter"
    argv = ["train", "--data", str(data), "--target", str(tmp_path / "target"), "--output_dir", str(out)]
    argv += ["--max_steps", "2", "--block_size", "4", "--mask_token_id", str(PAD), "--acceptance_holdout", "2"]
    argv += ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]
    argv += ["--real_acceptance_steps", "2"]
    measured = []
    measure = DFlashTrainer.measure_real_acceptance
    monkeypatch.setattr(
        DFlashTrainer, "measure_real_acceptance", lambda self, *a, **k: measured.append(1) or measure(self, *a, **k)
    )
    verbosity = hf_logging.get_verbosity()
    assert main(argv) == 0
    assert hf_logging.get_verbosity() == verbosity  # the command's INFO verbosity ends with the command
    printed = capsys.readouterr().out
    assert "trained 2 steps on 4 sequences in " in printed and "min; real tau on 2 held-out prompts" in printed
    assert len(measured) == 2  # before training, and once at the last step (reused as the "after" value)
    draft = DFlashForDrafting.from_pretrained(out)
    assert draft.config.block_size == 4 and draft.config.mask_token_id == PAD
    info = json.loads((out / "training_info.json").read_text())
    assert info["training"]["num_sequences"] == 4 and info["training"]["steps"] == 2
    assert info["training"]["chat_template"] is None  # a target folder without a tokenizer: not known, not stated
    assert "held-out" in info["acceptance"]
    assert info["acceptance"]["held-out"]["tau"] == info["training"]["held_out_tau_by_step"][-1][1]
    card = (out / "README.md").read_text()
    assert "speculative-decoding" in card and "--speculative-num-draft-tokens 4" in card


def test_train_neither_prints_nor_sets_the_log_verbosity(tmp_path, capsys):
    from hf_dflash.training.script import parse_train_args, train

    _, _, data = _saved_target_and_data(tmp_path)
    argv = ["--data", str(data), "--target", str(tmp_path / "target"), "--output_dir", str(tmp_path / "drafter")]
    argv += ["--max_steps", "1", "--block_size", "4", "--mask_token_id", str(PAD), "--acceptance_holdout", "2"]
    argv += ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        result = train(*parse_train_args(argv))
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    finally:
        hf_logging.set_verbosity(verbosity)
    assert result.steps == 1 and result.num_sequences == 4 and result.num_held_out == 2
    assert result.tau_before is not None and result.tau_after is not None
    assert "trained 1 steps" not in capsys.readouterr().out  # the command line prints result.summary(), not train
    assert result.summary().startswith("trained 1 steps on 4 sequences")


def test_train_without_a_held_out_split_trains_on_every_record(tmp_path):
    """`--acceptance_holdout 0` (the scaling curve measures on its own prompts): all records train, none held out."""
    from hf_dflash.training.script import parse_train_args, train

    _, _, data = _saved_target_and_data(tmp_path)
    argv = ["--data", str(data), "--target", str(tmp_path / "target"), "--output_dir", str(tmp_path / "drafter")]
    argv += ["--max_steps", "1", "--block_size", "4", "--mask_token_id", str(PAD), "--acceptance_holdout", "0"]
    argv += ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]
    result = train(*parse_train_args(argv))
    assert result.steps == 1 and result.num_sequences == 6 and result.num_held_out == 0
    assert result.tau_before is None and result.tau_after is None


def test_cached_target_features_give_the_online_loss(tmp_path):
    target = make_target("qwen3")
    records, _ = _regenerated(target, num_sequences=3, new_tokens=20)
    records[2] = {key: value[:18] for key, value in records[2].items()}  # ragged: padding in the batch
    dataset = Dataset.from_list(records)
    draft = make_draft(target, block_size=8, num_hidden_layers=1).train()
    cached = DFlashTrainer(
        model=draft, target=target, args=_args(tmp_path, cache_target_features=True), train_dataset=dataset
    )
    online = DFlashTrainer(model=draft, target=target, args=_args(tmp_path), train_dataset=dataset)
    features = [dict(cached.train_dataset[i]) for i in range(3)]
    batch = cached.data_collator(features)
    assert batch["rows"].tolist() == [0, 1, 2]
    torch.testing.assert_close(cached.compute_loss(draft, batch), online.compute_loss(draft, batch), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cache_target_features"):
        _args(tmp_path, cache_target_features=True, distill_weight=0.5)


def test_a_block_size_that_differs_from_the_drafter_is_refused(tmp_path):
    target = make_target("llama")
    draft = make_draft(target, block_size=8, num_hidden_layers=1)
    with pytest.raises(ValueError, match="pass block_size=8"):
        DFlashTrainer(model=draft, target=target, args=_args(tmp_path, block_size=4))


def test_a_drafter_with_causal_sliding_layers_is_refused(tmp_path):
    target = make_target("llama")
    draft = make_draft(
        target,
        block_size=8,
        num_hidden_layers=1,
        layer_types=["sliding_attention"],
        sliding_window=16,
        causal_sliding_attention=True,
    )
    with pytest.raises(NotImplementedError, match="causally inside the block"):
        DFlashTrainer(model=draft, target=target, args=_args(tmp_path, block_size=8))


def test_train_command_continues_a_drafter_and_rechooses_its_vocabulary(tmp_path):
    from hf_dflash.cli import main

    target, records, data = _saved_target_and_data(tmp_path)
    start = make_draft(target, block_size=4, num_hidden_layers=1, draft_vocab_size=16)
    start.set_draft_vocabulary(torch.arange(16))  # rows the data's responses mostly do not use
    start.save_pretrained(tmp_path / "start")
    common = [
        "train",
        "--data",
        str(data),
        "--target",
        str(tmp_path / "target"),
        "--init_draft",
        str(tmp_path / "start"),
    ]
    common += ["--max_steps", "1", "--block_size", "4", "--acceptance_holdout", "2", "--report_to", "none"]
    common += ["--use_cpu", "true"]
    common += ["--save_strategy", "no", "--disable_tqdm", "true"]
    assert main(common + ["--output_dir", str(tmp_path / "out"), "--draft_vocab_size", "16"]) == 0
    draft = DFlashForDrafting.from_pretrained(tmp_path / "out")
    response_tokens = Counter(t for r in records[:4] for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    most_common = {token for token, _ in response_tokens.most_common(8)}
    assert most_common <= set(draft.draft_token_ids.tolist())  # re-chosen from this data, not 0..15
    assert draft.config.num_hidden_layers == 1 and draft.config.block_size == 4  # the start's architecture
    info = json.loads((tmp_path / "out" / "training_info.json").read_text())
    assert info["training"]["draft_init"] == f"continued from {tmp_path / 'start'}"  # not the unused 'random'
    assert main(common + ["--output_dir", str(tmp_path / "wider"), "--draft_vocab_size", "32"]) == 0
    wider = DFlashForDrafting.from_pretrained(tmp_path / "wider")  # another size: the vocabulary resized, not refused
    assert wider.config.draft_vocab_size == 32 and most_common <= set(wider.draft_token_ids.tolist())
    assert wider.d2t.shape == (32,) and wider.draft_token_ids.unique().numel() == 32


def test_resizing_the_draft_vocabulary_keeps_the_layers_and_the_shared_rows_scores():
    target = make_target("llama")
    draft = make_draft(target, block_size=4, num_hidden_layers=1, draft_vocab_size=16).eval()
    draft.set_draft_vocabulary(torch.arange(16))
    hidden = torch.randn(2, 3, draft.config.hidden_size)
    before = draft.draft_logits(hidden, target.get_output_embeddings())  # [2, 3, 16]
    layers = {name: tensor.clone() for name, tensor in draft.state_dict().items() if name != "d2t"}
    draft.resize_draft_vocabulary(torch.arange(8, 40))  # 32 rows, 8 of them (8..15) shared with the old 16
    after = draft.draft_logits(hidden, target.get_output_embeddings())  # [2, 3, 32]
    assert draft.config.draft_vocab_size == 32 and after.shape[-1] == 32
    assert draft.draft_token_ids.tolist() == list(range(8, 40))
    torch.testing.assert_close(after[..., :8], before[..., 8:])  # the rows both vocabularies hold score the same
    assert all(torch.equal(tensor, draft.state_dict()[name]) for name, tensor in layers.items())


def test_resume_true_picks_the_latest_complete_checkpoint(tmp_path):
    from hf_dflash.training.script import _checkpoint_to_resume

    for step, complete in ((2, True), (10, True), (12, False)):  # checkpoint-12: killed while saving
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert _checkpoint_to_resume("true", str(tmp_path)) == str(tmp_path / "checkpoint-10")  # 10 > 2 as numbers
    assert _checkpoint_to_resume(str(tmp_path / "checkpoint-2"), str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert _checkpoint_to_resume(None, str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        _checkpoint_to_resume("True", str(tmp_path / "empty"))


def test_frequent_tokens_outside_a_kept_draft_vocabulary_are_named_with_the_fix(caplog):
    from hf_dflash.training.script import unproposable_tokens, warn_about_unproposable_tokens

    # 40 response tokens: 7 appears 10 times (25%), 9 once (2.5%), the rest are inside the vocabulary
    dataset = Dataset.from_list([{"input_ids": [1, 2] + [7] * 10 + [9] + [3] * 29, "loss_mask": [0, 0] + [1] * 40}])
    target = make_target("llama")
    draft = make_draft(target, block_size=4, num_hidden_layers=1, draft_vocab_size=8)
    draft.set_draft_vocabulary(torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))
    assert unproposable_tokens(dataset, draft.draft_token_ids, min_share=0.05) == {7: 0.25}
    assert unproposable_tokens(dataset, draft.draft_token_ids, min_share=0.02) == {7: 0.25, 9: 0.025}
    with caplog.at_level(logging.WARNING, logger="hf_dflash.training.script"):
        warn_about_unproposable_tokens(dataset, draft, None, is_adapter=True)
    assert "7 (25.0%)" in caplog.text and "--draft_vocab_size 8" in caplog.text and "adapter" in caplog.text
    caplog.clear()
    draft.set_draft_vocabulary(torch.tensor([0, 1, 2, 3, 4, 5, 7, 9]))
    with caplog.at_level(logging.WARNING, logger="hf_dflash.training.script"):
        warn_about_unproposable_tokens(dataset, draft, None, is_adapter=True)
    assert caplog.text == ""
