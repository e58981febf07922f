"""Synthetic data sets for smoke runs, benchmarks and tests (no download, seconds to build).

* :func:`write_intent_shard`, :func:`write_synthetic_shards` — small intent shards (through
  the one shard writer, :class:`demind.shard_format.ShardWriter`): noisy coloured squares whose
  three texts name the colour, at short or CC3M-like text lengths.
* :func:`write_synthetic_coco` — a COCO-format split (instances + captions, COCO's 80 names) for
  the ExclCOCO builder's tests and its val2017-sized run-time benchmark.
* :class:`ScriptedEngine` — a stand-in MLLM behind the generation engines' interface
  (:class:`demind.engines.base.Engine`): no model runs, a function gives each request's answer.

Test and benchmark support: tests and benchmarks import ``toyworld.synthetic``; nothing under
``demind/`` imports it.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

from demind.shard_format import ShardWriter, sample_key, shard_filename

# --------------------------------------------------------------------------- intent shards


def write_intent_shard(path: str | Path, samples: list[dict[str, Any]]) -> Path:
    """Write one shard: each sample a dict with ``key`` and fields such as ``jpg`` (bytes or a
    PIL image, saved as JPEG), ``txt``, ``rew.txt``, ``int.txt`` (str) and ``json`` (dict); a
    field left out is left out of the tar, so tests can build malformed shards.  Returns ``path``."""
    with ShardWriter(path) as writer:
        for sample in samples:
            writer.write({"__key__": sample["key"],
                          **{name: _field_bytes(value) for name, value in sample.items() if name != "key"}})
    return Path(path)


def _field_bytes(value: Any) -> bytes:
    from PIL import Image

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="JPEG", quality=95)
        return buffer.getvalue()
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, dict):
        return json.dumps(value).encode("utf-8")
    return value


SYNTHETIC_COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30),
                     "purple": (140, 30, 170), "orange": (240, 140, 20), "white": (240, 240, 240), "black": (15, 15, 15)}


# Mean words of (T_ori, T_rew, T_int) in CC3M-like intent data: alt-texts ~12 words, the
# paper's T_rew ~65 and T_int ~27 tokens (these filler words are one CLIP token each).
CC3M_TEXT_WORDS = (12, 65, 27)
_FILLER = ("the a of with on in near large small bright old young wooden green open quiet busy "
           "street table window water light people building photo scene view background").split()


def synthetic_texts(colour: str, rng: Any, text_lengths: str) -> tuple[str, str, str]:
    """(T_ori, T_rew, T_int) naming ``colour``: ``short`` (3-4 words) or ``cc3m`` (lengths
    drawn around :data:`CC3M_TEXT_WORDS`, +-25 %), for training at realistic text lengths."""
    short = (f"a {colour} square", f"a square painted {colour}", f"make the square {colour}")
    if text_lengths == "short":
        return short
    if text_lengths != "cc3m":
        raise ValueError(f"text_lengths must be 'short' or 'cc3m', got {text_lengths!r}")
    texts = []
    for base, mean in zip(short, CC3M_TEXT_WORDS):
        extra = max(0, int(round(rng.normal(mean, 0.25 * mean))) - len(base.split()))
        texts.append(" ".join([base, *rng.choice(_FILLER, extra)]))
    return tuple(texts)


def write_synthetic_shards(directory: str | Path, num_shards: int = 2, samples_per_shard: int = 32,
                           image_size: int = 32, seed: int = 0, omit: tuple[str, ...] = (),
                           text_lengths: str = "short") -> list[Path]:
    """Intent shards of noisy coloured squares whose three texts name the colour.

    A small learnable task for smoke runs, tests and benchmarks (image colour <-> text).
    ``omit`` leaves fields out (e.g. ``("int.txt",)``) to exercise the missing-field path.
    ``text_lengths``: ``short`` (3-4 words) or ``cc3m`` (CC3M-like lengths, see
    :func:`synthetic_texts`), since text length sets the text tower's cost.
    Returns the shard paths ``directory/00000.tar`` ...
    """
    import numpy as np
    from PIL import Image

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = list(SYNTHETIC_COLOURS)
    paths = []
    for shard in range(num_shards):
        samples = []
        for i in range(samples_per_shard):
            colour = names[int(rng.integers(len(names)))]
            pixels = np.asarray(SYNTHETIC_COLOURS[colour], dtype=np.float32)[None, None]
            pixels = pixels + rng.normal(0, 25, (image_size, image_size, 3))
            original, rewritten, intent = synthetic_texts(colour, rng, text_lengths)
            sample = {"key": sample_key(shard, i, 5), "jpg": Image.fromarray(pixels.clip(0, 255).astype("uint8")),
                      "txt": original, "rew.txt": rewritten, "int.txt": intent, "json": {"colour": colour}}
            samples.append({k: v for k, v in sample.items() if k not in omit})
        paths.append(write_intent_shard(directory / shard_filename(shard), samples))
    return paths


# ------------------------------------------------------- COCO-format data (ExclCOCO)

COCO_CATEGORIES = (
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant stop_sign "
    "parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe backpack umbrella handbag tie "
    "suitcase frisbee skis snowboard sports_ball kite baseball_bat baseball_glove skateboard surfboard "
    "tennis_racket bottle wine_glass cup fork knife spoon bowl banana apple sandwich orange broccoli carrot "
    "hot_dog pizza donut cake chair couch potted_plant bed dining_table toilet tv laptop mouse remote keyboard "
    "cell_phone microwave oven toaster sink refrigerator book clock vase scissors teddy_bear hair_drier toothbrush"
).replace("_", "\0").split()
COCO_CATEGORIES = tuple(c.replace("\0", " ") for c in COCO_CATEGORIES)  # the 80 names of instances_2017
SCENE_WORDS = ("street", "table", "field", "kitchen", "room", "water", "beach", "road", "grass", "building",
               "window", "wall", "snow", "sky", "tree", "plate", "city", "park", "food", "desk")


def write_synthetic_coco(folder: str | Path, num_images: int, split: str = "val2017", seed: int = 0,
                         instances_per_image: float = 7.3, captions_per_image: int = 5,
                         write_images: bool = False) -> tuple[Path, Path, Path]:
    """A COCO-format ``instances_{split}.json`` + ``captions_{split}.json`` with COCO's 80 category
    names (frequency skewed like COCO: "person" in about half of the images), captions naming 1-3 of
    an image's categories (through a synonym at times) and a scene word, and, with
    ``write_images``, 8x8 PNGs in ``folder/split``. For tests and the run-time benchmark
    (val2017 size: 5,000 images, ~25,000 captions, ~36,000 instances). Returns the two
    annotation paths and the image folder."""
    from demind.exclcoco_builder import with_article
    from demind.exclcoco_labels import SYNONYMS
    from demind.io import write_json_atomic

    rng = random.Random(seed)
    folder = Path(folder)
    weights = [12.0] + [1.0 / (1 + 0.05 * i) for i in range(len(COCO_CATEGORIES) - 1)]
    images, annotations, captions = [], [], []
    for n in range(num_images):
        image_id = 1000 + 7 * n  # ids are not 0..N-1 in COCO either
        images.append({"id": image_id, "file_name": f"{image_id:012d}.png", "width": 8, "height": 8})
        count = max(1, round(rng.expovariate(1 / instances_per_image)))
        cats = rng.choices(range(len(COCO_CATEGORIES)), weights, k=count)
        for c in cats:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": c + 1,
                                "bbox": [0, 0, 4, 4], "area": 16.0, "iscrowd": 0})
        distinct = sorted(set(cats))
        for _ in range(captions_per_image):
            named = rng.sample(distinct, min(len(distinct), rng.choice((1, 2, 2, 3))))
            words = []
            for c in named:
                name = COCO_CATEGORIES[c]
                if SYNONYMS.get(name) and rng.random() < 0.3:
                    name = rng.choice(SYNONYMS[name])
                words.append(with_article(name) if rng.random() < 0.7 else name + ("es" if name.endswith("s") else "s"))
            text = f"{' and '.join(words).capitalize()} in the {rng.choice(SCENE_WORDS)}."
            captions.append({"id": len(captions) + 1, "image_id": image_id, "caption": text})
    categories = [{"id": i + 1, "name": c, "supercategory": "thing"} for i, c in enumerate(COCO_CATEGORIES)]
    instances_path = write_json_atomic(folder / "annotations" / f"instances_{split}.json",
                                       {"images": images, "annotations": annotations, "categories": categories})
    captions_path = write_json_atomic(folder / "annotations" / f"captions_{split}.json",
                                      {"images": images, "annotations": captions})
    image_dir = folder / split
    if write_images:
        from PIL import Image

        image_dir.mkdir(parents=True, exist_ok=True)
        for img in images:
            colour = tuple(rng.randrange(256) for _ in range(3))
            Image.new("RGB", (8, 8), colour).save(image_dir / img["file_name"])
    return instances_path, captions_path, image_dir


# --------------------------------------------------------------------------- a scripted MLLM


class TextRenderer:
    """A chat template that joins the turns' texts (``<image>`` for an image item): prompts a test can read."""

    chat_template = "scripted"

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        return " ".join(item.get("text", "<image>") for turn in conversation for item in turn["content"])


class ScriptedEngine:
    """Behind the Engine interface, without a model: ``answer(request)`` is each request's text.
    Keeps what it was asked: ``calls`` (generate calls), ``requests`` (their count) and ``prompts``."""

    name = "scripted"
    model_id = "scripted"
    prefix_capacity_tokens = None
    renderer = TextRenderer()

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0
        self.requests = 0
        self.prompts: list[str] = []

    def generate(self, requests: list[Any]) -> list[Any]:
        from demind.engines import GenResult

        self.calls += 1
        self.requests += len(requests)
        self.prompts += [r.prompt for r in requests]
        return [GenResult(text=self.answer(r), finish_reason="stop", prompt_tokens=1, output_tokens=1)
                for r in requests]

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(t.split()) for t in texts]

    def release_prefixes(self) -> None:
        pass
