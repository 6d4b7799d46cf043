import os

# Multi-token forwards on 2 cores slow down 10-100x with OpenMP spin-waiting; must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402
import torch  # noqa: E402

# Every device this machine has; tests that take the `device` fixture run once on each (ids "cpu", "cuda", "mps").
DEVICES = (
    ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (["mps"] if torch.backends.mps.is_available() else [])
)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The device a test runs on, each available one in turn; tiny models go there with `.to(device)`."""
    return request.param


@pytest.fixture
def generator_spy(monkeypatch):
    """Names of the candidate generators `generate` builds (the spy wraps whatever routing is installed)."""
    from transformers import GenerationMixin

    from hf_dflash import enable_dflash_generate

    enable_dflash_generate()  # the routing wraps first; the spy goes around it
    built: list[str] = []
    routing = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        generator = routing(self, *args, **kwargs)
        built.append(type(generator).__name__)
        return generator

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    return built
