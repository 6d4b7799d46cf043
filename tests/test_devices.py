"""The core lossless checks on every device this machine has (the `device` fixture: "cpu", then "cuda" / "mps"):
greedy outputs token-identical to plain `generate` on both paths (chains, trees where the target verifies one,
costed plans, ragged batches), sampled outputs well-formed, measured costs positive, a few training steps that stay
on the device. Tiny fp32 models with eager attention, moved with `.to(device)`; oracle drafts make rounds accept
several tokens and roll back the rest. On a CPU-only machine this is a quick run of the device-agnostic code paths;
on a GPU it is where host/device mix-ups (a tensor left on the CPU, a CPU generator or timer) surface.

The GPU cost probe (`benchmarks/scripts/probe_gpu_costs.py`) gets a CPU smoke run at tiny shapes here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import VOCAB, greedy_reference, left_pad, load_module, make_draft, make_oracle, make_target
from test_draft_tree import tree_oracle
from test_generation import random_prompt
from test_training import _args, _regenerated
from transformers import GenerationConfig

from hf_dflash import speculative_generate
from hf_dflash.decoding.policy import VerifyCosts, VerifyPlanner, measure_verify_costs
from hf_dflash.decoding.speculative import tree_unsupported_reason
from hf_dflash.training.trainer import DFlashTrainer

# RoPE with a Llama layout, GPT-NeoX's partial rotary and fused QKV, Gemma 3's sliding layers and scaled embedding
# (chains only, batches decoded row by row).
DEVICE_FAMILIES = ["llama", "gpt_neox", "gemma3"]
NEW_TOKENS = 40


def flat_costs() -> VerifyCosts:
    """As on a GPU: a forward over 17 tokens costs about one token's, so the planner keeps most nodes, as trees if it
    may. New costs for every call: the fallback's judgement, timed on the wall clock, carries across the calls that
    share one `VerifyCosts`, so a shared one would let a pause begun in one test (another target, a busy machine)
    make the next test's call decode plain."""
    return VerifyCosts(verify=tuple(1.0 + 0.01 * n for n in range(17)), draft=0.1)


def _on(device: str, *tensors: torch.Tensor) -> bool:
    return all(t.device.type == device for t in tensors)


def _oracle_on(device: str, make, target, references: list[torch.Tensor], *args, **kwargs):
    """`make(target, references, ...)`, an oracle draft, steered on the host (MPS has no `torch.linalg.pinv`), then
    moved with `target` (back) to `device`."""
    draft = make(target.cpu(), [r.cpu() for r in references], *args, **kwargs)
    target.to(device)
    draft.to(device).token_states = draft.token_states.to(device)
    return draft


def test_from_target_builds_the_drafter_on_the_targets_device(device):
    target = make_target("qwen3").to(device)
    draft = make_draft(target, block_size=4, num_hidden_layers=1, draft_vocab_size=48)
    draft.set_draft_vocabulary(torch.arange(48, 96))  # host ids into the device's `d2t`
    assert draft.device == target.device and draft.dtype == target.dtype
    assert _on(device, *draft.parameters(), *draft.buffers())
    prompt = random_prompt(10, seed=2).to(device)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=12)
    assert _on(device, out.sequences)
    assert out.sequences[0].tolist() == greedy_reference(target, prompt, 12).tolist()


@pytest.mark.parametrize("family", DEVICE_FAMILIES)
def test_greedy_outputs_are_the_targets_own(device, family, generator_spy):
    target = make_target(family).to(device)
    prompt = random_prompt(12, seed=4).to(device)
    full = greedy_reference(target, prompt, NEW_TOKENS)
    reference = full.tolist()
    draft = _oracle_on(device, make_oracle, target, [full], p_wrong=0.2)

    chains = speculative_generate(target, draft, prompt[None], max_new_tokens=NEW_TOKENS, tree=False)
    planned = speculative_generate(target, draft, prompt[None], max_new_tokens=NEW_TOKENS, verify_costs=flat_costs())
    via_generate = target.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft)
    planned_config = GenerationConfig(  # generate()'s planner: the chain length worth verifying
        max_new_tokens=NEW_TOKENS, do_sample=False, dflash_planner=VerifyPlanner(costs=flat_costs())
    )
    costed_generate = target.generate(prompt[None], assistant_model=draft, generation_config=planned_config)

    assert chains.sequences[0].tolist() == planned.sequences[0].tolist() == reference
    assert via_generate[0].tolist() == costed_generate[0].tolist() == reference
    assert _on(device, chains.sequences, planned.sequences, via_generate)
    assert generator_spy == ["DFlashCandidateGenerator"] * 2
    assert chains.stats.tau > 2 and planned.stats.num_rounds > 0  # long accepted runs; 20% wrong slots roll back
    if tree_unsupported_reason(target, do_sample=False, planner=VerifyPlanner()) is not None:
        assert planned.stats.tree_rounds == 0
        return
    # siblings one logit behind the first choice: trees, fixed or planned, accept what a chain cannot propose
    tree_draft = _oracle_on(device, tree_oracle, target, [full], p_sibling=0.3, p_miss=0.1)
    trees = speculative_generate(target, tree_draft, prompt[None], max_new_tokens=NEW_TOKENS, tree=16)
    planned_trees = speculative_generate(
        target, tree_draft, prompt[None], max_new_tokens=NEW_TOKENS, verify_costs=flat_costs()
    )
    assert trees.sequences[0].tolist() == planned_trees.sequences[0].tolist() == reference
    assert trees.stats.tree_rounds == trees.stats.num_rounds > 0 and trees.stats.tau > 1.5
    assert planned_trees.stats.tree_rounds > 0


@pytest.mark.parametrize("family", DEVICE_FAMILIES)
def test_a_ragged_batch_of_two_gives_each_rows_own_output(device, family):
    target = make_target(family).to(device)
    prompts = [random_prompt(length, seed=length) for length in (5, 14)]
    full = [greedy_reference(target, p.to(device), 30) for p in prompts]
    references = [f[len(p) :].tolist() for f, p in zip(full, prompts)]
    draft = _oracle_on(device, make_oracle, target, full, p_wrong=0.2)
    input_ids, attention_mask = (t.to(device) for t in left_pad(prompts))
    width = input_ids.shape[1]

    variants = [{"tree": False}, {"verify_costs": flat_costs()}]
    if tree_unsupported_reason(target, do_sample=False, planner=VerifyPlanner()) is None:
        variants.append({"tree": 16})
    for kwargs in variants:
        out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=30, **kwargs)
        assert _on(device, out.sequences)
        assert [row[width:] for row in out.sequences.tolist()] == references, kwargs
        assert out.num_new_tokens == [30, 30]
        assert out.stats.tau > 1  # row by row (sliding windows), row 1 is steered to row 0's text: little accepted


def test_sampled_outputs_have_the_right_shape_and_stay_in_the_vocabulary(device):
    target = make_target("llama").to(device)
    draft = make_draft(target, block_size=6)
    prompts = [random_prompt(length, seed=length) for length in (6, 3)]
    input_ids, attention_mask = (t.to(device) for t in left_pad(prompts))
    torch.manual_seed(0)
    sampling = {"do_sample": True, "top_k": 20, "temperature": 0.8}

    one = speculative_generate(target, draft, input_ids[:1], max_new_tokens=24, verify_costs=flat_costs(), **sampling)
    batch = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=16, **sampling)
    via_generate = target.generate(input_ids[:1], max_new_tokens=24, assistant_model=draft, **sampling)

    for sequences, new in ((one.sequences, 24), (batch.sequences, 16), (via_generate, 24)):
        assert _on(device, sequences) and sequences.dtype == torch.long
        assert sequences.shape[1] == input_ids.shape[1] + new  # no EOS in the tiny configs: the whole budget
        assert 0 <= int(sequences.min()) and int(sequences.max()) < VOCAB
        assert sequences[:, : input_ids.shape[1]].tolist() == input_ids[: sequences.shape[0]].tolist()
    assert batch.num_new_tokens == [16, 16] and one.stats.num_rounds > 0


def test_measured_costs_are_positive_finite_and_plan_exact_runs(device):
    target = make_target("llama").to(device)
    draft = make_draft(target, block_size=4)
    costs = measure_verify_costs(target, draft, context_length=16, repeats=1, max_tokens=6)
    assert len(costs.verify) == 6
    assert all(math.isfinite(cost) and cost > 0 for cost in (*costs.verify, costs.draft))
    prompt = random_prompt(8, seed=5).to(device)
    out = speculative_generate(target, draft, prompt[None], max_new_tokens=20, verify_costs=costs)
    assert out.sequences[0].tolist() == greedy_reference(target, prompt, 20).tolist()


def test_a_few_training_steps_keep_the_drafter_on_the_device_and_change_it(device, tmp_path):
    target = make_target("llama")
    records, _ = _regenerated(target, num_sequences=4, new_tokens=16)  # written on the host, before the move
    target.to(device)
    draft = make_draft(target, block_size=8, num_hidden_layers=1).train()
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    args = _args(
        tmp_path,
        num_anchors=8,
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        use_cpu=device == "cpu",
    )
    trainer = DFlashTrainer(model=draft, target=target, args=args, train_dataset=Dataset.from_list(records))
    trainer.train()
    assert trainer.args.device.type == device
    assert _on(device, *draft.parameters(), *trainer.target.parameters())
    changed = [name for name, p in draft.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert "fc.weight" in changed and any(name.startswith("layers.0.self_attn") for name in changed)
    assert all(math.isfinite(entry["train_loss"]) for entry in trainer.state.log_history if "train_loss" in entry)


def test_the_gpu_cost_probe_runs_at_tiny_shapes_on_a_cpu(tmp_path, capsys):
    probe = load_module(Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "probe_gpu_costs.py")
    output = tmp_path / "costs.json"
    tiny = "--device cpu --dtype float32 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 128"
    report = probe.main([*tiny.split(), *"--context 16 --repeats 1 --draft-repeats 1 --output".split(), str(output)])

    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report  # the last line is the document
    assert json.loads(output.read_text()) == report
    assert [row["tokens"] for row in report["verify"]] == list(range(1, 33))
    assert all(row["ms"] > 0 and math.isfinite(row["ms"]) for row in report["verify"])
    steps = {(step["draft_layers"], step["block_size"]): step["median_ms"] for step in report["draft_step"]}
    assert set(steps) == {(layers, block) for layers in (1, 5) for block in (4, 8, 16)}
    assert all(ms > 0 for ms in steps.values())
    conditions = report["conditions"]
    assert (
        conditions["device"] == "cpu" and conditions["dtype"] == "float32" and conditions["torch"] == torch.__version__
    )
    assert conditions["target"]["hidden_size"] == 64 and conditions["target"]["num_hidden_layers"] == 2
    assert [d["num_hidden_layers"] for d in conditions["drafts"]] == [1, 5]
    assert probe.parse_args([]).hidden == 4096 and probe.parse_args([]).vocab == 151936  # the defaults: Qwen3-8B
