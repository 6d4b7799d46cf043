"""What a newcomer meets when something is wrong: one line, `hf-dflash <command>: error: <problem>. <fix>`, exit status 2,
before any model loads; and help that answers without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dflash import cli, loading, targets
from hf_dflash.cli import bench as bench_command
from hf_dflash.cli.errors import UsageError
from hf_dflash.offline import KNOWN_PROMPT_SETS, KNOWN_TARGETS

REPOSITORY = Path(__file__).resolve().parents[1]
DRAFTER = str(REPOSITORY / "drafters" / "smollm2-135m-instruct")  # a folder with config.json: checked, never loaded


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every way a command loads a model fails the test: an error must come before any of them."""

    def loaded(*args, **kwargs):
        pytest.fail("a model was loaded before the error")

    for name in ("load_target_and_tokenizer", "load_target_from_arguments", "load_draft"):
        monkeypatch.setattr(loading, name, loaded)
    monkeypatch.setattr(loading, "load_tokenizer_and_generation_config", loaded)
    monkeypatch.setattr(targets, "converted_target_folder", loaded)
    return loaded


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """Files the error cases point at: a model folder, a folder without config.json, a file, prompts files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file.txt").write_text("not a model")
    lines = {
        "empty_prompt.jsonl": ['{"prompt": ""}'],
        "blank_prompt.jsonl": ['{"prompt": "What is 2 + 2?"}', '{"prompt": " \\t "}'],
        "no_user_turn.jsonl": ['{"prompt": "ok"}', '{"messages": [{"role": "assistant", "content": "Hello"}]}'],
        "empty_user_turn.jsonl": [
            '{"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": ""}]}'
        ],
        "no_prompt_field.jsonl": ['{"text": "no prompt"}'],
        "bad_records.jsonl": ['{"id": "a", "input_ids": [1, 2], "loss_mask": [0]}'],
    }
    for name, content in lines.items():
        (tmp_path / name).write_text("\n".join(content) + "\n")
    return tmp_path


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.err


def assert_one_line_error(code: int, err: str, command: str, *expected: str) -> None:
    assert code == 2
    assert err.endswith("\n") and len(err.splitlines()) == 1, err
    assert err.startswith(f"hf-dflash {command}: error: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, (text, err)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["demo", "--target", "not-a-model"], ["unknown target 'not-a-model'", *KNOWN_TARGETS]),
        (
            ["demo", "--target", "smollm2-135m", "--untrained"],
            ["unknown target", "Did you mean 'smollm2-135m-instruct'"],
        ),
        (["demo", "--target", "./no-such-folder", "--untrained"], ["Target folder './no-such-folder' does not exist"]),
        (["demo", "--target", "a_file.txt", "--untrained"], ["is a file, not a model folder"]),
        (["demo", "--target", "empty", "--untrained"], ["holds no config.json"]),
        (["demo", "--target", "smollm2-135m-instruct", "--revision", "main"], ["no Hub revision"]),
        (["demo", "--draft", "./no-such-drafter"], ["--draft", "Drafter folder './no-such-drafter' does not exist"]),
        (["demo", "--prompt", "  ", "--untrained"], ["--prompt is empty"]),
        (["demo", "--max_new_tokens", "0"], ["--max_new_tokens", "must be at least 1"]),
        (["demo", "--dtype", "fp8"], ["invalid choice: 'fp8'", "bfloat16"]),
        (["demo", "--untrained", "--trust_remote_code", "maybe"], ["expected true or false"]),
        (["demo", "--debug"], ["--debug goes before the command"]),
        (
            ["bench", "--draft", DRAFTER, "--datasets", "nosuchset:3"],
            ["unknown prompt set 'nosuchset'", *KNOWN_PROMPT_SETS],
        ),
        (["bench", "--draft", DRAFTER, "--datasets", "gsm8k:0"], ["asks for no prompts"]),
        (["bench", "--draft", DRAFTER, "--datasets", "gsm8k:x"], ["N in NAME:N is a number"]),
        (["bench", "--draft", DRAFTER, "--methods", "fast"], ["invalid choice: 'fast'"]),
        (["bench", "--draft", DRAFTER, "--output", "model"], ["--output: model is a folder"]),
        (["bench", "--draft", DRAFTER, "--output", "a_file.txt/report.json"], ["which is a file"]),
        (["bench", "--draft", "not-a-drafter"], ["unknown drafter 'not-a-drafter'"]),
        (["bench", "--draft", DRAFTER, "--temperature", "0.7"], ["--temperature", "add --do_sample"]),
        (["bench", "--draft", DRAFTER, "--do_sample", "--temperature", "0"], ["--temperature must be above 0"]),
        (["bench", "--draft", DRAFTER, "--do_sample", "--top_p", "1.5"], ["--top_p must be in (0, 1]"]),
        (["bench"], ["the following arguments are required: --draft"]),
        (["data", "--source", "missing.jsonl", "--output", "o.jsonl"], ["--source: missing.jsonl does not exist"]),
        (["data", "--source", "gsm8k", "--output", "o.jsonl"], ["'gsm8k' is an evaluation set"]),
        (["data", "--source", "wiki", "--output", "o.jsonl"], ["Unknown training source 'wiki'"]),
        (["data", "--source", "synthetic", "--server_url", "http://x", "--output", "o.jsonl"], ["needs the target"]),
        (["data", "--source", "math500", "--output", "model"], ["--output: model is a folder"]),
        (["data", "--source", "math500", "--output", "o.jsonl", "--target", "not-a-model"], ["unknown target"]),
        (["data", "--source", "math500", "--output", "o.jsonl", "--server_extra_body", "[1]"], ["a JSON object"]),
        (["export", "--draft", DRAFTER, "--engine", "tgi", "--output", "out"], ["invalid choice: 'tgi'"]),
        (["export", "--draft", DRAFTER, "--engine", "vllm", "--output", "a_file.txt"], ["is a file"]),
        (
            ["export", "--draft", DRAFTER, "--engine", "llama.cpp", "--target", "model", "--output", "o"],
            ["--target_gguf"],
        ),
        (["card", "no-such-folder"], ["DIR: no-such-folder does not exist"]),
        (["card", "model", "--acceptance_json", "missing.json"], ["--acceptance_json: missing.json does not exist"]),
    ],
)
def test_a_user_error_is_one_line_and_comes_before_any_model_loads(argv, expected, workspace, nothing_loads, capsys):
    code, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, argv[0], *expected)


@pytest.mark.parametrize(
    "name, line, problem",
    [
        ("empty_prompt.jsonl", 1, "the user turn is empty or only whitespace"),
        ("blank_prompt.jsonl", 2, "the user turn is empty or only whitespace"),
        ("no_user_turn.jsonl", 2, "no user turn to answer"),
        ("empty_user_turn.jsonl", 1, "the user turn is empty or only whitespace"),
        ("no_prompt_field.jsonl", 1, "a prompt line needs a 'messages' list or a 'prompt' string"),
    ],
)
def test_data_refuses_a_prompts_file_line_without_text_by_file_and_line(
    name, line, problem, workspace, nothing_loads, capsys
):
    output = workspace / "records.jsonl"
    code, err = run_cli(["data", "--source", name, "--output", str(output)], capsys)
    assert_one_line_error(code, err, "data", f"{name}:{line}: {problem}")
    assert not output.exists()  # nothing was written


def test_data_refuses_an_evaluation_set_that_is_not_installed_before_loading(
    workspace, nothing_loads, monkeypatch, capsys
):
    import dataclasses

    from hf_dflash import offline

    spec = offline.KNOWN_PROMPT_SETS["gsm8k"]
    monkeypatch.setitem(offline.KNOWN_PROMPT_SETS, "gsm8k", dataclasses.replace(spec, module="hf_dflash_not_here"))
    (workspace / "good.jsonl").write_text('{"prompt": "What is 2 + 2?"}\n')
    code, err = run_cli(["data", "--source", "good.jsonl", "--output", "o.jsonl"], capsys)
    assert_one_line_error(code, err, "data", "gsm8k", "--unfiltered_evaluation_set gsm8k")


@pytest.fixture
def records(workspace):
    """Six good records in `data.jsonl`: `hf-dflash train` would train on them, but for what each case changes."""
    lines = [{"id": f"r{i}", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]} for i in range(6)]
    (workspace / "data.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"--data": "missing.jsonl"}, ["--data: missing.jsonl does not exist"]),
        ({"--data": "bad_records.jsonl"}, ["bad_records.jsonl:1"]),
        ({"--target": "not-a-model"}, ["unknown target 'not-a-model'"]),
        ({"--init_draft": "./no-such-drafter"}, ["--init_draft", "does not exist"]),
        ({"--block_size": "1"}, ["block_size must be at least 2"]),
        ({"--acceptance_holdout": "6"}, ["too few to hold out 6"]),
        ({"--output_dir": "a_file.txt"}, ["--output_dir: a_file.txt is a file"]),
        ({"--resume_from_checkpoint": "true"}, ["holds no complete checkpoint"]),
        ({"--init_draft": DRAFTER, "--draft_init": "target"}, ["drop one of them"]),
        ({"--no_such_flag": "1"}, ["unrecognized arguments: --no_such_flag 1"]),
    ],
)
def test_train_errors_are_one_line_and_come_before_any_model_loads(
    change, expected, records, nothing_loads, monkeypatch, capsys
):
    from hf_dflash.training import script

    monkeypatch.setattr(script, "load_target_from_arguments", nothing_loads)
    flags = {"--data": "data.jsonl", "--target": "model", "--output_dir": "out", "--report_to": "none"} | change
    code, err = run_cli(["train", *[part for flag in flags.items() for part in flag]], capsys)
    assert_one_line_error(code, err, "train", *expected)


def test_debug_before_the_command_shows_the_traceback(workspace, nothing_loads):
    with pytest.raises(UsageError, match="unknown target 'not-a-model'"):
        cli.main(["--debug", "demo", "--target", "not-a-model"])


def test_a_truncated_weights_file_is_one_line_naming_it(tmp_path, capsys):
    from helpers import make_target

    make_target("llama").save_pretrained(tmp_path / "target")
    weights = tmp_path / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()  # save_pretrained's progress bars
    code, err = run_cli(["demo", "--target", str(tmp_path / "target"), "--untrained"], capsys)
    assert_one_line_error(code, err, "demo", f"Target weights file {weights} is truncated or corrupt", "save it again")


def test_an_uncached_hub_id_is_asked_about_when_the_hub_is_online(monkeypatch, nothing_loads, capsys):
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    asked = []

    def repo_info(self, name, **kwargs):
        asked.append(name)
        raise RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # what the Hub answers for no such model

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", repo_info)
    code, err = run_cli(["demo", "--target", "smollm2-135m", "--untrained"], capsys)
    assert asked == ["smollm2-135m"]
    assert_one_line_error(code, err, "demo", "unknown target 'smollm2-135m'", "the Hub has", "smollm2-135m-instruct")

    def no_network(self, name, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)  # cannot ask: loading will say what is wrong
    with pytest.raises(pytest.fail.Exception, match="a model was loaded"):
        cli.main(["demo", "--target", "someone/some-model", "--untrained"])


def test_bench_help_lists_every_prompt_set_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    printed = capsys.readouterr().out
    epilog = printed[printed.index("prompt sets (--datasets):") :]
    for name, spec in KNOWN_PROMPT_SETS.items():
        assert f"  {name} " in epilog and spec.pip in epilog
    assert bench_command.prompt_sets_epilog() in printed


def test_every_flag_states_its_default_once(capsys):
    shown = {}
    for command in ("demo", "data", "bench", "export", "card"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        shown[command] = " ".join(capsys.readouterr().out.split())  # one line: a default may wrap
        for flag_help in shown[command].split(" --")[1:]:  # a flag's help, or part of it
            assert flag_help.lower().count("default") <= 1, (command, flag_help)
    assert "--limit LIMIT prompts per dataset (default: 10)" in shown["bench"]  # BenchmarkConfig's default
    assert "--max_new_tokens MAX_NEW_TOKENS tokens generated per prompt on each path (default: 200)" in shown["bench"]
    assert "--seed SEED seed of the sampling and of the synthetic prompts (default: 0)" in shown["data"]
    assert "--untrained [BOOL] use a fresh, untrained drafter" in shown["demo"] and "(default: false)" in shown["demo"]


def test_building_every_parser_imports_neither_torch_nor_transformers():
    script = (
        "import sys\n"
        "from hf_dflash import cli\n"
        "from hf_dflash.cli.flags import FlagParser\n"
        "cli.make_parser().format_help()\n"
        "subparsers = FlagParser(prog='hf-dflash').add_subparsers()\n"
        "helps = {name: module.make_parser(subparsers).format_help() for name, module in cli.COMMANDS.items()}\n"
        "assert '--datasets' in helps['bench'] and '--source' in helps['data'], helps\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets', 'safetensors') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("value, expected", [([], True), (["true"], True), (["false"], False), (["no"], False)])
def test_a_boolean_flag_is_spelled_alike_in_train_and_every_other_command(value, expected):
    from hf_dflash.cli.flags import FlagParser, add_target_flags, target_arguments
    from hf_dflash.training.script import parse_train_args

    parser = FlagParser()
    add_target_flags(parser)
    assert target_arguments(parser.parse_args(["--trust_remote_code", *value])).trust_remote_code is expected
    script, _ = parse_train_args(["--data", "d.jsonl", "--output_dir", "out", "--trust_remote_code", *value])
    assert script.trust_remote_code is expected
