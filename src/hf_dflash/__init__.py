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

from hf_dflash.lazy_names import lazy_names

__version__ = "0.1.0"

# Every public name and the module that defines it, imported on first use (`hf_dflash.lazy_names`): `import hf_dflash`
# stays light, so `hf-dflash --help` answers without importing torch.
_MODULES = {
    "hf_dflash.decoding.cpu_kernels": (
        "CPUPreparation",
        "KernelChoices",
        "is_optimized_for_cpu",
        "optimize_draft_for_cpu",
        "optimize_for_cpu",
        "optimize_target_and_draft_for_cpu",
    ),
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
__getattr__, __dir__, __all__ = lazy_names(__name__, _MODULES, globals())
