"""Files written whole or not at all (`hf_dflash.atomic_files`) and the writers that go through it."""

import os
import stat

import pytest
import torch

from hf_dflash.atomic_files import atomic_path, created_mode, write_text_atomic
from hf_dflash.data.prompts import Prompt
from hf_dflash.data.sources import prompts_from_jsonl, write_prompts_jsonl
from hf_dflash.training.target_features import _write


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_write_text_atomic_replaces_the_file_with_the_mode_open_gives(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_text_atomic(path, "first\n")
    write_text_atomic(path, "second\n")
    plain = tmp_path / "plain.json"
    plain.write_text("x")
    assert path.read_text() == "second\n"
    assert _mode(path) == _mode(plain) == created_mode()  # not mkstemp's private 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "training_info.json"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(path) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["training_info.json"]


def test_two_writers_of_one_destination_get_their_own_temporary_files(tmp_path):
    path = tmp_path / "features.safetensors"
    with atomic_path(path) as first, atomic_path(path) as second:
        assert first != second
        first.write_text("first")
        second.write_text("second")
    assert path.read_text() == "first"  # the outer block ends last and wins, whole
    assert [p.name for p in tmp_path.iterdir()] == ["features.safetensors"]


def test_prompt_file_is_untouched_when_writing_prompts_fails_midway(tmp_path):
    path = tmp_path / "prompts.jsonl"
    old = [Prompt(id="a", dataset="mine", messages=[{"role": "user", "content": "hello"}])]
    write_prompts_jsonl(old, path)

    def prompts():
        yield Prompt(id="b", dataset="mine", messages=[{"role": "user", "content": "new"}])
        raise ValueError("a bad row")

    with pytest.raises(ValueError, match="a bad row"):
        write_prompts_jsonl(prompts(), path)
    assert [p.id for p in prompts_from_jsonl(path)] == ["a"]
    assert [p.name for p in tmp_path.iterdir()] == ["prompts.jsonl"]


def test_feature_cache_leaves_nothing_when_saving_fails(tmp_path, monkeypatch):
    from hf_dflash.training import target_features

    def failing_save(tensors, filename):
        with open(filename, "wb") as file:
            file.write(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(target_features, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        _write({"features": torch.zeros(3, 4)}, tmp_path / "cache" / "abc.safetensors")
    assert list((tmp_path / "cache").iterdir()) == []
