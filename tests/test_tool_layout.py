"""The tooling's layout (docs/ARCHITECTURE.md): subpackages by responsibility, each with a docstring;
no import cycle between its modules nor between its subpackages, each subpackage importing only
those it may; no module over MAX_LINES lines unless listed with its reason; the stable public
modules in their subpackages (no shims); and the runtime importing nothing of the tooling."""
import ast
import re
from pathlib import Path

import pytest
from helpers import import_cycles as cycles, package_modules as modules

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "custom" / "fedpartial_tools"
RUNTIME = REPO / "custom" / "fedpartial"

MAX_LINES = 450
# Modules over MAX_LINES: one responsibility each, with the reason they stay whole.
LONG_MODULES = {
    "fedpartial_tools.model.export": "one command: a result model exported for use outside fedpartial (formats, "
                                     "the decision thresholds it carries, its check)",
    "fedpartial_tools.deploy.provision": "one job: a provisioned project and the runtime its sites install",
    "fedpartial_tools.data.partition": "one job: splitting a source into site files (partition, label hiding, "
                                       "lesion keeping, the split command)",
    "fedpartial_tools.data.images": "one reader: image folders / tables into a dataset",
    "fedpartial_tools.deploy.cli": "the deploy command's parser and its sub-commands, each a few lines onto "
                                   "provision / admin / processes",
}
# Subpackages and what each may import of the tooling (docs/ARCHITECTURE.md); the top-level
# modules (cli, model_cli, evaluate) may import any subpackage, and no subpackage imports them.
MAY_IMPORT = {
    "data": set(),
    "model": {"data"},
    "jobs": {"data"},
    "run": {"data", "jobs"},
    "deploy": {"data", "jobs", "run"},
    "bench": {"data", "model", "jobs", "run"},
}
TOP_LEVEL = {"__init__", "__main__", "cli", "model_cli", "evaluate"}


def imports(name: str, path: Path, known) -> set:
    """The modules of ``known`` that ``path`` imports, at the top or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def graph(root: Path):
    mods = modules(root)
    return {m: imports(m, f, mods) for m, f in mods.items()}


def part(module: str) -> str:
    """The subpackage of a tooling module, or the top-level module's own name."""
    return module.split(".")[1] if module.count(".") else "__init__"


def package_graph(g) -> dict:
    out = {}
    for m, targets in g.items():
        out.setdefault(part(m), set()).update(part(t) for t in targets if part(t) != part(m))
    return out


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_between_tooling_modules():
    assert cycles(graph(TOOLS)) == []


def test_no_import_cycle_between_subpackages_and_each_imports_what_it_may():
    pg = package_graph(graph(TOOLS))
    subpackages = {p.name for p in TOOLS.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(MAY_IMPORT), "a subpackage is missing from MAY_IMPORT (and docs/ARCHITECTURE.md)"
    assert cycles(pg) == []
    for sub, allowed in MAY_IMPORT.items():
        assert pg.get(sub, set()) <= allowed, f"{sub} imports {sorted(pg[sub] - allowed)}, which it may not"


def test_recipes_build_on_settings_never_the_other_way_round():
    g = graph(TOOLS)
    assert "fedpartial_tools.jobs.settings" in g["fedpartial_tools.jobs.recipes"]
    assert not g["fedpartial_tools.jobs.settings"] & {"fedpartial_tools.jobs.recipes", "fedpartial_tools.jobs.profiles",
                                                      "fedpartial_tools.jobs.folders"}


def test_every_subpackage_says_what_it_owns():
    for init in TOOLS.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"{init.relative_to(REPO)}: a paragraph on what it owns"


def test_no_long_module_unless_listed():
    mods = modules(TOOLS)
    long = {m: len(f.read_text().splitlines()) for m, f in mods.items()}
    long = {m: n for m, n in long.items() if n > MAX_LINES}
    assert set(long) <= set(LONG_MODULES), f"over {MAX_LINES} lines: {long}; split it, or list it with a reason"
    stale = set(LONG_MODULES) - set(long)
    assert not stale, f"listed as long but no longer over {MAX_LINES} lines (or gone): {sorted(stale)}"


def test_top_level_holds_the_user_commands_only():
    """Every other module lives in the subpackage of its responsibility, under the one name its
    callers use (no re-export shims)."""
    assert {f.stem for f in TOOLS.glob("*.py")} == TOP_LEVEL
    assert (TOOLS / "deploy" / "__main__.py").is_file()  # python -m fedpartial_tools.deploy


@pytest.mark.parametrize("path", sorted(RUNTIME.rglob("*.py")), ids=lambda p: str(p.relative_to(RUNTIME)))
def test_the_runtime_imports_nothing_of_the_tooling(path):
    if path == RUNTIME / "__main__.py":  # python -m fedpartial: the command-line shim, never shipped
        return
    known = {"fedpartial_tools"} | set(modules(TOOLS))
    assert not imports("fedpartial." + path.stem, path, known)


def test_the_architecture_picture_matches_the_folders():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = doc[doc.index("custom/fedpartial_tools/        TOOLING"):]
    block = block[:block.index("```")]
    drawn = {}
    for line in block.splitlines():
        m = re.match(r"^  (\w+)/ .*imports: (.*)$", line)
        if m:
            drawn[m.group(1)] = {w.strip(" ,") for w in m.group(2).split()} - {"runtime", "only", ""}
    assert drawn == MAY_IMPORT, "docs/ARCHITECTURE.md: one line per subpackage with what it may import"
    for f in TOOLS.rglob("*.py"):
        if f.name != "__init__.py":
            assert re.search(rf"(^|\s){re.escape(f.name)}", block, re.M), f"{f.relative_to(TOOLS)} is not drawn"
