"""FrozenCLIP: pseudo-token text encoding, truncation, freezing."""

from __future__ import annotations

import pytest
import torch

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig
from demind.text_tower import length_buckets, truncate_keeping_placeholders


def own_placeholder_embedding(backbone: FrozenCLIP, batch: int, k: int) -> torch.Tensor:
    """(batch, k, W) copies of the '*' token's own embedding."""
    row = backbone.model.token_embedding.weight[backbone.placeholder_id]
    return row.expand(batch, k, -1).clone()


def test_own_embedding_reproduces_plain_encode_text(tiny_backbone):
    texts = ["a photo of * , red car", "* on the left , a dog and a cat", "a sketch of *"]
    plain = tiny_backbone.encode_text(texts)
    pseudo = tiny_backbone.encode_with_pseudo_tokens(texts, own_placeholder_embedding(tiny_backbone, 3, 1))
    reference = tiny_backbone.model.encode_text(tiny_backbone.tokenize(texts))
    assert torch.equal(plain.pooled, pseudo.pooled)
    assert torch.allclose(plain.pooled, reference, atol=1e-6)
    assert torch.equal(plain.mask, pseudo.mask)


def test_placeholders_at_different_positions_get_their_own_vectors(tiny_backbone):
    texts = ["* , a red car", "a photo of a dog and * , blue"]
    pseudo = torch.randn(2, 1, tiny_backbone.width)
    batch = tiny_backbone.encode_with_pseudo_tokens(texts, pseudo)
    for i, text in enumerate(texts):
        single = tiny_backbone.encode_with_pseudo_tokens([text], pseudo[i : i + 1])
        assert torch.allclose(batch.pooled[i], single.pooled[0], atol=1e-5)
    swapped = tiny_backbone.encode_with_pseudo_tokens(texts, pseudo.flip(0))
    assert not torch.allclose(batch.pooled, swapped.pooled)


def test_several_placeholders_are_filled_in_order(tiny_backbone):
    pseudo = torch.randn(1, 4, tiny_backbone.width)
    out = tiny_backbone.encode_with_pseudo_tokens(["* * * *"], pseudo)
    reordered = tiny_backbone.encode_with_pseudo_tokens(["* * * *"], pseudo[:, [1, 0, 2, 3]])
    assert out.pooled.shape == (1, tiny_backbone.embed_dim)
    assert out.tokens.shape == (1, 6, tiny_backbone.width)  # SOT, 4 placeholders, EOT
    assert int(out.mask.sum()) == 4 and int(out.eot[0]) == 5
    assert not torch.allclose(out.pooled, reordered.pooled)


def test_trimming_padding_is_exact(tiny_backbone):
    texts = ["a photo of * , a red car on the left", "* dog"]
    tokens = tiny_backbone.tokenize(texts)
    full = tiny_backbone.model.encode_text(tokens)  # open_clip's own forward over all 77 positions
    trimmed = tiny_backbone.encode_text(texts)
    assert torch.allclose(trimmed.pooled, full, atol=1e-5)
    assert trimmed.tokens.shape[1] == int((tokens == tiny_backbone.eot_id).int().argmax(dim=1).max()) + 1


def test_length_buckets_match_one_padded_batch(tiny_backbone, monkeypatch):
    """Sorting texts by length into buckets changes nothing we read: pooled, word features
    under the mask, and the gradient reaching the pseudo tokens."""
    texts = ["* dog", "a photo of * , a red car on the left of a big blue house with a garden",
             "* , small", "a photo of * , a cat", "* on grass at night under the moon and the stars"]
    pseudo = torch.randn(len(texts), 1, tiny_backbone.width)
    monkeypatch.setattr(tiny_backbone.cfg, "text_buckets", 3)
    assert length_buckets(tiny_backbone.tokenize(texts).eq(tiny_backbone.eot_id).int().argmax(1), 3)
    results = {}
    for buckets in (1, 3):
        monkeypatch.setattr(tiny_backbone.cfg, "text_buckets", buckets)
        p = pseudo.clone().requires_grad_(True)
        out = tiny_backbone.encode_with_pseudo_tokens(texts, p)
        (out.pooled.square().sum() + (out.tokens * out.mask.unsqueeze(-1)).sum()).backward()
        results[buckets] = (out, p.grad)
    (one, grad_one), (three, grad_three) = results[1], results[3]
    assert torch.allclose(one.pooled, three.pooled, atol=1e-5)
    assert torch.equal(one.mask, three.mask) and one.tokens.shape == three.tokens.shape
    assert torch.allclose(one.tokens[one.mask], three.tokens[three.mask], atol=1e-5)
    assert torch.allclose(grad_one, grad_three, atol=1e-4)


def test_texts_of_equal_length_are_not_split_into_buckets(tiny_backbone):
    # one batch beats several small ones when splitting saves little padding
    eot = tiny_backbone.tokenize(["* * * *"] * 8).eq(tiny_backbone.eot_id).int().argmax(1)
    assert length_buckets(eot, tiny_backbone.cfg.text_buckets) is None


def test_long_text_truncation_keeps_placeholder_and_eot(tiny_backbone):
    text = "a photo of " + "very " * 100 + "* , and then " + "more " * 50
    tokens = tiny_backbone.tokenize([text])[0]
    assert int((tokens == tiny_backbone.placeholder_id).sum()) == 1
    assert int(tokens[-1]) == tiny_backbone.eot_id
    out = tiny_backbone.encode_with_pseudo_tokens([text], torch.randn(1, 1, tiny_backbone.width))
    assert int(out.eot[0]) == tiny_backbone.context_length - 1


def test_truncation_drops_free_text_from_the_end():
    assert truncate_keeping_placeholders([1, 2, 9, 3, 4, 5], 4, placeholder_id=9) == [1, 2, 9, 3]
    assert truncate_keeping_placeholders([1, 2, 3, 4, 9], 3, placeholder_id=9) == [1, 2, 9]
    with pytest.raises(ValueError, match="placeholders do not fit"):
        truncate_keeping_placeholders([9, 9, 9], 2, placeholder_id=9)


def test_wrong_placeholder_count_is_a_clear_error(tiny_backbone):
    with pytest.raises(ValueError, match="has 0 placeholder tokens"):
        tiny_backbone.encode_with_pseudo_tokens(["a photo of a dog"], torch.randn(1, 1, tiny_backbone.width))
    # '*,' is another BPE token: the count check catches the classic template typo.
    with pytest.raises(ValueError, match="separate word"):
        tiny_backbone.encode_with_pseudo_tokens(["a photo of *, red"], torch.randn(1, 1, tiny_backbone.width))


def test_backbone_is_frozen_and_stays_in_eval(tiny_backbone):
    assert not any(p.requires_grad for p in tiny_backbone.parameters())
    tiny_backbone.train()
    assert not tiny_backbone.training and not tiny_backbone.model.training


def test_missing_model_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        FrozenCLIP(BackboneConfig(name=str(tmp_path / "nope.json"), pretrained=None))


def test_missing_checkpoint_file_names_the_file(repo_root, tmp_path):
    cfg = BackboneConfig(name=str(repo_root / "configs/model/tiny-clip.json"), pretrained=str(tmp_path / "w.pt"))
    with pytest.raises(FileNotFoundError, match="w.pt"):
        FrozenCLIP(cfg)


def test_local_checkpoint_is_loaded_and_identified_by_hash(repo_root, tmp_path, tiny_backbone):
    path = tmp_path / "tiny.pt"
    torch.save(tiny_backbone.model.state_dict(), path)
    loaded = FrozenCLIP(BackboneConfig(name=str(repo_root / "configs/model/tiny-clip.json"), pretrained=str(path)))
    assert loaded.identity["pretrained"].startswith("sha256:")  # by content: the file name is not part of it
    images = torch.randn(2, 3, 32, 32)
    assert torch.allclose(loaded.encode_image(images), tiny_backbone.encode_image(images), atol=1e-6)
