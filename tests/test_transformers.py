"""transformers models with attn_implementation="pallas" against the same
models on "sdpa": logits and every parameter's gradient, greedy generation
with the KV cache on a left-padded batch, and torch.compile(fullgraph=True).
Small Llama (grouped key/value heads) and Qwen2 (biased projections) models
built from configs."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
import transformers

import torch_pallas
import torch_pallas.transformers

torch_pallas.transformers.register()

VOCAB = 96


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def qwen2_config():
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)


CONFIGS = {"llama": llama_config, "qwen2": qwen2_config}


def pair(make_config):
    """The same model (same weights) on "sdpa" and on "pallas"."""
    reference = transformers.AutoModelForCausalLM.from_config(
        make_config(), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(
        make_config(), attn_implementation="pallas").eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def left_padded_batch(lengths=(13, 9, 4), total=13):
    ids = torch.randint(3, VOCAB, (len(lengths), total))
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1
        ids[row, :total - n] = 0  # the pad token
    return ids, mask


def test_every_attention_layer_runs_on_the_op(monkeypatch):
    _, model = pair(llama_config)
    calls = []
    real = torch_pallas.transformers.attention_forward
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "pallas",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    model(torch.randint(0, VOCAB, (2, 7)))
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("family", CONFIGS)
def test_logits_and_gradients_match_sdpa(family):
    reference, ours = pair(CONFIGS[family])
    ids, mask = left_padded_batch()
    outputs = []
    for model in (reference, ours):
        model.train()
        logits = model(input_ids=ids, attention_mask=mask).logits
        # Padded positions attend to nothing that matters: compare the real ones.
        loss = (logits.float().log_softmax(-1)[mask.bool()].sum(-1) ** 2).mean()
        model.zero_grad()
        loss.backward()
        outputs.append((logits[mask.bool()].detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_logits, ref_grads), (logits, grads) = outputs
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert ref_grads.keys() == grads.keys()
    for name, ref in ref_grads.items():
        # float32 reassociation, relative to the gradient's size
        scale = ref.abs().max().item()
        torch.testing.assert_close(grads[name], ref, atol=1e-5 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", CONFIGS)
def test_generate_with_the_kv_cache_on_a_left_padded_batch(family):
    reference, ours = pair(CONFIGS[family])
    ids, mask = left_padded_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True,
                  pad_token_id=0)
    expected = reference.generate(ids, **kwargs)
    torch.testing.assert_close(ours.generate(ids, **kwargs), expected)


def test_set_attn_implementation_switches_a_built_model():
    reference, _ = pair(llama_config)
    ids = torch.randint(3, VOCAB, (2, 11))
    expected = reference(ids).logits
    reference.set_attn_implementation("pallas")
    assert reference.config._attn_implementation == "pallas"
    torch.testing.assert_close(reference(ids).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.exhaustive  # ~20 s of compiling; by default tests/test_patching.py compiles
def test_compiled_fullgraph_matches_sdpa():  # a padded Llama on "pallas" attention and the rest
    reference, ours = pair(llama_config)
    ids, mask = left_padded_batch()
    expected = reference(input_ids=ids, attention_mask=mask).logits
    compiled = torch.compile(ours, fullgraph=True)
    got = compiled(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)


def test_importing_torch_pallas_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, torch_pallas; assert 'transformers' not in sys.modules; "
            "torch_pallas.transformers.register(); assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# A minute of compiling each. By default tests/test_patching.py compiles a
# training step of a Llama on every Pallas op (every Linear converted and
# "pallas" attention among them, fullgraph, AdamW) against eager; these
# two, Linears and attention alone, run with -m exhaustive.
@pytest.mark.exhaustive
@pytest.mark.parametrize("family", CONFIGS)
def test_compiled_training_step_equals_eager(family):
    """A training step as a user compiles it: every Linear converted
    (replace_linear), "pallas" attention, the loss function compiled with
    fullgraph=True, its backward and an AdamW step; two steps on a
    left-padded batch give the eager model's losses and parameters.
    (Attention's backward on the transposed q/k/v transformers makes failed
    here while its fake promised q's strides.)"""
    models = []
    for _ in range(2):
        model = transformers.AutoModelForCausalLM.from_config(
            CONFIGS[family](), attn_implementation="pallas")
        model.train()
        models.append(torch_pallas.nn.replace_linear(model))
    eager, compiled = models
    compiled.load_state_dict(eager.state_dict())
    ids, mask = left_padded_batch()
    labels = ids.masked_fill(mask == 0, -100)

    def loss_of(model):
        return lambda ids, mask, labels: model(input_ids=ids, attention_mask=mask,
                                               labels=labels).loss

    steps = {}
    for name, model, loss_fn in (("eager", eager, loss_of(eager)),
                                 ("compiled", compiled,
                                  torch.compile(loss_of(compiled), fullgraph=True))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps[name] = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = loss_fn(ids, mask, labels)
            loss.backward()
            optimizer.step()
            steps[name].append(loss.detach())
    torch.testing.assert_close(steps["compiled"], steps["eager"], rtol=1e-5, atol=1e-5)
    expected = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def mistral_config(sliding_window):
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=sliding_window)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_a_binding_sliding_window(padded, monkeypatch):
    """Mistral with a window of 5 over 13 tokens gives SDPA's logits:
    padded, the mask carries the window; unpadded, the registered mask
    function builds none and the attention applies the window itself
    (transformers 5.x; 4.x, whose mask interface takes `cache_position`,
    gets SDPA's band mask)."""
    from transformers import masking_utils

    from torch_pallas.transformers import attention

    masks = []
    forward = attention.attention_forward
    monkeypatch.setattr(attention, "attention_forward",
                        lambda m, q, k, v, mask, *a, **kw: masks.append(mask) or forward(
                            m, q, k, v, mask, *a, **kw))
    attention.register()
    reference, ours = pair(lambda: mistral_config(5))
    ids, mask = left_padded_batch() if padded else (torch.randint(3, VOCAB, (2, 13)), None)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask).logits
    real = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=1e-4)
    mask_free = not padded and "q_length" in inspect.signature(masking_utils.sdpa_mask).parameters
    assert masks and all((m is None) == mask_free for m in masks), [type(m) for m in masks]
    # the window binds: without it the logits are others
    unwindowed = transformers.AutoModelForCausalLM.from_config(
        mistral_config(None), attn_implementation="sdpa").eval()
    unwindowed.load_state_dict(reference.state_dict())
    with torch.no_grad():
        other = unwindowed(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(other[real], expected[real], atol=1e-3)
    monkeypatch.undo()
    attention.register()


def test_what_the_attention_does_not_compute_raises_by_name():
    """Keywords that change the result and that the Pallas attention does
    not compute raise ValueError naming them, never are ignored."""
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    module = torch.nn.Module()
    module.is_causal = True
    forward = torch_pallas.transformers.attention_forward
    refused = {
        "indices": dict(indices=torch.tensor([0, 2])),
        "block_indices": dict(block_indices=torch.tensor([0])),
    }
    for what, kwargs in refused.items():
        with pytest.raises(ValueError, match=f"attn_implementation='pallas' does not support {what}"):
            forward(module, q, k, v, None, **kwargs)
    with pytest.raises(ValueError, match="sliding_window=3 over 6 keys for 2 queries"):
        forward(module, q[:, :, :2], k, v, None, sliding_window=3)
    # A window that does not bind, None values, one packed sequence: nothing changes.
    expected, _ = forward(module, q, k, v, None)
    for kwargs in (dict(sliding_window=6), dict(s_aux=None, softcap=None),
                   dict(cu_seq_lens_q=torch.tensor([0, 6]), cu_seq_lens_k=torch.tensor([0, 6]))):
        got, _ = forward(module, q, k, v, None, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_an_older_transformers_is_refused_by_version(monkeypatch):
    from torch_pallas.transformers import attention

    # (the module `import transformers` gives now: transformers replaces its
    # lazy module in sys.modules as it loads)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.55.4")
    for call in (torch_pallas.transformers.register,
                 lambda: torch_pallas.transformers.apply(torch.nn.Linear(2, 2))):
        with pytest.raises(ImportError, match=rf"needs transformers>={attention.OLDEST_TRANSFORMERS}; "
                                              r"found 4\.55\.4"):
            call()
