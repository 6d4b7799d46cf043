"""Where one round of `speculative_generate` spends its time, beside bare target forwards over the same tokens.

The loop runs as `speculative._decode` runs it (the module's own step functions: `propose`, `verify`, `accept`,
`keep_accepted`, `commit`), with its inner calls wrapped so each phase is timed in place: the draft forward, the
draft head and plan (the rest of `propose`), the verify inputs (`verify` less its forward), the verify forward, the
acceptance, the cache prune (`crop` / `keep_path`), the rest of `keep_accepted` (features, masks), `commit`, and the
loop's own Python (a round's wall time less all of these). After each round the same number of tokens goes through
the target twice more, the cache cropped back after each:

- `bare`: no mask, no positions, as `measure_verify_costs` times it (what the planner's cost model counts on);
- `masked`: the round's own 2D key mask and positions (a chain), to split the mask's cost from the forward's.

Every round has the same shape: chains of k proposals (the first k of the draft's chain), best-first trees of N
nodes, or sampled chains of k (temperature 0.7, top-p 0.95, top-k off: samples of the draft's q, Leviathan
acceptance against the target's warped distributions), batch 1, on GSM8K prompts, in the modes `bf16-exact` (bf16
weights, exact kernels: the bench's lossless setting) and `fp32-fast`.

OMP_WAIT_POLICY=PASSIVE python benchmarks/scripts/probe_round_profile.py --modes bf16-exact fp32-fast \
    --chains 2 4 8 --trees 4 8 16 --sampled_chains 2 4 8 --prompts 3 --max_new_tokens 96 [--threads 1] \
    --output benchmarks/results/round_profile.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache

from hf_dflash import DFlashForDrafting
from hf_dflash.bench.harness import load_benchmark_prompts
from hf_dflash.decoding import speculative
from hf_dflash.decoding.cpu_kernels import optimize_target_and_draft_for_cpu
from hf_dflash.decoding.policy import VerifyPlanner
from hf_dflash.loading import committed_drafter
from hf_dflash.targets import load_target

SAMPLING_TEMPERATURE = 0.7
MODES = {"bf16-exact": (torch.bfloat16, True), "fp32-fast": (torch.float32, False)}
PHASES = (
    "draft_forward",
    "draft_head_and_plan",
    "verify_inputs",
    "verify_forward",
    "accept",
    "cache_prune",
    "keep_rest",
    "commit",
    "loop_python",
)


class PhaseClock:
    """Seconds per phase within the current round."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed


def instrument(clock: PhaseClock, num_nodes: int, tree: bool):
    """Wrap the loop's inner calls (looked up by name at call time) and fix each round's shape; returns `undo`."""
    saved = {name: getattr(speculative, name) for name in ("draft_block", "target_forward", "keep_path", "_planned")}
    crop = DynamicCache.crop
    speculative.draft_block = clock.wrap("draft_forward", saved["draft_block"])
    speculative.target_forward = clock.wrap("verify_forward", saved["target_forward"])
    speculative.keep_path = clock.wrap("cache_prune", saved["keep_path"])
    speculative._planned = lambda setup, state, candidates: candidates if tree else candidates.first(num_nodes)
    DynamicCache.crop = clock.wrap("cache_prune", crop)

    def undo():
        for name, function in saved.items():
            setattr(speculative, name, function)
        DynamicCache.crop = crop

    return undo, crop


def forward_seconds(target, cache, crop, ids, mask=None, positions=None) -> float:
    """One target forward over `ids` after `cache` (with the tapped hidden states), then cropped off again."""
    kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": positions}
    layers = [1, target.config.num_hidden_layers // 2]
    start = time.perf_counter()
    target(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=layers, **kwargs)
    seconds = time.perf_counter() - start
    crop(cache, -ids.shape[1])
    return seconds


def profile_run(setup, state, stats, clock: PhaseClock, crop, rounds: list[dict]) -> None:
    """`speculative._decode`'s rounds, timed phase by phase (batch 1, no fallback, no streamer)."""
    while not bool(state.done.all()):
        clock.seconds.clear()
        start = time.perf_counter()
        propose_start = time.perf_counter()
        proposal = speculative.propose(setup, state)
        propose_seconds = time.perf_counter() - propose_start
        if not proposal.drafted:  # the last token: a plain step, not a profiled round
            break
        verify_start = time.perf_counter()
        out = speculative.verify(setup, state, proposal.tree)
        verify_seconds = time.perf_counter() - verify_start
        path, lengths, new_bonus = clock.wrap("accept", speculative.accept)(setup, proposal, out.logits)
        keep_start = time.perf_counter()
        tokens = speculative.keep_accepted(setup, state, proposal.tree, out.hidden_states, path, lengths)
        keep_seconds = time.perf_counter() - keep_start
        accepted = [row[: n - 1] + [b] for row, n, b in zip(tokens.tolist(), lengths.tolist(), new_bonus.tolist())]
        clock.wrap("commit", speculative.commit)(setup, state, accepted, stats, None, True)
        stats.record_plan(proposal.tree, drafted=True)
        state.bonus = new_bonus
        wall = time.perf_counter() - start
        phases = dict(clock.seconds)
        phases["draft_head_and_plan"] = propose_seconds - phases["draft_forward"]
        phases["verify_inputs"] = verify_seconds - phases["verify_forward"]
        phases["keep_rest"] = keep_seconds - phases.get("cache_prune", 0.0)
        phases["cache_prune"] = phases.get("cache_prune", 0.0)
        phases["loop_python"] = wall - sum(phases[name] for name in PHASES if name != "loop_python")
        num_tokens = proposal.tree.num_nodes + 1
        ids = torch.randint(0, 1000, (1, num_tokens))
        positions = state.next_position[:, None] + torch.arange(num_tokens)
        mask = torch.cat([state.key_mask, state.key_mask.new_ones(1, num_tokens)], dim=1)
        phases["bare_forward"] = forward_seconds(setup.target, state.cache, crop, ids)
        phases["masked_forward"] = forward_seconds(setup.target, state.cache, crop, ids, mask, positions)
        rounds.append({"tokens": num_tokens, "committed": int(lengths[0]), "wall": wall, **phases})


def profile_shape(
    target, draft, prompts, max_new_tokens: int, num_nodes: int, tree: bool, sampled: bool = False
) -> dict:
    """Median ms per round of each phase over every round of `prompts`, for one round shape."""
    torch.manual_seed(0)
    clock = PhaseClock()
    undo, crop = instrument(clock, num_nodes, tree)
    rounds: list[dict] = []
    try:
        for ids in prompts:
            setup = _setup(target, draft, max_new_tokens, num_nodes if tree else 0, sampled)
            stats = speculative.SpeculativeStats(block_size=draft.config.block_size)
            state = speculative.prefill(setup, ids, torch.ones_like(ids), stats)
            speculative.commit(setup, state, [[t] for t in state.bonus.tolist()], stats, None, count_round=False)
            profile_run(setup, state, stats, clock, crop, rounds)
    finally:
        undo()
    keys = ("wall", *PHASES, "bare_forward", "masked_forward")
    summary = {key: round(1000 * statistics.median(r[key] for r in rounds), 3) for key in keys}
    summary["verify_over_bare"] = round(
        statistics.median((r["verify_forward"] + r["verify_inputs"]) / r["bare_forward"] for r in rounds), 3
    )
    summary["round_minus_draft_over_bare"] = round(
        statistics.median((r["wall"] - r["draft_forward"]) / r["bare_forward"] for r in rounds), 3
    )
    summary["tau"] = round(statistics.mean(r["committed"] for r in rounds), 3)
    return {
        "shape": f"{'sampled-' if sampled else ''}{'tree' if tree else 'chain'}-{num_nodes}",
        "tokens": num_nodes + 1,
        "rounds": len(rounds),
        "ms": summary,
    }


def _setup(target, draft, max_new_tokens: int, max_tree_nodes: int, sampled: bool):
    parameters = speculative.inspect.signature(target.forward).parameters
    warpers = speculative.LogitsProcessorList()
    if sampled:
        sampling = GenerationConfig(do_sample=True, temperature=SAMPLING_TEMPERATURE, top_p=0.95, top_k=0)
        warpers = speculative._sampling_warpers(sampling)
    return speculative._Setup(
        target=target,
        draft=draft,
        max_new_tokens=max_new_tokens,
        do_sample=sampled,
        warpers=warpers,
        temperature=SAMPLING_TEMPERATURE if sampled else None,
        eos_ids=speculative.token_ids(target.generation_config.eos_token_id),
        pad_token_id=0,
        pass_positions="position_ids" in parameters,
        pass_logits_to_keep="logits_to_keep" in parameters,
        verify_costs=None,
        learns_overhead=False,
        planner=VerifyPlanner(),
        max_tree_nodes=max_tree_nodes,
        sample_proposals=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["bf16-exact", "fp32-fast"])
    parser.add_argument("--chains", nargs="*", type=int, default=[2, 4, 6, 8])
    parser.add_argument("--trees", nargs="*", type=int, default=[4, 8, 12, 16])
    parser.add_argument("--sampled_chains", nargs="*", type=int, default=[2, 4, 6])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (2 cores: try 1)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for mode in args.modes:
        dtype, exact = MODES[mode]
        target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
        draft = DFlashForDrafting.from_pretrained(committed_drafter("smollm2-135m-instruct")).to(dtype).eval()
        optimize_target_and_draft_for_cpu(target, draft, exact=exact)
        prompts = [p.input_ids[None] for p in load_benchmark_prompts(tokenizer, ["gsm8k"], args.prompts)]
        with torch.no_grad():
            profile_shape(target, draft, prompts[:1], 16, 4, False)  # warm-up
            shapes = [(k, False, False) for k in args.chains] + [(n, True, False) for n in args.trees]
            shapes += [(k, False, True) for k in args.sampled_chains]
            for num_nodes, tree, sampled in shapes:
                shape = profile_shape(target, draft, prompts, args.max_new_tokens, num_nodes, tree, sampled)
                row = {"mode": mode, **shape}
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.output:
        conditions = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "dataset": "gsm8k",
            "batch": 1,
        }
        with open(args.output, "w") as handle:
            json.dump({"conditions": conditions, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
