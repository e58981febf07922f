"""Every console script against malformed input of each kind it reads: a missing file, an empty
file, the wrong JSON/YAML type at each level, null and wrong-typed fields, truncated binary
state, an unreadable file (skipped when run as root, who reads it anyway), a directory where a
file is expected, an output under a file.

Each row runs the command in-process through its ``main(argv)`` and expects one of two outcomes:
``error`` -- exit status 2, no traceback, exactly one ``error:`` line on stderr that names the file
(and the line, entry or key); ``skip`` -- the bad item is skipped, counted and logged, and the rest
runs (exit 0, or 1 where the command reports partial failure). The scripts come from
``[project.scripts]`` of pyproject.toml: a new script without rows fails
:func:`test_every_console_script_has_rows`; covering it is adding rows to :data:`ROWS`.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import logging
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from pathlib import Path

import pytest
import torch

from demind.cli import common
from helpers import REPO_ROOT, TINY_CLIP

SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


class Inputs:
    """Well-formed inputs the rows break, built on first use and shared by the module."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        return path

    def folder(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @cached_property
    def a_file(self) -> Path:
        return self.write("a-file.txt", "not a folder")

    @cached_property
    def checkpoint(self) -> Path:
        """A tiny De-MINDS checkpoint whose backbone weights are in a file (every load rebuilds it)."""
        from demind.backbone import FrozenCLIP
        from demind.schema import BackboneConfig, ModelConfig
        from demind.checkpoint import save_checkpoint
        from demind.model import DeMinds

        torch.manual_seed(0)
        weights = self.root / "ckpt" / "clip.pt"
        weights.parent.mkdir(parents=True, exist_ok=True)
        torch.save(FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None)).model.state_dict(), weights)
        backbone = FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(weights)))
        model = DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16), backbone)
        return save_checkpoint(self.root / "ckpt" / "tiny.safetensors", model)

    @cached_property
    def truncated_checkpoint(self) -> Path:
        return self.write("ckpt/truncated.safetensors", self.checkpoint.read_bytes()[:200])

    @cached_property
    def gallery(self) -> Path:
        import numpy as np
        from PIL import Image

        folder = self.folder("gallery")
        for i in range(3):
            pixels = np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"img{i}.png")
        return folder

    def index(self, name: str) -> Path:
        """A fresh copy of a built index of :attr:`gallery` (rows damage their own copy)."""
        import shutil

        built = self.root / "index-built"
        if not built.is_dir():
            from demind.cli.index import main

            assert main(["--images", str(self.gallery), "--index", str(built), "--checkpoint", str(self.checkpoint),
                         "--num-workers", "0", "run.progress=false"]) == 0
        target = self.root / name
        shutil.copytree(built, target)
        return target

    @cached_property
    def coco(self) -> tuple[Path, Path, Path]:
        from toyworld.synthetic import write_synthetic_coco

        return write_synthetic_coco(self.root / "coco", 24, split="train", seed=5, write_images=True)

    def coco_variant(self, which: str, change: Callable[[dict], None]) -> Path:
        """An annotations folder with the instances or captions file of :attr:`coco` changed."""
        instances, captions, _ = self.coco
        folder = self.folder(f"coco-{which}-{len(list(self.root.glob('coco-*')))}")
        for kind, path in (("instances", instances), ("captions", captions)):
            data = json.loads(path.read_text())
            if kind == which:
                change(data)
            (folder / path.name).write_text(json.dumps(data))
        return folder

    @cached_property
    def cirr(self) -> Path:
        """A tiny CIRR root (rc2 layout): 6 images, 3 val queries."""
        import numpy as np
        from PIL import Image

        root = self.folder("cirr-built")
        images = self.folder("cirr-built/dev")
        names = [f"dev-{k}-a-img0" for k in range(6)]
        for k, name in enumerate(names):
            pixels = np.random.default_rng(k).integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(images / f"{name}.png")
        self.write("cirr-built/image_splits/split.rc2.val.json", json.dumps({n: f"./dev/{n}.png" for n in names}))
        self.write("cirr-built/captions/cap.rc2.val.json", json.dumps([
            {"pairid": k, "reference": names[k], "target_hard": names[k + 1], "caption": "make it red",
             "img_set": {"id": k, "members": names}} for k in range(3)]))
        return root

    def benchmark_variant(self, built: Path, name: str, relpath: str, change: Callable[[Any], Any] | bytes) -> Path:
        """A copy of the benchmark root ``built`` with the JSON file ``relpath`` changed: ``change`` maps
        its parsed content to the new content, or is the new bytes (a truncated file)."""
        import shutil

        target = self.root / name
        shutil.copytree(built, target)
        path = target / relpath
        path.write_bytes(change if isinstance(change, bytes) else json.dumps(change(json.loads(path.read_text()))).encode())
        return target

    @cached_property
    def fashioniq(self) -> Path:
        from test_eval_benchmarks import make_fashioniq

        return make_fashioniq(self.folder("fiq-built"))

    @cached_property
    def exclcoco_train(self) -> Path:
        from demind.exclcoco_builder import ExclCocoConfig, build_exclcoco

        instances, captions, images = self.coco
        build_exclcoco(instances, captions, self.root / "exclcoco-train", images,
                       ExclCocoConfig(caption_min_images=4), split="train")
        return self.root / "exclcoco-train"

    @cached_property
    def pair_corpus(self) -> Path:
        """Two input shards of 8 captioned random images each, the fourth image of the second corrupt."""
        import random

        from helpers import make_sample, write_input_shard

        words, rng = ["dog", "cat", "car", "tree", "house", "boat", "bird", "lamp", "red", "blue"], random.Random(0)
        folder = self.folder("pair-corpus")
        for s in range(2):
            samples = [make_sample(f"0000{s}{k:04d}", 10 * s + k, " ".join(rng.sample(words, 4))) for k in range(8)]
            if s == 1:
                samples[3]["jpg"] = b"\xff\xd8\xff not a jpeg"
            write_input_shard(folder / f"0000{s}.tar", samples)
        return folder


@dataclass
class Row:
    """One malformed input for one command.

    argv: the command line, built from the module's :class:`Inputs`. names: what the one error
    line must contain (file, line, key), from the same inputs. expect: ``"error"`` or ``"skip"``;
    for a skip, ``names`` must appear in the log and ``codes`` lists the allowed exit statuses."""

    script: str
    case: str
    argv: Callable[[Inputs], list[str]]
    names: Callable[[Inputs], list[str]] = lambda i: []
    expect: str = "error"
    codes: tuple[int, ...] = (0,)
    unreadable: bool = False  # a file without read permission: root reads it anyway, so skipped as root
    patch: Callable[[Inputs, Any], None] | None = None  # (inputs, monkeypatch): the world the row needs
    file_size_limit: int | None = None  # bytes: the command runs under `ulimit -f` (RLIMIT_FSIZE)
    id: str = field(init=False)

    def __post_init__(self) -> None:
        self.id = f"{self.script}:{self.case}"


def config_rows(script: str, extra: Callable[[Inputs], list[str]] = lambda i: []) -> list[Row]:
    """The config file every config-driven command reads: missing, a folder, not YAML, a list at the
    top, a scalar where a section belongs."""
    return [
        Row(script, "config missing", lambda i: ["--config", str(i.root / "absent.yaml"), *extra(i)],
            lambda i: ["absent.yaml"]),
        Row(script, "config is a folder", lambda i: ["--config", str(i.folder("config-dir")), *extra(i)],
            lambda i: ["config-dir"]),
        Row(script, "config not YAML", lambda i: ["--config", str(i.write("bad.yaml", "a: [\n")), *extra(i)],
            lambda i: ["bad.yaml"]),
        Row(script, "config a list", lambda i: ["--config", str(i.write("list.yaml", "- 1\n- 2\n")), *extra(i)],
            lambda i: ["list.yaml"]),
        Row(script, "config section a scalar", lambda i: ["--config", str(i.write("scalar.yaml", "run: 5\n")),
                                                          *extra(i)], lambda i: ["scalar.yaml", "run"]),
        Row(script, "config not UTF-8 (another editor's Latin-1)",
            lambda i: ["--config", str(i.write("latin1.yaml", b"run:\n  seed: 1  # r\xe9glage\n")), *extra(i)],
            lambda i: ["latin1.yaml", "UTF-8"]),
        Row(script, "config repeats a key", lambda i: ["--config", str(i.write("twice.yaml", "run:\n  seed: 1\n"
                                                                                           "run:\n  seed: 2\n")),
                                                       *extra(i)], lambda i: ["twice.yaml", "'run' appears twice"]),
    ]


CIRR_CAPTIONS = "captions/cap.rc2.val.json"


def slug(case: str) -> str:
    return case.replace(" ", "-")


def ckpt(i: Inputs) -> list[str]:
    return ["--checkpoint", str(i.checkpoint)]


ROWS: list[Row] = [
    # ------------------------------------------------------------------ training and data
    *config_rows("demind-train"),
    Row("demind-train", "shards missing",
        lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"data.shards={i.root / 'no-shards'}",
                   f"run.output_dir={i.root / 'train-run'}"], lambda i: ["no-shards"]),
    Row("demind-train", "output under a file",
        lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"run.output_dir={i.a_file / 'run'}"],
        lambda i: ["a-file.txt"]),
    Row("demind-train", "resume config.yaml not YAML",
        lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"data.shards={shards(i)}",
                   f"run.output_dir={resume_dir(i, 'resume-a', {'config.yaml': 'a: [', STATE: '{}'})}"],
        lambda i: ["resume-a", "config.yaml"]),
    Row("demind-train", "resume config.yaml a list",
        lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"data.shards={shards(i)}",
                   f"run.output_dir={resume_dir(i, 'resume-b', {'config.yaml': '- 1', STATE: '{}'})}"],
        lambda i: ["resume-b", "config.yaml"]),
    *config_rows("demind-features"),
    Row("demind-features", "shards missing", lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"),
                                                        f"data.shards={i.root / 'no-shards'}"],
        lambda i: ["no-shards"]),
    *config_rows("demind-generate"),
    Row("demind-generate", "input missing", lambda i: ["--input", str(i.root / "no-input"), "--output",
                                                       str(i.root / "gen-out"), "--dry-run"], lambda i: ["no-input"]),
    Row("demind-generate", "input is a file", lambda i: ["--input", str(i.a_file), "--output",
                                                         str(i.root / "gen-out"), "--dry-run"], lambda i: ["a-file.txt"]),
    Row("demind-generate", "shard range backwards", lambda i: ["--input", str(i.root / "no-input"), "--output",
                                                                str(i.root / "gen-out"), "--shard", "9-2", "--dry-run"],
        lambda i: ["'shard'", "9-2"]),
    Row("demind-generate", "brace pattern of 10^11 shards",
        lambda i: ["--input", str(i.root / "{0..99999999999}.tar"), "--output", str(i.root / "gen-out"), "--dry-run"],
        lambda i: ["--input", "100,000,000,000 shards"]),
    Row("demind-generate", "output folder under /proc", lambda i: ["--input", str(i.root / "no-input"), "--output",
                                                                    "/proc/demind-x", "--dry-run"],
        lambda i: ["'output'", "/proc/demind-x"]),
    *config_rows("demind-generate-triplets", lambda i: ["--pairs", str(i.root / "no-pairs"), "--output",
                                                        str(i.root / "trip-out"), "--dry-run"]),
    Row("demind-generate-triplets", "pairs folder missing",
        lambda i: ["--pairs", str(i.root / "no-pairs"), "--output", str(i.root / "trip-out"), "--dry-run"],
        lambda i: ["no-pairs", "pairs_manifest.json", "demind-mine-pairs"]),
    Row("demind-generate-triplets", "pairs manifest not JSON",
        lambda i: ["--pairs", str(i.write("bad-pairs/pairs_manifest.json", "{oops").parent), "--output",
                   str(i.root / "trip-out"), "--dry-run"], lambda i: ["bad-pairs", "pairs_manifest.json"]),
    Row("demind-generate-triplets", "pair shard range backwards",
        lambda i: ["--pairs", str(i.root / "no-pairs"), "--output", str(i.root / "trip-out"), "--shard", "9-2",
                   "--dry-run"], lambda i: ["'shard'", "9-2"]),
    Row("demind-generate-triplets", "output folder under /proc",
        lambda i: ["--pairs", str(i.root / "no-pairs"), "--output", "/proc/demind-x", "--dry-run"],
        lambda i: ["'output'", "/proc/demind-x"]),
    Row("demind-generate-triplets", "fewer than three instructions a pair",
        lambda i: ["--pairs", str(i.root / "no-pairs"), "--output", str(i.root / "trip-out"), "instructions.count=2",
                   "--dry-run"], lambda i: ["instructions.count"]),
    *config_rows("demind-make-shards"),
    Row("demind-make-shards", "captions missing",
        lambda i: ["--images", str(i.gallery), "--captions", str(i.root / "none.csv"), "--output", str(i.root / "ms")],
        lambda i: ["none.csv"]),
    Row("demind-make-shards", "captions is a folder",
        lambda i: ["--images", str(i.gallery), "--captions", str(i.folder("caps.csv")), "--output", str(i.root / "ms")],
        lambda i: ["caps.csv"]),
    Row("demind-make-shards", "captions empty",
        lambda i: ["--images", str(i.gallery), "--captions", str(i.write("empty.csv", "")), "--output",
                   str(i.root / "ms")], lambda i: ["empty.csv"]),
    Row("demind-make-shards", "captions unreadable",
        lambda i: ["--images", str(i.gallery), "--captions", str(unreadable(i, "locked.csv", "image,caption\n")),
                   "--output", str(i.root / "ms")], lambda i: ["locked.csv"], unreadable=True),
    Row("demind-make-shards", "images missing",
        lambda i: ["--images", str(i.root / "no-images"), "--captions",
                   str(i.write("ok.jsonl", '{"image": "img0.png", "caption": "a"}\n')), "--output", str(i.root / "ms")],
        lambda i: ["no-images"]),
    Row("demind-make-shards", "jsonl: null caption, wrong-typed image, not an object",
        lambda i: ["--images", str(i.gallery), "--captions", str(i.write("mixed.jsonl", "\n".join([
            '{"image": "img0.png", "caption": "a red square"}', '{"image": "img1.png", "caption": null}',
            '{"image": 5, "caption": "x"}', "[1, 2]", "{broken"]) + "\n")), "--output", str(i.root / "ms-mixed")],
        lambda i: ["mixed.jsonl:3", "mixed.jsonl:4", "mixed.jsonl:5"], expect="skip", codes=(0,)),
    # ------------------------------------------------------------------ evaluation
    *config_rows("demind-eval"),
    Row("demind-eval", "checkpoint missing",
        lambda i: ["--benchmark", "cirr", "--data-root", str(i.root), "--out", str(i.root / "ev"), "--checkpoint",
                   str(i.root / "none.safetensors")], lambda i: ["none.safetensors"]),
    Row("demind-eval", "checkpoint truncated",  # a readable benchmark: it is read before the model loads
        lambda i: ["--benchmark", "cirr", "--data-root", str(i.cirr), "--out", str(i.root / "ev"), "--checkpoint",
                   str(i.truncated_checkpoint)], lambda i: ["truncated.safetensors"]),
    Row("demind-eval", "checkpoint is a folder",  # a readable benchmark: it is read before the model loads
        lambda i: ["--benchmark", "cirr", "--data-root", str(i.cirr), "--out", str(i.root / "ev"), "--checkpoint",
                   str(i.folder("ckpt-dir.safetensors"))], lambda i: ["ckpt-dir.safetensors"]),
    Row("demind-eval", "data root missing",
        lambda i: ["--benchmark", "cirr", "--data-root", str(i.root / "no-cirr"), "--out", str(i.root / "ev"),
                   *ckpt(i)], lambda i: ["no-cirr"]),
    *[Row("demind-eval", f"CIRR {case}",
          lambda i, case=case, rel=rel, change=change: [
              "--benchmark", "cirr", "--data-root", str(i.benchmark_variant(i.cirr, f"cirr-{slug(case)}", rel, change)),
              "--out", str(i.root / "ev"), *ckpt(i)],
          lambda i, names=names: names)
      for case, rel, change, names in [
          ("captions truncated", CIRR_CAPTIONS, b'[{"pairid": 0, "refer', ["cap.rc2.val.json", "not valid JSON"]),
          ("captions an object", CIRR_CAPTIONS, lambda d: {"queries": d}, ["cap.rc2.val.json must be a list"]),
          ("entry not an object", CIRR_CAPTIONS, lambda d: [*d, 7], ["cap.rc2.val.json[3] must be an object"]),
          ("entry without reference", CIRR_CAPTIONS, lambda d: [d[0], {k: v for k, v in d[1].items() if k != "reference"}],
           ["cap.rc2.val.json[1].reference", "missing"]),
          ("null caption", CIRR_CAPTIONS, lambda d: [{**d[0], "caption": None}, *d[1:]],
           ["cap.rc2.val.json[0].caption", "got null"]),
          ("string pairid", CIRR_CAPTIONS, lambda d: [{**d[0], "pairid": "0"}, *d[1:]], ["cap.rc2.val.json[0].pairid"]),
          ("img_set without members", CIRR_CAPTIONS, lambda d: [*d[:2], {**d[2], "img_set": {"id": 2}}],
           ["cap.rc2.val.json[2].img_set.members"]),
          ("one pairid, two captions", CIRR_CAPTIONS, lambda d: [*d, {**d[0], "caption": "another text"}],
           ["cap.rc2.val.json", "pairid id"]),
          ("split a list", "image_splits/split.rc2.val.json", lambda d: list(d), ["split.rc2.val.json", "must be an object"]),
          ("split path null", "image_splits/split.rc2.val.json", lambda d: {**d, next(iter(d)): None},
           ["split.rc2.val.json", "must be a string"]),
      ]],
    *[Row("demind-eval", f"FashionIQ {case}",
          lambda i, case=case, rel=rel, change=change: [
              "--benchmark", "fashioniq", "--data-root",
              str(i.benchmark_variant(i.fashioniq, f"fiq-{slug(case)}", rel, change)), "--out", str(i.root / "ev"),
              *ckpt(i)],
          lambda i, names=names: names)
      for case, rel, change, names in [
          ("captions an object", "captions/cap.shirt.val.json", lambda d: {"q": d}, ["cap.shirt.val.json must be a list"]),
          ("candidate null", "captions/cap.shirt.val.json", lambda d: [{**d[0], "candidate": None}, *d[1:]],
           ["cap.shirt.val.json[0].candidate", "got null"]),
          ("one caption a number", "captions/cap.toptee.val.json", lambda d: [{**d[0], "captions": ["is red", 5]}, *d[1:]],
           ["two captions (strings)"]),
          ("split an object", "image_splits/split.dress.val.json", lambda d: {"ids": d}, ["split.dress.val.json"]),
      ]],
    # ------------------------------------------------------------------ search
    *config_rows("demind-index"),
    Row("demind-index", "images missing", lambda i: ["--images", str(i.root / "no-images"), "--index",
                                                     str(i.root / "ix"), *ckpt(i)], lambda i: ["no-images"]),
    Row("demind-index", "images is a file", lambda i: ["--images", str(i.a_file), "--index", str(i.root / "ix"),
                                                       *ckpt(i)], lambda i: ["a-file.txt"]),
    Row("demind-index", "index under a file", lambda i: ["--images", str(i.gallery), "--index",
                                                         str(i.a_file / "ix"), *ckpt(i)], lambda i: ["a-file.txt"]),
    Row("demind-index", "part size 0", lambda i: ["--images", str(i.gallery), "--index", str(i.root / "ix"),
                                                  "--part-size", "0", *ckpt(i)], lambda i: ["part_size"]),
    Row("demind-index", "checkpoint truncated", lambda i: ["--images", str(i.gallery), "--index", str(i.root / "ix"),
                                                           "--checkpoint", str(i.truncated_checkpoint)],
        lambda i: ["truncated.safetensors"]),
    Row("demind-index", "index.json truncated",
        lambda i: ["--images", str(i.gallery), "--index", str(damage(i.index("ix-trunc"), "index.json", b'{"form')),
                   *ckpt(i)], lambda i: ["ix-trunc", "index.json", "rebuilding the index"], expect="skip"),
    Row("demind-index", "index.json a list",
        lambda i: ["--images", str(i.gallery), "--index", str(damage(i.index("ix-list"), "index.json", b"[1, 2, 3]")),
                   *ckpt(i)], lambda i: ["ix-list", "index.json"]),
    Row("demind-index", "dangling link", lambda i: ["--images", str(dangling(i)), "--index", str(i.root / "ix-link"),
                                                    "--num-workers", "0", *ckpt(i)],
        lambda i: ["dangling.png"], expect="skip", codes=(0,)),
    *config_rows("demind-search"),
    Row("demind-search", "index missing", lambda i: ["--index", str(i.root / "no-index"), "--text", "red", *ckpt(i)],
        lambda i: ["no-index"]),
    Row("demind-search", "index.json truncated",
        lambda i: ["--index", str(damage(i.index("sx-trunc"), "index.json", b'{"form')), "--text", "red", *ckpt(i)],
        lambda i: ["sx-trunc", "index.json", "rerun demind-index"]),
    Row("demind-search", "index.json wrong-typed key",
        lambda i: ["--index", str(retype(i.index("sx-key"), "images", {})), "--text", "red", *ckpt(i)],
        lambda i: ["sx-key", "index.json", "'images'"]),
    Row("demind-search", "embedding part truncated",
        lambda i: ["--index", str(damage(i.index("sx-part"), "embeddings/part-00000.safetensors", b"PK\x03")), "--text", "red",
                   *ckpt(i)], lambda i: ["sx-part", "part-00000.safetensors", "rerun demind-index"]),
    Row("demind-search", "queries missing", lambda i: ["--index", str(i.index("sx-q1")), "--queries",
                                                       str(i.root / "none.jsonl"), *ckpt(i)], lambda i: ["none.jsonl"]),
    Row("demind-search", "queries is a folder", lambda i: ["--index", str(i.index("sx-q2")), "--queries",
                                                           str(i.folder("q.jsonl")), *ckpt(i)], lambda i: ["q.jsonl"]),
    Row("demind-search", "queries unreadable", lambda i: ["--index", str(i.index("sx-q5")), "--queries",
                                                          str(unreadable(i, "locked-q.jsonl", '{"text": "a"}\n')),
                                                          *ckpt(i)], lambda i: ["locked-q.jsonl"], unreadable=True),
    Row("demind-search", "queries empty", lambda i: ["--index", str(i.index("sx-q3")), "--queries",
                                                     str(i.write("empty.jsonl", "")), *ckpt(i)],
        lambda i: ["empty.jsonl"]),
    Row("demind-search", "query lines: null, wrong types, not JSON",
        lambda i: ["--index", str(i.index("sx-q4")), "--queries", str(i.write("bad.jsonl", "\n".join([
            json.dumps({"image": str(i.gallery / "img0.png"), "text": "make it red"}), '{"text": null}',
            '{"text": "red", "image": 5}', '{"text": "red", "negative": 7}', '{"text": "red", "k": "many"}',
            "not json", "[]"]) + "\n")), *ckpt(i)],
        lambda i: [f"bad.jsonl:{n}" for n in range(2, 8)], expect="skip", codes=(1,)),
    Row("demind-search", "output under a file", lambda i: ["--index", str(i.index("sx-out")), "--text", "red",
                                                           "--method", "text-only", "--out", str(i.a_file / "r.json"),
                                                           *ckpt(i)], lambda i: ["a-file.txt"]),
    *config_rows("demind-serve"),
    Row("demind-serve", "quickstart without search.json", lambda i: ["--quickstart", str(i.folder("qs-empty"))],
        lambda i: ["qs-empty", "search.json"]),
    Row("demind-serve", "search.json a list", lambda i: ["--quickstart", str(i.write("qs-list/search.json",
                                                                                     "[1]").parent)],
        lambda i: ["qs-list", "search.json"]),
    Row("demind-serve", "search.json truncated", lambda i: ["--quickstart", str(i.write("qs-trunc/search.json",
                                                                                        '{"form').parent)],
        lambda i: ["qs-trunc", "search.json"]),
    Row("demind-serve", "checkpoint truncated", lambda i: ["--index", str(i.root / "ix"), "--checkpoint",
                                                           str(i.truncated_checkpoint)],
        lambda i: ["truncated.safetensors"]),
    # ------------------------------------------------------------------ ExclCOCO and ExclMM
    *config_rows("demind-build-exclcoco"),
    *[Row("demind-build-exclcoco", case,
          lambda i, which=which, change=change: ["--annotations", str(i.coco_variant(which, change)), "--split", "train",
                                                 "--images", str(i.coco[2]), "--out", str(i.root / "ex-out")],
          lambda i, names=names: names)
      for case, which, change, names in [
          ("string category_id", "instances", lambda d: d["annotations"][0].update(category_id="2"),
           ["instances_train.json", "annotations[0].category_id"]),
          ("images a dict", "instances", lambda d: d.update(images={"1": "a.jpg"}), ["instances_train.json", "images must be a list"]),
          ("annotation without image_id", "instances", lambda d: d["annotations"][1].pop("image_id"),
           ["instances_train.json", "annotations[1].image_id"]),
          ("null caption", "captions", lambda d: d["annotations"][2].update(caption=None),
           ["captions_train.json", "annotations[2].caption"]),
          ("captions a list", "captions", lambda d: (d.clear(), None)[1], ["captions_train.json", "annotations"]),
      ]],
    Row("demind-build-exclcoco", "annotations missing",
        lambda i: ["--annotations", str(i.root / "no-coco"), "--split", "train", "--images", str(i.root),
                   "--out", str(i.root / "ex-out")], lambda i: ["no-coco"]),
    Row("demind-build-exclcoco", "instances empty",
        lambda i: ["--annotations", str((i.write("coco-empty/captions_train.json", ""),  # both present, one empty
                                         i.write("coco-empty/instances_train.json", ""))[1].parent), "--split", "train",
                   "--images", str(i.root), "--out", str(i.root / "ex-out")], lambda i: ["instances_train.json"]),
    *config_rows("demind-train-exclmm"),
    Row("demind-train-exclmm", "train split missing",
        lambda i: exclmm_args(i, i.root / "no-split", "exclmm-a"), lambda i: ["no-split", "exclcoco.json"]),
    Row("demind-train-exclmm", "exclcoco.json a list",
        lambda i: exclmm_args(i, i.write("split-list/exclcoco.json", "[]").parent, "exclmm-b"),
        lambda i: ["split-list", "exclcoco.json"]),
    Row("demind-train-exclmm", "features truncated",
        lambda i: exclmm_args(i, i.exclcoco_train, damage(i.folder("exclmm-c"), "features.safetensors", b"\x08\x00")),
        lambda i: ["exclmm-c", "features.safetensors"]),
    Row("demind-train-exclmm", "state truncated",
        lambda i: exclmm_args(i, i.exclcoco_train, damage(i.folder("exclmm-d"), "state.safetensors", b"\x08\x00")),
        lambda i: ["exclmm-d", "state.safetensors"]),
    Row("demind-train-exclmm", "log_every 0",
        lambda i: [*exclmm_args(i, i.exclcoco_train, "exclmm-e"), "run.log_every=0"], lambda i: ["run.log_every"]),
    Row("demind-train-exclmm", "top_t above code_dim",
        lambda i: [*exclmm_args(i, i.exclcoco_train, "exclmm-f"), "space.top_t=1000", "sae.code_dim=48"],
        lambda i: ["space.top_t", "sae.code_dim"]),
    Row("demind-train-exclmm", "image mask needs z_c",
        lambda i: [*exclmm_args(i, i.exclcoco_train, "exclmm-g"), "space.zc_mask=false",
                   "space.image_mask=zc_or_top_t"], lambda i: ["space.image_mask", "space.zc_mask"]),
    Row("demind-train-exclmm", "query space in capitals",
        lambda i: [*exclmm_args(i, i.exclcoco_train, "exclmm-h"), "query.space=CLIP"], lambda i: ["query.space"]),
    Row("demind-train-exclmm", "output under a file",
        lambda i: exclmm_args(i, i.exclcoco_train, i.write("exclmm-file", "x") / "run"),
        lambda i: ["run.output_dir", "exclmm-file"]),
    Row("demind-train-exclmm", "pickled state of an earlier version",
        lambda i: exclmm_args(i, i.exclcoco_train, damage(i.folder("exclmm-i"), "state.pt", b"old")),
        lambda i: ["state.pt", "demind-train-exclmm"]),
    *config_rows("demind-train-triplets"),
    Row("demind-train-triplets", "triplet file missing", lambda i: triplet_args(i, i.root / "no-triplets.jsonl"),
        lambda i: ["no-triplets.jsonl"]),
    Row("demind-train-triplets", "triplet line without a target",
        lambda i: triplet_args(i, i.write("trip-a/t.jsonl", '{"reference": "a.png", "modification": "x"}\n')),
        lambda i: ["t.jsonl:1", "'target'"]),
    Row("demind-train-triplets", "triplet image missing",
        lambda i: triplet_args(i, i.write("trip-b/t.csv", "reference,modification,target\ngone.png,x,gone.png\n")),
        lambda i: ["t.csv:2", "gone.png"]),
    Row("demind-train-triplets", "CIRR train captions missing",
        lambda i: triplet_args(i, i.folder("cirr-train-none"), "data.source=cirr"),
        lambda i: ["cap.rc2.train.json"]),
    Row("demind-train-triplets", "CSV quote left open",
        lambda i: triplet_args(i, i.write("trip-c/t.csv", 'reference,modification,target\na.png,x,a.png\n'
                                                           'a.png,"make it,a.png\na.png,y",a.png\n')),
        lambda i: ["t.csv:3", "quote"]),
    Row("demind-train-triplets", "one id, two triplets",
        lambda i: triplet_args(i, i.write("trip-d/t.jsonl", "".join(json.dumps(
            {"id": "q1", "reference": str(i.gallery / "img0.png"), "modification": m,
             "target": str(i.gallery / "img0.png")}) + "\n" for m in "xy"))),
        lambda i: ["t.jsonl", "'q1'"]),
    Row("demind-train-triplets", "hard noise without hard texts",
        lambda i: triplet_args(i, i.write("trip-e/t.jsonl", "".join(json.dumps(
            {"reference": str(i.gallery / "img0.png"), "modification": m,
             "target": str(i.gallery / "img0.png")}) + "\n" for m in "xy")),
            "noise.kind=hard", "noise.rate=1.0", "optim.batch_size=2"),
        lambda i: ["hard_modification"]),
    Row("demind-train-triplets", "output folder under /proc",
        lambda i: [*triplet_args(i, i.root / "no-triplets.jsonl"), "run.output_dir=/proc/demind-x"],
        lambda i: ["run.output_dir", "/proc/demind-x"]),
    Row("demind-train-triplets", "output folder a file",
        lambda i: [*triplet_args(i, i.root / "no-triplets.jsonl"), f"run.output_dir={i.a_file}"],
        lambda i: ["run.output_dir", "a-file.txt"]),
    Row("demind-train-triplets", "generated folder without its manifest",
        lambda i: triplet_args(i, i.folder("gen-triplets-empty"), "data.source=generated"),
        lambda i: ["triplets_manifest.json", "demind-generate-triplets"]),
    Row("demind-train-triplets", "MegaPairs row without q_text",
        lambda i: triplet_args(i, i.write("megapairs/rows.jsonl", '{"q_img": "a.png", "t_img": "b.png"}\n'),
                               "data.source=megapairs"),
        lambda i: ["rows.jsonl:1", "q_text"]),
    # ------------------------------------------------------------------ pair mining
    *config_rows("demind-mine-pairs", lambda i: ["--input", str(i.pair_corpus), "--output", str(i.root / "pairs-c")]),
    Row("demind-mine-pairs", "input folder without shards",
        lambda i: ["--input", str(i.folder("pairs-no-shards")), "--output", str(i.root / "pairs-a")],
        lambda i: ["pairs-no-shards", "--input"]),
    Row("demind-mine-pairs", "window upside down",
        lambda i: ["--input", str(i.pair_corpus), "--output", str(i.root / "pairs-b"), "image.low=0.9",
                   "image.high=0.5"], lambda i: ["image.low", "image.high"]),
    Row("demind-mine-pairs", "output a file",
        lambda i: ["--input", str(i.pair_corpus), "--output", str(i.a_file)], lambda i: ["a-file.txt"]),
    Row("demind-mine-pairs", "a window that keeps no pair",
        lambda i: ["--input", str(i.pair_corpus), "--output", str(i.root / "pairs-d"), "--config",
                   str(REPO_ROOT / "configs/pairs/tiny-cpu.yaml"), "run.progress=false", "caption.low=0.995",
                   "caption.high=0.999"], lambda i: ["signal caption", "0.995 < s < 0.999", "5% "]),
    Row("demind-mine-pairs", "a corrupt image in the corpus",
        lambda i: ["--input", str(i.pair_corpus), "--output", str(i.root / "pairs-e"), "--config",
                   str(REPO_ROOT / "configs/pairs/tiny-cpu.yaml"), "run.progress=false",
                   f"features.dir={i.root / 'pairs-e-features'}"],  # its own cache: the images are read here
        lambda i: ["000010003"], expect="skip", codes=(0,)),
    # ------------------------------------------------------------------ reports
    *config_rows("demind-negation-report"),
    Row("demind-negation-report", "phrasings missing", lambda i: ["--phrasings", str(i.root / "none.jsonl")],
        lambda i: ["none.jsonl"]),
    Row("demind-negation-report", "phrasings unreadable",
        lambda i: ["--phrasings", str(unreadable(i, "locked.jsonl", '{"query": "a"}\n'))], lambda i: ["locked.jsonl"],
        unreadable=True),
    Row("demind-negation-report", "phrasings line a list", lambda i: ["--phrasings", str(i.write("p1.jsonl", "[1]\n"))],
        lambda i: ["p1.jsonl:1"]),
    Row("demind-negation-report", "phrasings positive: 5", lambda i: ["--phrasings", str(i.write("p2.jsonl", json.dumps(
        {"query": "a cat", "positive": 5, "negatives": [], "cue": "control"}) + "\n"))],
        lambda i: ["p2.jsonl:1", "'positive'"]),
    Row("demind-negation-report", "phrasings not UTF-8", lambda i: ["--phrasings", str(i.write("p3.jsonl", b"\xff\xfe\n"))],
        lambda i: ["p3.jsonl:1"]),
    Row("demind-negation-report", "cirr null caption", lambda i: ["--cirr", str(i.write("cap.json", json.dumps(
        [{"pairid": 7, "caption": None}])))], lambda i: ["cap.json", "pairid 7", "'caption'"]),
    Row("demind-negation-report", "cirr a dict", lambda i: ["--cirr", str(i.write("cap2.json", "{}"))],
        lambda i: ["cap2.json"]),
    Row("demind-negation-report", "cirr entries not objects", lambda i: ["--cirr", str(i.write("cap3.json", "[1, 2]"))],
        lambda i: ["cap3.json", "entry 0"]),
    Row("demind-negation-report", "cirr is a folder", lambda i: ["--cirr", str(i.folder("cap4.json"))],
        lambda i: ["cap4.json"]),
    Row("demind-negation-report", "json under a file", lambda i: ["--json", str(i.a_file / "r.json")],
        lambda i: ["a-file.txt"]),
    Row("demind-negation-report", "json is a folder", lambda i: ["--json", str(i.folder("out.json"))],
        lambda i: ["out.json"]),
    # ------------------------------------------------------------------ tiny LLaVA for smoke runs
    *config_rows("demind-make-tiny-model", lambda i: ["--output", str(i.root / "tiny-llava")]),
    Row("demind-make-tiny-model", "output is a file", lambda i: ["--output", str(i.a_file)],
        lambda i: ["a-file.txt"]),
    Row("demind-make-tiny-model", "output under a file", lambda i: ["--output", str(i.a_file / "tiny")],
        lambda i: ["a-file.txt"]),
    Row("demind-make-tiny-model", "output folder under /proc", lambda i: ["--output", "/proc/demind-x/tiny"],
        lambda i: ["'output'", "/proc/demind-x"]),
    Row("demind-make-tiny-model", "output holds another model",
        lambda i: ["--output", str(i.write("other-model/config.json", '{"model_type": "llava"}').parent)],
        lambda i: ["'output'", "other-model", "--overwrite"]),
    Row("demind-make-tiny-model", "overwrite a folder that is not a model",
        lambda i: ["--output", str(i.write("my-notes/todo.txt", "mine").parent), "--overwrite"],
        lambda i: ["'output'", "my-notes", "LLaVA-NeXT"]),
    # ------------------------------------------------------------------ release
    *config_rows("demind-publish"),
    Row("demind-publish", "checkpoint missing", lambda i: ["--checkpoint", str(i.root / "none.safetensors"), "--out",
                                                           str(i.root / "pub-a")], lambda i: ["none.safetensors"]),
    Row("demind-publish", "checkpoint truncated", lambda i: ["--checkpoint", str(i.truncated_checkpoint), "--out",
                                                             str(i.root / "pub-b")], lambda i: ["truncated.safetensors"]),
    Row("demind-publish", "checkpoint is an empty folder", lambda i: ["--checkpoint", str(i.folder("pub-ckpt")), "--out",
                                                                      str(i.root / "pub-c")], lambda i: ["pub-ckpt"]),
    Row("demind-publish", "results not JSON", lambda i: ["--checkpoint", str(i.checkpoint), "--out", str(i.root / "pub-d"),
                                                         "--results", str(i.write("res.json", "{"))],
        lambda i: ["res.json"]),
    Row("demind-publish", "shards missing", lambda i: ["--shards", str(i.root / "no-shards"), "--out",
                                                       str(i.root / "pub-e")], lambda i: ["no-shards"]),
    *config_rows("demind-cc3m-list"),
    Row("demind-cc3m-list", "source missing", lambda i: ["--out", str(i.root / "cc-a.tsv"), "--source",
                                                         str(i.root / "none.parquet")], lambda i: ["none.parquet"]),
    Row("demind-cc3m-list", "source not parquet", lambda i: ["--out", str(i.root / "cc-b.tsv"), "--source",
                                                             str(i.write("bad.parquet", "not parquet"))],
        lambda i: ["bad.parquet"]),
    Row("demind-cc3m-list", "source without its columns", lambda i: ["--out", str(i.root / "cc-c.tsv"), "--source",
                                                                     str(parquet(i, "cols.parquet", {"url": ["u"]}))],
        lambda i: ["cols.parquet", "image_url"]),
    Row("demind-cc3m-list", "out under a file", lambda i: ["--out", str(i.a_file / "cc.tsv"), "--source", str(parquet(
        i, "good.parquet", {"image_url": ["http://x/1.jpg"], "caption": ["a cat"]}))], lambda i: ["a-file.txt"]),
    # ------------------------------------------------------------------ the toy world
    *config_rows("demind-quickstart"),
    Row("demind-quickstart", "workdir under a file", lambda i: [f"workdir={i.a_file / 'qs'}"], lambda i: ["a-file.txt"]),
    Row("demind-quickstart", "model config missing", lambda i: [f"workdir={i.root / 'qs'}",
                                                                f"backbone.model_config={i.root / 'none.json'}"],
        lambda i: ["none.json"]),
    *config_rows("demind-toy-clip"),
    Row("demind-toy-clip", "workdir under a file", lambda i: [f"workdir={i.a_file / 'tc'}"], lambda i: ["a-file.txt"]),
    Row("demind-toy-clip", "out under a file", lambda i: [f"workdir={i.root / 'tc'}", f"out={i.a_file / 'w'}"],
        lambda i: ["a-file.txt"]),
    Row("demind-toy-clip", "model config missing", lambda i: [f"workdir={i.root / 'tc'}",
                                                              f"backbone.model_config={i.root / 'none.json'}"],
        lambda i: ["none.json"]),
]


STATE = "trainer_state.json"


def shards(i: Inputs) -> Path:
    from toyworld.synthetic import write_synthetic_shards

    folder = i.root / "shards"
    if not folder.is_dir():
        write_synthetic_shards(folder, num_shards=1, samples_per_shard=4)
    return folder


def parquet(i: Inputs, name: str, columns: dict[str, list[str]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = i.root / name
    pq.write_table(pa.table(columns), path)
    return path


def resume_dir(i: Inputs, name: str, files: dict[str, str]) -> Path:
    """A training run folder whose newest checkpoint holds ``files``."""
    step = i.folder(f"{name}/checkpoints/step_5")
    for file, text in files.items():
        (step / file).write_text(text)
    return step.parents[1]


def unreadable(i: Inputs, name: str, text: str) -> Path:
    path = i.write(name, text)
    path.chmod(0)
    return path


def deny_reading_locked_files(monkeypatch) -> None:
    """Opening a ``locked*`` file (what :func:`unreadable` writes) raises the PermissionError a user
    without read permission gets: as root, chmod 0 alone would not stop the read."""
    import builtins
    import io

    real_open = io.open

    def guarded_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name.startswith("locked"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", guarded_open)
    monkeypatch.setattr(builtins, "open", guarded_open)


def damage(folder: Path, name: str, content: bytes) -> Path:
    """Overwrite ``folder/name`` with ``content`` (a truncated or foreign file); returns the folder."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return folder


def retype(index: Path, key: str, value: object) -> Path:
    """Give ``key`` of the index's index.json another JSON type; returns the index folder."""
    manifest = json.loads((index / "index.json").read_text())
    manifest[key] = value
    (index / "index.json").write_text(json.dumps(manifest))
    return index


def dangling(i: Inputs) -> Path:
    import shutil

    folder = i.root / "gallery-link"
    shutil.copytree(i.gallery, folder)
    (folder / "dangling.png").symlink_to(i.root / "gone.png")
    return folder


def exclmm_args(i: Inputs, split: Path, run: Path | str) -> list[str]:
    return ["--config", str(REPO_ROOT / "configs/exclmm/smoke.yaml"), f"backbone.name={TINY_CLIP}",
            f"data.train={split}", f"run.output_dir={i.root / run if isinstance(run, str) else run}"]


def triplet_args(i: Inputs, path: Path, *extra: str) -> list[str]:
    return [f"backbone.name={TINY_CLIP}", "backbone.pretrained=null", f"data.path={path}",
            f"run.output_dir={i.root / 'trip-out'}", "run.device=cpu", *extra]


# ------------------------------------------------------------------ journeys across boundaries


def bad_revision(i: Inputs) -> list[str]:
    return ["--checkpoint", "hf-hub:demind-test/smoke@/etc"]


def mixed_gallery(i: Inputs) -> Path:
    """A GIF, a TIFF and a caption file: the first two are indexed, the third named as skipped."""
    import numpy as np
    from PIL import Image

    folder = i.folder("gallery-mixed")
    for k, name in enumerate(("a.gif", "b.tif")):
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / name)
    (folder / "notes.txt").write_text("a caption")
    return folder


def repeated_member_shard(i: Inputs) -> Path:
    import io
    import tarfile

    folder = i.folder("gallery-tar")
    png = (i.gallery / "img0.png").read_bytes(), (i.gallery / "img1.png").read_bytes()
    with tarfile.open(folder / "00000.tar", "w") as tar:
        for data in png:
            info = tarfile.TarInfo("k0.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return folder


def another_runs_folder(i: Inputs) -> Path:
    """A training run's folder: its checkpoint and config, no demind-publish files."""
    import shutil

    run = i.folder("run-b")
    shutil.copy(i.checkpoint, run / "demind.safetensors")
    (run / "config.yaml").write_text("run:\n  seed: 2\n")
    return run


def reference_copy(i: Inputs) -> Path:
    """A copy of gallery image img1.png outside the gallery, as a user's own reference file."""
    return i.write("elsewhere/my-ref.png", (i.gallery / "img1.png").read_bytes())


def cirr_test1(i: Inputs) -> Path:
    """The tiny CIRR's images as a test1 split (no targets): 3 queries."""
    import shutil

    root = i.root / "cirr-test1"
    if not root.is_dir():
        shutil.copytree(i.cirr, root)
        names = json.loads((root / "image_splits/split.rc2.val.json").read_text())
        (root / "image_splits/split.rc2.test1.json").write_text(json.dumps(names))
        captions = json.loads((root / CIRR_CAPTIONS).read_text())
        (root / "captions/cap.rc2.test1.json").write_text(json.dumps(
            [{k: v for k, v in c.items() if k != "target_hard"} for c in captions]))
    return root


def hub_unreachable(i: Inputs, monkeypatch) -> None:
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")


def fake_accelerator(monkeypatch, distributed_type: str, processes: int) -> None:
    """accelerate.Accelerator replaced by one that reports ``distributed_type`` and ``processes``."""
    import accelerate
    from accelerate.utils import DistributedType

    class Launched:
        def __init__(self, *args, cpu: bool = False, **kwargs) -> None:
            self.distributed_type, self.num_processes = DistributedType[distributed_type], processes
            self.state = type("State", (), {"_cpu": cpu})()

    monkeypatch.setattr(accelerate, "Accelerator", Launched)


def no_gpu_for_a_gpu_launch(i: Inputs, monkeypatch) -> None:
    """Accelerate as multi_gpu.yaml sets it up where torch sees no GPU: 4 MULTI_CPU processes."""
    fake_accelerator(monkeypatch, "MULTI_CPU", 4)


def no_gpu_each_process_alone(i: Inputs, monkeypatch) -> None:
    """The same launch where Accelerate gives each of the 2 processes (WORLD_SIZE=2) a run of its own."""
    fake_accelerator(monkeypatch, "NO", 1)
    monkeypatch.setenv("WORLD_SIZE", "2")


ROWS += [
    *[Row(script, "checkpoint revision '/etc'", lambda i, extra=extra: [*extra(i), *bad_revision(i)],
          lambda i: ["checkpoint", "revision after '@'"])
      for script, extra in [
          ("demind-eval", lambda i: ["--benchmark", "cirr", "--data-root", str(i.cirr), "--out", str(i.root / "ev")]),
          ("demind-index", lambda i: ["--images", str(i.gallery), "--index", str(i.root / "ix-rev")]),
          ("demind-search", lambda i: ["--index", str(i.index("sx-rev")), "--text", "red"]),
          ("demind-serve", lambda i: ["--index", str(i.root / "ix")]),
          ("demind-publish", lambda i: ["--out", str(i.root / "pub-rev")]),
      ]],
    Row("demind-index", "GIF, TIFF and a caption file",
        lambda i: ["--images", str(mixed_gallery(i)), "--index", str(i.root / "ix-mixed"), "--num-workers", "0", *ckpt(i)],
        lambda i: ["2 images", "1 skipped", "notes.txt: not an image file (.txt)"], expect="skip"),
    Row("demind-index", "shard repeating a member name",
        lambda i: ["--images", str(repeated_member_shard(i)), "--index", str(i.root / "ix-tar"), "--num-workers", "0",
                   *ckpt(i)], lambda i: ["2 images", "another member named k0.png", "00000.tar/k0.png#2"],
        expect="skip"),
    Row("demind-search", "reference with a pixel copy in the gallery",
        lambda i: ["--index", str(i.index("sx-copy")), "--image", str(reference_copy(i)), "--text", "red",
                   "--method", "image-only", *ckpt(i)],
        lambda i: ["left out 1 pixel copy(ies) of the reference: img1.png", "--keep-reference"], expect="skip"),
    Row("demind-eval", "CIRR test1 with --limit",
        lambda i: ["--benchmark", "cirr", "--data-root", str(cirr_test1(i)), "--split", "test", "--limit", "2",
                   "--methods", "image-only", "--out", str(i.root / "ev-partial"), "--num-workers", "0",
                   "run.progress=false", *ckpt(i)],
        lambda i: ["partial-first2_cirr_test1_image-only_recall.json"], expect="skip"),
    Row("demind-index", "index over the file-size limit",
        lambda i: ["--images", str(i.gallery), "--index", str(i.root / "ix-big"), "--num-workers", "0", *ckpt(i)],
        lambda i: ["ix-big", "file too large", "ulimit -f"], file_size_limit=200),
    Row("demind-search", "out over the file-size limit",
        lambda i: ["--index", str(i.index("sx-big")), "--text", "red", "--method", "text-only", "--out",
                   str(i.root / "big-results.json"), *ckpt(i)],
        lambda i: ["big-results.json", "file too large", "ulimit -f"], file_size_limit=200),
    Row("demind-publish", "out over the file-size limit",
        lambda i: ["--checkpoint", str(i.checkpoint), "--out", str(i.root / "pub-big")],
        lambda i: ["pub-big", "file too large", "ulimit -f"], file_size_limit=200),
    Row("demind-publish", "overwrite another run's folder",
        lambda i: ["--checkpoint", str(i.checkpoint), "--out", str(another_runs_folder(i)), "--overwrite"],
        lambda i: ["run-b", "not written by demind-publish"]),
    Row("demind-publish", "out is a file", lambda i: ["--checkpoint", str(i.checkpoint), "--out", str(i.a_file)],
        lambda i: ["--out", "a-file.txt", "is a file"]),
    Row("demind-publish", "upload with the Hub unreachable",
        lambda i: ["--checkpoint", str(i.checkpoint), "--repo", "demind-test/unreachable"],
        lambda i: ["cannot reach the Hugging Face Hub", "demind-test/unreachable"], patch=hub_unreachable),
    Row("demind-train", "GPU launch on a machine without one",
        lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"data.shards={shards(i)}",
                   f"run.output_dir={i.root / 'train-gpu'}", "run.device=auto"],
        lambda i: ["no GPU", "configs/accelerate/multi_cpu.yaml", "run.device=cpu"], patch=no_gpu_for_a_gpu_launch),
    Row("demind-train", "GPU launch whose processes would each train alone",
        lambda i: ["--config", str(REPO_ROOT / "configs/train/smoke.yaml"), f"data.shards={shards(i)}",
                   f"run.output_dir={i.root / 'train-alone'}", "run.device=auto"],
        lambda i: ["started 2 processes", "configs/accelerate/multi_cpu.yaml"], patch=no_gpu_each_process_alone),
]


def limited_results(i: Inputs) -> Path:
    """The results.json of a demind-eval run of :attr:`Inputs.checkpoint` with --limit 1."""
    out = i.root / "ev-limited"
    if not (out / "results.json").is_file():
        from demind.cli.evaluate import main

        assert main(["--benchmark", "cirr", "--data-root", str(i.cirr), "--methods", "image-only", "--limit", "1",
                     "--out", str(out), "--num-workers", "0", "run.progress=false", *ckpt(i)]) == 0
    return out / "results.json"

def gallery_file_gone(i: Inputs) -> list[str]:
    """An index of a copy of :attr:`Inputs.gallery` whose img1.png and img2.png were deleted after
    indexing, and a query file: a plain query, then a +rerank one (its top 2 are the deleted files)."""
    import shutil

    from demind.cli.index import main

    gallery, index = i.root / "gallery-gone", i.root / "ix-gone"
    if not index.is_dir():
        shutil.copytree(i.gallery, gallery)
        assert main(["--images", str(gallery), "--index", str(index), "--num-workers", "0", "run.progress=false",
                     *ckpt(i)]) == 0
        (gallery / "img1.png").unlink()
        (gallery / "img2.png").unlink()
    queries = i.write("gone.jsonl", "\n".join(json.dumps({"image": str(gallery / "img0.png"), "text": "make it red",
                                                          "method": method}) for method in ("demind", "demind+rerank")))
    return ["--index", str(index), "--queries", str(queries), "engine.name=transformers",
            f"engine.model={i.root / 'no-llava-needed'}", "rerank.k=2", "run.progress=false", *ckpt(i)]

def offline_with_an_empty_hub_cache(i: Inputs, monkeypatch) -> None:
    """HF_HUB_OFFLINE=1 with a Hugging Face cache that holds nothing (a Hub id must come from the cache)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(i.folder("empty-hub-cache")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


ENGINE_MODELS = {  # an engine.model that cannot be loaded -> (value, what the error line names)
    "missing folder": (lambda i: str(i.root / "no-llava"), ["engine.model", "no-llava", "no such folder"]),
    "empty folder": (lambda i: str(i.folder("empty-llava")), ["engine.model", "empty-llava", "config.json"]),
    "Hub id not cached, offline": (lambda i: "demind-test/not-cached-llava",
                                   ["engine.model", "demind-test/not-cached-llava", "HF_HUB_OFFLINE"]),
}
ENGINE_COMMANDS = {  # a command that loads the engine -> its other arguments
    "demind-generate": lambda i: ["--config", str(REPO_ROOT / "configs/data_gen/tiny-cpu.yaml"), "--input",
                                  str(shards(i)), "--output", str(i.root / "gen-engine")],
    "demind-eval": lambda i: ["--benchmark", "cirr", "--data-root", str(i.cirr), "--out", str(i.root / "ev-engine"),
                              "--methods", "osrcir", "--num-workers", "0", "run.progress=false",
                              "engine.name=transformers", *ckpt(i)],
    "demind-search": lambda i: ["--index", str(i.index(f"sx-engine-{len(list(i.root.glob('sx-engine-*')))}")),
                                "--image", str(i.gallery / "img0.png"), "--text", "make it red", "--method", "osrcir",
                                "run.progress=false", "engine.name=transformers", *ckpt(i)],
}
ROWS += [Row("demind-eval", "METHOD+rerank without rerank.k",
             lambda i: ["--benchmark", "cirr", "--data-root", str(i.cirr), "--out", str(i.root / "ev-rerank"),
                        "--methods", "osrcir+rerank", "engine.name=transformers", *ckpt(i)],
             lambda i: ["'osrcir+rerank'", "rerank.k"])]
ROWS += [Row("demind-search", "gallery file deleted after indexing, +rerank query", gallery_file_gone,
             lambda i: ["1 of 2 queries could not be answered", "img1.png", "update the index with demind-index"],
             expect="skip", codes=(1,))]
ROWS += [Row("demind-publish", "results of a limited run",
             lambda i: ["--checkpoint", str(i.checkpoint), "--out", str(i.root / "pub-limited"), "--results",
                        str(limited_results(i))], lambda i: ["ev-limited", "results.json", "--limit 1"])]
ROWS += [Row(script, f"engine.model {case}", lambda i, args=args, model=model: [*args(i), f"engine.model={model(i)}"],
             lambda i, names=names: names, patch=offline_with_an_empty_hub_cache)
         for script, args in ENGINE_COMMANDS.items() for case, (model, names) in ENGINE_MODELS.items()]

MLLM_STORE_CASES = {  # the MLLM answer store and the re-ranking words -> (settings, what the error line names)
    "describe.store under a file": (lambda i: [f"describe.store={i.a_file / 'store'}"],
                                    ["describe.store", "a-file.txt"]),
    "describe.store's store.json a list": (lambda i: [f"describe.store={i.write('store-list/store.json', '[1]').parent}"],
                                           ["store-list", "store.json"]),
    "rerank.methods names none": (lambda i: ["rerank.k=2", "rerank.methods=,"], ["rerank.methods"]),
    "rerank.yes empty": (lambda i: ["rerank.k=2", "rerank.yes="], ["rerank.yes"]),
}
ROWS += [Row(script, case, lambda i, args=args, settings=settings: [*args(i), f"engine.model={i.root / 'no-llava'}",
                                                                    *settings(i)],
             lambda i, names=names: names)
         for script, args in ENGINE_COMMANDS.items() if script != "demind-generate"
         for case, (settings, names) in MLLM_STORE_CASES.items()]


def weights_gone(i: Inputs) -> Path:
    """A checkpoint whose backbone weights file was deleted after training (nowhere to be found)."""
    from demind.backbone import FrozenCLIP
    from demind.checkpoint import save_checkpoint
    from demind.model import DeMinds
    from demind.schema import BackboneConfig, ModelConfig

    folder = i.folder("ckpt-weights-gone")
    torch.save(FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=None)).model.state_dict(), folder / "gone.pt")
    backbone = FrozenCLIP(BackboneConfig(name=str(TINY_CLIP), pretrained=str(folder / "gone.pt")))
    path = save_checkpoint(folder / "tiny.safetensors", DeMinds(ModelConfig(num_queries=2, num_blocks=1, num_heads=4,
                                                                             mapping_hidden=16), backbone))
    (folder / "gone.pt").unlink()
    return path


def without_vllm(i: Inputs, monkeypatch) -> None:
    import demind.cli.model_options as model_options

    monkeypatch.setattr(model_options, "vllm_installed", lambda: False)


ROWS += [
    Row("demind-serve", "more threads than can start", lambda i: ["--index", str(i.root / "ix"), *ckpt(i), "--threads",
                                                                  "100000"], lambda i: ["threads", "100000"]),
    Row("demind-serve", "a timeout beyond a lock's longest wait", lambda i: ["--index", str(i.root / "ix"), *ckpt(i),
                                                                             "--timeout", "1e12"],
        lambda i: ["timeout", "1000000000000.0"]),
    Row("demind-serve", "--images of another folder than the index's",
        lambda i: ["--images", str(i.write("gallery-other/a.png", (i.gallery / "img0.png").read_bytes()).parent),
                   "--index", str(i.index("sv-other")), "run.progress=false", *ckpt(i)],
        lambda i: ["sv-other", "--new-folder"]),
    Row("demind-index", "the index is the image folder",
        lambda i: ["--images", str(i.write("gallery-self/a.png", (i.gallery / "img0.png").read_bytes()).parent),
                   "--index", str(i.root / "gallery-self"), *ckpt(i)], lambda i: ["gallery-self", "image folder"]),
    Row("demind-publish", "the backbone weights file is gone",
        lambda i: ["--checkpoint", str(weights_gone(i)), "--out", str(i.root / "pub-gone")],
        lambda i: ["gone.pt", "put that file back"]),
    *[Row(script, "engine.name=vllm without the vLLM package", lambda i, args=args: [*args(i), "engine.name=vllm",
                                                                                       "engine.model=some/llava"],
          lambda i: ["engine.name", "vLLM package"], patch=without_vllm)
      for script, args in [*((s, a) for s, a in ENGINE_COMMANDS.items() if s != "demind-generate"),
                           ("demind-serve", lambda i: ["--index", str(i.root / "ix"), *ckpt(i)])]],
]


@contextlib.contextmanager
def file_size_limit(limit: int | None):
    """Run the block as under ``ulimit -f`` (Python ignores SIGXFSZ: a write past it fails with EFBIG)."""
    if limit is None:
        yield
        return
    import resource

    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    return Inputs(tmp_path_factory.mktemp("sweep"))


@pytest.fixture(autouse=True)
def quiet_and_single_threaded(monkeypatch):
    monkeypatch.delenv(common.DEBUG_ENV, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def command_main(script: str) -> Callable[[list[str]], int]:
    module, name = SCRIPTS[script].split(":")
    return getattr(importlib.import_module(module), name)


# a clause that names another tool: the flags after it are that tool's ("demind-index --images DIR", "pip install")
OTHER_TOOL = re.compile(r"demind-[a-z-]+|python -m|python \S+\.py|pip install|setup\.sh|accelerate|torchrun|"
                        r"img2dataset|\bgit\b")


def flags_named(message: str) -> list[str]:
    """The ``--flags`` a message tells the user to give to the command it came from: every ``--flag``
    except those in a clause (after the last ``;``, ``:``, ``(`` or sentence end) naming another tool."""
    named = []
    for match in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]*", message):
        clause = re.split(r"[;:(]|\. ", message[:match.start()])[-1]
        if not OTHER_TOOL.search(clause):
            named.append(match.group(0))
    return named


def command_flags(script: str) -> set[str] | None:
    """Every option string of the command's parser (None: a command without ``build_parser``)."""
    module = importlib.import_module(SCRIPTS[script].split(":")[0])
    if not hasattr(module, "build_parser"):
        return None
    return {option for action in module.build_parser()._actions for option in action.option_strings} | {"--debug"}


def test_every_console_script_has_rows():
    assert sorted(SCRIPTS) == sorted({row.script for row in ROWS})


def record_line(row: Row, status: int, err: str, inputs: Inputs) -> None:
    """Append ``id<TAB>status<TAB>first error: line`` to the file ``DEMIND_SWEEP_LINES`` names (if set),
    with the inputs' folder written ``<inputs>``: two runs' files compare the command's answers line by line."""
    target = os.environ.get("DEMIND_SWEEP_LINES")
    if not target:
        return
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    first = (errors[0] if errors else "-").replace(str(inputs.root), "<inputs>")
    with open(target, "a", encoding="utf-8") as file:
        file.write(f"{row.id}\t{status}\t{first}\n")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_bad_input(row: Row, inputs: Inputs, capsys, caplog, monkeypatch):
    if row.script == "demind-serve":  # a row that got past its inputs must not block on a server
        import demind.search.server as server

        monkeypatch.setattr(server, "start_server", lambda *a, **k: pytest.fail("the bad input was served"))
        monkeypatch.setattr(server.guard, "bind_problem", lambda host, port: None)  # port 8000 may be taken here
    argv = row.argv(inputs)
    if row.unreadable and os.geteuid() == 0:
        deny_reading_locked_files(monkeypatch)  # root reads files without read permission
    if row.patch is not None:
        row.patch(inputs, monkeypatch)
    capsys.readouterr()
    with caplog.at_level(logging.INFO), file_size_limit(row.file_size_limit):
        status = command_main(row.script)(argv)
    captured = capsys.readouterr()
    record_line(row, status, captured.err, inputs)
    names = row.names(inputs)
    assert "Traceback" not in captured.err
    if row.expect == "error":
        errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
        assert status == 2, f"exit {status}; stderr: {captured.err[-800:]}"
        assert len(errors) == 1, captured.err
        for name in names:
            assert name in errors[0], f"{name!r} not in {errors[0]!r}"
        flags = command_flags(row.script)  # an error that names a flag names one this command has
        if flags is not None:
            assert set(flags_named(errors[0])) <= flags, f"{row.script} has no {set(flags_named(errors[0])) - flags}"
    else:
        assert status in row.codes, f"exit {status}; stderr: {captured.err[-800:]}"
        said = caplog.text + captured.out + captured.err
        for name in names:
            assert name in said, f"the skip of {name!r} was not reported"
