"""experts_implementation="pallas" (torch_pallas/transformers/experts.py)
against transformers' "eager" experts: tiny Mixtral, Qwen2-MoE (with its
shared expert), Qwen3-MoE and gpt-oss (biases, weights stored transposed,
its clamped interleaved gate) built from configs (two layers, hidden 32,
4-8 experts, top-2): eval logits, the training loss, every parameter's
gradient and 5 AdamW steps; the experts module alone with experts that
receive no token (the first and the last among them) and expert
parallelism's sentinel ids; that neither aten::_grouped_mm nor
transformers' fallback runs, forward or backward; set_experts_implementation
and from_config; apply's experts line, its refusal of weights grouped_mm
does not take, and a transformers without the experts interface.
The default CPU backend only: grouped_mm's own tests cover the others."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import torch_pallas
import torch_pallas.transformers
from torch_pallas.transformers import experts as pallas_experts
from torch_pallas.transformers import patching

torch_pallas.transformers.register()

VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)

WIDTH = 40  # each expert's intermediate size (the kernels built for one family serve the next)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SIZES, intermediate_size=WIDTH, num_local_experts=6, num_experts_per_tok=2),
    # one shared expert beside the routed ones
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SIZES, intermediate_size=48, moe_intermediate_size=WIDTH,
        shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SIZES, head_dim=8, intermediate_size=48, moe_intermediate_size=WIDTH, num_experts=8,
        num_experts_per_tok=2),
    # (G, K, N) weights, biases, interleaved gate and up clamped to its limit
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SIZES, head_dim=8, intermediate_size=WIDTH, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, swiglu_limit=1.5, layer_types=["sliding_attention", "full_attention"]),
}
BATCH = (2, 9)  # token ids of the models' tests; the experts module's get as many tokens
TOKENS = BATCH[0] * BATCH[1]
LR = 1e-3  # AdamW's


def model(family: str, experts_implementation: str) -> transformers.PreTrainedModel:
    """A tiny model whose experts' weights and biases are drawn anew (a
    fresh model's biases are zeros, its weights small): the gate's clamp
    binds (gpt-oss), and what the experts compute shows in the logits."""
    built = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[family](), attn_implementation="eager",
        experts_implementation=experts_implementation)
    with torch.no_grad():
        for m in built.modules():
            if patching._dispatches_experts(type(m)):
                for parameter in m.parameters():
                    parameter.normal_(0, 0.5 if parameter.dim() == 3 else 0.3)
    return built


def pair(family: str):
    """The same model (same weights) on the "eager" and "pallas" experts."""
    reference = model(family, "eager")
    ours = copy.deepcopy(reference)
    ours.set_experts_implementation(pallas_experts.NAME)
    return reference, ours


def experts_of(m: torch.nn.Module) -> list[torch.nn.Module]:
    return [e for e in m.modules() if patching._dispatches_experts(type(e))]


def assert_gradients_match(ours, reference, rtol=1e-5):
    expected = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        ref = expected[name].grad
        if ref is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, ref, rtol=rtol, atol=rtol * ref.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("family", CONFIGS)
def test_logits_loss_gradients_and_adamw_steps_match_eager_experts(family):
    reference, ours = pair(family)
    assert [e.config._experts_implementation for e in experts_of(ours)] == ["pallas"] * 2
    assert [e.config._experts_implementation for e in experts_of(reference)] == ["eager"] * 2
    ids = torch.randint(0, VOCAB, BATCH)

    for m in (reference, ours):
        m.eval()
    with torch.no_grad():
        expected, got = (m(input_ids=ids).logits for m in (reference, ours))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    def training_step(m, optimizer):
        m.train()
        optimizer.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (reference, ours)]
    for step in range(5):
        with Ops() as ops:
            losses = [training_step(reference, optimizers[0])]
        assert ops.names & EXPERTS_OPS == set()  # the eager experts: torch's ops
        with Ops() as ops:
            losses.append(training_step(ours, optimizers[1]))
        # neither torch's grouped GEMM nor transformers' fallback, forward or
        # backward; the Pallas ops instead (swiglu where the gate is SiLU's)
        swiglu = PALLAS_SWIGLU if family != "gpt_oss" else set()
        assert ops.names & EXPERTS_OPS == PALLAS_GROUPED | swiglu, ops.names & EXPERTS_OPS
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, msg=f"step {step}")
        if step == 0:
            assert_gradients_match(ours, reference)
        for optimizer in optimizers:
            optimizer.step()
    # AdamW moves a weight by up to lr a step whatever its gradient's size, so
    # one whose gradient is near zero in a step carries float32 reassociation
    # further than the rest: 1% of the 5 steps' largest move (seen: 0.2%).
    expected = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-2 * 5 * LR, msg=name)


def routing(module: torch.nn.Module, used: list[int], sentinel: bool = False):
    """Random hidden states, top-2 expert ids drawn from `used` only (two
    different ones per token) and softmax weights, all requiring grad; with
    `sentinel`, every third token's second pair has expert parallelism's
    sentinel id (num_experts) and weight 0."""
    hidden = torch.randn(TOKENS, module.gate_up_proj.shape[-1 if not module.is_transposed else 1])
    choice = torch.stack([torch.randperm(len(used))[:2] for _ in range(TOKENS)])
    index = torch.tensor(used)[choice]
    weights = torch.randn(TOKENS, 2).softmax(-1)
    if sentinel:
        index[::3, 1] = module.num_experts
        weights[::3, 1] = 0.0
    return hidden.requires_grad_(), index, weights.requires_grad_()


def assert_close(got, expected, msg=None):
    """float32 reassociation, relative to the values' size."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale, msg=msg)


def forward_and_gradients(function, module, hidden, index, weights):
    module.zero_grad()
    hidden.grad = weights.grad = None
    out = function(module, hidden, index, weights)
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(7)))
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), hidden.grad.clone(), weights.grad.clone(), grads


def eager_forward(module):
    """The module's own forward (transformers' eager experts), under the
    interface's dispatch."""
    return type(module).forward.__wrapped__


@pytest.mark.parametrize("family", CONFIGS)
def test_experts_that_receive_no_token(family):
    """The first and the last experts, and one between where there are more
    than 4, get no pair: their
    weights' gradients are exactly zero, everything else matches eager."""
    module = experts_of(model(family, "eager"))[0]
    count = module.num_experts
    unused = {0, count - 1} | ({count // 2} if count > 4 else set())
    used = [e for e in range(count) if e not in unused]
    hidden, index, weights = routing(module, used)
    expected = forward_and_gradients(eager_forward(module), module, hidden, index, weights)
    got = forward_and_gradients(pallas_experts.experts_forward, module, hidden, index, weights)
    for what, g, e in zip(("output", "hidden", "weights"), got[:3], expected[:3]):
        assert_close(g, e, msg=what)
    for name, grad in got[3].items():
        assert_close(grad, expected[3][name], msg=name)
        for e in unused:
            assert not grad[e].any(), (name, e)


def test_sentinel_ids_of_expert_parallelism_are_dropped():
    """Pairs with the sentinel id (>= num_experts, weight 0) add nothing to
    the output or any gradient, the router's weight included; the rest is
    eager's on the pairs without them."""
    module = experts_of(model("mixtral", "eager"))[0]
    module._is_expert_parallel = True
    hidden, index, weights = routing(module, list(range(module.num_experts)), sentinel=True)
    got = forward_and_gradients(pallas_experts.experts_forward, module, hidden, index, weights)
    # eager on the same pairs, the sentinels' weights zero and their ids an expert's
    valid = index < module.num_experts
    expected = forward_and_gradients(eager_forward(module), module, hidden,
                                     index.where(valid, 1), weights)
    for what, g, e in zip(("output", "hidden"), got[:2], expected[:2]):
        assert_close(g, e, msg=what)
    assert_close(got[2][valid], expected[2][valid], msg="weights")
    assert not got[2][~valid].any()
    for name, grad in got[3].items():
        assert grad.isfinite().all(), name
        assert_close(grad, expected[3][name], msg=name)


class Ops(TorchDispatchMode):
    """The names of the ops that run under it (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


TORCH_GROUPED = {"aten::_grouped_mm", "transformers::grouped_mm_fallback",
                 "transformers::grouped_mm_fallback_backward"}
PALLAS_GROUPED = {"pallas::grouped_mm", "pallas::grouped_mm_backward"}
PALLAS_SWIGLU = {"pallas::swiglu", "pallas::swiglu_backward"}
# the ops that could run the models' experts (their dense layers stay on torch)
EXPERTS_OPS = TORCH_GROUPED | PALLAS_GROUPED | PALLAS_SWIGLU


def test_the_dispatch_check_sees_torch_grouped_mm():
    """What the models' test asserts absent under "pallas" is seen, forward
    and backward, where transformers' default "grouped_mm" experts run."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    module = experts_of(model("mixtral", "eager"))[0]
    hidden, index, weights = routing(module, list(range(module.num_experts)))
    with Ops() as ops:
        grouped_mm_experts_forward(module, hidden, index, weights).sum().backward()
    assert ops.names & TORCH_GROUPED, sorted(ops.names)


def test_from_config_and_set_experts_implementation():
    ids = torch.randint(0, VOCAB, BATCH)
    m = model("qwen3_moe", "pallas").eval()
    assert m.config._experts_implementation == "pallas"  # what get_experts_implementation reads (5.1x on)
    with torch.no_grad(), Ops() as ops:
        on_pallas = m(input_ids=ids).logits
    assert "pallas::grouped_mm" in ops.names
    m.set_experts_implementation("eager")
    with torch.no_grad(), Ops() as ops:
        on_eager = m(input_ids=ids).logits
    assert "pallas::grouped_mm" not in ops.names
    torch.testing.assert_close(on_pallas, on_eager, rtol=1e-5, atol=1e-5)
    m.set_experts_implementation("pallas")
    assert [e.config._experts_implementation for e in experts_of(m)] == ["pallas"] * 2


def test_apply_reports_the_experts_line():
    reference = model("qwen2_moe", "eager")
    ours = copy.deepcopy(reference)
    report = torch_pallas.transformers.apply(ours)
    assert report.experts == 2 and ours.config._experts_implementation == "pallas"
    line = '  experts         2  MoE experts modules on experts_implementation="pallas"'
    assert line in str(report)
    ids = torch.randint(0, VOCAB, BATCH)
    reference.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)

    off = model("mixtral", "eager")
    report = torch_pallas.transformers.apply(off, experts=False)
    assert report.experts is None and "  experts       off" in str(report)
    assert off.config._experts_implementation == "eager"


def test_apply_leaves_experts_grouped_mm_cannot_take_alone():
    """Weights that are not float32/16-bit 3-D tensors (quantized experts)
    keep every experts module of the model on its implementation."""
    m = model("mixtral", "eager")
    layer = experts_of(m)[1]
    layer.down_proj = torch.nn.Parameter(torch.zeros(layer.down_proj.shape, dtype=torch.int8),
                                         requires_grad=False)
    report = torch_pallas.transformers.apply(m)
    assert report.experts == 0 and m.config._experts_implementation == "eager"
    assert any("experts (MixtralExperts): its down_proj is a 3-D torch.int8 tensor" in item
               and "2 experts modules keep their implementation" in item
               for item in report.left_alone), report.left_alone


def test_a_transformers_without_the_experts_interface(monkeypatch):
    """As with transformers 4.x (no transformers.integrations.moe):
    register() registers the attention alone, and apply switches no
    experts and says why."""
    monkeypatch.setattr(pallas_experts, "experts_interface", lambda: None)
    assert pallas_experts.register() is False
    torch_pallas.transformers.register()
    m = model("mixtral", "eager")
    report = torch_pallas.transformers.apply(m)
    assert report.experts == 0 and m.config._experts_implementation == "eager"
    assert any("has no experts interface" in item and "2 MoE layers stay on torch" in item
               for item in report.left_alone), report.left_alone


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_on_every_cpu_backend(family, cpu_backend):
    """The experts module (Qwen3-MoE's SiLU gate on swiglu; gpt-oss's
    biases and clamped gate) on each CPU backend, the simulators included,
    against eager, with an expert that receives no token."""
    module = experts_of(model(family, "eager"))[0]
    used = list(range(1, module.num_experts))
    hidden, index, weights = routing(module, used)
    expected = forward_and_gradients(eager_forward(module), module, hidden, index, weights)
    got = forward_and_gradients(pallas_experts.experts_forward, module, hidden, index, weights)
    for what, g, e in zip(("output", "hidden", "weights"), got[:3], expected[:3]):
        assert_close(g, e, msg=f"{cpu_backend}: {what}")
    for name, grad in got[3].items():
        assert_close(grad, expected[3][name], msg=f"{cpu_backend}: {name}")
        assert not grad[0].any(), name
