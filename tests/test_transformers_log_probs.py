"""torch_pallas.transformers.token_log_probs against TRL's formula on the
model's own full logits (GRPOTrainer's `_get_per_token_logps_and_entropies`
for one batch): tiny Llama, Qwen2 and Gemma 2 (its final softcap set, and
binding) models and a Llama with a biased LM head, a left-padded batch of
ragged rows, a vocabulary of no power of two; log-probs and entropies, and
every parameter's gradient of a loss mixing both; the same after
`apply(model)`. The LM head is never called and no (tokens x vocabulary)
tensor of the whole sequence exists; a bfloat16 model hands the op its
head's weight itself and bfloat16 hidden states; models whose logits are
more than the head's product, and bad arguments, are refused by name."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import padded_models
import torch_pallas.transformers
from padded_models import gradients
from torch_pallas.ops import token_log_probs as token_log_probs_op
from torch_pallas.transformers import log_probs, token_log_probs

VOCAB = 97  # no power of two
LENGTH = 11
BATCH = 2
# weights 10x transformers' default: logits of a few units, far from uniform
COMMON = {**padded_models.COMMON, "vocab_size": VOCAB, "initializer_range": 0.2}
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    # a final softcap this small binds on a tiny model's logits (test_the_softcap_binds)
    "gemma2": ("gemma2", dict(sliding_window=5, attn_logit_softcapping=7.0,
                              final_logit_softcapping=2.0)),
    "llama_head_bias": ("llama", {}),  # the LM head made anew with a bias
}
# ragged rows: 4 padding tokens then 7 real ones, and 11 real ones
MASK = padded_models.padding_of([(4, LENGTH - 4), (0, LENGTH)], LENGTH)


def tiny(family: str) -> torch.nn.Module:
    model_type, keywords = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **keywords})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family == "llama_head_bias":
        model.lm_head = torch.nn.Linear(config.hidden_size, VOCAB, bias=True)
        torch.nn.init.normal_(model.lm_head.bias)
    return model.train()


def batch() -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, LENGTH))


def trl_log_probs(model, input_ids, attention_mask, keep: int, temperature: float):
    """TRL's formula on the full logits: (log_probs, entropy), (B, keep)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   logits_to_keep=keep + 1).logits
    logits = logits[:, :-1, :]
    target = input_ids[:, -keep:]
    logits = logits[:, -keep:] / temperature
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def loss_of(log_probs, entropy, weights):
    """A GRPO-like mix: weighted log-probs, plus an entropy bonus when there is one."""
    loss = (weights[0] * log_probs).sum()
    return loss if entropy is None else loss + 0.1 * (weights[1] * entropy).sum()


def assert_gradients(got: dict, expected: dict, rtol: float, atol: float) -> None:
    assert got.keys() == expected.keys()
    for name, g in got.items():
        scale = max(expected[name].abs().max().item(), 1.0)
        torch.testing.assert_close(g, expected[name], rtol=rtol, atol=atol * scale, msg=name)


# (logits_to_keep, temperature, return_entropy): every pair of two options'
# values, in four calls (each costs seconds on the CPU's kernel interpreter)
CASES = [(None, 0.7, False), (None, 1.0, True), (5, 0.7, True), (5, 1.0, False)]


@pytest.mark.parametrize("logits_to_keep, temperature, return_entropy", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_trl(family, logits_to_keep, temperature, return_entropy):
    model, ids = tiny(family), batch()
    keep = logits_to_keep or LENGTH - 1
    weights = torch.randn(2, BATCH, keep)
    ref_log_probs, ref_entropy = trl_log_probs(model, ids, MASK, keep, temperature)
    loss_of(ref_log_probs, ref_entropy if return_entropy else None, weights).backward()
    expected = gradients(model)

    out = token_log_probs(model, ids, MASK, logits_to_keep=logits_to_keep,
                          temperature=temperature, return_entropy=return_entropy)
    got_log_probs, got_entropy = out if return_entropy else (out, None)
    assert got_log_probs.dtype == torch.float32 and got_log_probs.shape == (BATCH, keep)
    torch.testing.assert_close(got_log_probs, ref_log_probs, rtol=1e-5, atol=1e-5)
    if return_entropy:
        assert got_entropy.dtype == torch.float32 and got_entropy.shape == (BATCH, keep)
        torch.testing.assert_close(got_entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    loss_of(got_log_probs, got_entropy, weights).backward()
    assert_gradients(gradients(model), expected, rtol=1e-4, atol=1e-6)


def test_the_softcap_binds():
    """Gemma 2's final softcap changes these log-probs (so test_matches_trl
    would see it ignored) and token_log_probs reads it from the config."""
    model, ids = tiny("gemma2"), batch()
    capped, _ = trl_log_probs(model, ids, MASK, 5, 1.0)
    model.config.final_logit_softcapping = None
    uncapped, _ = trl_log_probs(model, ids, MASK, 5, 1.0)
    assert (capped - uncapped).abs().max() > 0.1
    torch.testing.assert_close(token_log_probs(model, ids, MASK, logits_to_keep=5), uncapped,
                               rtol=1e-5, atol=1e-5)


def test_without_attention_mask():
    model, ids = tiny("llama"), batch()
    expected, _ = trl_log_probs(model, ids, None, LENGTH - 1, 1.0)
    torch.testing.assert_close(token_log_probs(model, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_after_apply(family):
    """On the Pallas ops after apply (attention, norms, rotary, MLP, Linear
    layers): the same values and gradients as the model before, where a
    real token predicts (at a padding token each implementation keeps its
    own: padded_models.labels_for)."""
    reference, ids, keep, temperature = tiny(family), batch(), 5, 0.7
    ours = copy.deepcopy(reference)
    report = torch_pallas.transformers.apply(ours)
    assert report.attention and report.linear
    real = MASK[:, LENGTH - keep - 1:LENGTH - 1].bool()
    weights = torch.randn(2, BATCH, keep) * real
    ref_log_probs, ref_entropy = trl_log_probs(reference, ids, MASK, keep, temperature)
    loss_of(ref_log_probs, ref_entropy, weights).backward()

    got_log_probs, got_entropy = token_log_probs(ours, ids, MASK, logits_to_keep=keep,
                                                 temperature=temperature, return_entropy=True)
    torch.testing.assert_close(got_log_probs[real], ref_log_probs[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_entropy[real], ref_entropy[real], rtol=1e-4, atol=1e-4)
    loss_of(got_log_probs, got_entropy, weights).backward()
    assert_gradients(gradients(ours), gradients(reference), rtol=1e-3, atol=1e-5)


class WholeSequenceLogits(TorchDispatchMode):
    """Records the ops that make a (..., L, V) or (B * L, V) tensor: the
    whole sequence's logits."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and (tuple(t.shape[-2:]) == (LENGTH, VOCAB)
                                                or tuple(t.shape) == (BATCH * LENGTH, VOCAB)):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_the_lm_head_is_never_called():
    model, ids = tiny("llama"), batch()
    calls = []
    model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: calls.append(tuple(output.shape)))
    with WholeSequenceLogits() as recorder:
        log_probs_, entropy = token_log_probs(model, ids, MASK, return_entropy=True)
        (log_probs_.sum() + entropy.sum()).backward()
    assert calls == [] and recorder.seen == []
    # the hook and the recorder see the model's own forward's logits
    with WholeSequenceLogits() as recorder:
        model(input_ids=ids, attention_mask=MASK)
    assert calls == [(BATCH, LENGTH, VOCAB)] and recorder.seen


@pytest.fixture
def op_calls(monkeypatch):
    """The calls of the fused op, (input dtype, weight, bias, target shape,
    keywords) each, the op then run."""
    calls, op = [], token_log_probs_op.token_log_probs

    def recording(input, weight, target, bias=None, **kwargs):
        calls.append((input.dtype, weight, bias, target.shape, kwargs))
        return op(input, weight, target, bias, **kwargs)

    monkeypatch.setattr(token_log_probs_op, "token_log_probs", recording)
    return calls


def test_bfloat16_model_keeps_its_head_dtype(op_calls):
    """The op takes the head's own weight (no copy) and bfloat16 hidden
    states, and gives float32 values near TRL's (whose logits are rounded
    to bfloat16 first)."""
    model, ids = tiny("llama").to(torch.bfloat16), batch()
    got, entropy = token_log_probs(model, ids, MASK, logits_to_keep=5, temperature=0.7,
                                   return_entropy=True)
    [(dtype, weight, bias, target_shape, kwargs)] = op_calls
    assert dtype == torch.bfloat16 and weight is model.lm_head.weight and bias is None
    assert target_shape == (BATCH * 5,)
    assert kwargs == dict(temperature=0.7, return_entropy=True, softcap=None)
    assert got.dtype == entropy.dtype == torch.float32
    expected, expected_entropy = trl_log_probs(model, ids, MASK, 5, 0.7)
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-2)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=5e-2)
    got.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16


def test_under_autocast_the_head_runs_in_its_dtype(op_calls):
    """As the model's LM head (F.linear) under autocast: bfloat16 hidden
    states and weight (and bias); the float32 weight gets its gradient."""
    model, ids = tiny("llama_head_bias"), batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = trl_log_probs(model, ids, MASK, 5, 1.0)
        got = token_log_probs(model, ids, MASK, logits_to_keep=5)
    [(dtype, weight, bias, _, kwargs)] = op_calls
    assert dtype == weight.dtype == bias.dtype == torch.bfloat16
    assert kwargs["softcap"] is None
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-2)
    got.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert model.lm_head.bias.grad.abs().sum() > 0


# --- refusals --------------------------------------------------------------------

def tiny_of(model_type: str, **keywords) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **keywords})
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type, keywords, match", [
    ("cohere", dict(logit_scale=0.5), r"CohereForCausalLM.*self\.logit_scale"),
    ("granite", dict(logits_scaling=4.0), r"GraniteForCausalLM.*self\.config\.logits_scaling"),
])
def test_refuses_a_logit_scale(model_type, keywords, match):
    model = tiny_of(model_type, **keywords)
    with pytest.raises(ValueError, match=rf"token_log_probs: {match}"):
        token_log_probs(model, batch())


@pytest.mark.parametrize("name, match", [
    ("FalconH1ForCausalLM", r"self\.model\.lm_head_multiplier"),
    ("RecurrentGemmaForCausalLM", r"tanh"),
    ("ModernBertDecoderForCausalLM", r"self\.decoder"),
    ("BertLMHeadModel", r"does not call self\.lm_head"),
])
def test_refuses_what_a_forward_does_to_its_logits(name, match):
    """Read from the classes' forwards (none of them built)."""
    refusal = log_probs.read_forward(getattr(transformers, name), "lm_head")
    assert isinstance(refusal, str)
    assert re.search(match, refusal), refusal


@pytest.mark.parametrize("name, decoder, softcap", [
    ("LlamaForCausalLM", ("model",), False),
    ("Qwen2ForCausalLM", ("model",), False),
    ("Gemma2ForCausalLM", ("model",), True),
    ("GPT2LMHeadModel", ("transformer",), False),
    ("OPTForCausalLM", ("model", "decoder"), False),
])
def test_reads_the_decoder_and_the_softcap(name, decoder, softcap):
    plan = log_probs.read_forward(getattr(transformers, name), "lm_head")
    assert isinstance(plan, log_probs.Plan), plan
    assert (plan.decoder, plan.softcap) == (decoder, softcap)


class ScaledHead(torch.nn.Linear):
    def forward(self, input):
        return super().forward(input) * 2


def test_refuses_models_without_a_linear_lm_head():
    config = transformers.AutoConfig.for_model("llama", **COMMON)
    with pytest.raises(ValueError, match="token_log_probs: LlamaModel has no output embeddings"):
        token_log_probs(transformers.AutoModel.from_config(config), batch())
    with pytest.raises(ValueError, match="token_log_probs: Linear has no output embeddings"):
        token_log_probs(torch.nn.Linear(2, 2), batch())
    model = tiny("llama")
    model.lm_head = ScaledHead(COMMON["hidden_size"], VOCAB, bias=False)
    with pytest.raises(ValueError, match="LlamaForCausalLM's output embeddings are a ScaledHead"):
        token_log_probs(model, batch())


@pytest.mark.parametrize("change, error, match", [
    (dict(logits_to_keep=0), ValueError, r"logits_to_keep must be in \[1, 10\].*got 0"),
    (dict(logits_to_keep=LENGTH), ValueError, r"logits_to_keep must be in \[1, 10\].*got 11"),
    (dict(logits_to_keep=-1), ValueError, r"logits_to_keep .*got -1"),
    (dict(logits_to_keep=2.0), TypeError, r"logits_to_keep must be an int or None, got 2\.0"),
    (dict(logits_to_keep=True), TypeError, r"logits_to_keep .*got True"),
    (dict(temperature=0.0), ValueError, r"temperature must be finite and > 0, got 0\.0"),
    (dict(temperature=-0.7), ValueError, r"temperature .*got -0\.7"),
    (dict(temperature=float("inf")), ValueError, r"temperature .*got inf"),
    (dict(temperature=float("nan")), ValueError, r"temperature .*got nan"),
    (dict(temperature="1"), TypeError, r"temperature must be a real number, got '1'"),
    (dict(return_entropy=1), TypeError, r"return_entropy must be True or False, got 1"),
    (dict(input_ids=torch.rand(BATCH, LENGTH)), TypeError,
     r"input_ids must hold integer token ids, got dtype torch\.float32"),
    (dict(input_ids=torch.zeros(LENGTH, dtype=torch.long)), ValueError,
     r"input_ids must be 2-D \(batch, length\), got shape \(11,\)"),
    (dict(input_ids=torch.zeros(1, BATCH, LENGTH, dtype=torch.long)), ValueError,
     r"input_ids must be 2-D .*\(1, 2, 11\)"),
    (dict(input_ids=torch.zeros(BATCH, 1, dtype=torch.long)), ValueError,
     r"input_ids must hold at least 2 tokens a row.*\(2, 1\)"),
    (dict(attention_mask=torch.ones(BATCH, LENGTH - 1)), ValueError,
     r"attention_mask must be None or a tensor of input_ids' shape \(2, 11\), got \(2, 10\)"),
])
def test_refuses_bad_arguments(change, error, match):
    arguments = {"input_ids": batch(), "attention_mask": MASK, **change}
    with pytest.raises(error, match=rf"token_log_probs: {match}"):
        token_log_probs(tiny("llama"), **arguments)
