"""`hf_dflash.cli`: one module per command behind `main`, each command's help, and the flags `train` hands on."""

import argparse
from pathlib import Path

import pytest
import torch
from helpers import make_draft, make_target

from hf_dflash import cli, loading, offline
from hf_dflash.bench import paths
from hf_dflash.cli import demo, train

REPOSITORY = Path(__file__).resolve().parents[1]


def test_every_command_is_a_module_with_make_parser_and_run():
    subparsers = argparse.ArgumentParser().add_subparsers()
    for name, module in cli.COMMANDS.items():
        assert callable(module.run) and module.__name__ == f"hf_dflash.cli.{name}"
        assert module.make_parser(subparsers).prog.endswith(f" {name}")
    assert sorted(subparsers.choices) == sorted(cli.COMMANDS) == ["bench", "card", "data", "demo", "export", "train"]


@pytest.mark.parametrize("command", [[], ["demo"], ["data"], ["bench"], ["card"], ["train"], ["export"]])
def test_every_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    if command:
        assert printed.startswith(f"usage: hf-dflash {command[0]} ")
    else:
        assert all(name in printed for name in cli.COMMANDS)
    if command == ["train"]:  # HfArgumentParser's help: DFlash's flags by group first, then TrainingArguments'
        flags = ("\n  --target ", "\n  --data ", "\n  --block_size ", "\n  --per_device_train_batch_size ")
        order = [printed.index(flag) for flag in flags]
        assert order == sorted(order) and printed.index("\ntransformers' TrainingArguments:") > order[2]
        assert "--trust_remote_code [BOOL]" in printed  # a boolean is spelled as in every other command


def test_train_gets_its_flags_as_given_and_other_commands_refuse_unknown_ones(monkeypatch, capsys):
    received = []
    monkeypatch.setattr(train, "run", lambda args: received.append(args.unparsed_flags) or 7)
    flags = ["--data", "d.jsonl", "--seed", "-3", "positional", "--lr_scheduler_kwargs={'a': 1}", "--use_cpu", "true"]
    assert cli.main(["train", *flags]) == 7
    assert received == [flags]
    assert cli.main(["card", "folder", "--learning_rate", "1"]) == 2
    assert "hf-dflash card: error: unrecognized arguments: --learning_rate 1" in capsys.readouterr().err


def test_committed_drafter_is_found_in_the_checkout_and_not_in_an_install(monkeypatch, tmp_path):
    assert offline.committed_drafter("smollm2-135m-instruct") == str(REPOSITORY / "drafters" / "smollm2-135m-instruct")
    assert offline.committed_drafter("no-such-target") is None
    installed = tmp_path / "lib" / "python3" / "site-packages" / "hf_dflash" / "offline.py"
    monkeypatch.setattr(offline, "__file__", str(installed))
    assert offline.committed_drafter("smollm2-135m-instruct") is None


def test_demo_without_a_drafter_says_how_to_name_one_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(demo, "committed_drafter", lambda target: None)
    monkeypatch.setattr(loading, "load_target_from_arguments", lambda arguments: pytest.fail("loaded a target"))
    assert cli.main(["demo"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"hf-dflash demo: error: no committed drafter for target {loading.DEFAULT_TARGET} in ")
    assert "drafters/ folder" in error and "Pass --draft DIR" in error and len(error.splitlines()) == 1


@pytest.mark.parametrize("planned", [False, True])
def test_compare_decoding_paths_times_three_paths_that_agree(planned):
    from hf_dflash import VerifyCosts, VerifyPlanner

    target = make_target("llama")
    draft = make_draft(target, block_size=4, num_hidden_layers=1)
    prompt = torch.tensor([[1, 5, 9, 14, 3]])
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    planner = VerifyPlanner(costs=VerifyCosts(verify=(1.0, 1.5, 2.0, 2.5), draft=0.1)) if planned else None
    comparison = paths.compare_decoding_paths(target, draft, inputs, max_new_tokens=12, planner=planner)
    assert set(comparison.seconds) == {paths.PLAIN, paths.ASSISTED, paths.OURS}
    assert comparison.prompt_len == 5 and comparison.new_tokens == 12
    assert comparison.identical and comparison.stats.tau >= 1
    summary = comparison.summary()
    assert summary["identical"] is True and summary["new_tokens"] == 12
    assert summary[paths.OURS] == round(12 / comparison.seconds[paths.OURS], 2)
    comparison.sequences[paths.OURS] = comparison.sequences[paths.OURS].clone()
    comparison.sequences[paths.OURS][0, -1] += 1
    assert not comparison.identical


def test_train_help_is_rendered_once_then_read_from_its_cache_without_torch(tmp_path, monkeypatch, capsys):
    import os
    import subprocess
    import sys

    from hf_dflash.cli import main
    from hf_dflash.cli import train as train_command

    monkeypatch.setenv("HF_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    rendered = capsys.readouterr().out
    assert rendered == train_command.train_parser().format_help() and "--selector_rank" in rendered
    cache = train_command.train_help_cache()
    assert cache.read_text() == rendered
    script = (
        "import sys\nfrom hf_dflash.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'the cached help imported them'\n"
    )
    env = {**os.environ, "HF_DFLASH_CACHE": str(tmp_path), "COLUMNS": "100"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == rendered
    monkeypatch.setattr(train_command, "_installed_version", lambda name: "another")
    assert train_command.train_help_cache() != cache  # another transformers renders other flags: another file
