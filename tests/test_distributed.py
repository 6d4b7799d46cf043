"""`hf-dflash train` under two data-parallel CPU processes (torch.distributed with gloo, as `accelerate launch` or
`torchrun` starts it). Marked slow: it starts two Python processes."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import PAD, make_target

from hf_dflash import DFlashForDrafting

pytestmark = pytest.mark.slow


def test_two_process_ddp_training_runs_and_saves_one_drafter(tmp_path):
    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(8):
        prompt = torch.randint(0, PAD - 1, (1, 6), generator=generator)
        with torch.no_grad():
            ids = target.generate(prompt, max_new_tokens=16, do_sample=False)[0].tolist()
        lines.append(json.dumps({"id": f"t/{i}", "input_ids": ids, "loss_mask": [0] * 6 + [1] * 16, "prompt_len": 6}))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hf_dflash.cli", "train"]
    command += ["--data", str(tmp_path / "data.jsonl"), "--target", str(tmp_path / "target")]
    command += ["--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--block_size", "4"]
    command += ["--mask_token_id", str(PAD), "--acceptance_holdout", "2", "--per_device_train_batch_size", "2"]
    command += ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("trained 3 steps") == 1  # the summary comes from the main process only
    info = json.loads((tmp_path / "out" / "training_info.json").read_text())
    assert info["training"]["steps"] == 3
    DFlashForDrafting.from_pretrained(tmp_path / "out")
