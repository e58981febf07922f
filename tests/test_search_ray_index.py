"""The index's features encoded on a local Ray cluster (``demind-index --distributor ray``) against
a local build.

One Ray cluster (2 CPUs) serves the whole module; each worker loads the tiny CLIP of the
checkpoint fixture from its file. Units (a tar shard's members, runs of loose files) come back in
any order, but the driver puts this run's parts in unit order, so the index equals a local
build's name for name and row for row; a rerun encodes nothing; a worker that dies mid-unit
loses nothing (the unit is retried elsewhere), and with one try the unit is reported, the others
stay cached, and the rerun encodes only that unit.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="needs Ray: pip install -e '.[distributed]' (or pip install ray)")

from demind.cli.index import main as index_main  # noqa: E402
from demind.distributed import RayOptions  # noqa: E402
from demind.search import ray_index  # noqa: E402
from demind.search.index import build_index, load_index  # noqa: E402
from demind.search.ray_index import BackboneSource, UnitsFailedError, build_index_on_ray, plan_units  # noqa: E402
from demind.retrieval import ImageFeatureCache, ImageRef  # noqa: E402
from test_search import write_image, write_shard  # noqa: E402

LOCAL = {"batch_size": 2, "part_size": 3, "num_workers": 0, "progress": False}
INDEXED, UNREADABLE = 10, ["broken.png", "shards/00000.tar/k9.jpg"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the Ray workers (OMP_NUM_THREADS=1 for a 1-CPU actor): the same rows
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local 2-CPU Ray cluster for the module."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> Path:
    """Loose files (one broken, one in a subfolder), a tar shard (one member not an image), a note."""
    root = tmp_path_factory.mktemp("g") / "gallery"
    for i in range(6):
        write_image(root / f"img{i}.png", i)
    write_image(root / "sub" / "deep.jpg", 99)
    (root / "broken.png").write_bytes(b"broken")
    (root / "notes.txt").write_text("not an image")
    members = {f"k{i}.png": write_image(root.parent / "src" / f"k{i}.png", 70 + i).read_bytes() for i in range(3)}
    write_shard(root / "shards" / "00000.tar", {**members, "k9.jpg": b"not a jpeg"})
    return root


@pytest.fixture(scope="module")
def local_index(gallery, tiny_checkpoint, tmp_path_factory) -> Path:
    """The reference: the same gallery built locally."""
    backbone = BackboneSource(str(tiny_checkpoint)).load("cpu")
    index = tmp_path_factory.mktemp("local") / "index"
    assert build_index(gallery, index, backbone, **LOCAL).indexed == INDEXED
    return index


def ray_argv(gallery: Path, index: Path, checkpoint: Path, *extra: str) -> list[str]:
    return ["--images", str(gallery), "--index", str(index), "--checkpoint", str(checkpoint), "--batch-size", "2",
            "--part-size", "3", "--num-workers", "0", "run.progress=false", "run.device=cpu",
            "--distributor", "ray", "--workers", "2", *extra]


def assert_same_index(index: Path, reference: Path) -> None:
    """Name for name, row for row (same device and precision: the same bits), the same unreadable files."""
    a, b = load_index(index), load_index(reference)
    assert a.names == b.names
    assert torch.equal(a.features, b.features)
    unreadable = [json.loads((i / "index.json").read_text())["unreadable"] for i in (index, reference)]
    assert unreadable[0] == unreadable[1] and sorted(unreadable[0]) == UNREADABLE


def dies_once(marker: Path) -> type:
    """An IndexWorker whose first ``run``, on any worker, kills its process (a crashed node): a
    class made here is shipped to the workers by value."""
    marker = str(marker)

    class DiesOnce(ray_index.IndexWorker):
        def run(self, unit):
            import os

            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return super().run(unit)
            os._exit(1)

    return DiesOnce


def test_ray_build_equals_a_local_build_and_a_rerun_encodes_nothing(ray_cluster, gallery, local_index, tiny_checkpoint,
                                                                   tmp_path, capsys):
    index = tmp_path / "index"
    assert index_main(ray_argv(gallery, index, tiny_checkpoint)) == 0
    out = capsys.readouterr().out
    assert f"{INDEXED} images ({INDEXED} encoded" in out and "2 unreadable" in out and "broken.png" in out, out
    assert_same_index(index, local_index)
    parts = sorted(p.name for p in (index / "embeddings").glob("part-*.json"))
    assert len(parts) == 5  # one per unit: 3 runs of loose files, the shard, sub/deep.jpg (broken.png: unreadable)

    assert index_main(ray_argv(gallery, index, tiny_checkpoint)) == 0
    assert f"{INDEXED} images (0 encoded, {INDEXED} reused" in capsys.readouterr().out
    assert sorted(p.name for p in (index / "embeddings").glob("part-*.json")) == parts


def test_an_update_on_ray_encodes_only_the_new_file_and_equals_a_local_update(ray_cluster, gallery, tiny_checkpoint,
                                                                            local_index, tmp_path, caplog):
    here = tmp_path / "gallery"
    shutil.copytree(gallery, here)
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    shutil.copytree(local_index, local)
    backbone = BackboneSource(str(tiny_checkpoint)).load("cpu")
    build_index(here, local, backbone, new_root=True, **LOCAL)
    shutil.copytree(local, on_ray)
    write_image(here / "img9.png", 9)
    (here / "img0.png").unlink()
    options = RayOptions(workers=2, name_prefix="demind-index")
    with caplog.at_level("INFO", logger="demind.search.ray_index"):
        stats = build_index_on_ray(here, on_ray, BackboneSource(str(tiny_checkpoint)), options, batch_size=2,
                                   part_size=3, progress=False, device="cpu")
    assert (stats.encoded, stats.cached, stats.removed, stats.indexed) == (1, INDEXED - 1, 1, INDEXED)
    assert "ray: 1 worker(s)" in caplog.text and "for 1 image(s) in 1 unit(s)" in caplog.text  # the new file only
    build_index(here, local, backbone, **LOCAL)
    assert_same_index(on_ray, local)


def test_a_unit_whose_worker_died_is_retried_on_another_worker(ray_cluster, gallery, local_index, tiny_checkpoint,
                                                              tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(ray_index, "IndexWorker", dies_once(tmp_path / "died"))
    options = RayOptions(workers=2, name_prefix="demind-index")
    with caplog.at_level("WARNING"):
        stats = build_index_on_ray(gallery, tmp_path / "index", BackboneSource(str(tiny_checkpoint)), options,
                                   batch_size=2, part_size=3, progress=False, device="cpu")
    assert (tmp_path / "died").exists() and (stats.encoded, stats.indexed) == (INDEXED, INDEXED)
    assert "1 unit(s) done after a failed try" in caplog.text and "died" in caplog.text, caplog.text
    assert_same_index(tmp_path / "index", local_index)


@pytest.mark.slow
def test_a_unit_that_fails_its_last_try_is_reported_and_the_rerun_encodes_only_it(ray_cluster, gallery, local_index,
                                                                                tiny_checkpoint, tmp_path,
                                                                                monkeypatch, capsys):
    index = tmp_path / "index"
    with monkeypatch.context() as patch:
        patch.setattr(ray_index, "IndexWorker", dies_once(tmp_path / "died"))
        assert index_main(ray_argv(gallery, index, tiny_checkpoint, "--shard-attempts", "1")) == 1
    out = capsys.readouterr().out
    assert "1 of 5 unit(s) could not be encoded on Ray" in out and "1 tries: worker" in out, out
    assert not (index / "index.json").exists() and len(list((index / "embeddings").glob("part-*.json"))) == 4
    stats = build_index_on_ray(gallery, index, BackboneSource(str(tiny_checkpoint)),
                               RayOptions(workers=2, name_prefix="demind-index"), batch_size=2, part_size=3,
                               progress=False, device="cpu")
    assert 0 < stats.encoded <= 3 and stats.encoded + stats.cached == INDEXED  # only the failed unit's images
    a, b = load_index(index), load_index(local_index)  # a resumed build: the failed unit's rows come last
    assert sorted(a.names) == sorted(b.names)
    rows = dict(zip(b.names, b.features))
    assert all(torch.equal(row, rows[name]) for name, row in zip(a.names, a.features))


def test_units_keep_a_shard_together_and_split_runs_of_files(tmp_path):
    shard = tmp_path / "s.tar"
    refs = ([ImageRef(f"a{i}.png", tmp_path / f"a{i}.png") for i in range(4)]
            + [ImageRef(f"s.tar/m{i}.png", shard, span=(512 * i, 10)) for i in range(5)]
            + [ImageRef("z.png", tmp_path / "z.png")])
    units = plan_units(refs, part_size=3)
    assert [[r.name for r in u.refs] for u in units] == [
        ["a0.png", "a1.png", "a2.png"], ["a3.png"], [f"s.tar/m{i}.png" for i in range(5)], ["z.png"]]
    assert [u.unit_id for u in units] == [0, 1, 2, 3] and units[2].label == str(shard)
    assert [r for u in units for r in u.refs] == refs  # in unit order: the listing order


def test_a_file_the_worker_cannot_read_is_reported_not_awaited(gallery, tiny_checkpoint, tmp_path):
    """The worker's ``run`` in this process: a file gone (not on this node's filesystem) is unreadable."""
    source = BackboneSource(str(tiny_checkpoint))
    backbone = source.load("cpu")
    form = ImageFeatureCache.at(tmp_path, dtype=torch.float16, normalise=True)
    from demind.embedding_cache import cache_identity

    worker = ray_index.IndexWorker(source, cache_identity(backbone), "cpu", 2, 0, form)
    refs = [ImageRef("img1.png", gallery / "img1.png"), ImageRef("gone.png", tmp_path / "gone.png")]
    result = worker.run(ray_index.IndexUnit(0, "two files", tuple(refs)))
    assert result.names == ["img1.png"] and list(result.unreadable) == ["gone.png"]
    assert "gone.png" in result.unreadable["gone.png"] and result.rows.dtype == torch.float16
    assert torch.allclose(result.rows.float().norm(dim=-1), torch.ones(1), atol=1e-3)
    assert not list(tmp_path.glob("embeddings"))  # a worker writes nothing


def test_without_ray_the_command_names_the_install_line(gallery, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray gives
    assert index_main(ray_argv(gallery, tmp_path / "index", tiny_checkpoint)) == 2
    err = capsys.readouterr().err
    assert "pip install 'demind[distributed]'" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "index").exists()


def test_ray_settings_without_ray_distributor_are_refused(gallery, tiny_checkpoint, tmp_path, capsys):
    argv = ray_argv(gallery, tmp_path / "index", tiny_checkpoint)
    assert index_main(argv[:argv.index("--distributor")] + ["--workers", "2"]) == 2
    assert "workers" in capsys.readouterr().err


def test_parts_that_arrived_out_of_order_are_put_in_unit_order(tmp_path):
    """Units come back in any order; this run's parts are rewritten in unit order after the others."""
    from demind.search.index import ROLE

    cache = ImageFeatureCache.at(tmp_path, dtype=torch.float16, normalise=True)
    earlier = cache.write_part(ROLE, ["old.png"], ["k-old"], torch.ones(1, 4, dtype=torch.float16))
    rows = {u: torch.full((2, 4), float(u), dtype=torch.float16) for u in range(3)}
    written = {u: (cache.write_part(ROLE, [f"u{u}a", f"u{u}b"], [f"k{u}a", f"k{u}b"], rows[u]), 2) for u in (2, 0, 1)}
    ray_index._in_unit_order(cache, written, {"name": "tiny"})
    parts = cache.read_parts(ROLE)
    assert [p["names"] for p in parts] == [["old.png"], ["u0a", "u0b"], ["u1a", "u1b"], ["u2a", "u2b"]]
    assert all(torch.equal(p["features"], rows[u]) for u, p in enumerate(parts[1:]))
    assert earlier.is_file() and len(list((tmp_path / ROLE).glob("part-*"))) == 8  # the arrival-order parts are gone
