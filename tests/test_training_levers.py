"""The training levers of `DFlashTrainingArguments`, each checked against a hand computation on tiny inputs:
the acceptance-length objective, distillation, and a drafter initialised from its target."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import make_draft, make_target

from hf_dflash.training.arguments import DFlashTrainingArguments
from hf_dflash.training.draft_init import decoder_layers, initialize_draft_from_target
from hf_dflash.training.loss import block_loss, expected_length_shares
from hf_dflash.training.trainer import DFlashTrainer

B = 4


def _two_token_logits(probs: list[float]) -> torch.Tensor:
    """`[1, len, 2]` logits whose softmax gives token 0 probability `p` at each slot."""
    p = torch.tensor(probs)
    return torch.stack([p.log(), (1 - p).log()], -1)[None]


def _identity_head(states: torch.Tensor) -> torch.Tensor:
    return states


# -- the acceptance-length objective -------------------------------------------------------------------------------


def test_expected_length_shares_by_hand():
    # One block: the anchor, then slots the draft gets right with probability 0.5, 0.4, 0.2.
    # prefixes 0.5, 0.2, 0.04 -> C_1 = 0.74, C_2 = 0.24, C_3 = 0.04
    probs = torch.tensor([0.9, 0.5, 0.4, 0.2])
    rows = torch.tensor([1, 2, 3])
    shares = expected_length_shares(probs[rows], rows, B, B)
    torch.testing.assert_close(shares, torch.tensor([0.74, 0.24, 0.04]))


def test_an_unsupervised_slot_ends_what_a_block_can_accept():
    probs = torch.tensor([0.9, 0.5, 0.4, 0.2, 0.9, 0.8, 0.5, 0.5])  # two blocks
    rows = torch.tensor([1, 3, 5, 6, 7])  # slot 2 of the first block is not supervised
    shares = expected_length_shares(probs[rows], rows, 2 * B, B)
    # block 1: prefixes 0.5, 0, 0 -> C_1 = 0.5, C_3 = 0; block 2: prefixes 0.8, 0.4, 0.2 -> 1.4, 0.6, 0.2
    torch.testing.assert_close(shares, torch.tensor([0.5, 0.0, 1.4, 0.6, 0.2]))


def test_the_acceptance_objective_has_the_gradient_of_the_expected_accepted_length():
    torch.manual_seed(0)
    hidden = torch.randn(2, 3 * B, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False)
    labels = torch.randint(0, 11, (2, 3 * B))
    weights = torch.ones(2, 3 * B)
    weights[:, ::B] = 0  # anchors
    weights[1, -2:] = 0  # the end of the second sequence
    result = block_loss(hidden, head, labels, weights, B, chunk_size=5, acceptance_weight=1.0)
    (grad,) = torch.autograd.grad(result.weighted_sum, hidden)
    # -E by hand: per block, sum over slots of the running product of q(label), zero where unsupervised
    q = head(hidden).softmax(-1).gather(-1, labels[..., None])[..., 0] * (weights > 0)
    q = q.view(-1, B)[:, 1:]
    expected_length = q.cumprod(1).sum()
    (grad_reference,) = torch.autograd.grad(-expected_length, hidden)
    torch.testing.assert_close(grad, grad_reference)


def test_half_acceptance_mixes_the_decay_weights_with_the_shares():
    hidden = _two_token_logits([0.9, 0.5, 0.4, 0.2])
    labels = torch.zeros(1, B, dtype=torch.long)
    weights = torch.tensor([[0.0, 1.0, 0.5, 0.25]])
    result = block_loss(hidden, _identity_head, labels, weights, B, acceptance_weight=0.5)
    mixed = [0.5 * w + 0.5 * c for w, c in zip([1.0, 0.5, 0.25], [0.74, 0.24, 0.04])]
    by_hand = sum(m * -math.log(p) for m, p in zip(mixed, [0.5, 0.4, 0.2]))
    assert result.weighted_sum.item() == pytest.approx(by_hand, rel=1e-5)


# -- distillation ----------------------------------------------------------------------------------------------------


def test_distillation_is_the_kl_to_the_target_distribution_by_hand():
    draft_probs = [[0.5, 0.5], [0.8, 0.2]]
    target_probs = [[0.9, 0.1], [0.3, 0.7]]
    hidden = torch.tensor([[[0.0, 0.0], *[[math.log(a), math.log(b)] for a, b in draft_probs]]])  # anchor + 2 slots
    teacher = torch.tensor([[[0.0, 0.0], *[[math.log(a), math.log(b)] for a, b in target_probs]]])
    labels = torch.tensor([[0, 0, 1]])
    weights = torch.tensor([[0.0, 1.0, 0.5]])
    kl = [sum(p * math.log(p / q) for p, q in zip(ps, qs)) for ps, qs in zip(target_probs, draft_probs)]
    ce = [-math.log(0.5), -math.log(0.2)]
    for d in (1.0, 0.25):
        result = block_loss(hidden, _identity_head, labels, weights, 3, teacher_logits=teacher, distill_weight=d)
        by_hand = sum(w * ((1 - d) * c + d * k) for w, c, k in zip([1.0, 0.5], ce, kl))
        assert result.weighted_sum.item() == pytest.approx(by_hand, rel=1e-5)


# -- initialising the drafter from its target ------------------------------------------------------------------------


def _randomise_norms(target) -> None:
    """Random norm scales, so a copy that skipped them (or read Gemma's `1 + w` as `w`) would show."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)


def test_a_drafter_from_a_llama_target_takes_its_deepest_layers():
    target = make_target("llama")
    _randomise_norms(target)
    draft = make_draft(target, num_hidden_layers=2, target_layer_ids=[0, 1])
    copied = initialize_draft_from_target(draft, target)
    layers = decoder_layers(target)
    for index, source in zip(range(2), layers[1:]):  # 3 target layers: draft layers 0, 1 <- target layers 1, 2
        ours = draft.layers[index]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(ours.self_attn, name).weight, getattr(source.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(ours.mlp, name).weight, getattr(source.mlp, name).weight)
        torch.testing.assert_close(ours.input_layernorm.weight, source.input_layernorm.weight)
        torch.testing.assert_close(ours.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
        assert torch.equal(ours.self_attn.q_norm.weight, torch.ones(16))  # Llama has no q/k norm: left as is
    torch.testing.assert_close(draft.hidden_norm.weight, layers[1].input_layernorm.weight)
    torch.testing.assert_close(draft.norm.weight, target.model.norm.weight)
    # fc selects the deepest tapped layer (id 1, the second of the two features): fc([h0 ; h1]) = h1
    features = torch.randn(1, 5, 2 * 64)
    torch.testing.assert_close(draft.fc(features), features[..., 64:])
    assert "fc.weight" in copied and "layers.1.self_attn.q_norm.weight" not in copied


def test_a_drafter_from_an_unmerged_lora_target_starts_from_the_fine_tune():
    """The wrapped projections give their effective weight (base + delta), as the merged target would."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    tuned = get_peft_model(make_target("llama"), config)
    merged = copy.deepcopy(tuned).merge_and_unload()
    draft = make_draft(merged, num_hidden_layers=2, target_layer_ids=[0, 1])
    copied = initialize_draft_from_target(draft, tuned)
    for index, source in zip(range(2), decoder_layers(merged)[1:]):
        ours = draft.layers[index]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.testing.assert_close(getattr(ours.self_attn, name).weight, getattr(source.self_attn, name).weight)
        torch.testing.assert_close(ours.mlp.down_proj.weight, source.mlp.down_proj.weight)
    base_q = decoder_layers(make_target("llama"))[1].self_attn.q_proj.weight
    assert not torch.allclose(draft.layers[0].self_attn.q_proj.weight, base_q)  # the adapter changed it
    assert {"layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"} <= set(copied)
    tuned.merge_adapter()  # merged in place, still wrapped: the base weight holds the delta, added once
    again = make_draft(merged, num_hidden_layers=2, target_layer_ids=[0, 1])
    initialize_draft_from_target(again, tuned)
    torch.testing.assert_close(again.layers[0].self_attn.q_proj.weight, draft.layers[0].self_attn.q_proj.weight)

    dora = get_peft_model(make_target("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="merge_and_unload"):
        initialize_draft_from_target(make_draft(merged, num_hidden_layers=1), dora)


def test_gemma_norms_land_as_their_effective_scale_and_the_pre_mlp_norm_by_role():
    target = make_target("gemma3")
    _randomise_norms(target)
    draft = make_draft(target, num_hidden_layers=1, target_layer_ids=[0, 1])
    initialize_draft_from_target(draft, target)
    source = decoder_layers(target)[2]
    # Gemma's RMSNorm scales by (1 + w); its pre-MLP norm is pre_feedforward_layernorm
    torch.testing.assert_close(
        draft.layers[0].input_layernorm.weight, 1 + source.input_layernorm.weight, rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        draft.layers[0].post_attention_layernorm.weight, 1 + source.pre_feedforward_layernorm.weight, rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        draft.layers[0].self_attn.q_norm.weight, 1 + source.self_attn.q_norm.weight, rtol=0, atol=1e-5
    )
    torch.testing.assert_close(draft.norm.weight, 1 + target.model.norm.weight, rtol=0, atol=1e-5)


def test_a_target_whose_layers_fit_nothing_is_named():
    target = make_target("gpt_neox")  # fused query_key_value, LayerNorms with a bias
    draft = make_draft(target, num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft_init='random'"):
        initialize_draft_from_target(draft, target)
    with pytest.raises(ValueError, match="one target layer per draft layer"):
        initialize_draft_from_target(make_draft(make_target("llama"), num_hidden_layers=4), make_target("llama"))


def test_the_trainer_initialises_from_the_target_when_asked(tmp_path):
    target = make_target("qwen3")
    draft = make_draft(target, num_hidden_layers=1)
    args = DFlashTrainingArguments(
        output_dir=str(tmp_path), block_size=8, report_to="none", use_cpu=True, draft_init="target"
    )
    DFlashTrainer(model=draft, target=target, args=args)
    source = decoder_layers(target)[-1]
    assert torch.equal(draft.layers[0].self_attn.k_proj.weight, source.self_attn.k_proj.weight)
    torch.testing.assert_close(draft.layers[0].self_attn.k_norm.weight, source.self_attn.k_norm.weight)
    from peft import LoraConfig

    with pytest.raises(ValueError, match="drop one"):
        DFlashTrainer(
            model=make_draft(target, num_hidden_layers=1), target=target, args=args, peft_config=LoraConfig()
        )


def test_top_k_distillation_is_the_kl_to_the_renormalised_top_k_by_hand():
    draft_probs = [0.5, 0.3, 0.2]
    hidden = torch.tensor([[[0.0, 0.0, 0.0], [math.log(p) for p in draft_probs]]])  # anchor + one slot
    teacher = torch.tensor([[[0.0, 0.0], [math.log(0.6), math.log(0.2)]]])  # target's top-2: tokens 2 and 0
    ids = torch.tensor([[[0, 0], [2, 0]]])
    result = block_loss(
        hidden, _identity_head, torch.tensor([[0, 2]]), torch.tensor([[0.0, 1.0]]), 2, teacher_logits=teacher,
        distill_weight=1.0, teacher_ids=ids,
    )  # fmt: skip
    p = {2: 0.75, 0: 0.25}  # 0.6 and 0.2 renormalised
    by_hand = sum(share * math.log(share / draft_probs[token]) for token, share in p.items())
    assert result.weighted_sum.item() == pytest.approx(by_hand, rel=1e-5)


def _distill_args(tmp_path, **kwargs) -> DFlashTrainingArguments:
    defaults = {"output_dir": str(tmp_path / "out"), "block_size": 8, "num_anchors": 40, "report_to": "none"}
    defaults |= {"use_cpu": True, "distill_weight": 0.5, "distill_top_k": 5}
    return DFlashTrainingArguments(**(defaults | kwargs))


def _records(target, count: int = 3):
    torch.manual_seed(0)
    prompts = torch.randint(0, 90, (count, 6))
    out = target.generate(prompts, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    return [{"input_ids": row.tolist(), "loss_mask": [0] * 6 + [1] * 20} for row in out]


def _reduced_vocabulary_setup():
    """A llama target, three records of its own greedy text, and a training drafter with a 64-token vocabulary."""
    from datasets import Dataset

    target = make_target("llama")
    dataset = Dataset.from_list(_records(target))
    draft = make_draft(target, block_size=8, num_hidden_layers=1, draft_vocab_size=64)
    draft.set_draft_vocabulary(torch.arange(10, 74))
    return target, dataset, draft.train()


def test_cached_top_k_distillation_gives_the_online_top_k_loss(tmp_path):
    target, dataset, draft = _reduced_vocabulary_setup()
    cached = DFlashTrainer(
        model=draft, target=target, args=_distill_args(tmp_path, cache_target_features=True), train_dataset=dataset
    )
    online = DFlashTrainer(model=draft, target=target, args=_distill_args(tmp_path), train_dataset=dataset)
    full = DFlashTrainer(model=draft, target=target, args=_distill_args(tmp_path, distill_top_k=0))
    batch = cached.data_collator([dict(cached.train_dataset[i]) for i in range(3)])
    loss = cached.compute_loss(draft, batch)
    torch.testing.assert_close(loss, online.compute_loss(draft, batch), atol=1e-5, rtol=0)
    assert loss.item() != pytest.approx(full.compute_loss(draft, batch).item(), rel=1e-4)  # top-5 is not all 64
    assert cached.target_cache.top_ids[0].shape == (26, 5) and int(cached.target_cache.top_ids[0].max()) < 64


def test_the_target_cache_on_disk_is_reused_per_sequence_for_the_same_target(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_dflash.training import target_features

    target = make_target("qwen3")
    dataset = Dataset.from_list(_records(target))
    draft = make_draft(target, block_size=8, num_hidden_layers=1)
    args = _distill_args(tmp_path, cache_target_features=True, target_features_dir=str(tmp_path / "features"))
    first = target_features.build_target_cache(
        target, dataset.select([0, 1]), draft, 2048, 5, args.target_features_dir
    )
    (store,) = (tmp_path / "features").iterdir()
    assert sorted(path.suffix for path in store.iterdir()) == [".safetensors"] * 2  # one file per sequence

    forwards, real_forward = [], target_features.target_forward

    def counted_forward(target, batch, *args, **kwargs):
        forwards.append(batch)
        return real_forward(target, batch, *args, **kwargs)

    monkeypatch.setattr(target_features, "target_forward", counted_forward)
    # the next stage's data holds the previous stage's: the target runs on the new sequence only
    again = DFlashTrainer(model=draft, target=target, args=args, train_dataset=dataset).target_cache
    assert [batch["input_ids"][0].tolist() for batch in forwards] == [dataset[2]["input_ids"]]
    for name in ("features", "top_logits", "top_ids"):
        for ours, theirs in zip(getattr(again, name), getattr(first, name)):
            assert torch.equal(ours, theirs)
    online = target_features.build_target_cache(target, dataset, draft, 2048, 5)  # nothing read: computes all three
    for name in ("features", "top_logits", "top_ids"):
        for ours, theirs in zip(getattr(again, name), getattr(online, name)):
            assert torch.equal(ours, theirs)
    forwards.clear()
    target_features.build_target_cache(make_target("qwen3", seed=1), dataset, draft, 2048, 5, args.target_features_dir)
    target_features.build_target_cache(target, dataset, draft, 2048, 0, args.target_features_dir)
    assert len(forwards) == 6 and len(list((tmp_path / "features").iterdir())) == 3  # another target, another k
    forwards.clear()
    short = target_features.build_target_cache(target, dataset, draft, 5, 5, args.target_features_dir)
    assert len(forwards) == 3 and all(features.shape[0] == 5 for features in short.features)  # other tokens


def test_features_read_from_disk_give_the_in_memory_loss_and_hold_no_tensors(tmp_path):
    target, dataset, draft = _reduced_vocabulary_setup()
    features = str(tmp_path / "features")
    in_memory = DFlashTrainer(
        model=draft, target=target, args=_distill_args(tmp_path, cache_target_features=True), train_dataset=dataset
    )
    on_disk = DFlashTrainer(
        model=draft,
        target=target,
        args=_distill_args(
            tmp_path, cache_target_features=True, target_features_dir=features, target_features_storage="disk"
        ),
        train_dataset=dataset,
    )
    cache = on_disk.target_cache
    assert cache.features == [] and cache.top_logits == [] and len(cache.files) == len(dataset) == len(cache)
    batch = in_memory.data_collator([dict(in_memory.train_dataset[i]) for i in (2, 0)])
    assert torch.equal(in_memory.compute_loss(draft, batch), on_disk.compute_loss(draft, batch))


def test_float16_features_halve_the_files_stay_close_and_keep_their_own_folder(tmp_path):
    from datasets import Dataset

    from hf_dflash.training import target_features

    target = make_target("qwen3")
    dataset = Dataset.from_list(_records(target, count=2))
    draft = make_draft(target, block_size=8, num_hidden_layers=1)
    folder = tmp_path / "features"
    full = target_features.build_target_cache(target, dataset, draft, 2048, 0, folder)
    half = target_features.build_target_cache(target, dataset, draft, 2048, 0, folder, dtype=torch.float16)
    assert half.features[0].dtype == torch.float16
    torch.testing.assert_close(half.features[0].float(), full.features[0], rtol=1e-3, atol=1e-3)
    stores = sorted(folder.iterdir(), key=lambda store: sum(f.stat().st_size for f in store.iterdir()))
    assert len(stores) == 2  # fp16 values never stand in for fp32 ones
    sizes = [sum(f.stat().st_size for f in store.iterdir()) for store in stores]
    assert sizes[0] < 0.55 * sizes[1]
    read = target_features.build_target_cache(target, dataset, draft, 2048, 0, folder, "disk", torch.float16)
    batch = read.batch_features([1, 0], 30, torch.device("cpu"))
    assert batch.dtype == torch.float32 and torch.equal(
        batch[1, : half.features[0].shape[0]], half.features[0].float()
    )


def test_features_beyond_float16_range_are_refused_not_stored_as_inf(tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_dflash.training import target_features

    target = make_target("qwen3")
    dataset = Dataset.from_list(_records(target, count=1))
    draft = make_draft(target, block_size=8, num_hidden_layers=1)
    real_forward = target_features.target_forward

    def huge_forward(*args, **kwargs):
        features, logits = real_forward(*args, **kwargs)
        return features * 1e6, logits

    monkeypatch.setattr(target_features, "target_forward", huge_forward)
    with pytest.raises(ValueError, match="store the features as float32"):
        target_features.build_target_cache(target, dataset, draft, 2048, 0, tmp_path, dtype=torch.float16)
    assert not any(path.is_file() for path in tmp_path.rglob("*"))  # nothing half-written


def test_a_feature_cache_of_an_earlier_version_is_named_not_silently_ignored(tmp_path, caplog):
    import logging

    from datasets import Dataset

    from hf_dflash.training import target_features

    target = make_target("qwen3")
    dataset = Dataset.from_list(_records(target, count=1))
    draft = make_draft(target, block_size=8, num_hidden_layers=1)
    (tmp_path / "target-cache-0123456789abcdef0123.safetensors").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="hf_dflash.training.target_features"):
        target_features.build_target_cache(target, dataset, draft, 2048, 0, tmp_path)
    assert any("an earlier hf-dflash" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_dflash.training.target_features"):
        target_features.build_target_cache(target, dataset, draft, 2048, 0, tmp_path / "new")
    assert caplog.records == []


def test_bad_lever_arguments_are_named(tmp_path):
    for bad, message in (
        ({"distill_top_k": -1}, "distill_top_k"),
        ({"cache_target_features": True, "distill_top_k": 0}, "pass distill_top_k"),
        ({"distill_weight": 0.0, "target_features_dir": "x"}, "pass both"),
        ({"acceptance_loss_weight": 2.0}, "acceptance_loss_weight"),
        ({"draft_init": "copy"}, "draft_init"),
        ({"target_features_storage": "ssd"}, "target_features_storage"),
        ({"cache_target_features": True, "distill_top_k": 4, "target_features_storage": "disk"}, "pass it"),
        ({"target_features_dtype": "bfloat16"}, "target_features_dtype"),
    ):
        with pytest.raises(ValueError, match=message):
            _distill_args(tmp_path, **bad)
