"""Stored MLLM answers, keyed by what they depend on: the one rule of the description, re-ranking and
search stores.

**The key** (:meth:`AnswerStore.key`) of an answer is the sha256 of everything the answer depends on:

* the model's content: a digest of its files (weights, config, tokenizer, chat template; the
  folder of ``engine.model``, or its snapshot in the Hugging Face cache) -- :class:`ModelIdentity`;
* the reference image's pixels, decoded as the describer sees them before its resize
  (:func:`pixel_digest`; a verifier score adds the candidate's pixels);
* the modification text, the sample number, the prompt texts the kind uses (their content, not
  their version's name) and the generation settings (engine, dtype, temperature, top_p, seed,
  token limits, image size, answer words).

Names are labels only: a benchmark, split, query id, index or folder name is kept in the record for
reading, never in the key, so a renamed or copied index, a relabelled query or a moved model finds
its answers, and a changed caption, image, prompt, setting or model is asked again.

**Digests are remembered** as git remembers its index: a file's sha256 (and an image's pixel
digest) by its path and :func:`demind.io.file_version` (size, mtime, ctime, inode) in
``<store>/digests.jsonl`` (:class:`DigestMemo`), so a 15 GB model is read once, not on every run,
and a file replaced in place with its mtime put back is read again.

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

import hashlib
import json
import logging
import math
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from PIL import Image

from demind.errors import InputError, OutputLocationError
from demind.io import check_output_dir, file_version, reporting_output_errors, write_json_atomic, write_text_atomic
from demind.mllm.store_upgrade import warn_earlier_digests, warn_earlier_stores

log = logging.getLogger(__name__)

STORE_FORMAT = "demind-answers/2"
DIGEST_FORMAT = "demind-digests/2"  # a digests.jsonl line keyed by demind.io.file_version
KEY_INGREDIENTS = ("kind", "model", "prompt", "settings", "image", "text", "sample", "candidate")
KINDS = ("cirevl", "osrcir", "verify")
REQUIRED_FIELDS = {"verify": ("score",), "osrcir": ("description", "status", "raw"),
                   "cirevl": ("description", "status", "raw")}
_DOC_NAMES = re.compile(r"^(README|LICENSE|NOTICE|USE_POLICY)|\.md$", re.IGNORECASE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
LARGE_FILE = 1 << 28  # bytes: reading a file this large to hash it is said in the log


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def pixel_digest(picture: Image.Image) -> str:
    """sha256 of decoded pixels (mode and size included): the same image in another file, format or
    folder has the same digest; a changed pixel changes it."""
    digest = hashlib.sha256(f"{picture.mode}:{picture.size[0]}x{picture.size[1]}:".encode())
    digest.update(picture.tobytes())
    return digest.hexdigest()


def text_digest(*texts: str) -> str:
    """sha256 of prompt texts (a kind's prompt files, in order)."""
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()


def model_label(reference: str) -> str:
    """How the store names a model reference: an absolute (or ``~``) folder by its final name, so no
    path of this machine is written into a store that may be copied elsewhere; else as given."""
    return Path(reference).name if Path(reference).expanduser().is_absolute() else reference


# --------------------------------------------------------------------------- the digest memo


class DigestMemo:
    """File and pixel digests remembered by path and :func:`demind.io.file_version` (size, mtime,
    ctime, inode), in memory and, with a ``path``, appended to a JSON-lines file shared by every
    process using the store (a torn or foreign line is ignored: the digest is computed again).

    ``trusted`` False (``DEMIND_REHASH=1``, read by the commands) reads every file again: for a file
    system that keeps no change time or inode (FAT, some network mounts) after an edit that put the
    modification time back."""

    trusted = True

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._known: dict[str, str] = {}
        self._new: list[dict[str, Any]] = []
        self._earlier = 0  # lines of the older rule (size and mtime only): dropped at the next save
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    entry = json.loads(line)
                    if entry.get("format") != DIGEST_FORMAT:
                        self._earlier += 1
                        continue
                    self._known[entry["memo"]] = entry["sha256"]
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    continue
            warn_earlier_digests(path, self._earlier)

    @staticmethod
    def _memo_key(what: str, path: Path, extra: Any = None) -> str:
        return _sha([what, str(path.resolve()), file_version(path.stat()), extra])

    def _recall(self, memo: str) -> str | None:
        return self._known.get(memo) if self.trusted else None

    def _remember(self, memo: str, digest: str) -> str:
        self._known[memo] = digest
        self._new.append({"format": DIGEST_FORMAT, "memo": memo, "sha256": digest})
        return digest

    def file(self, path: Path) -> str:
        """sha256 of the file's bytes."""
        from demind.identity import file_sha256

        memo = self._memo_key("file", path)
        known = self._recall(memo)
        if known is not None:
            return known
        size = path.stat().st_size
        if size >= LARGE_FILE:
            log.info("reading %s (%.1f GB) once to key stored answers by the model's content; its digest is "
                     "remembered by size, times and inode in %s", path, size / 1e9, self.path or "memory")
        return self._remember(memo, file_sha256(path))

    def pixels(self, ref: Any) -> str:
        """:func:`pixel_digest` of an :class:`~demind.retrieval.ImageRef` as :func:`demind.retrieval.load_image`
        decodes it (orientation, mask and crop applied; the describers' resize is a setting)."""
        from demind.retrieval import load_image

        seg = _sha(ref.segmentation) if ref.segmentation is not None else None
        try:
            memo = self._memo_key("pixels", Path(ref.path), [ref.span, ref.box, seg, ref.orient])
        except OSError:  # a missing or unreadable file: load_image's one error naming it
            return pixel_digest(load_image(ref))
        return self._recall(memo) or self._remember(memo, pixel_digest(load_image(ref)))

    def save(self) -> None:
        """Append the digests computed since the last save (nothing without a path)."""
        if self.path is None or not self._new:
            return
        if self._earlier:  # written again without the older rule's lines (they would only be counted again)
            entries = [{"format": DIGEST_FORMAT, "memo": m, "sha256": d} for m, d in self._known.items()]
            write_text_atomic(self.path, "".join(json.dumps(e) + "\n" for e in entries))
            self._earlier, self._new = 0, []
            return
        lines = "".join(json.dumps(e) + "\n" for e in self._new)
        with reporting_output_errors(self.path), self.path.open("a", encoding="utf-8") as f:
            f.write(lines)
        self._new = []


# --------------------------------------------------------------------------- the model's identity


def model_files(folder: Path) -> list[Path]:
    """The files an MLLM's answers depend on: every file of its folder but documentation and dot-files."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not _DOC_NAMES.search(p.name)
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


class ModelIdentity:
    """The content identity of ``engine.model`` (see the module docstring): ``digest`` and ``source``
    -- ``"weights"`` (its files, hashed), ``"store"`` (recorded for this reference: the files are
    not on this machine), ``"name"`` (no files found even after loading: keyed by the reference) or
    ``"given"`` (stated by the caller for an engine without files: :class:`demind.mllm.MLLMSetup`)."""

    def __init__(self, reference: str, memo: DigestMemo, root: Path | None) -> None:
        self.reference = reference
        self.label = model_label(reference)
        self.memo = memo
        self.root = root
        self.digest: str | None = None
        self.source = ""

    def folder(self) -> Path | None:
        """Where the model's files lie here (its folder, or a Hub id's snapshot in the Hugging Face
        cache: :func:`demind.engines.local_model_folder`), with weights; else None."""
        from demind.engines import local_model_folder

        try:
            folder = local_model_folder(self.reference)
        except Exception:  # noqa: BLE001 -- huggingface_hub missing or a cache it cannot read: not here
            folder = None
        if folder is None or not any(p.suffix in _WEIGHT_SUFFIXES for p in folder.rglob("*")):
            return None
        return folder

    def current(self) -> str:
        """The identity that keys this run's answers (resolved once; :meth:`settle` after loading)."""
        if self.digest is None:
            if not self._from_weights():
                recorded = self._recorded()
                if recorded is not None:
                    self.digest, self.source = recorded["identity"], "store"
                    log.info("engine.model=%s: no model files on this machine; the answers stored for model "
                             "identity %s (recorded for %s on %s) are used", self.reference, self.digest[:16],
                             recorded.get("reference"), recorded.get("recorded"))
                else:
                    self.digest, self.source = f"name:{self.reference}", "name"
        return self.digest

    @property
    def from_weights(self) -> bool:
        self.current()
        return self.source == "weights"

    def settle(self) -> str:
        """After the model loaded (its files may have just been downloaded): key by its content if found."""
        if self.source not in ("weights", "memory", "given") and not self._from_weights():
            log.warning("engine.model=%s: its files cannot be found to key answers by their content (no folder, not "
                        "in the Hugging Face cache); its answers are keyed by this name", self.reference)
            self.digest, self.source = f"name:{self.reference}", "name"
        return self.digest or ""

    def _from_weights(self) -> bool:
        folder = self.folder()
        if folder is None:
            return False
        lines = [f"{p.relative_to(folder).as_posix()}\0{self.memo.file(p)}" for p in model_files(folder)]
        self.digest, self.source = text_digest(*lines), "weights"
        self.memo.save()
        self._record()
        return True

    def _record(self) -> None:
        """(Re)write this reference's record of the identity its files have now: ``recorded`` is the last
        time they were read, so the latest record of a reference is the content it last had."""
        if self.root is None:
            return
        path = self.root / "models" / f"{self.digest[:16]}-{text_digest(self.reference)[:8]}.json"
        now = time.time_ns()
        recorded = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now // 10**9)) + f".{now % 10**9:09d}Z"
        write_json_atomic(path, {"format": STORE_FORMAT, "reference": self.label,
                                 "reference_sha256": text_digest(self.reference), "identity": self.digest,
                                 "recorded": recorded}, indent=1)

    def _recorded(self) -> dict[str, Any] | None:
        """The latest identity recorded for this reference: the same string, else the same final name."""
        if self.root is None or not (self.root / "models").is_dir():
            return None
        records = []
        for path in sorted((self.root / "models").glob("*.json")):
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(record.get("identity"), str) and isinstance(record.get("reference"), str):
                    records.append(record)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                log.warning("%s is damaged: ignored", path)
        name = Path(self.reference).name
        exact = text_digest(self.reference)
        for match in (lambda r: r.get("reference_sha256") == exact or r["reference"] == self.reference,
                      lambda r: Path(r["reference"]).name == name):
            found = [r for r in records if match(r)]
            if found:
                return max(found, key=lambda r: str(r.get("recorded", "")))
        return None


# --------------------------------------------------------------------------- the store


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
        return _sha({"kind": self.kind, "model": self.model.current(), "prompt": self.prompt,
                     "settings": self.settings, "image": image, "text": text, "sample": sample,
                     "candidate": candidate})

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
            self.model.digest, self.model.source = "memory", "memory"
