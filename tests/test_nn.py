"""torch_pallas.nn: the drop-in Linear and Conv1D, replace_linear and what
it reports, a small transformer that trains the same with and without the
Pallas matmul, a small GPT-2 (transformers' Conv1D) converted, and
LinearCrossEntropyLoss."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import torch_pallas
from torch_pallas.nn import Linear, converted, replace_linear
from torch_pallas.ops.linear_cross_entropy import torch_linear_cross_entropy


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


def assert_logits_and_gradients_match(reference, pallas, run_pallas, tokens):
    """run_pallas (pallas, or it compiled) gives reference's logits and, in
    pallas's parameters, its gradients. The logits are those of the inputs
    the loss takes, so a compiled model compiles once."""
    inputs = tokens[:, :-1]
    torch.testing.assert_close(run_pallas(inputs), reference(inputs), rtol=1e-4, atol=1e-4)
    loss_of(reference, tokens).backward()
    loss_of(run_pallas, tokens).backward()
    for (name, p), q in zip(reference.named_parameters(), pallas.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=name)


def test_transformer_logits_and_gradients_match():
    reference, pallas = models()
    assert_logits_and_gradients_match(reference, pallas, pallas, torch.randint(0, 61, (4, 24)))


# ~30 s of compiling; converted Linears compile by default in the README's
# first block and in tests/test_patching.py's compiled Llama step.
@pytest.mark.exhaustive
def test_compiled_transformer_matches_and_trains_like_the_reference():
    """torch.compile(fullgraph=True): the first step's logits and gradients
    match the reference's, and six AdamW steps follow its losses."""
    reference, pallas = models()
    compiled = torch.compile(pallas, fullgraph=True)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    opt_pallas = torch.optim.AdamW(pallas.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        tokens = torch.randint(0, 61, (8, 24))
        if step == 0:
            assert_logits_and_gradients_match(reference, pallas, compiled, tokens)
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


class Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


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
    attention = nn.MultiheadAttention(8, 2)
    with pytest.warns(UserWarning, match=r"\(NonDynamicallyQuantizableLinear, Scaled\) are left alone"):
        model = replace_linear(nn.Sequential(Scaled(3, 3), attention))
    assert type(model[0]) is Scaled
    assert type(attention.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_replace_linear_reports_what_it_converted(capsys):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2), Scaled(2, 2)))
    assert converted(model) == []
    assert replace_linear(model, verbose=True) is model
    assert converted(model) == ["0", "2.0"]
    printed = capsys.readouterr().out
    assert "replace_linear(Sequential), in place" in printed
    assert "  0: Linear -> torch_pallas.nn.Linear" in printed
    assert "  2.0: Linear -> torch_pallas.nn.Linear" in printed
    assert "  2.1: Scaled left alone" in printed
    assert converted(replace_linear(nn.Linear(3, 3))) == [""]
    assert converted(nn.Sequential(Linear(3, 3))) == ["0"]  # built on Pallas, not converted


def test_replace_linear_warns_on_a_model_without_linear_layers():
    with pytest.warns(UserWarning, match="replace_linear: Sequential holds no torch.nn.Linear or transformers Conv1D"):
        replace_linear(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    with pytest.warns(UserWarning, match=r"MultiheadAttention holds no .*\(NonDynamicallyQuantizableLinear\) are left alone"):
        replace_linear(nn.MultiheadAttention(8, 2))
    model = replace_linear(nn.Sequential(nn.Linear(3, 3)))
    lazy = nn.Sequential(nn.LazyLinear(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replace_linear(model)  # already converted: nothing new, nothing to warn about
        replace_linear(lazy)  # converts when it materialises


# A GPT-2 built from a small config (no weights downloaded): its attention
# (c_attn, c_proj) and MLP (c_fc, c_proj) are transformers Conv1D, lm_head an
# nn.Linear tied to the token embedding.
GPT2_LAYERS = 2


def transformers_conv1d() -> type:
    # transformers is a test dependency (setup.py's test extra), imported here
    # only: the import costs seconds, and torch_pallas never makes it.
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def small_gpt2():
    import transformers
    config = transformers.GPT2Config(n_layer=GPT2_LAYERS, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, so both models compute the same


def test_gpt2_runs_on_the_pallas_matmul_with_the_same_logits_and_gradients():
    reference = small_gpt2()
    TransformersConv1D = transformers_conv1d()
    model = copy.deepcopy(reference)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert replace_linear(model) is model

    projections = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert converted(model) == [f"transformer.h.{i}.{p}" for i in range(GPT2_LAYERS) for p in projections] + [
        "lm_head"
    ]
    c_attn = model.transformer.h[0].attn.c_attn
    assert type(c_attn) is torch_pallas.nn.Conv1D and isinstance(c_attn, TransformersConv1D)
    assert type(model.lm_head) is Linear and model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert all(p is params[name] for name, p in model.named_parameters())
    after = model.state_dict()
    assert after.keys() == state.keys()
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)

    tokens = torch.randint(0, 128, (2, 16))
    assert pallas_matmuls(lambda: model(tokens)) == len(projections) * GPT2_LAYERS + 1  # + lm_head
    out, expected = model(tokens, labels=tokens), reference(tokens, labels=tokens)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)  # float32
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_conv1d_is_a_drop_in_transformers_conv1d():
    TransformersConv1D = transformers_conv1d()
    theirs = TransformersConv1D(7, 13)  # nf (out), nx (in)
    ours = torch_pallas.nn.Conv1D(7, 13)
    ours.load_state_dict(theirs.state_dict())
    assert isinstance(ours, TransformersConv1D) and ours.weight.shape == (13, 7)
    for shape in [(13,), (5, 13), (2, 3, 13)]:
        x = torch.randn(shape)
        assert pallas_matmuls(lambda: ours(x)) == 1
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    # pickled by reference to torch_pallas.nn.Conv1D, as torch.save(model) does
    buffer = io.BytesIO()
    torch.save(nn.Sequential(ours), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)[0]
    assert type(loaded) is torch_pallas.nn.Conv1D
    torch.testing.assert_close(loaded(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_replace_linear_keeps_a_conv1d_parametrization():
    from torch.nn.utils import parametrizations, parametrize

    reference = parametrizations.weight_norm(transformers_conv1d()(5, 9))
    model = replace_linear(copy.deepcopy(reference))
    assert isinstance(model, torch_pallas.nn.Conv1D) and converted(model) == [""]
    x = torch.randn(4, 9)
    assert pallas_matmuls(lambda: model(x)) == 1
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    parametrize.remove_parametrizations(model, "weight")
    assert type(model) is torch_pallas.nn.Conv1D
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


# A user's own linear layers, named to replace_linear with `also=`.
class OutIn(nn.Module):
    """x @ weight.T + bias, weight (out, in): nn.Linear's layout."""

    def __init__(self, n_in, n_out, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out)) if bias else None

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class InOut(nn.Module):
    """x @ weight (no bias attribute at all), weight (in, out)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)

    def forward(self, x):
        return x @ self.weight


class NotLinear(OutIn):
    def forward(self, x):
        return torch.relu(super().forward(x))


def test_replace_linear_converts_the_linear_maps_a_user_names():
    reference = nn.Sequential(OutIn(9, 13), nn.GELU(), InOut(13, 6), OutIn(6, 5, bias=False))
    model = copy.deepcopy(reference)
    parameters = list(model.parameters())
    assert replace_linear(model, also={OutIn: "out_in", InOut: "in_out"}) is model
    assert converted(model) == ["0", "2", "3"]
    assert isinstance(model[0], OutIn) and isinstance(model[2], InOut)
    assert list(model.parameters()) == parameters  # the same Parameter objects
    assert model.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(4, 3, 9)
    assert pallas_matmuls(lambda: model(x)) == 3
    expected = reference(x)
    got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(got)
    for g, e in zip(torch.autograd.grad(got, parameters, grad),
                    torch.autograd.grad(expected, list(reference.parameters()), grad)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # A sequence of classes means nn.Linear's layout.
    assert converted(replace_linear(nn.Sequential(OutIn(3, 4)), also=[OutIn])) == ["0"]
    # Pickled by reference, as torch.save(model) does.
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded[2]) is type(model[2])
    torch.testing.assert_close(loaded(x), expected, rtol=1e-5, atol=1e-5)


def test_replace_linear_refuses_a_named_class_that_computes_something_else():
    model = nn.Sequential(nn.Linear(3, 5), NotLinear(5, 4))
    with pytest.raises(ValueError, match=r"replace_linear: 1 \(NotLinear\): its forward does not "
                                         r"compute x @ weight.T \+ bias"):
        replace_linear(model, also=[NotLinear])
    assert converted(model) == []  # nothing changed
    with pytest.raises(ValueError, match=r"1 \(InOut\): its forward does not compute x @ weight.T"):
        replace_linear(nn.Sequential(nn.Linear(3, 4), InOut(4, 4)), also=[InOut])  # wrong layout
    with pytest.raises(ValueError, match=r"the layout must be one of \('out_in', 'in_out'\)"):
        replace_linear(model, also={OutIn: "transposed"})
    with pytest.raises(TypeError, match=r"also= takes torch.nn.Module classes"):
        replace_linear(model, also=["OutIn"])


@pytest.mark.parametrize("options", [
    {},  # the defaults: ignore_index=-100, "mean"
    dict(ignore_index=3, reduction="sum", label_smoothing=0.1, softcap=5.0),
])
def test_linear_cross_entropy_loss_is_the_op_with_its_options(options):
    """torch_pallas.nn.LinearCrossEntropyLoss(...)(input, weight, target,
    bias): the loss and the gradients of torch's F.cross_entropy of
    F.linear, with the module's options, ignored targets included."""
    x = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    bias = torch.randn(37, requires_grad=True)
    target = torch.randint(0, 37, (2, 7))
    target[0, :3] = options.get("ignore_index", -100)
    loss_module = torch_pallas.nn.LinearCrossEntropyLoss(**options)
    assert list(loss_module.state_dict()) == []  # the weight is the LM head's
    assert f"reduction={options.get('reduction', 'mean')!r}" in repr(loss_module)
    results = []
    for compute in (loss_module, lambda *a: torch_linear_cross_entropy(*a, **options)):
        loss = compute(x, weight, target, bias)
        results.append((loss, *torch.autograd.grad(loss, (x, weight, bias))))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
