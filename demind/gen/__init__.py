"""Intent-data generation: image-caption shards -> intent shards with an MLLM.

Command: ``demind-generate`` (:mod:`demind.cli.generate`; ``data_gen/run.py`` runs the same).
Modules: :mod:`.config` (the job's settings), :mod:`.plan` (``--shard`` ranges, each shard's state),
:mod:`.reader` (input shards, images), :mod:`.prompts` (prompt texts and conversations; the texts
in ``prompts/``), :mod:`.engines` (vLLM and transformers), :mod:`.memory` (KV budget),
:mod:`.generate` (the two stages + retries), :mod:`.quality` (cleaning and checks),
:mod:`.fidelity_stage` (optional GFQ stage), :mod:`.job` (the per-shard loop; shards are written by
:mod:`demind.shard_format`), :mod:`.ray_job` (the Ray distributor), :mod:`.model_ref` (where the
MLLM is loaded from), :mod:`.ingest` (shards from a folder of images and captions), :mod:`.cc3m`
(CC3M url list), :mod:`.exclusion` (ExclCOCO query texts by an LLM), :mod:`.tiny_llava` (a tiny
random LLaVA for CPU runs).
"""

# The face other packages import (the rest of demind.gen is private to it; demind/cli wires the job).
from demind.gen.engines.base import Engine, GenRequest, GenResult, request_seed
from demind.gen.model_ref import local_model_folder
from demind.gen.prompts import render, user_turn

__all__ = ["Engine", "GenRequest", "GenResult", "local_model_folder", "render", "request_seed", "user_turn"]
