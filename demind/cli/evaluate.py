"""``demind-eval`` / ``python -m demind.eval``: one benchmark, one command, a table and files you can check.

    demind-eval --benchmark cirr --data-root data/CIRR --checkpoint runs/demind/demind.safetensors \
        --split val --out runs/eval/cirr

Loads the backbone and model (:func:`demind.checkpoint.load_backbone_and_model`), then runs
:func:`demind.eval.evaluate`.
"""

from __future__ import annotations

import argparse

from demind.cli.common import run_command
from demind.config import ConfigError
from demind.eval.coco import PROMPT_FORMS, QUERY_RESIZES
from demind.eval.fashioniq import CAPTION_ORDERS, TEXT_FORMS


def build_parser() -> argparse.ArgumentParser:
    from demind.eval.harness import BENCHMARKS
    from demind.eval.methods import METHODS

    p = argparse.ArgumentParser(prog="demind-eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmark", required=True, choices=BENCHMARKS)
    p.add_argument("--data-root", required=True, help="the benchmark's folder in its official layout")
    p.add_argument("--checkpoint", help="De-MINDS checkpoint (.safetensors); its backbone is rebuilt from it")
    p.add_argument("--exclmm", help="trained ExclMM export (exclmm.safetensors) for the exclmm method")
    p.add_argument("--backbone", help="NAME:TAG_OR_PATH, e.g. ViT-L-14:openai (backbone-only methods, or to "
                                      "check the checkpoint's backbone); NAME:none = random weights")
    p.add_argument("--split", default="val", help="val (default) or test (CIRR test1, CIRCO test)")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}, or a negation-aware "
                                     "variant BASE+deo / BASE+deo-adam of text-only, image+text, mapping-only, "
                                     "demind (default: all base methods the given checkpoint/backbone allow, except "
                                     "oracle, which needs the toy benchmarks' target descriptions)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--cache-dir", help="image-feature cache (default OUT/feature_cache); share it across runs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=4, help="image-decoding workers")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--precision", default="fp32", help="backbone precision (fp32, fp16, bf16, amp)")
    p.add_argument("--limit", type=int, help="evaluate only the first N queries (smoke runs; flagged in outputs)")
    p.add_argument("--fashioniq-caption-order", default="released", choices=CAPTION_ORDERS,
                   help="released: Pic2Word's '{caption2} and {caption1}' (default); file: file order")
    p.add_argument("--fashioniq-text", default="released", choices=TEXT_FORMS,
                   help="Text-only/Image+Text text. released: the whole prompt 'a photo of * , {captions}', "
                        "'*' included, as Pic2Word (default); captions: the two captions only")
    p.add_argument("--coco-csv", help="read queries from a Pic2Word coco_eval.csv instead of building them")
    p.add_argument("--coco-prompt", default="released", choices=PROMPT_FORMS,
                   help="released: 'a photo of * and {query class} and {others}', with Pic2Word's dangling "
                        "'and' when there are no others (default); trimmed: without it; "
                        "prose: 'a photo of * , {obj1} and {obj2}'")
    p.add_argument("--coco-query-resize", default="released", choices=tuple(QUERY_RESIZES),
                   help="released: query region resized straight to the backbone's input square, no crop, "
                        "as Pic2Word (default); center-crop: the backbone's resize + centre-crop")
    p.add_argument("--coco-seed", type=int, default=0, help="seed of the COCO query draw")
    p.add_argument("--coco-area", default="0.05,0.5", help="MIN,MAX box area as a fraction of the image")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def reader_options(args: argparse.Namespace):
    """The ReaderOptions the flags ask for."""
    from demind.eval.harness import ReaderOptions

    try:
        low, high = (float(v) for v in args.coco_area.split(","))
    except ValueError:
        raise ConfigError(f"--coco-area must be MIN,MAX fractions such as 0.05,0.5, got {args.coco_area!r}") from None
    return ReaderOptions(fashioniq_caption_order=args.fashioniq_caption_order, fashioniq_text=args.fashioniq_text,
                         coco_csv=args.coco_csv, coco_prompt=args.coco_prompt,
                         coco_query_resize=args.coco_query_resize, coco_seed=args.coco_seed,
                         coco_min_area=low, coco_max_area=high)


def evaluate_command(args: argparse.Namespace) -> int:
    """Load, evaluate, print the table and the files written."""
    import torch

    from demind.checkpoint import load_backbone_and_model
    from demind.eval.harness import evaluate
    from demind.eval.reports import format_table

    options = reader_options(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backbone, model = load_backbone_and_model(args.checkpoint, args.backbone, precision=args.precision, device=device)
    exclmm = None
    if args.exclmm:
        from demind.exclmm import load_exclmm

        exclmm = load_exclmm(args.exclmm, backbone.identity, backbone.device)
    results = evaluate(
        args.benchmark, args.data_root, backbone=backbone, model=model, methods=args.methods, split=args.split,
        out_dir=args.out, cache_dir=args.cache_dir, options=options, batch_size=args.batch_size,
        num_workers=args.num_workers, limit=args.limit, progress=not args.quiet, exclmm=exclmm,
    )
    print(format_table(results))
    print(f"results: {results['files']['results']}\ntable: {results['files']['table']}")
    for path in results["files"]["submissions"]:
        print(f"submission: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command on ``argv`` (default: sys.argv[1:]); returns the exit status (2: bad input)."""
    return run_command(build_parser(), evaluate_command, argv)
