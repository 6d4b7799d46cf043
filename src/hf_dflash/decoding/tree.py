"""Draft trees: what one target forward verifies, built from one DFlash draft pass.

A DFlash draft gives a distribution `q_d` at every slot `d = 1 .. B-1` of the block in one forward. A chain verifies
the argmax of each slot; a tree verifies several candidates per slot at once (DDTree, Ringel and Romano, arXiv
2604.12989): node `i` holds a token at depth `d_i` and a parent (`-1`: the bonus token, depth 0), and its path
probability is the product of the slots' probabilities of the tokens on its path. `best_first_tree` takes the `N`
nodes of highest path probability from the slots' top-k (prefix-closed, since a child's path probability is at most
its parent's); a chain is the tree whose nodes each have one child.

The target verifies `[bonus, node_1 .. node_N]` in one forward: each node attends to the committed tokens, the bonus,
its ancestors and itself (`tree_attention_mask`) at position `bonus + depth`. Under greedy decoding a node is accepted
when its token is the target's argmax after its parent and its parent is accepted (`accept_greedy`); at most one node
per depth can be, so the accepted nodes form one path, whose tokens (then the target's token after the deepest one)
are committed. The output is the target's own: every committed token is the target's argmax after the committed
tokens before it.

Shapes: `b` rows, `N` nodes, `C` cached tokens, `S` slots, `K` candidates per slot.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import logging

logger = logging.get_logger(__name__)

ROOT = -1  # parent id of depth-1 nodes: the bonus token


@dataclass(frozen=True)
class DraftTree:
    """Nodes to verify, parents before children. `tokens`, `parents` (node index or `ROOT`) and `depths` are `[b, N]`;
    `path_probs` `[b, N]` is each node's path probability under the draft (what the planner counts on)."""

    tokens: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    path_probs: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @functools.cached_property  # asked by verify, keep and the stats each round: one device sync, not three
    def is_chain(self) -> bool:
        """Every node the child of the one before it (verified with a plain causal mask)."""
        chain = torch.arange(self.num_nodes, device=self.parents.device) - 1
        return bool((self.parents == chain).all())

    def first(self, num_nodes: int) -> DraftTree:
        """The first `num_nodes` nodes (best first, so still a tree)."""
        return DraftTree(
            *(field[:, :num_nodes] for field in (self.tokens, self.parents, self.depths, self.path_probs))
        )


def chain(tokens: torch.LongTensor, probs: torch.Tensor) -> DraftTree:
    """The chain `[b, S]` of one proposal per slot, with the draft's probability of each `[b, S]`."""
    batch, slots = tokens.shape
    index = torch.arange(slots, device=tokens.device).expand(batch, -1)
    return DraftTree(tokens, index - 1, index + 1, probs.float().cumprod(-1))


def best_first_tree(top_ids: torch.LongTensor, top_probs: torch.Tensor, num_nodes: int) -> DraftTree:
    """The `num_nodes` nodes of highest path probability per row, from each slot's top-k `[b, S, K]`, best first.

    A node at depth `d` extends its parent with one of slot `d`'s candidates; its path probability is the product of
    its path's slot probabilities. Rows with fewer possible nodes than asked (`K^S` in all) are never short here:
    callers ask for at most `S * K` nodes, which a row always has.
    """
    k = top_ids.shape[2]
    slot_probs = top_probs.float().cpu().tolist()  # [b][S][K]
    transitions = [[[slot] * k for slot in row] for row in slot_probs]  # every parent sees its slot's list (shared)
    return _tree(top_ids, transitions, num_nodes)


def lattice_tree(candidate_ids: torch.LongTensor, transition_probs: torch.Tensor, num_nodes: int) -> DraftTree:
    """`best_first_tree` where a candidate's probability depends on its parent's: `candidate_ids` `[b, S, K]` and
    `transition_probs` `[b, S, K, K]`, entry `[i, p, c]` the probability of slot i's candidate c after slot i - 1's
    candidate p (slot 0: every row `p` is the bonus token's). DFlash2's selector scores such a lattice
    (`SelectorLattice.scores`; the loop passes `SelectorLattice.transition_probs`); its best paths
    make the tree."""
    return _tree(candidate_ids, transition_probs.float().cpu().tolist(), num_nodes)


def _tree(candidate_ids: torch.LongTensor, transitions: list, num_nodes: int) -> DraftTree:
    """The best-first tree of each row's `transitions[i][p][c]` (host lists) over `candidate_ids` `[b, S, K]`."""
    batch, slots, k = candidate_ids.shape
    num_nodes = min(num_nodes, slots * k)
    rows = [_best_first_row(row, num_nodes) for row in transitions]  # [(parents, depths, candidate, prob)]
    parents = torch.tensor([[node[0] for node in row] for row in rows], dtype=torch.long)
    depths = torch.tensor([[node[1] for node in row] for row in rows], dtype=torch.long)
    candidate = torch.tensor([[node[2] for node in row] for row in rows], dtype=torch.long)
    path_probs = torch.tensor([[node[3] for node in row] for row in rows], dtype=torch.float32)
    device = candidate_ids.device
    parents, depths, candidate = parents.to(device), depths.to(device), candidate.to(device)
    tokens = candidate_ids[torch.arange(batch, device=device)[:, None], (depths - 1).clamp(min=0), candidate]
    return DraftTree(tokens, parents, depths, path_probs.to(device))


def _best_first_row(transitions: list[list[list[float]]], num_nodes: int) -> list[tuple[int, int, int, float]]:
    """(parent, depth, candidate index, path probability) of one row's best nodes, popped from a max-heap;
    `transitions[i][p][c]`: slot i's candidate c after candidate p of slot i - 1."""
    heap = [(-prob, ROOT, 1, c) for c, prob in enumerate(transitions[0][0])]
    heapq.heapify(heap)
    nodes: list[tuple[int, int, int, float]] = []
    while heap and len(nodes) < num_nodes:
        negative_prob, parent, depth, candidate = heapq.heappop(heap)
        nodes.append((parent, depth, candidate, -negative_prob))
        if depth < len(transitions):  # its children: the next slot's candidates after this one
            index = len(nodes) - 1
            for c, prob in enumerate(transitions[depth][candidate]):
                heapq.heappush(heap, (negative_prob * prob, index, depth + 1, c))
    return nodes


def ancestors(parents: torch.LongTensor) -> torch.Tensor:
    """`[b, N + 1, N + 1]` boolean: entry `(i, j)` says node `j` is node `i` or one of its ancestors; index 0 is the
    bonus token (every node's root), node `n` is index `n + 1`."""
    batch, num_nodes = parents.shape
    sees = torch.eye(num_nodes + 1, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    rows = torch.arange(batch, device=parents.device)
    for node in range(num_nodes):  # parents come first, so their rows are complete
        sees[:, node + 1] |= sees[rows, parents[:, node] + 1]
    return sees


def tree_attention_mask(key_mask: torch.Tensor, parents: torch.LongTensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive `[b, 1, N + 1, C + N + 1]` mask for verifying `[bonus, nodes]` after `C` cached tokens: a query sees
    the cached tokens its row keeps (`key_mask` `[b, C]`), the bonus, its ancestors and itself."""
    num_queries = parents.shape[1] + 1
    cached = key_mask.bool()[:, None, :].expand(-1, num_queries, -1)  # [b, N + 1, C]
    visible = torch.cat([cached, ancestors(parents)], dim=-1)[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


def accept_greedy(tree: DraftTree, target_ids: torch.LongTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The accepted path per row and the target's token after it.

    `target_ids` `[b, N + 1]` is the target's argmax at `[bonus, nodes]`. Returns the path as verify-input indices
    `[b, 1 + depth]` (0 = the bonus, `n + 1` = node `n`; rows shorter than the longest are padded with their last
    index, see the returned lengths) and `(lengths [b], new_bonus [b])`. The walk runs on the host over one copy of
    the tree and the target's tokens: a few dozen integers, where tensor ops would cost one dispatch per node.
    """
    device = tree.tokens.device
    fields = torch.stack([tree.tokens, tree.parents, tree.depths, target_ids[:, 1:]]).tolist()  # 4 x [b, N]
    paths, bonus = [], []
    for tokens, parents, depths, after_node, after_bonus in zip(*fields, target_ids[:, 0].tolist()):
        after = [after_bonus, *after_node]  # the target's token after each verify input
        path = _accepted_path(tokens, parents, depths, after)
        paths.append(path)
        bonus.append(after[path[-1]])
    longest = max(len(path) for path in paths)
    padded = [path + path[-1:] * (longest - len(path)) for path in paths]
    lengths = torch.tensor([len(path) for path in paths], device=device)
    return torch.tensor(padded, device=device), lengths, torch.tensor(bonus, device=device)


def _accepted_path(tokens: list[int], parents: list[int], depths: list[int], after: list[int]) -> list[int]:
    """One row's accepted path as verify-input indices from the bonus (0) to its deepest accepted node: a node is
    accepted when its parent is and its token is the target's after the parent (parents come first)."""
    accepted = [True] + [False] * len(tokens)
    deepest = 0
    for node, (token, parent, depth) in enumerate(zip(tokens, parents, depths), start=1):
        accepted[node] = accepted[parent + 1] and token == after[parent + 1]
        if accepted[node] and depth > (depths[deepest - 1] if deepest else 0):
            deepest = node
    path = [deepest]
    while path[-1] != 0:
        path.append(parents[path[-1] - 1] + 1)
    return path[::-1]


def keep_path(cache: Cache, num_fed: int, path: torch.LongTensor) -> None:
    """Keep, of the last `num_fed` cached tokens (the verified `[bonus, nodes]`), only those at `path` `[b, L]`: the
    kept entries are written over the first `L` of those slots in place, and the rest cropped (a view), so a round
    copies `L` entries per layer rather than the whole cache."""
    length = path.shape[1]
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        index = path[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        start = layer.keys.shape[-2] - num_fed
        for states in (layer.keys, layer.values):
            tail = states[..., start:, :].gather(2, index.to(states.device))  # a copy: the writes below cannot alias
            states[..., start : start + length, :] = tail
    cache.crop(length - num_fed)


@torch.no_grad()
def supports_tree_verification(target: PreTrainedModel) -> bool:
    """Whether `target` verifies a tree exactly: one forward over `[b, a1, a2, c1]` with a tree mask (`a1`, `a2`
    siblings, `c1` a child of `a1`) must give the logits of the chains `[b, a1, c1]` and `[b, a2]` (three forwards
    over a few tokens; `VerifyPlanner.supports_trees` asks once per attention implementation). Targets that ignore a
    4D mask or per-token positions, and sliding-window targets, verify chains only."""
    if _tree_matches_chains(target):
        return True
    logger.info(f"{type(target).__name__} cannot verify draft trees in one forward; it verifies chains.")
    return False


def _tree_matches_chains(target: PreTrainedModel) -> bool:
    vocab = target.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, 5), generator=generator).to(target.device)
    bonus, a1, a2, c1 = torch.randint(0, vocab, (4,), generator=generator).tolist()

    def forward(tokens: list[int], **kwargs) -> torch.Tensor:
        cache = DynamicCache(config=target.config)
        target(input_ids=prompt, cache=cache, use_cache=True)
        ids = torch.tensor([tokens], device=target.device)
        return target(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits[0].float()

    try:
        parents = torch.tensor([[ROOT, ROOT, 0]], device=target.device)  # a1, a2 under the bonus; c1 under a1
        mask = tree_attention_mask(torch.ones(1, 5, device=target.device), parents, target.dtype)
        positions = torch.tensor([[5, 6, 6, 7]], device=target.device)
        tree = forward([bonus, a1, a2, c1], attention_mask=mask, position_ids=positions)
        first, second = forward([bonus, a1, c1]), forward([bonus, a2])
    except (TypeError, ValueError, RuntimeError) as error:  # a model that takes no 4D mask or positions
        logger.info(f"Tree verification probe failed: {error}")
        return False
    tolerance = 1e-3 if target.dtype == torch.float32 else 5e-2
    expected = torch.stack([first[0], first[1], second[1], first[2]])
    return torch.allclose(tree, expected, atol=tolerance * float(expected.abs().max()), rtol=0)


__all__ = [
    "DraftTree",
    "accept_greedy",
    "ancestors",
    "best_first_tree",
    "chain",
    "keep_path",
    "supports_tree_verification",
    "tree_attention_mask",
]
