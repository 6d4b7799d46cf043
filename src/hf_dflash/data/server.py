"""Regenerate training responses on a running inference server through its OpenAI-compatible completions API.

``regenerate.regenerate_responses`` loads the target locally; users who already serve it (vLLM, SGLang, TGI,
llama.cpp's server all answer ``POST /v1/completions``) can have that engine write the responses instead with
``regenerate_responses_with_server``. The design:

- **The same records in the same file.** Prompt ids are the local tokenizer's chat-template encoding
  (``chat.encode_prompt``) and the server is sent the very text that encoding tokenizes
  (``chat.apply_chat_template``). The response is the ids the engine generated where it returns them: the
  engines whose ``GET /models`` names them as owner are asked to (``TOKEN_ID_FIELDS``: vLLM's
  ``choices[0].token_ids``, llama.cpp's ``__verbose.tokens``). Otherwise ``choices[0].text`` is tokenized without
  special tokens, with a warning: re-encoding text splits some of it differently from how the model generated it
  (SmolLM2 through llama.cpp's text: 0.54% of response tokens were not the target's own choice, against 0.12% from
  its ids; the first sometimes a ``"\n\n"`` re-encoded as two ``"\n"``; ``benchmarks/results/data/label_agreement.json``). A ``"stop"`` finish
  that does not end in a stop id gets its end-of-turn token appended (the stop id the server names in
  ``stop_reason`` / ``matched_stop`` when it names one, else ``turn_end_id``: the stop id closing an assistant
  turn in the template, ``chat.assistant_turn_closer``), so the record ends like a locally generated one; a
  ``"length"`` finish leaves it unfinished.
- **One writer.** Worker threads (``concurrent.futures``, ``urllib``; no extra dependency) only send
  requests; the main thread writes the answers through the loop local regeneration uses
  (``regenerate.regenerate_records``): those that arrived at each wake-up as one write, flushed and fsynced, so a
  crash tears at most the last line and nothing is written twice. Rerunning the same call resumes: ids already in
  the file are skipped and a torn last line is cut first (``records.completed_ids``,
  ``records.drop_torn_last_line``). Lines are in completion order, not prompt order. At most ``2 * concurrency`` requests are queued at a time.
- **Retries.** Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff and jitter
  (honouring ``Retry-After``), up to ``max_retries`` times per prompt; other 4xx answers and malformed bodies
  fail at once. After the first failure no new prompt is sent and no request is retried, the answers still in
  flight are written as they arrive, and then the failure is raised.

Engine-specific request fields go in ``extra_body``: the template already holds the BOS token, so on vLLM pass
``{"add_special_tokens": False}`` (its completions endpoint adds one by default), and
``{"skip_special_tokens": False}`` when responses may contain special tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerBase

from hf_dflash.data.chat import apply_chat_template, assistant_turn_closer
from hf_dflash.data.prompts import Prompt
from hf_dflash.data.regenerate import Answered, Pending, prompt_seed, regenerate_records

logger = transformers.utils.logging.get_logger(__name__)

# finish_reason values of a response that ended its turn ("eos_token": TGI before 2.2.1) or hit max_tokens.
STOP_FINISHES = ("stop", "eos_token")
LENGTH_FINISH = "length"
MAX_BACKOFF_S = 60.0  # no single wait between retries is longer, whatever Retry-After asks
# Request fields that make an engine return the ids it generated, by the `owned_by` its `GET /models` lists.
TOKEN_ID_FIELDS = {"vllm": {"return_token_ids": True}, "llamacpp": {"return_tokens": True, "verbose": True}}


def api_base(server_url: str) -> str:
    """The OpenAI API base of ``server_url``: as given when it has a path (``http://host:8000/v1``, a proxy's
    ``/api/v1``), else the server's ``/v1`` (``http://host:8000`` -> ``http://host:8000/v1``)."""
    url = server_url.rstrip("/")
    if urllib.parse.urlsplit(url).path:
        return url
    logger.info(f"{server_url} names a server, not its API: using {url}/v1")
    return f"{url}/v1"


def regenerate_responses_with_server(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Iterable[Prompt],
    output_path: str | os.PathLike,
    *,
    server_url: str,
    stop_ids: list[int],
    model: str | None = None,
    max_new_tokens: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_prompt_tokens: int = 512,
    concurrency: int = 8,
    max_retries: int = 5,
    timeout_s: float = 120.0,
    backoff_s: float = 1.0,
    api_key: str | None = None,
    extra_body: dict | None = None,
    progress: bool = True,
) -> Path:
    """Have an OpenAI-compatible server generate the response to each prompt and append ``{id, source,
    prompt_len, input_ids, loss_mask}`` records to ``output_path`` (JSONL), as ``regenerate.regenerate_responses``
    does with a local target.

    Args:
        tokenizer: the target's tokenizer; it renders and encodes prompts and encodes the server's answers.
        prompts: prompts to answer; ids already in the file, repeated ids and prompts longer than
            ``max_prompt_tokens`` (in the chat template) are skipped.
        output_path: the JSONL file, appended to; rerunning the same call resumes it.
        server_url: the API base (``http://host:8000/v1``); a bare server address (``http://host:8000``) gets
            ``/v1``, where OpenAI-compatible servers (vLLM, SGLang, llama-server) serve the API (``api_base``).
        stop_ids: the ids that end a turn, as ``chat.end_of_turn_ids`` (of the target or its ``GenerationConfig``)
            gives them; one of them is appended to responses the server reports as stopped.
        model: the served model's name; ``None`` asks ``GET {server_url}/models`` and takes the first.
        max_new_tokens, do_sample, temperature, top_p: sent as ``max_tokens``, ``temperature`` (0 when
            greedy) and ``top_p`` (1 when greedy).
        seed: each request's ``seed`` is derived from it and the prompt id.
        concurrency: requests in flight at once.
        max_retries: retries per prompt after its first attempt, on connection errors, timeouts, 429 and 5xx.
        timeout_s: socket timeout of one attempt (connect, and each read).
        backoff_s: the first wait between attempts; it doubles on each retry, up to ``MAX_BACKOFF_S``.
        api_key: sent as ``Authorization: Bearer ...`` when given.
        extra_body: engine-specific fields merged into every request (see the module docstring).
        progress: show a progress bar.

    Raises:
        ConnectionError: a prompt still failed after ``max_retries`` retries (rerun to resume).
        RuntimeError: the server rejected a request (a 4xx other than 429), with its message.
        ValueError: the server's answer is not a completions response.
        In each case everything answered before is in the file.
    """
    if concurrency < 1 or max_retries < 0:
        raise ValueError(
            f"concurrency must be at least 1 and max_retries at least 0, got {concurrency}, {max_retries}"
        )
    client = _Client(api_base(server_url), timeout_s, max_retries, backoff_s, api_key)
    sampling = {
        "max_tokens": max_new_tokens,
        "temperature": temperature if do_sample else 0.0,
        "top_p": top_p if do_sample else 1.0,
        "stream": False,
    }
    job = _Job(model, sampling, extra_body or {}, seed, concurrency, stop_ids)
    finishes = Counter()

    def answer(todo: list[Pending]) -> Iterator[list[Answered]]:
        return _answered_batches(client, job, tokenizer, todo, finishes)

    total = regenerate_records(
        tokenizer, prompts, output_path, answer, max_prompt_tokens=max_prompt_tokens, progress=progress
    )
    _log_finishes(finishes, total, max_new_tokens)
    return Path(output_path)


def turn_end_id(tokenizer: PreTrainedTokenizerBase, stop_ids: list[int]) -> int | None:
    """The stop id a finished assistant turn ends with: the token that closes an assistant message in the chat
    template (``<|im_end|>``, ``<|eot_id|>``, ``</s>`` for Mistral, whose user turns close with ``[/INST]``),
    else the tokenizer's EOS, else the smallest stop id; ``None`` when there is no stop id."""
    candidates = [assistant_turn_closer(tokenizer), tokenizer.eos_token_id, *sorted(stop_ids)]
    return next((i for i in candidates if i is not None and i in stop_ids), None)


# The run


@dataclass(frozen=True)
class _Job:
    """What every request of a run shares: the model (``None``: ask the server), sampling fields, extra fields."""

    model: str | None
    sampling: dict
    extra_body: dict
    seed: int
    concurrency: int
    stop_ids: list[int]

    def request(self, model: str, text: str, prompt_id: str) -> dict:
        """The completions request for one prompt's rendered text (``extra_body`` wins over every other field)."""
        fields = {"model": model, "prompt": text, "seed": _request_seed(self.seed, prompt_id), **self.sampling}
        return fields | self.extra_body


def _answered_batches(
    client: _Client, job: _Job, tokenizer: PreTrainedTokenizerBase, todo: list[Pending], finishes: Counter
) -> Iterator[list[Answered]]:
    """Ask the server for ``todo``'s answers: the model lookup runs now, the requests as the iterator is read.

    Each answer's finish reason is counted in ``finishes``, and its empty responses as ``"empty"``.
    """
    model, owner = client.served_model(job.model)
    turn_end = turn_end_id(tokenizer, job.stop_ids)
    logger.info(f"Regenerating {len(todo)} responses on {client.url} (model {model!r}, {job.concurrency} at a time)")
    id_fields = _token_id_fields(owner, job.extra_body, client.url)
    requests = [
        id_fields | job.request(model, apply_chat_template(tokenizer, prompt), prompt.id) for prompt, _ in todo
    ]
    return _tallied(client, job, tokenizer, todo, requests, turn_end, finishes)


def _token_id_fields(owner: str | None, extra_body: dict, url: str) -> dict:
    """The request fields that make the engine `owner` return its generated ids; a warning naming the fix when it is
    not known to and `extra_body` asks for none."""
    fields = TOKEN_ID_FIELDS.get(owner, {})
    if not fields and not set(extra_body) & {name for known in TOKEN_ID_FIELDS.values() for name in known}:
        logger.warning(
            f"{url} (owner {owner!r}) is not known to return the generated token ids: responses are its text "
            "re-tokenized, which splits some tokens differently from how the model generated them (on SmolLM2 through "
            "llama.cpp, 0.54% of response tokens were not the target's own choice from its text, 0.12% from its "
            "ids). Pass extra_body fields that make it return choices[0].token_ids (vLLM: return_token_ids) to keep "
            "the generated ids."
        )
    return fields


def _tallied(
    client: _Client,
    job: _Job,
    tokenizer: PreTrainedTokenizerBase,
    todo: list[Pending],
    requests: list[dict],
    turn_end: int | None,
    finishes: Counter,
) -> Iterator[list[Answered]]:
    """The answered prompts of each wake-up of ``_answers``, their finish reasons counted in ``finishes``."""
    for answers in _answers(client, requests, [prompt.id for prompt, _ in todo], job.concurrency):
        answered = [(*todo[i], _response(choice, tokenizer, job.stop_ids, turn_end)) for i, choice in answers]
        finishes.update(choice["finish_reason"] for _, choice in answers)
        finishes["empty"] += sum(not response for _, _, response in answered)
        yield answered


def _log_finishes(finishes: Counter, total: int, max_new_tokens: int) -> None:
    if finishes[LENGTH_FINISH]:
        logger.info(f"{finishes[LENGTH_FINISH]} of {total} responses were cut at max_new_tokens={max_new_tokens}")
    if finishes["empty"]:
        logger.warning(
            f"{finishes['empty']} answers held no token (an engine that drops special tokens from the text?) and "
            "were not written; a rerun asks for them again"
        )


def _answers(
    client: _Client, requests: list[dict], prompt_ids: list[str], concurrency: int
) -> Iterator[list[tuple[int, dict]]]:
    """Send the requests ``concurrency`` at a time; yield the (request index, ``choices[0]``) pairs that arrived
    at each wake-up. On the first failure nothing new is sent and nothing is retried, the answers in flight are
    yielded as they arrive, and then the failure is raised."""
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="hf-dflash-server")
    running: dict[Future, int] = {}
    sent, answered, failure = 0, 0, None
    try:
        while True:
            while failure is None and sent < len(requests) and len(running) < 2 * concurrency:
                running[pool.submit(client.complete, requests[sent], prompt_ids[sent])] = sent
                sent += 1
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            answers = []
            for future in done:
                index, error = running.pop(future), future.exception()
                if error is None:
                    answers.append((index, future.result()))
                elif failure is None and not isinstance(error, _Cancelled):
                    failure = error
                    client.stop.set()  # in-flight attempts still finish; nothing is retried
            answered += len(answers)
            yield answers
    finally:
        client.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    if failure is not None:
        logger.warning(f"{client.url}: stopping after a failure; {answered} answers were written")
        raise failure


def _request_seed(seed: int, prompt_id: str) -> int:
    """The local path's seed formula (``seed * 1_000_003 + crc32(id)``) per prompt, kept within int32 for servers
    that parse seeds that way."""
    return prompt_seed(seed, prompt_id) % 2**31


def _response(choice: dict, tokenizer, stop_ids: list[int], turn_end: int | None) -> list[int]:
    """The ids of one answer (the generated ones when the server returned them, else its text's tokens), ending in
    an end-of-turn token if it stopped."""
    ids = choice.get("token_ids")
    response = list(ids) if ids is not None else tokenizer(choice["text"], add_special_tokens=False).input_ids
    if choice["finish_reason"] in STOP_FINISHES and not (response and response[-1] in stop_ids):
        named = choice.get("stop_reason", choice.get("matched_stop"))  # vLLM's, SGLang's name of the stop token
        end = named if isinstance(named, int) and named in stop_ids else turn_end
        response += [end] if end is not None else []
    return response


# HTTP


class _Cancelled(Exception):
    """A request or retry skipped because the run is stopping after a prompt failed."""


@dataclass
class _Client:
    """Sends requests to one server with retries; ``stop`` ends all retrying once the run fails."""

    url: str
    timeout_s: float
    max_retries: int
    backoff_s: float
    api_key: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def served_model(self, model: str | None) -> tuple[str, str | None]:
        """``(model, owner)``: ``model``, or the first model ``GET {url}/models`` lists when it is ``None``, and the
        ``owned_by`` listed for it (``None`` when not listed, or when a given model's server lists no models)."""
        url = f"{self.url}/models"
        try:
            answer = self._with_retries(lambda: _parse_json(self._send(url, None), url), "GET /models")
        except (RuntimeError, ValueError):  # a proxy that serves no /models: fine when the model is named
            if model is None:
                raise
            return model, None
        models = answer.get("data") if isinstance(answer, dict) else None
        listed = [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []
        if model is None:
            if not listed or not isinstance(listed[0].get("id"), str):
                raise ValueError(f"{url} lists no model ({_snippet(answer)}); pass model=... explicitly")
            model = listed[0]["id"]
            logger.info(f"{url}: using model {model!r}")
        owner = next((m.get("owned_by") for m in listed if m.get("id") == model), None)
        return model, owner if isinstance(owner, str) else None

    def complete(self, request: dict, prompt_id: str) -> dict:
        """``choices[0]`` of the server's answer to one completions request (``text``, ``finish_reason``, ...)."""
        url = f"{self.url}/completions"
        body = json.dumps(request).encode()
        if self.stop.is_set():
            raise _Cancelled()
        try:
            return self._with_retries(lambda: _parse_choice(self._send(url, body), url), f"prompt {prompt_id!r}")
        except Exception:
            self.stop.set()  # set here, not by the main thread later, so that no queued prompt starts after this
            raise

    def _with_retries(self, attempt, what: str):
        last = ""
        for retry in range(self.max_retries + 1):
            try:
                return attempt()
            except urllib.error.HTTPError as error:
                message = _error_message(error)
                if error.code != 429 and error.code < 500:
                    hint = " (does server_url end in /v1?)" if error.code == 404 else ""
                    raise RuntimeError(
                        f"{error.url} rejected {what} with HTTP {error.code}{hint}: {message}"
                    ) from error
                last, wait_s = f"HTTP {error.code}: {message}", _retry_after(error)
            except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, cut short
                last, wait_s = f"{type(error).__name__}: {error}", 0.0
            if retry == self.max_retries:
                break
            delay = min(max(self.backoff_s * 2**retry * (1 + 0.25 * random.random()), wait_s), MAX_BACKOFF_S)
            logger.info(f"{self.url}: {what} failed ({last}); retry {retry + 1}/{self.max_retries} in {delay:.2f}s")
            if self.stop.wait(delay):
                raise _Cancelled()
        raise ConnectionError(
            f"{self.url}: {what} failed {self.max_retries + 1} times; last error: {last}. Everything answered "
            "before is in the output file: rerun the same command to resume."
        )

    def _send(self, url: str, body: bytes | None) -> bytes:
        """One HTTP attempt: POST ``body`` as JSON, or GET when it is ``None``."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=body, headers=headers, method="GET" if body is None else "POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read()


def _parse_json(body: bytes, url: str):
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{url} answered with something that is not JSON: {body[:200]!r}") from error


def _parse_choice(body: bytes, url: str) -> dict:
    """``choices[0]`` of a completions answer, checked to hold a ``text`` and a known ``finish_reason``, with the
    generated ids under ``token_ids`` where the answer holds them (vLLM puts them there; llama.cpp in
    ``__verbose.tokens``)."""
    answer = _parse_json(body, url)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("text"), str):
        raise ValueError(
            f"{url} answered without choices[0].text, so it is no completions endpoint: {_snippet(answer)}"
        )
    if choice.get("finish_reason") not in (*STOP_FINISHES, LENGTH_FINISH):
        raise ValueError(
            f"{url} answered with finish_reason {choice.get('finish_reason')!r}; expected one of "
            f"{', '.join((*STOP_FINISHES, LENGTH_FINISH))}"
        )
    verbose = answer.get("__verbose")
    ids = choice.get("token_ids", verbose.get("tokens") if isinstance(verbose, dict) else None)
    if ids is None:
        return choice
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{url} answered with token ids that are not a list of integers: {_snippet(ids)}")
    return choice | {"token_ids": ids}


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's explanation in an error answer (OpenAI-style ``{"error": {"message": ...}}`` or the raw body)."""
    try:
        body = error.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return error.reason or ""
    try:
        detail = json.loads(body).get("error", body)
    except (json.JSONDecodeError, AttributeError):
        return body[:500]
    return str(detail.get("message", detail) if isinstance(detail, dict) else detail)[:500]


def _retry_after(error: urllib.error.HTTPError) -> float:
    """The ``Retry-After`` header in seconds (0 when absent or a date)."""
    try:
        return float(error.headers.get("Retry-After", 0))
    except (TypeError, ValueError):
        return 0.0


def _snippet(value) -> str:
    return json.dumps(value)[:200]
