"""The drafter's attention backends agree, a cached forward equals recomputing from scratch, `use_cache=False` leaves
the cache alone, the forward compiles as one graph, causal sliding layers see no later block slot, and the draft logits
of a slice of the block are the target head's scores of its rows."""

import pytest
import torch
from helpers import make_draft, make_target
from transformers.cache_utils import DynamicCache


def inputs(draft, batch=2, n_ctx=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    block, hidden = draft.config.block_size, draft.config.hidden_size
    features = len(draft.config.target_layer_ids) * hidden
    noise = torch.randn(batch, block, hidden, generator=generator)
    context = torch.randn(batch, n_ctx, features, generator=generator)
    positions = torch.arange(n_ctx + block).expand(batch, -1)
    keep = torch.ones(batch, n_ctx + block, dtype=torch.long)
    keep[0, :3] = 0  # row 0 is left-padded
    return noise, context, positions, keep


@pytest.mark.parametrize(
    "layer_types", [["full_attention", "full_attention"], ["sliding_attention", "full_attention"]]
)
def test_eager_and_sdpa_agree(layer_types):
    target = make_target("llama")
    draft = make_draft(target, layer_types=layer_types, sliding_window=5)
    noise, context, positions, keep = inputs(draft)
    outputs = {}
    for backend in ("eager", "sdpa"):
        draft.set_attn_implementation(backend)
        with torch.no_grad():
            outputs[backend] = draft(noise, context, position_ids=positions, attention_mask=keep).last_hidden_state
    torch.testing.assert_close(outputs["eager"], outputs["sdpa"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outputs["eager"][0], outputs["eager"][1])  # the padding mask did something


def test_cached_forward_equals_recomputation_from_scratch():
    target = make_target("llama")
    draft = make_draft(target)
    noise, context, positions, _ = inputs(draft, batch=1, n_ctx=10)
    block = draft.config.block_size
    with torch.no_grad():
        full = draft(noise, context, position_ids=positions).last_hidden_state
        cache = DynamicCache(config=draft.config)
        draft(noise, context[:, :6], position_ids=torch.cat([positions[:, :6], positions[:, 10:]], 1), cache=cache)
        cache.crop(-block)  # what the generation loops do: keep the context K/V only
        cached = draft(noise, context[:, 6:], position_ids=positions[:, 6:], cache=cache).last_hidden_state
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_use_cache_false_neither_reads_nor_extends_the_cache():
    draft = make_draft(make_target("llama"))
    noise, context, positions, _ = inputs(draft, batch=1, n_ctx=6)
    block = draft.config.block_size
    with torch.no_grad():
        cache = DynamicCache(config=draft.config)
        draft(noise, context[:, :3], position_ids=torch.cat([positions[:, :3], positions[:, 6:]], 1), cache=cache)
        cache.crop(-block)
        cached_length = cache.get_seq_length()
        tail = positions[:, 3:]
        with_cache = draft(noise, context[:, 3:], position_ids=tail, cache=cache).last_hidden_state
        cache.crop(-block)
        without = draft(noise, context[:, 3:], position_ids=tail, cache=cache, use_cache=False).last_hidden_state
        no_cache = draft(noise, context[:, 3:], position_ids=tail).last_hidden_state
    assert cache.get_seq_length() == cached_length + 3  # only the call that used it extended it
    torch.testing.assert_close(without, no_cache)
    assert not torch.allclose(without, with_cache)  # the cached context mattered when it was used


@pytest.mark.parametrize(
    "layer_types", [["full_attention", "full_attention"], ["sliding_attention", "full_attention"]]
)
def test_forward_compiles_as_one_graph(layer_types):
    torch._dynamo.reset()
    draft = make_draft(make_target("llama"), layer_types=layer_types, sliding_window=5)
    draft.set_attn_implementation("sdpa")
    noise, context, positions, keep = inputs(draft)
    compiled = torch.compile(draft, fullgraph=True, backend="eager")  # a graph break or host sync would raise
    with torch.no_grad():
        expected = draft(noise, context, position_ids=positions, attention_mask=keep).last_hidden_state
        got = compiled(noise, context, position_ids=positions, attention_mask=keep).last_hidden_state
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("causal", [False, True])
def test_causal_sliding_layers_see_no_later_block_slot(causal):
    draft = make_draft(
        make_target("llama"),
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=16,
        causal_sliding_attention=causal,
    )
    noise, context, positions, keep = inputs(draft, batch=1)
    changed = noise.clone()
    changed[:, -1] += 1.0  # only the last block slot differs
    with torch.no_grad():
        before = draft(noise, context, position_ids=positions, attention_mask=keep).last_hidden_state
        after = draft(changed, context, position_ids=positions, attention_mask=keep).last_hidden_state
    assert torch.allclose(before[:, :-1], after[:, :-1]) == causal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft_vocab_size", [None, 16])
@pytest.mark.parametrize("batch", [1, 2])
def test_draft_logits_of_a_block_slice_are_the_heads_scores_of_its_rows(batch, draft_vocab_size, dtype):
    """The loops pass `hidden[:, 1 : 1 + S]`, a slice whose rows `draft_logits` multiplies as a 2-D product (a view at
    batch 1, a copy at batch 2): every `[row, slot]` must still get its own scores, and training's gradients flow."""
    target = make_target("llama").to(dtype)
    draft = make_draft(target, block_size=8, draft_vocab_size=draft_vocab_size).to(dtype)
    if draft_vocab_size:
        draft.set_draft_vocabulary(torch.arange(5, 21))
    head = target.get_output_embeddings()
    block = torch.randn(batch, 8, draft.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    hidden = block[:, 1:6]  # [b, 5, H]
    rows = head.weight if draft_vocab_size is None else head.weight[draft.draft_token_ids]
    with torch.no_grad():
        logits = draft.draft_logits(hidden, head)
        expected = torch.stack([torch.stack([row @ rows.float().T for row in slots]) for slots in hidden.float()])
    assert logits.shape == (batch, 5, rows.shape[0]) and logits.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.float(), expected, rtol=tolerance, atol=tolerance)
    trained, row = block.float().requires_grad_(), batch - 1
    draft.float().draft_logits(trained[:, 1:6], head.float())[row, 2].sum().backward()
    touched = trained.grad.abs().sum(-1).nonzero().tolist()  # [row, block slot] pairs that got a gradient
    assert touched == [[row, 3]]  # slice slot 2 is block slot 3, and only it
