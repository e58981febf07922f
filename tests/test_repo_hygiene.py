"""Repository hygiene: what a reader of a plain clone sees.

Every tracked text file is read (``git ls-files``; images, other binaries and the vendored
``tests/fixtures`` are skipped) and two kinds of line are refused, each reported as
``file:line``:

- an absolute path of one machine: a concrete location under the work, tmp or home roots
  (the regexes below). Write a placeholder instead (``DIR``, ``OUT``, ``runs/NAME``,
  ``data/CIRR``), or a path relative to the repository. A bare root in prose ("under /tmp")
  and example data folders a user would pick (``/data/cc3m``) are allowed: only a root
  followed by a concrete name is refused.
- a reference to an internal issue tracker (the word issue followed by a number, or ``#`` and a number): the numbers
  mean nothing to a reader of the repository. Say what the change is instead.

And the README stays short enough to read: at most 200 lines (details live in ``docs/``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

README_MAX_LINES = 200

# Binary or generated formats: never scanned (a null byte also marks a file as binary).
BINARY_SUFFIXES = {
    ".png", ".jpg", ".jpeg", ".gif", ".webp", ".ico", ".pdf", ".pt", ".pth", ".bin",
    ".safetensors", ".tar", ".gz", ".zip", ".npy", ".npz", ".whl",
}
# Vendored third-party data keep their own text.
SKIPPED_PREFIXES = ("tests/fixtures/",)

# A machine path: the work or tmp root followed by a name, or a user's home folder followed
# by a name. The lookbehind keeps relative paths ("runs/tmp/x", "a/home/b") and URLs out.
MACHINE_PATH = re.compile(
    r"(?<![\w.~$/-])/(?:work|tmp)/[\w.-]+"
    r"|(?<![\w.~$/-])/(?:home|Users)/[\w.-]+/"
)
# An internal issue number: the word issue(s) before a number (with or without "#"), or "#N" standing
# alone (not a hex colour such as #1f77b4 or #000000, not an anchor such as page#section).
ISSUE_WORD = re.compile(r"\bissues?\s*#?\d+\b", re.IGNORECASE)
ISSUE_HASH = re.compile(r"(?:^|(?<=[\s(\[,;:]))#\d{1,4}\b(?![\w-])")
# In markup and style sheets "#333" is a colour, so the bare "#N" rule is not applied there.
COLOUR_SUFFIXES = {".html", ".css", ".svg"}


def tracked_files() -> list[Path]:
    """Tracked files of the repository, or skip when it is not a git checkout (an sdist)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked-file list")
    names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
    return [
        ROOT / n
        for n in names
        if not n.startswith(SKIPPED_PREFIXES) and Path(n).suffix.lower() not in BINARY_SUFFIXES
    ]


def text_lines(path: Path) -> list[str]:
    """The file's lines, or [] for a binary file or one deleted in the work tree."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    if b"\0" in data:
        return []
    return data.decode("utf-8", "replace").splitlines()


def offences(path: Path) -> list[str]:
    """'file:line: what' for each machine path and internal issue reference in one file."""
    rel = path.relative_to(ROOT).as_posix()
    hash_rule = path.suffix.lower() not in COLOUR_SUFFIXES
    found = []
    for number, line in enumerate(text_lines(path), start=1):
        for match in MACHINE_PATH.finditer(line):
            found.append(f"{rel}:{number}: machine path {match.group(0)!r}")
        for match in ISSUE_WORD.finditer(line):
            found.append(f"{rel}:{number}: issue reference {match.group(0)!r}")
        if hash_rule:
            for match in ISSUE_HASH.finditer(line):
                found.append(f"{rel}:{number}: issue reference {match.group(0)!r}")
    return found


def test_patterns_catch_what_they_should_and_nothing_else():
    """The rules themselves, on made-up lines (built from parts so this file stays clean)."""
    work, tmp, home = "/" + "work/runs/qs3", "/" + "tmp/nd", "/" + "home/alice/x"
    for line in (f"--out {work}", f"see {tmp}", f"({home})", f"cp {tmp}/a b"):
        assert MACHINE_PATH.search(line), line
    for line in ("runs/tmp/x", "a/home/b/", "under /tmp", "https://x.org/work/y", "/data/cc3m"):
        assert not MACHINE_PATH.search(line), line
    for line in ("Issue " + "20's table", "issues " + "14 and 17", "(" + "#17)", "see #" + "3"):
        assert ISSUE_WORD.search(line) or ISSUE_HASH.search(line), line
    for line in ("colour #1f77b4", "#000000", "page.md#section-2", "issue tracker", "x#1"):
        assert not (ISSUE_WORD.search(line) or ISSUE_HASH.search(line)), line


def test_no_machine_paths_or_issue_numbers_in_tracked_files():
    """No tracked text file names a location on one machine or an internal issue number."""
    found = [hit for path in tracked_files() for hit in offences(path)]
    assert not found, (
        f"{len(found)} line(s) name a machine path or an internal issue number; use a "
        "placeholder (DIR, runs/NAME) or say what the change is:\n" + "\n".join(found)
    )


def test_readme_is_short():
    """The README is a front page; details belong in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move details to docs/"
    )
