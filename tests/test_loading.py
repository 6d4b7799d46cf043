"""`hf_dflash.loading`: one way to name a target and a device for every command, and the flags that spell it."""

import pytest
import torch
from helpers import FAMILY_CONFIGS, make_draft, make_target
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_dflash import loading
from hf_dflash.cli.flags import FlagParser, add_target_flags, target_arguments
from hf_dflash.training.script import parse_train_args


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama target folder, a drafter folder built for it and one built for a narrower Llama."""
    root = tmp_path_factory.mktemp("loading")
    target = make_target("llama")
    target.save_pretrained(root / "target")
    make_draft(target, block_size=4, num_hidden_layers=1).save_pretrained(root / "draft")
    wider = AutoModelForCausalLM.from_config(
        LlamaConfig(**(FAMILY_CONFIGS["llama"]().to_dict() | {"hidden_size": 32}))
    )
    make_draft(wider, block_size=4, num_hidden_layers=1).save_pretrained(root / "other_draft")
    return root


def load(folder, **options):
    return loading.load_target_and_tokenizer(folder, tokenizer_required=False, **options)[0]


def test_a_folder_loads_on_the_device_in_the_dtype_with_the_attention_asked_for(folders):
    model = load(folders / "target", device="cpu", dtype="bfloat16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu" and not model.training
    assert model.config._attn_implementation == "eager"
    assert load(folders / "target").dtype == torch.float32  # the CPU default


def test_default_device_and_dtype_follow_the_machine():
    assert loading.resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert loading.resolve_dtype(None, torch.device("cuda", 1)) == torch.bfloat16
    assert loading.resolve_dtype("auto", torch.device("cpu")) == "auto"
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert loading.resolve_device(None).type == expected
    with pytest.raises(ValueError, match="Unknown dtype 'fp8'"):
        loading.resolve_dtype("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="Unknown device"):
        loading.resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_an_absent_accelerator_is_refused_by_name(folders):
    with pytest.raises(ValueError, match="CUDA is not available here; use --device cpu"):
        load(folders / "target", device="cuda:1")


def test_bad_names_say_what_a_target_can_be(folders):
    with pytest.raises(FileNotFoundError, match="a local folder, or a Hub id"):
        load("./no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load("models/of/mine")  # a Hub id has at most one slash
    with pytest.raises(ValueError, match="no Hub revision"):
        load("smollm2-135m-instruct", revision="main")


def test_a_hub_id_goes_to_the_hub_with_its_revision_and_remote_code_only_when_asked(monkeypatch, folders):
    calls = []

    def from_pretrained(source, **kwargs):
        calls.append((source, kwargs))
        return make_target("llama")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load("Qwen/Qwen3-8B", revision="abc123", device="cpu")
    load("Qwen/Qwen3-8B", trust_remote_code=True, device="cpu")
    (first, plain), (_, remote) = calls
    assert first == "Qwen/Qwen3-8B" and plain["revision"] == "abc123" and "trust_remote_code" not in plain
    assert plain["dtype"] == torch.float32 and plain["device_map"] == torch.device("cpu")
    assert "attn_implementation" not in plain and remote["trust_remote_code"] is True


def test_an_unreachable_hub_id_names_the_three_ways_to_name_a_target(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="packaged name .*a model folder, or a Hub id"):
        load("nobody/no-such-model-here")


def test_a_target_without_a_tokenizer_is_refused_unless_allowed(folders):
    with pytest.raises(OSError, match="has no tokenizer"):
        loading.load_target_and_tokenizer(folders / "target", device="cpu")
    assert loading.load_target_and_tokenizer(folders / "target", tokenizer_required=False)[1] is None


def test_the_drafter_follows_the_targets_device_and_dtype_and_must_fit_it(folders):
    target = load(folders / "target", dtype="bfloat16")
    draft = loading.load_draft(folders / "draft", target)
    assert draft.dtype == torch.bfloat16 and draft.device == target.device and not draft.training
    with pytest.raises(ValueError, match="hidden size is 32 but the target's is 64"):
        loading.load_draft(folders / "other_draft", target)
    with pytest.raises(FileNotFoundError, match="Drafter folder './missing-draft' does not exist"):
        loading.load_draft("./missing-draft", target)


def test_a_truncated_weights_file_is_named_with_what_to_do(tmp_path):
    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    make_draft(target, block_size=4, num_hidden_layers=1).save_pretrained(tmp_path / "draft")
    for folder in ("target", "draft"):
        weights = tmp_path / folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # safetensors: "incomplete metadata"
    with pytest.raises(OSError, match="truncated or corrupt") as error:
        load(tmp_path / "target")
    assert f"Target weights file {tmp_path / 'target' / 'model.safetensors'} is" in str(error.value)
    assert "save it again with save_pretrained" in str(error.value)
    with pytest.raises(OSError, match="truncated or corrupt") as error:
        loading.load_draft(tmp_path / "draft", target)
    assert f"Drafter weights file {tmp_path / 'draft' / 'model.safetensors'} is" in str(error.value)


def test_every_flag_answers_to_both_spellings():
    parser = FlagParser()
    parser.add_argument("--max_new_tokens", type=int)
    parser.add_argument("--plain-threads", type=int)
    assert parser.parse_args(["--max-new-tokens", "3", "--plain_threads", "2"]).max_new_tokens == 3
    assert parser.parse_args(["--max_new_tokens", "4", "--plain-threads", "1"]).plain_threads == 1


def test_commands_share_the_target_flags_of_train():
    parser = FlagParser()
    add_target_flags(parser)
    argv = ["--target", "./mine", "--device", "cpu", "--dtype", "bfloat16", "--attn-implementation", "eager"]
    argv += ["--trust_remote_code", "--revision", "v1"]
    arguments = target_arguments(parser.parse_args(argv))
    assert arguments == loading.TargetArguments("./mine", "v1", True, "cpu", "bfloat16", "eager")
    script, args = parse_train_args(["--data", "d.jsonl", "--output_dir", "out", "--report_to", "none", *argv])
    assert loading.TargetArguments(**{name: getattr(script, name) for name in vars(arguments)}) == arguments
    assert args.use_cpu  # --device cpu is the Trainer's use_cpu
    script, _ = parse_train_args(["--data", "d.jsonl", "--output_dir", "out", "--target_dtype", "float16"])
    assert script.dtype == "float16"  # the flag's old name still works


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_train_refuses_a_device_it_cannot_train_on():
    with pytest.raises(ValueError, match="CUDA is not available"):
        parse_train_args(["--data", "d.jsonl", "--output_dir", "out", "--device", "cuda"])
