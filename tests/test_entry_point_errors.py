"""Bad input to each public entry point of attention, varlen_attention and
grouped_mm, as a table: entry point x bad argument -> an exception whose
message starts with the name of the function the caller called and names
the argument, raised before any kernel runs (launch.run is made to fail
the test if reached)."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
import torch_pallas.nn.functional
from torch_pallas.ops import varlen_attention as varlen_op
from torch_pallas.runtime import launch

I32 = torch.int32
SDPA = "torch_pallas.nn.functional.scaled_dot_product_attention"


@pytest.fixture(autouse=True)
def _no_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran before the arguments were refused")

    monkeypatch.setattr(launch, "run", refuse)


# --- attention: torch_pallas.attention, torch.ops.pallas.attention, the SDPA drop-in ---

def _sdpa_args(**change):
    args = dict(query=torch.randn(2, 4, 5, 8), key=torch.randn(2, 4, 6, 8),
                value=torch.randn(2, 4, 6, 8), attn_mask=None, dropout_p=0.0,
                enable_gqa=False)
    args.update(change)
    return args


ATTENTION_ENTRIES = {
    "pallas::attention": lambda a: torch_pallas.attention(
        a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"],
        enable_gqa=a["enable_gqa"]),
    "pallas::attention (torch.ops)": lambda a: torch.ops.pallas.attention(
        a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"],
        enable_gqa=a["enable_gqa"]),
    SDPA: lambda a: torch_pallas.nn.functional.scaled_dot_product_attention(
        a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"],
        enable_gqa=a["enable_gqa"]),
}
ATTENTION_BAD = {
    "dropout_p past 1": (dict(dropout_p=1.5), "dropout_p"),
    "key in float64": (dict(key=torch.randn(2, 4, 6, 8).double()), "key"),
    "int query": (dict(query=torch.ones(2, 4, 5, 8, dtype=I32)), "query"),
    "int mask": (dict(attn_mask=torch.ones(5, 6, dtype=I32)), "attn_mask"),
    "mask of another shape": (dict(attn_mask=torch.ones(4, 6, dtype=torch.bool)), "attn_mask"),
    "head dimensions differ": (dict(key=torch.randn(2, 4, 6, 4)), "key"),
    "value shorter": (dict(value=torch.randn(2, 4, 3, 8)), "value"),
    "gqa heads": (dict(key=torch.randn(2, 3, 6, 8), value=torch.randn(2, 3, 6, 8),
                       enable_gqa=True), "enable_gqa"),
    "head dimension 257": (dict(query=torch.randn(1, 1, 2, 257), key=torch.randn(1, 1, 2, 257),
                                value=torch.randn(1, 1, 2, 257)), "query"),
    "1-D query": (dict(query=torch.randn(8)), "query"),
    "query not a tensor": (dict(query=[1.0, 2.0]), "query"),
}


@pytest.mark.parametrize("bad", list(ATTENTION_BAD))
@pytest.mark.parametrize("entry", list(ATTENTION_ENTRIES))
def test_attention_entry_points_name_themselves(entry, bad):
    change, argument = ATTENTION_BAD[bad]
    name = entry.split(" ")[0]
    with pytest.raises((TypeError, ValueError, RuntimeError)) as raised:
        ATTENTION_ENTRIES[entry](_sdpa_args(**change))
    message = str(raised.value)
    assert message.startswith(name), message  # (torch's dispatcher says "pallas::attention()")
    assert argument in message, message


EXTRAS_BAD = {
    "window_size": (dict(window_size=(-2, 0)), "window_size"),
    "softcap": (dict(softcap=-1.0), "softcap"),
    "sinks shape": (dict(sinks=torch.randn(3)), "sinks"),
    "sinks dtype": (dict(sinks=torch.randn(4).double()), "sinks"),
}


@pytest.mark.parametrize("bad", list(EXTRAS_BAD))
def test_attention_extras_name_the_op(bad):
    change, argument = EXTRAS_BAD[bad]
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises((TypeError, ValueError)) as raised:
        torch_pallas.attention(q, q, q, **change)
    assert str(raised.value).startswith("pallas::attention: ")
    assert argument in str(raised.value)


# --- varlen_attention ---------------------------------------------------------------

def _varlen_args(**change):
    lengths = [5, 4]
    args = dict(query=torch.randn(9, 4, 16), key=torch.randn(9, 2, 16),
                value=torch.randn(9, 2, 16), cu_seq_q=varlen_op.random_sequences(lengths, "cpu"),
                cu_seq_k=varlen_op.random_sequences(lengths, "cpu"), max_q=5, max_k=5,
                enable_gqa=True)
    args.update(change)
    return args


VARLEN_ENTRIES = {
    "pallas::varlen_attention": torch_pallas.varlen_attention,
    "pallas::varlen_attention (torch.ops)": torch.ops.pallas.varlen_attention,
}
VARLEN_BAD = {
    "cu_seq_q decreasing": (dict(cu_seq_q=torch.tensor([0, 6, 5], dtype=I32)), "cu_seq_q"),
    "cu_seq_k not from 0": (dict(cu_seq_k=torch.tensor([1, 5, 9], dtype=I32)), "cu_seq_k"),
    "cu_seq_q past the tokens": (dict(cu_seq_q=torch.tensor([0, 5, 12], dtype=I32)),
                                 "cu_seq_q"),
    "a sequence beyond max_q": (dict(max_q=4), "max_q"),
    "a sequence beyond max_k": (dict(max_k=3), "max_k"),
    "cu_seq float": (dict(cu_seq_q=torch.tensor([0.0, 5.0, 9.0])), "cu_seq_q"),
    "cu_seq lengths differ": (dict(cu_seq_k=torch.tensor([0, 9], dtype=I32)), "cu_seq"),
    "heads not divisible": (dict(key=torch.randn(9, 3, 16), value=torch.randn(9, 3, 16)),
                            "heads"),
    "gqa not enabled": (dict(enable_gqa=False), "enable_gqa"),
    "sinks shape": (dict(sinks=torch.randn(2)), "sinks"),
    "window_size": (dict(window_size=(-2, 0)), "window_size"),
    "softcap negative": (dict(softcap=-1.0), "softcap"),
    "query 4-D": (dict(query=torch.randn(1, 9, 4, 16)), "query"),
}


@pytest.mark.parametrize("bad", list(VARLEN_BAD))
@pytest.mark.parametrize("entry", list(VARLEN_ENTRIES))
def test_varlen_attention_entry_points_name_themselves(entry, bad):
    change, argument = VARLEN_BAD[bad]
    kwargs = _varlen_args(**change)
    positional = [kwargs.pop(n) for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k",
                                          "max_q", "max_k")]
    if "window_size" in kwargs and "torch.ops" in entry:
        kwargs["window_size"] = list(kwargs["window_size"])
    with pytest.raises((TypeError, ValueError, RuntimeError)) as raised:
        VARLEN_ENTRIES[entry](*positional, **kwargs)
    message = str(raised.value)
    assert message.startswith("pallas::varlen_attention: "), message
    assert argument in message, message


# --- grouped_mm ---------------------------------------------------------------------

def _grouped_args(**change):
    args = dict(mat_a=torch.randn(10, 8), mat_b=torch.randn(3, 8, 6),
                offs=torch.tensor([3, 7, 10], dtype=I32), bias=None, out_dtype=None)
    args.update(change)
    return args


GROUPED_ENTRIES = {
    "pallas::grouped_mm": lambda a: torch_pallas.grouped_mm(
        a["mat_a"], a["mat_b"], offs=a["offs"], bias=a["bias"], out_dtype=a["out_dtype"]),
    "pallas::grouped_mm (torch.ops)": lambda a: torch.ops.pallas.grouped_mm(
        a["mat_a"], a["mat_b"], a["offs"], a["bias"], a["out_dtype"]),
}
GROUPED_BAD = {
    "offs decreasing": (dict(offs=torch.tensor([3, 2, 10], dtype=I32)), "offs"),
    "offs negative": (dict(offs=torch.tensor([-1, 7, 10], dtype=I32)), "offs"),
    "offs past the rows": (dict(offs=torch.tensor([3, 7, 11], dtype=I32)), "offs"),
    "offs float": (dict(offs=torch.tensor([3.0, 7.0, 10.0])), "offs"),
    "offs missing": (dict(offs=None), "offs"),
    "groups differ": (dict(offs=torch.tensor([3, 10], dtype=I32)), "offs"),
    "inner sizes differ": (dict(mat_b=torch.randn(3, 7, 6)), "mat_b"),
    "mat_b in float64": (dict(mat_b=torch.randn(3, 8, 6).double()), "mat_b"),
    "int mat_a": (dict(mat_a=torch.ones(10, 8, dtype=I32), mat_b=torch.ones(3, 8, 6, dtype=I32)),
                  "mat_a"),
    "1-D mat_a": (dict(mat_a=torch.randn(8)), "mat_a"),
    "bias shape": (dict(bias=torch.randn(3, 5)), "bias"),
    "bias dtype": (dict(bias=torch.randn(3, 6).double()), "bias"),
    "out_dtype": (dict(out_dtype=torch.float16), "out_dtype"),
}


@pytest.mark.parametrize("bad", list(GROUPED_BAD))
@pytest.mark.parametrize("entry", list(GROUPED_ENTRIES))
def test_grouped_mm_entry_points_name_themselves(entry, bad):
    change, argument = GROUPED_BAD[bad]
    with pytest.raises((TypeError, ValueError, RuntimeError)) as raised:
        GROUPED_ENTRIES[entry](_grouped_args(**change))
    message = str(raised.value)
    assert message.startswith("pallas::grouped_mm: "), message
    assert argument in message, message
