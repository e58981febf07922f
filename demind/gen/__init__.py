"""Intent-data generation: image-caption shards -> intent shards with an MLLM.

Entry point: ``data_gen/run.py``. Library pieces: :mod:`.shards` (ranges, plan),
:mod:`.reader` (input shards, images), :mod:`.prompts`, :mod:`.engines`, :mod:`.generate`
(the two stages + retries), :mod:`.quality`, :mod:`.writer`, :mod:`.job` (per-shard loop).
"""

# The face other packages import (the rest of demind.gen is private to it; demind/cli wires the job).
from demind.gen.engines.base import Engine, GenRequest, GenResult, request_seed
from demind.gen.exclusion import llm_query_writer
from demind.gen.model_ref import local_model_folder
from demind.gen.prompts import render, user_turn

__all__ = ["Engine", "GenRequest", "GenResult", "llm_query_writer", "local_model_folder", "render", "request_seed",
           "user_turn"]
