"""Serving engines: what llama.cpp and OpenVINO GenAI are asked and how their answers are read (fast, on stand-in
installs and recorded output), and the committed SmolLM2 drafter run by each engine itself (slow; needs
`bash scripts/install_engines.sh [--openvino]`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from hf_dflash.engines import llama_cpp, openvino

# What llama-speculative-simple -lv 4 printed for the committed drafter (2026-12-05), shortened.
SPECULATIVE_LOG = """\
0.04.695.309 I encoded   95 tokens in    0.350 seconds, speed:  271.689 t/s
0.04.695.310 I decoded  131 tokens in    3.660 seconds, speed:   35.790 t/s
0.04.695.315 I n_draft   = 7
0.04.695.316 I n_drafted = 496
0.04.695.377 I spec common_specu: statistics     draft-dflash: #calls(b,g,a) =    1     71     71, #gen drafts =     71, \
#acc drafts =    28, #gen tokens =    496, #acc tokens =    60, #mean acc len = 1.85, #acc rate/pos = (0.394, 0.268)
"""


def fake_llama_cpp(tmp_path, graphs: dict[str, str]) -> llama_cpp.LlamaCpp:
    root = tmp_path / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
    (root / "src" / "models").mkdir(parents=True)
    for name, source in graphs.items():
        (root / "src" / "models" / f"{name}.cpp").write_text(source)
    return llama_cpp.find_llama_cpp(tmp_path)


def test_targets_whose_graph_records_no_layer_inputs_are_refused_by_name(tmp_path):
    tree = fake_llama_cpp(tmp_path, {"llama": "res->t_layer_inp[il] = inpL;", "gemma3": "cur = build_ffn(cur);"})
    assert llama_cpp.unsupported_target_reason(tree, "llama") is None
    reason = llama_cpp.unsupported_target_reason(tree, "gemma3")
    assert "gemma3 graph (src/models/gemma3.cpp) does not record its layers' inputs" in reason
    assert "no graph for architecture 'rwkv7'" in llama_cpp.unsupported_target_reason(tree, "rwkv7")


def test_a_missing_engine_names_the_install_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="bash scripts/install_engines.sh"):
        llama_cpp.find_llama_cpp(tmp_path)
    tree = fake_llama_cpp(tmp_path, {})
    with pytest.raises(FileNotFoundError, match="llama-speculative-simple is not built.*install_engines.sh"):
        tree.tool("llama-speculative-simple")


def test_the_speculative_log_is_read_for_speed_and_mean_accepted_length():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    run = llama_cpp.parse_speculative_log(f"\n\n{prompt}Hello there.", SPECULATIVE_LOG, prompt)
    assert run.text == "Hello there."
    assert (run.new_tokens, run.tokens_per_s, run.mean_accepted_length, run.draft_passes) == (131, 35.79, 1.85, 71)
    undrafted = llama_cpp.parse_speculative_log(prompt, SPECULATIVE_LOG.splitlines()[1], prompt)
    assert undrafted.mean_accepted_length is None and undrafted.new_tokens == 131  # a method that never drafted
    with pytest.raises(RuntimeError, match="did not show its counts"):
        llama_cpp.parse_speculative_log(prompt, "decoded nothing", prompt)


def test_texts_agree_as_far_as_both_go():
    assert llama_cpp.texts_agree("fiber = 4\n\n", "fiber = 4 bolts")
    assert not llama_cpp.texts_agree("fiber = 5", "fiber = 4 bolts")


def built_llama_cpp_or_skip() -> llama_cpp.LlamaCpp:
    try:
        tree = llama_cpp.find_llama_cpp()
        tree.tool("llama-speculative-simple")
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return tree


def engine_and_our_tau(tree, draft, check_text: bool = False) -> tuple[float, float]:
    """llama.cpp's mean accepted length and hf-dflash's whole-block tau for `draft` (exported with its reduced
    vocabulary) on SmolLM2's fp32 weights, three GSM8K prompts, 96 new tokens each; with `check_text`, llama.cpp's
    DFlash text is also the one its speculative tool gives without a drafter (ngram drafts)."""
    import torch

    from hf_dflash import loading, speculative_generate
    from hf_dflash.data.chat import apply_chat_template, encode_prompt
    from hf_dflash.data.prompts import load_prompts
    from hf_dflash.targets import converted_target_folder, locate_gguf

    name = "smollm2-135m-instruct"
    target, tokenizer = loading.load_target_and_tokenizer(name, device="cpu", dtype="float32")
    draft = draft(target)
    target_gguf = locate_gguf(name)
    with tempfile.TemporaryDirectory() as scratch:
        gguf = llama_cpp.export_draft_gguf(
            draft, target, converted_target_folder(name), target_gguf, Path(scratch) / "d.gguf"
        )
        engine_tokens = engine_steps = our_tokens = our_steps = 0
        for prompt in load_prompts("gsm8k", limit=3):
            text = apply_chat_template(tokenizer, prompt)
            run = {"max_new_tokens": 96, "draft_tokens": draft.config.block_size - 1}
            dflash = llama_cpp.run_speculative(target_gguf, text, draft_gguf=gguf, llama_cpp=tree, **run)
            if check_text:
                ngram = llama_cpp.run_speculative(target_gguf, text, spec_type="ngram-simple", llama_cpp=tree, **run)
                assert llama_cpp.texts_agree(dflash.text, ngram.text)
            engine_tokens += dflash.mean_accepted_length * dflash.draft_passes
            engine_steps += dflash.draft_passes
            ids = torch.tensor([encode_prompt(tokenizer, prompt)])
            ours = speculative_generate(target, draft, ids, max_new_tokens=96, tree=False, optimize_cpu=False)
            our_tokens += sum(ours.stats.acceptance_lengths)
            our_steps += len(ours.stats.acceptance_lengths)
    return engine_tokens / engine_steps, our_tokens / our_steps


@pytest.mark.slow
def test_llama_cpp_runs_the_committed_drafter_near_our_tau_and_as_its_own_verification():
    """The committed SmolLM2 drafter exported with its reduced vocabulary, run by llama.cpp on GSM8K prompts: its
    greedy text is the one llama.cpp's speculative tool gives without DFlash (ngram drafts), and its mean accepted
    length is near hf-dflash's whole-block tau on the fp32 weights of the same GGUF."""
    pytest.importorskip("torch")
    from hf_dflash import loading

    committed = loading.committed_drafter("smollm2-135m-instruct")
    engine, ours = engine_and_our_tau(built_llama_cpp_or_skip(), lambda t: loading.load_draft(committed, t), True)
    assert engine == pytest.approx(ours, rel=0.10)  # the bar


@pytest.mark.slow
def test_llama_cpp_runs_a_dflash2_drafter_near_our_tau():
    """A DFlash2 drafter (the committed SmolLM2 drafter converted, with a seeded random selector that overrules its
    argmax: the walk is what is compared), exported with its reduced vocabulary and run by llama.cpp's DFlash2
    runtime on three GSM8K prompts: llama.cpp's mean accepted length is within 10% of our whole-block tau."""
    torch = pytest.importorskip("torch")
    from hf_dflash import loading
    from hf_dflash.training.draft_init import dflash2_from_dflash

    overruled = []

    def dflash2_drafter(target):
        v1 = loading.load_draft(loading.committed_drafter("smollm2-135m-instruct"), target)
        draft = dflash2_from_dflash(v1, selector_rank=32, selector_top_k=8).eval()
        generator = torch.Generator().manual_seed(0)
        selector = draft.candidate_selector
        with torch.no_grad():
            for parameter, scale in [
                (selector.successor_codebook, 0.5),
                (selector.predecessor_codebook, 0.5),
                (selector.hidden_projection.weight, 0.05),
            ]:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        select_chain = draft.select_chain

        def counting_select_chain(*args, **kwargs):  # slots where the walk left the unary argmax
            tokens, candidates, chain = select_chain(*args, **kwargs)
            overruled.append(int((tokens != candidates[..., 0]).sum()))
            return tokens, candidates, chain

        draft.select_chain = counting_select_chain
        return draft

    engine, ours = engine_and_our_tau(built_llama_cpp_or_skip(), dflash2_drafter)
    assert sum(overruled) > 0  # the selector's walk, not v1's argmax, is what the two agree on
    assert engine == pytest.approx(ours, rel=0.10)  # the bar


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_zlab_engine_export_writes_the_folder_and_the_commands_that_serve_it(engine, tmp_path):
    import json

    from helpers import make_draft, make_target

    from hf_dflash.engines.export import export_for_engine

    target = make_target("qwen3")
    draft = make_draft(target, block_size=4)
    recipe = export_for_engine(draft, target, engine, tmp_path / "out", target_id="org/target")
    written = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert written["engine"] == engine and written["block_size"] == 4 and written["tested_here"] is False
    assert (tmp_path / "out" / "config.json").is_file()
    drafted = '"num_speculative_tokens": 3' if engine == "vllm" else "--speculative-num-draft-tokens 4"
    assert drafted in recipe.commands[0] and "org/target" in recipe.commands[0]


def test_an_unknown_engine_or_a_llama_cpp_export_without_the_target_gguf_is_refused(tmp_path):
    from helpers import make_draft, make_target

    from hf_dflash.engines.export import export_for_engine

    target = make_target("qwen3")
    draft = make_draft(target, block_size=4)
    unknown = "Unknown engine 'tgi'; hf-dflash exports for llama.cpp, openvino, vllm, sglang"
    with pytest.raises(ValueError, match=unknown):
        export_for_engine(draft, target, "tgi", tmp_path / "a", target_id="t")
    with pytest.raises(ValueError, match="llama.cpp needs the target's GGUF"):
        export_for_engine(draft, target, "llama.cpp", tmp_path / "b", target_id="t")


# ---------------------------------------------------------------------------------------------------------------------
# OpenVINO GenAI
# ---------------------------------------------------------------------------------------------------------------------

# What openvino_runner.py printed for the committed drafter on gsm8k/1 (2026-12-05), ids shortened to the first 9.
RUNNER_REPORT = {
    "openvino_genai": "2026.4.1.0",
    "device": "CPU",
    "properties": {"INFERENCE_NUM_THREADS": 2},
    "device_defaults": {"INFERENCE_PRECISION_HINT": "<Type: 'float32'>", "KV_CACHE_PRECISION": "<Type: 'uint8_t'>"},
    "runs": [
        {
            "prompt_tokens": 56,
            "token_ids": [504, 3437, 314, 216, 34, 1659, 216, 33, 30],
            "text": "The answer is 2 * 1.",
            "new_tokens": 9,
            "target_steps": 3,
            "step_tokens": [1, 7, 1],
            "accepted_tokens": 6,
            "tokens_per_s": 61.5,
        }
    ],
}


def fake_openvino_venv(tmp_path, marker: bool = True):
    venv = tmp_path / "openvino-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    if marker:
        (venv / openvino.MARKER).write_text("pins")
    return venv


def fake_ir(tmp_path, *models: str):
    for name in models:
        (tmp_path / "ir" / name).mkdir(parents=True)
        (tmp_path / "ir" / name / "openvino_model.xml").write_text("<net/>")
    return tmp_path / "ir"


def test_a_missing_or_half_built_openvino_venv_names_the_install_command(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"bash scripts/install_engines.sh --openvino"):
        openvino.find_openvino(tmp_path / "nothing")
    half_built = fake_openvino_venv(tmp_path, marker=False)  # install_engines.sh writes the marker last
    with pytest.raises(FileNotFoundError, match="not installed"):
        openvino.find_openvino(half_built)
    (half_built / openvino.MARKER).write_text("pins")
    assert openvino.find_openvino(half_built).python == half_built / "bin" / "python"
    monkeypatch.setenv("HF_DFLASH_ENGINES", str(tmp_path))  # the same engines folder rule as llama.cpp
    assert openvino.find_openvino().venv == half_built


def test_the_runner_request_is_checked_before_the_venv_runs(tmp_path):
    ir = fake_ir(tmp_path, "target")
    run = {"max_new_tokens": 8, "block_size": 8}
    request = openvino.runner_request(ir, [(1, 2, 3), "<|im_start|>user"], with_draft=False, **run)
    assert request["prompts"] == [[1, 2, 3], "<|im_start|>user"] and request["with_draft"] is False
    assert request["properties"] == {} and request["threads"] == 2
    with pytest.raises(FileNotFoundError, match="has no draft IR: write it with `export_openvino`"):
        openvino.runner_request(ir, [[1]], with_draft=True, **run)
    with pytest.raises(ValueError, match="No prompts"):
        openvino.runner_request(ir, [], with_draft=False, **run)
    for bad in ([], [1.5], [True, 2]):
        with pytest.raises(ValueError, match="non-empty list of token ids"):
            openvino.runner_request(ir, [bad], with_draft=False, **run)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        openvino.runner_request(ir, [[1]], with_draft=False, max_new_tokens=0, block_size=8)
    ir = fake_ir(tmp_path, "draft")
    for block_size in (None, 1):
        with pytest.raises(ValueError, match="DFlash needs the drafter's block size"):
            openvino.runner_request(ir, [[1]], with_draft=True, max_new_tokens=8, block_size=block_size)
    with pytest.raises(ValueError, match="`paged` is for plain decoding"):
        openvino.runner_request(ir, [[1]], with_draft=True, paged=True, **run)


def test_the_runner_report_is_read_with_target_steps_and_mean_accepted_length():
    import json

    log = "openvino_runner: prompt 1/1 done\n"
    (run,) = openvino.parse_runner_report(log + json.dumps(RUNNER_REPORT) + "\n", expected=1)
    assert (run.new_tokens, run.target_steps, run.accepted_tokens, run.drafted_steps) == (9, 3, 6, 2)
    assert run.mean_accepted_length == 4.0  # (9 - the prompt step's 1 token) / 2 drafted steps, as tau counts
    assert run.text.startswith("The answer")
    plain = json.loads(json.dumps(RUNNER_REPORT))
    plain["runs"][0] |= {
        "token_ids": [504],
        "new_tokens": 1,
        "target_steps": 1,
        "step_tokens": [1],
        "accepted_tokens": 0,
    }
    assert openvino.parse_runner_report(json.dumps(plain))[0].mean_accepted_length is None  # nothing drafted


@pytest.mark.parametrize(
    "stdout, message",
    [
        ("", "printed no report"),
        ("Traceback (most recent call last):", "last line is not JSON"),
        ('{"runs": "none"}', "printed no report with runs"),
        ('{"runs": [{"text": "hi"}]}', "run 0 lacks token_ids, new_tokens"),
    ],
)
def test_a_broken_runner_report_is_refused(stdout, message):
    with pytest.raises(RuntimeError, match=message):
        openvino.parse_runner_report(stdout)


def test_a_runner_report_whose_counts_disagree_is_refused():
    import json

    report = json.loads(json.dumps(RUNNER_REPORT))
    report["runs"][0]["step_tokens"] = [1, 7]  # 8 tokens in 2 steps, but it says 9 in 3
    with pytest.raises(RuntimeError, match="9 new tokens in 3 steps, but the per-step counts sum to 8 over 2"):
        openvino.parse_runner_report(json.dumps(report))
    with pytest.raises(RuntimeError, match="reported 1 runs for 2 prompts"):
        openvino.parse_runner_report(json.dumps(RUNNER_REPORT), expected=2)


def test_drafters_openvino_would_run_unlike_their_training_are_refused_by_reason(tmp_path):
    from helpers import make_draft, make_target

    target = make_target("llama")
    assert openvino.unsupported_draft_reason(make_draft(target).config) is None
    scaled = make_draft(target, input_embedding_scale=8.0)
    assert "embedding rows by 8" in openvino.unsupported_draft_reason(scaled.config)
    causal = make_draft(
        target, layer_types=["sliding_attention", "full_attention"], sliding_window=4, causal_sliding_attention=True
    )
    assert "attend causally inside the block" in openvino.unsupported_draft_reason(causal.config)
    with pytest.raises(ValueError, match="cannot serve this drafter as trained: the target scales"):
        openvino.export_openvino(scaled, tmp_path, tmp_path / "out")  # refused before the venv is looked for


def test_an_openvino_export_writes_the_settings_genai_needs_to_serving_json(tmp_path, monkeypatch):
    import json

    from helpers import make_draft, make_target

    from hf_dflash.engines.export import export_for_engine

    exported = []
    monkeypatch.setattr(openvino, "export_openvino", lambda draft, folder, output: exported.append((folder, output)))
    target = make_target("llama")
    draft = make_draft(target, block_size=6)
    with pytest.raises(ValueError, match="OpenVINO needs the target's transformers folder"):
        export_for_engine(draft, target, "openvino", tmp_path / "a", target_id="t")
    recipe = export_for_engine(draft, target, "openvino", tmp_path / "out", target_id="t", target_folder="tgt")
    assert exported == [("tgt", tmp_path / "out")]
    written = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert written["settings"] == {"scheduler_config.enable_prefix_caching": False, "num_assistant_tokens": 5}
    assert written["engine"] == "openvino" and written["tested_here"] is True
    assert written["draft"] == str(tmp_path / "out" / "draft") and written["block_size"] == 6
    command = recipe.commands[0]
    assert "s.enable_prefix_caching = False" in command and "c.num_assistant_tokens = 5" in command
    assert f"g.draft_model('{tmp_path / 'out'}/draft', 'CPU')" in command


@pytest.mark.slow
def test_openvino_runs_the_committed_drafter_with_a_mean_accepted_length_above_1_2(tmp_path, record_property):
    """The committed SmolLM2 drafter exported to OpenVINO IR and run by GenAI's DFlash pipeline on two GSM8K prompts,
    greedy: GenAI's mean accepted length (tokens per drafted target step) is above 1.2."""
    try:
        engine = openvino.find_openvino()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    from hf_dflash import loading
    from hf_dflash.data.chat import encode_prompt
    from hf_dflash.data.prompts import load_prompts
    from hf_dflash.targets import converted_target_folder

    name = "smollm2-135m-instruct"
    target, tokenizer = loading.load_target_and_tokenizer(name, device="cpu", dtype="float32")
    draft = loading.load_draft(loading.committed_drafter(name), target)
    ir = openvino.export_openvino(draft, converted_target_folder(name), tmp_path / "ir", openvino=engine)
    prompts = [encode_prompt(tokenizer, prompt) for prompt in load_prompts("gsm8k", limit=2)]
    runs = openvino.run_openvino(
        ir, prompts, max_new_tokens=96, with_draft=True, block_size=draft.config.block_size, openvino=engine
    )
    committed = sum(run.new_tokens - run.step_tokens[0] for run in runs)
    mean_accepted_length = committed / sum(run.drafted_steps for run in runs)
    record_property("openvino_mean_accepted_length", mean_accepted_length)  # in the JUnit report (--junitxml)
    assert all(run.accepted_tokens > 0 and run.text for run in runs)
    assert mean_accepted_length > 1.2, f"GenAI's mean accepted length on 2 GSM8K prompts: {mean_accepted_length:.3f}"


@pytest.mark.slow
def test_llama_server_records_hold_the_ids_it_generated(tmp_path, caplog):
    """`regenerate_responses_with_server` on llama.cpp's own server (the package's GGUF, one slot): the engine is
    recognized and asked for its ids (no re-tokenizing warning), and each record's response is the token list its
    native `/completion` returns for the same prompt, a stop token included once."""
    import json
    import subprocess
    import time
    import urllib.request

    try:
        server_program = llama_cpp.find_llama_cpp().tool("llama-server")
    except FileNotFoundError as error:
        pytest.skip(str(error))
    from transformers import AutoTokenizer, GenerationConfig

    from hf_dflash.data.chat import apply_chat_template, end_of_turn_ids
    from hf_dflash.data.prompts import load_prompts
    from hf_dflash.data.server import regenerate_responses_with_server
    from hf_dflash.targets import converted_target_folder, locate_gguf

    name, port = "smollm2-135m-instruct", 8097
    folder = converted_target_folder(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stop_ids = end_of_turn_ids(GenerationConfig.from_pretrained(folder), tokenizer)
    command = [server_program, "-m", locate_gguf(name), "-np", "1", "-c", "2048", "-t", "2", "--port", str(port)]
    server = subprocess.Popen([*map(str, command), "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.loads(answer.read())

    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        prompts = load_prompts("gsm8k", limit=2) + load_prompts("mt-bench", limit=1)
        with caplog.at_level("WARNING", logger="hf_dflash"):
            path = regenerate_responses_with_server(
                tokenizer, prompts, tmp_path / "records.jsonl", server_url=url, stop_ids=stop_ids,
                max_new_tokens=96, max_prompt_tokens=1024, concurrency=1, progress=False,
                extra_body={"cache_prompt": False},  # both runs process the prompt whole: the same numerics
            )  # fmt: skip
        records = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
        for prompt in prompts:
            body = {"prompt": apply_chat_template(tokenizer, prompt), "n_predict": 96, "temperature": 0.0}
            body |= {"cache_prompt": False}
            native = post("/completion", body | {"return_tokens": True})
            record = records[prompt.id]
            assert record["input_ids"][record["prompt_len"] :] == native["tokens"]
            assert sum(token in stop_ids for token in native["tokens"]) == (native["stop_type"] == "eos")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "re-tokenized" not in caplog.text
