"""hf-dflash: lossless speculative decoding with a DFlash block-diffusion drafter, for any Hugging Face causal LM.

draft = DFlashForDrafting.from_pretrained("path/to/drafter")          # or .from_target(target) to train one
out = target.generate(**inputs, assistant_model=draft)                 # transformers' assisted decoding
out = hf_dflash.speculative_generate(target, draft, input_ids, mask)   # our batched loop, with statistics
planner = hf_dflash.VerifyPlanner()  # measured costs, fallback judgements, tree support: kept across calls
out = hf_dflash.speculative_generate(target, draft, input_ids, mask, verify_costs="auto", planner=planner)  # CPU
hf_dflash.optimize_for_cpu(target)   # CPU kernels for cheap block forwards (speculative_generate does it)
trainer = hf_dflash.DFlashTrainer(model=draft, target=target, args=hf_dflash.DFlashTrainingArguments(...), ...)

Folders by job, dependencies running one way: `model/` (the files copied next to a drafter's weights) <- `decoding/`
and `data/` <- `training/` <- `bench/` <- `cli/`. Every public name loads on first use (`DFlashTrainer` pulls in
`transformers.Trainer` and accelerate, which decoding does not need; nothing pulls in torch until a name is used).
The Auto classes learn the `dflash` model type when `hf_dflash.model` is first imported (`hf_dflash/model/__init__.py`).
"""

import importlib
from typing import Any

__version__ = "0.1.0"

# Every public name and the module that defines it, imported on first use (PEP 562), as transformers' own names are:
# `import hf_dflash` stays light, so `hf-dflash --help` answers without importing torch.
_MODULES = {
    "hf_dflash.decoding.cpu_kernels": ("CPUPreparation", "KernelChoices", "is_optimized_for_cpu", "optimize_for_cpu"),
    "hf_dflash.decoding.policy": ("VerifyCosts", "VerifyPlanner", "measure_verify_costs"),
    "hf_dflash.decoding.speculative": ("SpeculativeOutput", "SpeculativeStats", "speculative_generate"),
    "hf_dflash.model.configuration_dflash": ("DFlashConfig", "default_target_layer_ids"),
    "hf_dflash.model.generation_dflash": (
        "DFlashCandidateGenerator",
        "check_draft_fits_target",
        "enable_dflash_generate",
    ),
    "hf_dflash.model.modeling_dflash": ("DFlashForDrafting", "DFlashLayouts", "choose_mask_token_id"),
    "hf_dflash.training": ("DFlashTrainer", "DFlashTrainingArguments"),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'hf_dflash' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


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
