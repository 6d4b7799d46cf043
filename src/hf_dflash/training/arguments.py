"""`DFlashTrainingArguments`: `TrainingArguments` plus what a DFlash drafter's training needs (the pair TRL keeps as
`SFTConfig` beside `SFTTrainer`). Every field is also a flag of `hf-dflash train`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_dflash.model.configuration_dflash import VARIANTS, DFlashConfig

from .collator import default_loss_decay_gamma
from .target_features import FEATURE_DTYPES, STORAGES

ATTENTION_BACKENDS = ("sdpa", "eager", "flex_attention")
DRAFT_INITS = ("random", "target")
# The flags that shape DFlash2's new parts; left unset, a new drafter takes DFlashConfig's defaults and an --init_draft
# DFlash2 drafter keeps its own.
DFLASH2_ARGUMENTS = ("selector_rank", "selector_top_k", "conv_group_size")


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
    variant: str = field(
        default="dflash",
        metadata={
            "help": "A new drafter's variant: 'dflash', or 'dflash2' (sublayer convolutions and a candidate selector); "
            "with --init_draft of a DFlash drafter, 'dflash2' converts it (its proposals unchanged at step 0)."
        },
    )
    selector_rank: int | None = field(
        default=None,
        metadata={
            "help": f"DFlash2: width R of the selector's codebooks (default {DFlashConfig.selector_rank}; an "
            "--init_draft DFlash2 drafter keeps its own, and a smaller R narrows it to its strongest components)."
        },
    )
    selector_top_k: int | None = field(
        default=None,
        metadata={
            "help": f"DFlash2: candidates K the selector keeps per slot (default {DFlashConfig.selector_top_k}, or "
            "the --init_draft's)."
        },
    )
    conv_group_size: int | None = field(
        default=None,
        metadata={
            "help": "DFlash2: channels sharing one dynamic convolution coefficient (default "
            f"{DFlashConfig.conv_group_size}, or the --init_draft's)."
        },
    )
    selector_loss_weight: float = field(
        default=1.0,
        metadata={
            "help": "DFlash2: weight of the selector's K-way cross-entropy (the target's token among each slot's "
            "candidates, previous token teacher-forced) added to the block loss."
        },
    )
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
        if self.remove_unused_columns:
            raise ValueError(
                "DFlashTrainer needs remove_unused_columns=False (the draft's forward takes no input_ids)."
            )
        self._check_drafter_fields()
        self._check_loss_fields()
        self._check_feature_cache_fields()

    def _check_drafter_fields(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}.")
        if not 1 <= self.num_draft_layers <= 64:
            raise ValueError(f"num_draft_layers must be between 1 and 64, got {self.num_draft_layers}.")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be at least 1, got {self.num_anchors}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if self.draft_init not in DRAFT_INITS:
            raise ValueError(f"draft_init must be one of {DRAFT_INITS}, got {self.draft_init!r}.")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}.")
        given = [name for name in DFLASH2_ARGUMENTS if getattr(self, name) is not None]
        if given and self.variant != "dflash2":
            raise ValueError(f"{given} set DFlash2's selector and convolutions: pass variant='dflash2' with them.")

    def _check_loss_fields(self) -> None:
        if self.loss_decay_gamma is None:
            self.loss_decay_gamma = default_loss_decay_gamma(self.block_size)
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma must be positive, got {self.loss_decay_gamma}.")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}.")
        if not 0.0 <= self.acceptance_loss_weight <= 1.0:
            raise ValueError(f"acceptance_loss_weight must be in [0, 1], got {self.acceptance_loss_weight}.")
        if self.selector_loss_weight < 0:
            raise ValueError(f"selector_loss_weight must be >= 0, got {self.selector_loss_weight}.")
        if self.lm_head_chunk_size < 1 or self.max_length < 2:
            raise ValueError("lm_head_chunk_size must be >= 1 and max_length >= 2.")
        if self.distill_top_k < 0:
            raise ValueError(f"distill_top_k must be >= 0, got {self.distill_top_k}.")

    def _check_feature_cache_fields(self) -> None:
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


__all__ = ["ATTENTION_BACKENDS", "DFLASH2_ARGUMENTS", "DRAFT_INITS", "DFlashTrainingArguments"]
