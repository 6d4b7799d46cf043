"""`DFlashTrainer`: train a DFlash drafter for any causal LM with the transformers `Trainer`.

One step (arXiv:2602.06036; `N` anchors per sequence, `B` block size, `T` sequence length, `V` vocabulary):

1. target (frozen, `no_grad`): features `cat(hs[l + 1] for l in target_layer_ids)` `[b, T, n*H]` of every position;
2. draft: all `N` blocks `[x_a, MASK x (B-1)]` of a sequence in one forward, keys `[context (T) ; blocks (N*B)]`,
   with the collator's mask (context `t < a`, own block both ways) -> hidden `[b, N*B, H]`, the very forward that
   `speculative_generate` runs at inference (a test pins them together bit for bit);
3. loss: the target's LM head on the supervised slots only, in chunks (memory does not grow with `N*B*V`), weighted
   cross-entropy `sum w_k m_k CE_k / sum w_k m_k` normalised over the whole optimizer step (gradient accumulation and
   data parallel: `num_items_in_batch` counts loss weights, not tokens); optionally mixed with a KL term against the
   target's own distribution at the same position (`distill_weight`, over its top-k with `distill_top_k`), and with
   slot weights aimed at the expected acceptance length (`acceptance_loss_weight`, `expected_length_shares`).

A new drafter starts at random or from the target's own deepest layers (`draft_init`, `hf_dflash.training.draft_init`); the
target's features (and top-k logits) can be computed once per training set (`cache_target_features`,
`hf_dflash.training.target_features`), in memory or on disk.

The target is a teacher: never in the optimizer, never saved, kept in eval mode; the draft shares its frozen
embedding and LM head. Checkpoints hold the draft only and are reloaded and compared after every save.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
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

from .collator import (
    DataCollatorForDFlash,
    default_loss_decay_gamma,
    flex_block_mask,
    simulated_acceptance_length,
)
from .draft_init import initialize_draft_from_target
from .target_features import (
    FEATURE_DTYPES,
    STORAGES,
    TargetCache,
    build_target_cache,
    target_forward,
    top_k_over_draft_vocabulary,
)

logger = logging.get_logger(__name__)

ATTENTION_BACKENDS = ("sdpa", "eager", "flex_attention")
DRAFT_INITS = ("random", "target")


@dataclass
class DFlashTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the DFlash settings. Defaults follow the public recipes that reproduced the paper
    (AdamW, lr 6e-4, cosine, 4% warmup, no weight decay, clip 1.0) except epochs, which depend on the data size."""

    block_size: int = field(default=16, metadata={"help": "Block size B: one anchor plus B-1 drafted tokens."})
    num_draft_layers: int = field(default=1, metadata={"help": "Decoder layers of a new drafter (paper: 1 to 8)."})
    num_anchors: int = field(
        default=64, metadata={"help": "Random anchors (blocks) per sequence, re-drawn per epoch."}
    )
    loss_decay_gamma: float | None = field(
        default=None,
        metadata={"help": "gamma in w_k = exp(-(k-1)/gamma); default by block size (7 at 16, 5 at 10, 4 at 8)."},
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers whose outputs feed the draft; default: the paper's rule."}
    )
    mask_token_id: int | None = field(
        default=None, metadata={"help": "Embedding row of the MASK token; default: hf_dflash.choose_mask_token_id."}
    )
    layer_types: list[str] | None = field(
        default=None,
        metadata={"help": "Per new draft layer, full_attention or sliding_attention (default: all full)."},
    )
    sliding_window: int | None = field(
        default=None, metadata={"help": "Window of the sliding draft layers (recent context positions they see)."}
    )
    max_length: int = field(default=2048, metadata={"help": "Sequences are truncated to this many tokens."})
    attention_backend: str = field(
        default="sdpa", metadata={"help": f"Draft attention during training: one of {ATTENTION_BACKENDS}."}
    )
    distill_weight: float = field(
        default=0.0,
        metadata={
            "help": "0: cross-entropy on the target's tokens; 1: KL to the target's distribution; between: mix."
        },
    )
    acceptance_loss_weight: float = field(
        default=0.0,
        metadata={
            "help": "0: position-decayed loss; 1: the expected-acceptance-length objective (each slot's loss weighted "
            "by the expected accepted length it can still add, so its gradient is that of -E[tau]); between: mix."
        },
    )
    draft_init: str = field(
        default="random",
        metadata={
            "help": f"One of {DRAFT_INITS}: a new drafter's own random weights, or the target's deepest layers, "
            "fc selecting the deepest tapped layer and the target's norms (hf_dflash.training.draft_init); 'target' "
            "overwrites the weights of the drafter given to the trainer."
        },
    )
    distill_top_k: int = field(
        default=0,
        metadata={
            "help": "With distill_weight: the target's k most likely tokens over the draft vocabulary stand for its "
            "distribution (renormalised), which cache_target_features can keep; 0: all its logits, online."
        },
    )
    cache_target_features: bool = field(
        default=False,
        metadata={
            "help": "Run the target once over the training set and keep its features (and top-k logits with "
            "distill_top_k) in memory (fp32, 4 * n * H bytes per token) instead of one target forward per step; "
            "for small targets and data."
        },
    )
    target_features_dir: str | None = field(
        default=None,
        metadata={
            "help": "With cache_target_features: also keep that cache in this folder, one file per sequence, so a "
            "later run on the same target and tapped layers (a recipe's next stage) runs the target only on new ones."
        },
    )
    target_features_storage: str = field(
        default="memory",
        metadata={
            "help": "Where cache_target_features keeps the features while training: 'memory', or 'disk' (needs "
            "target_features_dir; only paths in memory, each batch's rows read from their files), for training "
            "sets whose features outgrow memory."
        },
    )
    target_features_dtype: str = field(
        default="float32",
        metadata={"help": "Stored dtype of cached features: 'float32' or 'float16' (half the memory and disk)."},
    )
    lm_head_chunk_size: int = field(default=1024, metadata={"help": "Supervised slots per LM-head + loss chunk."})
    real_acceptance_steps: int = field(
        default=0, metadata={"help": "Every this many steps, measure the real tau with speculative_generate (0: off)."}
    )
    real_acceptance_max_new_tokens: int = field(default=64, metadata={"help": "Tokens per prompt for the real tau."})
    save_zlab_layout: bool = field(
        default=False, metadata={"help": "Also write the z-lab layout (vLLM, SGLang) into `<checkpoint>/zlab`."}
    )
    # TrainingArguments fields with the recipes' defaults (their help says so, as `hf-dflash train --help` shows it)
    learning_rate: float = field(default=6e-4, metadata={"help": "The initial learning rate for AdamW."})
    lr_scheduler_type: str = field(
        default="cosine", metadata={"help": "The learning rate schedule (transformers' SchedulerType names)."}
    )
    warmup_steps: float = field(
        default=0.04,
        metadata={"help": "Linear warmup from 0 to learning_rate: a number of steps, or below 1 a share of them."},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW's weight decay."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay false: the draft's forward takes no input_ids."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}.")
        if not 1 <= self.num_draft_layers <= 64:
            raise ValueError(f"num_draft_layers must be between 1 and 64, got {self.num_draft_layers}.")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be at least 1, got {self.num_anchors}.")
        if self.loss_decay_gamma is None:
            self.loss_decay_gamma = default_loss_decay_gamma(self.block_size)
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma must be positive, got {self.loss_decay_gamma}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}.")
        if not 0.0 <= self.acceptance_loss_weight <= 1.0:
            raise ValueError(f"acceptance_loss_weight must be in [0, 1], got {self.acceptance_loss_weight}.")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"draft_init must be one of {DRAFT_INITS}, got {self.draft_init!r}.")
        if self.lm_head_chunk_size < 1 or self.max_length < 2:
            raise ValueError("lm_head_chunk_size must be >= 1 and max_length >= 2.")
        if self.distill_top_k < 0:
            raise ValueError(f"distill_top_k must be >= 0, got {self.distill_top_k}.")
        if self.cache_target_features and self.distill_weight > 0 and not self.distill_top_k:
            raise ValueError(
                "cache_target_features cannot keep all the target's logits for distillation: pass distill_top_k "
                "(e.g. 32) to keep its top-k with the features, or drop cache_target_features."
            )
        if self.target_features_dir and not self.cache_target_features:
            raise ValueError("target_features_dir keeps the cache of cache_target_features: pass both.")
        if self.target_features_storage not in STORAGES:
            raise ValueError(
                f"target_features_storage must be one of {STORAGES}, got {self.target_features_storage!r}."
            )
        if self.target_features_storage == "disk" and not self.target_features_dir:
            raise ValueError("target_features_storage='disk' reads the cache from target_features_dir: pass it.")
        if self.target_features_dtype not in FEATURE_DTYPES:
            raise ValueError(
                f"target_features_dtype must be one of {list(FEATURE_DTYPES)}, got {self.target_features_dtype!r}."
            )
        if self.remove_unused_columns:
            raise ValueError(
                "DFlashTrainer needs remove_unused_columns=False (the draft's forward takes no input_ids)."
            )


# ---------------------------------------------------------------------------------------------------------------------
# The training forward and loss (pure functions: the tests call them directly)
# ---------------------------------------------------------------------------------------------------------------------


def draft_training_forward(
    draft: nn.Module, embed_tokens: nn.Module, features: torch.Tensor, batch: dict[str, Any], attention_mask: Any
) -> torch.Tensor:
    """All blocks of every sequence in one draft forward -> `[b, N*B, H]` (after the draft's final norm)."""
    with torch.no_grad():
        noise_embeds = embed_tokens(batch["noise_ids"])  # [b, N*B, H], frozen target embedding
    out = draft(
        noise_embeds=noise_embeds,
        context_hidden_states=features,
        position_ids=batch["position_ids"],
        attention_mask=attention_mask,
    )
    return out.last_hidden_state


@dataclass
class BlockLoss:
    """Summed weighted loss of a batch, and per-slot correct/supervised counts (`[B]`, slot 0 always 0)."""

    weighted_sum: torch.Tensor
    correct: torch.Tensor
    supervised: torch.Tensor


def block_loss(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    block_size: int,
    chunk_size: int = 1024,
    teacher_logits: torch.Tensor | None = None,
    distill_weight: float = 0.0,
    acceptance_weight: float = 0.0,
    teacher_ids: torch.Tensor | None = None,
) -> BlockLoss:
    """`sum_k w_k * m_k * loss_k` over supervised slots, computed in checkpointed chunks of `chunk_size` slots.

    `head` maps hidden states to logits over the draft vocabulary (`DFlashForDrafting.draft_logits` with the target's
    LM head), whose indices `labels` use. `loss_k` is cross-entropy against `labels` (the target's tokens), or
    `(1 - d) * CE + d * KL(p_target || q)` with `teacher_logits` (`[b, N*B, V]`, the target's logits for the same
    token) and `d = distill_weight`; with `teacher_ids` (`[b, N*B, k]` draft-vocabulary indices) `teacher_logits` are
    `[b, N*B, k]` logits of those tokens only, and `p_target` is their softmax (the top-k renormalised). With `a = acceptance_weight`, the weights become `(1 - a) * w_k + a * C_k`, where
    `C_k` is slot k's share of the block's expected accepted length (`expected_length_shares`).
    """
    weights = loss_weights.flatten()
    rows = torch.nonzero(weights > 0).flatten()  # only supervised slots reach the LM head
    slots = rows % block_size
    flat_hidden = hidden.flatten(0, 1)[rows]
    flat_labels = labels.flatten()[rows]
    flat_teacher = teacher_logits.flatten(0, 1)[rows] if teacher_logits is not None else None
    flat_teacher_ids = teacher_ids.flatten(0, 1)[rows] if teacher_ids is not None else None
    losses, label_probs = [], []  # per supervised row, in order
    correct = torch.zeros(block_size, dtype=torch.long, device=hidden.device)
    for start in range(0, rows.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        teacher = flat_teacher[part] if flat_teacher is not None else None
        ids = flat_teacher_ids[part] if flat_teacher_ids is not None else None
        loss, prob, hits = checkpoint(
            _chunk_loss, flat_hidden[part], head, flat_labels[part], teacher, distill_weight, ids, use_reentrant=False
        )
        losses.append(loss)
        label_probs.append(prob)
        correct += torch.bincount(slots[part][hits], minlength=block_size)
    row_weights = weights[rows]
    if acceptance_weight > 0:
        shares = expected_length_shares(
            torch.cat(label_probs) if label_probs else weights[:0], rows, weights.shape[0], block_size
        )
        row_weights = (1 - acceptance_weight) * row_weights + acceptance_weight * shares
    weighted_sum = hidden.sum() * 0.0  # touches every trainable parameter even when nothing is supervised
    if losses:
        weighted_sum = weighted_sum + (torch.cat(losses) * row_weights).sum()
    supervised = torch.bincount(slots, minlength=block_size)
    return BlockLoss(weighted_sum, correct, supervised)


@torch.no_grad()
def expected_length_shares(
    label_probs: torch.Tensor, rows: torch.Tensor, num_slots: int, block_size: int
) -> torch.Tensor:
    """`[rows]` weights `C_k = sum_{m >= k} prod_{j <= m} q_j` of supervised slots, `q_j` (`label_probs`) the draft's
    probability of the target's token at slot j of the same block (0 at an unsupervised slot: nothing after it is
    accepted).

    A block's expected accepted length is `E = sum_m prod_{j <= m} q_j`, and `dE = sum_k C_k * d log q_k`: a
    cross-entropy weighted by these (detached) `C_k` has exactly the gradient of `-E`, the acceptance-length objective
    (the "LK" losses of SpecForge and NeMo Automodel aim at the same quantity). `rows` are the supervised slots'
    indices among the `num_slots = b * N * B` slots.
    """
    accepted = torch.zeros(num_slots, dtype=torch.float32, device=label_probs.device)
    accepted[rows] = label_probs.float()
    accepted = accepted.view(-1, block_size)  # [blocks, B]
    accepted[:, 0] = 1.0  # the anchor is the last verified token: given
    prefix = accepted.cumprod(1)  # prod_{j <= m} q_j
    shares = prefix.flip(1).cumsum(1).flip(1)  # sum_{m >= k} prefix_m
    return shares.flatten()[rows].to(label_probs.dtype)


def _chunk_loss(hidden, head, labels, teacher_logits, distill_weight, teacher_ids):
    """Per row: the loss (CE, or CE mixed with the KL to the teacher), the draft's probability of the label
    (detached), and whether its argmax is the label."""
    logits = head(hidden).float()  # [rows, V_d]
    loss = F.cross_entropy(logits, labels, reduction="none")
    label_prob = (-loss).exp().detach()
    if teacher_logits is not None and distill_weight > 0:
        log_p = teacher_logits.float().log_softmax(-1)  # [rows, V_d], or [rows, k] over `teacher_ids`
        log_q = logits.log_softmax(-1)
        log_q = log_q if teacher_ids is None else log_q.gather(-1, teacher_ids)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        loss = (1 - distill_weight) * loss + distill_weight * kl
    return loss, label_prob, logits.argmax(-1) == labels


def gather_at_slots(per_position: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[b, T, X]` values of every position -> `[b, N*B, X]`: the values at the position that predicts each slot's
    token (`a + k - 1`), e.g. the target's logits there."""
    block_positions = batch["position_ids"][:, batch["input_ids"].shape[1] :]
    source = (block_positions - 1).clamp(min=0, max=per_position.shape[1] - 1)
    return per_position.gather(1, source[..., None].expand(-1, -1, per_position.shape[-1]))


# ---------------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------------


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
        self.add_callback(_EpochAnchorsCallback(data_collator))
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
            self.args.lm_head_chunk_size,
            teacher[0],
            self.args.distill_weight,
            self.args.acceptance_loss_weight,
            teacher_ids=teacher[1],
        )
        denominator = num_items_in_batch if num_items_in_batch is not None else inputs["loss_weights"].sum()
        loss = result.weighted_sum / torch.as_tensor(denominator, device=hidden.device).clamp(min=1e-6)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        self._record(result, "train" if model.training else "eval")
        return (loss, {"hidden": hidden}) if return_outputs else loss

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
        metrics["correct"] = metrics["correct"] + result.correct.detach()
        metrics["supervised"] = metrics["supervised"] + result.supervised.detach()

    def slot_accuracy(self, mode: str = "train") -> list[float]:
        """Accuracy of slots 1..B-1 since the last log (NaN for a slot that was never supervised)."""
        metrics = self._metrics[mode]
        if isinstance(metrics["supervised"], int):
            return []
        correct = self.accelerator.reduce(metrics["correct"], reduction="sum")
        supervised = self.accelerator.reduce(metrics["supervised"], reduction="sum")
        return [c / s if s else math.nan for c, s in zip(correct[1:].tolist(), supervised[1:].tolist())]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add per-slot accuracy `acc_k` and the simulated acceptance length `sim_tau` to the usual logs."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        accuracy = self.slot_accuracy(mode)
        if accuracy and ("loss" in logs or "eval_loss" in logs):
            prefix = "eval_" if mode == "eval" else ""
            logs[f"{prefix}acc_1"] = accuracy[0]
            logs[f"{prefix}acc_mean"] = sum(a for a in accuracy if not math.isnan(a)) / max(len(accuracy), 1)
            logs[f"{prefix}sim_tau"] = simulated_acceptance_length(accuracy)
            self._metrics[mode] = defaultdict(int)
        super().log(logs, start_time)

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


class _EpochAnchorsCallback(TrainerCallback):
    """Re-draw the collator's anchors at every epoch."""

    def __init__(self, collator: Any):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        if hasattr(self.collator, "set_epoch"):
            self.collator.set_epoch(int(state.epoch or 0))


class RealAcceptanceCallback(TrainerCallback):
    """Every `every_n_steps` optimizer steps (and at the end), log the real acceptance length `real_tau`."""

    def __init__(self, trainer: DFlashTrainer, every_n_steps: int):
        self.trainer = trainer
        self.every_n_steps = every_n_steps

    def on_train_begin(self, args, state, control, **kwargs):
        # A run resumed from a checkpoint starts with that checkpoint's log history: carry the taus measured before
        # the interruption into the training info (the card's history), as the uninterrupted run has them.
        history = [[entry["step"], round(entry["real_tau"], 3)] for entry in state.log_history if "real_tau" in entry]
        if history:
            self.trainer.training_info.setdefault("training", {})["held_out_tau_by_step"] = history

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self._measure()

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step % self.every_n_steps != 0:
            self._measure()

    def _measure(self) -> None:
        metrics = self.trainer.measure_real_acceptance()
        training = self.trainer.training_info.setdefault("training", {})
        training.setdefault("held_out_tau_by_step", []).append(
            [self.trainer.state.global_step, round(metrics["real_tau"], 3)]
        )
        self.trainer.log(metrics)


__all__ = [
    "BlockLoss",
    "DFlashTrainer",
    "DFlashTrainingArguments",
    "RealAcceptanceCallback",
    "block_loss",
    "draft_training_forward",
    "expected_length_shares",
    "gather_at_slots",
    "verify_saved_draft",
]
