"""Padded batches as data the kernels already take: a (B, S) padding mask
(a tokenizer's attention_mask) folded into packed sequences
(ops/attention_spans.py, padded_batch_sequences), never a dense (L, S) mask.

- the torch path (transformers' `padded_attention`) on every CPU backend,
  and the Triton kernels on the sequences it builds, against a float64
  reference made from the padding mask itself: values and gradients,
  ragged lengths, left, right and both-sides padding;
- `torch_pallas.jax.attention(padding_mask=...)`, eagerly and under
  jax.jit with the mask traced, on the TPU family's interpreter and
  simulator;
- models on attn_implementation="pallas" (Llama, Mistral's window, Gemma
  2's softcap and window, gpt-oss's sinks after apply(), Mixtral) against
  the same model on "eager": a padded batch and an all-ones mask, eagerly
  and under torch.compile(fullgraph=True): logits at real tokens, the
  loss and every gradient, with no (tokens x tokens) tensor made;
- a mask with holes (a row's real tokens not one run): served densely
  where its values can be read, NaN in its rows where they cannot.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import padded_models
import torch_pallas
from attention_reference import Case, bound, run_kernel, torch_error
from padded_models import (FAMILIES, MODEL_PADDING, TOKENS, VOCAB, Squares, compare,
                           gradients, model_pair, train_step)
from torch_pallas.ops import attention_spans
from torch_pallas.transformers import attention as hf_attention

LENGTH = 21  # no multiple of any block
TRITON = "torch_pallas.kernels.triton."
# torch.compile's backend for the models: inductor for one family (its
# codegen of the fold's reductions and scans), aot_eager for the others
# (Dynamo's fullgraph capture and AOT autograd, without inductor's minutes).
COMPILE_BACKEND = {"llama": "inductor"}


def padding_of(rows, length=LENGTH) -> torch.Tensor:
    return padded_models.padding_of(rows, length)


# left-padded, right-padded, both sides, unpadded: four lengths
RAGGED = padding_of([(6, 15), (0, 9), (3, 13), (0, LENGTH)])


def reference_padded(q, k, v, padding, *, causal=True, left=-1, softcap=0.0, sinks=None):
    """float64: real tokens see their row's real tokens (causal, window of
    `left` keys back); a padding token's row is 0."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    real = padding.bool()
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None]
    seen = real[:, None, :, None] & real[:, None, None, :]
    if causal:
        seen = seen & (j <= i)
    if left >= 0:
        seen = seen & (j >= i - left)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :k.shape[2]]
    out = p @ v
    return out.masked_fill(~seen.any(-1, keepdim=True), 0.0)


def _inputs(b, hq=4, hkv=2, length=LENGTH, d=16, dtype=torch.float32):
    return (torch.randn(b, hq, length, d, dtype=dtype), torch.randn(b, hkv, length, d, dtype=dtype),
            torch.randn(b, hkv, length, d, dtype=dtype))


# (id, padded_attention keywords): causal GQA, a window, softcap and sinks
OPTIONS = {
    "causal": dict(),
    "window": dict(window=5),
    "softcap_sinks": dict(softcap=4.0, sinks=True),
}


def _padded(q, k, v, padding, window=None, softcap=0.0, sinks=None):
    """transformers' padded path, (B, H, L, Dv) as the reference gives it."""
    out = hf_attention.padded_attention(q, k, v, padding, 0.0, None, window, softcap, sinks)
    return out.transpose(1, 2)


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
def test_padded_attention_matches_float64_on_every_cpu_backend(cpu_backend, options):
    keywords = dict(OPTIONS[options])
    # Mosaic GPU's attention is on the Tensor Cores: 16-bit inputs only
    dtype = torch.bfloat16 if cpu_backend.startswith("mosaic_gpu") else torch.float32
    atol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    q, k, v = (t.requires_grad_() for t in _inputs(4, dtype=dtype))
    sinks = (torch.randn(4, dtype=dtype, requires_grad=True) if keywords.pop("sinks", False)
             else None)
    out = _padded(q, k, v, RAGGED, sinks=sinks, **keywords)
    window = keywords.get("window")
    left = window - 1 if window else -1
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    sd = None if sinks is None else sinks.detach().double().requires_grad_()
    expected = reference_padded(qd, kd, vd, RAGGED, left=left,
                                softcap=keywords.get("softcap", 0.0), sinks=sd)
    torch.testing.assert_close(out.double(), expected, rtol=atol / 2, atol=atol)
    grad = torch.randn_like(out)
    differentiated = (q, k, v) + (() if sinks is None else (sinks,))
    got = torch.autograd.grad(out, differentiated, grad)
    wanted = torch.autograd.grad(expected, (qd, kd, vd) + (() if sd is None else (sd,)),
                                 grad.double())
    for name, g, w in zip("q k v sinks".split(), got, wanted):
        torch.testing.assert_close(g.double(), w, rtol=5 * atol, atol=2.5 * atol, msg=name)
    # padding tokens' rows: zeros, and no gradient reaches their queries
    padded_rows = ~RAGGED.bool()
    assert torch.equal(out.transpose(1, 2)[padded_rows], torch.zeros_like(
        out.transpose(1, 2)[padded_rows]))
    assert torch.equal(got[0].transpose(1, 2)[padded_rows],
                       torch.zeros_like(got[0].transpose(1, 2)[padded_rows]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_on_a_padded_batchs_sequences(dtype):
    """The Triton kernels (their CPU interpreter) on the spans a folded
    padded batch gives, causal with a window: out and the gradients,
    unfolded, against the float64 reference of the padding mask, within
    twice torch's own error."""
    b, hq, hkv, d = RAGGED.shape[0], 2, 1, 32
    q, k, v = _inputs(b, hq, hkv, d=d, dtype=dtype)
    cu_q, cu_k, holes = attention_spans.padded_batch_sequences(RAGGED)
    assert not holes.any()
    spans = attention_spans.sequence_spans(cu_q, cu_k, b * LENGTH, 3, 0)

    def fold(t):
        return t.transpose(0, 1).reshape(1, t.shape[1], b * LENGTH, d)

    case = Case(fold(q), fold(k), fold(v), None, False, d ** -0.5, spans=spans)
    out, lse = run_kernel(TRITON + "attention", "triton", case.inputs, **case.params)
    do = torch.randn_like(out)
    grads = run_kernel(TRITON + "attention_backward", "triton",
                       (case.q, case.k, case.v, out, do, lse, *case.backward_extra),
                       **case.params)
    (ref_out, _, ref_grads), errors = torch_error(case, do)
    # the fold's reference is the padding mask's (the spans are checked, not trusted)
    expected = reference_padded(q, k, v, RAGGED, left=3)
    torch.testing.assert_close(fold(expected), ref_out, rtol=1e-9, atol=1e-9)
    for name, got, want, err in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                    (ref_out, *ref_grads), errors):
        excess = (got.double() - want).abs() - bound(err, dtype)
        assert excess.max() <= 0, f"{name}: {excess.max()}"


# --- torch_pallas.jax.attention(padding_mask=...) -------------------------------------

@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
def test_jax_attention_with_a_padding_mask_matches_float64(backend):
    """Values and every gradient (q, k, v, sinks) against the float64
    reference, the mask traced under jax.jit (three masks, all ones among
    them, one compilation),
    GQA, a window, softcap and sinks; bool and integer masks."""
    import jax
    import jax.numpy as jnp

    import torch_pallas.jax as tpj

    q, k, v = _inputs(4)
    sinks = torch.randn(4)
    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v, sinks)]
    compiled = []

    def loss(q, k, v, sinks, mask, g):
        compiled.append(1)  # traced once per shape and dtype
        out = tpj.attention(q, k, v, is_causal=True, window_size=(6, -1), softcap=5.0,
                            sinks=sinks, padding_mask=mask)
        return (out * g).sum(), out

    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))
    masks = (RAGGED, padding_of([(0, LENGTH), (10, 11), (0, 1), (2, 17)]),
             torch.ones(4, LENGTH, dtype=torch.long))  # lax.cond's unpadded branch
    with torch_pallas.backend(backend):
        for mask in masks:
            g = torch.randn(4, 4, LENGTH, 16)
            (_, out), grads = grad(*arrays, jnp.asarray(mask.numpy()), jnp.asarray(g.numpy()))
            tensors = [t.double().requires_grad_() for t in (q, k, v, sinks)]
            expected = reference_padded(*tensors[:3], mask, left=6, softcap=5.0,
                                        sinks=tensors[3])
            np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=1e-5,
                                       atol=2e-5)
            wanted = torch.autograd.grad(expected, tensors, g.double())
            for name, got, want in zip("q k v sinks".split(), grads, wanted):
                np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-4, atol=5e-5,
                                           err_msg=name)
        out = jax.jit(lambda q, k, v, m: tpj.attention(q, k, v, padding_mask=m))(
            *arrays[:3], jnp.asarray(RAGGED.bool().numpy()))
    assert len(compiled) == 1
    expected = reference_padded(q, k, v, RAGGED, causal=False)
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), rtol=1e-5, atol=2e-5)


def test_jax_padding_mask_refusals_and_holes():
    import jax
    import jax.numpy as jnp

    import torch_pallas.jax as tpj

    q = jnp.asarray(torch.randn(2, 2, 7, 8).numpy())
    holed = jnp.asarray([[1, 1, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"padding_mask's real tokens must be one run.*rows \[0\]"):
        tpj.attention(q, q, q, padding_mask=holed)
    with pytest.raises(ValueError, match=r"padding_mask must be \(B, L\) = \(2, 7\)"):
        tpj.attention(q, q, q, padding_mask=holed[:, :5])
    with pytest.raises(TypeError, match="padding_mask must be bool or integers, got float32"):
        tpj.attention(q, q, q, padding_mask=holed.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"as many keys as queries"):
        tpj.attention(q, q[:, :, :5], q[:, :, :5], padding_mask=holed)
    # traced, the holes cannot be read: that row is NaN, the other exact
    out = jax.jit(lambda q, m: tpj.attention(q, q, q, is_causal=True, padding_mask=m))(q, holed)
    assert np.isnan(np.asarray(out[0])).all()
    expected = reference_padded(*(torch.from_numpy(np.asarray(q)),) * 3,
                                torch.from_numpy(np.asarray(holed)))[1]
    np.testing.assert_allclose(np.asarray(out[1]), expected.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_padded_batch_and_an_all_ones_mask_match_eager(family, monkeypatch):
    """Eagerly and under torch.compile(fullgraph=True) (one graph for both
    masks: the mask is data): logits at real tokens, the loss over them and
    every gradient equal the eager model's; each attention call takes the
    padded path (a (B, S) mask, five sequences a row), and no tokens x
    tokens tensor is made eagerly."""
    reference, ours = model_pair(family)
    ids = torch.randint(3, VOCAB, (3, TOKENS))
    ones = torch.ones_like(MODEL_PADDING)
    expected = {}
    for name, mask in (("padded", MODEL_PADDING), ("ones", ones)):
        logits, loss = train_step(reference, ids, mask)
        loss.backward()
        expected[name] = (logits.detach(), loss.detach(), gradients(reference), mask.bool())

    folded = []  # the padding masks the attention layers were given
    real_fold = hf_attention.padded_attention
    monkeypatch.setattr(hf_attention, "padded_attention",
                        lambda q, k, v, padding, *rest: folded.append(tuple(padding.shape))
                        or real_fold(q, k, v, padding, *rest))
    with Squares(TOKENS) as squares:
        logits, loss = train_step(ours, ids, MODEL_PADDING)
    loss.backward()
    assert not squares.seen, squares.seen[:3]
    layers = ours.config.num_hidden_layers
    assert folded and set(folded) == {(3, TOKENS)} and len(folded) % layers == 0
    calls = len(folded)
    compare(family, logits.detach(), loss.detach(), gradients(ours), expected["padded"])
    # eagerly an all-ones mask is read (a plain CPU tensor): no mask at all
    logits, loss = train_step(ours, ids, ones)
    loss.backward()
    assert len(folded) == calls
    compare(family, logits.detach(), loss.detach(), gradients(ours), expected["ones"])

    torch.compiler.reset()  # each family's compile its own (one code object for all)
    compiled = torch.compile(lambda i, m: train_step(ours, i, m), fullgraph=True,
                             backend=COMPILE_BACKEND.get(family, "aot_eager"))
    for name, mask in (("padded", MODEL_PADDING), ("ones", ones)):
        logits, loss = compiled(ids, mask)
        loss.backward()
        compare(family, logits.detach(), loss.detach(), gradients(ours), expected[name])


def test_a_mask_with_holes_is_served_densely_eagerly_and_poisons_its_rows_traced():
    """A row whose real tokens are not one run: eagerly (values readable)
    the dense SDPA mask, exact; under torch.compile that row's outputs are
    NaN (nothing else can say so without reading the mask; the next layer
    may spread them across the batch, whose rows share the folded row's
    blocks)."""
    reference, ours = model_pair("llama")
    reference.eval(), ours.eval()
    ids = torch.randint(3, VOCAB, (2, TOKENS))
    mask = padding_of([(0, TOKENS), (2, 11)], TOKENS)
    mask[0, 4] = 0  # a hole
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
        compiled = torch.compile(lambda i, m: ours(input_ids=i, attention_mask=m).logits,
                                 fullgraph=True)
        got = compiled(ids, mask)
    assert torch.isnan(got[0]).all()


def test_the_integrations_load_when_first_named():
    """`import torch_pallas` then `torch_pallas.torchax` (as the README
    writes it), `.torch_tpu`, `.jax` and `.transformers`: each module,
    loaded on first use; JAX not imported before."""
    import subprocess
    import sys

    code = ("import sys, torch_pallas\n"
            "assert 'jax' not in sys.modules\n"
            "names = ('torchax', 'torch_tpu', 'jax', 'transformers')\n"
            "assert set(names) <= set(dir(torch_pallas))\n"
            "mods = [getattr(torch_pallas, n) for n in names]\n"
            "print(' '.join(m.__name__ for m in mods), callable(torch_pallas.torchax.register))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["torch_pallas.torchax", "torch_pallas.torch_tpu",
                                  "torch_pallas.jax", "torch_pallas.transformers", "True"]
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        torch_pallas.nothing  # noqa: B018
