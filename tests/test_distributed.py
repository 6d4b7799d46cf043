"""`hf-dflash train` under two data-parallel CPU processes (torch.distributed with gloo), started by `torchrun` and by
`accelerate launch` with configs/accelerate/cpu_2proc.yaml; and the accelerate config files we ship, read by
accelerate's own loader. The launches are marked slow: each starts three Python processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PAD, save_target_and_records

from hf_dflash import DFlashForDrafting
from hf_dflash.model import modeling_dflash

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
NUM_RECORDS, HELD_OUT, BATCH = 8, 2, 2  # 6 training sequences, 2 per process and step


def train_flags(folder: Path) -> list[str]:
    flags = ["--data", str(folder / "data.jsonl"), "--target", str(folder / "target")]
    flags += ["--output_dir", str(folder / "out"), "--max_steps", "3", "--block_size", "4"]
    flags += ["--mask_token_id", str(PAD), "--acceptance_holdout", str(HELD_OUT)]
    flags += ["--per_device_train_batch_size", str(BATCH)]
    return flags + ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]


def assert_trained_on_two_processes(folder: Path, result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("trained 3 steps") == 1  # the summary comes from the main process only
    info = json.loads((folder / "out" / "training_info.json").read_text())["training"]
    assert info["steps"] == 3
    # 6 sequences at 2 per process: 2 steps an epoch with two processes (4 sequences a step, the last one padded by
    # the distributed sampler), 3 with one; a launch that quietly started a single process ends at epoch 1.0.
    assert info["epochs"] == 1.5
    DFlashForDrafting.from_pretrained(folder / "out")


@pytest.mark.slow
def test_two_process_ddp_training_runs_and_saves_one_drafter(tmp_path):
    save_target_and_records(tmp_path, NUM_RECORDS, new_tokens=16)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "hf_dflash.cli", "train", *train_flags(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert_trained_on_two_processes(tmp_path, result)


@pytest.mark.slow
def test_accelerate_launch_with_the_cpu_config_trains_on_two_processes(tmp_path):
    """What a user types, with the config file we ship (`accelerate launch --cpu` would start one process)."""
    save_target_and_records(tmp_path, NUM_RECORDS, new_tokens=16)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml")]
    command += ["-m", "hf_dflash.cli", "train", *train_flags(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert_trained_on_two_processes(tmp_path, result)
    assert "Total train batch size (w. parallel, distributed & accumulation) = 4" in result.stderr


def launch_arguments(config_file: Path):
    """The arguments `accelerate launch --config_file config_file` runs with: accelerate's own merge of the file
    into its command line (private, but it is what the command calls first)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    return _validate_launch_command(args)[0]


@pytest.mark.parametrize("name", ["cpu_2proc.yaml", "multi_gpu.yaml", "fsdp.yaml"])
def test_accelerate_configs_load_with_accelerate(name, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    config = load_config_from_file(str(CONFIGS / name))  # raises on a key accelerate does not know
    assert config.num_machines == 1 and config.main_process_port == 0
    args = launch_arguments(CONFIGS / name)
    assert args.multi_gpu or args.use_fsdp  # the torchrun launcher: num_processes processes, not one
    assert not args.cpu
    env = prepare_multi_gpu_env(args)
    assert args.nproc_per_node == str(config.num_processes)
    assert env["ACCELERATE_MIXED_PRECISION"] == ("no" if name == "cpu_2proc.yaml" else "bf16")
    # An fsdp_config key becomes the launch flag of its name (fsdp_ prefixed) and the processes' FSDP_* variable;
    # accelerate silently ignores one it has no flag for, so a misspelt key would do nothing.
    flags = {action.dest for action in launch_command_parser()._actions}
    assert not {key if key.startswith("fsdp_") else f"fsdp_{key}" for key in config.fsdp_config} - flags
    if name != "fsdp.yaml":
        assert "ACCELERATE_USE_FSDP" not in env
        return
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # what each process builds from them; raises on a bad value
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["DFlashDecoderLayer"]
    assert issubclass(getattr(modeling_dflash, plugin.transformer_cls_names_to_wrap[0]), torch.nn.Module)
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"  # Trainer.save_model writes model.safetensors
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "false"  # else ranks > 0 load the (never sharded) target empty
