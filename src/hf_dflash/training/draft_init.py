"""Start a new drafter from its target's own weights instead of at random (`DFlashTrainingArguments.draft_init`).

A drafter of `L` layers takes the target's deepest `L` decoder layers, parameter by parameter wherever the name and
shape match (attention and MLP projections, q/k norms, the two pre-norms); `fc` starts as a selection of the deepest
tapped layer's features, `hidden_norm` as the first copied layer's input norm (so the context's keys and values are
what that target layer would compute from the same hidden states), and the final norm as the target's. Norms are
copied by their effective scale (`norm(ones)`), so Gemma's `1 + weight` parametrisation lands as the right scale in
the drafter's plain RMSNorm. What does not match (the target's activation, sandwich norms, biases) is left at the
drafter's own initialisation, and logged. A target with an unmerged PEFT LoRA adapter (a fine-tune) gives each wrapped
projection's effective weight (base plus the active adapters' delta), so the drafter starts from the fine-tune.

A DFlash2 drafter can also start from a trained DFlash (v1) drafter (`dflash2_from_dflash`): every v1 weight is kept,
the convolutions start as the identity and the successor codebook at zero, so it proposes exactly what the v1
drafter does until training moves them. A trained DFlash2 drafter's selector can be narrowed (`reduce_selector_rank`:
its strongest components kept) and its candidate count changed (`set_selector_top_k`) before it trains on.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from hf_dflash.model.configuration_dflash import DFLASH2_FIELDS, DFlashConfig
from hf_dflash.model.modeling_dflash import DFlashForDrafting

logger = logging.get_logger(__name__)

# Draft parameter path inside a layer -> where a target layer keeps the same role, in order of preference. Gemma's
# `post_attention_layernorm` normalises the attention output (a sandwich norm); its pre-MLP norm is
# `pre_feedforward_layernorm`, which is what the drafter's `post_attention_layernorm` is.
_ROLE_ALIASES = {"post_attention_layernorm.weight": ["pre_feedforward_layernorm.weight"]}


@torch.no_grad()
def initialize_draft_from_target(draft: DFlashForDrafting, target: PreTrainedModel) -> list[str]:
    """Overwrite `draft`'s weights with the target's where they fit (see the module docstring); returns the names of
    the draft parameters that were set. Raises `ValueError` when no layer weight of the target fits the drafter."""
    target_layers = decoder_layers(target)
    num_draft = draft.config.num_hidden_layers
    if num_draft > len(target_layers):
        raise ValueError(
            f"draft_init='target' needs one target layer per draft layer: the drafter has {num_draft}, the target "
            f"{len(target_layers)}. Use fewer draft layers or draft_init='random'."
        )
    sources = target_layers[len(target_layers) - num_draft :]  # the deepest layers, in order
    copied = []
    for index, (layer, source) in enumerate(zip(draft.layers, sources)):
        copied += [f"layers.{index}.{name}" for name in _copy_layer(layer, source)]
    if not copied:
        raise ValueError(
            f"draft_init='target': no weight of {type(target).__name__}'s decoder layers fits the drafter's (names "
            "or shapes differ, e.g. fused projections). Train from a random start with draft_init='random'."
        )
    _select_deepest_feature(draft)
    copied.append("fc.weight")
    if _copy_norm(draft.hidden_norm, _module(sources[0], "input_layernorm")):
        copied.append("hidden_norm.weight")
    if _copy_norm(draft.norm, getattr(target.get_decoder(), "norm", None)):
        copied.append("norm.weight")
    left = sorted(set(name for name, _ in draft.named_parameters()) - set(copied))
    logger.info(
        f"draft_init='target': {len(copied)} draft weights from target layers "
        f"{len(target_layers) - num_draft}..{len(target_layers) - 1}; left at their own initialisation: {left}"
    )
    return copied


def dflash2_from_dflash(draft: DFlashForDrafting, **fields: object) -> DFlashForDrafting:
    """A DFlash2 drafter that starts as `draft` (a DFlash v1 drafter): its weights, identity convolutions, a zero
    successor codebook. `fields` set the DFlash2 config fields (`selector_rank`, `selector_top_k`, `conv_group_size`,
    ...); the rest of the config is `draft`'s. Same dtype and device as `draft`."""
    if draft.config.variant != "dflash":
        raise ValueError(f"dflash2_from_dflash converts a DFlash (v1) drafter; this one is {draft.config.variant!r}.")
    unknown = sorted(set(fields) - set(DFLASH2_FIELDS))
    if unknown:
        raise ValueError(f"dflash2_from_dflash sets only the DFlash2 fields {list(DFLASH2_FIELDS)}; got {unknown}.")
    config = type(draft.config).from_dict(draft.config.to_dict() | {"variant": "dflash2", **fields})
    with draft.device:
        converted = DFlashForDrafting._from_config(config, dtype=draft.dtype)
    result = converted.load_state_dict(draft.state_dict(), strict=False)
    if result.unexpected_keys or any("conv" not in key and "selector" not in key for key in result.missing_keys):
        raise RuntimeError(f"dflash2_from_dflash: weights did not carry over ({result}).")
    converted.train(draft.training)
    return converted.to(draft.device)


def check_selector_reshape(config: DFlashConfig, fields: dict[str, int]) -> None:
    """Refuse DFlash2 `fields` that a trained DFlash2 drafter of `config` cannot take: a wider selector (its rank can
    only shrink), other convolution groups, or what no DFlash2 config takes (`DFlashConfig`'s own checks, e.g. more
    candidates than the draft vocabulary). Raises `ValueError`."""
    rank = fields.get("selector_rank", config.selector_rank)
    if rank > config.selector_rank:
        raise ValueError(
            f"selector_rank={rank}: a trained selector can only be narrowed (this drafter's rank is "
            f"{config.selector_rank}). Pass a rank between 1 and {config.selector_rank}, or train a wider one from a "
            "DFlash drafter with --variant dflash2."
        )
    if fields.get("conv_group_size", config.conv_group_size) != config.conv_group_size:
        raise ValueError(
            f"conv_group_size={fields['conv_group_size']}: this drafter's convolutions were trained with groups of "
            f"{config.conv_group_size} channels. Leave conv_group_size out to continue it."
        )
    type(config).from_dict(config.to_dict() | fields)  # the reshaped config, checked as any config is


@torch.no_grad()
def reduce_selector_rank(draft: DFlashForDrafting, rank: int) -> torch.LongTensor:
    """Narrow a DFlash2 drafter's selector, in place, to the `rank` components with the most weight, and return their
    indices (ascending) among the old ones.

    A pairwise score is `sum_r A[pred, r] * P[r] * B[c, r]` with `P = W h`: component r contributes at most
    `|A[:, r]| * |W[r]| * |B[:, r]|` (norms of its predecessor column, projection row and successor column) per unit
    hidden state, a product that rescaling the three factors cannot change. The components with the largest products
    are kept as they are; the pairwise scores lose exactly the dropped ones' terms, the unary logits nothing.
    """
    selector, current = draft.candidate_selector, draft.config.selector_rank
    check_selector_reshape(draft.config, {"selector_rank": rank})
    strength = (
        selector.predecessor_codebook.float().norm(dim=0)
        * selector.hidden_projection.weight.float().norm(dim=1)
        * selector.successor_codebook.float().norm(dim=0)
    )  # [R]
    kept = strength.topk(rank).indices.sort().values  # [rank]
    projection = selector.hidden_projection
    narrowed = nn.Linear(projection.in_features, rank, bias=False, device=projection.weight.device)
    narrowed.weight = nn.Parameter(projection.weight[kept].clone(), requires_grad=projection.weight.requires_grad)
    selector.hidden_projection = narrowed
    for name in ("predecessor_codebook", "successor_codebook"):
        codebook = getattr(selector, name)
        setattr(selector, name, nn.Parameter(codebook[:, kept].clone(), requires_grad=codebook.requires_grad))
    draft.config.selector_rank = rank
    share = (strength[kept].sum() / strength.sum()).item() if strength.sum() > 0 else 1.0
    logger.info(
        f"Selector narrowed from rank {current} to {rank}: the kept components carry {share:.1%} of its weight."
    )
    return kept


def set_selector_top_k(draft: DFlashForDrafting, top_k: int) -> None:
    """Keep `top_k` candidates per slot in a DFlash2 drafter's selector (no weight depends on the count)."""
    check_selector_reshape(draft.config, {"selector_top_k": top_k})
    draft.config.selector_top_k = top_k
    draft.candidate_selector.top_k = top_k


def decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The target's decoder layers: the `ModuleList` of its decoder with one entry per hidden layer."""
    num_layers = target.config.get_text_config().num_hidden_layers
    for module in target.get_decoder().modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"Cannot find {type(target).__name__}'s {num_layers} decoder layers; use draft_init='random'.")


def _copy_layer(layer: nn.Module, source: nn.Module) -> list[str]:
    """Copy each parameter of a draft layer from the target layer's parameter of the same role; the copied names."""
    source_params = _effective_parameters(source)
    copied = []
    for name, param in layer.named_parameters():
        for source_name in [name, *_ROLE_ALIASES.get(name, [])][::-1]:  # the alias first: it names the role
            if name.endswith("norm.weight"):
                if _copy_norm(_module(layer, name), _module(source, source_name)):
                    copied.append(name)
                    break
            elif source_name in source_params and source_params[source_name].shape == param.shape:
                param.copy_(source_params[source_name])
                copied.append(name)
                break
    return copied


def _effective_parameters(layer: nn.Module) -> dict[str, torch.Tensor]:
    """`layer`'s parameters by name; a PEFT-wrapped projection (`q_proj.base_layer`, `q_proj.lora_A`, ...) gives the
    weight it computes with under the plain name (`q_proj.weight`), and its base bias."""
    wrapped = {name: module for name, module in layer.named_modules() if hasattr(module, "base_layer")}
    params = {
        name: param
        for name, param in layer.named_parameters()
        if not any(name.startswith(f"{prefix}.") for prefix in wrapped)
    }
    for prefix, module in wrapped.items():
        params[f"{prefix}.weight"] = _lora_effective_weight(module, prefix)
        if getattr(module.base_layer, "bias", None) is not None:
            params[f"{prefix}.bias"] = module.base_layer.bias
    return params


def _lora_effective_weight(module: nn.Module, name: str) -> torch.Tensor:
    """A LoRA-wrapped linear layer's weight with its active, unmerged adapters' deltas added."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or any(module.use_dora.get(a, False) for a in module.active_adapters):
        raise ValueError(
            f"draft_init='target' reads a PEFT adapter's weights through plain LoRA layers only, and the target's "
            f"{name} is a {type(module).__name__}: merge the adapter into the target first (`merge_and_unload()`, "
            "or `--merge_target_adapter`)."
        )
    weight = module.base_layer.weight  # holds the deltas of the adapters merged into it already
    if module.disable_adapters:
        return weight
    for adapter in module.active_adapters:
        if adapter in module.lora_A and adapter not in module.merged_adapters:
            weight = weight + module.get_delta_weight(adapter)
    return weight


def _copy_norm(norm: nn.Module, source: nn.Module | None) -> bool:
    """Set an RMSNorm's weight to `source`'s effective scale `source(ones)` when `source` is an RMSNorm of the same
    width (probed in its own dtype: the target is never converted)."""
    if source is None or getattr(source, "bias", None) is not None:  # a LayerNorm shifts: not an RMSNorm's scale
        return False
    weight = getattr(source, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != norm.weight.shape:
        return False
    ones = torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)
    norm.weight.copy_(source(ones)[0])
    return True


def _select_deepest_feature(draft: DFlashForDrafting) -> None:
    """`fc` as `[0 ... 0 | I | 0 ...]`: the context starts as the deepest tapped layer's hidden states."""
    hidden = draft.config.hidden_size
    deepest = max(range(len(draft.config.target_layer_ids)), key=lambda i: draft.config.target_layer_ids[i])
    draft.fc.weight.zero_()
    draft.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden, dtype=draft.fc.weight.dtype)


def _module(root: nn.Module, parameter_name: str) -> nn.Module | None:
    """The module that holds `parameter_name` (`"self_attn.q_norm.weight"` -> `root.self_attn.q_norm`), if any."""
    try:
        return root.get_submodule(parameter_name.rsplit(".", 1)[0])
    except AttributeError:
        return None


__all__ = ["decoder_layers", "initialize_draft_from_target"]
