"""Release on the Hugging Face Hub: published folders with their cards, the upload, and CC3M in.

* :mod:`demind.hub.cards` — the model card (from a checkpoint and its runs' ``results.json``) and
  the dataset card (from intent shards and their ``_stats.json``).
* :mod:`demind.hub.publish` — ``demind-publish``'s work: the Hub-layout folder of a checkpoint,
  a shard folder's card, one ``upload_folder`` call.
* :mod:`demind.hub.cc3m` — the Hub's Conceptual Captions table -> img2dataset's input file.

Reading ``hf-hub:`` references lives below this package, in :mod:`demind.hubref`, since the
checkpoint loader and every shard reader use it.
"""
