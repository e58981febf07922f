"""De-MINDS modules: gradients through the frozen tower, the gate at init, ablations."""

from __future__ import annotations

import pytest
import torch

from demind.model import DeMinds, IntentionModule
from demind.schema import ModelConfig
from demind.templates import fill_template


@pytest.fixture()
def model(tiny_backbone) -> DeMinds:
    torch.manual_seed(0)
    return DeMinds(ModelConfig(mapping_hidden=64), tiny_backbone)


def test_shapes_and_normalisation(model, tiny_backbone):
    v = tiny_backbone.encode_image(torch.randn(3, 3, 32, 32))
    out = model(v, ["make it red", "", "a dog on the grass"])
    for emb in out:
        assert emb.shape == (3, tiny_backbone.embed_dim)
        assert torch.allclose(emb.norm(dim=-1), torch.ones(3), atol=1e-5)


def test_at_initialisation_t_hat_equals_t_cls(model, tiny_backbone):
    model.eval()
    v = tiny_backbone.encode_image(torch.randn(2, 3, 32, 32))
    out = model(v, ["make it red", "without the dog"])
    assert torch.allclose(out.t_hat, out.t_cls, atol=1e-6)
    assert not torch.allclose(out.t_star, out.t_cls, atol=1e-3)
    prompts = [fill_template(model.cfg.template, text=t) for t in ["make it red", "without the dog"]]
    assert torch.allclose(model.mapping_only(v, prompts), out.t_cls, atol=1e-6)


def test_gradients_reach_trainable_parts_but_not_the_backbone(model, tiny_backbone):
    before = {k: v.clone() for k, v in tiny_backbone.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    v = tiny_backbone.encode_image(torch.randn(4, 3, 32, 32))
    out = model(v, ["red", "blue", "a cat", "two dogs"])
    # Both paths: through t_cls (mapping) and through t* (queries); the gate needs t* != 0.
    (out.t_hat.sum() + out.t_star.pow(2).sum() + out.t_star[:, 0].sum()).backward()
    assert model.mapping.layers[0].weight.grad.abs().sum() > 0
    assert model.intention.queries.grad.abs().sum() > 0
    assert model.intention.blocks[0].attn.in_proj_weight.grad.abs().sum() > 0
    assert model.gate.grad is not None and model.gate.grad.abs() > 0
    assert all(p.grad is None for p in tiny_backbone.parameters())
    optimizer.step()
    after = tiny_backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_state_dict_holds_only_trainable_weights(model):
    keys = model.state_dict().keys()
    assert not any(k.startswith("backbone") for k in keys)
    assert {"gate", "logit_scale", "intention.queries"} <= set(keys)


def test_intention_module_ignores_padding():
    torch.manual_seed(0)
    module = IntentionModule(width=16, num_queries=2, num_blocks=2, num_heads=4).eval()
    words = torch.randn(1, 6, 16)
    mask = torch.tensor([[True, True, True, False, False, False]])
    garbage = words.clone()
    garbage[:, 3:] = 100 * torch.randn(1, 3, 16)
    assert torch.allclose(module(words, mask), module(garbage, mask), atol=1e-5)
    assert not torch.allclose(module(words, mask), module(words, torch.ones_like(mask)), atol=1e-4)


@pytest.mark.parametrize("fusion", ["add", "intent_only"])
def test_fusion_ablations(tiny_backbone, fusion):
    model = DeMinds(ModelConfig(mapping_hidden=64, fusion=fusion), tiny_backbone).eval()
    v = tiny_backbone.encode_image(torch.randn(2, 3, 32, 32))
    out = model(v, ["red", "blue"])
    expected = out.t_star if fusion == "intent_only" else torch.nn.functional.normalize(out.t_cls + out.t_star, dim=-1)
    assert torch.allclose(out.t_hat, expected, atol=1e-6)


def test_bad_model_config_is_rejected(tiny_backbone):
    """The rules are declared on the fields: checked at load, and by DeMinds for a config built in code."""
    from demind.config import load_config

    with pytest.raises(ValueError, match="fusion"):
        load_config(ModelConfig, None, ["fusion=concat"])
    with pytest.raises(ValueError, match="template"):
        load_config(ModelConfig, None, ["template=a photo of {text}"])
    with pytest.raises(ValueError, match="fusion"):
        DeMinds(ModelConfig(fusion="concat"), tiny_backbone)
    with pytest.raises(ValueError, match="template"):
        DeMinds(ModelConfig(template="a photo of {text}"), tiny_backbone)


def test_query_api_fills_each_paper_template(model, tiny_backbone):
    model.eval()
    v = tiny_backbone.encode_image(torch.randn(2, 3, 32, 32))
    cirr = model.query(v, ["make it red", "without the dog"])
    assert torch.allclose(cirr, model(v, ["make it red", "without the dog"]).t_hat, atol=1e-6)
    domain = model.query(v, ["sketch", "cartoon"], template="a {domain} of *")
    prompts = ["a sketch of *", "a cartoon of *"]
    assert torch.allclose(domain, model.compose(v, prompts).t_hat, atol=1e-6)
    objects = model.query(v, ["dog and cat", "car"], template="a photo of * , {objects}", mapping_only=True)
    assert torch.allclose(objects, model.mapping_only(v, ["a photo of * , dog and cat", "a photo of * , car"]), atol=1e-6)
    with pytest.raises(ValueError, match="one"):
        model.query(v, ["x", "y"], template="a photo of {a} {b} *")


def test_fill_template_neutralises_stray_placeholders():
    assert fill_template("a photo of * , {text}", text="5 * stars") == "a photo of * , 5 stars"
    assert fill_template("a {domain} of *", domain="sketch") == "a sketch of *"


@pytest.mark.slow
def test_vit_l14_shapes_and_trainable_parameter_count():
    from demind.backbone import FrozenCLIP
    from demind.schema import BackboneConfig

    backbone = FrozenCLIP(BackboneConfig(name="ViT-L-14", pretrained=None))
    model = DeMinds(ModelConfig(), backbone).eval()
    assert (backbone.embed_dim, backbone.width) == (768, 768)
    with torch.no_grad():
        out = model(backbone.encode_image(torch.randn(2, 3, 224, 224)), ["make it red", "without the dog"])
    assert out.t_hat.shape == (2, 768)
    mapping = (768 * 512 + 512) + (512 * 512 + 512) + (512 * 768 + 768)
    attention = (3 * 768 * 768 + 3 * 768) + (768 * 768 + 768)
    feed_forward = (768 * 3072 + 3072) + (3072 * 768 + 768)
    block = attention + feed_forward + 3 * 2 * 768  # three LayerNorms
    expected = mapping + 6 * block + 4 * 768 + 1  # + queries + gate
    assert model.num_trainable_parameters() == expected == 43_589_889


QUERY_TEXTS = ["make it red", "", "a dog on the grass, seen from far away at night in the snow", "without the cat"]


def eager_queries(model, tiny_backbone, image_emb) -> tuple[torch.Tensor, torch.Tensor]:
    model.set_query_mode("eager")
    return model.query(image_emb, QUERY_TEXTS), model.query(image_emb, QUERY_TEXTS, mapping_only=True)


def test_intent_prompt_fast_path_and_length_rounding_are_exact(model, tiny_backbone):
    """The repeated intention prompt, tokenised once, and lengths rounded up to 8 (the CUDA-graph
    path's shapes) give exactly what per-row tokenisation and tight lengths give."""
    model.eval()
    refined = torch.randn(3, model.cfg.num_queries, tiny_backbone.width)
    slow = tiny_backbone.encode_with_pseudo_tokens([model.intent_prompt] * 3, refined)
    fast = tiny_backbone.encode_template_with_pseudo_tokens(model.intent_prompt, refined)
    for a, b in zip(slow, fast):
        assert torch.equal(a, b)
    image_emb = tiny_backbone.encode_image(torch.randn(4, 3, 32, 32))
    reference = eager_queries(model, tiny_backbone, image_emb)
    try:
        tiny_backbone.length_multiple = 8
        rounded = model.query(image_emb, QUERY_TEXTS), model.query(image_emb, QUERY_TEXTS, mapping_only=True)
    finally:
        tiny_backbone.length_multiple = 1
    for a, b in zip(reference, rounded):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="placeholder"):
        tiny_backbone.encode_template_with_pseudo_tokens("a photo", refined)


@pytest.mark.parametrize("mode, backend", [
    ("compile", "aot_eager"),  # graph capture and autograd tracing, no code generation: fast
    pytest.param("compile", "inductor", marks=pytest.mark.slow),  # generated kernels
    pytest.param("cudagraphs", "inductor", marks=pytest.mark.slow),  # on CPU: inductor with rounded lengths
])
def test_compiled_query_gives_the_eager_embeddings(model, tiny_backbone, mode, backend):
    model.eval()
    image_emb = tiny_backbone.encode_image(torch.randn(4, 3, 32, 32))
    reference = eager_queries(model, tiny_backbone, image_emb)
    try:
        model.set_query_mode(mode, backend=backend)
        for _ in range(2):  # the second call runs the compiled code
            fast = model.query(image_emb, QUERY_TEXTS), model.query(image_emb, QUERY_TEXTS, mapping_only=True)
            for a, b in zip(reference, fast):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert set(model.state_dict()) == set(DeMinds(model.cfg, tiny_backbone).state_dict())
    finally:
        model.set_query_mode("eager")
    with pytest.raises(ValueError, match="query mode"):
        model.set_query_mode("fast")
