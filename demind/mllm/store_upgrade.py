"""Answer stores of the older layout, ``<benchmark>-<split>/<kind>/<prompt>/<model>/store.json``
(answers keyed by query id), and digest-memo lines of the older rule (no ``format``: a file keyed
by size and mtime only): the one home of both (:class:`demind.mllm.store.AnswerStore` and
:class:`demind.mllm.digest_memo.DigestMemo` call in here and nowhere else knows them).

Their keys say nothing of what an answer depends on, so no answer can be matched to a question of
the current store: they are not read, one warning names them, and their answers are asked again
(:func:`warn_earlier_stores`).
"""

from __future__ import annotations

import logging
from pathlib import Path

# each line in its reader's log (the store, the digest memo), as if the reader had said it
store_log = logging.getLogger("demind.mllm.store")
memo_log = logging.getLogger("demind.mllm.digest_memo")


def warn_earlier_stores(root: Path, kind: str) -> None:
    """Warn, once, when ``root`` holds ``kind`` stores of the older layout."""
    older = sorted(root.glob(f"*/{kind}/*/*/store.json"))  # <benchmark>-<split>/<kind>/<prompt>/<model>/
    if older:
        store_log.warning("%s holds %d %s store(s) of an older layout (answers keyed by query id, not by what they "
                          "depend on, e.g. %s): they are not read, so their answers are asked again; delete them when "
                          "done", root, len(older), kind, older[0].parent)


def warn_earlier_digests(memo: Path, count: int) -> None:
    """One line when the digest memo ``memo`` holds ``count`` lines of the rule before
    :func:`demind.io.file_version` (files keyed by size and mtime only, no format field): they are
    not used (a file replaced with its mtime put back would match them), so those files are read
    once more; the next save writes the memo without them."""
    if count:
        memo_log.info("%s: %d digests remembered by the older rule (size and modification time only) are not "
                      "used: their files are read once more", memo, count)
