"""What an evaluation leaves behind: a printed table, results.json, per-method rankings,
a markdown table shaped like the paper's tables, and test-server submission files.

* ``rankings/<method>.json``: ``{query id: [top-50 gallery names]}``, so anyone can recompute
  the metrics (CIRR's reference is already excluded).
* CIRR test1: ``submission/cirr_test1_<method>_recall.json``
  (``{"version": "rc2", "metric": "recall", "<pairid>": [50 names]}``) and
  ``..._recall_subset.json`` (``"metric": "recall_subset"``, top 3 of the subset).
* CIRCO test: ``submission/circo_test_<method>.json`` (``{"<id>": [50 integer image ids]}``).

Every file is written to a temporary name and renamed, so a crash never leaves half a file. A run
into an ``--out`` that holds an earlier evaluation replaces it: results.json, table.md, and the
rankings and submissions of methods this run did not evaluate are removed (logged), so every file
there belongs to the run its results.json describes (:func:`remove_stale_outputs`).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from demind.errors import InputError
from demind.eval.structures import QueryGroup
from demind.retrieval import method_label
from demind.io import write_json_atomic, write_text_atomic

TITLES = {
    "cirr": "CIRR",
    "fashioniq": "FashionIQ",
    "coco": "COCO object composition",
    "imagenet-r": "ImageNet-R domain conversion",
    "circo": "CIRCO",
    "exclcoco": "ExclCOCO",
}
GROUP_LABELS = {"average": "Avg", "toptee": "TopTee"}

log = logging.getLogger(__name__)


def column_label(key: str) -> str:
    """``dress/R@10`` -> ``Dress R@10``; ``average/R@10`` -> ``Avg R@10``; ``Rsubset@1`` -> ``Rs@1``."""
    group, _, metric = key.rpartition("/")
    metric = metric.replace("Rsubset@", "Rs@")
    if not group:
        return metric
    return f"{GROUP_LABELS.get(group, group.capitalize())} {metric}"


def metric_columns(results: dict) -> list[str]:
    """Metric keys in the order the first evaluated method reports them (group-major, as in the paper)."""
    for values in results["methods"].values():
        if values:
            return list(values)
    return []


def _rows(results: dict) -> tuple[list[str], list[list[str]]]:
    columns = metric_columns(results)
    header = ["Method", *(column_label(c) for c in columns)]
    # a metric one method lacks (a re-ranked row has no AUCs: no score per gallery image) prints as n/a
    rows = [[method_label(m), *(f"{values[c]:.2f}" if c in values else "n/a" for c in columns)]
            for m, values in results["methods"].items()]
    return header, rows


def _title(results: dict) -> str:
    backbone = results["backbone"]
    return (f"{TITLES.get(results['benchmark'], results['benchmark'])} ({results['split']}), "
            f"backbone {backbone['name']} / {backbone['pretrained']}, values in %")


def _footnotes(results: dict) -> list[str]:
    notes = list(results["definitions"])
    for group, counts in results["counts"].items():
        if counts["skipped"] or counts["gallery_missing"]:
            notes.append(f"{group}: evaluated {counts['evaluated']} of {counts['queries']} queries; skipped "
                         f"{counts['skip_reasons']}; {counts['gallery_missing']} gallery images missing")
    if results.get("limit") is not None:
        notes.append(f"LIMITED RUN: first {results['limit']} queries only (not comparable to published numbers)")
    if not results["has_ground_truth"] and results.get("limit") is not None:
        notes.append("test split: no ground truth here; rankings written, and the submission files as "
                     "partial-first*_...json (not test-server submissions: the run was limited)")
    elif not results["has_ground_truth"]:
        notes.append("test split: no ground truth here; rankings and submission files written")
    return notes


def format_table(results: dict) -> str:
    """The results as a plain-text table with the metric definitions under it."""
    header, rows = _rows(results)
    lines = [_title(results)]
    if len(header) > 1:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
        lines += [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]
    lines += [f"* {n}" for n in _footnotes(results)]
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    """A markdown table: one row per method, columns as in the paper's table for this benchmark."""
    header, rows = _rows(results)
    lines = [f"**{_title(results)}**", ""]
    if len(header) > 1:
        lines += ["| " + " | ".join(header) + " |", "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {n}" for n in _footnotes(results)]
    return "\n".join(lines) + "\n"


def cirr_submission(rankings: dict[str, list[str]], metric: str) -> dict[str, Any]:
    """CIRR test-server format: ``{"version": "rc2", "metric": metric, pairid: names}``."""
    if metric not in ("recall", "recall_subset"):
        raise InputError(f"CIRR submissions are 'recall' or 'recall_subset', got {metric!r}")
    depth = 50 if metric == "recall" else 3
    return {"version": "rc2", "metric": metric, **{qid: names[:depth] for qid, names in rankings.items()}}


def write_reports(out_dir: Path, results: dict, data, outcomes: dict) -> dict[str, Any]:
    """Write every output file; returns their paths (also stored in results.json)."""
    files: dict[str, Any] = {"rankings": {}, "submissions": []}
    for method, by_group in outcomes.items():
        merged = {qid: names for o in by_group.values() for qid, names in o.rankings.items()}
        files["rankings"][method] = str(write_json_atomic(out_dir / "rankings" / f"{method}.json", merged))
        files["submissions"] += _write_submissions(out_dir, data, method, by_group, results.get("limit"))
    files["table"] = str(write_text_atomic(out_dir / "table.md", markdown_table(results)))
    files["results"] = str(out_dir / "results.json")
    results["files"] = files
    write_json_atomic(out_dir / "results.json", results, indent=2)
    remove_stale_outputs(out_dir, files)
    return files


OUTPUT_FOLDERS = ("rankings", "submission")
"""The folders of ``--out`` that hold only files demind-eval writes (one per method)."""


def remove_stale_outputs(out_dir: Path, files: dict[str, Any]) -> list[Path]:
    """Remove the ``rankings/*.json`` and ``submission/*.json`` that this run did not write: an earlier
    evaluation's, into the same ``--out``, which no results.json lists any more. The folder then holds
    one evaluation, the one its results.json describes; the feature cache and the MLLM answers beside
    it stay (that reuse is why a run goes into the same ``--out`` again), and so does any other file."""
    written = {Path(p).resolve() for p in [*files["rankings"].values(), *files["submissions"]]}
    stale = sorted(p for folder in OUTPUT_FOLDERS if (out_dir / folder).is_dir()
                   for p in (out_dir / folder).glob("*.json") if p.resolve() not in written)
    for path in stale:
        path.unlink()
    if stale:
        log.info("removed %d output file(s) of the previous evaluation in %s that this one did not write: %s",
                 len(stale), out_dir, ", ".join(p.relative_to(out_dir).as_posix() for p in stale))
    return stale


def partial_submission_note(limit: int) -> str:
    """What a limited run's submission file says of itself (and why the test server refuses it)."""
    return (f"PARTIAL: the first {limit} queries only (demind-eval --limit {limit}); not a test-server "
            f"submission: run without --limit for one")


def _write_submissions(out_dir: Path, data, method: str, by_group: dict, limit: int | None = None) -> list[str]:
    """The test-server files of a CIRR test1 / CIRCO test run. A run with ``limit`` writes them as
    ``partial-firstN_<usual name>`` holding a ``"partial"`` key (a file the server refuses), so that
    no file that looks like a full submission holds N queries."""
    written = []
    prefix = f"partial-first{limit}_" if limit is not None else ""
    marker = {"partial": partial_submission_note(limit)} if limit is not None else {}
    if data.benchmark == "cirr" and data.split == "test1":
        outcome = by_group["all"]
        for metric, rankings in (("recall", outcome.rankings), ("recall_subset", outcome.subset_rankings)):
            path = out_dir / "submission" / f"{prefix}cirr_test1_{method}_{metric}.json"
            written.append(str(write_json_atomic(path, {**marker, **cirr_submission(rankings, metric)})))
    if data.benchmark == "circo" and data.split == "test":
        ids = data.submission_ids
        payload = {qid: [ids[n] for n in names] for qid, names in by_group["all"].rankings.items()}
        written.append(str(write_json_atomic(out_dir / "submission" / f"{prefix}circo_test_{method}.json",
                                             {**marker, **payload})))
    return written


def combine_group_metrics(per_group: dict[str, dict[str, float]]) -> dict[str, float]:
    """Flat percentages: one group -> its metrics; several -> ``group/metric`` plus ``average/metric``."""
    if len(per_group) == 1:
        return {k: 100.0 * v for k, v in next(iter(per_group.values())).items()}
    flat: dict[str, float] = {}
    for group, values in per_group.items():
        flat.update({f"{group}/{k}": 100.0 * v for k, v in values.items()})
    names = list(next(iter(per_group.values())).keys())
    for k in names:
        flat[f"average/{k}"] = sum(100.0 * v[k] for v in per_group.values()) / len(per_group)
    return flat


def group_counts(group: QueryGroup) -> dict[str, Any]:
    """A query group's counts in results.json: queries evaluated and skipped (why), gallery images missing."""
    return {
        "queries": group.total_queries,
        "evaluated": len(group.queries),
        "skipped": len(group.skipped),
        "skip_reasons": dict(Counter(s["reason"] for s in group.skipped)),
        "skipped_queries": group.skipped,
        "gallery": len(group.gallery),
        "gallery_missing": len(group.gallery_missing),
        "gallery_missing_names": group.gallery_missing,
    }
