"""What a benchmark run compares and how: the method names, the baselines and `BenchmarkConfig`.

Design: plain data only (names, reasons, a config dataclass, a tokenized prompt), so that the methods, the harness and
the report all read one definition without importing one another, and `hf-dflash bench --help` reads it without
importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_dflash.offline import KNOWN_PROMPT_SETS

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
    """What `run_benchmark` runs. The prompt sets are read with `hf_dflash.data.prompts` unless prompts are passed in.

    Each field's `help` is also its `hf-dflash bench` flag's help (`hf_dflash.cli.flags.add_dataclass_flags`), and its
    `group` the section of `--help` it is listed in, so a default is written only here."""

    datasets: tuple[str, ...] = field(
        default=("gsm8k", "humaneval", "mt-bench"),
        metadata={
            "help": f"prompt sets ({', '.join(KNOWN_PROMPT_SETS)}); NAME:N takes the first N prompts of NAME instead "
            "of --limit (e.g. mt-bench:10)",
            "metavar": "SET",
            "nargs": "+",
            "group": "prompts",
        },
    )
    limit: int = field(default=10, metadata={"help": "prompts per dataset", "group": "prompts"})
    methods: tuple[str, ...] = field(
        default=ALL_METHODS,
        metadata={
            "help": "decoding paths to time (ours_chain and ours_tree16 run greedy only, ours_argmax under "
            "--do_sample only); plain and the --plain_threads variants always run: they are the baselines",
            "choices": ALL_METHODS,
            "metavar": "METHOD",
            "nargs": "+",
            "group": "methods",
        },
    )
    plain_threads: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "also time plain generate at these torch thread counts, each plain variant (plain_threadsN, "
            "plain_stock_threadsN, plain_fast_threadsN; the default count is `plain`); every speedup is against the "
            "fastest plain of each dataset",
            "metavar": "N",
            "group": "methods",
        },
    )
    full_comparison_limit: int | None = field(
        default=None,
        metadata={
            "help": "only the first M prompts of a dataset run every method, the others --core_methods (default: "
            "every prompt runs every method)",
            "metavar": "M",
            "group": "methods",
        },
    )
    core_methods: tuple[str, ...] = field(
        default=CORE_METHODS,
        metadata={
            "help": "what the prompts past --full_comparison_limit run (every plain variant runs on every prompt)",
            "choices": ALL_METHODS,
            "metavar": "METHOD",
            "nargs": "+",
            "group": "methods",
        },
    )
    max_new_tokens: int = field(
        default=200, metadata={"help": "tokens generated per prompt on each path", "group": "decoding"}
    )
    repeats: int = field(
        default=1,
        metadata={
            "help": "timed runs of each prompt on each path (each its own row of the report)",
            "group": "decoding",
        },
    )
    do_sample: bool = field(  # sampled outputs differ between paths by design: the identity check needs greedy
        default=False,
        metadata={
            "help": "sample (outputs are then not compared); adds ours_argmax, the draft's argmax proposed with a "
            "one-hot q",
            "group": "decoding",
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of each prompt's sampling (--do_sample)", "group": "decoding"}
    )
    prompt_lookup_num_tokens: int = field(
        default=10, metadata={"help": "tokens prompt_lookup proposes per round", "group": "decoding"}
    )
    warmup_new_tokens: int = field(  # enough for a couple of draft rounds on every path
        default=16, metadata={"help": "tokens of each path's untimed warm-up run", "group": "decoding"}
    )
    draft_block_sizes: tuple[int, ...] = field(
        default=(4, 8, 16),
        metadata={
            "help": "block sizes at which one draft forward is timed (empty: skip)",
            "metavar": "B",
            "group": "sub-benchmarks",
        },
    )
    draft_timing_repeats: int = field(
        default=20, metadata={"help": "timed draft forwards per block size", "group": "sub-benchmarks"}
    )
    draft_context_len: int = field(
        default=128,
        metadata={
            "help": "cached context the timed draft forward attends to (a typical prompt length)",
            "group": "sub-benchmarks",
        },
    )
    batch_sizes: tuple[int, ...] = field(
        default=(1, 4, 8),
        metadata={
            "help": "batch sizes of the batched ours-vs-plain throughput comparison (empty: skip)",
            "metavar": "N",
            "group": "sub-benchmarks",
        },
    )
    # `ours`, `assisted`: "auto" verifies what pays (decoding.policy); None: all (the command's --verify auto|all)
    verify_costs: str | None = "auto"
    progress: bool = field(default=True, metadata={"help": "show progress bars on stderr", "group": "output"})
    peers: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "serving engines also run on the prompts, plain and with the drafter (bench.peers; needs "
            "scripts/install_engines.sh, with --openvino for OpenVINO)",
            "choices": PEER_ENGINES,
            "metavar": "ENGINE",
            "group": "peers",
        },
    )
    peer_target_gguf: str | None = field(
        default=None,
        metadata={
            "help": "the target's GGUF for the llama.cpp peer (default for a packaged target: its package's GGUF)",
            "group": "peers",
        },
    )
    # sampling settings (added after the rest: reports keep their config keys in order)
    temperature: float | None = field(
        default=None,
        metadata={
            "help": "sampling temperature (--do_sample; default: the target's generation config)",
            "group": "decoding",
        },
    )
    top_p: float | None = field(
        default=None,
        metadata={
            "help": "nucleus sampling's p (--do_sample; default: the target's generation config)",
            "group": "decoding",
        },
    )
    top_k: int | None = field(
        default=None,
        metadata={
            "help": "top-k sampling's k, 0: off (--do_sample; default: the target's generation config)",
            "group": "decoding",
        },
    )


@dataclass(frozen=True)
class BenchmarkPrompt:
    """A tokenized prompt: a stable id (`"gsm8k/17"`), its dataset, and `[L]` token ids (chat template applied)."""

    id: str
    dataset: str
    input_ids: torch.LongTensor
