"""The policy for on-disk formats of earlier versions (ARCHITECTURE.md): each format family reads
or refuses its older forms in one module, ``<reader>_upgrade.py`` beside its reader, and nowhere
else. Checked here on the source: an older format's marker (an earlier version of a
``demind-NAME/N`` format string, a ``LEGACY_*`` name or any name saying "legacy") outside an
upgrade module is a scattered old-format branch; and an upgrade module is imported only by its
own package (its family's reader).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("demind", "toyworld")
FORMAT = re.compile(r"demind-([a-z][a-z-]*)/(\d+)\b")
LEGACY_NAME = re.compile(r"legacy", re.IGNORECASE)


def is_upgrade_module(path: Path) -> bool:
    return path.name.endswith("_upgrade.py")


def source_files(root: Path) -> list[Path]:
    return sorted(p for top in SOURCES if (root / top).is_dir() for p in (root / top).rglob("*.py"))


def format_versions(files: list[Path]) -> dict[str, set[int]]:
    """Format name -> every version written as a ``"demind-NAME/N"`` string in ``files``."""
    versions: dict[str, set[int]] = defaultdict(set)
    for path in files:
        for name, version in FORMAT.findall(path.read_text(encoding="utf-8")):
            versions[name].add(int(version))
    return versions


def misplaced_markers(root: Path) -> list[str]:
    """``path: marker`` for every older-format marker outside an upgrade module: a format string
    of a version below its family's newest, or one an upgrade module defines; a name containing
    "legacy" (identifiers only: prose may say the word)."""
    files = source_files(root)
    versions = format_versions(files)
    older = {f"demind-{name}/{v}" for name, vs in versions.items() for v in vs if v < max(vs)}
    older |= {m.group(0) for path in files if is_upgrade_module(path)
              for m in FORMAT.finditer(path.read_text(encoding="utf-8"))}
    found = []
    for path in files:
        if is_upgrade_module(path):
            continue
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(root).as_posix()
        found += [f"{where}: {m.group(0)}" for m in FORMAT.finditer(text) if m.group(0) in older]
        names = {tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                 if tok.type == tokenize.NAME and LEGACY_NAME.search(tok.string)}
        found += [f"{where}: {name}" for name in sorted(names)]
    return found


def foreign_importers(root: Path) -> list[str]:
    """``importer -> upgrade module`` for every import of an upgrade module from outside its package."""
    files = source_files(root)
    modules = {".".join(p.relative_to(root).with_suffix("").parts): p for p in files}
    upgrades = {name for name, path in modules.items() if is_upgrade_module(path)}
    found = []
    for name, path in modules.items():
        package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found += [f"{name} -> {t}" for t in targets if t in upgrades and t.rsplit(".", 1)[0] != package]
    return found


def test_older_format_markers_live_only_in_their_upgrade_modules():
    assert misplaced_markers(ROOT) == []


def test_upgrade_modules_are_imported_only_by_their_own_package():
    assert foreign_importers(ROOT) == []


def test_each_upgrade_module_says_what_it_reads_and_is_read_by_a_reader():
    upgrades = [p for p in source_files(ROOT) if is_upgrade_module(p)]
    assert len(upgrades) >= 6  # search index, image-feature parts, training features, ExclMM runs, hub, toy world
    for path in upgrades:
        docstring = " ".join((ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split())
        assert "the one home" in docstring, path
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        stem = path.stem
        readers = [p for p in path.parent.glob("*.py") if p != path and re.search(
            rf"(from {re.escape(module)} import|from \.{stem} import|import {re.escape(module)}\b)",
            p.read_text(encoding="utf-8"))]
        assert readers, f"{path}: no module of its package reads through it"


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("files, expected", [
    # the older version beside its reader: a scattered branch
    ({"demind/a/reader.py": 'NEW = "demind-thing/2"\nOLD = "demind-thing/1"\n'},
     ["demind/a/reader.py: demind-thing/1"]),
    # in its upgrade module: the policy
    ({"demind/a/reader.py": 'NEW = "demind-thing/2"\n', "demind/a/reader_upgrade.py": 'OLD = "demind-thing/1"\n'}, []),
    # an upgrade module's format named again elsewhere
    ({"demind/a/reader.py": 'NEW = "demind-thing/2"\n', "demind/a/reader_upgrade.py": 'OLD = "demind-thing/1"\n',
      "toyworld/b.py": 'x = "demind-thing/1"\n'}, ["toyworld/b.py: demind-thing/1"]),
    # a name saying legacy outside an upgrade module; the word in prose is fine
    ({"demind/a/reader.py": '"""a legacy note"""\nLEGACY_FILES = ()\ndef read_legacy(): pass\n'},
     ["demind/a/reader.py: LEGACY_FILES", "demind/a/reader.py: read_legacy"]),
    # one version only: current, not a marker
    ({"demind/a/reader.py": 'FORMAT = "demind-thing/1"\n'}, []),
])
def test_the_marker_check_on_hand_made_trees(tmp_path, files, expected):
    for relative, text in files.items():
        write(tmp_path, relative, text)
    assert misplaced_markers(tmp_path) == expected


def test_the_import_check_on_hand_made_trees(tmp_path):
    write(tmp_path, "demind/a/__init__.py", "")
    write(tmp_path, "demind/a/reader.py", "from demind.a.reader_upgrade import up\nfrom .reader_upgrade import up\n")
    write(tmp_path, "demind/a/reader_upgrade.py", "def up(): pass\n")
    write(tmp_path, "demind/b.py", "from demind.a.reader_upgrade import up\nimport demind.a.reader_upgrade\n")
    write(tmp_path, "demind/a/sub/c.py", "from ..reader_upgrade import up\n")
    assert foreign_importers(tmp_path) == ["demind.a.sub.c -> demind.a.reader_upgrade",
                                           "demind.b -> demind.a.reader_upgrade",
                                           "demind.b -> demind.a.reader_upgrade"]


def test_exclmm_features_of_the_single_file_form_read_as_current(tmp_path):
    """Features written by an earlier version (``demind-exclmm-features/1``: one safetensors file
    with its JSON inside, no record beside it) read as the current reader returns them, and are reused."""
    import torch

    from demind.exclmm.features import FEATURES_NAME, _reusable, load_features, pack_ragged
    from demind.exclmm.run_upgrade import LEGACY_FORMAT
    from demind.trainkit import save_tree

    identity = {"name": "RN50", "pretrained": "openai", "activation": "quick_gelu"}
    images = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    tree = {"images": images, "image_ids": [7, 8, 9], "caption_words": pack_ragged([[1, 2], [], [3]]),
            "positive_queries": images[:1], "positive_words": pack_ragged([[4]]), "backbone": identity,
            "train": "data/exclcoco/train"}
    path = save_tree(tmp_path / FEATURES_NAME, tree, LEGACY_FORMAT)
    assert not path.with_suffix(".json").exists()
    feats = load_features(path)
    assert torch.equal(feats["images"], images) and feats["image_ids"] == [7, 8, 9]
    assert feats["caption_words"] == [[1, 2], [], [3]] and feats["positive_words"] == [[4]]
    why, reused = _reusable(path, identity, "data/exclcoco/train")
    assert why is None and reused["caption_words"] == [[1, 2], [], [3]]
    why, _ = _reusable(path, identity, "data/exclcoco/other")
    assert why == "was made for data.train=data/exclcoco/train"


def test_a_folder_published_before_the_file_list_counts_its_fixed_layout(tmp_path):
    """A folder demind-publish wrote before it recorded ``files``: the files of its fixed layout are
    its own (``--overwrite`` may replace them), a file added by hand is not."""
    import json

    from demind.release.folders import CARD_MARKER, published_files

    for name, text in {"config.json": json.dumps({"library_name": "demind"}), "README.md": f"card\n{CARD_MARKER}\n",
                       "demind.safetensors": "", "training_config.yaml": "", "backbone/tiny.json": "",
                       "results/cirr.json": "", "notes.txt": "mine"}.items():
        write(tmp_path, name, text)
    assert published_files(tmp_path) == {"config.json", "README.md", "demind.safetensors", "training_config.yaml",
                                         "backbone/tiny.json", "results/cirr.json"}
    write(tmp_path, "config.json", json.dumps({"library_name": "demind", "files": ["config.json", "README.md"]}))
    assert published_files(tmp_path) == {"config.json", "README.md"}  # the current form: its list alone
