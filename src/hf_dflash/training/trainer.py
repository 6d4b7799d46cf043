"""`DFlashTrainer`: train a DFlash drafter for any causal LM with the transformers `Trainer`.

One step (arXiv:2602.06036; `N` anchors per sequence, `B` block size, `T` sequence length, `V` vocabulary):

1. target (frozen, `no_grad`): features `cat(hs[l + 1] for l in target_layer_ids)` `[b, T, n*H]` of every position;
2. draft: all `N` blocks `[x_a, MASK x (B-1)]` of a sequence in one forward, keys `[context (T) ; blocks (N*B)]`,
   with the collator's mask (context `t < a`, own block both ways) -> hidden `[b, N*B, H]`, the very forward that
   `speculative_generate` runs at inference (a test pins them together bit for bit);
3. loss (`hf_dflash.training.loss`): the target's LM head on the supervised slots only, weighted cross-entropy
   `sum w_k m_k CE_k / sum w_k m_k` normalised over the whole optimizer step (gradient accumulation and data parallel:
   `num_items_in_batch` counts loss weights, not tokens); optionally mixed with a KL term against the target's own
   distribution (`distill_weight`, over its top-k with `distill_top_k`), with slot weights aimed at the expected
   acceptance length (`acceptance_loss_weight`), and for a DFlash2 drafter plus the selector's K-way cross-entropy
   (`selector_loss_weight`).

A new drafter starts at random or from the target's own deepest layers (`draft_init`, `hf_dflash.training.draft_init`);
a DFlash2 drafter can start from a trained v1 drafter (`dflash2_from_dflash`). The target's features (and top-k
logits) can be computed once per training set (`cache_target_features`, `hf_dflash.training.target_features`), in
memory or on disk.

The target is a teacher: never in the optimizer, never saved, kept in eval mode; the draft shares its frozen
embedding and LM head. Checkpoints hold the draft only and are reloaded and compared after every save.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.utils import logging

from hf_dflash.adapters import (
    add_draft_adapter,
    base_drafter_record,
    is_peft_model,
    save_base_drafter_record,
    verify_saved_adapter,
)
from hf_dflash.decoding.speculative import speculative_generate
from hf_dflash.model.generation_dflash import check_draft_fits_target, pad_token_id_of
from hf_dflash.model.modeling_dflash import DFlashForDrafting, DFlashLayouts
from hf_dflash.model_card import write_training_info

from .arguments import DFlashTrainingArguments
from .callbacks import EpochAnchorsCallback, RealAcceptanceCallback
from .collator import DataCollatorForDFlash, flex_block_mask, simulated_acceptance_length
from .draft_init import initialize_draft_from_target
from .loss import BlockLoss, SelectorTerm, block_loss, draft_training_forward, gather_at_slots
from .target_features import (
    FEATURE_DTYPES,
    TargetCache,
    build_target_cache,
    target_forward,
    top_k_over_draft_vocabulary,
)

logger = logging.get_logger(__name__)

SLOT_COUNTS = ("correct", "supervised", "in_candidates", "selector_correct")  # per-slot counts summed between logs


class DFlashTrainer(Trainer):
    """A `Trainer` whose model is a `DFlashForDrafting` and whose teacher is the frozen `target`.

    Args:
        model: the drafter to train (e.g. `DFlashForDrafting.from_target(target, ...)`); it is all that is optimised
            and saved.
        target: the causal LM the drafter speculates for; frozen, in eval mode, prepared by accelerate for
            evaluation only.
        args: `DFlashTrainingArguments`.
        train_dataset / eval_dataset: items with `input_ids` and `loss_mask` (see `hf_dflash.data.regenerate`).
        data_collator: defaults to `DataCollatorForDFlash` built from `args` and the drafter's config.
        acceptance_prompts: `[1, prompt_len]` tensors of held-out prompts; with `args.real_acceptance_steps` the real
            speculative loop runs on them every that many steps and logs `real_tau` next to the simulated `sim_tau`.
        training_info: free-form facts for the model card (data sources, machine, ...), saved next to the weights.
        peft_config: a `peft.PeftConfig` (e.g. `LoraConfig(r=16)`) to train an adapter on the drafter instead of all
            its weights, as in TRL's `SFTTrainer(peft_config=...)`: `model` is then the base drafter (warm start; its
            reduced-vocabulary map is kept), and what is saved is the adapter (`hf_dflash.adapters`). A `model` that
            already is a `PeftModel` trains its own adapter.
    """

    def __init__(
        self,
        model: DFlashForDrafting,
        target: PreTrainedModel,
        args: DFlashTrainingArguments,
        data_collator: Any | None = None,
        acceptance_prompts: list[torch.Tensor] | None = None,
        training_info: dict | None = None,
        peft_config: Any | None = None,
        **kwargs: Any,
    ):
        if not isinstance(args, DFlashTrainingArguments):
            raise TypeError("DFlashTrainer needs DFlashTrainingArguments (block size, anchors, gamma, ...).")
        check_draft_fits_target(target, model, max_batch_size=None)
        # The drafter an adapter is trained on, recorded next to the adapter so it is never applied to another one.
        self.base_drafter = base_drafter_record(model) if peft_config is not None or is_peft_model(model) else None
        if args.draft_init == "target":
            if peft_config is not None or is_peft_model(model):
                raise ValueError(
                    "draft_init='target' starts a drafter over; an adapter trains on a given one: drop one."
                )
            initialize_draft_from_target(model, target)
        if peft_config is not None:
            model = add_draft_adapter(model, peft_config)
        if args.block_size != model.config.block_size:
            raise ValueError(
                f"DFlashTrainingArguments.block_size is {args.block_size} but the drafter's block size is "
                f"{model.config.block_size}; pass block_size={model.config.block_size} (it sets the loss decay default)."
            )
        if model.config.causal_sliding_attention:
            raise NotImplementedError(
                "This drafter's sliding-window layers attend causally inside the block (as z-lab's SWA drafters do); "
                "the training masks are bidirectional inside each block, so it cannot be fine-tuned faithfully here."
            )
        model.set_attn_implementation(args.attention_backend)
        if data_collator is None:
            data_collator = DataCollatorForDFlash(
                block_size=model.config.block_size,
                num_anchors=args.num_anchors,
                mask_token_id=model.config.mask_token_id,
                pad_token_id=pad_token_id_of(target.generation_config),
                loss_decay_gamma=args.loss_decay_gamma,
                max_length=args.max_length,
                seed=args.seed,
                dense_mask=args.attention_backend != "flex_attention",
                sliding_window=model.config.sliding_window
                if "sliding_attention" in model.config.layer_types
                else None,
                draft_vocabulary=model.draft_token_ids,
            )
        self.target_cache: TargetCache | None = None
        if args.cache_target_features and kwargs.get("train_dataset") is not None:
            top_k = args.distill_top_k if args.distill_weight > 0 else 0
            self.target_cache = build_target_cache(
                target,
                kwargs["train_dataset"],
                model,
                args.max_length,
                top_k,
                args.target_features_dir,
                storage=args.target_features_storage,
                dtype=FEATURE_DTYPES[args.target_features_dtype],
            )
            kwargs["train_dataset"] = kwargs["train_dataset"].add_column(
                "row", list(range(len(kwargs["train_dataset"])))
            )
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        self.model_accepts_loss_kwargs = True  # our loss is already normalised over the optimizer step
        self.target = self.accelerator.prepare_model(target.requires_grad_(False).eval(), evaluation_mode=True)
        self.embed_tokens = self.target.get_input_embeddings()
        self.lm_head = self.target.get_output_embeddings()
        self.acceptance_prompts = acceptance_prompts or []
        self.measurement_cpu_s = 0.0  # this process's CPU seconds in measure_real_acceptance, to tell from training
        self.training_info = copy.deepcopy(training_info or {})  # the real-tau callback appends to nested lists
        self._metrics: dict[str, dict[str, torch.Tensor]] = {"train": defaultdict(int), "eval": defaultdict(int)}
        self.selector_metrics: dict[str, list[float]] = {}  # DFlash2: per-slot recall@K and accuracy, last log
        self.add_callback(EpochAnchorsCallback(data_collator))
        if args.real_acceptance_steps and self.acceptance_prompts:
            self.add_callback(RealAcceptanceCallback(self, args.real_acceptance_steps))

    # -- loss ----------------------------------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | None = None,
    ):
        """Weighted block loss divided by the optimizer step's total loss weight (`num_items_in_batch`)."""
        draft = self.accelerator.unwrap_model(model)
        distill = self.args.distill_weight > 0
        if self.target_cache is not None and "rows" in inputs:
            features, teacher = self._cached_target(inputs, distill)
        else:
            features, target_logits = target_forward(self.target, inputs, self._layer_ids(model), distill)
            teacher = self._teacher(target_logits, inputs, draft) if distill else (None, None)
        hidden = draft_training_forward(model, self.embed_tokens, features, inputs, self._draft_mask(inputs))
        result = block_loss(
            hidden,
            lambda states: draft.draft_logits(states, self.lm_head),
            inputs["labels"],
            inputs["loss_weights"],
            draft.config.block_size,
            chunk_size=self.args.lm_head_chunk_size,
            teacher_logits=teacher[0],
            distill_weight=self.args.distill_weight,
            acceptance_weight=self.args.acceptance_loss_weight,
            teacher_ids=teacher[1],
            selector=self._selector_term(draft, inputs),
        )
        denominator = num_items_in_batch if num_items_in_batch is not None else inputs["loss_weights"].sum()
        loss = result.weighted_sum / torch.as_tensor(denominator, device=hidden.device).clamp(min=1e-6)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        self._record(result, "train" if model.training else "eval")
        return (loss, {"hidden": hidden}) if return_outputs else loss

    def _selector_term(self, draft: DFlashForDrafting, inputs: dict[str, Any]) -> SelectorTerm | None:
        """DFlash2's selector loss inputs (None for a v1 drafter)."""
        if draft.candidate_selector is None:
            return None
        predecessors = draft.to_draft_ids(inputs["predecessor_ids"])  # target ids of each slot's true previous token
        return SelectorTerm(draft.candidate_selector, predecessors, self.args.selector_loss_weight)

    def _cached_target(self, inputs: dict[str, Any], distill: bool) -> tuple[torch.Tensor, tuple]:
        """`[b, T, n*H]` cached features of the batch's rows, and the cached teacher at each slot (top-k logits and
        their draft-vocabulary indices, `[b, N*B, k]` each) when distilling."""
        rows, seq_len, device = inputs["rows"].tolist(), inputs["input_ids"].shape[1], inputs["input_ids"].device
        features = self.target_cache.batch_features(rows, seq_len, device)
        if not distill:
            return features, (None, None)
        logits, ids = self.target_cache.batch_top_logits(rows, seq_len, device)
        return features, (gather_at_slots(logits, inputs), gather_at_slots(ids, inputs))

    def _teacher(self, target_logits: torch.Tensor, inputs: dict[str, Any], draft: DFlashForDrafting) -> tuple:
        """The target's logits at each slot over the draft vocabulary (`[b, N*B, V_d]`, no ids), or with
        `distill_top_k` its top-k logits and their indices (`[b, N*B, k]` each)."""
        if not self.args.distill_top_k:
            token_ids = draft.draft_token_ids
            return gather_at_slots(target_logits if token_ids is None else target_logits[..., token_ids], inputs), None
        logits, ids = top_k_over_draft_vocabulary(target_logits, draft.draft_token_ids, self.args.distill_top_k)
        return gather_at_slots(logits, inputs), gather_at_slots(ids, inputs)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """Total loss weight of the optimizer step (all micro-batches, all processes)."""
        if not batch_samples:
            return None
        total = sum(batch["loss_weights"].sum() for batch in batch_samples).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            total = self.accelerator.gather(total).sum()
        return total

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs, num_items_in_batch=None)
        return loss.detach(), None, None

    def _layer_ids(self, model: nn.Module) -> list[int]:
        return list(self.accelerator.unwrap_model(model).config.target_layer_ids)

    def _draft_mask(self, inputs: dict[str, Any]) -> Any:
        """The collator's dense masks, or flex block masks built here; per layer type if the draft has sliding ones."""
        config = self.accelerator.unwrap_model(self.model).config
        window = config.sliding_window if "sliding_attention" in config.layer_types else None
        if "draft_attention_mask" in inputs:
            full, sliding = inputs["draft_attention_mask"], inputs.get("draft_sliding_attention_mask")
        else:
            args = (inputs["anchor_positions"], inputs["anchor_valid"], inputs["attention_mask"], config.block_size)
            full, sliding = flex_block_mask(*args), flex_block_mask(*args, window) if window else None
        return full if sliding is None else {"full_attention": full, "sliding_attention": sliding}

    # -- metrics -------------------------------------------------------------------------------------------------------

    def _record(self, result: BlockLoss, mode: str) -> None:
        metrics = self._metrics[mode]
        for name in SLOT_COUNTS:
            if getattr(result, name) is not None:
                metrics[name] = metrics[name] + getattr(result, name).detach()

    def slot_accuracy(self, mode: str = "train", count: str = "correct") -> list[float]:
        """Share of supervised slots 1..B-1 since the last log that are `count` (`"correct"`: the argmax is the label;
        DFlash2: `"in_candidates"`, `"selector_correct"`); NaN for a slot never supervised, [] before any step."""
        metrics = self._metrics[mode]
        if isinstance(metrics["supervised"], int) or isinstance(metrics[count], int):
            return []
        hits = self.accelerator.reduce(metrics[count], reduction="sum")
        supervised = self.accelerator.reduce(metrics["supervised"], reduction="sum")
        return [c / s if s else math.nan for c, s in zip(hits[1:].tolist(), supervised[1:].tolist())]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add per-slot accuracy `acc_k` and the simulated acceptance length `sim_tau` to the usual logs; for DFlash2
        the selector's per-slot recall@K `sel_recall_k` and teacher-forced accuracy `sel_acc_k`, and `sel_tau`, the
        acceptance length those accuracies simulate."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        accuracy = self.slot_accuracy(mode)
        if accuracy and ("loss" in logs or "eval_loss" in logs):
            prefix = "eval_" if mode == "eval" else ""
            logs[f"{prefix}acc_1"] = accuracy[0]
            logs[f"{prefix}acc_mean"] = _mean(accuracy)
            logs[f"{prefix}sim_tau"] = simulated_acceptance_length(accuracy)
            logs |= self._selector_logs(mode, prefix)
            self._metrics[mode] = defaultdict(int)
        super().log(logs, start_time)

    def _selector_logs(self, mode: str, prefix: str) -> dict[str, float]:
        recall, picked = self.slot_accuracy(mode, "in_candidates"), self.slot_accuracy(mode, "selector_correct")
        if not recall:
            return {}
        self.selector_metrics = {
            "recall_at_k": [round(r, 4) for r in recall],
            "accuracy": [round(a, 4) for a in picked],
        }
        logs = {f"{prefix}sel_recall_{k}": r for k, r in enumerate(recall, start=1)}
        logs |= {f"{prefix}sel_acc_{k}": a for k, a in enumerate(picked, start=1)}
        return logs | {f"{prefix}sel_acc_mean": _mean(picked), f"{prefix}sel_tau": simulated_acceptance_length(picked)}

    # -- real acceptance -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def measure_real_acceptance(self, max_new_tokens: int | None = None) -> dict[str, float]:
        """Run the real speculative loop (greedy) with the target on `acceptance_prompts`; return `real_tau`."""
        draft = self.accelerator.unwrap_model(self.model)
        was_training = draft.training
        draft.eval()
        budget = max_new_tokens or self.args.real_acceptance_max_new_tokens
        lengths: list[int] = []
        start = time.process_time()
        try:
            for prompt in self.acceptance_prompts:
                prompt = prompt.to(self.target.device)
                out = speculative_generate(  # tau only: the drafter under training keeps its stock modules
                    self.target, draft, prompt, max_new_tokens=budget, do_sample=False, optimize_cpu=False
                )
                lengths += out.stats.acceptance_lengths
        finally:
            draft.train(was_training)
            self.measurement_cpu_s += time.process_time() - start
        return {"real_tau": sum(lengths) / max(len(lengths), 1)}

    # -- saving --------------------------------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the draft only (hf-dflash layout, plus z-lab on request), then reload it and compare every weight."""
        output_dir = output_dir or self.args.output_dir
        super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return
        draft = self.accelerator.unwrap_model(self.model)
        if self.base_drafter is not None:  # an adapter: PEFT wrote it; check it and say which drafter it belongs to
            verify_saved_adapter(draft, output_dir)
            save_base_drafter_record(self.base_drafter, output_dir)
            servable = copy.deepcopy(draft).merge_and_unload() if self.args.save_zlab_layout else None
        else:  # under FSDP the Trainer passes the gathered `state_dict`; the module's own holds shards
            servable = verify_saved_draft(draft if state_dict is None else state_dict, output_dir, dtype=draft.dtype)
        if self.args.save_zlab_layout:  # engines serve a plain drafter: an adapter goes out merged into a copy
            target = self.accelerator.unwrap_model(self.target)  # its head's rows for a reduced vocabulary
            servable.save_pretrained(Path(output_dir) / "zlab", layout=DFlashLayouts.ZLAB, target=target)
            verify_saved_draft(servable, Path(output_dir) / "zlab")
        self._write_training_info(output_dir)

    def _write_training_info(self, output_dir: str | os.PathLike) -> None:
        draft = self.accelerator.unwrap_model(self.model)
        info = dict(self.training_info)
        info.setdefault("base_model", getattr(self.target.config, "_name_or_path", None))
        info["training"] = {
            **info.get("training", {}),
            "block_size": draft.config.block_size,
            "num_draft_layers": draft.config.num_hidden_layers,
            "target_layer_ids": list(draft.config.target_layer_ids),
            "anchors_per_sequence": self.args.num_anchors,
            "loss_decay_gamma": self.args.loss_decay_gamma,
            "learning_rate": self.args.learning_rate,
            "epochs": round(self.state.epoch or 0, 2),
            "steps": self.state.global_step,
            "max_length": self.args.max_length,
            "distill_weight": self.args.distill_weight,
            "acceptance_loss_weight": self.args.acceptance_loss_weight,
            "draft_init": self._draft_start(),
        }
        if self.base_drafter is not None:
            trainable, total = draft.get_nb_trainable_parameters()
            info["base_drafter"] = self.base_drafter["name_or_path"]
            info["training"] |= {"trainable_parameters": trainable, "drafter_parameters": total - trainable}
        write_training_info(output_dir, info)

    def _draft_start(self) -> str:
        """How the drafter's weights started, for its card: an adapter's frozen base drafter, the drafter the caller
        says this one continues (`training_info["training"]["draft_init"]`, e.g. `hf-dflash train --init_draft`),
        else `args.draft_init` ('random' or 'target'), which only describes a drafter this trainer started."""
        if self.base_drafter is not None:
            return f"adapter on {self.base_drafter['name_or_path']}"
        return self.training_info.get("training", {}).get("draft_init", self.args.draft_init)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Render the drafter's model card (`hub_cards/`) into `output_dir/README.md` instead of the generic card.

        The arguments are `Trainer.create_model_card`'s (`push_to_hub(**kwargs)` passes them on): `license` (default
        apache-2.0), `tags` (added to the DFlash tags), `finetuned_from` (the target, the card's `base_model`;
        default: from `training_info`), `dataset_tags` (dataset repo ids for the metadata) and `model_name`, the
        drafter's name in the card's snippets (`org/name`, or `<your-org>/name`; default: `hub_model_id`). A drafter's
        card has no place for `language`, `tasks`, `dataset` and `dataset_args`: they are left out with a warning.
        """
        from hf_dflash.model_card import card_info_from_folder, write_model_card

        if not self.is_world_process_zero():
            return
        unused = {"language": language, "tasks": tasks, "dataset": dataset, "dataset_args": dataset_args}
        if any(value is not None for value in unused.values()):
            names = ", ".join(name for name, value in unused.items() if value is not None)
            logger.warning(f"The drafter's model card has no place for {names}; left out of the card.")
        repo_id = self.hub_model_id or self.args.hub_model_id
        if model_name and model_name != (repo_id or "").split("/")[-1]:  # push_to_hub passes hub_model_id's tail
            repo_id = model_name if "/" in model_name else f"<your-org>/{model_name}"
        overrides = {
            "license": license,
            "extra_tags": [tags] if isinstance(tags, str) else tags,
            "drafter_repo_id": repo_id,
            "base_model": finetuned_from,
            "datasets": [dataset_tags] if isinstance(dataset_tags, str) else dataset_tags,
        }
        self._write_training_info(self.args.output_dir)
        write_model_card(self.args.output_dir, card_info_from_folder(self.args.output_dir, **overrides))


def verify_saved_draft(
    expected: DFlashForDrafting | dict[str, torch.Tensor], folder: str | os.PathLike, dtype: torch.dtype | None = None
) -> DFlashForDrafting:
    """Reload `folder` and check every weight equals the draft's (nothing missing, nothing re-initialised); returns
    the reloaded drafter. `expected` is the draft or its full state dict (what FSDP gathers for saving)."""
    if isinstance(expected, nn.Module):
        dtype, expected = expected.dtype, expected.state_dict()
    dtype = dtype or next(tensor.dtype for tensor in expected.values() if tensor.is_floating_point())
    reloaded = DFlashForDrafting.from_pretrained(folder, dtype=dtype)
    saved = reloaded.state_dict()
    if saved.keys() != expected.keys():
        raise RuntimeError(f"{folder}: saved weights {sorted(saved)} differ from the draft's {sorted(expected)}.")
    for name, tensor in expected.items():
        if not torch.equal(saved[name].cpu(), tensor.detach().cpu()):
            raise RuntimeError(f"{folder}: weight {name} changed on save/reload; the checkpoint is not trustworthy.")
    return reloaded


def _mean(values: list[float]) -> float:
    """Mean over the slots that were supervised (NaN entries left out)."""
    kept = [value for value in values if not math.isnan(value)]
    return sum(kept) / max(len(kept), 1)


__all__ = ["DFlashTrainer", "verify_saved_draft"]
