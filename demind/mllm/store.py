"""Stored MLLM answers, keyed by what they depend on: the one rule of the description, re-ranking and
search stores.

**The key** (:meth:`AnswerStore.key`) of an answer is the sha256 of everything the answer depends on:

* the model's content: a digest of its files (weights, config, tokenizer, chat template; the
  folder of ``engine.model``, or its snapshot in the Hugging Face cache) --
  :class:`~demind.mllm.model_identity.ModelIdentity`;
* the reference image's pixels, decoded as the describer sees them before its resize
  (:func:`~demind.mllm.digest_memo.pixel_digest`; a verifier score adds the candidate's pixels);
* the modification text, the sample number, the prompt texts the kind uses (their content, not
  their version's name) and the generation settings (engine, dtype, temperature, top_p, seed,
  token limits, image size, answer words).

Names are labels only: a benchmark, split, query id, index or folder name is kept in the record for
reading, never in the key, so a renamed or copied index, a relabelled query or a moved model finds
its answers, and a changed caption, image, prompt, setting or model is asked again.

**Digests are remembered** as git remembers its index: a file's sha256 (and an image's pixel
digest) by its path and :func:`demind.io.file_version` (size, mtime, ctime, inode) in
``<store>/digests.jsonl`` (:class:`~demind.mllm.digest_memo.DigestMemo`), so a 15 GB model is read
once, not on every run, and a file replaced in place with its mtime put back is read again.

**Weights absent** (a store copied to a machine without the model): ``<store>/models/`` records
which content identity answered for each model reference (hub id, or a folder by its final name and
the sha256 of its path: no path of this machine is written into the store). When the files
cannot be found, the identity recorded for the reference (the same string, else the same final
name) keys the lookups, with one log line naming it; a rerun whose answers are all stored then
loads no model and needs none. If an answer is missing the model is loaded, and the identity is
read from its files again before anything is generated.

**Layout** (docs/mllm.md shows it; tests/test_answer_store.py checks the docs against it)::

    <store>/store.json                  {"format", "key"}: what the keys hold
    <store>/models/<id16>-<ref8>.json   {"reference", "reference_sha256", "identity", "recorded"}
    <store>/digests.jsonl               the digest memo (one JSON object a line, appended)
    <store>/<kind>/part-<writer>-<n>.json   {"format", "records": {key: record}}; kind: cirevl, osrcir, verify

A part is written atomically after each chunk; ``<writer>`` is unique to the process that wrote it,
so two processes sharing a store (``demind-serve`` and ``demind-search`` on one index) never
overwrite each other's parts. A damaged part (not JSON, not an object) or record (not an object,
missing its fields) is not trusted: its answers are asked again, with one counted log line. A store
of the older layout is not read, and said so (:mod:`demind.mllm.store_upgrade`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from pathlib import Path
from typing import Any, Callable

from demind.errors import InputError, OutputLocationError
from demind.io import check_output_dir, write_json_atomic
from demind.mllm.digest_memo import DigestMemo, sha_of
from demind.mllm.model_identity import STORE_FORMAT, ModelIdentity
from demind.mllm.store_upgrade import warn_earlier_stores

log = logging.getLogger(__name__)

KEY_INGREDIENTS = ("kind", "model", "prompt", "settings", "image", "text", "sample", "candidate")
KINDS = ("cirevl", "osrcir", "verify")
REQUIRED_FIELDS = {"verify": ("score",), "osrcir": ("description", "status", "raw"),
                   "cirevl": ("description", "status", "raw")}


def check_store_root(root: Path) -> Path:
    """Refuse an unwritable store before any model loads: one error naming ``describe.store``."""
    try:
        return check_output_dir(root)
    except OutputLocationError as e:
        raise OutputLocationError(f"describe.store: {e}; MLLM answers are written there as they are generated: give "
                                  f"describe.store=DIR, a folder this process can write") from None


def _read_store_meta(root: Path) -> None:
    meta = root / "store.json"
    if not meta.is_file():
        return
    fix = f"delete {meta} (it is written again; the answers in the parts are kept)"
    try:
        stored = json.loads(meta.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{meta} is not JSON ({e}); {fix}") from None
    if not isinstance(stored, dict) or stored.get("format") != STORE_FORMAT:
        what = stored.get("format") if isinstance(stored, dict) else f"a JSON {type(stored).__name__}"
        raise InputError(f"{meta} is not a {STORE_FORMAT} store ({what}); {fix}")


class AnswerStore:
    """The answers of one ``kind`` (``osrcir``, ``cirevl``, ``verify``) by key, under ``<root>/<kind>/``
    (``root`` None: in memory only). ``model``, ``prompt`` and ``settings`` are the key's shared part."""

    def __init__(self, root: str | Path | None, kind: str, model: ModelIdentity | None = None, prompt: str = "",
                 settings: dict[str, Any] | None = None, memo: DigestMemo | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self.kind = kind
        self.folder = self.root / kind if self.root is not None else Path("<memory>")
        self.memo = memo or DigestMemo(self.root / "digests.jsonl" if self.root is not None else None)
        self.model = model or ModelIdentity("unknown", self.memo, None)
        self.prompt = prompt
        self.settings = settings or {}
        self.records: dict[str, dict[str, Any]] = {}
        self.damaged = 0  # parts and records found damaged (their answers are asked again)
        self._writer = f"{os.getpid()}{secrets.token_hex(4)}"
        self._next_part = 0
        if self.root is not None:
            self._open()

    def key(self, *, image: str, text: str = "", sample: int = 0, candidate: str | None = None) -> str:
        """The key of one answer: sha256 of the ingredients (module docstring)."""
        return sha_of({"kind": self.kind, "model": self.model.current(), "prompt": self.prompt,
                     "settings": self.settings, "image": image, "text": text, "sample": sample,
                     "candidate": candidate})

    def image_digest(self, ref: Any) -> str:
        """The image part of a key: the pixel digest of an :class:`~demind.retrieval.ImageRef`, remembered."""
        return self.memo.pixels(ref)

    def save_digests(self) -> None:
        """Write the digests computed since the last save to the store's memo."""
        self.memo.save()

    def rekey_from_model(self, load: Callable[[], object]) -> bool:
        """Before generating: unless the model's files keyed the answers, ``load()`` the model (its files may
        arrive with it) and key by their content from now on. True: the keys may have changed."""
        if self.model.from_weights:
            return False
        load()
        self.model.settle()
        return True

    def ingredients(self) -> dict[str, Any]:
        """The key's shared part, as each record keeps it (readable; the key itself is its hash)."""
        return {"model_identity": self.model.current(), "model": self.model.label, "prompt_sha256": self.prompt,
                "settings": self.settings}

    def _open(self) -> None:
        _read_store_meta(self.root)
        for part in sorted(self.folder.glob("part-*.json")):
            self._read_part(part)
        warn_earlier_stores(self.root, self.kind)

    def _read_part(self, part: Path) -> None:
        try:
            data = json.loads(part.read_text(encoding="utf-8"))
            records = data["records"]
            if not isinstance(records, dict):
                raise TypeError(f"records is a JSON {type(records).__name__}")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            self.damaged += 1
            log.warning("%s is damaged (%s: %s): its answers are asked again", part, type(e).__name__, e)
            return
        bad = 0
        for key, record in records.items():
            if self._valid(record):
                self.records[key] = record
            else:
                bad += 1
        if bad:
            self.damaged += bad
            log.warning("%s: %d of %d records are damaged (not an object, or missing %s): they are asked again",
                        part, bad, len(records), "/".join(REQUIRED_FIELDS.get(self.kind, ())))

    def _valid(self, record: Any) -> bool:
        if not isinstance(record, dict) or any(f not in record for f in REQUIRED_FIELDS.get(self.kind, ())):
            return False
        if self.kind == "verify":
            return isinstance(record["score"], (int, float)) and math.isfinite(record["score"])
        return (record["description"] is None or isinstance(record["description"], str)) and \
            isinstance(record["status"], str) and isinstance(record["raw"], str)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def add(self, records: dict[str, dict[str, Any]]) -> None:
        """Keep ``records`` (by key) and write them as this writer's next part (atomically)."""
        if not records:
            return
        if self.root is not None:
            if not (self.root / "store.json").is_file():
                write_json_atomic(self.root / "store.json", {"format": STORE_FORMAT, "key": list(KEY_INGREDIENTS)},
                                  indent=1)
            write_json_atomic(self.folder / f"part-{self._writer}-{self._next_part:05d}.json",
                              {"format": STORE_FORMAT, "records": records}, indent=1)
            self._next_part += 1
            self.memo.save()
        self.records.update(records)


class MemoryStore(AnswerStore):
    """A store that writes nothing (evaluate() without an output or cache folder, benchmarks)."""

    def __init__(self, kind: str = "answers", **rule: Any) -> None:
        super().__init__(None, kind, **rule)
        if "model" not in rule:  # no model named: answers live for this process only, keyed by no content
            self.model.in_memory()
