"""Where trained queries sit relative to the toy CLIP's modality gap, on the toy CIRR's queries.

    python -m toyworld.lab.query_geometry --cirr WORKDIR/benchmarks/cirr \\
        --features WORKDIR/eval/feature_cache --checkpoints RUN_A/demind.safetensors RUN_B/demind.safetensors

For each checkpoint (its backbone rebuilt from the checkpoint's own record) and for De-MINDS and
mapping-only of it, over the toy CIRR's queries: tanh(gate); the query's cosine with the gap axis
(the last embedding dimension, which only texts use: ``toyworld.clip.add_modality_gap``); the
spread (std over the batch) of the query's cosines to the target *descriptions* (what the
alignment loss compares it with) and to the target *images* (what retrieval compares it with).
Prints a table and one JSON line per row (``--json PATH``: the rows as one JSON list). The reading it checks is in
``docs/lab-notes/calibrated-cirr.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from demind.backbone import FrozenCLIP
from demind.checkpoint import checkpoint_backbone_config, load_checkpoint
from demind.io import write_json_atomic
from demind.templates import TEMPLATES


def gallery_features(features_root: Path) -> dict[str, torch.Tensor]:
    """name -> (D,) normalised gallery image embedding, from the evaluation's feature cache."""
    from demind.retrieval import ImageFeatureCache

    out = {}
    for split_dir in sorted(features_root.rglob("cirr/val")):  # one folder per backbone, as the evaluation keys them
        for data in ImageFeatureCache.at(split_dir).read_parts("gallery"):
            out.update(zip(data["names"], F.normalize(data["features"].float(), dim=-1)))
    if not out:
        raise SystemExit(f"error: no CIRR gallery features under {features_root} (run the quickstart on it first)")
    return out


@torch.no_grad()
def geometry(model, queries: list[dict], gallery: dict[str, torch.Tensor], mapping_only: bool) -> dict[str, float]:
    ref = torch.stack([gallery[q["reference"]] for q in queries])                  # (Q, D)
    target_images = torch.stack([gallery[q["target_hard"]] for q in queries])      # (Q, D)
    q = model.query(ref, [x["caption"] for x in queries], template=TEMPLATES["cirr"], mapping_only=mapping_only)
    descriptions = F.normalize(model.backbone.encode_text([x["target_description"] for x in queries]).pooled, dim=-1)
    to_text, to_image = q @ descriptions.T, q @ target_images.T                       # (Q, Q)
    return {"gap_axis_cos": q[:, -1].mean().item(),
            "std_cos_to_descriptions": to_text.std(dim=1).mean().item(),
            "std_cos_to_target_images": to_image.std(dim=1).mean().item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cirr", required=True, type=Path, help="the toy CIRR folder (rc2 layout)")
    parser.add_argument("--features", required=True, type=Path, help="the evaluation's feature cache")
    parser.add_argument("--checkpoints", nargs="+", required=True, type=Path)
    parser.add_argument("--queries", type=int, default=256, help="the first N queries (one batch)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    queries = json.loads((args.cirr / "captions" / "cap.rc2.val.json").read_text())[: args.queries]
    gallery = gallery_features(args.features)
    print(f"{'checkpoint':<40} {'query':<13} {'tanh(gate)':>10} {'cos(q, gap axis)':>17} "
          f"{'std cos to texts':>17} {'std cos to images':>18}")
    rows = []
    for path in args.checkpoints:
        model = load_checkpoint(path, FrozenCLIP(checkpoint_backbone_config(path)))
        gate = torch.tanh(model.gate).item() if model.cfg.fusion == "gate" else float("nan")
        for mapping_only in (False, True):
            row = geometry(model, queries, gallery, mapping_only)
            name = "mapping-only" if mapping_only else "demind"
            print(f"{path.parent.name:<40} {name:<13} {gate:>10.3f} {row['gap_axis_cos']:>17.3f} "
                  f"{row['std_cos_to_descriptions']:>17.3f} {row['std_cos_to_target_images']:>18.3f}")
            rows.append({"checkpoint": str(path), "query": name, "tanh_gate": gate, **row})
            print(json.dumps(rows[-1]))
    if args.json:
        write_json_atomic(args.json, rows, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
