"""transformers' attention on "pallas" for today's models: sliding windows
(Mistral, Qwen2 and 3, Gemma 2 and 3, gpt-oss), Gemma 2's softcap, gpt-oss's
sinks, and padding-free batches (DataCollatorWithFlattening, with the
flash-attention keywords or position ids only): logits, training loss and
every gradient against the same model on "eager"; a packed batch's
sequences as if each ran alone, with no (tokens x tokens) tensor made;
apply() on each family."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import torch_pallas
import torch_pallas.transformers
from padded_models import VOCAB, Squares, eager_and_pallas

# (model type, config keywords): a window of 5 that binds on 13 tokens.
FAMILIES = {
    "mistral": ("mistral", dict(sliding_window=5)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    # Qwen3: per-head q and k RMSNorms before the rotary embedding
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "gemma2": ("gemma2", dict(sliding_window=5, attn_logit_softcapping=7.0,
                              final_logit_softcapping=None)),
    "gemma3": ("gemma3_text", dict(sliding_window=5, sliding_window_pattern=2)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=32,
                                layer_types=["sliding_attention", "full_attention"])),
}


def model_pair(family: str):
    """The same tiny model (same weights) on "eager" and on "pallas"."""
    return eager_and_pallas(*FAMILIES[family])


def gradients(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_eager(family):
    """Logits in eval, and the training loss and every parameter gradient,
    on an unpadded batch (no mask: the window, softcap and sinks are the
    attention's) and a right-padded one (the mask carries the window; no
    loss term is predicted from a padded row, which each implementation
    fills as it likes)."""
    reference, ours = model_pair(family)
    ids = torch.randint(3, VOCAB, (2, 13))
    padding = torch.ones(2, 13, dtype=torch.long)
    padding[1, -4:] = 0
    for mask in (None, padding):
        reference.eval(), ours.eval()
        with torch.no_grad():
            expected = reference(input_ids=ids, attention_mask=mask).logits
            got = ours(input_ids=ids, attention_mask=mask).logits
        real = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
        torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    reference.train(), ours.train()
    labels = ids.masked_fill(padding == 0, -100)
    for model in (reference, ours):
        model.zero_grad()
        model(input_ids=ids, attention_mask=padding, labels=labels).loss.backward()
    loss = ours(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5,
                               atol=1e-5)
    expected = gradients(reference)
    got = gradients(ours)
    assert got.keys() == expected.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, expected[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("keywords", ["flash_attn_kwargs", "position_ids"])
def test_padding_free_batch_is_each_sequence_alone(family, keywords):
    """Sequences of 9, 14 and 6 tokens packed by DataCollatorWithFlattening
    into one row: the loss and every gradient are those of the sequences
    run one at a time (summed over their tokens), with the
    flash-attention keywords (cu_seq_lens_*) or with position ids only; no
    (29 x 29) tensor is made on the way."""
    reference, ours = model_pair(family)
    reference.train(), ours.train()
    lengths = [9, 14, 6]
    features = [{"input_ids": torch.randint(3, VOCAB, (n,)).tolist()} for n in lengths]
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=keywords == "flash_attn_kwargs", return_tensors="pt")
    packed = collator(features)
    total = sum(lengths)
    assert packed["input_ids"].shape == (1, total)
    with Squares(total) as seen:
        loss = ours(**packed).loss
    assert not seen.seen, seen.seen[:3]
    tokens = sum(n - 1 for n in lengths)  # each sequence's first label is -100
    (loss * tokens).backward()
    expected_sum = 0.0
    for feature in features:
        ids = torch.tensor([feature["input_ids"]])
        alone = reference(input_ids=ids, labels=ids).loss * (ids.shape[1] - 1)
        alone.backward()
        expected_sum = expected_sum + alone.detach()
    torch.testing.assert_close(loss.detach() * tokens, expected_sum, rtol=1e-5, atol=1e-5)
    expected = gradients(reference)
    for name, g in gradients(ours).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_apply_puts_each_family_on_pallas(family):
    """apply() puts every family's attention on "pallas" (their windows,
    softcap and sinks are computed) and its norms on the op; what it leaves
    alone it lists with a reason."""
    reference, _ = model_pair(family)
    ours = copy.deepcopy(reference)
    report = torch_pallas.transformers.apply(ours)
    assert report.attention == 2 and ours.config._attn_implementation == "pallas"
    assert report.rms_norm > 0
    if family == "qwen3":  # the per-head q and k norms too: 2 a layer, and 2 + 1 more
        assert report.rms_norm == 2 * 4 + 1, report
    assert all(": " in item for item in report.left_alone), report.left_alone
    ids = torch.randint(3, VOCAB, (2, 13))
    reference.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_packed_rows_of_a_batch_of_two_match_eager():
    """Position ids that restart in each of two rows (sequences packed per
    row, no mask): the attention reads packing off a single row only, so
    the mask function gives these rows transformers' mask; the logits are
    the eager model's."""
    reference, ours = model_pair("mistral")
    ids = torch.randint(3, VOCAB, (2, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6],
                              [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
    reference.eval(), ours.eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
        got = ours(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
