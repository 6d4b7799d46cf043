"""`SpeculativeStats`' prefill / draft / verify times: each phase is billed the device work it queued.

CUDA and MPS run kernels asynchronously, so a clock read without waiting for the device bills a phase's work to
whichever later phase waits first. No test here times anything: the device is either faked or only checked for
invariants (every phase took some time, and together no longer than the call).
"""

import time

import pytest
import torch
from helpers import make_draft, make_target

from hf_dflash.decoding import speculative
from hf_dflash.decoding.policy import VerifyCosts
from hf_dflash.decoding.speculative import synchronized_clock

PROMPT = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8])
DEVICES = (
    ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (["mps"] if torch.backends.mps.is_available() else [])
)


@pytest.fixture(scope="module")
def models():
    target = make_target("llama")
    return target, make_draft(target, block_size=4, num_hidden_layers=1)


@pytest.mark.parametrize(
    "device, module, expected_calls",
    [(torch.device("cuda"), torch.cuda, [(torch.device("cuda"),)]), (torch.device("mps"), torch.mps, [()])],
)
def test_the_clock_waits_for_an_asynchronous_device(monkeypatch, device, module, expected_calls):
    calls = []
    monkeypatch.setattr(module, "synchronize", lambda *args: calls.append(args))
    before = time.perf_counter()
    assert synchronized_clock(device) >= before
    assert calls == expected_calls


def test_the_clock_does_not_wait_on_a_cpu(monkeypatch):
    def fail(*args):
        raise AssertionError("a CPU has no queued work to wait for")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    monkeypatch.setattr(torch.mps, "synchronize", fail)
    synchronized_clock(torch.device("cpu"))


class QueuedDevice:
    """A fake asynchronous device: work is queued by the phases and runs (advances the clock) only when the clock is
    read through `synchronized_clock`, as CUDA work completes only when the host synchronises."""

    def __init__(self):
        self.now, self.queued = 0.0, 0.0

    def queue(self, seconds: float, result):
        self.queued += seconds
        return result

    def clock(self, device: torch.device) -> float:
        self.now, self.queued = self.now + self.queued, 0.0
        return self.now


def test_queued_device_work_is_billed_to_the_phase_that_queued_it(monkeypatch, models):
    target, draft = models
    device = QueuedDevice()
    real_draft, real_forward = speculative.draft_block, speculative.target_forward
    monkeypatch.setattr(speculative, "synchronized_clock", device.clock)
    monkeypatch.setattr(speculative, "draft_block", lambda *args: device.queue(1.0, real_draft(*args)))
    monkeypatch.setattr(
        speculative, "target_forward", lambda *args, **kwargs: device.queue(10.0, real_forward(*args, **kwargs))
    )
    stats = speculative.speculative_generate(target, draft, PROMPT[None], max_new_tokens=12).stats
    assert stats.num_rounds > 1
    assert stats.prefill_time_s == 10.0  # one target forward
    assert stats.draft_time_s == 1.0 * stats.num_rounds  # one drafter call per round, none of the target's work
    # one target forward per round or plain step (the last token needs no draft), none of the draft's work
    assert stats.verify_time_s == 10.0 * (stats.num_rounds + stats.plain_steps)


def test_bare_forward_seconds_add_the_measured_cost_of_each_steps_token_count(monkeypatch, models):
    target, draft = models
    costs = VerifyCosts(verify=tuple(float(n) for n in range(1, 18)), draft=0.5)  # n tokens: n seconds
    nodes = []
    record_plan = speculative.SpeculativeStats.record_plan
    monkeypatch.setattr(
        speculative.SpeculativeStats,
        "record_plan",
        lambda self, tree, drafted: nodes.append(tree.num_nodes) or record_plan(self, tree, drafted),
    )
    stats = speculative.speculative_generate(target, draft, PROMPT[None], max_new_tokens=12, verify_costs=costs).stats
    assert stats.num_rounds > 0 and len(nodes) == stats.num_rounds + stats.plain_steps
    assert stats.bare_forward_s == sum(num_nodes + 1.0 for num_nodes in nodes)  # the bonus and the nodes
    assert speculative.speculative_generate(target, draft, PROMPT[None], max_new_tokens=4).stats.bare_forward_s == 0


@pytest.mark.parametrize("device", DEVICES)
def test_phase_times_are_positive_and_within_the_call(monkeypatch, models, device):
    target, draft = (model.to(device) for model in models)
    waits = []
    if device in ("cuda", "mps"):  # count the waits, still waiting for real
        module = getattr(torch, device)
        real_synchronize = module.synchronize
        monkeypatch.setattr(module, "synchronize", lambda *args: waits.append(args) or real_synchronize(*args))
    start = synchronized_clock(torch.device(device))
    stats = speculative.speculative_generate(target, draft, PROMPT[None].to(device), max_new_tokens=12).stats
    wall = synchronized_clock(torch.device(device)) - start
    try:
        assert stats.num_rounds > 1
        assert stats.prefill_time_s > 0 and stats.draft_time_s > 0 and stats.verify_time_s > 0
        assert stats.total_time_s <= wall
        if device != "cpu":  # both ends of prefill, then the start of each round's draft, verify and its end
            assert len(waits) >= 2 + 3 * stats.num_rounds
    finally:
        for model in models:
            model.to("cpu")
