"""Every code block of README.md and docs/*.md runs as written, or says in the doc why it cannot.

Each fenced block is preceded in the doc's source by a marker line (invisible when rendered):

* ``<!-- docs-test: run -->`` -- executed here (bash or Python) in a scratch folder, with the
  substitutions of :data:`SUBSTITUTIONS` applied (each row says why a stand-in is needed);
* ``<!-- docs-test: slow -->`` -- the same, under ``pytest -m slow``;
* ``<!-- docs-test: parse — REASON -->`` -- cannot run here (REASON: real weights, data, a GPU, the
  network, minutes of CPU); every command of ours in it is parsed by its own parser and its
  KEY=VALUE overrides loaded into its config (so an unknown flag, key or value fails), every other
  program must be one of :data:`EXTERNAL`, Python blocks compile and their imports resolve;
* ``<!-- docs-test: text — REASON -->`` -- not code (a folder layout, sample output).

A block without a marker, or a marker without a block, fails :func:`test_every_block_is_covered`.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import FIXTURES, REPO_ROOT, TINY_CLIP

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- docs-test: (run|slow|parse|text)(?: — (.+?))? -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SCRIPTS = PYPROJECT["project"]["scripts"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])


@dataclass(frozen=True)
class Substitution:
    text: str  # as the doc writes it
    stand_in: str  # what runs here ({names} filled from the sandbox)
    why: str


SUBSTITUTIONS = (
    Substitution("runs/paper/demind.safetensors", "{checkpoint}",
                 "real weights: a trained ViT-L/14 De-MINDS takes GPU-days; a random De-MINDS on the tiny "
                 "random CLIP (configs/model/tiny-clip.json) stands in"),
    Substitution("ref.jpg", "{image}", "data: the user's own photo; a generated 32x32 PNG stands in"),
    Substitution("photos/", "{photos}/", "data: the user's own photos; 6 generated PNGs stand in"),
    Substitution("captions.csv", "{captions}", "data: the user's caption file; one line per generated photo"),
    Substitution("data/CIRR", "{cirr}",
                 "data: CIRR's images are downloaded by hand under their licence; the vendored CIRR annotation "
                 "files (20 queries) with generated images stand in"),
)

# programs that are not ours: allowed in parse-only blocks, each with why it is not run here
EXTERNAL = {
    "git": "network: clones the repository",
    "bash": "runs a script of this repository (it must exist)",
    "pip": "network: installs packages (every extra named must exist in pyproject.toml)",
    "img2dataset": "network: downloads CC3M's images (installed by the block's own pip line)",
    "accelerate": "launches train.py on several GPUs (train.py's arguments are parsed)",
    "sbatch": "a SLURM cluster", "srun": "a SLURM cluster", "scontrol": "a SLURM cluster",
    "ray": "a Ray cluster", "sleep": "shell", "set": "shell", "for": "shell", "done": "shell", "cd": "shell",
}
# ``python FILE`` and ``python -m MODULE`` forms of our commands -> the module whose main() runs
FILES = {"train.py": "demind.cli.train", "pipelines/quickstart.py": "toyworld.cli.quickstart",
         "data_gen/run.py": "demind.cli.generate", "data_gen/make_shards.py": "demind.cli.make_shards",
         "data_gen/make_tiny_model.py": "demind.cli.make_tiny_model"}
MODULES = {"demind.eval": "demind.cli.evaluate", "demind.features": "demind.cli.features"}


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    code: str
    mode: str | None
    reason: str | None

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT)}:{self.line}"


def read_blocks(doc: Path) -> tuple[list[Block], list[int]]:
    """The fenced blocks of ``doc`` with their markers, and the lines of markers without a block."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks, orphans, i = [], [], 0
    while i < len(lines):
        marker = MARKER.match(lines[i].strip())
        if marker and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
            orphans.append(i + 1)
        fence = FENCE.match(lines[i])
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = MARKER.match(lines[i - 1].strip()) if i else None
            blocks.append(Block(doc, i + 1, fence.group(1), "\n".join(lines[i + 1:end]),
                                above.group(1) if above else None, above.group(2) if above else None))
            i = end
        i += 1
    return blocks, orphans


BLOCKS = [b for doc in DOCS for b in read_blocks(doc)[0]]


def test_every_block_is_covered():
    """Counted: each fence has a marker saying how it is tested, parse/text ones with their reason."""
    uncovered = [b.name for b in BLOCKS if b.mode is None]
    unexplained = [b.name for b in BLOCKS if b.mode in ("parse", "text") and not b.reason]
    orphans = [f"{doc.relative_to(REPO_ROOT)}:{n}" for doc in DOCS for n in read_blocks(doc)[1]]
    fences = sum(1 for doc in DOCS for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("```"))
    assert fences == 2 * len(BLOCKS), "an unclosed fence"
    assert len(BLOCKS) >= 30
    assert not uncovered, f"blocks without a <!-- docs-test: ... --> marker: {uncovered}"
    assert not unexplained, f"parse/text markers need '— REASON': {unexplained}"
    assert not orphans, f"markers not followed by a fence: {orphans}"
    assert {b.mode for b in BLOCKS} >= {"run", "parse"}


# --------------------------------------------------------------------------- parsing commands


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: continuation lines joined, comments and ``&&``/``;``
    separators dropped, synopsis brackets (``[--k 20]``, ``a|b``) read as their first choice, a shell
    variable in an argument (``--shard "$first-$last"``) read as 0."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        tokens = shlex.split(line, comments=True)
        current: list[str] = []
        for token in tokens:
            if token in ("&&", "||", ";", "&"):
                commands.append(current)
                current = []
                continue
            if token.startswith("["):  # a synopsis' optional part: [--k 20]
                token = token[1:]
            if token.endswith("]") and "[" not in token:
                token = token[:-1]
            if "|" in token and not token.startswith("-") and "=" not in token:  # a synopsis' choice: a|b
                token = token.split("|")[0]
            if current and re.search(r"\$\{?[A-Za-z_]", token):  # a shell variable the block sets ($first):
                token = re.sub(r"\$\{?[A-Za-z_][A-Za-z_0-9]*\}?", "0", token)  # any value the command takes
            if token:
                current.append(token)
        commands.append(current)
    # shell assignments (x=$(...)) and empty commands carry nothing to check
    return [c for c in commands if c and not re.match(r"^[A-Za-z_][A-Za-z_0-9]*=", c[0])]


def our_command(command: list[str]) -> tuple[str, list[str]] | None:
    """(module whose main() runs, its arguments) when ``command`` is one of ours, else None."""
    program = Path(command[0]).name
    if program in SCRIPTS:
        return SCRIPTS[program].split(":")[0], command[1:]
    if program.startswith("python"):
        if command[1] == "-m":
            return MODULES.get(command[2], command[2]), command[3:]
        return FILES.get(command[1], command[1]), command[2:]
    if program == "accelerate" and "train.py" in command:
        return "demind.cli.train", command[command.index("train.py") + 1:]
    return None


def check_our_command(module_name: str, args: list[str], where: str) -> None:
    """Parse ``args`` with the command's own parser and load its config from them; a module without
    a config parser (benchmarks, lab scripts) must list every flag used in its --help."""
    if module_name == "pytest":
        return
    module = importlib.import_module(module_name)
    if not hasattr(module, "build_parser"):
        help_text = subprocess.run([sys.executable, "-m", module_name, "--help"], capture_output=True, text=True,
                                   cwd=REPO_ROOT, timeout=300).stdout
        missing = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in help_text]
        assert not missing, f"{where}: {module_name} --help does not list {missing}"
        return
    from demind.cli.common import add_debug_option, load_command_config

    parser = module.build_parser()
    add_debug_option(parser)
    try:
        namespace = parser.parse_intermixed_args(args)
    except SystemExit:
        pytest.fail(f"{where}: {module_name} refuses {shlex.join(args)}")
    cls = getattr(namespace, "config_class", None)
    if cls is not None:
        load_command_config(cls, namespace)  # unknown keys and values that break a rule raise


def check_python(code: str, where: str) -> None:
    """The block compiles and every name it imports exists."""
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name), f"{where}: no module {alias.name}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode != "text"], ids=lambda b: b.name)
def test_every_command_parses(block, monkeypatch):
    """Every block, run or not: our commands accept its flags and keys, other programs are declared."""
    monkeypatch.chdir(REPO_ROOT)  # --config configs/... as the docs write it
    if block.lang == "python":
        check_python(block.code, block.name)
        return
    assert block.lang == "bash", f"{block.name}: a code block needs a language (bash or python) or a text marker"
    installed = set()
    for command in shell_commands(block.code):
        where = f"{block.name}: {shlex.join(command)[:80]}"
        ours = our_command(command)
        if ours is not None:
            check_our_command(*ours, where)
            continue
        program = Path(command[0]).name
        assert program in EXTERNAL, f"{where}: {program} is neither ours nor declared in EXTERNAL"
        if program == "bash":
            assert (REPO_ROOT / command[1]).is_file(), f"{where}: no script {command[1]}"
        if program == "pip":
            for target in command[2:]:
                if target.startswith(".["):
                    extras = re.fullmatch(r"\.\[([\w,-]+)\]", target)
                    assert extras and set(extras.group(1).split(",")) <= EXTRAS, f"{where}: unknown extra in {target}"
                installed.add(target)
        if program == "img2dataset":
            assert "img2dataset" in installed, f"{where}: install it first in the same block (pip install img2dataset)"


# --------------------------------------------------------------------------- running blocks


def tiny_cirr(root: Path, queries: int = 20) -> Path:
    """CIRR's official layout from the vendored annotation files: the first ``queries`` val queries,
    a generated 16x16 PNG for each image they name."""
    import json

    import numpy as np
    from PIL import Image

    captions = json.loads((FIXTURES / "cirr" / "captions" / "cap.rc2.val.json").read_text())[:queries]
    names = sorted({n for c in captions for n in [c["reference"], c["target_hard"], *c["img_set"]["members"]]})
    (root / "captions").mkdir(parents=True)
    (root / "image_splits").mkdir()
    (root / "dev").mkdir()
    (root / "captions" / "cap.rc2.val.json").write_text(json.dumps(captions))
    (root / "image_splits" / "split.rc2.val.json").write_text(json.dumps({n: f"./dev/{n}.png" for n in names}))
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "dev" / f"{name}.png")
    return root


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> dict[str, str]:
    """The scratch folder the blocks run in and the stand-ins of :data:`SUBSTITUTIONS`."""
    import numpy as np
    from PIL import Image

    import torch

    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig, ModelConfig
    from demind.checkpoint import save_checkpoint
    from demind.model import DeMinds

    root = tmp_path_factory.mktemp("docs")
    image = root / "ref.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    # the tiny random CLIP by its absolute path (rebuilt from backbone.seed), a random De-MINDS on it
    torch.manual_seed(0)
    model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16),
                    FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None)))
    checkpoint = save_checkpoint(root / "tiny.safetensors", model)
    photos = root / "photos"
    photos.mkdir()
    rng = np.random.default_rng(2)
    for n in range(6):
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(photos / f"photo{n}.png")
    captions = root / "captions.csv"
    captions.write_text("image,caption\n" + "".join(f"photo{n}.png,a photo number {n}\n" for n in range(6)))
    return {"root": str(root), "checkpoint": str(checkpoint), "image": str(image), "cirr": str(tiny_cirr(root / "cirr")),
            "photos": str(photos), "captions": str(captions)}


def substituted(code: str, sandbox: dict[str, str]) -> str:
    for row in SUBSTITUTIONS:
        code = code.replace(row.text, row.stand_in.format(**sandbox))
    return code


def run_block(block: Block, sandbox: dict[str, str]) -> None:
    code = substituted(block.code, sandbox)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT), "DEMIND_DEBUG": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=sandbox["root"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode == "run"], ids=lambda b: b.name)
def test_block_runs(block, sandbox):
    run_block(block, sandbox)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode == "slow"], ids=lambda b: b.name)
def test_slow_block_runs(block, sandbox):
    run_block(block, sandbox)


def test_the_checks_catch_what_they_should(monkeypatch):
    """The parse checks fail on an unknown flag, an unknown key, an undeclared program and a
    missing import (a check that cannot fail is no check)."""
    monkeypatch.chdir(REPO_ROOT)
    fails = [
        lambda: check_our_command("demind.cli.search", ["--index", "x", "--no-such-flag"], "t"),
        lambda: check_our_command("demind.cli.evaluate", ["--benchmark", "cirr", "--data-root", "d", "--out", "o",
                                                           "no.such_key=1"], "t"),
        lambda: check_our_command("toyworld.cli.quickstart", ["run.device=tpu"], "t"),
        lambda: check_python("from demind.eval.methods import build_methods", "t"),
    ]
    for fail in fails:
        with pytest.raises((AssertionError, pytest.fail.Exception, Exception)):
            fail()
    assert shell_commands("a --x 1 \\\n  --y 2 && b [--k 20] [--m a|b] '.[x,y]'  # c") == [
        ["a", "--x", "1", "--y", "2"], ["b", "--k", "20", "--m", "a", ".[x,y]"]]
    assert our_command(["accelerate", "launch", "--config_file", "c.yaml", "train.py", "--config", "p.yaml"]) == (
        "demind.cli.train", ["--config", "p.yaml"])
    assert all(row.why for row in SUBSTITUTIONS) and all(EXTERNAL.values())
