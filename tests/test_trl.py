"""torch_pallas.trl: TRL's own GRPOTrainer, its per-token log-probs and
entropies through torch_pallas.transformers.token_log_probs, on a tiny
Llama built from a config and a word-level tokenizer built here (nothing
downloaded).

One training step (module-scoped: built and run once) goes through all
three of TRL's call sites: the old policy (num_iterations=2 asks for it),
the reference model (beta > 0) and the policy in the loss, with entropies
(top_entropy_quantile < 1 and entropy_coef > 0 read them). Then, on the
batch that step trained on, the loss and every parameter's gradient are
TRL's own (its method, swapped back in on the same trainer), and so are the
method's outputs for each model, chunking and padding.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (CohereConfig, CohereForCausalLM, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

import torch_pallas.trl as pallas_trl
from torch_pallas.transformers import log_probs

# One worker builds the trainer and runs its step, for every test here.
pytestmark = pytest.mark.xdist_group("trl")

WORDS = ["<pad>", "<eos>", "<unk>", *(f"w{i}" for i in range(37))]  # 40 words
PAD, EOS = 0, 1
PROMPTS = ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11", "w12", "w13 w14 w15", "w16 w17"]
TRL_METHOD = trl.GRPOTrainer._get_per_token_logps_and_entropies


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def reward(completions, **kwargs) -> list[float]:
    """Deterministic, and different between most completions (a group of
    equal rewards has no advantage)."""
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


def grpo_config(output_dir, **overrides) -> trl.GRPOConfig:
    settings = dict(
        output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, use_cpu=True, report_to="none", seed=0, bf16=False,
        save_strategy="no", logging_steps=1, learning_rate=1e-2, temperature=0.7,
        beta=0.1,                   # a reference model
        num_iterations=2,           # the old policy's log-probs
        top_entropy_quantile=0.5,   # entropies, for the mask
        entropy_coef=0.01,          # and in the loss
        # An end of sequence more likely (+1 to its logit, of 40 words'), so
        # that completions come padded, some after 1 token, some after 4.
        generation_kwargs={"sequence_bias": {(EOS,): 1.0}},
    )
    return trl.GRPOConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def token_log_probs():
    """The function torch_pallas.trl calls, recording each call."""
    calls = []
    fused = log_probs.token_log_probs

    def recorded(model, input_ids, *args, **kwargs):
        calls.append(dict(model=model, rows=input_ids.size(0), **kwargs))
        return fused(model, input_ids, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(log_probs, "token_log_probs", recorded)
        yield calls


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_log_probs):
    """A torch_pallas.trl.GRPOTrainer after one step, the inputs its loss
    took, the calls of token_log_probs in that step (`step_calls`) and since
    (`calls`, all of them), and the step's warnings."""
    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    # TRL builds the reference model from the policy's path
    LlamaForCausalLM(config).save_pretrained(root / "model")
    trainer = pallas_trl.GRPOTrainer(
        model=str(root / "model"), reward_funcs=reward, args=grpo_config(root / "out"),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer())
    losses_inputs = []
    compute_loss = trainer._compute_loss

    def recorded(model, inputs):
        losses_inputs.append(inputs)
        return compute_loss(model, inputs)

    trainer._compute_loss = recorded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    del trainer._compute_loss
    (inputs,) = losses_inputs
    return types.SimpleNamespace(trainer=trainer, inputs=inputs, step_calls=list(token_log_probs),
                                 calls=token_log_probs, warnings=[str(w.message) for w in caught])


def batch(inputs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """input_ids, attention_mask and logits_to_keep, as TRL's loss builds them."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return input_ids, mask, inputs["completion_ids"].size(1)


def test_a_step_scores_every_model_on_the_fused_path(trained):
    trainer, calls = trained.trainer, trained.step_calls
    assert not [w for w in trained.warnings if w.startswith(pallas_trl.WHERE)], trained.warnings
    keep = trained.inputs["completion_ids"].size(1)
    # generation: the old policy, then the reference (batch_size rows a call);
    # the loss: the policy, with entropies
    assert [(call["model"], call["return_entropy"]) for call in calls] == [
        (trainer.model, False), (trainer.ref_model, False), (trainer.model, True)]
    assert all(call["logits_to_keep"] == keep and call["temperature"] == 0.7 for call in calls)
    assert [call["rows"] for call in calls] == [4, 4, 4]
    assert trained.inputs["old_per_token_logps"] is not None
    # the completions came padded; the entropies made TRL's metric
    assert (trained.inputs["completion_mask"] == 0).any()
    assert trainer.state.log_history[0]["entropy"] > 0


def _gradients(trainer, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_the_loss_and_every_gradient_are_trls(trained, monkeypatch):
    trainer, inputs = trained.trainer, trained.inputs
    trainer.model.train()
    loss, grads = _gradients(trainer, inputs)
    calls = len(trained.calls)
    monkeypatch.setattr(trainer, pallas_trl.TRL_METHOD, types.MethodType(TRL_METHOD, trainer))
    trl_loss, trl_grads = _gradients(trainer, inputs)
    assert len(trained.calls) == calls  # TRL's own, this time
    torch.testing.assert_close(loss, trl_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == trl_grads.keys() == {name for name, _ in trainer.model.named_parameters()}
    for name, grad in grads.items():
        assert trl_grads[name].abs().max() > 0, name
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("who, batch_size, compute_entropy", [
    ("model", None, True), ("model", 3, False), ("ref_model", 1, False)])
def test_the_methods_outputs_are_trls(trained, who, batch_size, compute_entropy):
    """Chunked by batch_size as TRL chunks (3 of 4 rows: a shorter last
    chunk); padding in the middle of the completions too (0, no gradient).
    (TRL's reference model's fused head computes no entropies: TRL never
    asks for them.)"""
    trainer = trained.trainer
    model = getattr(trainer, who)
    input_ids, mask, keep = batch(trained.inputs)
    mask[1, -2] = 0
    fused = trainer._get_per_token_logps_and_entropies(model, input_ids, mask, keep, batch_size=batch_size,
                                                       compute_entropy=compute_entropy)
    with torch.no_grad():
        expected = TRL_METHOD(trainer, model, input_ids, mask, keep, batch_size=batch_size,
                              compute_entropy=compute_entropy)
    assert fused[2] is None and expected[2] is None
    assert (fused[1] is None) == (not compute_entropy)
    for got, want in zip(fused[:2], expected[:2]):
        if want is None:
            continue
        assert got.dtype == torch.float32 and got.shape == want.shape == (4, keep)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert (got[mask[:, -keep:] == 0] == 0).all()


def test_a_compiled_model_is_served_unwrapped(trained, recwarn):
    trainer = trained.trainer
    input_ids, mask, keep = batch(trained.inputs)
    calls = len(trained.calls)
    compiled = torch.compile(trainer.model)  # (never called: nothing compiles)
    got, _, _ = trainer._get_per_token_logps_and_entropies(compiled, input_ids, mask, keep)
    assert [call["model"] for call in trained.calls[calls:]] == [trainer.model]
    want, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, mask, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not [w for w in recwarn if str(w.message).startswith(pallas_trl.WHERE)]


def tiny_cohere() -> CohereForCausalLM:
    """Logits scaled by config.logit_scale, which token_log_probs refuses."""
    return CohereForCausalLM(CohereConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=None, logit_scale=0.5))


# Each case: what it changes (on trainer, model and the call's arguments) and
# the reason the warning gives.
REFUSED = {
    "pixel_values": (lambda trainer, model, call: call.update(pixel_values=torch.zeros(4, 3, 2, 2)),
                     r"inputs besides the tokens \(pixel_values\)"),
    "compute_aux_loss": (lambda trainer, model, call: call.update(compute_aux_loss=True),
                         "MoE load-balancing loss"),
    "logits_to_keep=0": (lambda trainer, model, call: call.update(logits_to_keep=0), "logits_to_keep=0"),
    "DataParallel": (lambda trainer, model, call: call.update(model=torch.nn.DataParallel(model)),
                     "inside a DataParallel"),
    "cast_lm_head_to_fp32": (lambda trainer, model, call: setattr(trainer.args, "cast_lm_head_to_fp32", True),
                             "cast_lm_head_to_fp32=True"),
    "logit_scale": (lambda trainer, model, call: call.update(model=tiny_cohere()),
                    "CohereForCausalLM's forward .*self.logit_scale"),
}


class _Sentinel:
    """What TRL's method (recorded) returns here."""


@pytest.mark.parametrize("case", [*REFUSED, "trl's signature"])
def test_what_the_fused_path_does_not_serve_is_trls(trained, monkeypatch, case):
    trainer = trained.trainer
    input_ids, mask, keep = batch(trained.inputs)
    call = dict(model=trainer.model, logits_to_keep=keep)
    monkeypatch.setattr(trainer.args, "cast_lm_head_to_fp32", False)  # restored after the case sets it
    if case in REFUSED:
        change, reason = REFUSED[case]
        change(trainer, trainer.model, call)
    else:  # another trl's method: every call is TRL's
        monkeypatch.setattr(trl.GRPOTrainer, pallas_trl.TRL_METHOD,
                            lambda self, model, input_ids, logits_to_keep: None)
        monkeypatch.setattr(pallas_trl, "SIGNATURE_REFUSAL", pallas_trl._signature_refusal())
        reason = r"takes \('self', 'model', 'input_ids', 'logits_to_keep'\)"
    served = []

    def trls(self, *args, **kwargs):
        served.append((args, kwargs))
        return _Sentinel

    monkeypatch.setattr(trl.GRPOTrainer, pallas_trl.TRL_METHOD, trls)
    model, keep = call.pop("model"), call.pop("logits_to_keep")
    calls = len(trained.calls)
    with pytest.warns(UserWarning, match=f"^{pallas_trl.WHERE}: .*: .*{reason}"):
        returned = trainer._get_per_token_logps_and_entropies(model, input_ids, mask, keep, **call)
    assert returned is _Sentinel
    assert len(trained.calls) == calls  # not token_log_probs
    # TRL's method had the call as it was made
    assert served == [((model, input_ids, mask, keep), {"batch_size": None, "compute_entropy": False,
                                                        "compute_aux_loss": False, **call})]
