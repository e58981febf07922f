"""``run.query_mode`` on the commands that compose queries (eval, search, serve): applied to the
loaded checkpoint, refused in one line where it would do nothing, and (slow: inductor compiles)
the compiled command ranks as the eager one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from demind.cli.search import main as search_main
from test_search import one_torch_thread  # noqa: F401  (module fixture: one torch thread)
from test_serve_ranker_line import index_dir, serve_without_serving  # noqa: F401  (fixture, helper)


def write_gallery(folder: Path, n: int = 5) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


def query_args(index: Path, image: Path, *extra: str) -> list[str]:
    return ["--index", str(index), "--image", str(image), "--text", "make it red", "-k", "5", *extra]


def test_query_mode_is_refused_where_it_would_do_nothing(tmp_path, tiny_checkpoint, capsys):
    image = write_gallery(tmp_path / "g") / "img0.png"
    # no checkpoint: no De-MINDS query to compile
    assert search_main(query_args(tmp_path / "idx", image, "--backbone", "ViT-B-32:none",
                                  "run.query_mode=compile")) == 2
    err = capsys.readouterr().err.strip().splitlines()  # refused with the config, before the index or any model
    assert len(err) == 1 and err[0].startswith("error: invalid config: config key 'run.query_mode'")
    assert ("run.query_mode=compile speeds up a checkpoint's queries and no --checkpoint was given: leave "
            "run.query_mode=eager") in err[0]
    # CUDA graphs on a CPU would silently run without graphs
    assert search_main(query_args(tmp_path / "idx", image, "--checkpoint", str(tiny_checkpoint),
                                  "run.device=cpu", "run.query_mode=cudagraphs")) == 2
    assert ("run.query_mode=cudagraphs replays CUDA graphs and needs run.device=cuda; on a CPU use "
            "run.query_mode=compile") in capsys.readouterr().err.strip().splitlines()[-1]
    assert search_main(query_args(tmp_path / "idx", image, "run.query_mode=fast")) == 2
    assert "run.query_mode" in capsys.readouterr().err


def test_demind_index_has_no_query_mode(tmp_path, tiny_checkpoint, capsys):
    """demind-index composes no query: the key is unknown there, not silently ignored."""
    from demind.cli.index import main as index_main

    gallery = write_gallery(tmp_path / "g")
    assert index_main(["--images", str(gallery), "--index", str(tmp_path / "idx"), "--checkpoint",
                       str(tiny_checkpoint), "run.query_mode=compile"]) == 2
    assert "run.query_mode" in capsys.readouterr().err


def test_a_missing_cpp_compiler_is_one_line(tiny_checkpoint, monkeypatch):
    from torch._inductor import cpp_builder

    from demind.checkpoint import load_backbone_and_model
    from demind.errors import InputError

    _, model = load_backbone_and_model(tiny_checkpoint)

    def no_compiler():
        raise RuntimeError("Unsupported compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(InputError, match="no C.. compiler was found .*install one .* or use query_mode=eager"):
        model.set_query_mode("compile")
    assert model.backbone.text_layers.__name__ == "text_layers"  # nothing was half-applied


@pytest.mark.slow
def test_compiled_search_ranks_as_eager_search(tmp_path, tiny_checkpoint, capsys):
    """demind-search with run.query_mode=compile (inductor, frozen weights on the CPU) returns the
    eager command's ranking, scores within float rounding."""
    from demind.cli.index import main as index_main

    gallery = write_gallery(tmp_path / "g", 7)
    assert index_main(["--images", str(gallery), "--index", str(tmp_path / "idx"), "--checkpoint",
                       str(tiny_checkpoint)]) == 0
    results = {}
    for mode in ("eager", "compile"):
        out = tmp_path / f"{mode}.json"
        assert search_main(query_args(tmp_path / "idx", gallery / "img2.png", "--checkpoint", str(tiny_checkpoint),
                                      "--out", str(out), f"run.query_mode={mode}")) == 0
        results[mode] = json.loads(out.read_text())["queries"][0]["results"]
    capsys.readouterr()
    assert len(results["eager"]) == 5
    assert [r["name"] for r in results["compile"]] == [r["name"] for r in results["eager"]]
    np.testing.assert_allclose([r["score"] for r in results["compile"]], [r["score"] for r in results["eager"]],
                               rtol=0, atol=1e-5)


def test_serve_compiles_the_query_before_it_serves(monkeypatch, capsys, index_dir, tiny_checkpoint):
    """demind-serve with a compiled query mode runs one warm-up query of each kind before the server
    starts, so a user's first query does not outlast --timeout while it compiles."""
    pytest.importorskip("flask", reason="flask not installed (optional extra 'search')")
    from demind.model import DeMinds

    events = []
    monkeypatch.setattr(DeMinds, "set_query_mode", lambda self, mode, backend="inductor": events.append(mode))
    real_warm_up = DeMinds.warm_up
    monkeypatch.setattr(DeMinds, "warm_up", lambda self: (events.append("warm_up"), real_warm_up(self))[1])
    serve_without_serving(monkeypatch, ["--index", str(index_dir), "--checkpoint", str(tiny_checkpoint),
                                        "run.query_mode=compile", "run.progress=false"])
    assert events == ["compile", "warm_up"]
    out = capsys.readouterr().out
    assert out.index("compiling the query (run.query_mode=compile") < out.index("demind search: ")
