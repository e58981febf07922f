"""Descriptions (and re-ranking scores) as data: a resumable store of MLLM answers.

One folder per (benchmark split, describer, prompt version, model identity, settings):

    <root>/<benchmark>-<split>/<kind>/<prompt version>@<sha12>/<model slug>-<settings hash>/
        store.json          what produced the records (written first; checked on every open)
        part-00000.json     {"format", "records": {id: record}}, one per finished chunk, atomic

A part is written (tmp file, then rename: :mod:`demind.io`) as soon as its chunk of queries is
answered, so a killed evaluation keeps every finished part and a rerun asks the model only for
ids no part holds; a rerun with nothing missing never loads the model. A record keeps the raw
MLLM output with the parsed description, so the store can be inspected and published as is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.io import write_json_atomic

log = logging.getLogger(__name__)

STORE_FORMAT = "demind-descriptions/1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def model_identity(model: str) -> dict[str, Any]:
    """What identifies an MLLM without loading it: a hub id as given; a local folder by its
    name (never its place: a store moved to another machine, or the model moved, still matches),
    the sha256 of its config.json and the names and sizes of its weight files (hashing 15 GB of
    weights on every run would cost minutes; a retrained model of the same architecture changes
    the sizes only rarely, so the folder's own name is part of the slug too)."""
    folder = Path(model)
    if not folder.is_dir():
        return {"model": model}
    config = folder / "config.json"
    weights = sorted((p.name, p.stat().st_size) for p in folder.iterdir()
                     if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return {"model": folder.resolve().name,
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
            "weights": weights}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:60] or "model"


class RecordStore:
    """Records by id in atomic parts under ``folder``; ``identity`` must match the stored one."""

    def __init__(self, folder: str | Path, identity: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.identity = identity
        self.records: dict[str, dict[str, Any]] = {}
        self._next_part = 0
        self._open()

    @classmethod
    def under(cls, root: str | Path, benchmark: str, split: str, kind: str, prompt_id: str,
              model: dict[str, Any], settings: dict[str, Any]) -> "RecordStore":
        """The store of one (benchmark split, kind, prompt, model, settings) under ``root``."""
        identity = {"format": STORE_FORMAT, "benchmark": benchmark, "split": split, "kind": kind,
                    "prompt": prompt_id, "model": model, "settings": settings}
        digest = hashlib.sha256(json.dumps([model, settings], sort_keys=True).encode()).hexdigest()[:10]
        name = f"{_slug(Path(str(model['model'])).name)}-{digest}"
        return cls(Path(root) / f"{benchmark}-{split}" / kind / _slug(prompt_id) / name, identity)

    def _open(self) -> None:
        meta = self.folder / "store.json"
        if meta.is_file():
            try:
                stored = json.loads(meta.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise InputError(f"{meta} is not JSON ({e}); delete the folder {self.folder} to rebuild it") from None
            if stored != json.loads(json.dumps(self.identity)):
                differ = sorted(k for k in set(stored) | set(self.identity) if stored.get(k) != self.identity.get(k))
                raise InputError(f"{meta} was written for other settings ({', '.join(differ)} differ); delete "
                                 f"{self.folder} or pass another describe.store")
        parts = sorted(self.folder.glob("part-*.json"))
        for part in parts:
            try:
                data = json.loads(part.read_text(encoding="utf-8"))
                records = data["records"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                # parts are written atomically; a damaged one (copied half, edited) is redone, not trusted
                log.warning("%s is damaged (%s): its records are asked again", part, e)
                continue
            self.records.update(records)
        if parts:
            self._next_part = max(int(p.stem.split("-")[1]) for p in parts) + 1

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def add(self, records: dict[str, dict[str, Any]]) -> None:
        """Keep ``records`` and write them as the next part (atomically)."""
        if not records:
            return
        meta = self.folder / "store.json"
        if not meta.is_file():
            write_json_atomic(meta, self.identity, indent=1)
        write_json_atomic(self.folder / f"part-{self._next_part:05d}.json",
                          {"format": STORE_FORMAT, "records": records}, indent=1)
        self._next_part += 1
        self.records.update(records)


class MemoryStore(RecordStore):
    """A store that writes nothing (evaluate() without an output or cache folder)."""

    def __init__(self, identity: dict[str, Any] | None = None) -> None:
        self.folder = Path("<memory>")
        self.identity = identity or {}
        self.records = {}
        self._next_part = 0

    def add(self, records: dict[str, dict[str, Any]]) -> None:
        self.records.update(records)
