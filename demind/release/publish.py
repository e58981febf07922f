"""``demind-publish``'s work: a checkpoint's Hub-layout folder, a shard folder's dataset card, the upload.

A published checkpoint folder (what ``--checkpoint FOLDER`` and ``hf-hub:ORG/NAME`` read) is
self-contained: it loads on any machine, after any move::

    demind.safetensors        the checkpoint's tensors (sha256 checked first), its backbone paths
                              rewritten relative to the folder
    config.json               format, model config, backbone config and identity, the file list
                              (what ``--overwrite`` may replace: :mod:`demind.release.folders`)
    README.md                 the model card (demind.release.cards.model_card)
    backbone/NAME.json        the backbone's open_clip model-config JSON, when the backbone is one
    backbone/WEIGHTS          the backbone's weights file, when it is a local file (a fine-tuned or
                              toy CLIP); a pretrained tag is fetched by open_clip as usual
    training_config.yaml      the run's resolved training config, when the run folder has one (config.yaml
                              of demind-train, run.json's config of demind-train-triplets)
    results/BENCH-SPLIT.json  each results.json of demind-eval that evaluated this checkpoint

Every path a file of the folder records is relative to it; absolute paths in the copied configs
and results are cut (``without_local_paths``): a published folder does not show the publisher's disk.

Intent shards are published where they lie: the dataset card is written as the shard folder's
``README.md`` and the folder is uploaded with only its ``*.tar``, ``*_stats.json`` and card.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from demind.schema import BackboneConfig
from demind.checkpoint import (BACKBONE_DIR, BACKBONE_FILES_KEY, CHECKPOINT_FILE, CheckpointError, CheckpointSource,
                               read_checked_tensors, read_checkpoint_metadata, resolve_backbone_files,
                               resolve_checkpoint, write_checkpoint)
from demind.config import to_dict
from demind.hubref import HubError, hub_unreachable, import_hub, is_hub_ref, parse_hub_ref
from demind.identity import backbone_identity, canonical_identity, file_sha256
from demind.io import atomic_path, write_json_atomic, write_text_atomic
from demind.release.cards import dataset_card, model_card, model_kind, results_problem
from demind.release.folders import (CARD_MARKER, PUBLISHED_FILES_KEY, PublishError, building_beside,
                                    check_publish_target, swap_in)
from demind.shard_format import HUB_SHARD_FILES, SHARD_SUFFIX, ShardOutput, stats_path

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
CONFIG_FILE = "config.json"
TRAINING_CONFIG_FILE = "training_config.yaml"
TRIPLET_RUN_FILE = "run.json"  # a demind-train-triplets run's record: its resolved config under "config"
RESULTS_DIR = "results"


@dataclass
class CardOptions:
    """What a card says beyond the data: Hub repository, licence, extra tags, training datasets."""

    repo: str | None = None
    license: str = "apache-2.0"
    tags: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)

    def title(self, fallback: str) -> str:
        return self.repo.split("/", 1)[1] if self.repo else fallback


# --------------------------------------------------------------------------- checkpoints


def find_run_results(checkpoint: Path) -> list[Path]:
    """Every ``results.json`` under the checkpoint's run folder (``demind-eval --out RUN/eval/...``),
    and a published folder's ``results/*.json`` (publishing a published folder again keeps them)."""
    published = sorted((checkpoint.parent / RESULTS_DIR).glob("*.json")) if (
        checkpoint.parent / CONFIG_FILE).is_file() else []
    return sorted(checkpoint.parent.rglob("results.json")) + published


def checkpoint_evaluations(checkpoint: Path, meta: dict[str, Any], results: list[str] | None
                           ) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """The evaluations of this checkpoint: the ``results`` files given (each must be one), else the
    run folder's ``results.json`` files that are (the others are skipped with a log line); and the
    card's notes on found evaluations left out because they are partial (``demind-eval --limit``:
    never the model's result; one given by name is refused)."""
    explicit = results is not None
    found = [Path(p) for p in results] if explicit else find_run_results(checkpoint)
    kept, partial = [], []
    for path in found:
        try:
            parsed = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            if explicit:
                raise PublishError(f"results {path} cannot be read ({e}); give the results.json demind-eval wrote")
            logger.info("skipping %s: unreadable (%s)", path, e)
            continue
        problem = results_problem(parsed, meta)
        if problem and explicit:
            raise PublishError(f"results {path} does not evaluate checkpoint {checkpoint}: {problem}; "
                               "give a results.json that demind-eval wrote for this checkpoint")
        if problem:
            logger.info("skipping %s: %s", path, problem)
            continue
        limit = parsed.get("limit")
        if limit is not None and explicit:
            raise PublishError(f"results {path} is a limited run (demind-eval --limit {limit}: the first {limit} "
                               "queries only), not the model's result; run demind-eval without --limit and give that "
                               "results.json")
        if limit is not None:
            shown = path.relative_to(checkpoint.parent).as_posix() if path.is_relative_to(checkpoint.parent) \
                else path.name
            logger.warning("not publishing %s as a result: a limited run (demind-eval --limit %s)", path, limit)
            partial.append(f"`{shown}` is not reported: a limited run (`demind-eval --limit {limit}`, the first "
                           f"{limit} queries only) measures no result of the model.")
            continue
        kept.append((path, parsed))
    return kept, partial


def without_local_paths(obj: Any, run_dir: Path) -> Any:
    """``obj`` (parsed YAML/JSON) with every absolute path replaced, so a published config does not
    show the publisher's disk: a path inside ``run_dir`` becomes relative to it, any other becomes
    ``<local>/NAME``."""
    if isinstance(obj, dict):
        return {k: without_local_paths(v, run_dir) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_local_paths(v, run_dir) for v in obj]
    if isinstance(obj, str) and Path(obj).is_absolute() and len(Path(obj).parts) > 1:
        path = Path(obj)
        return str(path.relative_to(run_dir)) if path.is_relative_to(run_dir) else f"<local>/{path.name}"
    return obj


def _copy_file(src: Path, dest: Path) -> None:
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)


def _copy_backbone_files(meta: dict[str, Any], source: Path, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copy the backbone's local files (model-config JSON, weights file) into ``out/backbone/``
    after checking they are the ones the checkpoint records (identity by content). Returns the
    backbone config as the published checkpoint records it (paths relative to ``out``) and its
    backbone files record."""
    identity = canonical_identity(meta["backbone_identity"])  # older records: file:NAME@sha256:HEX
    try:
        cfg = resolve_backbone_files(meta, source)
    except CheckpointError as e:  # a weights file that is nowhere: its advice (--backbone) is the loaders'
        head = str(e).split("; give --backbone", 1)[0]
        raise PublishError(f"{head}; put that file back where the run had it, or beside the checkpoint, and publish "
                           f"again (the published folder must carry it)") from None
    published, files = to_dict(cfg), {"name": None, "pretrained": None, "model_config": None}
    if cfg.name.endswith(".json"):
        if not Path(cfg.name).is_file():
            raise PublishError(f"the checkpoint's backbone is the model config {cfg.name}, which is not on this "
                               "disk; publish from where it is, since the folder must carry it")
        now = backbone_identity(BackboneConfig(name=cfg.name, pretrained=None))["name"]
        if identity.get("name") != now:
            raise PublishError(f"the backbone model config {cfg.name} changed since training (its content is {now}, "
                               f"the checkpoint records {identity.get('name')}); restore the file the run used")
        published["name"] = files["name"] = f"{BACKBONE_DIR}/{Path(meta['backbone_config']['name']).name}"
        _copy_file(Path(cfg.name), out / published["name"])
    if str(identity.get("pretrained") or "").startswith("sha256:"):
        weights = Path(cfg.pretrained)
        if f"sha256:{file_sha256(weights)[:16]}" != identity["pretrained"]:
            raise PublishError(f"the backbone weights {weights} are not the ones the checkpoint was trained on "
                               f"({identity['pretrained']}); restore the file the run used")
        published["pretrained"] = files["pretrained"] = f"{BACKBONE_DIR}/{weights.name}"
        _copy_file(weights, out / published["pretrained"])
    return published, files


def _results_name(res: dict[str, Any], taken: set[str]) -> str:
    base = f"{res['benchmark']}-{res['split']}"
    name, n = f"{base}.json", 2
    while name in taken:
        name, n = f"{base}-{n}.json", n + 1
    taken.add(name)
    return name


def publish_checkpoint(checkpoint: str | Path, out: str | Path, card: CardOptions,
                       results: list[str] | None = None, overwrite: bool = False) -> Path:
    """Write the Hub-layout folder of ``checkpoint`` into ``out`` (layout in the module docstring).

    checkpoint: a checkpoint file, a folder demind-publish wrote, or ``hf-hub:ORG/NAME``.
    results: results.json files to put in the card (each must evaluate this checkpoint); None
    finds them under the checkpoint's run folder. The folder is built beside ``out`` and swapped
    in when complete; ``overwrite`` replaces a folder demind-publish wrote (nothing else). Returns ``out``.
    """
    out = Path(out)
    check_publish_target(out, overwrite)
    source = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_metadata(source.file)
    state = read_checked_tensors(source.file, meta)  # sha256 and finite check before anything is published
    evaluations, partial = checkpoint_evaluations(source.file, meta, results)
    with building_beside(out) as build:
        _write_folder(build, source, meta, state, evaluations, card, out.name, partial)
        swap_in(build, out)
    logger.info("published folder %s: checkpoint, backbone files, card, %d evaluation(s)", out, len(evaluations))
    return out


def run_training_config(source: CheckpointSource, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The resolved training config of the run that wrote the checkpoint, or None where none is beside it:
    a published folder's ``training_config.yaml``; a De-MINDS run's ``config.yaml`` (demind-train); a
    combiner run's ``run.json`` ``config`` (demind-train-triplets). One that cannot be read is an error
    naming it (a card must not drop the recipe without a word)."""
    folder = source.file.parent
    if source.folder is not None:
        candidates = [(folder / TRAINING_CONFIG_FILE, None)]
    elif model_kind(meta).method == "combiner":
        candidates = [(folder / TRIPLET_RUN_FILE, "config")]
    else:
        candidates = [(folder / "config.yaml", None)]
    for path, key in candidates:
        if not path.is_file():
            continue
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML reads the JSON of run.json too
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise PublishError(f"the run's training config {path} cannot be read ({str(e).splitlines()[0]}); "
                               f"restore it, or publish from a copy of the checkpoint without it") from None
        config = loaded.get(key) if key is not None and isinstance(loaded, dict) else loaded
        if not isinstance(config, dict):
            raise PublishError(f"the run's training config {path} holds no config{f' under {key!r}' if key else ''} "
                               f"(a mapping); restore it, or publish from a copy of the checkpoint without it")
        return config
    return None


def _write_folder(out: Path, source: CheckpointSource, meta: dict[str, Any], state: dict,
                  evaluations: list[tuple[Path, dict[str, Any]]], card: CardOptions, title: str,
                  partial: list[str] = ()) -> None:
    """Every file of a published folder into the (new, empty) folder ``out``; the manifest
    (config.json, listing them all) and the card last (``partial``: its notes on evaluations left out)."""
    backbone, files = _copy_backbone_files(meta, source.file, out)
    published = {**meta, "backbone_config": backbone, BACKBONE_FILES_KEY: files}
    write_checkpoint(out / CHECKPOINT_FILE, state, published)  # the same tensors; paths relative to the folder
    run_dir = source.file.parent.resolve()
    training = run_training_config(source, meta)
    if training is not None:
        training = without_local_paths(training, run_dir)
        write_text_atomic(out / TRAINING_CONFIG_FILE, yaml.safe_dump(training, sort_keys=False))
    taken: set[str] = set()
    copied = []
    for path, res in evaluations:
        rel = f"{RESULTS_DIR}/{_results_name(res, taken)}"
        write_json_atomic(out / rel, without_local_paths(res, run_dir), indent=2)
        copied.append((rel, res))
    datasets = list(card.datasets)
    shards = str((training or {}).get("data", {}).get("shards", ""))
    if is_hub_ref(shards):
        datasets.append(parse_hub_ref(shards, "data.shards").repo_id)
    text = model_card(published, copied, name=card.title(title), repo=card.repo, license=card.license,
                      tags=card.tags, datasets=list(dict.fromkeys(datasets)), training=training,
                      left_out=list(partial))
    write_text_atomic(out / CARD_FILE, text + "\n" + CARD_MARKER + "\n")
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    write_json_atomic(out / CONFIG_FILE, {
        "library_name": "demind", "format": meta["format"], "checkpoint": CHECKPOINT_FILE,
        "tensors_sha256": meta.get("tensors_sha256"), "model_config": meta["model_config"],
        "backbone_config": backbone, "backbone_identity": meta["backbone_identity"],
        "backbone_model_config": files["name"], "backbone_weights": files["pretrained"],
        "results": [rel for rel, _ in copied],
        "training_config": TRAINING_CONFIG_FILE if training is not None else None,
        PUBLISHED_FILES_KEY: sorted([*written, CONFIG_FILE])}, indent=2)


# --------------------------------------------------------------------------- intent shards


def shard_stats(shards: str | Path) -> list[dict[str, Any]]:
    """The ``_stats.json`` of every shard in the folder; a shard without one is unfinished: an error."""
    folder = Path(shards)
    tars = sorted(folder.glob("*" + SHARD_SUFFIX)) if folder.is_dir() else []
    if not tars:
        raise PublishError(f"--shards {folder} holds no .tar shards; give the folder data_gen wrote")
    missing = [t for t in tars if not stats_path(t).is_file()]
    if missing:
        raise PublishError(f"{len(missing)} shard(s) in {folder} have no _stats.json (unfinished), e.g. "
                           f"{missing[0].name}; finish the generation run (rerun it) before publishing")
    stats = [ShardOutput.of(t).load_stats() for t in tars]
    bad = [t for t, s in zip(tars, stats) if s is None]
    if bad:
        raise PublishError(f"{stats_path(bad[0])} cannot be read; rerun the generation of that shard")
    return stats


def write_dataset_card(shards: str | Path, out: str | Path, card: CardOptions) -> Path:
    """Write the dataset card of the shards in ``shards`` to ``out/README.md`` (never over a README.md
    that demind-publish did not write). Returns the card's path."""
    target = Path(out) / CARD_FILE
    if target.is_file() and CARD_MARKER not in target.read_text(encoding="utf-8"):
        raise PublishError(f"{target} exists and was not written by demind-publish; move it away first")
    text = dataset_card(shard_stats(shards), name=card.title(Path(shards).resolve().name), repo=card.repo,
                        license=card.license, tags=card.tags)
    return write_text_atomic(target, text + "\n" + CARD_MARKER + "\n")


# --------------------------------------------------------------------------- upload


def upload(folder: str | Path, repo: str, repo_type: str, *, private: bool = False,
           allow_patterns: list[str] | None = None, message: str = "Publish with demind-publish") -> str:
    """Create ``repo`` if needed and upload ``folder`` in one ``upload_folder`` commit; returns the URL.

    The token comes from where huggingface_hub looks (``HF_TOKEN``, ``hf auth login``)."""
    hub = import_hub()
    from huggingface_hub import errors

    api = hub.HfApi()
    unreachable = hub_unreachable()  # no network: one line in seconds, not retries then a traceback
    if unreachable:
        raise HubError(f"cannot reach the Hugging Face Hub to upload {folder} to {repo_type} repository {repo} "
                       f"({unreachable}); check the network connection (and HF_ENDPOINT, a proxy), then run the "
                       "same command again")
    try:
        url = api.create_repo(repo, repo_type=repo_type, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(folder), repo_type=repo_type,
                          allow_patterns=allow_patterns, commit_message=message)
    except errors.HfHubHTTPError as e:
        raise HubError(f"the Hub refused the upload to {repo_type} repository {repo} ({e}); log in with "
                       "`hf auth login` or set HF_TOKEN to a token that can write to it") from None
    except errors.HFValidationError as e:
        raise HubError(f"--repo {repo!r} is not a valid repository id ({e}); give ORG/NAME") from None
    except errors.LocalTokenNotFoundError:
        raise HubError(f"uploading to {repo_type} repository {repo} needs a Hub token: log in with `hf auth login` "
                       "or set HF_TOKEN to a token that can write to it") from None
    except Exception as e:  # noqa: BLE001 -- only a failure to reach the Hub becomes one line
        if not is_network_error(e):
            raise
        raise HubError(f"cannot reach the Hugging Face Hub to upload {folder} to {repo_type} repository {repo} "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no answer'}); check the "
                       "network connection (and HF_ENDPOINT, a proxy), then run the same command again") from None
    return str(url)


NETWORK_MODULES = ("httpx", "httpcore", "requests", "urllib", "ssl", "socket")


def is_network_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the Hub could not be reached: a connection, DNS, TLS or timeout failure
    of the HTTP client huggingface_hub uses (httpx from 1.0, requests before), or the OS's."""
    for kind in type(exc).__mro__:
        if kind.__module__.split(".")[0].rstrip("0123456789") in NETWORK_MODULES:  # httpx2, urllib3 alike
            return True
    return isinstance(exc, (ConnectionError, TimeoutError))


SHARD_UPLOAD_FILES = HUB_SHARD_FILES
"""What a shard folder's upload sends: the tars, their stats and the card (no .tmp, no feature cache)."""
