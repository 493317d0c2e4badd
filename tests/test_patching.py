"""torch_pallas.transformers.apply against the unpatched model: small
Llama, Mistral, Qwen2 and GPT-2 models built from configs (vocabulary 257,
hidden 64, two layers, a right-padded batch of 13 and 8 tokens with labels
ignored at the padding and the prompt), their eval logits, training loss
and every parameter's gradient; training curves, gradient accumulation
with `num_items_in_batch`, the report, each kind switched off, the state
dict, what is left alone and why, how far the rotary patch reaches, and
examples/train_llama.py.
The default CPU backend only: the ops' own tests cover the others."""

from __future__ import annotations

import copy
import importlib.util
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss

import torch_pallas
import torch_pallas.transformers
from torch_pallas.transformers import patching

VOCAB = 257
LENGTHS = (13, 8)  # a right-padded batch
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SIZES, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(**SIZES, num_key_value_heads=2),
    # Llama's sizes (the kernels built for one serve the others), biased q, k, v
    "qwen2": lambda: transformers.Qwen2Config(**SIZES, num_key_value_heads=2),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
        embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}
# What apply finds in each (two layers; Llama-style: 2 norms a layer and the
# final one, q/k/v/o and gate/up/down, the LM head; GPT-2: ln_1, ln_2, ln_f,
# c_attn, c_proj, c_fc, c_proj a layer and the LM head).
LLAMA_COUNTS = dict(attention=2, rms_norm=5, layer_norm=0, rotary=2, swiglu=2, linear=15,
                    cross_entropy=1)
COUNTS = {"llama": LLAMA_COUNTS, "mistral": LLAMA_COUNTS, "qwen2": LLAMA_COUNTS,
          "gpt2": dict(attention=2, rms_norm=0, layer_norm=5, rotary=0, swiglu=0, linear=9,
                       cross_entropy=1)}


def pair(family: str, **kinds):
    """An unpatched model and a patched copy (the same weights)."""
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](),
                                                              attn_implementation="sdpa")
    ours = copy.deepcopy(reference)
    report = torch_pallas.transformers.apply(ours, **kinds)
    return reference, ours, report


def batch(lengths=LENGTHS, prompt=3):
    """Token ids, their attention mask and labels: -100 at the padding and
    over each row's first `prompt` tokens."""
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return ids, mask, labels


def assert_gradients_match(ours, reference, rtol=1e-4):
    expected = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        ref = expected[name].grad
        # float32 reassociation, relative to the gradient's size
        torch.testing.assert_close(p.grad, ref, rtol=rtol, atol=rtol * ref.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("family", CONFIGS)
def test_logits_loss_and_gradients_match_the_unpatched_model(family):
    reference, ours, report = pair(family)
    assert {kind: getattr(report, kind) for kind in patching.KINDS} == COUNTS[family]
    ids, mask, labels = batch()
    real = mask.bool()

    outputs = []
    for model in (reference, ours):
        model.eval()
        evaluated = model(input_ids=ids, attention_mask=mask, labels=labels)
        model.train()
        trained = model(input_ids=ids, attention_mask=mask, labels=labels)
        model.zero_grad()
        trained.loss.backward()
        outputs.append((evaluated, trained))
    (ref_eval, ref_train), (our_eval, our_train) = outputs

    # eval: the logits, and the loss computed from them
    torch.testing.assert_close(our_eval.logits[real], ref_eval.logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(our_eval.loss, ref_eval.loss, rtol=1e-5, atol=1e-5)
    # training with labels: the fused loss, no logits
    assert our_train.logits is None and ref_train.logits is not None
    torch.testing.assert_close(our_train.loss, ref_train.loss, rtol=1e-5, atol=1e-5)
    assert_gradients_match(ours, reference)


def test_training_tracks_the_unpatched_loss_curve():
    """20 AdamW steps on one batch: the patched model's losses follow the
    unpatched one's step by step (and fall)."""
    reference, ours, _ = pair("llama")
    ids, mask, labels = batch()
    curves = []
    for model in (reference, ours):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        curves.append(torch.stack(losses))
    expected, got = curves
    assert expected[-1] < expected[0] - 1.0  # it learns: the curves can part
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gradient_accumulation_with_num_items_in_batch():
    """Two micro-batches with different counts of labelled tokens, each loss
    summed over its tokens and divided by the count over both (as the
    Trainer passes `num_items_in_batch`); also with return_dict=False."""
    reference, ours, _ = pair("llama")
    micro_batches = [batch(prompt=2), batch(LENGTHS[::-1], prompt=6)]
    # The labels are shifted by one inside the loss: count what it counts.
    num_items = torch.tensor(sum(int((labels[:, 1:] != -100).sum())
                                 for _, _, labels in micro_batches))

    def accumulate(model):
        model.train()
        model.zero_grad()
        total, lengths = 0, []
        for ids, mask, labels in micro_batches:
            out = model(input_ids=ids, attention_mask=mask, labels=labels,
                        num_items_in_batch=num_items, return_dict=False)
            out[0].backward()
            total, lengths = total + out[0].detach(), lengths + [len(out)]
        return total, lengths

    (expected, ref_lengths), (got, our_lengths) = accumulate(reference), accumulate(ours)
    assert our_lengths == [n - 1 for n in ref_lengths]  # the tuples without their logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert_gradients_match(ours, reference)


def patched_kinds(model) -> set[str]:
    """The kinds `model` runs on the Pallas ops, read from its modules."""
    found = set()
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "pallas":
        found.add("attention")
    for m in model.modules():
        kind = patching.patched_as(m)
        if kind in patching.KINDS:
            found.add(kind)
        if isinstance(m, torch_pallas.nn.LayerNorm):
            found.add("layer_norm")
    if torch_pallas.nn.converted(model):
        found.add("linear")
    return found


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", patching.KINDS)
def test_each_kind_switches_off(family, kind):
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    report = torch_pallas.transformers.apply(model, **{kind: False})
    assert getattr(report, kind) is None
    present = {k for k, count in COUNTS[family].items() if count}
    assert patched_kinds(model) == present - {kind}
    if kind == "cross_entropy":
        assert model.loss_function is ForCausalLMLoss
    assert f"  {kind:<14}off" in str(report)


def test_state_dict_and_save_pretrained_are_unchanged(tmp_path):
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    before = {name: t.clone() for name, t in model.state_dict().items()}
    model.save_pretrained(tmp_path / "before")
    torch_pallas.transformers.apply(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, t in after.items():
        assert torch.equal(t, before[name]), name
    model.save_pretrained(tmp_path / "after")
    files = sorted(p.name for p in (tmp_path / "before").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "after").iterdir())
    for name in files:
        assert (tmp_path / "before" / name).read_bytes() == (tmp_path / "after" / name).read_bytes(), name


# transformers 5.0 to 5.16 (5.0.0 and 5.10.4 seen, 5.17 on pass): a patched
# Llama does not pickle ("Can't pickle <function apply_rotary_pos_emb>: it's
# not the same object as ...modeling_llama.apply_rotary_pos_emb": something
# of the model holds transformers' own function, whose name the rotary patch
# gives its dispatcher). Found by CI's between-versions run; not yet fixed.
PICKLE_REFUSED = (5, 0) <= tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 17)


def test_apply_twice_deepcopy_and_pickle_keep_the_patch(request):
    request.applymarker(pytest.mark.xfail(PICKLE_REFUSED, raises=pickle.PicklingError,
                                          reason="a patched Llama does not pickle on "
                                                 f"transformers {transformers.__version__}"))
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    first = torch_pallas.transformers.apply(model)
    second = torch_pallas.transformers.apply(model)
    assert str(second) == str(first)
    clone = copy.deepcopy(model)
    # The copy's forwards are bound to the copy's modules, not the original's.
    assert clone.forward.module is clone and clone.loss_function.module is clone
    assert clone.lm_head.forward.module is clone.lm_head
    assert clone.model.layers[0].mlp.forward.module is clone.model.layers[0].mlp
    assert patched_kinds(clone) == patched_kinds(model) == set(patching.KINDS) - {"layer_norm"}
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert patched_kinds(loaded) == patched_kinds(model)
    assert loaded.model.layers[1].self_attn.forward.module is loaded.model.layers[1].self_attn


def test_the_rotary_patch_reaches_only_the_patched_model(monkeypatch):
    """The modeling file's apply_rotary_pos_emb is shared by every Llama:
    an unpatched one built beside a patched one keeps transformers' own."""
    calls = []
    monkeypatch.setattr(patching, "pallas_rotary_embedding",
                        lambda *args: calls.append(1) or patching.torch_rotary_embedding(*args))
    off = {kind: False for kind in patching.KINDS if kind != "rotary"}
    reference, ours, report = pair("llama", **off)
    assert report.rotary == 2
    ids, mask, _ = batch()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert calls == []
        got = ours(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(got, expected)


def test_no_hub_kernel_routes_around_the_rotary_patch():
    """transformers 5 with the `kernels` distribution routes a Llama
    attention module's apply_rotary_pos_emb calls to the module's private
    copy, which `kernels.kernelize` points at a hub kernel by setting its
    forward: a patched module's calls never reach that copy, an unpatched
    module's still do (and without `kernels`, the name is a plain function)."""
    reference, ours, report = pair("llama", **{k: False for k in patching.KINDS if k != "rotary"})
    assert report.rotary == 2
    attention = ours.model.layers[0].self_attn
    if not hasattr(attention, "_kernel_funcs"):  # transformers without kernels' routing
        namespace = patching._innermost_forward(type(attention)).__globals__
        assert callable(namespace[patching.ROTARY])
        assert not isinstance(namespace[patching.ROTARY], torch.nn.Module)
        return

    def hub_kernel(self, *args, **kwargs):
        raise AssertionError("routed to the hub kernel")

    for model in (reference, ours):  # what kernelize does to each module's private copy
        for layer in model.model.layers:
            (private,) = layer.self_attn._kernel_funcs.values()  # the rotary's copy
            private.forward = hub_kernel.__get__(private)
    ids, mask, _ = batch()
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
        with pytest.raises(AssertionError, match="routed to the hub kernel"):
            reference(input_ids=ids, attention_mask=mask)


def test_gpt_oss_attention_with_sinks_runs_on_pallas():
    """gpt-oss passes its attention sinks (`s_aux`) and a sliding window to
    the attention function: apply puts its attention on "pallas", which
    computes both, and the patched model's logits are the unpatched
    model's."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"])
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # sinks that matter (a fresh model's are zeros)
        for layer in reference.model.layers:
            layer.self_attn.sinks.normal_()
    ours = copy.deepcopy(reference)
    report = torch_pallas.transformers.apply(ours)
    assert report.attention == 2 and ours.config._attn_implementation == "pallas"
    assert not any("keep their implementation" in item for item in report.left_alone), \
        report.left_alone
    assert report.rms_norm == 5 and report.linear > 0
    ids, mask, _ = batch()
    reference.eval(), ours.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
        unpadded = ids[mask.bool().all(-1)]  # rows without padding: no mask at all
        expected_unpadded = reference(input_ids=unpadded).logits
        got_unpadded = ours(input_ids=unpadded).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_unpadded, expected_unpadded, rtol=1e-5, atol=1e-5)


class OffsetRMSNorm(torch.nn.Module):
    """normed * (1 + weight) in the input's dtype throughout: none of the
    casting modes (Gemma's normalises and multiplies in float32)."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return normed * (1 + self.weight)


class GeluMLP(torch.nn.Module):
    """A gated MLP on GELU (as Gemma's): not SwiGLU."""

    def __init__(self, n):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(n, 2 * n), torch.nn.Linear(n, 2 * n)
        self.down_proj = torch.nn.Linear(2 * n, n)
        self.act_fn = torch.nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_modules_that_compute_something_else_are_left_alone_and_reported():
    model = torch.nn.Sequential(OffsetRMSNorm(16), GeluMLP(16))
    x = torch.randn(3, 16)
    expected = model(x)
    with pytest.warns(UserWarning, match="recognised nothing"):
        report = torch_pallas.transformers.apply(model, linear=False)
    assert report.total == 0
    assert any("0 (OffsetRMSNorm)" in item and "Llama" in item for item in report.left_alone)
    assert any("1 (GeluMLP)" in item and "silu" in item for item in report.left_alone)
    assert patched_kinds(model) == set()
    torch.testing.assert_close(model(x), expected)
    assert "left alone: 0 (OffsetRMSNorm)" in str(report)


def test_a_model_it_recognises_nothing_in_warns():
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh())
    with pytest.warns(UserWarning, match=r"torch_pallas.transformers.apply: recognised nothing .* "
                                         r"in Sequential"):
        report = torch_pallas.transformers.apply(model)
    assert report.total == 0


def test_verbose_prints_the_report(capsys):
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["gpt2"]())
    report = torch_pallas.transformers.apply(model, verbose=True, rotary=False)
    printed = capsys.readouterr().out
    assert printed.strip() == str(report)
    assert f"  {'layer_norm':<14}  5  LayerNorm" in printed
    assert f"  {'rotary':<14}off" in printed


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(TypeError, match="torch_pallas.transformers.apply: model must be a "
                                        "torch.nn.Module, got str"):
        torch_pallas.transformers.apply("not a model")


def test_a_model_already_sharded_is_refused_before_anything_is_patched():
    """apply runs modules on plain tensors to check them: after fully_shard
    (sharded parameters) it raises first and leaves the model as it was."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(model)
        before = patched_kinds(model), model.config._attn_implementation
        with pytest.raises(RuntimeError, match=r"apply: model\.embed_tokens\.weight is a "
                                               r"DTensor .*call apply before fully_shard"):
            torch_pallas.transformers.apply(model)
        assert (patched_kinds(model), model.config._attn_implementation) == before
    finally:
        dist.destroy_process_group()


def test_a_forward_hook_changing_the_lm_heads_output_refuses_the_fused_loss():
    """A hook that returns other logits (scaled) would be lost by a loss
    computed from the head's input: the training forward raises, naming
    the way out; a hook that returns them as they are changes nothing."""
    reference, model, _ = pair("llama")
    ids, mask, labels = batch()
    model.train()
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out)
    expected = reference.train()(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               expected, rtol=1e-5, atol=1e-6)
    handle.remove()
    model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError, match="changes the LM head's output.*cross_entropy=False"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


def test_any_module_holding_what_it_knows_is_patched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    expected = model(x)
    report = torch_pallas.transformers.apply(model)
    assert (report.linear, report.layer_norm, report.total) == (1, 1, 2)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("kind", [*patching.KINDS, "verbose"])
def test_a_keyword_that_is_not_a_bool_is_refused(kind):
    with pytest.raises(TypeError, match=rf"torch_pallas.transformers.apply: {kind} must be True "
                                        r"or False, got 'yes'"):
        torch_pallas.transformers.apply(torch.nn.Linear(2, 2), **{kind: "yes"})


def test_the_training_demo_runs_and_its_two_runs_agree(capsys, monkeypatch, tmp_path):
    """examples/train_llama.py, two steps of a tiny Llama on each side, and
    its plot."""
    path = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"
    spec = importlib.util.spec_from_file_location("train_llama", path)
    demo = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_llama", demo)  # for its dataclass
    spec.loader.exec_module(demo)
    runs = demo.main(["--steps", "2", "--hidden", "32", "--layers", "1", "--seq-len", "8",
                      "--batch-size", "2", "--plot", str(tmp_path / "losses.png")])
    assert [run.name for run in runs] == ["torch", "torch_pallas"]
    torch.testing.assert_close(runs[1].losses, runs[0].losses, rtol=1e-4, atol=1e-4)
    assert all(run.tokens_per_second > 0 and run.peak_memory is not None for run in runs)
    printed = capsys.readouterr().out
    assert "swiglu          1  gated MLPs" in printed  # the report
    assert "tokens/s" in printed and "peak memory" in printed
    assert (tmp_path / "losses.png").stat().st_size > 0


@pytest.mark.exhaustive
def test_bfloat16_llama_matches_within_bfloat16_rounding():
    reference, ours, _ = pair("llama")
    reference.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids, mask, labels = batch()
    losses = []
    for model in (reference, ours):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)
    assert_gradients_match(ours, reference, rtol=5e-2)


@pytest.mark.exhaustive
def test_compiled_training_step_of_a_patched_model_equals_eager():
    """The loss of a patched Llama compiled with fullgraph=True (the rotary
    flag, the LM head passing through, the fused loss all traced), two AdamW
    steps, against the same patched model run eagerly."""
    _, eager, _ = pair("llama")
    compiled = copy.deepcopy(eager)
    ids, mask, labels = batch()
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.train()
        run = lambda ids, mask, labels, model=model: model(  # noqa: E731
            input_ids=ids, attention_mask=mask, labels=labels).loss
        if name == "compiled":
            run = torch.compile(run, fullgraph=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for _ in range(2):
            loss = run(ids, mask, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.detach())
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=1e-5)


NORMS = {  # each casting mode's module, as its modeling file writes it
    "llama": lambda n: transformers.models.llama.modeling_llama.LlamaRMSNorm(n, eps=1e-6),
    "gemma": lambda n: transformers.models.gemma.modeling_gemma.GemmaRMSNorm(n, eps=1e-6),
    "none": lambda n: transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm(n, eps=1e-6),
}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("mode", NORMS)
def test_rms_norms_keep_their_casting(mode):
    """apply picks the casting mode that reproduces each RMSNorm module (the
    patched module is rms_norm in that mode, bit for bit, in the module's
    output dtype), for every input and weight dtype, the weight random (not
    a fresh model's). Against the module itself: bit-equal but where the
    float32 sums of squares, added in another order than torch's CPU sum,
    differ in the last bit (tests/test_rms_norm.py measures how often)."""
    width = 257  # ragged
    for x_dtype in FLOATS:
        for w_dtype in FLOATS:
            module = NORMS[mode](width).to(w_dtype)
            with torch.no_grad():
                module.weight.uniform_(-1.5, 1.5)
            patched = copy.deepcopy(module)
            report = torch_pallas.transformers.apply(patched)
            assert report.rms_norm == 1 and patched.forward.options == (mode,)
            x = (torch.randn(3, 5, width) * 4).to(x_dtype)
            with torch.no_grad():
                expected, got = module(x), patched(x)
                op = torch_pallas.rms_norm(x, (width,), module.weight, 1e-6, casting_mode=mode)
            what = f"{x_dtype}, weight {w_dtype}"
            assert got.dtype == expected.dtype and torch.equal(got, op), what
            equal = (got == expected).double().mean().item()
            assert equal >= (0.6 if x_dtype == torch.float32 else 0.999), f"{what}: {equal:.4f}"
            torch.testing.assert_close(got, expected, msg=what)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_bfloat16_models_give_the_unpatched_logits_within_rounding(family):
    """A bfloat16 model patched by apply: its eval logits are the unpatched
    bfloat16 model's within bfloat16's rounding, measured as the unpatched
    model's own distance from its float32 twin (the same weights)."""
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](),
                                                              attn_implementation="sdpa")
    with torch.no_grad():  # norms' weights that matter (a fresh model's are ones)
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    float32 = copy.deepcopy(reference).eval()
    reference = reference.to(torch.bfloat16).eval()
    ours = copy.deepcopy(reference)
    report = torch_pallas.transformers.apply(ours)
    assert {kind: getattr(report, kind) for kind in patching.KINDS} == COUNTS[family]
    ids, mask, _ = batch()
    real = mask.bool()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits[real].float()
        got = ours(input_ids=ids, attention_mask=mask).logits[real].float()
        twin = float32(input_ids=ids, attention_mask=mask).logits[real]
    rounding = (expected - twin).abs().max().item()
    assert (got - expected).abs().max().item() <= 2 * rounding
