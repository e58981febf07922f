"""Answer stores of the older layout, ``<benchmark>-<split>/<kind>/<prompt>/<model>/store.json``
(answers keyed by query id): the one home of that layout (:class:`demind.mllm.store.AnswerStore`
calls in here and nowhere else knows it).

Their keys say nothing of what an answer depends on, so no answer can be matched to a question of
the current store: they are not read, one warning names them, and their answers are asked again
(:func:`warn_earlier_stores`).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("demind.mllm.store")  # the reader's log: its line reads as it did before


def warn_earlier_stores(root: Path, kind: str) -> None:
    """Warn, once, when ``root`` holds ``kind`` stores of the older layout."""
    older = sorted(root.glob(f"*/{kind}/*/*/store.json"))  # <benchmark>-<split>/<kind>/<prompt>/<model>/
    if older:
        log.warning("%s holds %d %s store(s) of an older layout (answers keyed by query id, not by what they depend "
                    "on, e.g. %s): they are not read, so their answers are asked again; delete them when done",
                    root, len(older), kind, older[0].parent)
