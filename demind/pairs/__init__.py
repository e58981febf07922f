"""Pair mining, MegaPairs-style: pairs of related images found in a captioned corpus by one or more
neighbour signals, the first step of generated triplets (docs/triplets.md).

* :mod:`~demind.pairs.config` -- the recipe (signals, windows, K, H, ranker), torch-free;
* :mod:`~demind.pairs.corpus` -- the corpus found again by key: :func:`open_corpus`;
* :mod:`~demind.pairs.manifest` -- ``pairs_manifest.json``: corpus, backbones, recipe;
* :mod:`~demind.pairs.signals` -- the signals' features, through the feature caches;
* :mod:`~demind.pairs.select` -- windows, targets, hard negatives of one query shard;
* :mod:`~demind.pairs.job` -- the shard job: plan, done-markers, the pair-shard writer.
"""

from typing import TYPE_CHECKING

from demind.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools and go-to-definition (tests/test_lazy_faces.py keeps them equal)
    from demind.pairs.config import SIGNALS, MinePairsConfig
    from demind.pairs.corpus import Corpus, check_same_corpus, corpus_record, open_corpus, shards_record
    from demind.pairs.manifest import PAIRS_MANIFEST, CorpusMismatchError, read_pairs_manifest

__getattr__, __dir__ = lazy_exports(__name__, {
    "demind.pairs.config": ["SIGNALS", "MinePairsConfig"],
    "demind.pairs.corpus": ["Corpus", "check_same_corpus", "corpus_record", "open_corpus", "shards_record"],
    "demind.pairs.manifest": ["PAIRS_MANIFEST", "CorpusMismatchError", "read_pairs_manifest"],
})

__all__ = ["PAIRS_MANIFEST", "SIGNALS", "Corpus", "CorpusMismatchError", "MinePairsConfig", "check_same_corpus",
           "corpus_record", "open_corpus", "read_pairs_manifest", "shards_record"]
