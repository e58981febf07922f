"""``demind-publish``: a checkpoint or intent shards as a Hugging Face Hub repository, with its card.

    demind-publish --checkpoint runs/paper/demind.safetensors --out release/demind-vitl14
    demind-publish --checkpoint runs/paper/demind.safetensors --repo ORG/demind-vitl14
    demind-publish --shards data/intent-cc3m --repo ORG/intent-cc3m --repo-type dataset

A checkpoint becomes a folder in the Hub's layout (checkpoint, config, model card with the run's
evaluation tables); ``--out`` writes it, ``--repo`` uploads it (one ``upload_folder`` call; the token
from ``HF_TOKEN`` or ``hf auth login``) and prints the URL. Intent shards get a dataset card
(``README.md`` in the shard folder) and are uploaded where they lie; ``--out`` writes only the card
there instead. Anyone then loads ``hf-hub:ORG/NAME`` with any ``--checkpoint`` or ``data.shards``.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import setting

DEFAULT_LICENSE = {"model": "apache-2.0", "dataset": "other"}


@dataclass
class PublishConfig:
    checkpoint: str | None = setting(None, input="path", help="De-MINDS checkpoint to publish (a run's demind.safetensors, a "
                                               "folder demind-publish wrote, or hf-hub:ORG/NAME)")
    shards: str | None = setting(None, input="dir", help="folder of intent shards (with their _stats.json) to publish")
    out: str | None = setting(None, output="dir", help="write the folder (checkpoint) or the card (shards) here")
    repo: str | None = setting(None, free="ORG/NAME on the Hub, checked by the Hub on upload", help="ORG/NAME: upload to this Hub repository (created if missing)")
    repo_type: str | None = setting(None, choices=("model", "dataset"),
                                    help="model for --checkpoint, dataset for --shards (the default for each)")
    results: list[str] | None = setting(None, input="file", help="results.json files of demind-eval for the card (default: every "
                                                   "one under the checkpoint's run folder that evaluated it)")
    license: str | None = setting(None, free="a licence id written into the card", help="card licence (default apache-2.0 for a model, other for shards)")
    tags: list[str] = setting(default_factory=list, free="card tags, written as given", help="extra card tags")
    datasets: list[str] = setting(default_factory=list, free="Hub dataset ids, written into the card", help="Hub datasets the model was trained on (ORG/NAME)")
    private: bool = setting(False, help="create the repository as private")
    overwrite: bool = setting(False, help="replace a folder demind-publish wrote before at --out (refused when it "
                                          "holds any file demind-publish did not write; built beside, then swapped)")

    def kind(self) -> str:
        return "dataset" if self.shards else "model"

    def config_problems(self) -> list[tuple[str, str]]:
        if bool(self.checkpoint) == bool(self.shards):
            return [("checkpoint", "give exactly one of --checkpoint CKPT and --shards DIR")]
        if not self.out and not self.repo:
            return [("out", "give --out DIR (write the folder) and/or --repo ORG/NAME (upload it)")]
        if self.repo_type and self.repo_type != self.kind():
            what = "--shards" if self.shards else "--checkpoint"
            return [("repo_type", f"= {self.repo_type!r} does not fit {what}: use --repo-type {self.kind()}")]
        if self.repo and self.repo.count("/") != 1:
            return [("repo", f"= {self.repo!r}: give ORG/NAME")]
        if self.results is not None and self.shards:
            return [("results", "goes with --checkpoint (a dataset card has no evaluation table)")]
        return []


FLAGS = {f"--{key.replace('_', '-')}": Flag(key) for key in (
    "checkpoint", "shards", "out", "repo", "repo_type", "license", "private", "overwrite")}
FLAGS.update({"--results": Flag("results", many=True), "--tags": Flag("tags", many=True),
              "--datasets": Flag("datasets", many=True)})


def build_parser():
    return config_parser(PublishConfig, "demind-publish", __doc__.split("\n\n")[0], FLAGS)


def publish_command(cfg: PublishConfig) -> int:
    """Write the folder or card, upload when --repo is given; print what was written and the URL."""
    from demind.release.publish import SHARD_UPLOAD_FILES, CardOptions, publish_checkpoint, upload, write_dataset_card

    kind = cfg.kind()
    card = CardOptions(repo=cfg.repo, license=cfg.license or DEFAULT_LICENSE[kind], tags=cfg.tags,
                       datasets=cfg.datasets)
    if kind == "dataset":
        target = cfg.out or cfg.shards
        print(f"dataset card: {write_dataset_card(cfg.shards, target, card)}")
        if cfg.repo:
            if cfg.out:  # the card must travel with the shards: write it there too
                write_dataset_card(cfg.shards, cfg.shards, card)
            url = upload(cfg.shards, cfg.repo, kind, private=cfg.private, allow_patterns=SHARD_UPLOAD_FILES)
            print(f"uploaded {cfg.shards} to {url}")
        return 0
    with tempfile.TemporaryDirectory(prefix="demind-publish-") as staging:
        # without --out the folder is built in a temporary place, uploaded, then removed
        folder = publish_checkpoint(cfg.checkpoint, cfg.out or Path(staging) / "folder", card, cfg.results,
                                    cfg.overwrite)
        if cfg.out:
            print(f"published folder: {folder}")
        if cfg.repo:
            print(f"uploaded {folder if cfg.out else 'the folder'} to {upload(folder, cfg.repo, kind, private=cfg.private)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``demind-publish``: see the module docstring; returns the exit status (2: bad input)."""
    return run_config_command(PublishConfig, build_parser(), publish_command, argv)


if __name__ == "__main__":
    sys.exit(main())
