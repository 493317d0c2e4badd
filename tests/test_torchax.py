"""torch_pallas in torchax (torch tensors backed by JAX arrays): every op
through `torch_pallas.torchax.register()` on "jax" tensors, values and torch
autograd's gradients against the same call on CPU tensors; a Llama and a
Mixtral (transformers, from config) with attn_implementation="pallas" and
`apply()`, their logits and every parameter's gradient (JAX's, through
torchax.extract_jax) eagerly and under jax.jit, and their logits through
`torchax.compile`, against the same model on torch CPU.

The tests marked `torchax` need torchax (0.0.13 imports on torch < 2.13);
CI runs them in a venv of their own: pytest -m torchax tests/test_torchax.py.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import torch_pallas
import torch_pallas.torchax


def test_registration_says_why_torchax_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchax", None)  # `import torchax` raises ImportError
    with pytest.raises(ImportError, match=r"torch_pallas.torchax.register: torchax does not "
                                          r"import here \(torch .*torch < 2.13"):
        torch_pallas.torchax.register()


@pytest.fixture(scope="module")
def env():
    import torchax  # the tests marked `torchax` run where it is installed (CI's leg 3)

    return torch_pallas.torchax.register(torchax.default_env())


def _cases():
    from test_jax_forms import CASES

    return CASES


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@pytest.mark.torchax
@pytest.mark.parametrize("case", _cases(), ids=[c.id for c in _cases()])
def test_each_op_on_jax_tensors_with_torch_autograd(env, case):
    args = case.args()
    diff = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    leaves = [a.clone().requires_grad_(i in diff) if i in diff else a for i, a in enumerate(args)]
    out = case.torch_call(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [torch.randn(o.shape) for o in outs]
    sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
    with env:
        jleaves = [_to(a, "jax").requires_grad_() if i in diff else _to(a, "jax")
                   for i, a in enumerate(args)]
        got = case.torch_call(*jleaves)
        gots = got if isinstance(got, tuple) else (got,)
        sum((g.float() * w.to("jax")).sum() for g, w in zip(gots, weights)).backward()
        values = [g.to("cpu") for g in gots]
        grads = [jleaves[i].grad.to("cpu") for i in diff]
    tol = 2e-2 if args[0].dtype == torch.bfloat16 else 2e-5
    for g, o in zip(values, outs):
        assert g.dtype == o.dtype and g.shape == o.shape
        torch.testing.assert_close(g.float(), o.detach().float(), rtol=tol, atol=tol)
    for i, g in zip(diff, grads):
        torch.testing.assert_close(g.float(), leaves[i].grad.float(), rtol=tol, atol=tol)


@pytest.mark.torchax
def test_an_argument_the_forms_do_not_take_is_refused_by_name(env):
    q = torch.randn(1, 2, 5, 8)
    with env, pytest.raises(NotImplementedError, match="pallas::attention: under torchax attn_mask"
                            r".*served as packed sequences: torch_pallas.jax.attention\(padding_mask"):
        torch_pallas.attention(q.to("jax"), q.to("jax"), q.to("jax"),
                               attn_mask=torch.ones(5, 5, dtype=torch.bool).to("jax"))


COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128)
FAMILIES = {"llama": {}, "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


@pytest.mark.torchax
@pytest.mark.parametrize("family", FAMILIES)
def test_a_patched_model_trains_in_torchax_as_on_cpu(env, family):
    import jax
    import torchax
    import transformers

    import torch_pallas.transformers

    config = transformers.AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch_pallas.transformers.register()
    experts = {"experts_implementation": "pallas"} if family == "mixtral" else {}
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="pallas", **experts).train()
    report = torch_pallas.transformers.apply(model)
    assert report.attention and report.cross_entropy and report.rms_norm and report.rotary
    assert report.experts if family == "mixtral" else report.swiglu
    ids = torch.randint(0, COMMON["vocab_size"], (2, 11))
    logits = model(input_ids=ids).logits.detach()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}

    states, call = torchax.extract_jax(model)
    ids_jax = jax.numpy.asarray(ids.numpy())

    def jax_logits(states, ids):
        return call(states, (), {"input_ids": ids}).logits

    def jax_loss(states, ids):
        return call(states, (), {"input_ids": ids, "labels": ids}).loss

    for run in (lambda f: f, jax.jit):  # eagerly, then compiled
        np.testing.assert_allclose(run(jax_logits)(states, ids_jax), logits.numpy(),
                                   rtol=1e-5, atol=1e-5)
        value, jax_grads = run(jax.value_and_grad(jax_loss))(states, ids_jax)
        np.testing.assert_allclose(value, loss.item(), rtol=1e-6)
        assert set(grads) <= set(jax_grads)
        for name, grad in grads.items():
            np.testing.assert_allclose(jax_grads[name], grad.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=name)

    with env:  # jax.jit returns JAX types: the logits, not transformers' ModelOutput
        compiled = torchax.compile(Logits(model).to("jax"))
        out = compiled(ids.to("jax"))
        np.testing.assert_allclose(out.to("cpu").numpy(), logits.numpy(), rtol=1e-5, atol=1e-5)


class LogProbs(torch.nn.Module):
    """A GRPO-like loss on torch_pallas.transformers.token_log_probs:
    (loss, log-probs, entropies)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, weights):
        import torch_pallas.transformers

        log_probs, entropy = torch_pallas.transformers.token_log_probs(
            self.model, input_ids, attention_mask, temperature=0.7, return_entropy=True)
        return (weights[0] * log_probs).sum() + 0.1 * (weights[1] * entropy).sum(), log_probs, \
            entropy


@pytest.mark.torchax
def test_a_patched_models_token_log_probs_in_torchax_as_on_cpu(env):
    """torch_pallas.transformers.token_log_probs of a left-padded batch
    through a tiny Llama with attn_implementation="pallas" and `apply()`,
    a loss mixing log-probs and entropies at a temperature: values (at the
    positions a real token predicts from) and every parameter's gradient
    (JAX's, through torchax.extract_jax) eagerly and under jax.jit, against
    the same call on torch CPU."""
    import jax
    import torchax
    import transformers

    import torch_pallas.transformers
    from padded_models import padding_of

    length = 11
    config = transformers.AutoConfig.for_model(
        "llama", **{**COMMON, "vocab_size": 97, "initializer_range": 0.2})
    torch_pallas.transformers.register()
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="pallas").train()
    assert torch_pallas.transformers.apply(model).attention
    wrapped = LogProbs(model)
    ids = torch.randint(0, 97, (2, length))
    mask = padding_of([(4, length - 4), (0, length)], length)
    real = mask[:, :-1].bool()  # position i predicts token i + 1
    weights = torch.randn(2, 2, length - 1) * real
    loss, log_probs, entropy = wrapped(ids, mask, weights)
    loss.backward()
    grads = {name: p.grad for name, p in wrapped.named_parameters()}

    states, call = torchax.extract_jax(wrapped)
    arrays = [jax.numpy.asarray(t.numpy()) for t in (ids, mask, weights)]

    def jax_loss(states, *arrays):
        loss, log_probs, entropy = call(states, arrays, {})
        return loss, (log_probs, entropy)

    for run in (lambda f: f, jax.jit):  # eagerly, then compiled
        (value, outs), jax_grads = run(jax.value_and_grad(jax_loss, has_aux=True))(states,
                                                                                  *arrays)
        for got, expected in zip(outs, (log_probs, entropy)):
            assert got.shape == expected.shape and got.dtype == jax.numpy.float32
            np.testing.assert_allclose(np.asarray(got)[real.numpy()],
                                       expected.detach()[real].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, loss.item(), rtol=1e-5, atol=1e-5)
        assert set(grads) <= set(jax_grads)
        for name, grad in grads.items():
            np.testing.assert_allclose(jax_grads[name], grad.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=name)


@pytest.mark.torchax
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss", "mixtral"])
def test_a_padded_batch_under_jax_jit_matches_the_eager_model(env, family):
    """A tokenizer's attention_mask under jax.jit (torchax.extract_jax), the
    mask traced: a padded batch (left, right and both sides) and an all-ones
    mask, one compilation for both. Logits at real tokens, the loss and
    every gradient (jax.value_and_grad) equal those of the same model on
    attn_implementation="eager" in torch; the attention takes the padded
    path (no dense mask reaches the refusing JAX-side forms)."""
    import jax
    import torchax

    from padded_models import (MODEL_PADDING, TOKENS, VOCAB, compare, gradients, labels_for,
                               model_pair, train_step)

    reference, ours = model_pair(family)
    ids = torch.randint(3, VOCAB, (3, TOKENS))
    masks = {"padded": MODEL_PADDING, "ones": torch.ones_like(MODEL_PADDING)}
    expected = {}
    for name, mask in masks.items():
        logits, loss = train_step(reference, ids, mask)
        loss.backward()
        expected[name] = (logits.detach(), loss.detach(), gradients(reference), mask.bool())

    states, call = torchax.extract_jax(ours)
    traced = []

    def jax_loss(states, ids, mask, labels):
        traced.append(1)
        return call(states, (), {"input_ids": ids, "attention_mask": mask,
                                 "labels": labels}).loss

    logits_of = jax.jit(lambda states, ids, mask: call(
        states, (), {"input_ids": ids, "attention_mask": mask}).logits)
    step = jax.jit(jax.value_and_grad(jax_loss))
    for name, mask in masks.items():
        ids_jax, mask_jax, labels = (jax.numpy.asarray(t.numpy())
                                     for t in (ids, mask, labels_for(ids, mask)))
        value, jax_grads = step(states, ids_jax, mask_jax, labels)
        grads = {n: torch.from_numpy(np.asarray(jax_grads[n])) for n in expected[name][2]}
        logits = torch.from_numpy(np.asarray(logits_of(states, ids_jax, mask_jax)))
        compare(family, logits, torch.tensor(float(value)), grads, expected[name])
    assert len(traced) == 1  # the mask is data: one trace for both


@pytest.mark.torchax
def test_the_factory_ops_make_jax_tensors(env):
    with env:
        filled = torch_pallas.fill((3, 129), -2.5)
        counted = torch_pallas.iota(70, dtype=torch.int32)
        assert filled.device.type == "jax" and counted.dtype == torch.int32
        torch.testing.assert_close(filled.to("cpu"), torch.full((3, 129), -2.5))
        torch.testing.assert_close(counted.to("cpu"), torch.arange(70, dtype=torch.int32))
        with pytest.raises(TypeError, match="dtype=int64 needs JAX's 64-bit mode"):
            torch_pallas.iota(5)  # torch's default, int64: not narrowed to int32
