"""torch_pallas.nn: the drop-in Linear, replace_linear, and a small
transformer that trains the same with and without the Pallas matmul."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_pallas
from torch_pallas.nn import Linear, replace_linear


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=61, dim=32, heads=4, layers=3, context=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def models():
    reference = TinyTransformer()
    return reference, replace_linear(copy.deepcopy(reference))


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_linear_is_a_drop_in_nn_linear():
    torch_layer = nn.Linear(13, 7)
    layer = Linear(13, 7)
    layer.load_state_dict(torch_layer.state_dict())
    assert isinstance(layer, nn.Linear)
    assert layer.state_dict().keys() == torch_layer.state_dict().keys()
    for shape in [(13,), (5, 13), (2, 3, 13)]:
        x = torch.randn(shape)
        torch.testing.assert_close(layer(x), torch_layer(x), rtol=1e-5, atol=1e-5)
    no_bias = Linear(13, 7, bias=False)
    x = torch.randn(4, 13)
    torch.testing.assert_close(no_bias(x), x @ no_bias.weight.t())


def test_replace_linear_keeps_parameters_in_place():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
    params = list(model.parameters())
    assert replace_linear(model) is model
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [Linear, Linear]
    assert all(p is q for p, q in zip(params, model.parameters()))
    single = nn.Linear(3, 3)
    assert type(replace_linear(single)) is Linear


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_transformer_logits_and_gradients_match(compiled):
    reference, pallas = models()
    tokens = torch.randint(0, 61, (4, 24))
    run_ref, run_pallas = reference, pallas
    if compiled:
        run_pallas = torch.compile(pallas, fullgraph=True)
    torch.testing.assert_close(run_pallas(tokens), run_ref(tokens), rtol=1e-4, atol=1e-4)
    loss_of(run_ref, tokens).backward()
    loss_of(run_pallas, tokens).backward()
    for (name, p), q in zip(reference.named_parameters(), pallas.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=name)


def test_transformer_trains_like_the_reference():
    reference, pallas = models()
    compiled = torch.compile(pallas, fullgraph=True)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    opt_pallas = torch.optim.AdamW(pallas.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        tokens = torch.randint(0, 61, (8, 24))
        pair = []
        for model, opt in ((reference, opt_ref), (compiled, opt_pallas)):
            opt.zero_grad()
            loss = loss_of(model, tokens)
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(pair)
    for ref_loss, pallas_loss in losses:
        assert abs(ref_loss - pallas_loss) < 1e-3 * max(1.0, ref_loss), losses
    assert losses[-1][1] < losses[0][1]  # it learns


def test_transformer_forward_on_a_simulation_backend():
    reference, pallas = models()
    tokens = torch.randint(0, 61, (2, 12))
    with torch_pallas.backend("tpu_interpret"):
        torch.testing.assert_close(pallas(tokens), reference(tokens), rtol=1e-4, atol=1e-4)


def test_linear_under_autocast_matches_torch():
    layer = nn.Linear(16, 8)
    pallas = replace_linear(copy.deepcopy(layer))
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = pallas(x), layer(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_linear_with_a_bias_of_another_dtype_raises_like_torch():
    layer = nn.Linear(16, 8).bfloat16()
    layer.bias.data = layer.bias.data.float()
    pallas = replace_linear(copy.deepcopy(layer))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        layer(x)
    with pytest.raises(TypeError, match="linear: bias has dtype torch.float32, input and weight torch.bfloat16"):
        pallas(x)


def pallas_matmuls(fn) -> int:
    """How many pallas::matmul calls `fn()` makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.pallas.matmul.default:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def test_replace_linear_keeps_parametrizations():
    from torch.nn.utils import parametrizations, parametrize

    reference = parametrizations.weight_norm(nn.Linear(9, 5))
    model = copy.deepcopy(reference)
    assert replace_linear(model) is model and isinstance(model, Linear)
    x = torch.randn(4, 9)
    assert pallas_matmuls(lambda: model(x)) == 1
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    model(x).sum().backward()
    reference(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    parametrize.remove_parametrizations(model, "weight")
    assert type(model) is Linear
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


def test_replace_linear_makes_a_lazy_linear_pallas_once_it_materialises():
    model = replace_linear(nn.Sequential(nn.LazyLinear(6), nn.Tanh()))
    x = torch.randn(3, 11)
    model(x)  # materialises (torch computes this first call)
    assert type(model[0]) is Linear and model[0].in_features == 11
    assert pallas_matmuls(lambda: model(x)) == 1
    torch.testing.assert_close(model(x), torch.tanh(x @ model[0].weight.T + model[0].bias))


def test_replace_linear_leaves_subclasses_alone():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    attention = nn.MultiheadAttention(8, 2)
    model = replace_linear(nn.Sequential(Scaled(3, 3), attention))
    assert type(model[0]) is Scaled
    assert type(attention.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
