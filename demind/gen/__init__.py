"""Intent-data generation: image-caption shards -> intent shards with an MLLM.

Command: ``demind-generate`` (:mod:`demind.cli.generate`; ``data_gen/run.py`` runs the same).
Modules: :mod:`.config` (the job's settings), :mod:`.plan` (``--shard`` ranges, each shard's state),
:mod:`.reader` (input shards, images), :mod:`.prompts` (prompt texts and conversations; the texts
in ``prompts/``), :mod:`demind.engines` (vLLM and transformers, KV budget, chat rendering),
:mod:`.generate` (the two stages + retries), :mod:`.quality` (cleaning and checks),
:mod:`.fidelity_stage` (optional GFQ stage), :mod:`.job` (the per-shard loop; shards are written by
:mod:`demind.shard_format`), :mod:`.ray_job` (the Ray distributor), :mod:`.ingest` (shards from
a folder of images and captions), :mod:`.cc3m` (CC3M url list), :mod:`.exclusion` (ExclCOCO query
texts by an LLM).
"""

# Nothing here is imported from outside: demind/cli wires the job; the engines, chat rendering and
# model references it runs on are demind.engines'.
__all__: list[str] = []
