"""The benchmark names and the benchmark sections of ``demind-eval``'s config (``fashioniq``, ``coco``;
together :class:`ReaderOptions`, what the readers are handed).

Torch-free, so ``demind-eval --help`` and config checks load no model code; callers import them from
here (the face :mod:`demind.eval` offers ``BENCHMARKS``, ``CocoOptions`` and ``ReaderOptions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demind.settings import setting
from demind.eval.coco import PROMPT_FORMS, QUERY_RESIZES
from demind.eval.fashioniq import CAPTION_ORDERS, TEXT_FORMS

BENCHMARKS = ("cirr", "fashioniq", "coco", "imagenet-r", "circo", "exclusion", "exclcoco")


@dataclass
class FashionIQOptions:
    caption_order: str = setting("released", choices=CAPTION_ORDERS,
                                 help="released: Pic2Word's '{caption2} and {caption1}'; file: file order")
    text: str = setting("released", choices=TEXT_FORMS,
                        help="Text-only/Image+Text text. released: the whole prompt 'a photo of * , {captions}', "
                             "as Pic2Word; captions: the two captions only")


@dataclass
class CocoOptions:
    csv: str | None = setting(None, input="file", help="read queries from a Pic2Word coco_eval.csv instead of building them")
    prompt: str = setting("released", choices=PROMPT_FORMS,
                          help="released: 'a photo of * and {query class} and {others}', with Pic2Word's dangling "
                               "'and' when there are no others; trimmed: without it; prose: 'a photo of * , {obj1} "
                               "and {obj2}'")
    query_resize: str = setting("released", choices=tuple(QUERY_RESIZES),
                                help="released: query region resized straight to the input square, no crop, as "
                                     "Pic2Word; center-crop: the backbone's resize + centre-crop")
    seed: int = setting(0, ge=0, help="seed of the COCO query draw")
    min_area: float = setting(0.05, ge=0, le=1, help="smallest query box area, as a fraction of the image")
    max_area: float = setting(0.5, ge=0, le=1, help="largest query box area, as a fraction of the image")

    def config_problems(self) -> list[tuple[str, str]]:
        if self.min_area >= self.max_area:
            return [("min_area", f"= {self.min_area} must be below coco.max_area = {self.max_area}")]
        return []


@dataclass
class ReaderOptions:
    """Benchmark-specific choices (defaults follow Pic2Word's released protocol; see each reader):
    the ``fashioniq`` and ``coco`` sections of ``demind-eval``'s config."""

    fashioniq: FashionIQOptions = field(default_factory=FashionIQOptions)
    coco: CocoOptions = field(default_factory=CocoOptions)
