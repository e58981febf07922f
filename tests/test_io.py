"""Atomic writes: a failed write leaves the old file and no temp file behind."""

from __future__ import annotations

import json

import numpy as np
import pytest

from demind.io import atomic_path, write_json_atomic, write_text_atomic


def test_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = write_text_atomic(tmp_path / "sub" / "a.txt", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert path.read_text() == "old" and not (tmp_path / "sub" / "a.txt.tmp").exists()


def test_json_round_trip_with_default(tmp_path):
    path = write_json_atomic(tmp_path / "r.json", {"p": tmp_path}, indent=2, default=str)
    assert json.loads(path.read_text()) == {"p": str(tmp_path)}


def _transparent_png(path, mode="RGBA"):
    """A 4x4 image: left half opaque blue, right half fully transparent with red hidden under it."""
    from PIL import Image

    pixels = np.zeros((4, 4, 4), dtype=np.uint8)
    pixels[:, :2] = (0, 0, 255, 255)
    pixels[:, 2:] = (255, 0, 0, 0)
    image = Image.fromarray(pixels, "RGBA")
    if mode == "P":
        image = image.quantize(colors=4, method=Image.Quantize.FASTOCTREE)
        image.info["transparency"] = image.getpixel((3, 0))
    image.save(path)
    return path


@pytest.mark.parametrize("mode", ["RGBA", "P"])
def test_every_image_reader_composites_transparency_on_white(tmp_path, mode):
    from demind.retrieval import ImageRef, load_image
    from demind.gen.reader import decode_and_shrink
    from demind.search.query import read_query_image

    path = _transparent_png(tmp_path / "t.png", mode)
    for image in (load_image(ImageRef(name="t", path=path)), read_query_image(path.read_bytes()),
                  decode_and_shrink(path.read_bytes(), 64)):
        pixels = np.asarray(image)
        assert image.mode == "RGB"
        assert tuple(pixels[0, 0]) == (0, 0, 255) and tuple(pixels[0, 3]) == (255, 255, 255)


# --------------------------------------------------------------------------- the file-size limit

FSIZE_SCRIPT = r"""
import resource, sys, torch
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
from demind.errors import OutputLocationError
from demind.io import atomic_path, write_bytes_atomic
from safetensors.torch import save_file
out = sys.argv[1]
writers = {
    "bytes": lambda: write_bytes_atomic(out + "/a.bin", b"0" * 50000),
}
def torch_save():
    with atomic_path(out + "/b.pt") as tmp:
        torch.save(torch.zeros(100000), tmp)
def safetensors_save():
    with atomic_path(out + "/c.safetensors") as tmp:
        save_file({"a": torch.zeros(100000)}, str(tmp))
for name, write in (("bytes", writers["bytes"]), ("torch.save", torch_save), ("safetensors", safetensors_save)):
    try:
        write()
        print(name, "WROTE")
    except OutputLocationError as e:
        print(name, "ONE-LINE", e)
"""


def test_a_write_over_the_file_size_limit_is_an_output_location_error(tmp_path):
    """EFBIG (``ulimit -f``, FAT32's 4 GiB) from a plain write, torch.save (which says only
    ``unexpected pos``) and safetensors (``os error 27``): each one OutputLocationError naming
    the file and the limit; the old file and no temp file are left."""
    import subprocess
    import sys

    (tmp_path / "a.bin").write_bytes(b"old")
    proc = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, file in (("bytes", "a.bin"), ("torch.save", "b.pt"), ("safetensors", "c.safetensors")):
        assert lines[name].startswith("ONE-LINE cannot write "), (name, lines[name], proc.stderr[-1500:])
        assert file in lines[name] and "file too large" in lines[name] and "ulimit -f" in lines[name]
    assert (tmp_path / "a.bin").read_bytes() == b"old"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_json_object_naming_one_key_twice_with_two_values_is_refused(tmp_path):
    """json.load keeps the last of two values silently (a CIRR split map or ExclCOCO's images losing an
    entry); the reader names the file and the key. The same value twice is harmless and kept."""
    from demind.errors import InputError
    from demind.io import read_json

    path = tmp_path / "split.json"
    path.write_text('{"a": "x.png", "b": "y.png", "a": "z.png"}', encoding="utf-8")
    with pytest.raises(InputError, match=r"split.json: the key 'a' appears twice in one object"):
        read_json(path)
    path.write_text('{"a": "x.png", "a": "x.png", "n": [{"k": 1, "k": 1}]}', encoding="utf-8")
    assert read_json(path) == {"a": "x.png", "n": [{"k": 1}]}


def test_coco_files_refuse_a_repeated_key(tmp_path):
    from demind.coco_files import load_coco
    from demind.errors import InputError

    path = tmp_path / "instances.json"
    path.write_text('{"images": [], "images": [{"id": 1, "file_name": "a.jpg"}]}', encoding="utf-8")
    with pytest.raises(InputError, match="instances.json: the key 'images' appears twice"):
        load_coco(path, {"images": {"id": int}})
