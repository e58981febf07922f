"""Offline is fast and clear: weights or a Hub reference that would need a download fail in seconds,
as one error naming what was asked and the offline fix, before any model is built and without
huggingface_hub's minute of retries (79 s measured for RN50:openai on a machine without DNS)."""

from __future__ import annotations

import time

import open_clip
import open_clip.pretrained
import pytest

from demind.backbone import BackboneWeightsError, FrozenCLIP
from demind.schema import BackboneConfig
from demind.hubref import HubError, hub_unreachable, resolve_hub_folder

from helpers import TINY_CLIP

TAG = "demind_test_hub_only"


@pytest.fixture()
def hub_tag(monkeypatch):
    """TINY_CLIP with a pretrained tag whose weights live only on the Hub (as most open_clip tags)."""
    open_clip.add_model_config(TINY_CLIP)
    entry = {"url": "", "hf_hub": "demind-test/tiny-clip-weights/", "mean": (0.5,) * 3, "std": (0.5,) * 3}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, TINY_CLIP.stem, {TAG: entry})
    monkeypatch.setattr(open_clip, "create_model_and_transforms",
                        lambda *a, **k: pytest.fail("the model was built (and a download tried) although offline"))
    return BackboneConfig(name=str(TINY_CLIP), pretrained=TAG)


def unreachable_endpoint(monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there


def test_offline_mode_refuses_uncached_weights_at_once(hub_tag, monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(BackboneWeightsError) as caught:
        FrozenCLIP(hub_tag)
    assert time.monotonic() - start < 5
    message = str(caught.value)
    assert f"{TINY_CLIP}:{TAG}" in message and "demind-test/tiny-clip-weights" in message
    assert "HF_HUB_OFFLINE=1" in message and "backbone.pretrained" in message and "\n" not in message


def test_no_network_refuses_uncached_weights_in_seconds(hub_tag, monkeypatch):
    unreachable_endpoint(monkeypatch)
    assert "127.0.0.1:9 cannot be reached" in hub_unreachable()
    start = time.monotonic()
    with pytest.raises(BackboneWeightsError, match=r"not in the Hugging Face cache and 127\.0\.0\.1:9 cannot be "
                                                   r"reached.*Check the network"):
        FrozenCLIP(hub_tag)
    assert time.monotonic() - start < 5


def test_cached_weights_or_a_local_file_are_not_probed(hub_tag, monkeypatch, tmp_path):
    """A local file never asks the network; a tag in the cache goes on to open_clip as before."""
    import demind.backbone as backbone

    monkeypatch.setattr(backbone, "hub_unreachable", lambda: pytest.fail("probed the network"))
    local = tmp_path / "w.pt"
    local.write_bytes(b"")
    assert backbone.weights_out_of_reach(BackboneConfig(name=str(TINY_CLIP), pretrained=str(local)),
                                         TINY_CLIP.stem) is None
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: str(tmp_path / name))
    assert backbone.weights_out_of_reach(hub_tag, TINY_CLIP.stem) is None


def test_a_hub_reference_without_network_reads_the_cache_only_and_says_why(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    unreachable_endpoint(monkeypatch)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(HubError, match=r"not \(completely\) in the Hugging Face cache and 127\.0\.0\.1:9 cannot be "
                                       r"reached"):
        resolve_hub_folder("hf-hub:demind-test/absent", "model", "--checkpoint")
    assert time.monotonic() - start < 10


def test_behind_a_proxy_the_proxy_is_what_must_answer(monkeypatch):
    """huggingface_hub downloads through HTTPS_PROXY / HTTP_PROXY: a network where only the proxy is
    reachable is online (a direct connection to the endpoint would say it is not)."""
    import socket

    unreachable_endpoint(monkeypatch)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert "127.0.0.1:9" in hub_unreachable()
    with socket.socket() as proxy:  # a local stand-in for the proxy: it accepts connections
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(1)
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        assert hub_unreachable() is None
        monkeypatch.setenv("no_proxy", "127.0.0.1")  # the endpoint bypasses the proxy: connected directly again
        assert "127.0.0.1:9" in hub_unreachable()
