"""JAX's own shipped Pallas kernels as trainable torch ops, each in a few lines.

    python examples/jax_kernels.py     # trains each on CPU, checks it against torch

`torch_pallas.custom_op` turns a JAX function into a torch op; with no
`backward=`, autograd runs JAX's autodiff of the function, which applies the
kernels' own `jax.custom_vjp` rules (their backward kernels, on the residuals
their forward kept: attention's log-sum-exp, layer norm's mean and rstd). So
each kernel below is its JAX signature annotated for torch and one call:

| op `jax_kernels::` | JAX kernel, `jax.experimental.pallas.ops.` | gradient |
|---|---|---|
| `layer_norm` | `gpu.layer_norm.layer_norm` (Triton-style) | its custom_vjp |
| `mha` | `gpu.attention.mha` (flash attention, Triton-style) | its custom_vjp |
| `flash_attention` | `tpu.flash_attention.flash_attention` | its custom_vjp |
| `gmm` | `tpu.megablox.gmm` (grouped matmul, for MoE) | its custom_vjp |
| `paged_attention` | `tpu.paged_attention.paged_attention` | none: inference |
| `paged_attention_gpu` | `gpu.paged_attention.paged_attention` | none: inference |

On CPU they run in interpret mode: the GPU kernels take `interpret=`, which
the op fills in for the backend; the TPU flash attention and paged attention
take none and run under JAX's interpret-mode context all the same. JAX's
config objects (the attention `BlockSizes`) pass as they are through the op
`custom_op` returns; `torch.dtype` (gmm's `preferred_element_type`) arrives
as the JAX dtype; float8 and int8 KV caches (paged attention) cross as they
are.

Where they run on CPU: the TPU kernels on `interpret` (the default) and
`tpu_interpret`; the GPU ones, Triton-style `pl.pallas_call`s, on
`interpret` only (the TPU simulator asserts its own compiler parameters,
JAX's Mosaic GPU simulator runs no Triton-style kernel).

What the kernels themselves require (JAX's rules, not torch_pallas's):
- layer_norm normalizes the last axis (the wrapper folds any leading axes
  into rows; JAX's takes exactly [batch, seq, features]); float32 inside.
- mha: q, k, v [batch, seq, heads, head_dim], one length for q and kv when
  segment_ids [batch, seq] are given. The sequence must be a multiple of
  every block size (each clamped to the sequence): the forward checks its
  two, the backward's four go unchecked, and JAX's default BlockSizes
  (backward blocks of 32) on a sequence of 37 give NaN gradients. One block
  covering the sequence always works.
- flash_attention: q, k, v [batch, heads, seq, head_dim]; the kv length a
  multiple of 128 (lane-sized kv blocks), the q length a multiple of
  block_q; `ab`, a [batch, heads, q_len, kv_len] bias added before sm_scale,
  gets a gradient; segment ids per q and per kv position. JAX's default
  BlockSizes are 128 everywhere: give smaller q blocks for short queries.
- gmm: lhs [m, k] with m a multiple of tiling[0], rhs [groups, k, n] (k and
  n need not be multiples of the tiles), int32 group_sizes summing to m.
  JAX's vjp gives existing_out the whole output gradient, also on the rows
  the kernel overwrote (whose true gradient is 0).
- TPU paged attention reads unquantized K/V pages as bfloat16 (float32 ones
  too); int8 pages come with per-token scales `k_scales`/`v_scales`
  ([..., page_size, 1], JAX's QuantizedTensor). megacore_mode ("batch",
  "kv_head") splits the work over two TensorCores: it runs on `interpret`
  and on `tpu_interpret` (two simulated cores); on one simulated core it
  hangs, as JAX's docstring warns.
- GPU paged attention takes float8_e4m3fn, float8_e5m2 or int8 pages with
  per-token scales ([kv_heads, pages, page_size]), as JAX's tests pass them.

Each kernel has a float64 torch reference below (`*_reference`): its
forward, and autograd of it, are what tests/test_jax_kernels.py compares
the ops' outputs and gradients with.
"""

from __future__ import annotations

import torch
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.gpu import layer_norm as gpu_layer_norm
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash_attention
from jax.experimental.pallas.ops.tpu import megablox
from jax.experimental.pallas.ops.tpu import paged_attention as tpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils

import torch_pallas

MhaBlockSizes = gpu_attention.BlockSizes
FlashBlockSizes = tpu_flash_attention.BlockSizes


# -- the kernels as torch ops ------------------------------------------------

@torch_pallas.custom_op("jax_kernels::layer_norm")
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               interpret=None) -> torch.Tensor:
    # JAX's kernel takes (batch, seq, features): fold any leading axes into seq.
    rows = x.reshape(1, -1, x.shape[-1])
    out = gpu_layer_norm.layer_norm(rows, weight, bias, eps=eps, interpret=interpret or False)
    return out.reshape(x.shape)


@torch_pallas.custom_op("jax_kernels::mha")
def mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        segment_ids: torch.Tensor | None = None, sm_scale: float = 1.0, causal: bool = False,
        block_sizes: MhaBlockSizes | None = None, interpret=None) -> torch.Tensor:
    return gpu_attention.mha(q, k, v, segment_ids, sm_scale=sm_scale, causal=causal,
                             block_sizes=block_sizes or MhaBlockSizes.get_default(),
                             interpret=interpret or False)


@torch_pallas.custom_op("jax_kernels::flash_attention")
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    ab: torch.Tensor | None = None, q_segment_ids: torch.Tensor | None = None,
                    kv_segment_ids: torch.Tensor | None = None, causal: bool = False,
                    sm_scale: float = 1.0, block_sizes: FlashBlockSizes | None = None
                    ) -> torch.Tensor:
    segment_ids = None
    if q_segment_ids is not None:
        segment_ids = tpu_flash_attention.SegmentIds(q=q_segment_ids, kv=kv_segment_ids)
    return tpu_flash_attention.flash_attention(q, k, v, ab, segment_ids, causal=causal,
                                               sm_scale=sm_scale, block_sizes=block_sizes)


@torch_pallas.custom_op("jax_kernels::gmm")
def gmm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
        preferred_element_type: torch.dtype = torch.float32,
        tiling: tuple[int, ...] = (128, 128, 128), group_offset: torch.Tensor | None = None,
        existing_out: torch.Tensor | None = None, transpose_rhs: bool = False,
        interpret=None) -> torch.Tensor:
    # megablox.gmm is ops.gmm: the kernel with its custom_vjp (gmm + tgmm backward).
    return megablox.gmm(lhs, rhs, group_sizes, preferred_element_type, tiling, group_offset,
                        existing_out, transpose_rhs, interpret or False)


@torch_pallas.custom_op("jax_kernels::paged_attention", differentiable=False)
def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    lengths: torch.Tensor, page_indices: torch.Tensor,
                    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                    *, pages_per_compute_block: int, megacore_mode: str | None = None,
                    attn_logits_soft_cap: float | None = None, inline_seq_dim: bool = True
                    ) -> torch.Tensor:
    if k_scales is not None:
        k_pages = quantization_utils.QuantizedTensor(k_pages, k_scales)
    if v_scales is not None:
        v_pages = quantization_utils.QuantizedTensor(v_pages, v_scales)
    return tpu_paged_attention.paged_attention(
        q, k_pages, v_pages, lengths, page_indices,
        pages_per_compute_block=pages_per_compute_block, megacore_mode=megacore_mode,
        attn_logits_soft_cap=attn_logits_soft_cap, inline_seq_dim=inline_seq_dim)


@torch_pallas.custom_op("jax_kernels::paged_attention_gpu", differentiable=False)
def paged_attention_gpu(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        block_tables: torch.Tensor, lengths: torch.Tensor | None,
                        k_scales_pages: torch.Tensor | None = None,
                        v_scales_pages: torch.Tensor | None = None, *, block_h: int = 16,
                        pages_per_compute_block: int = 8, k_splits: int = 16,
                        attn_logits_soft_cap: float | None = None, interpret=None
                        ) -> torch.Tensor:
    return gpu_paged_attention.paged_attention(
        q, k_pages, v_pages, block_tables, lengths, k_scales_pages, v_scales_pages,
        block_h=block_h, pages_per_compute_block=pages_per_compute_block, k_splits=k_splits,
        attn_logits_soft_cap=attn_logits_soft_cap, interpret=interpret or False)


# -- float64 torch references ------------------------------------------------

def layer_norm_reference(x, weight, bias, eps=1e-5):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * weight.double() + bias.double()


def attention_mask(q_len, kv_len, causal=False, q_segment_ids=None, kv_segment_ids=None):
    """Which keys each query sees, [batch or 1, 1, q_len, kv_len] (None: all);
    causal is aligned at the top left (query i sees keys 0..i), as in both
    of JAX's kernels."""
    mask = None
    if q_segment_ids is not None:
        mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    if causal:
        tril = torch.ones(q_len, kv_len, dtype=torch.bool).tril()[None, None]
        mask = tril if mask is None else mask & tril
    return mask


def _softmax_attention(logits, v, mask, out_spec):
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum(f"bhqk,{out_spec}", logits.softmax(-1), v)


def mha_reference(q, k, v, segment_ids=None, sm_scale=1.0, causal=False):
    """q, k, v [batch, seq, heads, head_dim]."""
    q, k, v = q.double(), k.double(), v.double()
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * sm_scale
    mask = attention_mask(q.shape[1], k.shape[1], causal, segment_ids, segment_ids)
    return _softmax_attention(logits, v, mask, "bkhd->bqhd")


def flash_attention_reference(q, k, v, ab=None, q_segment_ids=None, kv_segment_ids=None,
                              causal=False, sm_scale=1.0):
    """q, k, v [batch, heads, seq, head_dim]; the bias is added before the scale."""
    q, k, v = q.double(), k.double(), v.double()
    logits = q @ k.transpose(-1, -2)
    if ab is not None:
        logits = logits + ab.double()
    mask = attention_mask(q.shape[2], k.shape[2], causal, q_segment_ids, kv_segment_ids)
    return _softmax_attention(logits * sm_scale, v, mask, "bhkd->bhqd")


def gmm_reference(lhs, rhs, group_sizes, group_offset=None, existing_out=None,
                  transpose_rhs=False):
    """Rows of group g (group_sizes[g] rows, in order) times rhs[g - group_offset],
    for the rhs.shape[0] groups from group_offset on; other rows are
    existing_out's (or zero)."""
    lhs, rhs = lhs.double(), rhs.double()
    if transpose_rhs:
        rhs = rhs.transpose(1, 2)
    ends = torch.cumsum(group_sizes.long(), 0).tolist()
    starts = [0] + ends[:-1]
    first = 0 if group_offset is None else int(group_offset)
    out = (torch.zeros(lhs.shape[0], rhs.shape[2], dtype=torch.float64) if existing_out is None
           else existing_out.double())
    for i in range(rhs.shape[0]):
        a, b = starts[first + i], ends[first + i]
        out = torch.cat([out[:a], lhs[a:b] @ rhs[i], out[b:]])
    return out


def pages_to_sequences(pages, page_indices):
    """[kv_heads, pages, page_size, d] pages -> [batch, kv_heads, max_len, d]."""
    heads, _, page_size, d = pages.shape
    batch, per_sequence = page_indices.shape
    gathered = pages[:, page_indices.long()]  # [kv_heads, batch, per_seq, page_size, d]
    return gathered.reshape(heads, batch, per_sequence * page_size, d).transpose(0, 1)


def paged_attention_reference(q, k, v, lengths=None, attn_logits_soft_cap=None):
    """One query per sequence against its first `lengths` keys, grouped heads:
    q [batch, heads, d], k and v [batch, kv_heads, max_len, d] (dequantized;
    pages_to_sequences)."""
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, d = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(batch, kv_heads, heads // kv_heads, d)
    logits = torch.einsum("bhgd,bhtd->bhgt", q, k)
    if attn_logits_soft_cap is not None:
        logits = torch.tanh(logits / attn_logits_soft_cap) * attn_logits_soft_cap
    if lengths is not None:
        visible = torch.arange(k.shape[2])[None] < lengths.long()[:, None]
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    return torch.einsum("bhgt,bhtd->bhgd", logits.softmax(-1), v).reshape(batch, heads, d)


def int8_quantize(x):
    """TPU paged attention's int8 cache (JAX's quantize_to_int8): values and
    per-token scales [..., 1]; dequantized as q * scale / 127.5."""
    scales = x.abs().amax(-1, keepdim=True)
    return torch.round(x * (127.5 / scales)).clamp(-128, 127).to(torch.int8), scales


def scaled_quantize(x, dtype):
    """GPU paged attention's cache in `dtype` (float8 or int8) with per-token
    scales [...] (not [..., 1]); dequantized as q * scale."""
    top = torch.finfo(dtype).max if dtype.is_floating_point else 127
    scales = x.abs().amax(-1) / (0.95 * top)
    scaled = x / scales[..., None]
    if not dtype.is_floating_point:
        scaled = scaled.round()
    return scaled.to(dtype), scales


# -- train each, check it ----------------------------------------------------

def _report(name, got, want):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    print(f"  {name}: max |error| {err:.1e}")
    assert err < 1e-3 * scale, (name, err)


def _train(name, op, reference, params, data, steps=8, lr=0.05):
    """A few Adam steps on op's mean squared error to a random target, the
    gradients at the first step checked against the float64 reference's."""
    target = torch.randn_like(op(*params, *data).detach().float())
    optimizer = torch.optim.Adam(params, lr=lr)
    losses = []
    for step in range(steps):
        loss = (op(*params, *data).float() - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            copies = [p.detach().double().requires_grad_() for p in params]
            (reference(*copies, *data) - target.double()).square().mean().backward()
            for i, (p, c) in enumerate(zip(params, copies)):
                _report(f"grad {i}", p.grad, c.grad)
        optimizer.step()
        losses.append(loss.item())
    print(f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} Adam steps")
    assert losses[-1] < losses[0]


def main():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 100)
    _train("layer_norm", lambda w, b, x: layer_norm(x, w, b),
           lambda w, b, x: layer_norm_reference(x, w, b),
           [torch.randn(100, requires_grad=True), torch.randn(100, requires_grad=True)], [x])

    seg = torch.tensor([[0] * 20 + [1] * 44, [0] * 64], dtype=torch.int32)
    blocks = MhaBlockSizes(32, 32, 32, 32, 32, 32)
    _train("mha", lambda q, k, v, s: mha(q, k, v, s, 0.25, True, blocks),
           lambda q, k, v, s: mha_reference(q, k, v, s, 0.25, True),
           [torch.randn(2, 64, 2, 32, requires_grad=True) for _ in range(3)], [seg])

    flash_blocks = FlashBlockSizes(
        block_q=64, block_k_major=128, block_k=128, block_b=1, block_q_major_dkv=64,
        block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=64, block_k_major_dq=128,
        block_k_dq=128, block_q_dq=64)
    _train("flash_attention",
           lambda q, k, v, ab: flash_attention(q, k, v, ab, causal=True, sm_scale=0.2,
                                               block_sizes=flash_blocks),
           lambda q, k, v, ab: flash_attention_reference(q, k, v, ab, causal=True, sm_scale=0.2),
           [torch.randn(1, 2, 64, 32, requires_grad=True),
            *[torch.randn(1, 2, 128, 32, requires_grad=True) for _ in range(2)],
            torch.randn(1, 2, 64, 128, requires_grad=True)], [])

    group_sizes = torch.tensor([10, 0, 30, 24], dtype=torch.int32)
    _train("gmm", lambda lhs, rhs, g: gmm(lhs, rhs, g, tiling=(16, 32, 32)),
           lambda lhs, rhs, g: gmm_reference(lhs, rhs, g),
           [torch.randn(64, 96, requires_grad=True), torch.randn(4, 96, 80, requires_grad=True)],
           [group_sizes])

    print("paged attention (inference):")
    q, pages = torch.randn(3, 8, 32), torch.randn(2, 2, 12, 8, 32)
    page_indices = torch.randperm(12, dtype=torch.int32).reshape(3, 4)
    lengths = torch.tensor([1, 17, 32], dtype=torch.int32)
    v = pages_to_sequences(pages[1], page_indices)
    k8, k_scales = scaled_quantize(pages[0], torch.float8_e4m3fn)
    got = paged_attention_gpu(q, k8, pages[1], page_indices, lengths, k_scales, None,
                              pages_per_compute_block=2, k_splits=2)
    dequantized = pages_to_sequences(k8.double() * k_scales[..., None].double(), page_indices)
    _report("gpu, float8_e4m3fn keys", got, paged_attention_reference(q, dequantized, v, lengths))
    kq, kq_scales = int8_quantize(pages[0])
    vq, vq_scales = int8_quantize(pages[1])
    got = paged_attention(q, kq, vq, lengths, page_indices, kq_scales, vq_scales,
                          pages_per_compute_block=2)
    k, v = (pages_to_sequences(x.double() * s.double() / 127.5, page_indices)
            for x, s in ((kq, kq_scales), (vq, vq_scales)))
    _report("tpu, int8 keys and values", got, paged_attention_reference(q, k, v, lengths))


if __name__ == "__main__":
    main()
