"""What a benchmark run compares and how: the method names, the baselines and `BenchmarkConfig`.

Design: plain data only (names, reasons, a config dataclass, a tokenized prompt), so that the methods, the harness and
the report all read one definition without importing one another, and `hf-dflash bench --help` reads it without
importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BASELINE = "plain"
STOCK_BASELINE = "plain_stock"  # plain decoding with the stock kernels, when the target was prepared for the CPU
FAST_BASELINE = "plain_fast"  # plain decoding with fast mode's kernels, when the target was prepared exact
OTHER_KERNEL_PLAINS = (STOCK_BASELINE, FAST_BASELINE)  # their outputs may differ from `plain`'s: not failures
ALL_METHODS = (
    "plain",
    "prompt_lookup",
    "native",
    "assisted",
    "ours",
    "ours_chain",
    "ours_tree16",
    "ours_full_block",
    "ours_argmax",
)
CORE_METHODS = ("plain", "assisted", "ours")  # what prompts beyond `full_comparison_limit` run (with every plain)
# Left out where they would repeat another method or cannot run (`methods.not_applicable`):
GREEDY_ONLY = {
    "ours_chain": "under sampling `ours` verifies chains already",
    "ours_tree16": "draft trees are verified for greedy decoding only",
}
SAMPLING_ONLY = {"ours_argmax": "greedy decoding proposes the draft's argmax already (it is `ours`)"}
TREE_METHODS = ("ours_tree16",)
PEER_ENGINES = ("llama.cpp", "openvino")  # serving engines `bench.peers` runs beside ours
COST_CURVE_TOKENS = 32  # the target's forward is timed over 1 .. 32 new tokens (>= 16 tree nodes + the bonus)


@dataclass
class BenchmarkConfig:
    """What `run_benchmark` runs. The prompt sets are read with `hf_dflash.data.prompts` unless prompts are passed in."""

    datasets: tuple[str, ...] = ("gsm8k", "humaneval", "mt-bench")  # "name:N" takes N prompts of it, not `limit`
    limit: int = 10  # prompts per dataset
    methods: tuple[str, ...] = ALL_METHODS  # `plain` and the `plain_threads` variants are always added: baselines
    plain_threads: tuple[int, ...] = ()  # also time `plain` at these torch thread counts; the faster is the baseline
    full_comparison_limit: int | None = None  # only the first M prompts of a dataset run every method; None: all do
    core_methods: tuple[str, ...] = CORE_METHODS  # what the prompts beyond `full_comparison_limit` run
    max_new_tokens: int = 200
    repeats: int = 1
    do_sample: bool = False  # sampled outputs differ between paths by design: the identity check needs greedy
    seed: int = 0
    prompt_lookup_num_tokens: int = 10
    warmup_new_tokens: int = 16  # enough for a couple of draft rounds on every path
    draft_block_sizes: tuple[int, ...] = (4, 8, 16)  # empty: skip the draft-forward timing
    draft_timing_repeats: int = 20
    draft_context_len: int = 128  # cached context the timed draft forward attends to (a typical prompt length)
    batch_sizes: tuple[int, ...] = (1, 4, 8)  # empty: skip the batched-throughput comparison
    verify_costs: str | None = "auto"  # `ours`, `assisted`: "auto" verifies what pays (decoding.policy); None: all
    progress: bool = True
    peers: tuple[str, ...] = ()  # serving engines also run on the prompts, plain and with the drafter (bench.peers)
    peer_target_gguf: str | None = None  # the target's GGUF, for the llama.cpp peer


@dataclass(frozen=True)
class BenchmarkPrompt:
    """A tokenized prompt: a stable id (`"gsm8k/17"`), its dataset, and `[L]` token ids (chat template applied)."""

    id: str
    dataset: str
    input_ids: torch.LongTensor
