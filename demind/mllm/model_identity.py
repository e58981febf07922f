"""The content identity of ``engine.model`` (:class:`ModelIdentity`), the model part of every key of
:mod:`demind.mllm.store`: a digest of its files read through the digest memo, or, with the weights absent,
the identity ``<store>/models/`` recorded for the reference (the store's docstring, "Weights absent").
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from demind.io import write_json_atomic
from demind.mllm.digest_memo import DigestMemo, text_digest

log = logging.getLogger(__name__)

STORE_FORMAT = "demind-answers/2"  # the store's layout (store.json, parts, models/ records): demind.mllm.store
_DOC_NAMES = re.compile(r"^(README|LICENSE|NOTICE|USE_POLICY)|\.md$", re.IGNORECASE)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_label(reference: str) -> str:
    """How the store names a model reference: an absolute (or ``~``) folder by its final name, so no
    path of this machine is written into a store that may be copied elsewhere; else as given."""
    return Path(reference).name if Path(reference).expanduser().is_absolute() else reference


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

    def given(self, identity: str) -> None:
        """Key by ``identity``, stated by the caller for an engine without model files
        (:class:`demind.mllm.MLLMSetup`'s ``content_identity``): neither files nor the store are read."""
        self.digest, self.source = f"given:{identity}", "given"

    def in_memory(self) -> None:
        """Key by no content: answers that live for this process only (:class:`demind.mllm.MemoryStore`)."""
        self.digest, self.source = "memory", "memory"

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
