"""hf-dflash: lossless speculative decoding with a DFlash block-diffusion drafter, for any Hugging Face causal LM.

draft = DFlashForDrafting.from_pretrained("path/to/drafter")          # or .from_target(target) to train one
out = target.generate(**inputs, assistant_model=draft)                 # transformers' assisted decoding
out = hf_dflash.speculative_generate(target, draft, input_ids, mask)   # our batched loop, with statistics
planner = hf_dflash.VerifyPlanner()  # measured costs, fallback judgements, tree support: kept across calls
out = hf_dflash.speculative_generate(target, draft, input_ids, mask, verify_costs="auto", planner=planner)  # CPU
hf_dflash.optimize_for_cpu(target)   # CPU kernels for cheap block forwards (speculative_generate does it)
trainer = hf_dflash.DFlashTrainer(model=draft, target=target, args=hf_dflash.DFlashTrainingArguments(...), ...)

Folders by job, dependencies running one way: `model/` (the files copied next to a drafter's weights) <- `decoding/`
and `data/` <- `training/` <- `bench/` <- `cli/`. The training names load on first use (`DFlashTrainer` pulls in
`transformers.Trainer` and accelerate, which decoding does not need).
"""

from typing import Any

from transformers import AutoConfig, AutoModel

from hf_dflash.decoding.cpu_kernels import CPUPreparation, KernelChoices, is_optimized_for_cpu, optimize_for_cpu
from hf_dflash.decoding.policy import VerifyCosts, VerifyPlanner, measure_verify_costs
from hf_dflash.decoding.speculative import SpeculativeOutput, SpeculativeStats, speculative_generate
from hf_dflash.model.configuration_dflash import DFlashConfig, default_target_layer_ids
from hf_dflash.model.generation_dflash import DFlashCandidateGenerator, check_draft_fits_target, enable_dflash_generate
from hf_dflash.model.modeling_dflash import DFlashForDrafting, DFlashLayouts, choose_mask_token_id

__version__ = "0.1.0"

AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashForDrafting, exist_ok=True)
# `save_pretrained` then writes `auto_map` and copies the remote-code files next to the weights.
DFlashConfig.register_for_auto_class()
DFlashForDrafting.register_for_auto_class("AutoModel")

_TRAINING_NAMES = ("DFlashTrainer", "DFlashTrainingArguments")


def __getattr__(name: str) -> Any:
    if name in _TRAINING_NAMES:
        from hf_dflash import training

        return getattr(training, name)
    raise AttributeError(f"module 'hf_dflash' has no attribute {name!r}")


__all__ = [
    "CPUPreparation",
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashForDrafting",
    "DFlashLayouts",
    "DFlashTrainer",
    "DFlashTrainingArguments",
    "KernelChoices",
    "SpeculativeOutput",
    "SpeculativeStats",
    "VerifyCosts",
    "VerifyPlanner",
    "check_draft_fits_target",
    "choose_mask_token_id",
    "default_target_layer_ids",
    "enable_dflash_generate",
    "is_optimized_for_cpu",
    "measure_verify_costs",
    "optimize_for_cpu",
    "speculative_generate",
]
