"""Write the paper's models with random weights at their real shapes (nothing is downloaded):

    python scripts/make_full_size_models.py --out models/full        # ~15 GB of LLaVA, ~1.7 GB of CLIP, minutes
    python scripts/make_full_size_models.py --out models/mid --small   # the same files, small layers (tests, ~20 MB)

* ``OUT/llava-v1.6-mistral-7b-hf``: the files of ``llava-hf/llava-v1.6-mistral-7b-hf`` (config, processor,
  chat template, tokenizer, generation config) and random bf16 weights in the Hub's four safetensors shards;
  ``engine.model=OUT/llava-v1.6-mistral-7b-hf`` runs configs/data_gen/llava-1.6-7b.yaml against it.
* ``OUT/ViT-L-14.safetensors``: open_clip ViT-L-14 with ``pretrained`` unset (``backbone.pretrained=PATH``).

Weights stream to disk one tensor at a time (peak memory ~0.5 GB). The tokenizer is Mistral-7B's real
vocabulary when the ``mistral_common`` package is installed (it ships the SentencePiece file) or
``--sentencepiece tokenizer.model`` is given; otherwise a stand-in of the same size and special-token ids,
which the folder's README.md says. A complete folder (its safetensors index written) is reused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.full_size_models import write_llava_mistral_7b, write_vit_l14  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the model folders")
    parser.add_argument("--small", action="store_true", help="the real config and processor files with small layers")
    parser.add_argument("--only", choices=("llava", "clip"), help="write one of the two")
    parser.add_argument("--sentencepiece", help="Mistral-7B's tokenizer.model (default: mistral_common's copy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.only != "clip":
        folder = write_llava_mistral_7b(out / "llava-v1.6-mistral-7b-hf", small=args.small,
                                        sentencepiece=args.sentencepiece, seed=args.seed)
        print(f"llava: {folder} ({(folder / 'README.md').read_text(encoding='utf-8').splitlines()[1]})")
    if args.only != "llava" and not args.small:
        print(f"clip: {write_vit_l14(out / 'ViT-L-14.safetensors', seed=args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
