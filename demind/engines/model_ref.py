"""``engine.model``: where the MLLM of generation, the describers and re-ranking is loaded from.

A local folder that ``save_pretrained`` wrote (``config.json``, weights, processor files), or a
Hugging Face Hub id (``ORG/NAME``) that transformers and vLLM read through the Hugging Face cache
(``HF_HUB_OFFLINE=1``: from the cache only). :func:`check_engine_model` tells, from the file system
alone and before any model code is imported, the three ways this goes wrong that a user meets
first (a missing folder, a folder without a model, a Hub id absent from the cache while offline) as
one :class:`EngineModelError` naming ``engine.model`` and the fix; :func:`engine_load_error` says the
same of a load that failed anyway (a Hub id the network could not fetch, a folder transformers
cannot read). ``demind.engines.build_engine`` calls both, so every command that builds an
engine (demind-generate, demind-eval, demind-search, demind-serve, demind-build-exclcoco) says it
in the same words; :func:`local_model_folder` is where the files lie (the cache's snapshot for a
Hub id), for whoever keys answers by the model's content.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from demind.errors import InputError

logger = logging.getLogger(__name__)

KEY = "engine.model"
EXAMPLE_HUB_ID = "llava-hf/llava-v1.6-mistral-7b-hf"
FOLDER_HINT = ("a folder save_pretrained wrote (config.json, weights, processor files; "
               "`python data_gen/make_tiny_model.py --output DIR` writes a tiny random one)")


class EngineModelError(InputError):
    """``engine.model`` names nothing an engine can load; the message says what to give instead."""


def _looks_like_path(model: str) -> bool:
    """A value only a file system can mean: absolute, ``./``, ``../``, ``~``, a backslash, or more
    than one ``/`` (a Hub id is ``ORG/NAME``)."""
    return (model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") > 1)


def _is_hub_id(model: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def hub_cache_folder(model: str) -> Path | None:
    """The cached snapshot folder of Hub id ``model`` (its ``config.json`` there), or None when the
    Hugging Face cache does not hold it."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def local_model_folder(model: str) -> Path | None:
    """The folder holding ``model``'s files on this machine: the folder itself, or a Hub id's cached
    snapshot; None when neither exists (the engine would download it, or cannot load it)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not _looks_like_path(model) and _is_hub_id(model):
        return hub_cache_folder(model)
    return None


def check_engine_model(model: str | None, key: str = KEY) -> None:
    """Refuse, in one :class:`EngineModelError` line, an ``engine.model`` no engine can load; checks
    the file system and the Hugging Face cache only (no model code, no network)."""
    import huggingface_hub.constants as hub

    if not model or not str(model).strip():
        raise EngineModelError(f"{key} is not set: give {key}=DIR ({FOLDER_HINT}) or a Hub id such as "
                               f"{EXAMPLE_HUB_ID}")
    model = str(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            what = "is an empty folder" if not any(path.iterdir()) else "holds no config.json"
            raise EngineModelError(f"{key}={model} {what}: not a saved transformers model; give {FOLDER_HINT}, "
                                   f"or a Hub id such as {EXAMPLE_HUB_ID}")
        return
    if path.exists():
        raise EngineModelError(f"{key}={model} is a file; give the model's folder ({FOLDER_HINT}) or a Hub id "
                               f"such as {EXAMPLE_HUB_ID}")
    if _looks_like_path(model) or not _is_hub_id(model):
        raise EngineModelError(f"{key}={model}: no such folder; give {FOLDER_HINT}, or a Hub id such as "
                               f"{EXAMPLE_HUB_ID}")
    if hub.HF_HUB_OFFLINE and hub_cache_folder(model) is None:
        raise EngineModelError(
            f"{key}={model} is neither a folder here nor a Hub model in the Hugging Face cache ({hub.HF_HUB_CACHE}), "
            f"and HF_HUB_OFFLINE=1 allows no download: download it where there is a network (`hf download "
            f"{model}`, then copy the cache), unset HF_HUB_OFFLINE, or give a local model folder")


def engine_load_error(model: str, engine: str, error: BaseException, key: str = KEY) -> EngineModelError:
    """The one line for a model the ``engine`` failed to load from ``model`` (``error``: what the
    library raised; its first line is kept, the rest is for --debug)."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = "folder" if Path(model).expanduser().is_dir() else "name"
    return EngineModelError(f"{key}={model}: the {engine} engine cannot load a model from this {where} ({reason}); "
                            f"give {FOLDER_HINT}, or a Hub id such as {EXAMPLE_HUB_ID} that can be downloaded or is "
                            f"in the Hugging Face cache")


# LLaVA(-NeXT) processor values that llava-hf's processor_config.json gained in 2024 (patch_size and the
# feature strategy with transformers 4.45, num_additional_image_tokens later); a Hub cache or a folder saved
# before then lacks them. Without patch_size transformers cannot count image tokens (TypeError on the first
# image); without num_additional_image_tokens it counts one token fewer per image than the model's features
# (2,927 for a 672 px image of LLaVA-1.6: "Image features and image tokens do not match"), while vLLM, which
# counts from the model's config, gives 2,928.
_IMAGE_TOKEN_KEYS = ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens")


def load_processor(model: str) -> Any:
    """``AutoProcessor.from_pretrained(model)``, with the image-token settings an older LLaVA(-NeXT)
    ``processor_config.json`` leaves out taken from the model's config (the vision tower's patch size,
    its feature strategy, one extra token for a CLIP tower's CLS); every other processor as it loads."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    if not all(hasattr(processor, k) for k in _IMAGE_TOKEN_KEYS):
        return processor
    saved = _saved_processor_config(model)
    missing = [k for k in _IMAGE_TOKEN_KEYS if saved.get(k) is None]
    if not missing:
        return processor
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return processor
    values = {"patch_size": vision.patch_size,
              "vision_feature_select_strategy": getattr(config, "vision_feature_select_strategy", "default"),
              "num_additional_image_tokens": 1 if vision.model_type == "clip_vision_model" else 0}
    for key in missing:
        setattr(processor, key, values[key])
    logger.warning("%s: processor_config.json has no %s (an older llava-hf download): taken from the model's config "
                   "(%s)", model, ", ".join(missing), ", ".join(f"{k}={values[k]}" for k in missing))
    return processor


def _saved_processor_config(model: str) -> dict[str, Any]:
    """The processor_config.json of ``model`` (a folder or a cached Hub id) as saved; {} where there is none."""
    import json

    folder = local_model_folder(model)
    path = folder / "processor_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
