"""torch_pallas.jax, the JAX-side form of every op, against the torch ops on
the same kernels (CPU, interpreted; on a TPU chip with
TORCH_PALLAS_BACKEND=tpu): values and every gradient, on fresh random ragged
shapes, eagerly and under jax.jit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_pallas
import torch_pallas.jax as tpj
from torch_pallas.jax import calls

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def to_jax(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(jnp.asarray(a, jnp.float32)))


@dataclasses.dataclass
class Case:
    """One call: torch's (`torch_call`) and JAX's (`jax_call`) on the same
    inputs; the float inputs among `args` are differentiated."""

    id: str
    args: Callable[[], tuple]  # torch tensors (None allowed)
    torch_call: Callable
    jax_call: Callable
    grads: bool = True


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _ends():
    return torch.tensor([10, 10, 38], dtype=torch.int32)


CASES = [
    Case("add_broadcast", lambda: (_r(37, 53), _r(1, 53)), torch_pallas.add, tpj.add),
    Case("add_bf16", lambda: (_r(5, 37, dtype=torch.bfloat16), _r(5, 37, dtype=torch.bfloat16)),
         torch_pallas.add, tpj.add),
    Case("matmul_folded", lambda: (_r(3, 37, 53), _r(53, 29)), torch_pallas.matmul, tpj.matmul),
    Case("matmul_broadcast_batch", lambda: (_r(2, 1, 19, 21), _r(3, 21, 13)),
         torch_pallas.matmul, tpj.matmul),
    Case("matmul_bf16", lambda: (_r(37, 53, dtype=torch.bfloat16), _r(53, 29, dtype=torch.bfloat16)),
         torch_pallas.matmul, tpj.matmul),
    Case("matmul_vector", lambda: (_r(53), _r(4, 53, 29)), torch_pallas.matmul, tpj.matmul),
    Case("grouped_mm_bias", lambda: (_r(45, 40), _r(3, 40, 24), _ends(), _r(3, 24)),
         lambda a, b, e, c: torch_pallas.grouped_mm(a, b, offs=e, bias=c),
         lambda a, b, e, c: tpj.grouped_mm(a, b, e, c)),
    Case("grouped_mm_bf16_float32_out",
         lambda: (_r(45, 40, dtype=torch.bfloat16), _r(3, 40, 24, dtype=torch.bfloat16), _ends()),
         lambda a, b, e: torch_pallas.grouped_mm(a, b, offs=e, out_dtype=torch.float32),
         lambda a, b, e: tpj.grouped_mm(a, b, e, out_dtype=jnp.float32)),
    Case("rms_norm", lambda: (_r(5, 7, 96), _r(96)),
         lambda x, w: torch_pallas.rms_norm(x, (96,), w, 1e-6),
         lambda x, w: tpj.rms_norm(x, w, 1e-6)),
    Case("rms_norm_llama_bf16_no_weight", lambda: (_r(9, 130, dtype=torch.bfloat16),),
         lambda x: torch_pallas.rms_norm(x, (130,), casting_mode="llama"),
         lambda x: tpj.rms_norm(x, casting_mode="llama")),
    Case("rms_norm_gemma", lambda: (_r(11, 64), _r(64)),
         lambda x, w: torch_pallas.rms_norm(x, (64,), w, casting_mode="gemma"),
         lambda x, w: tpj.rms_norm(x, w, casting_mode="gemma")),
    Case("layer_norm", lambda: (_r(13, 100), _r(100), _r(100)),
         lambda x, w, b: torch_pallas.layer_norm(x, (100,), w, b),
         lambda x, w, b: tpj.layer_norm(x, w, b)),
    Case("layer_norm_no_affine", lambda: (_r(3, 5, 40),),
         lambda x: torch_pallas.layer_norm(x, (40,), eps=1e-3),
         lambda x: tpj.layer_norm(x, eps=1e-3)),
    Case("swiglu", lambda: (_r(9, 77), _r(9, 77)), torch_pallas.swiglu, tpj.swiglu),
    Case("rotary", lambda: (_r(2, 4, 11, 16), _r(2, 2, 11, 16), _r(1, 11, 16), _r(1, 11, 16)),
         torch_pallas.rotary_embedding, tpj.rotary_embedding),
    Case("attention_causal_gqa", lambda: (_r(2, 4, 37, 32), _r(2, 2, 37, 32), _r(2, 2, 37, 24)),
         lambda q, k, v: torch_pallas.attention(q, k, v, is_causal=True, enable_gqa=True),
         lambda q, k, v: tpj.attention(q, k, v, is_causal=True)),
    Case("attention_window_softcap_sinks",
         lambda: (_r(1, 4, 45, 16), _r(1, 4, 51, 16), _r(1, 4, 51, 16), _r(4)),
         lambda q, k, v, s: torch_pallas.attention(q, k, v, scale=0.3, window_size=(7, 3),
                                                   softcap=4.0, sinks=s),
         lambda q, k, v, s: tpj.attention(q, k, v, scale=0.3, window_size=(7, 3), softcap=4.0,
                                          sinks=s)),
    Case("attention_bf16_window_causal",
         lambda: tuple(_r(2, 2, 40, 32, dtype=torch.bfloat16) for _ in range(3)),
         lambda q, k, v: torch_pallas.attention(q, k, v, is_causal=True, window_size=(9, -1)),
         lambda q, k, v: tpj.attention(q, k, v, is_causal=True, window_size=(9, -1))),
    Case("varlen_attention",
         lambda: (_r(30, 4, 16), _r(33, 2, 16), _r(33, 2, 16),
                  torch.tensor([0, 5, 17, 30], dtype=torch.int32),
                  torch.tensor([0, 9, 20, 33], dtype=torch.int32)),
         lambda q, k, v, cq, ck: torch_pallas.varlen_attention(
             q, k, v, cq, ck, 13, 13, window_size=(-1, 0), enable_gqa=True),
         lambda q, k, v, cq, ck: tpj.varlen_attention(q, k, v, cq, ck, window_size=(-1, 0))),
    Case("linear_cross_entropy",
         lambda: (_r(70, 48), _r(300, 48) * 0.3, _r(300),
                  torch.where(torch.rand(70) < 0.2, -100, torch.randint(0, 300, (70,)))),
         lambda x, w, b, t: torch_pallas.linear_cross_entropy(x, w, t, b, label_smoothing=0.1),
         lambda x, w, b, t: tpj.linear_cross_entropy(x, w, t, b, label_smoothing=0.1)),
    # two whole chunks of 256 rows and 88 more; d_weight from the pass over
    # the vocabulary: two whole blocks of 128 classes and 44 more
    Case("linear_cross_entropy_chunks",
         lambda: (_r(600, 16), _r(300, 16), _r(300),
                  torch.where(torch.rand(600) < 0.1, -100, torch.randint(0, 300, (600,)))),
         lambda x, w, b, t: torch_pallas.linear_cross_entropy(x, w, t, b, reduction="sum",
                                                              label_smoothing=0.2),
         lambda x, w, b, t: tpj.linear_cross_entropy(x, w, t, b, reduction="sum",
                                                     label_smoothing=0.2)),
    Case("linear_cross_entropy_chunks_none_softcap_bf16",
         lambda: (_r(2, 300, 16, dtype=torch.bfloat16), _r(260, 16, dtype=torch.bfloat16),
                  torch.randint(0, 260, (2, 300))),
         lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, reduction="none",
                                                           softcap=3.0),
         lambda x, w, t: tpj.linear_cross_entropy(x, w, t, reduction="none", softcap=3.0)),
    Case("linear_cross_entropy_none_softcap_bf16",
         lambda: (_r(3, 21, 32, dtype=torch.bfloat16), _r(130, 32, dtype=torch.bfloat16),
                  torch.randint(0, 130, (3, 21))),
         lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, reduction="none",
                                                           softcap=5.0),
         lambda x, w, t: tpj.linear_cross_entropy(x, w, t, reduction="none", softcap=5.0)),
    Case("token_log_probs_entropy_temperature",
         lambda: (_r(3, 23, 48), _r(301, 48) * 0.3, _r(301),
                  torch.where(torch.rand(3, 23) < 0.2, -100, torch.randint(0, 301, (3, 23)))),
         lambda x, w, b, t: torch_pallas.token_log_probs(x, w, t, b, temperature=0.7,
                                                         return_entropy=True),
         lambda x, w, b, t: tpj.token_log_probs(x, w, t, b, temperature=0.7,
                                                return_entropy=True)),
    # two whole chunks of 256 rows and 88 more, d_weight from the pass over
    # the vocabulary; the log-probs alone, soft-capped
    Case("token_log_probs_chunks_softcap_bf16",
         lambda: (_r(600, 16, dtype=torch.bfloat16), _r(260, 16, dtype=torch.bfloat16),
                  torch.where(torch.rand(600) < 0.1, -100, torch.randint(0, 260, (600,)))),
         lambda x, w, t: torch_pallas.token_log_probs(x, w, t, softcap=3.0),
         lambda x, w, t: tpj.token_log_probs(x, w, t, softcap=3.0)),
    Case("token_log_probs_chunks_entropy",
         lambda: (_r(600, 16), _r(300, 16), _r(300),
                  torch.where(torch.rand(600) < 0.1, -100, torch.randint(0, 300, (600,)))),
         lambda x, w, b, t: torch_pallas.token_log_probs(x, w, t, b, temperature=1.3,
                                                         return_entropy=True),
         lambda x, w, b, t: tpj.token_log_probs(x, w, t, b, temperature=1.3,
                                                return_entropy=True)),
]


def _differentiable(args):
    return [i for i, a in enumerate(args) if a is not None and a.is_floating_point()]


def _assert_close(name, ours, theirs, dtype):
    theirs = theirs.detach().float()
    tol = TOLERANCE.get(dtype, 2e-5)
    if dtype == torch.float32:  # a chip's float32 exp and log are coarser than the CPU's
        tol *= calls.backend("test_jax_forms").float32_allowance
    scale = max(1.0, theirs.abs().max().item())
    err = (to_torch(ours) - theirs).abs().max().item() if theirs.numel() else 0.0
    assert err <= tol * scale, f"{name}: max |jax - torch| = {err:.3g} > {tol * scale:.3g}"


# Under jax.jit in the default run (each kernel is jitted either way; the
# eager calls add the checks of values known on the host, which the error
# test below covers), eagerly too with -m exhaustive.
@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.exhaustive), True],
                         ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_jax_form_matches_the_torch_op(case, jit):
    args = case.args()
    dtype = args[0].dtype
    diff = _differentiable(args) if case.grads else []
    leaves = [a.clone().requires_grad_(i in diff) if a is not None and a.is_floating_point()
              else a for i, a in enumerate(args)]
    out = case.torch_call(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [torch.randn(o.shape) for o in outs]  # a random linear function of the outputs
    torch.autograd.backward([o.float() * w for o, w in zip(outs, weights)],
                            [torch.ones(o.shape) for o in outs])

    jargs = [None if a is None else to_jax(a) for a in args]
    jweights = [to_jax(w) for w in weights]

    def loss(*differentiated):
        full = list(jargs)
        for i, a in zip(diff, differentiated):
            full[i] = a
        got = case.jax_call(*full)
        got = got if isinstance(got, tuple) else (got,)
        return sum((g.astype(jnp.float32) * w).sum() for g, w in zip(got, jweights)), got

    run = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(diff))), has_aux=True)) \
        if jit else jax.value_and_grad(loss, argnums=tuple(range(len(diff))), has_aux=True)
    (_, got), grads = run(*[jargs[i] for i in diff])
    for j, (o, t) in enumerate(zip(got, outs)):
        assert o.shape == tuple(t.shape)
        assert jnp.dtype(o.dtype).name == str(t.dtype).removeprefix("torch."), (o.dtype, t.dtype)
        _assert_close(f"output {j}", o, t, dtype)
    for i, g in zip(diff, grads):
        assert g.dtype == jargs[i].dtype
        _assert_close(f"gradient of argument {i}", g, leaves[i].grad, dtype)


def test_fill_and_iota_match_the_torch_ops():
    np.testing.assert_array_equal(np.asarray(tpj.fill((3, 129), -2.5)),
                                  torch_pallas.fill((3, 129), -2.5).numpy())
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda: tpj.iota(1000, jnp.int32))()),
                                  np.arange(1000))
    assert tpj.fill(7, 1.5, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("call, message", [
    (lambda: tpj.matmul(jnp.ones((3, 4)), jnp.ones((5, 2))), "torch_pallas.jax.matmul: a.shape"),
    (lambda: tpj.matmul(jnp.ones((3, 4)), jnp.ones((4, 2), jnp.bfloat16)), "dtype float32, b"),
    (lambda: tpj.rms_norm(jnp.ones((3, 4)), casting_mode="gemma"), "needs a weight"),
    (lambda: tpj.attention(jnp.ones((1, 3, 4, 8)), jnp.ones((1, 2, 4, 8)), jnp.ones((1, 2, 4, 8))),
     "dividing the query's"),
    (lambda: tpj.varlen_attention(jnp.ones((6, 2, 8)), jnp.ones((6, 2, 8)), jnp.ones((6, 2, 8)),
                                  jnp.array([0, 4, 2], jnp.int32), jnp.array([0, 3, 6], jnp.int32)),
     "cu_seq_q must start at 0, not decrease"),
    (lambda: tpj.linear_cross_entropy(jnp.ones((4, 8)), jnp.ones((5, 8)), jnp.array([0, 1, 9, 2])),
     "target holds 9"),
    (lambda: tpj.token_log_probs(jnp.ones((4, 8)), jnp.ones((5, 8)), jnp.array([0, 1, 9, 2])),
     "torch_pallas.jax.token_log_probs: target holds 9"),
    (lambda: tpj.token_log_probs(jnp.ones((4, 8)), jnp.ones((5, 8)), jnp.array([0, 1, 2, 2]),
                                 temperature=0.0),
     "torch_pallas.jax.token_log_probs: temperature=0.0"),
])
def test_bad_arguments_are_refused_before_any_kernel(call, message):
    with pytest.raises((ValueError, TypeError, IndexError), match=message):
        call()


def test_a_backend_of_another_family_is_refused():
    with torch_pallas.backend("mosaic_gpu_interpret"):
        with pytest.raises(torch_pallas.BackendError, match="runs the TPU kernels"):
            tpj.swiglu(jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_int32_add_and_64_bit_dtypes():
    x = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(tpj.add(x, x[:1])), np.asarray(x + x[:1]))
    if not jax.config.jax_enable_x64:  # JAX would narrow them to 32 bits: refused
        with pytest.raises(TypeError, match="torch_pallas.jax.iota: dtype=int64 needs JAX's 64-bit"):
            tpj.iota(5, jnp.int64)
        with pytest.raises(TypeError, match="torch_pallas.jax.fill: dtype=float64"):
            tpj.fill((2,), 1.0, "float64")
