"""Greedy losslessness, token for token, on both paths: `target.generate(assistant_model=draft)` and
`speculative_generate`, across target families, drafts (random and oracle-steered), prompt lengths, block sizes,
budgets and EOS."""

import pytest
import torch
from helpers import FAMILIES, PAD, greedy_reference, left_pad, make_draft, make_oracle, make_target
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_dflash import DFlashCandidateGenerator, speculative_generate


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, PAD, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("p_wrong", [None, 0.15])
def test_greedy_identical_for_every_family(family, p_wrong, generator_spy):
    target = make_target(family)
    prompt = random_prompt(20, seed=3)
    reference = greedy_reference(target, prompt, 60)  # crosses the tiny sliding windows (32/48)
    draft = make_draft(target) if p_wrong is None else make_oracle(target, [reference], p_wrong)

    via_generate = target.generate(prompt[None], max_new_tokens=60, do_sample=False, assistant_model=draft)
    ours = speculative_generate(target, draft, prompt[None], max_new_tokens=60)

    assert generator_spy == ["DFlashCandidateGenerator"]
    assert via_generate[0].tolist() == reference.tolist()
    assert ours.sequences[0].tolist() == reference.tolist()
    if p_wrong is not None:
        assert ours.stats.tau > 3  # the oracle really exercised long accepted runs


CASES = [  # (family, prompt length, block size, max_new_tokens, p_wrong)
    ("llama", 1, 2, 1, 0.0),
    ("llama", 1, 16, 200, 0.1),
    ("llama", 300, 4, 40, 0.3),
    ("llama", 7, 16, 17, 0.0),
    ("qwen3", 300, 16, 200, 0.05),
    ("qwen3", 2, 3, 2, 0.0),
    ("gemma3", 37, 16, 200, 0.2),
    ("gemma3", 300, 8, 23, 0.0),
    ("gpt2", 5, 5, 199, 0.5),
    ("mistral", 64, 12, 100, 0.1),
]


@pytest.mark.parametrize(("family", "prompt_len", "block_size", "max_new_tokens", "p_wrong"), CASES)
def test_greedy_identical_across_lengths_blocks_and_budgets(family, prompt_len, block_size, max_new_tokens, p_wrong):
    target = make_target(family)
    prompt = random_prompt(prompt_len, seed=prompt_len)
    reference = greedy_reference(target, prompt, max_new_tokens)
    draft = make_oracle(target, [reference], p_wrong, block_size=block_size)

    via_generate = target.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft)
    ours = speculative_generate(target, draft, prompt[None], max_new_tokens=max_new_tokens)

    assert via_generate[0].tolist() == reference.tolist()
    assert ours.sequences[0].tolist() == reference.tolist()
    assert ours.num_new_tokens == [max_new_tokens]


@pytest.mark.parametrize("family", ["llama", "gemma2", "opt"])
@pytest.mark.parametrize("p_wrong", [0.0, 0.4])
def test_eos_inside_an_accepted_block_stops_exactly_where_plain_generate_stops(family, p_wrong):
    target = make_target(family)
    prompt = random_prompt(9, seed=11)
    free_run = greedy_reference(target, prompt, 80)
    eos = int(free_run[len(prompt) + 25])  # a token the target emits mid-way
    reference = greedy_reference(target, prompt, 80, eos_token_id=eos)
    assert reference[-1] == eos and len(reference) < len(free_run)
    draft = make_oracle(target, [free_run], p_wrong, block_size=8)

    via_generate = target.generate(
        prompt[None], max_new_tokens=80, do_sample=False, assistant_model=draft, eos_token_id=eos
    )
    ours = speculative_generate(target, draft, prompt[None], max_new_tokens=80, eos_token_id=eos)

    assert via_generate[0].tolist() == reference.tolist()
    assert ours.sequences[0, : len(reference)].tolist() == reference.tolist()
    assert ours.num_new_tokens == [len(reference) - len(prompt)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox", "phi3", "gemma3", "mistral"])
def test_batched_ragged_rows_finish_at_different_times(family):
    target = make_target(family)
    prompts = [random_prompt(n, seed=n) for n in (1, 13, 40, 6, 25)]
    free_runs = [greedy_reference(target, p, 50) for p in prompts]
    eos = int(free_runs[1][len(prompts[1]) + 10])  # row 1 stops early; the others when (if) they meet it
    references = [greedy_reference(target, p, 50, eos_token_id=eos) for p in prompts]
    draft = make_oracle(target, free_runs, p_wrong=0.2, block_size=6)
    input_ids, attention_mask = left_pad(prompts)

    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=50, eos_token_id=eos)

    width = input_ids.shape[1]
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        new_tokens = reference[len(prompt) :].tolist()
        assert out.num_new_tokens[row] == len(new_tokens)
        assert out.sequences[row, width : width + len(new_tokens)].tolist() == new_tokens
        assert (out.sequences[row, width + len(new_tokens) :] == PAD).all()
    assert len(set(out.num_new_tokens)) > 1  # rows really did finish at different times


def test_batched_random_draft_matches_each_row_alone():
    target = make_target("qwen3")
    prompts = [random_prompt(n, seed=100 + n) for n in (3, 30, 17)]
    draft = make_draft(target, block_size=16)
    input_ids, attention_mask = left_pad(prompts)
    out = speculative_generate(target, draft, input_ids, attention_mask, max_new_tokens=40)
    for row, prompt in enumerate(prompts):
        assert (
            out.sequences[row, input_ids.shape[1] :].tolist()
            == greedy_reference(target, prompt, 40)[len(prompt) :].tolist()
        )


def test_left_padded_prompt_on_the_transformers_path():
    target = make_target("llama")
    prompt = random_prompt(12, seed=5)
    input_ids, attention_mask = left_pad([prompt, random_prompt(20, seed=6)])
    row_ids, row_mask = input_ids[:1], attention_mask[:1]  # 8 padding slots on the left
    reference = target.generate(row_ids, attention_mask=row_mask, max_new_tokens=30, do_sample=False)
    draft = make_oracle(target, [greedy_reference(target, prompt, 30)], p_wrong=0.2)
    out = target.generate(row_ids, attention_mask=row_mask, max_new_tokens=30, do_sample=False, assistant_model=draft)
    assert out.tolist() == reference.tolist()


def test_acceptance_statistics_add_up():
    target = make_target("llama")
    prompt = random_prompt(10, seed=2)
    reference = greedy_reference(target, prompt, 65)
    draft = make_oracle(target, [reference], p_wrong=0.0, block_size=8)
    stats = speculative_generate(target, draft, prompt[None], max_new_tokens=65).stats
    assert stats.acceptance_lengths == [8] * 8  # a perfect draft commits B tokens per round: 1 + 8 * 8 = 65
    assert stats.tau == 8 and stats.num_rounds == 8
    assert stats.histogram == [0] * 8 + [8]
    assert stats.new_tokens == 65 and stats.draft_time_s > 0 and stats.verify_time_s > 0


def test_users_output_hidden_states_and_scores_keep_working():
    target = make_target("llama")
    prompt = random_prompt(8, seed=8)
    draft = make_oracle(target, [greedy_reference(target, prompt, 20)], p_wrong=0.3)
    kwargs = {"max_new_tokens": 20, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    plain = target.generate(prompt[None], output_hidden_states=True, **kwargs)
    ours = target.generate(prompt[None], output_hidden_states=True, assistant_model=draft, **kwargs)
    assert ours.sequences.tolist() == plain.sequences.tolist()
    assert len(ours.scores) == 20 and len(ours.hidden_states) == len(plain.hidden_states)
    # every layer's hidden states are returned, not only the ones the draft taps
    assert all(h is not None for step in ours.hidden_states for h in step)


@pytest.mark.parametrize("max_new_tokens", [17, 18, 21, 22, 23])
def test_static_cache_never_overflows_near_the_budget(max_new_tokens):
    target = make_target("llama")
    prompt = random_prompt(6, seed=max_new_tokens)
    reference = greedy_reference(target, prompt, max_new_tokens)
    draft = make_oracle(target, [reference], p_wrong=0.0, block_size=8)
    out = target.generate(
        prompt[None],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        assistant_model=draft,
        cache_implementation="static",
    )
    assert out[0].tolist() == reference.tolist()


def test_history_dependent_processors_stay_lossless():
    target = make_target("qwen2")
    prompt = random_prompt(15, seed=4)
    kwargs = {"max_new_tokens": 40, "do_sample": False, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2}
    reference = target.generate(prompt[None], **kwargs)[0]
    draft = make_oracle(target, [reference], p_wrong=0.2)
    assert target.generate(prompt[None], assistant_model=draft, **kwargs)[0].tolist() == reference.tolist()


class Collector(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamers_receive_the_prompt_then_exactly_the_new_tokens():
    target = make_target("llama")
    prompt = random_prompt(10, seed=9)
    reference = greedy_reference(target, prompt, 30)
    draft = make_oracle(target, [reference], p_wrong=0.3)
    for run in (
        lambda s: target.generate(prompt[None], max_new_tokens=30, do_sample=False, assistant_model=draft, streamer=s),
        lambda s: speculative_generate(target, draft, prompt[None], max_new_tokens=30, streamer=s),
    ):
        streamer = Collector()
        run(streamer)
        assert streamer.ended and streamer.chunks[0] == prompt.tolist()
        assert sum(streamer.chunks[1:], []) == reference[len(prompt) :].tolist()
        assert len(streamer.chunks) > 2  # tokens arrived in several pieces, as they were accepted


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids == self.token).any(-1)


def test_custom_stopping_criteria_stop_within_one_round():
    target = make_target("llama")
    prompt = random_prompt(10, seed=10)
    free_run = greedy_reference(target, prompt, 60)
    stop_token = int(free_run[len(prompt) + 20])
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    plain = target.generate(prompt[None], max_new_tokens=60, do_sample=False, stopping_criteria=criteria)[0]
    draft = make_oracle(target, [free_run], p_wrong=0.1, block_size=8)
    ours = target.generate(
        prompt[None], max_new_tokens=60, do_sample=False, stopping_criteria=criteria, assistant_model=draft
    )[0]
    # transformers checks criteria once per round, so up to B - 1 extra target tokens may follow the stop
    assert ours[: len(plain)].tolist() == plain.tolist()
    assert len(ours) - len(plain) < 8


def test_our_generator_clamps_drafts_to_the_budget(monkeypatch):
    target = make_target("llama")
    prompt = random_prompt(5, seed=12)
    reference = greedy_reference(target, prompt, 10)
    draft = make_oracle(target, [reference], p_wrong=0.0, block_size=8)
    lengths = []
    original = DFlashCandidateGenerator.get_candidates

    def record(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        lengths.append((input_ids.shape[1], candidates.shape[1] - input_ids.shape[1]))
        return candidates, logits

    monkeypatch.setattr(DFlashCandidateGenerator, "get_candidates", record)
    out = target.generate(prompt[None], max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert out[0].tolist() == reference.tolist()
    max_length = len(prompt) + 10
    assert all(length + drafted + 1 <= max_length for length, drafted in lengths)  # never verify past the budget


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("vocabulary", ["covers-the-output", "random-half"])
def test_reduced_draft_vocabulary_stays_lossless(family, vocabulary):
    """A draft over a subset of the vocabulary (vLLM's `d2t` convention): drafts come from the subset only, the
    target verifies over the whole vocabulary."""
    target = make_target(family)
    prompt = random_prompt(15, seed=4)
    reference = greedy_reference(target, prompt, 50)
    emitted = reference[len(prompt) :].unique()
    if vocabulary == "covers-the-output":
        subset = torch.cat([emitted, torch.arange(PAD)[~torch.isin(torch.arange(PAD), emitted)][: 48 - len(emitted)]])
    else:
        subset = torch.randperm(PAD, generator=torch.Generator().manual_seed(0))[:48]
    draft = make_oracle(target, [reference], p_wrong=0.1, draft_vocab_size=48)
    draft.set_draft_vocabulary(subset)

    via_generate = target.generate(prompt[None], max_new_tokens=50, do_sample=False, assistant_model=draft)
    ours = speculative_generate(target, draft, prompt[None], max_new_tokens=50)

    assert via_generate[0].tolist() == reference.tolist()
    assert ours.sequences[0].tolist() == reference.tolist()
    if vocabulary == "covers-the-output":
        assert ours.stats.tau > 3  # the oracle's tokens are all in the subset: long runs accepted


def test_the_drafters_context_queue_joins_steps_in_order_and_refuses_an_empty_read():
    from hf_dflash.decoding.speculative import DecodeState

    state = DecodeState(
        cache=None, key_mask=None, next_position=None, draft_cache=None, draft_key_mask=None,
        context=[], bonus=None, generated=[[]], done=torch.zeros(1, dtype=torch.bool),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="no target features are queued"):
        state.take_context()
    for step in range(3):  # a prompt of two tokens, then two plain steps
        length = 2 if step == 0 else 1
        positions = torch.arange(length)[None] + (0 if step == 0 else step + 1)
        state.add_context(torch.full((1, length, 4), float(step)), torch.ones(1, length), positions)
    features, mask, positions = state.take_context()
    assert features[0, :, 0].tolist() == [0.0, 0.0, 1.0, 2.0] and positions.tolist() == [[0, 1, 2, 3]]
    assert mask.shape == (1, 4) and state.context == []
