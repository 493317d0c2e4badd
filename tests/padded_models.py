"""Tiny transformers models of today's families on attn_implementation=
"pallas" beside the same weights on "eager", and padded batches for them:
what tests/test_padded_batches.py (torch, eager and compiled),
test_torchax.py (jax.jit) and test_torch_tpu.py (the `tpu` kernels) share.
Importing it imports transformers (the test extra's)."""

from __future__ import annotations

import copy

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import torch_pallas.transformers


def padding_of(rows, length: int) -> torch.Tensor:
    """(B, length) long: each row's (padding before, real tokens) run."""
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, (before, real) in enumerate(rows):
        mask[b, before:before + real] = 1
    return mask


VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128)
# (model type, config keywords, apply()): windows of 5 that bind on 13 tokens
FAMILIES = {
    "llama": ("llama", {}, False),
    "mistral": ("mistral", dict(sliding_window=5), False),
    "gemma2": ("gemma2", dict(sliding_window=5, attn_logit_softcapping=7.0,
                              final_logit_softcapping=None), False),
    "gpt_oss": ("gpt_oss", dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=32,
                                layer_types=["sliding_attention", "full_attention"]), True),
    # apply(): the experts on "pallas" too (torchax lowers no aten::_grouped_mm)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), True),
}
TOKENS = 13
# left-padded, right-padded, both sides: three lengths
MODEL_PADDING = padding_of([(5, 8), (0, 10), (2, 9)], TOKENS)


def eager_and_pallas(model_type: str, keywords: dict):
    """The same tiny model (same weights, COMMON's sizes with `keywords`) on
    "eager" and on "pallas"; gpt-oss with sinks that matter (a fresh
    model's are zeros)."""
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **keywords})
    reference = transformers.AutoModelForCausalLM.from_config(config,
                                                              attn_implementation="eager")
    if model_type == "gpt_oss":
        with torch.no_grad():
            for layer in reference.model.layers:
                layer.self_attn.sinks.normal_()
    torch_pallas.transformers.register()
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation("pallas")
    return reference, ours


def model_pair(family: str):
    """eager_and_pallas for a family of FAMILIES, in training mode, after
    apply() where the family says so."""
    model_type, keywords, apply = FAMILIES[family]
    reference, ours = eager_and_pallas(model_type, keywords)
    reference.train(), ours.train()
    if apply:
        assert torch_pallas.transformers.apply(ours).attention
    return reference, ours


class Squares(TorchDispatchMode):
    """Records the ops that make a tensor with two dimensions of `size`
    (a tokens x tokens mask or score matrix)."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.seen = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.size) >= 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def labels_for(ids, mask):
    """The ids as labels, -100 at padding and where a padding token would
    predict (a left-padded row's first real token): what a padding token's
    row holds is each implementation's own (eager: the mean of every value;
    "pallas": 0)."""
    predicted_from_padding = torch.nn.functional.pad(mask[:, :-1] == 0, (1, 0))
    return ids.masked_fill((mask == 0) | predicted_from_padding, -100)


def train_step(model, ids, mask):
    """(logits, loss) of a forward with labels_for's labels."""
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    logits = out.logits
    if logits is None:  # apply()'s fused loss made none: a forward of its own
        logits = model(input_ids=ids, attention_mask=mask).logits
    return logits, out.loss


def gradients(model) -> dict:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def compare(family, logits, loss, grads, expected):
    ref_logits, ref_loss, ref_grads, real = expected
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys(), family
    for name, g in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-3, atol=1e-5 * max(scale, 1.0),
                                   msg=f"{family}: {name}")
