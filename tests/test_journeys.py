"""Journeys across boundaries, as a new user meets them: photos from a phone, a tar with a repeated
name, a model published on one machine and loaded on another, an editor's config, a malformed
reference. Each test is one case of issue 38 and failed on the code before it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import REPO_ROOT, TINY_CLIP


# --------------------------------------------------------------------------- configs from other editors


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file(tmp_path, capsys):
    from demind.cli.index import main

    config = tmp_path / "latin1.yaml"
    config.write_bytes("run:\n  device: cpu  # r\xe9glage\n".encode("latin-1"))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1
    assert "latin1.yaml" in err and "UTF-8" in err


def test_a_yaml_config_repeating_a_key_is_refused_naming_key_file_and_lines(tmp_path):
    from demind.cli.search import SearchConfig
    from demind.config import ConfigError, load_config

    config = tmp_path / "twice.yaml"
    config.write_text("k: 5\nrun:\n  device: cpu\nk: 7\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml.*'k' appears twice \(lines 1 and 4\)"):
        load_config(SearchConfig, config)
    config.write_text("run:\n  device: cpu\n  device: cuda\n")
    with pytest.raises(ConfigError, match=r"'device' appears twice \(lines 2 and 3\)"):
        load_config(SearchConfig, config)


# --------------------------------------------------------------------------- malformed references


@pytest.mark.parametrize("revision", ["/etc", "../../x", "a\x01b", "main/", "a..b", "x y", "a:b"])
def test_a_hub_revision_outside_the_ref_grammar_names_the_setting(revision):
    from demind.hubref import HubError, parse_hub_ref

    with pytest.raises(HubError, match=r"^checkpoint=.*revision after '@'"):
        parse_hub_ref(f"hf-hub:a/b@{revision}", "checkpoint")


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "0123456789abcdef0123456789abcdef01234567"])
def test_git_refs_and_commits_stay_valid_revisions(revision):
    from demind.hubref import parse_hub_ref

    assert parse_hub_ref(f"hf-hub:a/b@{revision}", "checkpoint").revision == revision
