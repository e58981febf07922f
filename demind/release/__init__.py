"""Release on the Hugging Face Hub: published folders with their cards, and the upload.

* :mod:`demind.release.cards` — the model card (from a checkpoint and its runs' ``results.json``) and
  the dataset card (from intent shards and their ``_stats.json``).
* :mod:`demind.release.folders` — where ``demind-publish`` writes: what ``--overwrite`` may replace,
  and the swap of a complete new folder for the old one.
* :mod:`demind.release.publish` — ``demind-publish``'s work: the Hub-layout folder of a checkpoint,
  a shard folder's card, one ``upload_folder`` call.

Reading ``hf-hub:`` references lives below this package, in :mod:`demind.hubref`, since the
checkpoint loader and every shard reader use it; CC3M's url list in (the Hub's Conceptual
Captions table -> img2dataset's input) is data preparation, in :mod:`demind.gen.cc3m`.
"""
