"""One prompt decoded greedily by the three paths a user can pick, timed, and whether they agree: plain
`target.generate`, transformers' `generate(assistant_model=draft)` and `hf_dflash.speculative_generate`
(what `hf-dflash demo` shows; `run_benchmark` does the same over prompt sets, with repeats and statistics)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from hf_dflash.decoding.policy import VerifyPlanner
from hf_dflash.decoding.speculative import speculative_generate
from hf_dflash.model.generation_dflash import synchronized_clock

PLAIN, ASSISTED, OURS = "target.generate", "generate(assistant_model=draft)", "speculative_generate"


@dataclass
class PathComparison:
    """One prompt decoded by each path: its sequences (`[1, prompt + new]`) and seconds, by path name."""

    prompt_len: int
    sequences: dict[str, Any]
    seconds: dict[str, float]
    stats: Any  # the `SpeculativeStats` of `speculative_generate`

    @property
    def new_tokens(self) -> int:
        """Tokens plain `generate` added (the count every path's rate is measured by)."""
        return self.sequences[PLAIN].shape[1] - self.prompt_len

    @property
    def identical(self) -> bool:
        """Whether every path returned plain `generate`'s sequence."""
        plain = self.sequences[PLAIN].tolist()
        return all(sequence.tolist() == plain for sequence in self.sequences.values())

    def tokens_per_second(self) -> dict[str, float]:
        """New tokens per second of each path."""
        return {name: self.new_tokens / seconds for name, seconds in self.seconds.items()}

    def summary(self) -> dict[str, Any]:
        """The JSON the demo prints last: new tokens, agreement, tau and each path's tokens/s."""
        summary = {"new_tokens": self.new_tokens, "identical": self.identical, "tau": self.stats.tau}
        return summary | {name: round(rate, 2) for name, rate in self.tokens_per_second().items()}


def compare_decoding_paths(
    target, draft, inputs: Mapping[str, Any], *, max_new_tokens: int, planner: VerifyPlanner | None = None
) -> PathComparison:
    """Decode `inputs` (a tokenizer's `input_ids` and `attention_mask`, batch 1) greedily three ways and time each.

    The models run as given: prepare both for the CPU first if wanted (`speculative_generate` is told not to). With
    a `planner`, both drafted paths verify what pays by its costs (measured here, before any timing, if it has
    none); without, they verify every proposal."""
    budget = {"max_new_tokens": max_new_tokens, "do_sample": False}
    costs = planner.costs_for(target, draft, batch_size=1) if planner is not None else None
    assisted_config = GenerationConfig(**budget, dflash_planner=planner)
    paths: dict[str, Callable[[], Any]] = {
        PLAIN: lambda: target.generate(**inputs, **budget),
        ASSISTED: lambda: target.generate(**inputs, assistant_model=draft, generation_config=assisted_config),
        OURS: lambda: speculative_generate(
            target,
            draft,
            inputs["input_ids"],
            inputs["attention_mask"],
            verify_costs=costs,
            planner=planner,
            optimize_cpu=False,
            **budget,
        ),
    }
    outputs, seconds = {}, {}
    with torch.no_grad():
        for name, path in paths.items():
            outputs[name], seconds[name] = _timed(path, target.device)
    ours = outputs[OURS]
    sequences = {PLAIN: outputs[PLAIN], ASSISTED: outputs[ASSISTED], OURS: ours.sequences}
    return PathComparison(inputs["input_ids"].shape[1], sequences, seconds, ours.stats)


def _timed(run: Callable[[], Any], device) -> tuple[Any, float]:
    """`run()` and its seconds, read on the device's clock (CUDA and MPS run asynchronously)."""
    start = synchronized_clock(device)
    result = run()
    return result, synchronized_clock(device) - start
