"""The files copied next to a drafter's weights (`configuration_dflash`, `modeling_dflash`, `generation_dflash`, and
what they import), and the one place the Auto classes learn the `dflash` model type.

The registration runs once, when anything under `hf_dflash.model` is first imported (as `hf_dflash.DFlashForDrafting`
does): `AutoConfig` and `AutoModel` then resolve `model_type: "dflash"` without remote code, and `save_pretrained`
writes `auto_map` and copies the remote-code files next to the weights.
"""

from transformers import AutoConfig, AutoModel

from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashForDrafting

AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashForDrafting, exist_ok=True)
DFlashConfig.register_for_auto_class()
DFlashForDrafting.register_for_auto_class("AutoModel")
