"""The package's layout: dependencies run one way (`model` at the bottom, `cli` at the top), no import circle, and
the Layout section of docs/architecture.md names every folder that exists."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "hf_dflash"

# Each unit (a folder, or a top-level module) may import only units on lower floors.
FLOORS = {
    "atomic_files": 0,
    "lazy_names": 0,  # the packages' names imported on first use
    "offline": 0,  # the packaged targets and prompt sets, named without torch
    "arguments": 1,  # TargetArguments and the naming rules of a model, without torch
    "model": 1,
    "adapters": 2,
    "targets": 2,
    "loading": 3,
    "model_card": 3,
    "decoding": 4,
    "data": 4,
    "training": 5,
    "engines": 5,  # llama.cpp and friends, driven through their own programs
    "hf_dflash": 6,  # the package's public names (`hf_dflash/__init__.py`)
    "bench": 7,
    "cli": 8,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hf_dflash"


def imported_modules(path: Path) -> set[str]:
    """Every `hf_dflash` module `path` imports, at the top or inside a function."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("hf_dflash")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if not base.startswith("hf_dflash"):
                continue
            for alias in node.names:  # `from hf_dflash import loading` imports a module
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imported_modules(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_unit_has_a_floor():
    units = {unit_of(module) for module in import_graph()}
    assert units == set(FLOORS), "add the new folder or module to FLOORS (and to docs/architecture.md's Layout)"


def test_imports_run_down_the_floors_only():
    upward = [
        f"{module} -> {imported}"
        for module, imports in import_graph().items()
        for imported in imports
        if unit_of(imported) != unit_of(module) and FLOORS[unit_of(imported)] >= FLOORS[unit_of(module)]
    ]
    assert upward == []


def test_no_module_imports_itself_through_a_circle():
    graph = import_graph()
    visiting, done, circles = [], set(), []

    def visit(module: str) -> None:
        if module in done:
            return
        if module in visiting:
            circles.append(visiting[visiting.index(module) :] + [module])
            return
        visiting.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported != module and not module.startswith(imported + "."):  # a package's own __init__
                visit(imported)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)
    assert circles == []


def test_the_hub_files_import_only_each_other():
    for path in (PACKAGE / "model").glob("*_dflash.py"):
        assert imported_modules(path) <= {f"hf_dflash.model.{p.stem}" for p in (PACKAGE / "model").glob("*.py")}
        assert "from .." not in path.read_text() and "import hf_dflash" not in path.read_text()


def test_the_architecture_page_names_every_folder():
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page[page.index("## Layout") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    folders = {p.relative_to(ROOT).as_posix() + "/" for p in _folders()}
    named = set(re.findall(r"^\s*([\w./-]+/)\s", section, flags=re.M))
    assert folders - named == set(), "docs/architecture.md's ## Layout lacks these folders"
    assert named - folders == set(), "docs/architecture.md's ## Layout names folders that do not exist"


def _folders() -> list[Path]:
    """The folders a reader needs, as git tracks them: the top level's, the package's, and those of `benchmarks/` and
    `drafters/` (build outputs and other ignored folders are not the layout)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tracked = {Path(name).parent for name in listed.splitlines()}
    tracked |= {parent for folder in tracked for parent in folder.parents}
    wanted = {Path("."), Path("src/hf_dflash"), Path("benchmarks"), Path("drafters")}
    return [ROOT / folder for folder in tracked if folder.parent in wanted and folder != Path(".")] + [PACKAGE]


def test_every_public_name_resolves_and_training_loads_on_first_use():
    import sys

    script = (
        "import sys, hf_dflash\n"
        "assert 'hf_dflash.training.trainer' not in sys.modules, 'import hf_dflash pulled in the trainer'\n"
        "missing = [name for name in hf_dflash.__all__ if getattr(hf_dflash, name, None) is None]\n"
        "assert not missing, missing\n"
        "from hf_dflash import DFlashTrainer, DFlashTrainingArguments, VerifyPlanner, speculative_generate\n"
        "from hf_dflash.training.trainer import DFlashTrainer as Trainer\n"
        "assert DFlashTrainer is Trainer\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
