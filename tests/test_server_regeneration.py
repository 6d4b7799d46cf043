"""Tests for ``hf_dflash.data.server`` against a real HTTP server on 127.0.0.1, in a thread.

The server plays an OpenAI-compatible engine: it serves the tiny Llama of ``helpers.make_target`` greedily
behind ``GET /v1/models`` and ``POST /v1/completions``, decodes with the same word-level tokenizer (so decoding
then encoding round-trips and records can be compared exactly), leaves the stop token out of the text and
names it in ``stop_reason`` unless it is the tokenizer's EOS (as vLLM does). Faults (500, 429, a sleep past the
client's timeout, 503 for good, 400, malformed bodies) are injected per request.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from helpers import PAD, VOCAB, make_target
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import GenerationConfig, PreTrainedTokenizerFast

from hf_dflash.data.chat import apply_chat_template, end_of_turn_ids
from hf_dflash.data.evaluation import EVALUATION_SETS
from hf_dflash.data.prompts import Prompt
from hf_dflash.data.records import load_training_dataset
from hf_dflash.data.regenerate import generate_responses, regenerate_responses
from hf_dflash.data.server import (
    regenerate_responses_with_server,
    turn_end_id,
)
from hf_dflash.data.sources import write_prompts_jsonl

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SPECIALS = ["[UNK]", "<|im_start|>", "<|im_end|>"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 4)]
END_OF_TURN = 2  # <|im_end|>
STOP_WORD = 12  # a word the rigged target says mid-response for prompts 1 and 4: a second stop id (its EOS)
MAX_NEW = 12
MODEL = "tiny-llama"
FAST = {"max_new_tokens": MAX_NEW, "backoff_s": 0.01, "progress": False}


def make_tokenizer(template: str = CHAT_TEMPLATE, specials=SPECIALS, roles=("system", "user", "assistant"), eos=None):
    """Word-level tokenizer over the tiny target's ids: specials, roles, words w0, w1, ..., and ``<pad>`` at PAD."""
    words = [f"w{i}" for i in range(VOCAB - 1 - len(specials) - len(roles))]
    vocab = [*specials, *roles, *words, "<pad>"]
    assert len(vocab) == VOCAB and vocab.index("<pad>") == PAD
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens([*specials, "<pad>"])
    eos = eos or "<|im_end|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        eos_token=eos,
        pad_token="<pad>",
        extra_special_tokens=[s for s in specials if s not in ("[UNK]", eos)],
    )
    tokenizer.chat_template = template
    return tokenizer


def make_prompts(n: int) -> list[Prompt]:
    return [
        Prompt(
            id=f"test/{i}", dataset="test", messages=[{"role": "user", "content": " ".join(WORDS[i * 7 : i * 10 + 2])}]
        )
        for i in range(n)
    ]


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(records: list[dict]) -> dict[str, dict]:
    assert len({r["id"] for r in records}) == len(records), "a record is duplicated"
    return {r["id"]: r for r in records}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target():
    """The tiny Llama, rigged to end its turn (<|im_end|>) now and then, with STOP_WORD as a second EOS."""
    target = make_target("llama")
    with torch.no_grad():
        target.lm_head.weight[END_OF_TURN] *= 3
    target.generation_config.eos_token_id = STOP_WORD
    return target


@pytest.fixture(scope="module")
def stop_ids(target, tokenizer):
    assert end_of_turn_ids(target, tokenizer) == sorted([END_OF_TURN, STOP_WORD])
    return end_of_turn_ids(target, tokenizer)


@pytest.fixture(scope="module")
def local_records(target, tokenizer, tmp_path_factory) -> dict[str, dict]:
    """What ``regenerate_responses`` writes for 12 prompts with the target loaded locally."""
    path = tmp_path_factory.mktemp("local") / "local.jsonl"
    regenerate_responses(
        target, tokenizer, make_prompts(12), path, max_new_tokens=MAX_NEW, batch_size=4, progress=False
    )
    return by_id(read_records(path))


class Engine:
    """The test server's behaviour: greedy completions of the target, with an optional fault per request.

    ``fault(prompt_index, attempt)`` returns None (answer now), a number of seconds to wait before answering,
    or ``(status, body)`` to send instead.
    """

    def __init__(self, target, tokenizer, stop_ids, prompts):
        self.target, self.tokenizer, self.stop_ids = target, tokenizer, stop_ids
        self.index = {apply_chat_template(tokenizer, p): i for i, p in enumerate(prompts)}
        self.requests: list[dict] = []  # every completions body received, in order
        self.headers: list[dict] = []
        self.attempts: Counter = Counter()  # prompt index -> requests
        self.fault = lambda index, attempt: None
        self.lock = threading.Lock()
        self.owner = None  # `owned_by` in GET /models

    def answer(self, body: dict, headers: dict) -> tuple[int, dict | bytes]:
        with self.lock:
            self.requests.append(body)
            self.headers.append(headers)
            index = self.index[body["prompt"]]
            fault = self.fault(index, self.attempts[index])
            self.attempts[index] += 1
        if isinstance(fault, float):
            time.sleep(fault)
        elif fault is not None:
            return fault
        choice = self.complete(body)
        answer = {"object": "text_completion", "model": MODEL, "choices": [choice]}
        if body.get("return_token_ids"):  # asked as vLLM is: ids and no text, so only the ids make the record right
            choice |= {"token_ids": choice.pop("ids"), "text": ""}
        elif body.get("return_tokens") and body.get("verbose"):  # asked as llama.cpp's server is
            answer["__verbose"] = {"tokens": choice.pop("ids")}
            choice["text"] = ""
        choice.pop("ids", None)
        return 200, answer

    def complete(self, body: dict) -> dict:
        ids = self.tokenizer(body["prompt"], add_special_tokens=False).input_ids
        with self.lock:
            response = generate_responses(
                self.target, [ids], pad_token_id=PAD, stop_ids=self.stop_ids, max_new_tokens=body["max_tokens"]
            )[0]
        stopped = response[-1] in self.stop_ids
        named = response[-1] if stopped and response[-1] != self.tokenizer.eos_token_id else None
        return {
            "index": 0,
            "text": self.tokenizer.decode(response[:-1] if stopped else response),
            "finish_reason": "stop" if stopped else "length",
            "stop_reason": named,
            "ids": response,  # every generated id, a stop id included: what engines return when asked
        }


def serve(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/v1/models":
                owner = {"owned_by": engine.owner} if engine.owner else {}
                self.send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", **owner}]})
            else:
                self.send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                return self.send(404, {"error": {"message": f"no route {self.path}"}})
            self.send(*engine.answer(body, dict(self.headers)))

        def send(self, status: int, answer: dict | bytes):
            payload = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = False  # server_close() then waits for every handler (a sleeping one too)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def engine(target, tokenizer, stop_ids):
    engine = Engine(target, tokenizer, stop_ids, make_prompts(12))
    server = serve(engine)
    engine.url = f"http://127.0.0.1:{server.server_port}/v1"
    yield engine
    server.shutdown()
    server.server_close()


def test_server_records_equal_local_records_token_for_token(engine, tokenizer, stop_ids, local_records, tmp_path):
    prompts = make_prompts(8)
    path = regenerate_responses_with_server(
        tokenizer,
        prompts,
        tmp_path / "out.jsonl",
        server_url=engine.url + "/",
        stop_ids=stop_ids,
        concurrency=3,
        **FAST,
    )
    records = by_id(read_records(path))
    assert records == {p.id: local_records[p.id] for p in prompts}
    endings = Counter(r["input_ids"][-1] if r["input_ids"][-1] in stop_ids else "length" for r in records.values())
    assert endings.keys() == {END_OF_TURN, STOP_WORD, "length"}  # both stops (named or not) and a cut response
    assert min(len(r["input_ids"]) - r["prompt_len"] for r in records.values()) == 1  # an empty text + <|im_end|>
    assert len(load_training_dataset(path)) == len(prompts)

    # Each prompt was sent once, as the rendered template, greedy, with its own seed, to the listed model.
    assert sorted(r["prompt"] for r in engine.requests) == sorted(apply_chat_template(tokenizer, p) for p in prompts)
    for request in engine.requests:
        assert request | {"prompt": "", "seed": 0} == {
            "model": MODEL, "prompt": "", "max_tokens": MAX_NEW, "temperature": 0.0, "top_p": 1.0, "seed": 0,
            "stream": False,
        }  # fmt: skip
    assert len({r["seed"] for r in engine.requests}) == len(prompts)

    # Rerunning the same call sends nothing and leaves the file as it is.
    before = path.read_text()
    regenerate_responses_with_server(tokenizer, prompts, path, server_url=engine.url, stop_ids=stop_ids, **FAST)
    assert path.read_text() == before and len(engine.requests) == len(prompts)


def test_sampling_parameters_model_key_and_extra_body_are_sent(engine, tokenizer, stop_ids, tmp_path):
    regenerate_responses_with_server(
        tokenizer, make_prompts(2), tmp_path / "out.jsonl", server_url=engine.url, stop_ids=stop_ids,
        model=MODEL, do_sample=True, temperature=0.7, top_p=0.9, api_key="secret",
        extra_body={"add_special_tokens": False}, **FAST,
    )  # fmt: skip
    assert {(r["temperature"], r["top_p"], r["add_special_tokens"]) for r in engine.requests} == {(0.7, 0.9, False)}
    assert {h["Authorization"] for h in engine.headers} == {"Bearer secret"}


def test_transient_failures_are_retried_and_every_record_written_once(
    engine, tokenizer, stop_ids, local_records, tmp_path
):
    prompts = make_prompts(9)
    faults = [(500, {"error": {"message": "engine hiccup"}}), (429, {"error": {"message": "slow down"}}), 1.5]
    engine.fault = lambda index, attempt: faults[index // 3 % 3] if index % 3 == 0 and attempt == 0 else None
    path = regenerate_responses_with_server(
        tokenizer, prompts, tmp_path / "out.jsonl", server_url=engine.url, stop_ids=stop_ids,
        concurrency=4, timeout_s=1.0, **FAST,  # 1.5 s is past the timeout
    )  # fmt: skip
    assert by_id(read_records(path)) == {p.id: local_records[p.id] for p in prompts}
    assert all(engine.attempts[i] >= 2 for i in (0, 3, 6))  # each faulty first attempt was retried


def test_a_server_failing_for_good_raises_keeps_what_was_answered_and_a_rerun_finishes(
    engine, tokenizer, stop_ids, local_records, tmp_path
):
    prompts, healthy = make_prompts(12), 3
    answered = []

    def fault(index, attempt):
        if len(answered) == healthy:
            return 503, {"error": {"message": "engine down"}}
        answered.append(index)
        return 0.5 if len(answered) == healthy else None  # the last answer arrives after another prompt failed

    engine.fault = fault
    path = tmp_path / "out.jsonl"
    kwargs = {"server_url": engine.url, "stop_ids": stop_ids, "concurrency": 2, "max_retries": 2, **FAST}
    with pytest.raises(ConnectionError, match=r"HTTP 503: engine down.*rerun the same command to resume") as error:
        regenerate_responses_with_server(tokenizer, prompts, path, **kwargs)
    assert engine.url in str(error.value) and "test/" in str(error.value)
    records = by_id(read_records(path))
    assert sorted(records) == sorted(prompts[i].id for i in answered)  # every answer, each once
    assert all(records[i] == local_records[i] for i in records)
    assert 3 in engine.attempts.values()  # the prompt that gave up was tried 1 + max_retries times
    assert len(engine.attempts) < len(prompts)  # nothing new was sent after the failure

    with open(path, "a") as file:
        file.write('{"id": "test/11", "source": "te')  # and the process died mid-line
    engine.fault = lambda index, attempt: None
    sent_before = len(engine.requests)
    regenerate_responses_with_server(tokenizer, prompts, path, **kwargs)
    assert by_id(read_records(path)) == {p.id: local_records[p.id] for p in prompts}
    resent = {engine.index[r["prompt"]] for r in engine.requests[sent_before:]}
    assert resent == set(range(len(prompts))) - set(answered)  # done ids are not asked again


def test_an_answer_without_a_token_is_not_written(engine, tokenizer, stop_ids, local_records, tmp_path):
    engine.fault = lambda index, attempt: (
        (200, {"choices": [{"text": "", "finish_reason": "length"}]}) if index == 0 else None
    )
    path = regenerate_responses_with_server(
        tokenizer, make_prompts(3), tmp_path / "out.jsonl", server_url=engine.url, stop_ids=stop_ids, **FAST
    )
    assert by_id(read_records(path)) == {i: local_records[i] for i in ("test/1", "test/2")}  # loadable for training


def test_a_rejected_request_fails_at_once_with_the_servers_message(engine, tokenizer, stop_ids, tmp_path):
    engine.fault = lambda index, attempt: (400, {"error": {"message": "max_tokens is too large"}})
    with pytest.raises(RuntimeError, match=r"/v1/completions rejected prompt 'test/0' with HTTP 400: max_tokens is"):
        regenerate_responses_with_server(
            tokenizer, make_prompts(4), tmp_path / "out.jsonl", server_url=engine.url, stop_ids=stop_ids,
            concurrency=1, max_retries=5, **FAST,
        )  # fmt: skip
    assert len(engine.requests) == 1  # no retry, and no other prompt sent
    assert (tmp_path / "out.jsonl").read_text() == ""


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"<html>502 Bad Gateway</html>", "not JSON"),
        ({"choices": []}, "without choices"),
        ({"choices": [{"text": "w1", "finish_reason": "abort"}]}, "finish_reason 'abort'"),
    ],
)
def test_a_malformed_answer_raises_naming_the_url(engine, tokenizer, stop_ids, tmp_path, body, complaint):
    engine.fault = lambda index, attempt: (200, body)
    with pytest.raises(ValueError, match=complaint) as error:
        regenerate_responses_with_server(
            tokenizer, make_prompts(2), tmp_path / "out.jsonl", server_url=engine.url, stop_ids=stop_ids, **FAST
        )
    assert f"{engine.url}/completions" in str(error.value)


def test_a_server_address_is_served_and_a_wrong_path_and_a_dead_server_are_explained(
    engine, tokenizer, stop_ids, tmp_path
):
    server = engine.url[: -len("/v1")]  # what a user copies from the server's start-up line
    regenerate_responses_with_server(
        tokenizer, make_prompts(1), tmp_path / "base.jsonl", server_url=server, stop_ids=stop_ids, model=MODEL, **FAST
    )
    assert len((tmp_path / "base.jsonl").read_text().splitlines()) == 1
    with pytest.raises(RuntimeError, match=r"HTTP 404 \(does server_url end in /v1\?\)"):
        regenerate_responses_with_server(
            tokenizer, make_prompts(1), tmp_path / "out.jsonl", server_url=f"{server}/api",
            stop_ids=stop_ids, model=MODEL, **FAST,
        )  # fmt: skip
    with pytest.raises(
        ConnectionError, match=r"http://127\.0\.0\.1:1/v1: GET /models failed 2 times; last error: URLError"
    ):
        regenerate_responses_with_server(
            tokenizer, make_prompts(1), tmp_path / "out.jsonl", server_url="http://127.0.0.1:1/v1",
            stop_ids=stop_ids, max_retries=1, **FAST,
        )  # fmt: skip


def test_the_appended_end_of_turn_is_the_token_closing_an_assistant_message(target, tokenizer):
    assert turn_end_id(tokenizer, [STOP_WORD, END_OF_TURN]) == END_OF_TURN
    assert turn_end_id(tokenizer, [STOP_WORD]) == STOP_WORD
    assert turn_end_id(tokenizer, []) is None
    # Mistral-style: user turns close with the special [/INST], which end_of_turn_ids counts as a stop id;
    # assistant turns close with </s>, and that is what a finished response ends with.
    mistral = make_tokenizer(
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %} {{ m['content'] }} </s>{% endif %}{% endfor %}",
        specials=["[UNK]", "[INST]", "[/INST]", "</s>"],
        roles=(),
        eos="</s>",
    )
    inst_end, eos = mistral.convert_tokens_to_ids(["[/INST]", "</s>"])
    assert end_of_turn_ids(GenerationConfig(), mistral) == sorted([inst_end, eos])
    assert turn_end_id(mistral, [inst_end, eos]) == eos
    # Without the target's weights, its generation config gives the same stop ids.
    generation_config = GenerationConfig(eos_token_id=STOP_WORD)
    assert end_of_turn_ids(generation_config, tokenizer) == end_of_turn_ids(target, tokenizer)


def test_data_command_regenerates_through_the_server(engine, target, tokenizer, local_records, tmp_path):
    """`hf-dflash data --target <folder> --server_url URL`: only the folder's tokenizer and generation config are read
    (no weights), and the records equal the local ones."""
    import logging

    from hf_dflash.cli import main

    folder = tmp_path / "served-model"
    target.config.save_pretrained(folder)  # what a user's folder holds, minus weights the server has
    target.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts_path, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    write_prompts_jsonl(make_prompts(6), prompts_path)
    argv = ["data", "--target", str(folder), "--server_url", engine.url, "--source", str(prompts_path)]
    argv += ["--num_prompts", "6", "--max_new_tokens", str(MAX_NEW), "--output", str(output), "--concurrency", "2"]
    argv += [arg for name in EVALUATION_SETS for arg in ("--unfiltered_evaluation_set", name)]
    package_logger = logging.getLogger("hf_dflash")
    handlers, level = list(package_logger.handlers), package_logger.level
    try:
        assert main(argv) == 0
    finally:  # run_data shows the package's log on stderr; undo that for the other tests
        for handler in package_logger.handlers[len(handlers) :]:
            package_logger.removeHandler(handler)
        package_logger.setLevel(level)
    assert by_id(read_records(output)) == {p.id: local_records[p.id] for p in make_prompts(6)}
    assert len(engine.requests) == 6


def test_a_bare_server_address_gets_the_api_base_and_a_path_is_kept():
    from hf_dflash.data.server import api_base

    assert api_base("http://127.0.0.1:8080") == "http://127.0.0.1:8080/v1"
    assert api_base("http://127.0.0.1:8080/") == "http://127.0.0.1:8080/v1"
    assert api_base("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080/v1"
    assert api_base("https://proxy.example/api/v1") == "https://proxy.example/api/v1"


@pytest.mark.parametrize("owner", ["vllm", "llamacpp"])
def test_the_generated_ids_are_asked_of_engines_that_return_them_and_win_over_the_text(
    engine, tokenizer, stop_ids, local_records, tmp_path, owner, caplog
):
    engine.owner = owner
    prompts = make_prompts(6)
    with caplog.at_level("WARNING", logger="hf_dflash"):
        path = regenerate_responses_with_server(
            tokenizer, prompts, tmp_path / "out.jsonl", server_url=engine.url, stop_ids=stop_ids, **FAST
        )
    assert by_id(read_records(path)) == {p.id: local_records[p.id] for p in prompts}  # one stop id, not two
    fields = {"vllm": {"return_token_ids"}, "llamacpp": {"return_tokens", "verbose"}}[owner]
    assert all(fields <= set(request) for request in engine.requests)
    assert "re-tokenized" not in caplog.text


def test_an_engine_not_known_to_return_ids_gets_a_warning_unless_extra_body_asks_for_them(
    engine, tokenizer, stop_ids, local_records, tmp_path, caplog
):
    prompts = make_prompts(2)
    with caplog.at_level("WARNING", logger="hf_dflash"):
        regenerate_responses_with_server(
            tokenizer, prompts, tmp_path / "text.jsonl", server_url=engine.url, stop_ids=stop_ids, **FAST
        )
    assert "re-tokenized" in caplog.text and "return_token_ids" in caplog.text  # the fix, named
    assert not any("return_token_ids" in request for request in engine.requests)  # nothing unasked-for sent
    caplog.clear()
    engine.owner = "vllm-behind-a-proxy"  # an owner not in TOKEN_ID_FIELDS, whose engine returns ids when asked
    with caplog.at_level("WARNING", logger="hf_dflash"):
        path = regenerate_responses_with_server(
            tokenizer, prompts, tmp_path / "ids.jsonl", server_url=engine.url, stop_ids=stop_ids,
            extra_body={"return_token_ids": True}, **FAST,
        )  # fmt: skip
    assert "re-tokenized" not in caplog.text
    assert by_id(read_records(path)) == {p.id: local_records[p.id] for p in prompts}
