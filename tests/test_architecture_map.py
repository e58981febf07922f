"""ARCHITECTURE.md is a map a newcomer reads in minutes, and it names only what exists.

The scope, exactly: every ``.py`` file under ``demind/`` and ``toyworld/`` has one line of its own,
except the modules under a folder of :data:`FOLDER_LINES`, which share that folder's one line.  A
module's line starts with its path in one fixed form, ``- `demind/io.py` — ...`` (a folder's:
``- `toyworld/lab/` — ...``), so the map can be read by this test and by a script.

What is checked, from the text alone (nothing is imported):

* every module in scope has exactly one line, and no line names a module that does not exist;
* no line is longer than :data:`MAX_LINE_CHARS` characters and the file is under :data:`MAX_BYTES`;
* every path written in backticks under a folder of the repository, and every link, exists;
* every ``demind.x.y`` / ``toyworld.x`` name in backticks is a module, or a name a module defines;
* the layer picture matches the import graph of ``tests/test_layout.py``: no component imports one
  of a higher layer, and every package of ``demind/`` has its layer;
* on a module's line, a code name in backticks (``ShardWriter``, ``decode_image``, ``IMAGE_FIELDS``:
  an identifier with an underscore or a capital letter) is defined or imported by that module (a
  package face's lazy exports count), so a name that moved leaves no stale line behind.
"""

from __future__ import annotations

import ast
import posixpath
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

import test_layout as layout  # the import graph the layout rules read (a module, so its tests are not collected twice)

REPO_ROOT = Path(__file__).resolve().parents[1]
MAP = REPO_ROOT / "ARCHITECTURE.md"
DESIGN = REPO_ROOT / "docs" / "design.md"  # the design notes the map links to: checked for stale paths too
PACKAGES = ("demind", "toyworld")
FOLDER_LINES = ("toyworld/lab/",)  # research probes: python -m scripts that nothing imports
MAX_LINE_CHARS = 200
MAX_BYTES = 20_000

ENTRY = re.compile(r"^- `((?:demind|toyworld)/[^`]*)` — \S")
CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOTTED = re.compile(r"^(?:demind|toyworld)(?:\.[A-Za-z_]\w*)+$")
CODE_NAME = re.compile(r"^_*[A-Za-z]\w*$")
FILE_SUFFIXES = {"json", "jsonl", "md", "png", "py", "safetensors", "txt", "yaml"}  # `demind.safetensors` is a file


def in_scope(root: Path = REPO_ROOT) -> set[str]:
    """The entries the map must have: module paths, and the folders of FOLDER_LINES."""
    entries = set(FOLDER_LINES)
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(FOLDER_LINES):
                entries.add(rel)
    return entries


def map_entries(text: str) -> list[str]:
    """The path each module line starts with, in order (a path written twice appears twice)."""
    return [m.group(1) for line in text.splitlines() if (m := ENTRY.match(line))]


def entry_problems(text: str, scope: set[str]) -> list[str]:
    counts = Counter(map_entries(text))
    return ([f"no line for {path}" for path in sorted(scope - set(counts))]
            + [f"a line for {path}, which is not a module in scope" for path in sorted(set(counts) - scope)]
            + [f"{count} lines for {path}" for path, count in sorted(counts.items()) if count > 1])


def long_lines(text: str) -> list[str]:
    return [f"line {i} has {len(line)} characters" for i, line in enumerate(text.splitlines(), 1)
            if len(line) > MAX_LINE_CHARS]


def named_paths(text: str, root: Path = REPO_ROOT, doc_dir: str = "") -> set[str]:
    """Paths in backticks whose first part is a folder of the repository (``tests/x.py::test_y``: the
    file), and link targets (relative to the document's folder ``doc_dir``), relative to ``root``."""
    folders = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    paths = {posixpath.normpath(posixpath.join(doc_dir, link)) for link in LINK.findall(text) if "://" not in link}
    for token in CODE.findall(text):
        if "/" in token and " " not in token and token.split("/")[0] in folders:
            paths.add(token.split("::")[0])
    return paths


def missing_paths(text: str, root: Path = REPO_ROOT, doc_dir: str = "") -> list[str]:
    return sorted(p for p in named_paths(text, root, doc_dir) if not (root / p).exists())


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Names a module defines anywhere (functions, classes, assignments, fields) or imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def names_of(rel: str, root: Path = REPO_ROOT) -> frozenset[str]:
    """What a line's module defines or imports; a package face (``__init__.py``) also offers the
    names its lazy exports list as strings."""
    path = root / rel
    if path.name != "__init__.py":
        return defined_names(path)
    listed = {n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
              if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()}
    return defined_names(path) | listed


def module_file(dotted: str, root: Path = REPO_ROOT) -> Path | None:
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def unknown_dotted_names(text: str, root: Path = REPO_ROOT) -> list[str]:
    """``demind.x.y`` names that are neither a module nor a name a module defines."""
    unknown = []
    tokens = {t for t in CODE.findall(text) if DOTTED.match(t) and t.rpartition(".")[2] not in FILE_SUFFIXES}
    for token in sorted(tokens):
        module, _, name = token.rpartition(".")
        path = module_file(module, root)
        if module_file(token, root) is None and not (
                path is not None and name in names_of(path.relative_to(root).as_posix(), root)):
            unknown.append(token)
    return unknown


def is_code_name(token: str) -> bool:
    return bool(CODE_NAME.match(token)) and ("_" in token.strip("_") or token != token.lower())


def stale_code_names(text: str, root: Path = REPO_ROOT) -> list[str]:
    """Code names on a module's line that its module does not define."""
    stale = []
    for line in text.splitlines():
        m = ENTRY.match(line)
        if not m or not m.group(1).endswith(".py") or not (root / m.group(1)).is_file():
            continue
        defined = names_of(m.group(1), root)
        stale += [f"{m.group(1)}: `{token}`" for token in CODE.findall(line[m.end(1) + 1:])
                  if is_code_name(token) and token not in defined]
    return stale


LAYER = re.compile(r"^(\d+)\. ")


def layers(text: str) -> dict[str, int]:
    """Component (``demind.gen``, ``toyworld``) -> its layer, from the numbered list under ``## Layers``."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    found, number = {}, 0
    for line in section.splitlines():
        if m := LAYER.match(line):
            number = int(m.group(1))
        elif not line.startswith("   "):  # an item goes on in indented lines; anything else ends it
            number = 0
        for token in CODE.findall(line) if number else ():
            if token.startswith(PACKAGES) and (token.endswith("/") or token.endswith(".py")):
                found[token.removesuffix("/").removesuffix(".py").replace("/", ".")] = number
    return found


def layer_problems(text: str, graph: dict[str, set[str]]) -> list[str]:
    """Imports that run to a higher layer; packages of ``demind/`` without a layer.

    Top-level modules of ``demind/`` that the list does not name are the foundation (layer 1)."""
    listed = layers(text)
    components = layout.component_graph(graph)
    problems = [f"{c} has no layer" for c in sorted(components) if c.count(".") == 1 and c not in listed
                and layout.MODULES.get(c, (Path(),))[0].name == "__init__.py"]

    def layer(c: str) -> int:
        return listed.get(c, 1)

    for source, targets in sorted(components.items()):
        problems += [f"{source} (layer {layer(source)}) imports {target} (layer {layer(target)}): {sorted(edges)[0]}"
                     for target, edges in sorted(targets.items()) if layer(target) > layer(source)]
    return problems


TEXT = MAP.read_text(encoding="utf-8")


def test_every_module_has_exactly_one_line():
    assert entry_problems(TEXT, in_scope()) == []


def test_no_line_is_longer_than_the_limit():
    assert long_lines(TEXT) == []


def test_the_map_is_short():
    assert len(TEXT.encode("utf-8")) < MAX_BYTES


def test_every_path_named_exists():
    assert missing_paths(TEXT) == []


def test_every_module_name_named_exists():
    assert unknown_dotted_names(TEXT) == []


def test_code_names_on_a_module_line_are_defined_in_that_module():
    assert stale_code_names(TEXT) == []


def test_the_design_notes_name_only_what_exists():
    design = DESIGN.read_text(encoding="utf-8")
    assert missing_paths(design, doc_dir="docs") == [] and unknown_dotted_names(design) == []
    assert "(docs/design.md)" in TEXT


def test_the_layer_picture_matches_the_imports():
    assert layers(TEXT)["demind.cli"] > layers(TEXT)["demind.search"] > layers(TEXT)["demind.retrieval"]
    assert layer_problems(TEXT, layout.import_graph()) == []


def test_the_layer_check_on_a_hand_made_graph():
    text = "# Map\n## Layers\nBottom to top.\n1. `demind/io.py`\n2. `demind/eval/`\n3. `demind/search/`\n\n"
    graph = {"demind.io": set(), "demind.eval.harness": {"demind.io", "demind.search.index"},
             "demind.search.index": {"demind.eval"}, "demind.eval": set(), "demind.search": set()}
    assert layer_problems(text, graph) == [
        "demind.eval (layer 2) imports demind.search (layer 3): demind.eval.harness -> demind.search.index"]


def test_the_map_states_its_scope():
    # the reader is told what the test enforces
    assert all(f"`{folder}`" in TEXT for folder in FOLDER_LINES)
    assert "`tests/test_architecture_map.py`" in TEXT


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A repository of three modules and a folder of probes."""
    for rel, source in {"demind/__init__.py": "", "demind/io.py": "def write_json_atomic(): ...\n",
                        "demind/imaging.py": "def to_rgb(): ...\nMAX_SIDE = 1\n",
                        "toyworld/__init__.py": "", "toyworld/lab/probe.py": "", "docs/design.md": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    return tmp_path


GOOD = """# Architecture
See [design](docs/design.md).
- `demind/__init__.py` — the package.
- `demind/io.py` — atomic writes (`write_json_atomic`, `engine.model`, `demind.io.write_json_atomic`).
- `demind/imaging.py` — the one decoder (`to_rgb`, `MAX_SIDE`; `decode` is plain text).
- `toyworld/__init__.py` — the toy world.
- `toyworld/lab/` — research probes.
"""


def test_the_checks_pass_a_good_map(tree):
    assert in_scope(tree) == {"demind/__init__.py", "demind/io.py", "demind/imaging.py", "toyworld/__init__.py",
                              "toyworld/lab/"}
    assert entry_problems(GOOD, in_scope(tree)) == []
    assert missing_paths(GOOD, tree) == [] and unknown_dotted_names(GOOD, tree) == []
    assert stale_code_names(GOOD, tree) == [] and long_lines(GOOD) == []


def test_the_checks_catch_what_the_old_map_had(tree):
    # the faults of the essay this map replaced: a stale name on io.py's line, a module that no
    # longer exists, a module without a line, a module with two, a 1,642-character line
    bad = GOOD.replace("`write_json_atomic`", "`to_rgb`").replace("- `toyworld/__init__.py` — the toy world.\n", "")
    bad += ("- `demind/synthetic.py` — `write_synthetic_coco` (see `demind/synthetic.py`, `demind.synthetic`).\n"
            "- `demind/io.py` — again.\n" + "x" * 1642 + "\n")
    assert entry_problems(bad, in_scope(tree)) == [
        "no line for toyworld/__init__.py", "a line for demind/synthetic.py, which is not a module in scope",
        "2 lines for demind/io.py"]
    assert stale_code_names(bad, tree) == ["demind/io.py: `to_rgb`"]
    assert missing_paths(bad, tree) == ["demind/synthetic.py"]
    assert unknown_dotted_names(bad, tree) == ["demind.synthetic"]
    assert long_lines(bad) == ["line 9 has 1642 characters"]
    assert missing_paths("[gone](docs/gone.md) `docs/design.md` `runs/out/x.json`", tree) == ["docs/gone.md"]
    assert missing_paths("[map](../ARCHITECTURE.md) [here](design.md#a) `demind/io.py::f`", tree, "docs") == [
        "ARCHITECTURE.md"]
    assert unknown_dotted_names("`demind.safetensors` `demind.io.f`", tree) == ["demind.io.f"]
