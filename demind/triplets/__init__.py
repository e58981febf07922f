"""Supervised composed retrieval on labelled (reference, modification, target) triplets.

* :mod:`~demind.triplets.readers` -- CIRR's and FashionIQ's training splits, a user's JSONL/CSV file;
* :mod:`~demind.triplets.generated`, :mod:`~demind.triplets.megapairs` -- generated triplets (ours, MegaPairs's),
  read by :mod:`~demind.triplets.sources` with the others; their hard negatives in the loss:
  :mod:`~demind.triplets.hard_negatives`;
* :mod:`~demind.triplets.noise` -- nested easy / hard noise injection (ConeSep's protocol);
* :mod:`~demind.triplets.features` -- frozen image and text features, cached;
* :mod:`~demind.combiner` -- the CLIP4Cir-style combiner the trainer fits;
* :mod:`~demind.triplets.modes` -- noise modes: none, small-loss, gfq, conesep, conesep-nobtu;
* :mod:`~demind.triplets.train` -- the trainer (``demind-train-triplets``; docs/training.md);
* :mod:`~demind.triplets.accelerator` -- under ``accelerate launch``: several processes, DeepSpeed.
"""
