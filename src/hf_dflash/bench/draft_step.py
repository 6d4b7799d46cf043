"""The draft's step time per block size (paper, Figure 3): a fresh drafter with the same layers, timed inside the
benchmark process.

Design: the step is the one inside the decoding loop (`context_len` context tokens already cached, one new context
token, the block's forward, then the target's LM head on the drafted positions over the draft vocabulary); two
warm-up steps, then the median of `repeats`, on the device's own clock. A failure here never costs the main
benchmark: the harness records it as a `SubBenchmarkError`. Returns plain dicts (the keys of `report.DraftStepTime`),
which `benchmarks/scripts/` read too.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from hf_dflash.bench.statistics import median
from hf_dflash.model.generation_dflash import draft_forward, greedy_head_step, synchronized_clock
from hf_dflash.model.modeling_dflash import DFlashForDrafting

logger = logging.get_logger(__name__)


@torch.no_grad()
def time_draft_forward(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    block_sizes: Sequence[int],
    repeats: int = 20,
    context_len: int = 128,
) -> list[dict[str, Any]]:
    """Median time of one draft step (forward over `[anchor, MASK x (B-1)]` + the target's LM head on the B-1
    drafted positions) for a fresh drafter with the same layers, per block size B.

    The step is the one inside the decoding loop (`generation_dflash.draft_forward`): `context_len` context tokens
    already cached, one new context token.
    """
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    device, num_features = target.device, len(draft.config.target_layer_ids) * draft.config.hidden_size
    results = []
    for block_size in block_sizes:
        config = copy.deepcopy(draft.config)
        config.block_size = block_size
        torch.manual_seed(0)
        with device:  # initialised where it runs: a target-sized drafter is slow to initialise on a CPU and copy
            fresh = DFlashForDrafting(config).to(dtype=draft.dtype).eval()
        cache = DynamicCache(config=fresh.config)
        cache.activate_past_recording()  # sliding draft layers must be able to crop the block back
        anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
        context = torch.randn(1, context_len, num_features, device=device, dtype=draft.dtype)
        all_positions = torch.arange(context_len + 1 + block_size, device=device)[None]
        draft_forward(fresh, embed, anchor, context, all_positions[:, : context_len + block_size], cache=cache)
        step_times, head_times = [], []
        for attempt in range(repeats + 2):  # two warm-up steps
            start = synchronized_clock(device)
            hidden = draft_forward(fresh, embed, anchor, context[:, :1], all_positions[:, context_len:], cache=cache)
            head_start = synchronized_clock(device)
            greedy_head_step(fresh, lm_head, hidden[:, 1:], anchor[:, 0])  # as the loop does
            end = synchronized_clock(device)
            cache.crop(-1)  # back to `context_len` cached tokens
            if attempt >= 2:
                step_times.append(end - start)
                head_times.append(end - head_start)
        results.append(
            {
                "block_size": block_size,
                "draft_layers": config.num_hidden_layers,
                "median_ms": 1000 * median(step_times),
                "lm_head_median_ms": 1000 * median(head_times),
                "repeats": repeats,
                "context_len": context_len,
            }
        )
        logger.info(f"draft step at block size {block_size}: {results[-1]['median_ms']:.2f} ms")
    return results
