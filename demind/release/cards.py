"""Model and dataset cards: ``README.md`` with YAML front matter, generated from real run data only.

The model card carries the checkpoint's recorded backbone and model config and, for every
``results.json`` of ``demind-eval`` that belongs to the checkpoint, the evaluation table exactly
as the evaluation wrote it (:func:`demind.eval.reports.markdown_table`) plus the published model's
row (``demind`` for a De-MINDS checkpoint, ``combiner`` for a combiner: :data:`MODEL_KINDS`)
in the Hub's ``model-index`` metadata. Without a ``results.json`` the card claims no numbers.

The dataset card carries the intent-shard schema (:data:`demind.shard_format.INTENT_MEMBERS`),
the generation config, engine, model and prompt version, and the counts summed over the
shards' ``_stats.json`` done-markers.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import yaml

from demind.eval import TITLES, markdown_table
from demind.identity import same_backbone
from demind.schema import COMBINER_ARCHITECTURE
from demind.shard_format import INTENT_MEMBERS

LIBRARY = "demind"
MODEL_TAGS = ["demind", "composed-image-retrieval", "zero-shot-composed-image-retrieval", "clip", "open_clip"]
DATASET_TAGS = ["demind", "webdataset", "composed-image-retrieval", "intent-shards"]


@dataclass(frozen=True)
class ModelKind:
    """What a card says of one kind of checkpoint: the evaluation method that is the published model
    (its row goes into ``model-index``), its tags, what it is, and the training keys worth listing."""

    method: str
    tags: tuple[str, ...]
    summary: str
    training_keys: tuple[str, ...]


MODEL_KINDS = {
    "demind": ModelKind(
        "demind", tuple(MODEL_TAGS),
        "A De-MINDS model for zero-shot composed image retrieval: a mapping network and an intention module trained "
        "on top of a frozen CLIP, published with `demind-publish`.",
        ("optim.max_steps", "optim.global_batch_size", "optim.lr", "data.shards", "run.seed")),
    COMBINER_ARCHITECTURE: ModelKind(
        "combiner", ("demind", "composed-image-retrieval", "supervised-composed-image-retrieval", "combiner", "clip",
                     "open_clip"),
        "A combiner for composed image retrieval (CLIP4Cir-style): f(reference image feature, text feature) over a "
        "frozen CLIP, trained with supervision on (reference, modification, target) triplets by "
        "`demind-train-triplets`; its queries are the method `combiner`. Published with `demind-publish`.",
        ("data.source", "data.path", "data.limit", "noise.kind", "noise.rate", "robust.mode", "optim.epochs",
         "optim.batch_size", "optim.lr", "run.seed")),
}
MODEL_METHOD = MODEL_KINDS["demind"].method
"""The evaluation method of a De-MINDS checkpoint (:func:`model_kind` gives each checkpoint's)."""


def model_kind(meta: dict[str, Any]) -> ModelKind:
    """The kind of the checkpoint ``meta`` records: a combiner (``architecture: combiner``) or De-MINDS."""
    architecture = (meta.get("model_config") or {}).get("architecture")
    return MODEL_KINDS[COMBINER_ARCHITECTURE if architecture == COMBINER_ARCHITECTURE else "demind"]


EVAL_KEYS = ("benchmark", "split", "methods", "backbone", "model_config")
"""Keys that make a ``results.json`` one written by ``demind-eval``."""


def render_card(front_matter: dict[str, Any], body: str) -> str:
    """``---`` YAML ``---`` then the markdown body: the Hub's card format."""
    header = yaml.safe_dump(front_matter, sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{header}---\n\n{body.strip()}\n"


def read_front_matter(card: str) -> dict[str, Any]:
    """The YAML front matter of a card's text (``{}`` when it has none)."""
    if not card.startswith("---\n"):
        return {}
    end = card.index("\n---\n", 4)
    return yaml.safe_load(card[4:end]) or {}


# --------------------------------------------------------------------------- model card


def results_problem(results: Any, meta: dict[str, Any]) -> str | None:
    """Why ``results`` (a parsed results.json) is not an evaluation of this checkpoint, or None."""
    if not isinstance(results, dict) or any(k not in results for k in EVAL_KEYS):
        return f"it is not a demind-eval results.json (needs the keys {', '.join(EVAL_KEYS)})"
    if results["model_config"] is None:
        return "it evaluated a backbone alone, not a checkpoint"
    if results["model_config"] != meta["model_config"]:
        return "its model config differs from the checkpoint's"
    identity = {k: v for k, v in results["backbone"].items() if k != "precision"}
    if not same_backbone(identity, meta["backbone_identity"]):
        return f"it ran on backbone {identity}, the checkpoint on {meta['backbone_identity']}"
    return None


def base_model_id(name: str, pretrained: str | None) -> str | None:
    """The Hub repository of an open_clip ``name`` + ``pretrained`` tag, where open_clip knows one."""
    import open_clip

    if not pretrained:
        return None
    hub = open_clip.get_pretrained_cfg(name, pretrained).get("hf_hub")
    return hub.strip("/") if hub else None


def model_index(name: str, evaluations: list[dict[str, Any]], method: str = MODEL_METHOD) -> list[dict[str, Any]]:
    """The Hub's ``model-index``: the published model's ``method``'s metrics of every evaluation, values in %."""
    results = []
    for res in evaluations:
        values = res["methods"].get(method)
        if not values:
            continue
        results.append({
            "task": {"type": "composed-image-retrieval", "name": "Zero-shot composed image retrieval"},
            "dataset": {"name": TITLES.get(res["benchmark"], res["benchmark"]), "type": res["benchmark"],
                        "split": res["split"]},
            "metrics": [{"type": key, "name": key, "value": round(float(v), 4)} for key, v in values.items()],
        })
    return [{"name": name, "results": results}] if results else []


def _backbone_lines(meta: dict[str, Any]) -> list[str]:
    cfg, identity = meta["backbone_config"], meta["backbone_identity"]
    tag = cfg.get("pretrained")
    weights = f"pretrained `{tag}`" if tag else "random weights"
    lines = [f"- Frozen CLIP: `{cfg['name']}`, {weights} (identity `{json.dumps(identity)}`)."]
    if tag is None:
        lines.append(f"- The backbone has random weights drawn from seed {cfg.get('seed')} (a smoke test, not a "
                     "usable retrieval model); the loader draws the same weights and checks their fingerprint.")
    elif str(identity.get("pretrained", "")).startswith("sha256:"):
        lines.append(f"- The backbone's weights are a local file, published in this folder as `{tag}` (the loader "
                     "finds it there and checks its sha256).")
    if str(cfg["name"]).endswith(".json"):
        lines.append(f"- The backbone's open_clip model config is published in this folder as `{cfg['name']}`.")
    return lines


def model_card(meta: dict[str, Any], evaluations: list[tuple[str, dict[str, Any]]], *, name: str,
               repo: str | None, license: str, tags: list[str], datasets: list[str],
               training: dict[str, Any] | None, left_out: list[str] = ()) -> str:
    """The model card of a checkpoint (``meta``: :func:`demind.checkpoint.read_checkpoint_metadata`).

    evaluations: (file name in the folder, parsed results.json) of this checkpoint's evaluations.
    training: the run's resolved training config (``config.yaml``), or None when absent.
    left_out: one sentence per evaluation found and not reported (a limited run), said in the body.
    """
    backbone, kind = meta["backbone_config"], model_kind(meta)
    front: dict[str, Any] = {"library_name": LIBRARY, "license": license,
                             "tags": list(dict.fromkeys([*kind.tags, *tags]))}
    base = base_model_id(backbone["name"], backbone.get("pretrained"))
    if base:
        front["base_model"] = base
    if datasets:
        front["datasets"] = datasets
    front["demind"] = {"backbone": {"name": backbone["name"], "pretrained": backbone.get("pretrained")},
                       "backbone_identity": meta["backbone_identity"], "model_config": meta["model_config"],
                       "tensors_sha256": meta.get("tensors_sha256")}
    index = model_index(name, [res for _, res in evaluations], kind.method)
    if index:
        front["model-index"] = index
    ref = f"hf-hub:{repo}" if repo else "hf-hub:ORG/NAME"
    body = [f"# {name}", "", kind.summary, "",
            "## Backbone and model", "", *_backbone_lines(meta),
            f"- Model config: `{json.dumps(meta['model_config'], sort_keys=True)}`.", ""]
    if training is not None:
        body += _training_lines(training, kind.training_keys)
    body += ["## Evaluation", ""]
    if evaluations:
        for file, res in evaluations:
            body += [markdown_table(res).rstrip(), "", f"(from `{file}`, written by `demind-eval`)", ""]
    else:
        body += ["No `results.json` of a full `demind-eval` run was found for this checkpoint, so this card "
                 "reports no numbers. Evaluate it with `demind-eval` and publish again to add them.", ""]
    body += [f"- {note}" for note in left_out] + ([""] if left_out else [])
    body += ["## How to load", "", "```python",
             "from demind.checkpoint import load_backbone_and_model", "",
             f'backbone, model = load_backbone_and_model("{ref}")  # rebuilds the recorded backbone, checks it',
             "```", "",
             f"Every command's `--checkpoint` takes the same reference (add `@REVISION` for a branch, tag or "
             f"commit), e.g. `demind-eval --benchmark cirr --data-root data/CIRR --checkpoint {ref} "
             f"--methods {kind.method} --out runs/eval`. "
             "It is read through the Hugging Face cache, so `HF_HUB_OFFLINE=1` works once it is there; "
             "a download of this folder works as a local `--checkpoint FOLDER` too.", ""]
    return render_card(front, "\n".join(body))


def _training_lines(training: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """The card's training section: the ``keys`` (dotted) of the resolved training config that it holds."""
    values = {}
    for key in keys:
        value: Any = training
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None and value != "":
            values[key] = value
    listed = ", ".join(f"`{k}={v}`" for k, v in values.items())
    return ["## Training", "", f"Resolved training config in `training_config.yaml`: {listed}.", ""]


# --------------------------------------------------------------------------- dataset card


def size_category(n: int) -> str:
    """The Hub's ``size_categories`` bucket of ``n`` samples."""
    bounds = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
              (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B")]
    return next((label for bound, label in bounds if n < bound), "n>1T" if n >= 10**12 else "1B<n<10B")


def shard_counts(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed over the shards' ``_stats.json``: samples in/written/skipped/flagged, text tokens."""
    skipped, flagged, tokens = Counter(), Counter(), {}
    for s in stats:
        skipped.update(s.get("skipped") or {})
        flagged.update(s.get("flagged") or {})
        for stage, t in (s.get("text_tokens") or {}).items():
            total, count = tokens.get(stage, (0, 0))
            tokens[stage] = (total + t.get("total", 0), count + t.get("count", 0))
    return {"shards": len(stats), "samples_in": sum(s.get("samples_in", 0) for s in stats),
            "written": sum(s.get("written", 0) for s in stats), "skipped": dict(sorted(skipped.items())),
            "samples_flagged": sum(s.get("samples_flagged", 0) for s in stats), "flagged": dict(sorted(flagged.items())),
            "mean_text_tokens": {k: round(t / c, 2) for k, (t, c) in tokens.items() if c}}


def generation_summary(stats: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The distinct engine, model, prompt version/sha and mode over the shards (one each unless mixed)."""
    keys = ("engine", "model", "prompt_version", "prompt_sha", "mode")
    return {k: list(dict.fromkeys(s.get(k) for s in stats if s.get(k) is not None)) for k in keys}


def dataset_card(stats: list[dict[str, Any]], *, name: str, repo: str | None, license: str,
                 tags: list[str]) -> str:
    """The dataset card of a folder of intent shards from their ``_stats.json`` (one dict per shard)."""
    counts, gen = shard_counts(stats), generation_summary(stats)
    configs = list({json.dumps(s["config"], sort_keys=True): s["config"] for s in stats if s.get("config")}.values())
    front = {"license": license, "tags": list(dict.fromkeys(DATASET_TAGS + tags)),
             "task_categories": ["image-to-text", "text-to-image"], "size_categories": [size_category(counts["written"])],
             "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "*.tar"}]}],
             "demind": {"samples": counts["written"], "shards": counts["shards"],
                        **{k: (v[0] if len(v) == 1 else v) for k, v in gen.items()}}}
    ref = repo or "ORG/NAME"
    schema = ["| member | content |", "| --- | --- |", *(f"| `{m}` | {d} |" for m, d in INTENT_MEMBERS)]
    gen_rows = ["| field | value |", "| --- | --- |",
                *(f"| {k} | {', '.join(f'`{x}`' for x in v) or 'not recorded'} |" for k, v in gen.items())]
    count_rows = ["| count | value |", "| --- | --- |",
                  *(f"| {k} | {json.dumps(v) if isinstance(v, dict) else v} |" for k, v in counts.items())]
    body = [f"# {name}", "",
            "Intent shards for De-MINDS training: each image with its original caption (T_ori), a rewritten "
            "caption (T_rew) and a pseudo-manipulation description (T_int) written by a multimodal LLM, "
            "published with `demind-publish`. WebDataset tars, one `NNNNN_stats.json` per shard.", "",
            "## Sample schema", "", *schema, "", "## Generation", "", *gen_rows, ""]
    for i, config in enumerate(configs):
        title = "Generation config" + (f" ({i + 1} of {len(configs)})" if len(configs) > 1 else "")
        body += [f"{title}:", "", "```yaml", yaml.safe_dump(config, sort_keys=False).rstrip(), "```", ""]
    body += ["## Counts", "", "Summed over the shards' `_stats.json`:", "", *count_rows, "",
             "## How to use", "", "Train on it straight from the Hub (read through the Hugging Face cache):", "",
             "```bash", f"demind-train --config configs/train/paper.yaml data.shards=hf-hub:{ref}", "```", "",
             "or read it with `datasets`:", "", "```python", "from datasets import load_dataset", "",
             f'ds = load_dataset("{ref}", split="train", streaming=True)  # fields: jpg, txt, rew.txt, int.txt, json',
             "```", ""]
    return render_card(front, "\n".join(body))
