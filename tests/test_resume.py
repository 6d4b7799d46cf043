"""`hf-dflash train` survives SIGKILL: a run killed after a checkpoint and resumed from it ends with the drafter an
uninterrupted run ends with, and checkpoints hold the draft (weights, optimizer) and nothing of the frozen target.

Marked slow: every run is a `python -m hf_dflash.cli train` subprocess (about 10 s each, mostly start-up). The runs
are sized so the kill cannot race the end of training: 30 steps of about 70 ms and a kill as soon as checkpoint-6 is
complete leave about 2 s of training the poller (every 5 ms) would have to sleep through; if it ever did, the test
fails saying so instead of comparing two uninterrupted runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import PAD, save_target_and_records
from safetensors.torch import load_file

from hf_dflash import DFlashForDrafting

pytestmark = pytest.mark.slow

MAX_STEPS = 30
SAVE_STEPS = 3  # 10 training sequences, batch 2: 5 steps an epoch, so checkpoint-6 (the kill point) is mid-epoch
KILL_AFTER_STEP = 6
NUM_RECORDS = 12  # 10 train + 2 held out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A saved tiny Llama target and JSONL of its own greedy continuations, as `hf-dflash data` writes them."""
    root = tmp_path_factory.mktemp("resume")
    save_target_and_records(root, NUM_RECORDS, new_tokens=24)
    return root


def train_command(workspace: Path, output_dir: Path, *extra: str) -> list[str]:
    """The same training every time (fixed seed), with the held-out real tau measured along the way: its callback
    runs the speculative loop between steps, which must not disturb what a resumed run computes."""
    command = [sys.executable, "-m", "hf_dflash.cli", "train", "--data", str(workspace / "data.jsonl")]
    command += ["--target", str(workspace / "target"), "--output_dir", str(output_dir), "--seed", "7"]
    command += ["--max_steps", str(MAX_STEPS), "--block_size", "4", "--mask_token_id", str(PAD)]
    command += ["--num_anchors", "4"]  # of 23 candidates: each epoch draws other anchors, the resumed run must too
    command += ["--per_device_train_batch_size", "2", "--dataloader_num_workers", "0", "--acceptance_holdout", "2"]
    command += ["--save_strategy", "steps", "--save_steps", str(SAVE_STEPS), "--logging_steps", "1"]
    command += ["--real_acceptance_steps", "5", "--real_acceptance_max_new_tokens", "16"]
    command += ["--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true"]
    return command + list(extra)


def run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"trained {MAX_STEPS} steps") == 1, result.stdout
    return result


def complete_checkpoints(output_dir: Path) -> dict[int, Path]:
    """Checkpoints whose `trainer_state.json` (the Trainer writes it last) is there and whole, by step."""
    found = {}
    for folder in output_dir.glob("checkpoint-*"):
        try:
            state = json.loads((folder / "trainer_state.json").read_text())
        except (OSError, ValueError):  # not written yet, or caught mid-write
            continue
        found[state["global_step"]] = folder
    return found


@pytest.fixture(scope="module")
def uninterrupted(workspace) -> Path:
    output_dir = workspace / "uninterrupted"
    run(train_command(workspace, output_dir))
    return output_dir


@pytest.fixture(scope="module")
def killed(workspace) -> Path:
    """An output folder whose training got SIGKILL once checkpoint-6 or later was complete, before the end."""
    output_dir = workspace / "killed"
    log = (workspace / "killed.log").open("w")
    process = subprocess.Popen(train_command(workspace, output_dir), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        if max(complete_checkpoints(output_dir), default=0) >= KILL_AFTER_STEP:
            process.kill()
            break
        time.sleep(0.005)
    else:
        process.kill()
        process.wait()
        pytest.fail(f"the training ended (exit {process.returncode}) before it could be killed; see {log.name}")
    assert process.wait() == -9
    log.close()
    latest = max(complete_checkpoints(output_dir))
    assert KILL_AFTER_STEP <= latest < MAX_STEPS  # killed mid-run ...
    assert not (output_dir / "model.safetensors").exists()  # ... before the final save
    return output_dir


def resume(workspace: Path, killed: Path, tmp_path: Path, how: str) -> Path:
    """Resume a copy of the killed run the way a user would type it: `path` (the latest complete checkpoint) or
    `true`."""
    output_dir = tmp_path / "resumed"
    shutil.copytree(killed, output_dir)
    checkpoints = complete_checkpoints(output_dir)
    value = str(checkpoints[max(checkpoints)]) if how == "path" else how
    result = run(train_command(workspace, output_dir, "--resume_from_checkpoint", value))
    assert f"global step {max(checkpoints)}" in result.stderr  # the Trainer's "Resuming training from checkpoint"
    return output_dir


def assert_same_training(resumed: Path, uninterrupted: Path) -> None:
    expected, got = load_file(uninterrupted / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    states = [
        json.loads((folder / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
        for folder in (uninterrupted, resumed)
    ]
    assert states[0]["global_step"] == states[1]["global_step"] == MAX_STEPS
    losses = [{entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry} for state in states]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)  # every step's loss, before and after the kill
    infos = [
        json.loads((folder / "training_info.json").read_text())["training"] for folder in (uninterrupted, resumed)
    ]
    assert infos[0]["steps"] == infos[1]["steps"] == MAX_STEPS
    assert infos[0]["epochs"] == infos[1]["epochs"]
    assert infos[1]["held_out_tau_by_step"] == infos[0]["held_out_tau_by_step"]  # the taus before the kill too
    assert len(infos[0]["held_out_tau_by_step"]) == MAX_STEPS // 5
    # The resumed run's times count its own steps only, and its card says from where.
    assert "resumed_from_step" not in infos[0]
    assert KILL_AFTER_STEP <= infos[1]["resumed_from_step"] < MAX_STEPS
    card = (resumed / "README.md").read_text()
    assert f"| Resumed from step (wall and CPU time count from there) | {infos[1]['resumed_from_step']} |" in card


def test_sigkilled_training_resumed_from_its_latest_checkpoint_ends_with_the_same_drafter(
    workspace, uninterrupted, killed, tmp_path
):
    assert_same_training(resume(workspace, killed, tmp_path, "path"), uninterrupted)


def test_resume_from_checkpoint_true_resumes_the_latest_checkpoint(workspace, uninterrupted, killed, tmp_path):
    assert_same_training(resume(workspace, killed, tmp_path, "true"), uninterrupted)


def test_checkpoints_hold_the_draft_only(workspace, uninterrupted):
    draft = DFlashForDrafting.from_pretrained(uninterrupted)  # the module's own parameter names and shapes
    target_weights = load_file(workspace / "target" / "model.safetensors")
    draft_bytes = sum(t.numel() * t.element_size() for t in draft.state_dict().values())
    embedding_bytes = target_weights["model.embed_tokens.weight"].numel() * 4
    for folder in [uninterrupted, *complete_checkpoints(uninterrupted).values()]:
        saved = load_file(folder / "model.safetensors")
        assert set(saved) == set(draft.state_dict())
        assert not set(saved) & set(target_weights)
        assert not any("embed" in name or "lm_head" in name for name in saved)
        size = (folder / "model.safetensors").stat().st_size  # the tensors plus a JSON header of their names
        assert draft_bytes <= size < draft_bytes + min(embedding_bytes, 16_384)
    checkpoint = complete_checkpoints(uninterrupted)[MAX_STEPS]
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    moments = [state["exp_avg"] for state in optimizer["state"].values()]
    trainable = [p for p in draft.parameters() if p.requires_grad]
    assert sorted(m.numel() for m in moments) == sorted(p.numel() for p in trainable)  # no target parameter
    files = [path for path in checkpoint.rglob("*") if path.suffix != ".py"]  # the remote code is a fixed ~110 KB
    assert sum(path.stat().st_size for path in files) < 4 * draft_bytes  # weights + 2 moments + ...
    assert (checkpoint / "rng_state.pth").exists()  # what makes the resumed run draw the same batches
