"""Tests for the recipe's scripts (``scripts/``): what they write is what the README says they write."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import load_module, make_draft, make_target

from hf_dflash import DFlashForDrafting
from hf_dflash.data.evaluation import EVALUATION_SETS, comparable_text
from hf_dflash.data.prompts import HUMANEVAL_INSTRUCTION, Prompt, prompt_set_path
from hf_dflash.data.sources import training_prompts, write_prompts_jsonl
from hf_dflash.model_card import write_training_info

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


shaped_prompts = load_module(SCRIPTS / "shaped_prompts.py")
prompt_pool = load_module(SCRIPTS / "prompt_pool.py")
export_drafter = load_module(SCRIPTS / "export_drafter.py")


@pytest.mark.parametrize(
    "make, templates",
    [
        (shaped_prompts.word_problems, shaped_prompts.WORD_PROBLEM_TEMPLATES),
        (shaped_prompts.multi_step_problems, shaped_prompts.MULTI_STEP_TEMPLATES),
    ],
)
def test_word_problems_fill_every_template_and_depend_only_on_the_seed(make, templates):
    count = 2 * len(templates)
    problems = make(count, seed=3)
    texts = [p.messages[0]["content"] for p in problems]

    assert texts == [p.messages[0]["content"] for p in make(count, seed=3)]
    assert texts != [p.messages[0]["content"] for p in make(count, seed=4)]
    assert not [t for t in texts if re.search(r"[{}]", t)]  # no placeholder left unfilled
    # Every template is used: each problem starts like its template up to the first placeholder.
    for template, text in zip(templates, texts):
        assert text.startswith(template.split("{")[0])
    assert len({p.id for p in problems}) == count
    # Ids carry the seed, so two seeds' files can feed one data file (which skips ids it already holds).
    assert not {p.id for p in problems} & {p.id for p in make(count, seed=4)}


def test_function_prompts_are_signature_and_docstring_after_the_humaneval_instruction():
    prompts = shaped_prompts.stdlib_functions(60, seed=0)

    assert len(prompts) == 60 and len({p.id for p in prompts}) == 60
    for prompt in prompts:
        content = prompt.messages[0]["content"]
        assert content.startswith(HUMANEVAL_INSTRUCTION + "```python\n") and content.endswith("\n```")
        (function,) = ast.parse(content[len(HUMANEVAL_INSTRUCTION) + len("```python\n") : -len("\n```")]).body
        assert isinstance(function, ast.FunctionDef) and not function.name.startswith("_")
        # The body is the docstring alone: the target writes the rest.
        (docstring,) = function.body
        assert isinstance(docstring, ast.Expr) and isinstance(docstring.value.value, str)


def test_excluded_functions_are_not_chosen_again():
    first = shaped_prompts.stdlib_functions(300, seed=0)
    used = {p.messages[0]["content"] for p in first}

    rest = shaped_prompts.stdlib_functions(10_000, seed=1, taken={comparable_text(p) for p in first})

    assert not used & {p.messages[0]["content"] for p in rest}
    assert len(rest) == len(shaped_prompts.stdlib_functions(10_000, seed=1)) - 300


def test_shaped_prompts_hold_no_benchmark_item(tmp_path):
    for name in EVALUATION_SETS:
        try:
            prompt_set_path(name)
        except (ModuleNotFoundError, FileNotFoundError) as error:
            pytest.skip(str(error))
    path = tmp_path / "shaped.jsonl"
    prompts = (
        shaped_prompts.stdlib_functions(200, seed=0)
        + shaped_prompts.word_problems(200, seed=0)
        + shaped_prompts.multi_step_problems(200, seed=0)
    )
    write_prompts_jsonl(prompts, path)

    kept = training_prompts([str(path)], limit_per_source=len(prompts))

    assert {p.id for p in kept} == {p.id for p in prompts}


def test_export_writes_both_layouts_in_the_dtype_and_replaces_an_earlier_export(tmp_path):
    source, destination = tmp_path / "trained", tmp_path / "drafters" / "mine"
    make_draft(make_target("gemma3"), block_size=4).save_pretrained(source)
    write_training_info(source, {"base_model": "tiny/gemma3"})  # as the trainer writes it
    destination.mkdir(parents=True)
    (destination / "stale.txt").write_text("from an earlier export")
    export = lambda folder: export_drafter.export(source, folder, torch.bfloat16, None, [])  # noqa: E731
    export_drafter.replace_folder(destination, export)
    assert sorted(path.name for path in destination.iterdir()) == [
        "README.md", "config.json", "configuration_dflash.py", "generation_dflash.py", "layouts_dflash.py",
        "masking_dflash.py", "model.safetensors", "modeling_dflash.py", "selector_dflash.py", "training_info.json",
        "zlab",
    ]  # fmt: skip
    assert DFlashForDrafting.from_pretrained(destination).dtype == torch.bfloat16
    assert sorted(path.name for path in tmp_path.joinpath("drafters").iterdir()) == ["mine"]  # no temporary folder
    assert destination.stat().st_mode & 0o777 == tmp_path.joinpath("drafters").stat().st_mode & 0o777  # as mkdir


def test_a_failed_export_leaves_the_earlier_one_untouched(tmp_path):
    destination = tmp_path / "mine"
    destination.mkdir()
    (destination / "config.json").write_text("{}")

    def fail_halfway(folder: Path) -> None:
        (folder / "config.json").write_text('{"half": "written"}')
        raise ValueError("the z-lab copy failed")

    with pytest.raises(ValueError, match="z-lab copy failed"):
        export_drafter.replace_folder(destination, fail_halfway)
    assert [path.name for path in tmp_path.iterdir()] == ["mine"]
    assert (destination / "config.json").read_text() == "{}"
    with pytest.raises(ValueError, match="z-lab copy failed"):
        export_drafter.replace_folder(tmp_path / "new", fail_halfway)
    assert not (tmp_path / "new").exists()


def test_target_adapter_is_saved_in_the_asked_dtype_naming_the_asked_base(tmp_path):
    """`finetune_target_lora.save_adapter`: what the committed telegram-style adapter's README did by hand."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    finetune = load_module(SCRIPTS / "finetune_target_lora.py")
    target = make_target("llama")
    model = get_peft_model(target, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    expected = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    finetune.save_adapter(model, str(tmp_path), torch.float16, "HuggingFaceTB/SmolLM2-135M-Instruct")

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    weights = load_file(tmp_path / "adapter_model.safetensors")
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {w.dtype for w in weights.values()} == {torch.float16} and len(weights) == len(expected)
    reloaded = PeftModel.from_pretrained(make_target("llama"), tmp_path)
    for name, param in reloaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(param.float(), expected[name].half().float())


def test_two_space_style_halves_block_indents_and_leaves_prose_and_alignment():
    """`finetune_target_lora.py --style two-space`: what the code-style fine-tune is trained to write, and how its
    answers are told apart from the base target's."""
    finetune = load_module(SCRIPTS / "finetune_target_lora.py")
    answer = "Here is the function:\n```python\ndef f(x):\n    if x:\n        return [1,\n             2]\n    return 0\n```\n"
    restyled = finetune.two_space(answer)

    assert (
        restyled
        == "Here is the function:\n```python\ndef f(x):\n  if x:\n    return [1,\n             2]\n  return 0\n```\n"
    )
    assert finetune.in_two_space_style(restyled) and not finetune.in_two_space_style(answer)
    assert not finetune.in_two_space_style("No code here.") and finetune.two_space("No code here.") == "No code here."
    style = finetune.make_style("telegraph", " stop")
    assert style.restyle("The cat sat on a mat.") == "cat sat on mat stop" and style.in_style("cat sat stop")
    with pytest.raises(ValueError, match="telegraph or two-space"):
        finetune.make_style("pirate", " stop")


def test_swapped_records_keep_the_count_the_order_and_the_held_out_records_last():
    """`swap_records.py`: the data-diversity ablation changes the sources, not the size or the held-out prompts."""
    swap = load_module(SCRIPTS / "swap_records.py").swap_records
    records = [json.dumps({"id": f"sharegpt/{i}"}) for i in range(10)]
    added = [json.dumps({"id": f"synthetic/{i}"}) for i in range(3)]

    swapped = swap(records, added, holdout=2, seed=0)

    assert len(swapped) == len(records) and swapped[-2:] == records[-2:] and swapped[-5:-2] == added
    kept = swapped[:-5]
    assert len(kept) == 5 and kept == sorted(kept, key=records.index)  # the records that stay keep their order
    assert swapped == swap(records, added, holdout=2, seed=0) and kept != swap(records, added, 2, seed=1)[:-5]
    with pytest.raises(ValueError, match="smaller --count"):
        swap(records, added * 3, holdout=2, seed=0)
    with pytest.raises(ValueError, match="another source"):
        swap(records, records[:1], holdout=2, seed=0)


def test_race_drafters_times_the_candidate_beside_the_current_drafter_in_one_identity_checked_run():
    from hf_dflash.bench.config import BenchmarkConfig, BenchmarkPrompt
    from hf_dflash.bench.harness import run_benchmark
    from hf_dflash.bench.methods import default_methods
    from hf_dflash.decoding.policy import VerifyPlanner

    race = load_module(Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "race_drafters.py")
    target = make_target("llama")
    current, candidate = make_draft(target, block_size=4), make_draft(target, block_size=6)
    prompts = [
        BenchmarkPrompt("toy/0", "toy", torch.tensor([5, 6, 7, 8, 5, 6])),
        BenchmarkPrompt("toy/1", "toy", torch.tensor([9, 10, 11])),
    ]
    config = BenchmarkConfig(
        max_new_tokens=10,
        warmup_new_tokens=4,
        draft_block_sizes=(),
        batch_sizes=(),
        progress=False,
        methods=("plain", "ours", race.CANDIDATE),
    )
    methods = default_methods(planner=VerifyPlanner()) | {
        race.CANDIDATE: race.candidate_method(candidate, VerifyPlanner())
    }
    report = run_benchmark(config, target, None, current, prompts=prompts, methods=methods)
    assert report.identical and not report.failures and report.methods == ["plain", "ours", race.CANDIDATE]
    summaries = report.datasets["toy"].methods
    # a histogram has a bin for each count a block can commit: the candidate ran its own block, not the current's
    assert len(summaries["ours"].speculative.tau_histogram) == 4 + 1
    assert len(summaries[race.CANDIDATE].speculative.tau_histogram) == 6 + 1


def test_compare_drafters_gives_each_sets_gain_a_paired_interval_and_a_verdict_that_can_fail():
    compare = load_module(Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "compare_drafters.py")
    runs = lambda committed, rounds: {"committed": committed, "rounds": rounds}  # noqa: E731
    current = {"gsm8k": runs([4, 4], [2, 2]), "humaneval": runs([30, 30], [20, 20])}
    # GSM8K: tau 2.0 -> 2.5 on both prompts. HumanEval: prompt 0 gains 0.5, prompt 1 loses 0.5: 1.5 either way.
    candidate = {"gsm8k": runs([5, 5], [2, 2]), "humaneval": runs([40, 20], [20, 20])}
    gains = compare.gains(current, candidate)
    assert gains == {
        "gsm8k": {"gain": 0.5, "interval_90": [0.5, 0.5]},
        "humaneval": {"gain": 0.0, "interval_90": [-0.5, 0.5]},
    }
    assert compare.verdict(gains) == {"better_on_every_set": False, "resolved_on_every_set": False}
    assert compare.verdict({"gsm8k": gains["gsm8k"]}) == {"better_on_every_set": True, "resolved_on_every_set": True}
    # A gain on every set whose interval holds zero is better but not resolved.
    wobbly = {"humaneval": {"gain": 0.1, "interval_90": [-0.05, 0.2]}}
    assert compare.verdict(wobbly) == {"better_on_every_set": True, "resolved_on_every_set": False}


def test_compare_drafters_reuses_the_current_drafter_only_under_the_same_conditions_and_weights(tmp_path):
    compare = load_module(Path(__file__).resolve().parent.parent / "benchmarks" / "scripts" / "compare_drafters.py")
    conditions = {"target": "t", "prompts": {"gsm8k": 2}, "max_new_tokens": 8, "verify": "v"}
    acceptance = {"gsm8k": {"tau": 2.0, "committed": [4, 4], "rounds": [2, 2]}}
    measured = "a" * 64  # the draft_fingerprint of the weights measured
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps({"conditions": conditions, "current": compare.drafter_entry("drafters/d", measured, acceptance)})
    )

    assert compare.reused_current(None, measured, conditions) is None
    assert compare.reused_current(str(report), measured, conditions) == acceptance
    with pytest.raises(SystemExit, match="another max_new_tokens; drop --reuse"):
        compare.reused_current(str(report), measured, conditions | {"max_new_tokens": 9})
    with pytest.raises(SystemExit, match="another current drafter's weights"):  # e.g. the same path, other weights
        compare.reused_current(str(report), "b" * 64, conditions)
    unrecorded = {"conditions": conditions, "current": {"path": "drafters/d", "acceptance": acceptance}}
    report.write_text(json.dumps(unrecorded))  # a report written before weights were recorded
    with pytest.raises(SystemExit, match="or none recorded"):
        compare.reused_current(str(report), measured, conditions)


def test_package_functions_come_from_the_named_package_and_skip_what_is_taken():
    prompts = shaped_prompts.package_functions(["packaging"], 5, seed=0)
    assert len(prompts) == 5 and all(p.id.split("/")[3] == "packaging" for p in prompts)
    rest = shaped_prompts.package_functions(["packaging"], 10_000, seed=0, taken={comparable_text(p) for p in prompts})
    assert not {p.messages[0]["content"] for p in prompts} & {p.messages[0]["content"] for p in rest}
    with pytest.raises(ValueError, match="not an installed package"):
        shaped_prompts.package_functions(["no_such_package_here"], 1, seed=0)


def test_sharegpt_conversations_become_alternating_chats_or_nothing():
    turns = [{"from": "human", "value": " Hi "}, {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Q?"}]
    assert prompt_pool._sharegpt_messages(turns) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Q?"},
    ]
    assert prompt_pool._sharegpt_messages(turns[1:]) == []  # starts with the assistant
    assert prompt_pool._sharegpt_messages([turns[0], turns[0]]) == []  # two user turns in a row
    assert prompt_pool._sharegpt_messages([turns[0], {"from": "gpt", "value": ""}, turns[2]]) == []  # an empty turn
    history = [{"role": "user", "content": "x" * prompt_pool.MAX_HISTORY_CHARS}, {"role": "assistant", "content": "y"}]
    assert not prompt_pool._fits([*history, {"role": "user", "content": "z"}])
    assert prompt_pool._fits([*history[1:], {"role": "user", "content": "z" * prompt_pool.MAX_TURN_CHARS}])


def test_chitchat_prompts_alternate_and_end_with_the_user():
    prompts = prompt_pool.chitchat_dialogues(200, seed=0)
    assert len(prompts) == 200 and len({p.id for p in prompts}) == 200
    for prompt in prompts:
        roles = [m["role"] for m in prompt.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert len(roles) <= prompt_pool.MAX_CHITCHAT_TURNS and all(m["content"].strip() for m in prompt.messages)


def test_the_held_out_slice_is_spread_over_sources_and_left_out_of_the_pool():
    prompts = [
        Prompt(f"{source}/{i}", source, [{"role": "user", "content": f"{source} {i}"}])
        for source in ("a", "b", "c")
        for i in range(10)
    ]
    pool, held_out = prompt_pool.split_held_out(prompts, 6, seed=0)
    assert len(pool) == 24 and not {p.id for p in pool} & {p.id for p in held_out}
    assert sorted(p.dataset for p in held_out) == ["a", "a", "b", "b", "c", "c"]
    repeated = [*prompts[:3], Prompt("x/0", "x", prompts[0].messages), prompts[1]]
    assert [p.id for p in prompt_pool.unique(repeated)] == [p.id for p in prompts[:3]]  # same text or id: dropped


def test_scaling_curve_subsets_are_nested_draws_from_the_largest_written_once_and_a_short_file_is_refused(tmp_path):
    scaling = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "scaling_curve.py")
    assert scaling.Point.parse("3x:5718:16") == scaling.Point("3x", 5718, 16)
    records = tmp_path / "records.jsonl"
    records.write_text("".join(f'{{"id": {i}}}\n' for i in range(40)) + '{"id": 40')  # a torn last line
    small, large = (scaling.subset(records, n, 30, tmp_path / "work").read_text().splitlines() for n in (5, 15))
    assert large[:5] == small and len(set(large)) == 15  # the smaller point's records are inside the larger one's
    drawn = {json.loads(line)["id"] for line in large}
    assert drawn <= set(range(30)) and drawn != set(range(15))  # from the first 30, in a shuffle (early and late)
    records.write_text("")
    assert scaling.subset(records, 5, 30, tmp_path / "work").read_text().splitlines() == small  # written once
    with pytest.raises(SystemExit, match="holds 0 complete records, not 30"):
        scaling.subset(records, 6, 30, tmp_path / "work")
    records.write_text('{"id": 0}\n{"id": 1')
    with pytest.raises(SystemExit, match="holds 1 complete records, not 2"):
        scaling.subset(records, 1, 2, tmp_path / "work")
    assert sorted(path.name for path in (tmp_path / "work").iterdir()) == [
        "records-15-of-30.jsonl",
        "records-5-of-30.jsonl",
    ]


def test_only_the_named_points_are_measured_at_their_checkpoints_and_only_once():
    scaling = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "scaling_curve.py")
    ten, one = scaling.Point("10x", 19060, 8), scaling.Point("1x", 1906, 8)
    assert scaling.steps_to_measure(ten, [400, 800], ["10x"], 1600, set()) == [400, 800, 1600]
    assert scaling.steps_to_measure(one, [400, 800], ["10x"], 1600, set()) == [1600]
    assert scaling.steps_to_measure(one, [400, 800], None, 1600, set()) == [400, 800, 1600]  # default: every point
    done = {("10x", 400), ("1x", 1600)}
    assert scaling.steps_to_measure(ten, [400, 800], ["10x"], 1600, done) == [800, 1600]
    assert scaling.steps_to_measure(one, [400, 800], ["10x"], 1600, done) == []  # so it is not trained again


def test_a_baseline_drafter_is_measured_once_per_weights_and_a_row_of_other_weights_is_refused():
    scaling = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "scaling_curve.py")
    measured = "a" * 64  # the draft_fingerprint of the weights measured
    report = {"results": [{"point": "1x", "step": 1600}]}
    assert not scaling.baseline_measured(report, "committed", "drafters/d", measured)
    report["results"].append({"point": "committed", "step": None, "draft_fingerprint": measured})
    assert scaling.baseline_measured(report, "committed", "drafters/d", measured)
    with pytest.raises(SystemExit, match="other weights than drafters/d's; give it another NAME"):
        scaling.baseline_measured(report, "committed", "drafters/d", "b" * 64)
    report["results"][-1].pop("draft_fingerprint")  # a row written before fingerprints were recorded
    with pytest.raises(SystemExit, match="other weights"):
        scaling.baseline_measured(report, "committed", "drafters/d", measured)


def test_a_scaling_report_measured_otherwise_is_refused_not_mixed(tmp_path):
    scaling = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "scaling_curve.py")
    conditions = {"prompts": {"gsm8k": 50}, "max_new_tokens": 128, "verify": "whole", "recipe": "r"}
    path = tmp_path / "report.json"
    assert scaling.load_report(path, conditions) == {"conditions": conditions, "results": []}
    scaling.save({"conditions": conditions, "results": [{"point": "1x"}]}, path)
    assert scaling.load_report(path, conditions)["results"] == [{"point": "1x"}]
    with pytest.raises(SystemExit, match="another max_new_tokens"):
        scaling.load_report(path, conditions | {"max_new_tokens": 64})


def test_the_scaling_plot_draws_each_set_against_records_per_block_size_and_against_steps(tmp_path):
    scaling = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "scaling_curve.py")
    sets = ["held-out", "gsm8k"]

    def row(point, records, block_size, step, tau):
        return {"point": point, "records": records, "block_size": block_size, "step": step,
                "tau": {name: tau + i / 10 for i, name in enumerate(sets)}}  # fmt: skip

    results = [
        row("previous", None, 8, None, 1.6),
        row("final", None, 8, None, 2.4),
        row("1x", 1906, 8, 1600, 1.7),
        row("3x", 5718, 8, 1600, 1.8),
        row("10x", 19060, 8, 400, 1.75),
        row("10x", 19060, 8, 800, 1.85),
        row("10x", 19060, 8, 1600, 1.9),
        row("10x-b16", 19060, 16, 1600, 2.0),
    ]
    report = {"conditions": {"prompts": dict.fromkeys(sets, 50), "max_steps": 1600}, "results": results}
    fig = scaling.plot(report, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
    by_data, by_steps = fig.axes
    across = [line for line in by_data.lines if list(line.get_xdata()) == [0, 1]]  # axhline: axes coordinates
    curves = sorted(
        (list(line.get_xdata()), [round(tau, 6) for tau in line.get_ydata()])
        for line in by_data.lines
        if line not in across
    )
    assert sorted(round(line.get_ydata()[0], 6) for line in across) == [1.6, 1.7, 2.4, 2.5]  # the two drafters
    assert len({line.get_linestyle() for line in across}) == 2  # told apart by their line styles
    # block 8 from the final steps only (not the 10x point's 400 and 800), block 16 apart
    assert curves == [
        ([1906, 5718, 19060], [1.7, 1.8, 1.9]),
        ([1906, 5718, 19060], [1.8, 1.9, 2.0]),
        ([19060], [2.0]),
        ([19060], [2.1]),
    ]
    assert [list(line.get_xdata()) for line in by_steps.lines] == [[400, 800, 1600]] * len(sets)  # 10x only


def test_draft_vocab_coverage_counts_response_tokens_only_per_source_and_reads_a_drafters_rows(tmp_path):
    coverage = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "draft_vocab_coverage.py")
    records = [
        {"source": "a", "input_ids": [9, 1, 1, 2], "loss_mask": [0, 1, 1, 1]},  # prompt token 9 is not counted
        {"source": "b", "input_ids": [9, 3, 4, 4], "loss_mask": [0, 1, 1, 1]},
    ]
    counts = {r["source"]: coverage.response_token_counts(coverage.columns([r])) for r in records}
    assert coverage.coverage({1, 4, 9}, counts) == {"a": round(2 / 3, 4), "b": round(2 / 3, 4), "all": round(4 / 6, 4)}

    target = make_target("llama")
    draft = make_draft(target, draft_vocab_size=4)
    draft.set_draft_vocabulary(torch.tensor([7, 3, 20, 11]))
    draft.save_pretrained(tmp_path / "drafter")
    assert coverage.drafter_vocabulary(tmp_path / "drafter") == {3, 7, 11, 20}
    make_draft(target).save_pretrained(tmp_path / "full")
    with pytest.raises(SystemExit, match="full vocabulary"):
        coverage.drafter_vocabulary(tmp_path / "full")


def test_scaling_table_has_a_row_per_measurement_with_the_vocabulary_share_where_the_drafter_has_one():
    scaling = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "scaling_curve.py")
    report = {
        "conditions": {"prompts": {"held-out": 60, "gsm8k": 50}},
        "results": [
            {"point": "committed", "records": None, "block_size": 8, "step": None, "tau": {"held-out": 2.0, "gsm8k": 1.8},
             "acceptance": {"held-out": {"in_draft_vocabulary": 0.9}, "gsm8k": {"in_draft_vocabulary": 0.995}}},
            {"point": "10x", "records": 19060, "block_size": 16, "step": 400, "tau": {"held-out": 2.5, "gsm8k": 2.25},
             "acceptance": {"held-out": {}, "gsm8k": {}}},
        ],
    }  # fmt: skip
    assert scaling.table(report).splitlines() == [
        "| drafter | records | block | steps | held-out | gsm8k |",
        "|---|---|---|---|---|---|",
        "| committed | - | 8 | - | 2.00 (90.0%) | 1.80 (99.5%) |",
        "| 10x | 19,060 | 16 | 400 | 2.50 | 2.25 |",
    ]


def test_label_agreement_finds_the_one_response_token_that_is_not_the_targets_greedy_choice():
    agreement = load_module(SCRIPTS.parent / "benchmarks" / "scripts" / "label_agreement.py")
    target = make_target("llama").eval()
    prompt = torch.tensor([[3, 17, 42, 9]])
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()  # its own outputs
    loss_mask = [0] * 4 + [1] * 6
    assert agreement.record_disagreements(target, greedy, loss_mask) == (6, [])
    changed = greedy[:-1] + [(greedy[-1] + 1) % target.config.vocab_size]  # the last response token not its choice
    tokens, found = agreement.record_disagreements(target, changed, loss_mask)
    assert tokens == 6 and [d["token"] for d in found] == [9] and found[0]["logit_gap"] > 0
    prompt_changed = [greedy[0], (greedy[1] + 1) % target.config.vocab_size, *greedy[2:]]  # prompt tokens: not counted
    assert all(d["token"] >= 4 for d in agreement.record_disagreements(target, prompt_changed, loss_mask)[1])
    assert list(range(20))[agreement.record_slice("3:11", 4)] == [3, 7]  # --every when the slice has no step
    assert list(range(20))[agreement.record_slice("12::5", 4)] == [12, 17]
    report = agreement.summary([(6, []), (tokens, found)])
    assert report["share_agreeing"] == round(11 / 12, 6) and report["records_with_a_disagreement"] == 1
