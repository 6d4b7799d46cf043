import dataclasses
import json
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import load_module, make_draft, make_target

from hf_dflash import bench
from hf_dflash.bench import harness as benchmark
from hf_dflash.bench import methods as bench_methods
from hf_dflash.bench import peers
from hf_dflash.bench.config import (
    ALL_METHODS,
    FAST_BASELINE,
    SAMPLING_ONLY,
    STOCK_BASELINE,
    BenchmarkConfig,
    BenchmarkPrompt,
)
from hf_dflash.bench.harness import load_benchmark_prompts, measure_batch_throughput, run_benchmark
from hf_dflash.bench.methods import default_methods, plain_thread_methods, plain_threads_name
from hf_dflash.bench.plot import measured_methods, save_plot
from hf_dflash.bench.report import BenchmarkReport, Mismatch, PromptRun, render_table
from hf_dflash.bench.statistics import (
    count_new_tokens,
    first_difference,
    median,
    median_of_ratios,
    ratio_of_medians,
    summarize,
)
from hf_dflash.decoding.policy import VerifyPlanner
from hf_dflash.engines.llama_cpp import EngineRun

PROMPTS = [
    BenchmarkPrompt("toy/0", "toy", torch.tensor([5, 6, 7, 8, 5, 6, 7, 8])),
    BenchmarkPrompt("toy/1", "toy", torch.tensor([9, 10, 11, 12, 13])),
    BenchmarkPrompt("toy/2", "toy", torch.tensor([3, 4, 3, 4, 3, 4, 3])),
    BenchmarkPrompt("other/0", "other", torch.tensor([20, 21, 22, 20, 21])),
]


OTHER_THREADS = 1 if torch.get_num_threads() != 1 else 2  # a plain variant beside `plain` at the default count
PLAIN_OTHER = plain_threads_name(OTHER_THREADS)
GREEDY_METHODS = [m for m in ALL_METHODS if m != "ours_argmax"]
SPECULATIVE_METHODS = ["ours", "ours_chain", "ours_tree16", "ours_full_block"]


def tiny_config(**overrides) -> BenchmarkConfig:
    fields = dict(max_new_tokens=12, warmup_new_tokens=4, draft_block_sizes=(), batch_sizes=(), progress=False)
    return BenchmarkConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def draft(target):
    return make_draft(target, block_size=4, num_hidden_layers=1)


@pytest.fixture(scope="module")
def report(target, draft):
    config = tiny_config(
        repeats=2,
        full_comparison_limit=2,
        draft_block_sizes=(2, 4),
        batch_sizes=(1, 3),
        plain_threads=(OTHER_THREADS,),
    )
    return run_benchmark(config, target, None, draft, prompts=PROMPTS)


# -- statistics --------------------------------------------------------------------------------------------------------


def test_statistics_on_hand_made_numbers():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert median([]) is None
    assert ratio_of_medians([2.0, 4.0, 6.0], [1.0, 2.0, 100.0]) == 2.0
    assert median_of_ratios([2.0, 4.0, 6.0], [1.0, 2.0, 100.0]) == 2.0  # ratios 2, 2, 0.06
    assert median_of_ratios([3.0, 1.0], [1.0, 1.0]) == 2.0
    assert ratio_of_medians([], [1.0]) is None
    with pytest.raises(ValueError, match="equal lengths"):
        median_of_ratios([1.0], [1.0, 2.0])


def test_first_difference_and_new_token_counts():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert count_new_tokens(torch.tensor([[4, 2, 0, 0], [4, 5, 6, 7]]), eos_token_ids=[2]) == [2, 4]


def test_summarize_pairs_each_method_with_plain_on_the_same_prompts():
    per_prompt = {
        "a": {"plain": _entry(10, 1.0, 10), "ours": _entry(10, 0.5, 5), "native": _entry(10, 0.25, 4)},
        "b": {"plain": _entry(10, 2.0, 10), "ours": _entry(10, 0.5, 4)},
        "c": {"plain": _entry(10, 0.5, 10), "ours": _entry(10, 0.5, 6)},
    }
    summary = summarize(per_prompt, ["a", "b", "c"], ["plain", "ours", "native"]).methods
    assert summary["plain"].tokens_per_s == 10.0  # rates 10, 5, 20
    assert summary["ours"].tokens_per_s == 20.0  # rates 20, 20, 20
    assert summary["ours"].speedup_ratio_of_medians == 2.0
    assert summary["ours"].speedup_median_of_ratios == 2.0  # ratios 2, 4, 1
    assert summary["ours"].tokens_per_target_forward == 2.0  # 30 tokens, 15 forwards
    assert summary["native"].prompts == 1
    assert summary["native"].speedup_ratio_of_medians == 4.0  # against plain on prompt "a" only


def test_summarize_takes_the_faster_plain_variant_as_baseline():
    per_prompt = {
        "a": {"plain": _entry(10, 1.0, 10), "plain_threads1": _entry(10, 0.5, 10), "ours": _entry(10, 0.25, 4)},
        "b": {"plain": _entry(10, 2.0, 10), "plain_threads1": _entry(10, 1.0, 10), "ours": _entry(10, 0.5, 4)},
    }
    summary = summarize(per_prompt, ["a", "b"], ["plain", "plain_threads1", "ours"], ["plain", "plain_threads1"])
    assert summary.baseline == "plain_threads1"
    assert summary.plain_tokens_per_s == {"plain": 7.5, "plain_threads1": 15.0}  # rates 10, 5 and 20, 10
    assert summary.methods["plain_threads1"].speedup_ratio_of_medians == 1.0
    assert summary.methods["plain"].speedup_ratio_of_medians == 0.5
    assert summary.methods["ours"].speedup_ratio_of_medians == 2.0  # 30 vs 15, not 30 vs 7.5
    assert summary.methods["ours"].speedup_median_of_ratios == 2.0


def _entry(new_tokens, seconds, forwards):
    return PromptRun(
        new_tokens=new_tokens,
        target_forwards=forwards,
        seconds=[seconds],
        tokens_per_s=new_tokens / seconds,
        tokens_per_target_forward=new_tokens / forwards,
    )


# -- the committed reports ---------------------------------------------------------------------------------------------

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
COMMITTED_REPORTS = sorted(RESULTS.glob("**/bench_*.json"))
# written before `plain_threads` and the per-method statistics existed: they load, and only their config gains keys
OLDER_REPORTS = {
    "bench_smollm2_fresh_clone_rerun.json",
    "bench_smollm2_more_shaped_data.json",
    "bench_smollm2_shaped_first.json",
    "bench_smollm2_shaped_first_mtbench.json",
}


def test_every_committed_report_is_found():
    assert len(COMMITTED_REPORTS) >= 13 and OLDER_REPORTS <= {path.name for path in COMMITTED_REPORTS}


@pytest.mark.parametrize("path", COMMITTED_REPORTS, ids=lambda path: path.name)
def test_committed_reports_load_and_write_back_the_same_json(path):
    written = json.loads(path.read_text())
    report = BenchmarkReport.read(path)
    assert report.datasets and report.per_prompt and report.conditions.max_new_tokens > 0
    again = report.to_json()
    # the config is a `BenchmarkConfig`: it round-trips, plus the settings added since, at their defaults
    assert again["config"].items() >= written["config"].items()
    defaults = BenchmarkConfig()
    for key in again["config"].keys() - written["config"].keys():
        assert again["config"][key] == json.loads(json.dumps(getattr(defaults, key))), key
    if path.name in OLDER_REPORTS:  # an older schema: every other part round-trips
        assert {key: value for key, value in again.items() if key != "config"} == {
            key: value for key, value in written.items() if key != "config"
        }
        assert all("draft_ms_per_round" in s.extra for s in report.datasets.values())  # its own keys are kept
    else:  # same keys, same order
        assert list(again) == list(written) and list(again["config"])[: len(written["config"])] == list(
            written["config"]
        )
        assert {key: value for key, value in again.items() if key != "config"} == {
            key: value for key, value in written.items() if key != "config"
        }
    table = render_table(report)
    assert report.conditions.cpu in table and all(dataset in table for dataset in report.datasets)


def test_export_drafter_reads_ours_statistics_from_a_committed_report():
    export_drafter = load_module(Path(__file__).resolve().parent.parent / "scripts" / "export_drafter.py")
    report = BenchmarkReport.read(RESULTS / "bench_smollm2.json")
    acceptance = export_drafter.acceptance_from_report(RESULTS / "bench_smollm2.json")
    assert set(acceptance) == {"gsm8k", "humaneval"}
    ours = report.datasets["gsm8k"].methods["ours"]
    assert acceptance["gsm8k"]["tau"] == round(ours.speculative.tau, 2)
    assert acceptance["gsm8k"]["speedup"] == round(ours.speedup_median_of_ratios, 2)
    assert acceptance["gsm8k"]["conditions"].endswith("speed-up against plain")  # a report from before other plains
    main = export_drafter.acceptance_from_report(RESULTS / "bench_smollm2_xeon_main.json")["gsm8k"]["conditions"]
    assert "CPU kernels: 211 linears prepared (exact)" in main and main.endswith("speed-up against plain_stock")
    older = export_drafter.acceptance_from_report(RESULTS / "bench_smollm2_shaped_first.json")
    assert older["gsm8k"]["tau"] == round(
        json.loads((RESULTS / "bench_smollm2_shaped_first.json").read_text())["datasets"]["gsm8k"]["tau"], 2
    )  # from before per-method statistics: the dataset's own tau


# -- the benchmark on a tiny target ------------------------------------------------------------------------------------


def test_report_covers_every_method_and_outputs_are_identical(report):
    assert report.methods == ["plain", PLAIN_OTHER, *GREEDY_METHODS[1:]]
    assert report.baselines == ["plain", PLAIN_OTHER]
    assert report.skipped_methods == {"ours_argmax": SAMPLING_ONLY["ours_argmax"]}  # greedy: it is `ours`
    assert report.failed_methods == {}
    assert report.identical and report.mismatches == []  # every plain variant and every drafted path
    assert {m for p in report.per_prompt.values() for m in p} == set(report.methods)
    assert set(report.datasets) == {"toy", "other", "all"}
    for summary in report.datasets.values():
        methods = summary.methods
        assert set(methods) == set(report.methods)
        assert summary.baseline in report.baselines and set(summary.plain_tokens_per_s) == {"plain", PLAIN_OTHER}
        assert methods[summary.baseline].speedup_ratio_of_medians == 1.0
        assert methods["plain"].tokens_per_target_forward == 1.0
        for method in SPECULATIVE_METHODS:
            stats = methods[method].speculative
            # the fallback's judgement carries across prompts: a costed method may not draft on a whole set
            assert (stats.tau >= 1.0 or stats.rounds == 0) and len(stats.tau_histogram) == 4 + 1
        assert methods["plain"].speculative is None and methods["assisted"].speculative is None  # no stats there
        assert methods["ours_chain"].speculative.tree_rounds == methods["ours_full_block"].speculative.tree_rounds == 0
        assert methods["ours_tree16"].speculative.tree_rounds > 0
        assert methods["ours_tree16"].speculative.verified_drafts_per_round > 4  # 16 nodes where the budget leaves 3
        assert methods["ours_full_block"].speculative.verified_drafts_per_round > 2  # B - 1 = 3 where the budget cuts
    as_json = json.loads(json.dumps(report.to_json()))  # JSON-ready
    ours = as_json["datasets"]["toy"]["methods"]["ours"]  # the statistics sit beside the rates, as they always did
    for key in ("tau", "tau_histogram", "verified_drafts_per_round", "tree_rounds", "plain_steps", "rounds"):
        assert key in ours, key
    assert "tau" not in as_json["datasets"]["toy"]  # no copy of `ours`'s statistics at the dataset's top any more
    assert BenchmarkReport.from_json(as_json).to_json() == as_json


def test_full_comparison_limit_is_per_dataset(report):
    methods = {p.id: p.methods for p in report.prompts}
    assert set(methods["toy/0"]) == set(methods["toy/1"]) == set(methods["other/0"]) == set(report.methods)
    assert set(methods["toy/2"]) == {"plain", PLAIN_OTHER, "assisted", "ours"}  # every plain variant runs everywhere
    assert [p.full_comparison for p in report.prompts] == [True, True, False, True]
    assert report.datasets["toy"].methods["native"].prompts == 2
    assert report.datasets["toy"].methods["ours"].prompts == 3
    assert len(report.per_prompt["toy/0"]["ours"].seconds) == 2  # repeats


def test_conditions_are_recorded(report):
    conditions = report.conditions.to_json()
    for key in ("OMP_WAIT_POLICY", "torch_threads", "torch", "transformers", "cpu", "target_dtype", "block_size"):
        assert key in conditions
    assert conditions["block_size"] == 4 and conditions["max_new_tokens"] == 12
    relative, seconds = conditions["target_forward_relative"], conditions["target_forward_s"]
    assert len(relative) == len(seconds) == 32 and relative[0] == 1.0 and all(s > 0 for s in seconds)
    assert conditions["verify_costs_relative"] == relative  # `ours` planned from that very curve
    assert conditions["draft_forward_s"] > 0 and conditions["draft_cost_relative"] > 0
    assert "stock_target_forward_s" not in conditions  # not prepared: no stock curve, and no key for it


def test_every_costed_method_plans_from_one_measured_costs_object(target, draft, monkeypatch):
    seen = []
    real = bench_methods.speculative_generate

    def spy(target, draft, input_ids, attention_mask=None, **kwargs):
        seen.append((kwargs.get("tree"), kwargs["verify_costs"]))
        return real(target, draft, input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(bench_methods, "speculative_generate", spy)
    config = tiny_config(methods=("ours", "ours_chain", "ours_tree16", "ours_full_block"), max_new_tokens=6)
    planner = VerifyPlanner()
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:1], planner=planner)
    assert report.identical
    costs = bench_methods.benchmark_verify_costs(target, draft, planner)
    assert costs.max_nodes >= 16  # trees of 16 nodes + the bonus fit
    by_tree = {tree: {id(c) if c is not None else None for t, c in seen if t == tree} for tree, _ in seen}
    assert by_tree == {None: {id(costs)}, False: {id(costs), None}, 16: {None}}  # ours / ours_chain, full block / tree


def test_plain_threads_runs_at_that_count_and_restores_it(target, draft):
    counts = []
    handle = target.register_forward_pre_hook(lambda *args: counts.append(torch.get_num_threads()))
    default = torch.get_num_threads()
    try:
        method = plain_thread_methods([OTHER_THREADS])[PLAIN_OTHER]
        method(target, draft, PROMPTS[0].input_ids[None], None, max_new_tokens=2, do_sample=False)
    finally:
        handle.remove()
    assert set(counts) == {OTHER_THREADS} and torch.get_num_threads() == default


@pytest.mark.parametrize("slow", ["plain", PLAIN_OTHER])
def test_speedups_are_against_the_faster_plain(target, draft, slow):
    methods = default_methods() | plain_thread_methods([OTHER_THREADS])

    def slowed(*args, **kwargs):
        time.sleep(0.2)
        return methods[slow](*args, **kwargs)

    config = tiny_config(methods=("ours",), plain_threads=(OTHER_THREADS,), verify_costs=None)
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:2], methods=methods | {slow: slowed})
    faster = PLAIN_OTHER if slow == "plain" else "plain"
    assert report.identical  # the slowed variant's outputs are still checked
    for summary in report.datasets.values():
        rates = summary.plain_tokens_per_s
        assert summary.baseline == faster and rates[faster] > rates[slow]
        assert summary.methods[faster].speedup_ratio_of_medians == 1.0
        assert summary.methods[slow].speedup_ratio_of_medians < 1.0
    assert f"speedups vs {faster}, the faster plain" in render_table(report)


def test_sampling_measures_both_proposal_kinds(target, draft):
    config = tiny_config(do_sample=True, methods=("ours", "ours_argmax", "ours_chain", "ours_tree16"))
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:2])
    assert report.methods == ["plain", "ours", "ours_argmax"]
    assert set(report.skipped_methods) == {"ours_chain", "ours_tree16"}  # chains already; trees are greedy only
    assert not report.identity_checked and report.failures == []
    for method in ("ours", "ours_argmax"):
        stats = report.datasets["toy"].methods[method].speculative
        assert stats.tau >= 1.0 and stats.tree_rounds == 0
    assert "ours_argmax: tau" in render_table(report)


def test_sampling_settings_reach_every_method_and_the_report(target, draft, monkeypatch):
    from hf_dflash.bench import harness

    seen = []
    timed_run = harness._timed_run
    monkeypatch.setattr(
        harness,
        "_timed_run",
        lambda method, t, d, ids, kwargs: seen.append(kwargs) or timed_run(method, t, d, ids, kwargs),
    )
    config = tiny_config(do_sample=True, temperature=0.7, top_p=0.95, methods=("ours",))
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:1])
    assert report.conditions.sampling == {"temperature": 0.7, "top_p": 0.95}
    assert seen and all(kwargs["temperature"] == 0.7 and kwargs["top_p"] == 0.95 for kwargs in seen)
    assert "top_k" not in seen[0]  # unset: the target's own


def test_trees_are_left_out_where_the_target_cannot_verify_one():
    target = make_target("mistral")  # sliding-window attention: chains only
    draft = make_draft(target, block_size=4, num_hidden_layers=1)
    config = tiny_config(methods=("ours", "ours_tree16"), max_new_tokens=4)
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:1])
    assert report.methods == ["plain", "ours"] and "sliding-window" in report.skipped_methods["ours_tree16"]
    assert report.identical and report.failures == []
    assert "ours_tree16 left out" in render_table(report)


def test_datasets_take_their_own_limit(monkeypatch):
    from hf_dflash.data import chat, prompts

    asked = {}

    def load_prompts(name, limit=None):
        asked[name] = limit
        return [prompts.Prompt(f"{name}/{i}", name, [{"role": "user", "content": "hi"}]) for i in range(limit)]

    monkeypatch.setattr(prompts, "load_prompts", load_prompts)
    monkeypatch.setattr(chat, "encode_prompt", lambda tokenizer, prompt: [1, 2])
    loaded = load_benchmark_prompts(None, ["gsm8k", "mt-bench:2"], limit=3)
    assert asked == {"gsm8k": 3, "mt-bench": 2}
    assert [p.id for p in loaded] == ["gsm8k/0", "gsm8k/1", "gsm8k/2", "mt-bench/0", "mt-bench/1"]
    assert {p.dataset for p in loaded} == {"gsm8k", "mt-bench"}
    assert all(p.input_ids.tolist() == [1, 2] for p in loaded)


def test_sub_benchmarks(report):
    assert [r.block_size for r in report.draft_forward] == [2, 4]
    assert all(r.median_ms > 0 for r in report.draft_forward)
    batch = report.batch
    assert [r.batch_size for r in batch] == [1, 3]
    assert all(r.identical and r.plain_new_tokens == r.ours_new_tokens for r in batch)
    assert all(r.tau >= 1.0 and r.tree_rounds is not None and r.plain_steps is not None for r in batch)  # planned


def test_a_wrong_token_is_detected(target, draft):
    methods = default_methods()

    def broken(target, draft, input_ids, attention_mask, **kwargs):
        sequences, stats = methods["plain"](target, draft, input_ids, attention_mask, **kwargs)
        sequences = sequences.clone()
        sequences[0, -3] = (sequences[0, -3] + 1) % 90
        return sequences, stats

    config = tiny_config(methods=("plain", "ours", "broken"))
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:2], methods=methods | {"broken": broken})
    assert not report.identical
    assert {m.method for m in report.mismatches} == {"broken"}
    assert {m.prompt_id for m in report.mismatches} == {"toy/0", "toy/1"}
    assert all(m.first_difference == 12 - 3 for m in report.mismatches)
    assert "OUTPUT MISMATCHES" in render_table(report)


def test_a_method_that_raises_is_reported(target, draft):
    def raises(*args, **kwargs):
        raise RuntimeError("boom")

    config = tiny_config(methods=("ours", "raises"))
    report = run_benchmark(
        config, target, None, draft, prompts=PROMPTS[:1], methods=default_methods() | {"raises": raises}
    )
    assert report.methods == ["plain", "ours"] and "boom" in report.failed_methods["raises"]
    assert not report.identical


def test_table_and_plot(report, tmp_path):
    table = render_table(report)
    for method in report.methods:
        assert method in table
    assert "identical outputs" in table and "every method ran on: toy/0, toy/1, other/0" in table
    assert "target forward over n tokens" in table and "ours_tree16: tau" in table and "speedups vs" in table
    path = save_plot(report, tmp_path / "plots" / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_draws_only_the_methods_that_measured_something():
    main = BenchmarkReport.read(RESULTS / "bench_smollm2_xeon_main.json")  # --full_comparison_limit 0
    assert len(main.methods) == 10
    assert measured_methods(main) == ["plain", "plain_stock", "plain_fast", "ours"]


def test_the_table_counts_each_other_kernel_plains_differences_apart(report):
    def difference(prompt_id, method):
        return Mismatch(
            prompt_id=prompt_id,
            method=method,
            repeat=0,
            first_difference=3,
            expected_tokens=12,
            got_tokens=12,
            expected=[1, 2],
            got=[1, 3],
        )

    differing = [difference("toy/0", STOCK_BASELINE), difference("toy/0", FAST_BASELINE)]
    differing.append(difference("toy/1", FAST_BASELINE))
    lines = render_table(dataclasses.replace(report, stock_differences=differing)).splitlines()
    assert f"{STOCK_BASELINE} differs from prepared plain on 1 prompt(s)" in "\n".join(lines)
    assert f"{FAST_BASELINE} differs from prepared plain on 2 prompt(s)" in "\n".join(lines)
    assert "identical outputs" in lines[-1]  # not failures


def _fresh_models(monkeypatch, tmp_path) -> str:
    """The CLI loads a new tiny target and drafter each time (it prepares them for the CPU, as it would real ones);
    returns the `--draft` folder it checks (a config.json) before it loads. The prompt sets need not be installed."""
    from hf_dflash import loading
    from hf_dflash.cli import bench as bench_command

    monkeypatch.setattr(loading, "load_target_and_tokenizer", lambda **arguments: (make_target("llama"), None))
    monkeypatch.setattr(
        loading, "load_draft", lambda path, target, **options: make_draft(target, block_size=4, num_hidden_layers=1)
    )
    monkeypatch.setattr(bench_command, "prompt_set_path", lambda name: None)
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    return str(tmp_path / "draft")


def test_cli_prints_json_last_and_fails_on_mismatch(monkeypatch, capsys, tmp_path):
    from hf_dflash import cli

    real_run = bench.run_benchmark
    draft = _fresh_models(monkeypatch, tmp_path)
    monkeypatch.setattr(bench, "run_benchmark", lambda *args, **kwargs: real_run(*args, prompts=PROMPTS[:1], **kwargs))
    output = tmp_path / "bench.json"
    argv = ["bench", "--draft", draft, "--max-new-tokens", "6", "--methods", "ours", "--output", str(output)]
    argv += ["--draft-block-sizes", "--batch-sizes", "--plain-threads", str(OTHER_THREADS)]
    assert cli.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(output.read_text())
    assert json.loads(last)["config"]["methods"] == ["ours"]
    assert json.loads(last)["config"]["plain_threads"] == [OTHER_THREADS]
    stock_other = plain_threads_name(OTHER_THREADS, STOCK_BASELINE)
    assert json.loads(last)["methods"] == ["plain", STOCK_BASELINE, PLAIN_OTHER, stock_other, "ours"]  # stock too
    assert output.with_suffix(".png").is_file()
    written = json.loads(output.read_text())
    assert written["conditions"]["command"].startswith("hf-dflash") and written["conditions"]["draft_path"] == draft
    assert BenchmarkReport.read(output).to_json() == written  # the CLI's own keys survive a read

    broken = dict(default_methods())
    broken["ours"] = lambda *args, **kwargs: (torch.zeros(1, 20, dtype=torch.long), None)
    monkeypatch.setattr(
        bench, "run_benchmark", lambda *args, **kwargs: real_run(*args, prompts=PROMPTS[:1], methods=broken, **kwargs)
    )
    assert cli.main(argv) == 1
    assert "OUTPUT MISMATCHES" in capsys.readouterr().out


@pytest.fixture
def bench_cli(monkeypatch, tmp_path):
    """`hf-dflash bench ...options` on a tiny target and two prompts -> (exit code, the report it wrote)."""
    from hf_dflash import cli

    real_run = bench.run_benchmark
    draft = _fresh_models(monkeypatch, tmp_path)
    monkeypatch.setattr(bench, "run_benchmark", lambda *args, **kwargs: real_run(*args, prompts=PROMPTS[:2], **kwargs))
    output = tmp_path / "bench.json"

    def run(*options: str) -> tuple[int, dict]:
        argv = ["bench", "--draft", draft, "--max-new-tokens", "6", "--methods", "ours", "--verify", "all"]
        exit_code = cli.main(argv + ["--output", str(output), *options])
        return exit_code, json.loads(output.read_text())

    return run


def test_cli_fails_when_batched_outputs_differ(bench_cli, monkeypatch, capsys):
    real_generate = benchmark.speculative_generate

    def wrong_when_batched(target, draft, input_ids, *args, **kwargs):
        out = real_generate(target, draft, input_ids, *args, **kwargs)
        if input_ids.shape[0] > 1:  # single-prompt runs (the main benchmark, batch 1) stay right
            out.sequences[-1, -1] = (out.sequences[-1, -1] + 1) % 90
        return out

    monkeypatch.setattr(benchmark, "speculative_generate", wrong_when_batched)
    exit_code, report = bench_cli("--draft-block-sizes", "--batch-sizes", "1", "2")
    assert exit_code == 1
    assert report["mismatches"] == [] and [r["identical"] for r in report["batch"]] == [True, False]
    assert not report["identical"]
    assert report["failures"] == ["batch 2: speculative_generate differs from target.generate"]
    out = capsys.readouterr()
    assert "identical outputs" not in out.out and "batch 2: speculative_generate differs" in out.err


@pytest.mark.parametrize(
    "function, options, still_identical",
    [
        ("time_draft_forward", ["--draft-block-sizes", "2", "--batch-sizes"], True),  # timing only: outputs matched
        ("measure_batch_throughput", ["--draft-block-sizes", "--batch-sizes", "2"], False),  # never compared
    ],
)
def test_cli_fails_when_a_sub_benchmark_raises(bench_cli, monkeypatch, capsys, function, options, still_identical):
    def raises(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(benchmark, function, raises)
    exit_code, report = bench_cli(*options)
    name = "draft_forward" if function == "time_draft_forward" else "batch"
    assert exit_code == 1
    assert report[name] == {"error": "RuntimeError('boom')"} and report["mismatches"] == []
    assert report["identical"] is still_identical
    assert report["failures"] == [f"{name} sub-benchmark failed: RuntimeError('boom')"]
    table = capsys.readouterr().out
    assert "identical outputs" not in table and f"{name} sub-benchmark failed" in table


def test_batches_are_padded_as_the_library_pads(draft):
    target = make_target("llama")
    target.generation_config.pad_token_id, target.generation_config.eos_token_id = None, [3, 7]  # pads with 3
    inputs = []
    target.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(kwargs["input_ids"]), with_kwargs=True)
    prompts = PROMPTS[:2]  # 8 and 5 tokens: the second row gets 3 pads
    results = measure_batch_throughput(target, draft, prompts, [2], {"max_new_tokens": 3}, progress=False)
    assert inputs[0][1, :3].tolist() == [3, 3, 3] and inputs[0][1, 3:].tolist() == PROMPTS[1].input_ids.tolist()
    assert results[0].identical


def test_an_exact_run_has_plain_on_fast_kernels_among_its_baselines(monkeypatch):
    """With `--cpu_kernels exact` plain decoding at its fastest may be fast mode's: `plain_fast` is a baseline (single
    and batched), run inside `CPUPreparation.fast`; its outputs may differ from exact plain's without failing."""
    from hf_dflash.decoding.cpu_attention import EXACT_ATTENTION
    from hf_dflash.decoding.cpu_kernels import CPUPreparation, optimize_target_and_draft_for_cpu

    target = make_target("llama")
    draft = make_draft(target, block_size=4, num_hidden_layers=1)
    preparation = optimize_target_and_draft_for_cpu(target, draft, exact=True)
    entered = []
    real_fast = CPUPreparation.fast
    monkeypatch.setattr(CPUPreparation, "fast", lambda self: entered.append(self) or real_fast(self))
    config = tiny_config(methods=("ours",), batch_sizes=(2,))
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:2], preparation=preparation)
    assert report.baselines == ["plain", STOCK_BASELINE, FAST_BASELINE]
    assert {run for runs in report.per_prompt.values() for run in runs} >= {FAST_BASELINE, "ours"}
    assert set(report.batch[0].plain_tokens_per_s_by_kernels) == {"plain", STOCK_BASELINE, FAST_BASELINE}
    assert entered and all(entry is preparation for entry in entered)
    assert report.identical and not report.failures  # exact ours matched exact plain; other plains are not judged
    assert target.config._attn_implementation == EXACT_ATTENTION  # exact mode again after every plain_fast call
    fast_prepared = optimize_target_and_draft_for_cpu(make_target("llama"), exact=False)
    assert FAST_BASELINE not in benchmark._method_table(tiny_config(), None, fast_prepared, VerifyPlanner())[1]


def test_every_plain_variant_runs_at_the_other_thread_counts(monkeypatch):
    """Plain decoding at its fastest may be fast mode's kernels at another thread count: `--plain_threads n` times each
    plain variant at `n` threads, each a baseline, on its own kernels; their outputs are judged as their kernels'."""
    from hf_dflash.bench.methods import kernels_of
    from hf_dflash.decoding.cpu_kernels import CPUPreparation, optimize_target_and_draft_for_cpu

    target = make_target("llama")
    draft = make_draft(target, block_size=4, num_hidden_layers=1)
    preparation = optimize_target_and_draft_for_cpu(target, draft, exact=True)
    fast_threads = []
    real_fast = CPUPreparation.fast
    monkeypatch.setattr(
        CPUPreparation, "fast", lambda self: fast_threads.append(torch.get_num_threads()) or real_fast(self)
    )
    config = tiny_config(methods=("ours",), plain_threads=(OTHER_THREADS,))
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:2], preparation=preparation)
    variants = ["plain", STOCK_BASELINE, FAST_BASELINE]
    assert report.baselines == variants + [plain_threads_name(OTHER_THREADS, v) for v in variants]
    assert f"{FAST_BASELINE}_threads{OTHER_THREADS}" in report.baselines
    assert set(fast_threads) == {torch.get_num_threads(), OTHER_THREADS}  # fast kernels at both counts
    assert report.identical and not report.failures
    assert [kernels_of(name) for name in report.baselines] == variants * 2
    assert kernels_of("ours") == "ours" and kernels_of("plain_threads") == "plain_threads"


def test_batch_throughput_needs_one_repeat(target, draft):
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure_batch_throughput(target, draft, PROMPTS[:1], [1], {"max_new_tokens": 2}, repeats=0, progress=False)


def test_native_and_assisted_take_their_own_paths(generator_spy, target, draft):
    config = tiny_config(methods=("native", "assisted", "prompt_lookup"))
    report = run_benchmark(config, target, None, draft, prompts=PROMPTS[:1])
    assert report.identical
    assert set(generator_spy) == {
        "DFlashTokenCandidateGenerator",
        "DFlashCandidateGenerator",
        "PromptLookupCandidateGenerator",
    }


# -- serving engines beside ours (bench.peers) -------------------------------------------------------------------------


class _FakeEngine:
    """An engine whose plain text is `"ab"` and whose DFlash text agrees with it except on prompts holding token 9."""

    name, weights = "fake", "fake.gguf"

    def __init__(self):
        self.prompts = []

    def plain(self, prompts, tokenizer, max_new_tokens):
        self.prompts += peers.rendered_texts(prompts, tokenizer)
        return [EngineRun("ab\n", max_new_tokens, 11.0 + i) for i in range(len(prompts))]

    def dflash(self, prompts, tokenizer, max_new_tokens):
        return [
            EngineRun("ax" if "9" in text else "ab", max_new_tokens, 20.0, 2.0 + len(text) % 2, draft_passes=4)
            for text in peers.rendered_texts(prompts, tokenizer)
        ]


class _DigitTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        assert not skip_special_tokens  # the engine must see the chat template's special tokens
        return " ".join(str(i) for i in ids.tolist())


def test_peer_rows_reduce_each_engine_mode_and_dataset():
    engine = _FakeEngine()
    rows = peers.measure_peers([engine], PROMPTS, _DigitTokenizer(), max_new_tokens=12)
    assert engine.prompts == [" ".join(str(i) for i in p.input_ids.tolist()) for p in PROMPTS]
    by_key = {(r.dataset, r.mode): r for r in rows}
    assert sorted(by_key) == [("other", "dflash"), ("other", "plain"), ("toy", "dflash"), ("toy", "plain")]
    toy_plain, toy_dflash = by_key["toy", "plain"], by_key["toy", "dflash"]
    assert (toy_plain.prompts, toy_plain.tokens_per_s, toy_plain.mean_accepted_length) == (3, 12.0, None)
    assert by_key["other", "plain"].tokens_per_s == 14.0  # each dataset reduces its own prompts' runs
    assert toy_dflash.agrees_with_plain == 2  # toy/1 holds token 9: its DFlash text parts from the plain one
    lengths = [2.0 + len(" ".join(str(i) for i in p.input_ids.tolist())) % 2 for p in PROMPTS[:3]]
    assert toy_dflash.mean_accepted_length == pytest.approx(sum(lengths) / 3, abs=1e-3)  # equal passes: the mean
    assert (toy_dflash.weights, toy_dflash.engine) == ("fake.gguf", "fake")


def test_peer_rows_weigh_accepted_length_by_the_engine_s_target_steps():
    plain = EngineRun("a", 10, 5.0)
    pairs = [(plain, EngineRun("a", 30, 9.0, 3.0, 10)), (plain, EngineRun("a", 10, 7.0, 1.0, 10))]
    pairs.append((plain, EngineRun("b", 40, 8.0, 2.0, 20)))
    _, dflash = peers.peer_rows("e", "w", "d", pairs)
    assert dflash.mean_accepted_length == pytest.approx((30 + 10 + 40) / 40)
    assert (dflash.tokens_per_s, dflash.agrees_with_plain) == (8.0, 2)


def test_peers_run_in_the_benchmark_and_survive_its_report(target, draft, monkeypatch, tmp_path):
    engine = _FakeEngine()
    built = []

    def fake_build(names, draft_, target_, target_gguf):
        built.append((names, target_gguf))
        return [engine], tempfile.TemporaryDirectory()

    monkeypatch.setattr(benchmark, "build_peers", fake_build)
    config = tiny_config(methods=("plain",), peers=("llama.cpp",), peer_target_gguf="t.gguf")
    report = run_benchmark(config, target, _DigitTokenizer(), draft, prompts=PROMPTS[:2])
    assert built == [(("llama.cpp",), "t.gguf")] and [r.mode for r in report.peers] == ["plain", "dflash"]
    again = BenchmarkReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again.to_json() == report.to_json() and again.peers[1].agrees_with_plain == 1
    assert "fake dflash (fake.gguf): 20.0 tok/s, accepted length" in render_table(report)

    monkeypatch.setattr(benchmark, "build_peers", lambda *args: (_ for _ in ()).throw(RuntimeError("no engine")))
    failed = run_benchmark(config, target, _DigitTokenizer(), draft, prompts=PROMPTS[:1])
    assert "no engine" in failed.peers.error and "peers sub-benchmark failed" in " ".join(failed.failures)


def test_an_engine_that_loses_runs_is_caught():
    class Short(_FakeEngine):
        def dflash(self, prompts, tokenizer, max_new_tokens):
            return super().dflash(prompts, tokenizer, max_new_tokens)[:-1]

    with pytest.raises(RuntimeError, match="answered 4 / 3 runs for 4 prompts"):
        peers.measure_peers([Short()], PROMPTS, _DigitTokenizer(), max_new_tokens=12)


def test_the_openvino_peer_runs_token_ids_with_an_f32_kv_cache_and_counts_drafted_steps(monkeypatch):
    from hf_dflash.engines.openvino import OpenVinoRun

    calls = []

    def fake_run(ir, prompts, **kwargs):
        calls.append((ir, prompts, kwargs))
        return [OpenVinoRun([1, 2, 3, 4, 5], "text", 5, 3, [1, 2, 2], 2, 40.0) for _ in prompts]

    monkeypatch.setattr(peers.openvino, "run_openvino", fake_run)
    engine = peers.OpenVinoPeer(Path("ir"), block_size=8)
    (plain,) = engine.plain(PROMPTS[:1], None, 5)
    (dflash,) = engine.dflash(PROMPTS[:1], None, 5)
    assert calls[0][1] == [PROMPTS[0].input_ids.tolist()] and calls[1][2]["with_draft"]
    assert calls[1][2]["block_size"] == 8
    assert calls[1][2]["properties"] == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    assert (plain.mean_accepted_length, plain.draft_passes) == (None, None)
    assert (dflash.mean_accepted_length, dflash.draft_passes, dflash.tokens_per_s) == (2.0, 2, 40.0)


def test_peer_engines_refuse_what_they_cannot_run(target, draft):
    with pytest.raises(ValueError, match="Unknown peer engine"):
        peers.build_peers(["vllm"], draft, target, None)
    with pytest.raises(ValueError, match="OpenVINO's exporter reads the target's own folder"):
        peers.build_peers(["openvino"], draft, target, None)
    with pytest.raises(ValueError, match="--peer_target_gguf"):
        peers.build_peers(["llama.cpp"], draft, target, None)
    with pytest.raises(ValueError, match="load the target from a local folder"):
        peers.llama_cpp_peer(draft, target, "t.gguf", "unused")  # an in-memory model has no folder to convert


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["llama.cpp", "openvino"])
def test_peer_rows_for_the_committed_drafter(engine):
    """`hf-dflash bench --peers ENGINE` on one GSM8K prompt: the engine runs the target plain and with the committed
    drafter at a real accepted length. Whether its DFlash text agrees with its plain text is recorded, not asserted:
    llama.cpp's multi-token forwards differ from its one-token ones in the last bits (its n-gram speculation parts from
    plain text as often, `benchmarks/results/engine_parity_llama_cpp.json`)."""
    from hf_dflash import loading
    from hf_dflash.engines import llama_cpp, openvino
    from hf_dflash.targets import locate_gguf

    try:
        llama_cpp.find_llama_cpp().tool(
            "llama-speculative-simple"
        ) if engine == "llama.cpp" else openvino.find_openvino()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    name = "smollm2-135m-instruct"
    target, tokenizer = loading.load_target_and_tokenizer(name, device="cpu", dtype="float32")
    draft = loading.load_draft(loading.committed_drafter(name), target)
    prompts = load_benchmark_prompts(tokenizer, ["gsm8k:1"], None)
    engines, folder = peers.build_peers([engine], draft, target, locate_gguf(name))
    with folder:
        plain, dflash = peers.measure_peers(engines, prompts, tokenizer, max_new_tokens=64)
    assert plain.tokens_per_s > 0 and dflash.tokens_per_s > 0 and dflash.mean_accepted_length > 1.2
    assert (plain.mode, dflash.mode, dflash.prompts, dflash.agrees_with_plain in (0, 1)) == (
        "plain",
        "dflash",
        1,
        True,
    )
