"""Serving engines: what llama.cpp is asked and how its answers are read (fast, on a stand-in source tree and
recorded logs), and the committed SmolLM2 drafter run by llama.cpp itself (slow; needs
`bash scripts/install_engines.sh`)."""

from __future__ import annotations

import pytest

from hf_dflash.engines import llama_cpp

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


@pytest.mark.slow
def test_llama_cpp_runs_the_committed_drafter_near_our_tau_and_as_its_own_verification(tmp_path):
    """The committed SmolLM2 drafter exported with its reduced vocabulary, run by llama.cpp on GSM8K prompts: its
    greedy text is the one llama.cpp's speculative tool gives without DFlash (ngram drafts), and its mean accepted
    length is near hf-dflash's whole-block tau on the fp32 weights of the same GGUF."""
    torch = pytest.importorskip("torch")
    try:
        tree = llama_cpp.find_llama_cpp()
        tree.tool("llama-speculative-simple")
    except FileNotFoundError as error:
        pytest.skip(str(error))
    from hf_dflash import loading, speculative_generate
    from hf_dflash.data.chat import apply_chat_template, encode_prompt
    from hf_dflash.data.prompts import load_prompts
    from hf_dflash.targets import converted_target_folder, locate_gguf

    name = "smollm2-135m-instruct"
    target, tokenizer = loading.load_target_and_tokenizer(name, device="cpu", dtype="float32")
    draft = loading.load_draft(loading.committed_drafter(name), target)
    target_gguf = locate_gguf(name)
    gguf = llama_cpp.export_draft_gguf(draft, target, converted_target_folder(name), target_gguf, tmp_path / "d.gguf")
    engine_tokens = engine_steps = our_tokens = our_steps = 0
    for prompt in load_prompts("gsm8k", limit=3):
        text = apply_chat_template(tokenizer, prompt)
        run = {"max_new_tokens": 96, "draft_tokens": draft.config.block_size - 1}
        dflash = llama_cpp.run_speculative(target_gguf, text, draft_gguf=gguf, llama_cpp=tree, **run)
        ngram = llama_cpp.run_speculative(target_gguf, text, spec_type="ngram-simple", llama_cpp=tree, **run)
        assert llama_cpp.texts_agree(dflash.text, ngram.text)
        engine_tokens += dflash.mean_accepted_length * dflash.draft_passes
        engine_steps += dflash.draft_passes
        ids = torch.tensor([encode_prompt(tokenizer, prompt)])
        ours = speculative_generate(target, draft, ids, max_new_tokens=96, tree=False, optimize_cpu=False)
        our_tokens += sum(ours.stats.acceptance_lengths)
        our_steps += len(ours.stats.acceptance_lengths)
    assert engine_tokens / engine_steps == pytest.approx(our_tokens / our_steps, rel=0.10)  # the bar


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
    with pytest.raises(ValueError, match="Unknown engine 'openvino'; hf-dflash exports for llama.cpp, vllm, sglang"):
        export_for_engine(draft, target, "openvino", tmp_path / "a", target_id="t")
    with pytest.raises(ValueError, match="llama.cpp needs the target's GGUF"):
        export_for_engine(draft, target, "llama.cpp", tmp_path / "b", target_id="t")
