"""`hf-dflash train`: train a drafter for a target on a regenerated dataset (`hf-dflash data`), then save and card it.

Every `TrainingArguments` / `DFlashTrainingArguments` field is a flag (`--learning_rate`, `--block_size`, ...), parsed by
`HfArgumentParser` (`parse_train_args`), so the command runs as is under `accelerate launch -m hf_dflash.cli train ...`.
`train` does the work and returns a `TrainResult`; it prints nothing and leaves logging as it finds it: the command
line (`hf_dflash.cli`) chooses the verbosity and prints the summary.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, PreTrainedModel
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from .data import load_training_dataset
from .generation_dflash import token_ids
from .loading import TargetArguments, load_draft, load_target_from_arguments, resolve_device, same_device
from .modeling_dflash import DFlashForDrafting
from .targets import KNOWN_TARGETS
from .trainer import DFlashTrainer, DFlashTrainingArguments

logger = logging.get_logger(__name__)


@dataclass(kw_only=True)
class TrainScriptArguments(TargetArguments):
    """What to train on: the target (`TargetArguments`, as every command names it), the regenerated data, and where
    a drafter starts from. The drafter takes the target's dtype; the device is the Trainer's (`--device cpu` sets
    `--use_cpu`)."""

    data: str = field(metadata={"help": "JSONL written by `hf-dflash data` (input_ids, loss_mask, prompt_len)."})
    init_draft: str | None = field(default=None, metadata={"help": "Start from this drafter folder instead of fresh."})
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "Draft over the N most frequent response tokens of the data only (cheaper draft LM head); with "
            "--init_draft, the same N as that drafter, its tokens re-chosen from this data."
        },
    )
    acceptance_holdout: int = field(
        default=4, metadata={"help": "Records held out of training whose prompts measure the real tau."}
    )
    use_peft: bool = field(
        default=False,
        metadata={"help": "Train a LoRA adapter on the --init_draft drafter instead of all its weights."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (with --use_peft)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (with --use_peft)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout (with --use_peft)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Draft modules that get a LoRA (default: every layer's attention and MLP projections)."},
    )

    def __post_init__(self) -> None:
        if self.use_peft and not self.init_draft:
            raise ValueError("--use_peft adapts an existing drafter: pass it as --init_draft (a folder or a Hub id).")
        if self.use_peft and self.draft_vocab_size:
            raise ValueError(
                "--use_peft keeps the --init_draft drafter's vocabulary map (the adapter is trained on it): drop "
                "--draft_vocab_size."
            )

    def peft_config(self):
        """The `LoraConfig` of `--use_peft` (None without it)."""
        if not self.use_peft:
            return None
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.lora_target_modules,
        )


@dataclass(frozen=True)
class TrainResult:
    """What `train` did: optimizer steps, training sequences, wall time, and the held-out tau before and after."""

    steps: int
    num_sequences: int
    wall_s: float
    num_held_out: int
    tau_before: float | None  # None when no prompts were held out
    tau_after: float | None
    output_dir: str

    def summary(self) -> str:
        """One line for the command line to print."""
        return (
            f"trained {self.steps} steps on {self.num_sequences} sequences in {self.wall_s / 60:.1f} min; real tau "
            f"on {self.num_held_out} held-out prompts: {self.tau_before} before, {self.tau_after} after "
            f"-> {self.output_dir}"
        )


def parse_train_args(argv: list[str] | None = None) -> tuple[TrainScriptArguments, DFlashTrainingArguments]:
    """The `hf-dflash train` flags (`sys.argv` when `argv` is None) as the script's and the trainer's arguments."""
    parser = HfArgumentParser((TrainScriptArguments, DFlashTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(args=argv)
    if script.device is not None and resolve_device(script.device).type == "cpu" and not args.use_cpu:
        args = dataclasses.replace(args, use_cpu=True)  # the Trainer picks its device from `use_cpu`
    return script, args


def train(script: TrainScriptArguments, args: DFlashTrainingArguments) -> TrainResult:
    """Train a drafter, save it with its model card in `args.output_dir` (and push it when `args.push_to_hub`)."""
    start = time.perf_counter()
    target, tokenizer = _load_target(script, args)
    dataset = load_training_dataset(script.data)
    split = len(dataset) - script.acceptance_holdout
    if split < 1:
        raise ValueError(f"{script.data} has {len(dataset)} records: too few to hold out {script.acceptance_holdout}.")
    train_dataset = dataset.select(range(split))
    prompts = held_out_prompts(dataset, script.acceptance_holdout)
    draft = _initial_draft(script, args, target, tokenizer)
    if script.draft_vocab_size:  # the LM head is the target's: choosing the rows anew loses nothing learned
        draft.set_draft_vocabulary(frequent_response_tokens(train_dataset, script.draft_vocab_size, target))
    elif draft.draft_token_ids is not None:  # a kept vocabulary (an adapter, a continued drafter) may miss new tokens
        warn_about_unproposable_tokens(train_dataset, draft, tokenizer, script.use_peft)
    trainer = DFlashTrainer(
        model=draft.train(),
        target=target,
        args=args,
        train_dataset=train_dataset,
        acceptance_prompts=prompts,
        training_info=_training_info(script, train_dataset),
        peft_config=script.peft_config(),
    )
    before = trainer.measure_real_acceptance()["real_tau"] if prompts else None
    cpu_start, measured_before = time.process_time(), trainer.measurement_cpu_s
    trainer.train(resume_from_checkpoint=_checkpoint_to_resume(args.resume_from_checkpoint, args.output_dir))
    training_cpu_s = time.process_time() - cpu_start - (trainer.measurement_cpu_s - measured_before)
    after = _final_held_out_tau(trainer) if prompts else None
    wall_s = time.perf_counter() - start
    trainer.training_info["training"]["wall_time_s"] = round(wall_s)
    # CPU seconds of the optimizer steps alone (this process, all its threads; not loading, caching or the held-out
    # tau): what an ablation compares variants by, even on a shared machine
    trainer.training_info["training"]["train_cpu_s"] = round(training_cpu_s, 1)
    start_name = "the --init_draft drafter" if script.init_draft else "untrained drafter"
    trainer.training_info["acceptance"] = _held_out_acceptance(before, after, len(prompts), args, start_name)
    trainer.save_model()
    trainer.create_model_card()
    if args.push_to_hub:
        trainer.push_to_hub()
    return TrainResult(
        steps=trainer.state.global_step,
        num_sequences=len(train_dataset),
        wall_s=wall_s,
        num_held_out=len(prompts),
        tau_before=before,
        tau_after=after,
        output_dir=args.output_dir,
    )


def _checkpoint_to_resume(flag: str | None, output_dir: str) -> str | None:
    """`--resume_from_checkpoint`: a checkpoint folder as given, or for `true` the latest complete checkpoint of
    output_dir (one whose `trainer_state.json` was written: a kill while saving leaves a newer, partial folder)."""
    if not isinstance(flag, str) or flag.lower() != "true":
        return flag
    complete = [folder for folder in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if _is_complete(folder)]
    if not complete:
        raise FileNotFoundError(
            f"--resume_from_checkpoint true: {output_dir} holds no complete checkpoint (a {PREFIX_CHECKPOINT_DIR}-N "
            "folder with trainer_state.json); pass a checkpoint folder, or train from the start without the flag."
        )
    return str(max(complete, key=lambda folder: int(folder.name.rsplit("-", 1)[1])))


def _is_complete(folder: Path) -> bool:
    return folder.name.rsplit("-", 1)[1].isdigit() and (folder / "trainer_state.json").is_file()


def _load_target(script: TrainScriptArguments, args: DFlashTrainingArguments) -> tuple[PreTrainedModel, object]:
    """The frozen target on the Trainer's device; a folder without a tokenizer needs `--mask_token_id`."""
    if script.device is not None and not same_device(resolve_device(script.device), args.device):
        raise ValueError(
            f"--device {script.device} differs from the Trainer's device {args.device}: the Trainer trains on "
            "cuda:<local rank> (choose GPUs with CUDA_VISIBLE_DEVICES or accelerate launch), on the CPU with "
            "--device cpu."
        )
    return load_target_from_arguments(script, device=args.device, tokenizer_required=False)


def _initial_draft(
    script: TrainScriptArguments, args: DFlashTrainingArguments, target, tokenizer
) -> DFlashForDrafting:
    if script.init_draft and args.draft_init == "target":
        raise ValueError(
            f"--draft_init target starts a new drafter from the target's layers; --init_draft {script.init_draft} "
            "continues a trained one: drop one of them."
        )
    if script.init_draft:
        draft = load_draft(script.init_draft, target)
        if script.draft_vocab_size and script.draft_vocab_size != draft.config.draft_vocab_size:
            raise ValueError(
                f"--draft_vocab_size {script.draft_vocab_size} differs from the {draft.config.draft_vocab_size} of "
                f"--init_draft {script.init_draft}; pass the same size (its rows are re-chosen from this data) or none."
            )
        return draft
    overrides = {
        name: getattr(args, name)
        for name in ("target_layer_ids", "mask_token_id", "layer_types", "sliding_window")
        if getattr(args, name) is not None
    }
    if script.draft_vocab_size:
        overrides["draft_vocab_size"] = script.draft_vocab_size
    torch.manual_seed(args.seed)
    return DFlashForDrafting.from_target(
        target, num_hidden_layers=args.num_draft_layers, block_size=args.block_size, tokenizer=tokenizer, **overrides
    )


def response_token_counts(dataset) -> Counter:
    """How often each token id appears in the responses (loss mask 1)."""
    counts = Counter()
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        counts.update(token for token, supervised in zip(ids, mask) if supervised)
    return counts


def unproposable_tokens(dataset, draft_token_ids: torch.LongTensor, min_share: float = 0.005) -> dict[int, float]:
    """`{token id: share of the response tokens}` of the tokens outside the draft vocabulary that make up at least
    `min_share` of the responses each: tokens the target says often and the drafter can never propose."""
    counts = response_token_counts(dataset)
    total = max(sum(counts.values()), 1)
    vocabulary = set(draft_token_ids.tolist())
    return {
        token: count / total
        for token, count in counts.most_common()
        if token not in vocabulary and count / total >= min_share
    }


def warn_about_unproposable_tokens(dataset, draft: DFlashForDrafting, tokenizer, is_adapter: bool) -> None:
    """Warn, naming the tokens and the fix, when frequent response tokens lie outside the kept draft vocabulary: every
    one of them ends an accepted run, and no training of the drafter's layers can change that."""
    missing = unproposable_tokens(dataset, draft.draft_token_ids)
    if not missing:
        return
    size = draft.config.draft_vocab_size
    names = ", ".join(
        f"{tokenizer.decode([token]) if tokenizer is not None else token!r} ({share:.1%})"
        for token, share in missing.items()
    )
    fix = (
        f"an adapter keeps the base drafter's vocabulary: to draft them, fine-tune the whole drafter with "
        f"--draft_vocab_size {size} (its rows are re-chosen from this data; the LM head is the target's)"
        if is_adapter
        else f"pass --draft_vocab_size {size} to re-choose the rows from this data"
    )
    logger.warning(
        f"Frequent response tokens the drafter can never propose (outside its {size}-token draft vocabulary): "
        f"{names}; {fix}."
    )


def frequent_response_tokens(dataset, size: int, target: PreTrainedModel) -> torch.LongTensor:
    """The `size` token ids seen most often in the responses (loss mask 1), the target's EOS ids always included."""
    counts = response_token_counts(dataset)
    always = token_ids(target.generation_config.eos_token_id)
    chosen = list(dict.fromkeys(always + [token for token, _ in counts.most_common(size)]))[:size]
    taken = set(chosen)
    filler = (token for token in range(target.get_input_embeddings().weight.shape[0]) if token not in taken)
    chosen += [next(filler) for _ in range(size - len(chosen))]  # tiny datasets: pad with low ids
    covered = sum(counts[token] for token in chosen) / max(sum(counts.values()), 1)
    logger.info(f"Draft vocabulary: {size} tokens cover {covered:.1%} of the response tokens.")
    return torch.tensor(chosen)


def held_out_prompts(dataset, holdout: int) -> list[torch.Tensor]:
    """`[1, prompt_len]` prompts of the last `holdout` records, the ones `--acceptance_holdout` keeps out of training
    (the tokens before the first supervised one)."""
    dataset = dataset.select(range(len(dataset) - holdout, len(dataset)))
    lengths = dataset["prompt_len"] if "prompt_len" in dataset.column_names else None
    lengths = lengths or [mask.index(1) for mask in dataset["loss_mask"]]
    return [torch.tensor(ids[:length])[None] for ids, length in zip(dataset["input_ids"], lengths)]


def _training_info(script: TrainScriptArguments, train_dataset) -> dict:
    sources = (
        Counter(name for name in train_dataset["source"] if name) if "source" in train_dataset.column_names else {}
    )
    return {
        "base_model": KNOWN_TARGETS[script.target].hub_id if script.target in KNOWN_TARGETS else script.target,
        "target_name": script.target,
        "target_adapter": script.target_adapter,  # the PEFT adapter the target ran with, if any
        "training": {
            "data": ", ".join(f"{name} ({count})" for name, count in sorted(sources.items())) or script.data,
            "num_sequences": len(train_dataset),
            "supervised_tokens": sum(sum(mask) for mask in train_dataset["loss_mask"]),
            "chat_template": "target's own (responses regenerated by the target)",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        }
        | ({"draft_init": f"continued from {script.init_draft}"} if script.init_draft else {}),
    }


def _final_held_out_tau(trainer: DFlashTrainer) -> float:
    """The held-out tau after training: the `RealAcceptanceCallback` already measured it at the last step when it
    ran (`held_out_tau_by_step`), else it is measured now."""
    history = trainer.training_info["training"].get("held_out_tau_by_step")
    if history and history[-1][0] == trainer.state.global_step:
        return history[-1][1]
    return trainer.measure_real_acceptance()["real_tau"]


def _held_out_acceptance(before, after, num_prompts: int, args: DFlashTrainingArguments, start_name: str) -> dict:
    if after is None:
        return {}
    conditions = (
        f"{num_prompts} held-out training-distribution prompts, greedy, {args.real_acceptance_max_new_tokens} new "
        f"tokens, speculative_generate; {start_name}: tau {before:.2f}"
    )
    return {"held-out": {"tau": round(after, 3), "speedup": None, "conditions": conditions}}


__all__ = ["TrainResult", "TrainScriptArguments", "parse_train_args", "train"]
