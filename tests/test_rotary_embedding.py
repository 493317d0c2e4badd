"""torch_pallas.rotary_embedding against transformers' apply_rotary_pos_emb
(torch's composition) in float64: values and the gradients of q, k, cos
and sin, every dtype, ragged head sizes, grouped kv heads, unsqueeze_dim 1
and 2 (and negative), cos broadcast along the batch, q as a transformers
layer makes it (`view(B, S, H, D).transpose(1, 2)`: read in place, the
results laid out as q); a float32 cos with a bfloat16 q; transformers' own
function and angles; every CPU backend; empty inputs; bad arguments refused
before any kernel runs, naming them; the fake CUDA trace into the Triton
kernels. (opcheck, compile on model layouts with static and dynamic shapes
and the backends' fakes: tests/test_opcheck.py and tests/test_layouts.py;
the angles' gradients compiled with dynamic shapes here, -m exhaustive.)"""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive
from torch_pallas.ops import rotary_embedding as rope
from torch_pallas.runtime import launch, registry

# name: (q shape, kv heads, cos shape, unsqueeze_dim, q transposed as transformers makes it,
#        cos and sin requiring grad)
CASES = {
    "llama": ((2, 4, 5, 6), 2, (1, 5, 6), 1, True, True),
    "heads_after_tokens": ((3, 7, 2, 10), 1, (3, 7, 10), 2, False, False),
    "ragged": ((1, 3, 33, 34), 3, (1, 33, 34), 1, False, True),
    "leading_dims": ((2, 3, 2, 4, 6), 1, (2, 3, 4, 6), -3, False, True),
}


def make(case, dtype, angles_dtype=None):
    """(q, k, cos, sin, unsqueeze_dim) for a CASES entry, fresh random."""
    q_shape, kv_heads, angles_shape, dim, transposed, angles_grad = case
    head_axis = dim + len(angles_shape) + 1 if dim < 0 else dim
    head_axis += len(q_shape) - len(angles_shape) - 1
    k_shape = (*q_shape[:head_axis], kv_heads, *q_shape[head_axis + 1:])

    def tensor(shape):
        if not transposed:
            return torch.randn(shape).to(dtype)
        b, h, s, d = shape  # a projection's (B, S, H, D), seen as (B, H, S, D)
        return torch.randn(b, s, h, d).to(dtype).transpose(1, 2)

    q, k = tensor(q_shape), tensor(k_shape)
    cos, sin = (torch.randn(angles_shape).to(angles_dtype or dtype) for _ in range(2))
    for t in (q, k, cos, sin) if angles_grad else (q, k):
        t.requires_grad_()
    return q, k, cos, sin, dim


def check(q, k, cos, sin, dim, what):
    """Values and every gradient of one call against float64, dtypes and
    shapes as torch's composition gives them."""
    outs = torch_pallas.rotary_embedding(q, k, cos, sin, dim)
    expected = rope.torch_rotary_embedding(q, k, cos, sin, dim)
    refs = rope.reference(q, k, cos, sin, dim)
    for name, x, out, e, ref in zip(("q", "k"), (q, k), outs, expected, refs):
        assert out.dtype == e.dtype and out.shape == e.shape, f"{what} {name}"
        assert_within(out, ref, rope.error_bound(x, cos, sin, ref, dim), f"{what} {name}_embed")

    grads = [torch.randn(o.shape).to(o.dtype) for o in outs]
    wanted = [t for t in (q, k, cos, sin) if t.requires_grad]
    ours = torch.autograd.grad(outs, wanted, grads)
    theirs = torch.autograd.grad(expected, wanted, grads)
    angles = cos.requires_grad
    grads64 = rope.reference_gradients(*grads, cos, sin, dim, *((q, k) if angles else ()))
    bounds = [rope.error_bound(g, cos, sin, g64, dim, transpose=True, dtype=x.dtype)
              for g, g64, x in zip(grads, grads64, (q, k))]
    if angles:
        bounds += rope.angle_error_bounds(*grads, q, k, cos, dim, *grads64[2:])
    for name, g, t, g64, bound in zip(("q", "k", "cos", "sin"), ours, theirs, grads64, bounds):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what} d{name}"
        assert_within(g, g64, bound, f"{what} d{name}")


# Each case in each dtype on the default backend costs a kernel build apiece:
# the llama case in every dtype, the others in one each (all of them with
# -m exhaustive, and on every backend there).
@pytest.mark.parametrize("case,dtype", [
    *(("llama", dtype) for dtype in FLOAT_DTYPES),
    ("heads_after_tokens", torch.float16), ("ragged", torch.bfloat16),
    ("leading_dims", torch.float32),
])
def test_values_and_gradients_match_float64(case, dtype):
    check(*make(CASES[case], dtype), f"{case} {dtype}")


# interpret is the default backend test_values_... runs on; the others' default
# coverage is test_every_backend_on_a_block_edge.
@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(also=("interpret", "triton")),
                         indirect=True)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_backend(cpu_backend, dtype):
    for case in CASES:
        check(*make(CASES[case], dtype), f"{cpu_backend} {case} {dtype}")


# Past one block of each family: TPU blocks of 16 tokens, Mosaic GPU blocks
# of 64 tokens (halves of 17 padded to 32), Triton steps of 8 heads; the
# whole array on interpret. (batch, heads, tokens, D)
BLOCK_EDGES = {"interpret": (2, 3, 5, 34), "tpu_interpret": (2, 3, 17, 34),
               "mosaic_gpu_interpret": (1, 2, 65, 34), "triton": (2, 9, 3, 34)}


def test_every_backend_on_a_block_edge(cpu_backend):
    """q and k as transformers makes them: the forward reads each token's
    heads together (N1 = batch x tokens), the backward's fresh gradients
    have the heads outside the tokens (N2 = tokens)."""
    b, h, s, d = BLOCK_EDGES[cpu_backend]
    case = ((b, h, s, d), 1, (b, s, d), 1, True, True)
    check(*make(case, torch.float32), cpu_backend)


def test_q_from_a_transformers_layer_is_read_in_place(monkeypatch):
    """q and k as transformers' attention makes them, `proj(x).view(B, S, H,
    D).transpose(1, 2)`: the kernel reads their memory as it lies and the
    results lie as they do; a k in another layout than q is copied."""
    b, s, h, kv, d = 2, 9, 4, 2, 10
    q = torch.randn(b, s, h * d).view(b, s, h, d).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, kv * d).view(b, s, kv, d).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(b, s, d), torch.randn(b, s, d)
    handed = []
    run = launch.run
    monkeypatch.setattr(launch, "run", lambda op, device, inputs, params: (
        handed.extend(inputs), run(op, device, inputs, params))[1])
    q_embed, k_embed = torch_pallas.rotary_embedding(q, k, cos, sin)
    assert [t.data_ptr() for t in handed[:2]] == [q.data_ptr(), k.data_ptr()]
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()
    monkeypatch.undo()
    check(q, k, cos, sin, 1, "transposed q and k")
    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k)]
    check(q, contiguous[1], cos, sin, 1, "transposed q, contiguous k")
    check(contiguous[0], k, cos, sin, 1, "contiguous q, transposed k")
    sliced = torch.randn(b, h, s, d + 3)[..., :d].requires_grad_()  # neither layout: copied
    check(sliced, k, cos, sin, 1, "sliced q")


def test_float32_angles_with_a_bfloat16_q():
    """As torch's composition: the result in float32 (the dtypes promoted),
    the gradients in their inputs' dtypes."""
    q, k, cos, sin, dim = make(CASES["llama"], torch.bfloat16, angles_dtype=torch.float32)
    check(q, k, cos, sin, dim, "float32 angles")


def test_transformers_own_function_and_angles():
    """Llama's apply_rotary_pos_emb and LlamaRotaryEmbedding's cos and sin
    (positions 0..S-1 of a batch of 2), in bfloat16."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)
    b, s, d = 2, 11, config.hidden_size // config.num_attention_heads
    x = torch.randn(b, s, config.hidden_size, dtype=torch.bfloat16)
    positions = torch.arange(s).expand(b, s)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(x, positions)
    q = torch.randn(b, s, 4, d, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, s, 2, d, dtype=torch.bfloat16).transpose(1, 2)
    ours = torch_pallas.rotary_embedding(q, k, cos, sin)
    theirs = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    refs = rope.reference(q, k, cos, sin)
    for x_, o, t, ref in zip((q, k), ours, theirs, refs):
        assert o.dtype == t.dtype == torch.bfloat16
        assert_within(o, ref, rope.error_bound(x_, cos, sin, ref), "transformers' angles")
        # one rounding where transformers' composition rounds each product
        assert (o.double() - ref).abs().sum() <= (t.double() - ref).abs().sum()


def test_gradients_only_where_asked():
    """k and the angles needing no gradient get none; angles alone get
    theirs."""
    q, k, cos, sin, dim = make(CASES["ragged"], torch.float32)
    k.requires_grad_(False), sin.requires_grad_(False)
    q_embed, k_embed = torch_pallas.rotary_embedding(q, k, cos, sin, dim)
    (q_embed.sum() + k_embed.sum()).backward()
    assert k.grad is None and sin.grad is None
    assert q.grad is not None and cos.grad is not None
    q, k = q.detach(), k.detach()
    cos, sin = cos.detach().requires_grad_(), sin.detach().requires_grad_()
    outs = torch_pallas.rotary_embedding(q, k, cos, sin, dim)
    expected = rope.torch_rotary_embedding(q, k, cos, sin, dim)
    weights = [torch.randn(o.shape) for o in outs]
    ours = torch.autograd.grad(outs, (cos, sin), weights)
    theirs = torch.autograd.grad(expected, (cos, sin), weights)
    for g, t in zip(ours, theirs):
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)


def test_empty_inputs():
    """No tokens, or no kv heads: results of the right shapes, gradients too."""
    for q_shape, kv_heads in (((2, 4, 0, 6), 2), ((2, 4, 3, 6), 0)):
        q = torch.randn(q_shape, requires_grad=True)
        k = torch.randn(q_shape[0], kv_heads, *q_shape[2:], requires_grad=True)
        cos, sin = torch.randn(1, q_shape[2], 6), torch.randn(1, q_shape[2], 6)
        q_embed, k_embed = torch_pallas.rotary_embedding(q, k, cos, sin)
        expected = rope.torch_rotary_embedding(q, k, cos, sin)
        torch.testing.assert_close(q_embed, expected[0])
        assert k_embed.shape == k.shape
        (q_embed.sum() + k_embed.sum()).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


def _args(q=(2, 4, 5, 6), k=(2, 2, 5, 6), cos=(1, 5, 6), sin=None, dim=1, dtype=torch.float32,
          angles_dtype=None, sin_dtype=None):
    angles_dtype = angles_dtype or dtype
    return (torch.randn(q).to(dtype), torch.randn(k).to(dtype), torch.randn(cos).to(angles_dtype),
            torch.randn(sin or cos).to(sin_dtype or angles_dtype), dim)


@pytest.mark.parametrize("args, error, match", [
    (_args(q=(2, 4, 5, 7), k=(2, 2, 5, 7), cos=(1, 5, 7)), RuntimeError,
     r"q.shape\[-1\]=7 must be even"),
    (_args(k=(2, 2, 4, 6)), RuntimeError, r"q.shape=\(2, 4, 5, 6\) and k.shape=\(2, 2, 4, 6\)"),
    (_args(cos=(1, 4, 6)), RuntimeError, r"cos.shape=\(1, 4, 6\) unsqueezed at unsqueeze_dim=1"),
    (_args(cos=(3, 5, 6)), RuntimeError, r"cos.shape=\(3, 5, 6\).*must broadcast"),
    (_args(sin=(1, 5, 3)), RuntimeError, r"cos.shape=\(1, 5, 6\) and sin.shape=\(1, 5, 3\)"),
    (_args(dim=3), RuntimeError, r"unsqueeze_dim=3 must name"),
    (_args(dim=-1), RuntimeError, r"unsqueeze_dim=-1 must name"),
    (_args(cos=(2, 1, 5, 6)), RuntimeError, r"cos.dim\(\)=4 must be between 1 and q.dim\(\) - 1"),
    (_args(dtype=torch.float64), TypeError, "q has dtype torch.float64"),
    (_args(angles_dtype=torch.int32), TypeError, "cos has dtype torch.int32"),
    (_args(sin_dtype=torch.float16), TypeError, "sin.dtype=torch.float16"),
    ((torch.randn(2, 4, 5, 6), torch.randn(2, 2, 5, 6).half(), torch.randn(5, 6),
      torch.randn(5, 6), 1), TypeError, "k.dtype=torch.float16"),
], ids=["odd", "k", "cos_tokens", "cos_batch", "sin", "dim", "dim_last", "cos_dims", "float64",
        "int", "sin_dtype", "k_dtype"])
def test_bad_arguments_are_refused_before_any_kernel(args, error, match, monkeypatch):
    def no_kernel(*a, **kw):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(launch, "run", no_kernel)
    with pytest.raises(error, match=match) as info:
        torch_pallas.rotary_embedding(*args)
    assert "pallas::rotary_embedding" in str(info.value)


def test_backward_op_refuses_q_without_k():
    g = torch.randn(2, 4, 5, 6)
    with pytest.raises(ValueError, match="q and k must be given together") as info:
        torch.ops.pallas.rotary_embedding_backward(g, g, torch.randn(5, 6), torch.randn(5, 6), 1,
                                                   g, None)
    assert "pallas::rotary_embedding_backward" in str(info.value)


@pytest.mark.exhaustive  # a second dynamic compilation, seconds long
def test_compiled_with_dynamic_shapes_and_the_angles_gradients():
    """tests/test_layouts.py compiles the op's first example with dynamic
    shapes (q and k requiring grad) and every example with static ones;
    this, the example whose cos and sin require grad, with dynamic ones."""
    from layouts import compiled_matches_eager

    info = registry.get("rotary_embedding")
    (example,) = [e for e in info.examples(torch.device("cpu"), True) if e.args[2].requires_grad]
    compiled_matches_eager(info.overload, example.args, example.kwargs, dynamic=True,
                           what="rotary_embedding with the angles' gradients")


def test_torch_compile_on_cuda_traces_the_triton_kernels():
    from helpers import fake_cuda_trace

    model = """
    class Model(torch.nn.Module):
        def forward(self, q, k, cos, sin, dq, dk):
            return (*torch_pallas.rotary_embedding(q, k, cos, sin),
                    *torch.ops.pallas.rotary_embedding_backward(dq, dk, cos, sin, 1, q, k))
    """
    inputs = """
    q = torch.randn(2, 100, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 100, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (torch.randn(1, 100, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    inputs = (q, k, cos, sin, dq, dk)
    """
    lines = fake_cuda_trace(model, inputs)
    assert lines["KERNELS"].split() == ["rotary_embedding_kernel"]
    assert lines["WRAPPERS"] == "2"
    assert lines["OPAQUE"] == "False"
