"""Intent-data generation: image-caption shards -> intent shards with an MLLM.

Entry point: ``data_gen/run.py``. Library pieces: :mod:`.shards` (ranges, plan),
:mod:`.reader` (input shards, images), :mod:`.prompts`, :mod:`.engines`, :mod:`.generate`
(the two stages + retries), :mod:`.quality`, :mod:`.writer`, :mod:`.job` (per-shard loop).
"""
