"""bench/gpu_check.py: the ops on an NVIDIA GPU (Hopper or newer for the
`mosaic_gpu` backend; `triton` anywhere), in phases that each fit one short
device call and write their results as they go.

Phases (`--list` prints every case with a rough time on one H100):

- correctness: every op on CUDA tensors on each GPU backend against torch
  or float64: small ragged calls (check_ops, check_attention), every
  registered op's examples, realistic shapes forward and backward (matmul
  4096^3 and an LLM projection; attention B2 H16 L4096 D128 causal, GQA,
  window, softcap, sinks; a Mixtral-like grouped_mm; the row ops at 8192
  columns; linear_cross_entropy 8192 x 4096, V 128256) against float64
  computed on the GPU, DLPack zero copy, CUDA stream semantics,
  torch.compile (Triton kernels, no JAX) and CUDA graphs of a compiled
  training step, and `pytest -m gpu`;
- speed: each goal of issue 64 part 3 as a case, the reference timed in
  the same process and interleaved with ours (CUDA events, medians over
  rounds after a warm-up); each row says shape, dtype, provider, ms,
  TFLOP/s or GB/s, ratio (reference time / ours), the goal and whether it
  is met;
- training: the training ops' pytest-benchmark suites (and bench_models.py
  unless --quick), and a Llama training step under torch.compile, patched
  by torch_pallas.transformers.apply against unpatched: time, peak memory,
  loss.

On the lent GPU machine, one device call each (`bench/gpu_machine.sh`
installs the project with `pip install --no-deps -e .` and the wheels
carried in .gpu-wheels/, and sets the environment). Correctness first, in
two calls of ~5 minutes (its --quick total, ~9 minutes, is more than one
call), then speed, then training (a session's 15 device minutes hold
correctness and speed; training takes the next one's):

    source bench/gpu_machine.sh && python bench/gpu_check.py --phase correctness --quick --out $OUT/correctness --case ops --case attention --case examples --case pytest_gpu
    source bench/gpu_machine.sh && python bench/gpu_check.py --phase correctness --quick --out $OUT/correctness2 --case realistic_matmul --case realistic_attention --case realistic_grouped_mm --case realistic_rows --case realistic_lce --case dlpack --case streams --case compile --case cuda_graphs_step
    source bench/gpu_machine.sh && python bench/gpu_check.py --phase speed --quick --out $OUT/speed --liger-wheel-dir .gpu-wheels
    source bench/gpu_machine.sh && python bench/gpu_check.py --phase training --quick --out $OUT/training

(device tool: timeout_s 480 for each; --budget-s, 420 s by default, keeps
a call inside that.) Without --quick, or to rerun a part:

    python bench/gpu_check.py --phase speed --case matmul --case attention --out $OUT/speed
    python bench/gpu_check.py --list

Each phase writes into --out, rewritten after every row (a call cut off by
its time limit still returns what it finished): `<phase>.json` (every row),
`<phase>.txt` (the table) and `<phase>.log` (everything printed, the
subprocesses' output included). `--budget-s` skips, and records as
skipped, the cases whose expected time no longer fits.

Exit status: 0 every result correct, 1 a wrong result (or a case that
raised, or a failed test suite), 2 no GPU. Unmet speed goals are reported,
not failures. `--tune` first tunes the Hopper matmul for the timed shapes
(kernels/mosaic_gpu/matmul_tuning.py; slow).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import math
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# --- results, written as they come ------------------------------------------------

class Tee:
    """stdout also into the phase's log file, line-buffered: the log holds
    what was printed up to the moment a call was cut off."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text):
        self.stream.write(text)
        self.file.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()
        self.file.flush()


class Recorder:
    """A phase's rows, each appended to `<phase>.json` and `<phase>.txt`
    (both rewritten whole, so that either is complete at every moment)."""

    def __init__(self, out: Path, phase: str, meta: dict):
        self.out, self.phase, self.meta, self.rows = out, phase, meta, []

    def add(self, **row) -> dict:
        row = {"phase": self.phase, **row}
        self.rows.append(row)
        self.write()
        return row

    def write(self) -> None:
        (self.out / f"{self.phase}.json").write_text(
            json.dumps(dict(**self.meta, rows=self.rows), indent=1, default=str))
        (self.out / f"{self.phase}.txt").write_text(self.table() + "\n")

    def table(self) -> str:
        lines = []
        checks = [r for r in self.rows if r["kind"] == "check"]
        if checks:
            lines.append(f"{'case':<24} {'check':<78} {'status':<8} detail")
            lines += [f"{r['case']:<24} {r['name']:<78} {r['status']:<8} {r.get('detail', '')}"
                      for r in checks]
        speed = [r for r in self.rows if r["kind"] == "speed"]
        if speed:
            lines.append(f"\n{'case':<22} {'shape':<34} {'dtype':<9} {'provider':<26} "
                         f"{'ms':>9} {'rate':>16} {'ratio':>6}  reference / goal / met")
            for r in speed:
                rate = "" if r.get("rate") is None else f"{r['rate']:.1f} {r['unit']}"
                ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
                ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
                met = {True: "MET", False: "not met", None: ""}[r.get("met")]
                lines.append(f"{r['case']:<22} {r['shape']:<34} {r['dtype']:<9} "
                             f"{r['provider']:<26} {ms:>9} {rate:>16} {ratio:>6}  "
                             f"{r.get('reference', '')} / {r.get('goal', '')} {met}"
                             + (f" [{r['note']}]" if r.get("note") else ""))
        other = [r for r in self.rows if r["kind"] not in ("check", "speed")]
        if other:
            lines.append("")
            lines += [json.dumps(r, default=str) for r in other]
        return "\n".join(lines)

    @property
    def wrong(self) -> list[dict]:
        return [r for r in self.rows if r.get("status") in ("WRONG", "ERROR")]


@dataclasses.dataclass
class Context:
    rec: Recorder
    quick: bool
    args: argparse.Namespace
    case: str = ""

    def check(self, name: str, ok: bool, detail: str = "", status: str | None = None):
        """One correctness row: ok, WRONG, or `status` (e.g. "refused": a
        backend's documented refusal, listed but not a wrong result)."""
        status = status or ("ok" if ok else "WRONG")
        print(f"  {self.case:<22} {name:<78} {status} {detail}", flush=True)
        self.rec.add(kind="check", case=self.case, name=name, status=status, detail=detail)

    def error(self, name: str, e: BaseException):
        traceback.print_exc()
        self.check(name, False, f"raised {type(e).__name__}: {str(e)[:500]}", status="ERROR")

    def guarded(self, name: str, fn: Callable) -> None:
        """`fn()`, a raise recorded as an ERROR row: one summary at the end."""
        try:
            fn()
        except Exception as e:  # report and go on
            self.error(name, e)

    def speed(self, **row):
        row = self.rec.add(kind="speed", case=self.case, **row)
        print("  " + json.dumps(row, default=str), flush=True)


# --- shared helpers ---------------------------------------------------------------

def gpu_backends() -> list[str]:
    major, _ = torch.cuda.get_device_capability()
    return (["mosaic_gpu"] if major >= 9 else []) + ["triton"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def float32_matmul_precision(setting: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def on_backend(backend: str, fn: Callable) -> Callable:
    """`fn` called under `torch_pallas.backend(backend)`."""
    import torch_pallas

    def call(*args, **kwargs):
        with torch_pallas.backend(backend):
            return fn(*args, **kwargs)

    return call


def refused(e: BaseException) -> bool:
    """A backend's own refusal of a call it does not take (a BackendError
    naming what): listed as "refused", not as a wrong result."""
    import torch_pallas

    return isinstance(e, torch_pallas.BackendError)


def compare(ctx: Context, name: str, got, ref, bound) -> bool:
    """|got - ref| <= bound elementwise (tensors or tuples of them); the row
    gives the worst error and the worst error / bound."""
    gots = got if isinstance(got, (tuple, list)) else (got,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    bounds = bound if isinstance(bound, (tuple, list)) else (bound,)
    ok, worst, worst_share = len(gots) == len(refs), 0.0, 0.0
    for g, r, b in zip(gots, refs, bounds):
        r = r.to(g.device)
        err = (g.detach().double() - r).abs()
        b = torch.as_tensor(b, dtype=torch.float64, device=err.device)
        ok &= bool((err <= b).all()) and bool(torch.isfinite(g).all())
        if err.numel():
            worst = max(worst, err.max().item())
            worst_share = max(worst_share, (err / b.clamp_min(1e-300)).max().item())
    ctx.check(name, ok, f"max err {worst:.3g}, {worst_share:.2f} of its bound")
    return ok


def rounding(dtype: torch.dtype) -> float:
    from torch_pallas.base import dtypes

    return dtypes.ROUNDING[dtype]


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def seeded(seed: int = 0) -> None:
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


# --- correctness: small ragged calls (the original one-shot check) ---------------

def check_ops(ctx: Context) -> None:
    """fill, iota, add and matmul on ragged shapes in every float dtype,
    against torch's results or float64 within the ops' bounds."""
    import torch_pallas
    from torch_pallas.ops import add as add_op, matmul as matmul_op

    dev = "cuda"
    for backend in gpu_backends():
        def expect(name, ok, detail="", backend=backend):
            ctx.check(f"{backend} {name}", ok, detail)

        with torch_pallas.backend(backend):
            for size in [(1,), (1000,), (3, 1001)]:
                def fill(size=size):
                    value = float(torch.randn(()))
                    out = torch.ops.pallas.fill(size, value, dtype=torch.float32, device=dev)
                    expect(f"fill {size}", torch.equal(out.cpu(), torch.full(size, value)))
                ctx.guarded(f"{backend} fill {size}", fill)
            for n in (1, 1000, 5000):
                def iota(n=n):
                    out = torch.ops.pallas.iota(n, dtype=torch.int32, device=dev)
                    expect(f"iota {n}", torch.equal(out.cpu(), torch.arange(n, dtype=torch.int32)))
                ctx.guarded(f"{backend} iota {n}", iota)
            for dtype in FLOATS:
                def add(dtype=dtype):
                    x = torch.randn(1000, 999, device=dev, dtype=dtype)
                    y = torch.randn(999, device=dev, dtype=dtype)
                    out, ref = torch.ops.pallas.add(x, y), add_op.reference(x.cpu(), y.cpu())
                    err = (out.cpu().double() - ref).abs()
                    expect(f"add (1000,999)+(999,) {dtype}",
                           bool((err <= rounding(dtype) * ref.abs()).all()))
                ctx.guarded(f"{backend} add {dtype}", add)
            cases = [((1, 1), (1, 1)), ((7, 5), (5, 3)), ((1000, 999), (999, 1001)),
                     ((257, 129), (129, 65)), ((3, 100, 70), (70, 50)),
                     ((2, 1, 64, 96), (3, 96, 40))]
            # float32 on the Tensor Cores is TF32: mosaic_gpu runs it only where
            # torch allows TF32 ('high'), and refuses at the default 'highest'.
            tf32 = backend == "mosaic_gpu"
            if tf32:
                def refuses_full_float32():
                    a = torch.randn(64, 64, device=dev)
                    try:
                        torch.ops.pallas.matmul(a, a)
                    except torch_pallas.BackendError as e:
                        expect("matmul float32 at 'highest' refused", "TF32" in str(e))
                    else:
                        expect("matmul float32 at 'highest' refused", False, "it ran")
                ctx.guarded(f"{backend} matmul float32 at 'highest'", refuses_full_float32)
            for dtype in FLOATS if not ctx.quick else (torch.float32, torch.bfloat16):
                for a_shape, b_shape in cases:
                    def matmul(a_shape=a_shape, b_shape=b_shape, dtype=dtype):
                        a = torch.randn(a_shape, device=dev, dtype=dtype)
                        b = torch.randn(b_shape, device=dev, dtype=dtype)
                        precision = "high" if tf32 and dtype == torch.float32 else "highest"
                        pairs = {"": (a, b), " b^T": (a, b.mT.contiguous().mT)}
                        for label, (x, w) in pairs.items():
                            with float32_matmul_precision(precision):
                                out = torch.ops.pallas.matmul(x, w)
                            ref = matmul_op.reference(x.cpu(), w.cpu())
                            bound = matmul_op.error_bound(x.cpu(), w.cpu(), ref,
                                                          tf32=precision == "high")
                            err = (out.cpu().double() - ref).abs()
                            expect(f"matmul {a_shape}x{b_shape}{label} {dtype} ({precision})",
                                   bool((err <= bound).all()), f"max err {err.max().item():.3g}")
                    ctx.guarded(f"{backend} matmul {a_shape} {dtype}", matmul)


def check_attention(ctx: Context) -> None:
    """Forward and gradients against float64 on ragged, GQA, causal and
    masked calls: within twice torch's own error in the dtype, plus a
    floor, as tests/test_attention.py bounds them."""
    import torch.nn.functional as F

    import torch_pallas
    from torch_pallas.ops import attention as attention_op

    atol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    cases = [((2, 4, 37, 64), (2, 2, 45, 64), {"enable_gqa": True}),
             ((2, 4, 300, 128), (2, 4, 300, 128), {"is_causal": True}),
             ((1, 8, 1, 128), (1, 2, 1000, 128), {"enable_gqa": True}),  # decode
             ((2, 2, 129, 80), (2, 2, 257, 80), {"attn_mask": "padding"}),
             ((1, 2, 200, 256), (1, 2, 190, 256), {"is_causal": True})]
    for backend in gpu_backends():
        dtypes = (torch.bfloat16,) if ctx.quick else (torch.bfloat16, torch.float16)
        dtypes += (torch.float32,) if backend == "triton" else ()
        for dtype in dtypes:
            for q_shape, k_shape, kwargs in cases:
                name = f"{backend} attention {q_shape}x{k_shape} {sorted(kwargs)} {dtype}"

                def one(q_shape=q_shape, k_shape=k_shape, kwargs=kwargs, dtype=dtype, name=name,
                        backend=backend):
                    q = torch.randn(q_shape, device="cuda", dtype=dtype, requires_grad=True)
                    k, v = (torch.randn(k_shape, device="cuda", dtype=dtype, requires_grad=True)
                            for _ in range(2))
                    kw = dict(kwargs)
                    if kw.get("attn_mask") == "padding":
                        kw["attn_mask"] = torch.rand(k_shape[0], 1, 1, k_shape[2],
                                                     device="cuda") > 0.2
                    grad = torch.randn(*q_shape[:-1], k_shape[-1], device="cuda", dtype=dtype)
                    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
                    ref = attention_op.reference(*leaves64, **{
                        n: (x.cpu() if torch.is_tensor(x) else x) for n, x in kw.items()})
                    ref_grads = torch.autograd.grad(ref, leaves64, grad.cpu().double())
                    results = {}
                    for label, fn in (("torch", F.scaled_dot_product_attention),
                                      ("pallas", torch_pallas.attention)):
                        with torch_pallas.backend(backend):
                            out = fn(q, k, v, **kw)
                        results[label] = (out, *torch.autograd.grad(out, (q, k, v), grad))
                    ok, worst = True, 0.0
                    for r, t, p in zip((ref, *ref_grads), results["torch"], results["pallas"]):
                        torch_err = (t.detach().cpu().double() - r).abs()
                        err = (p.detach().cpu().double() - r).abs()
                        floor = 2 * atol[dtype] * max(1.0, r.abs().max().item())
                        ok &= bool((err <= 2 * torch_err + floor).all())
                        worst = max(worst, err.max().item())
                    ctx.check(name, ok, f"max err {worst:.3g}")

                ctx.guarded(name, one)


def check_examples(ctx: Context) -> None:
    """Every registered op's example calls on CUDA against their float64
    references and bounds (the ones the CPU tests check on the simulators)."""
    import torch_pallas
    from torch_pallas.runtime import registry

    for backend in gpu_backends():
        for info in registry.ops():
            for i, example in enumerate(info.examples(torch.device("cuda"), False)):
                name = f"{backend} {info.name} example {i}"
                try:
                    with torch_pallas.backend(backend):
                        worst, within = example.error(
                            info.function(*example.args, **example.kwargs))
                    ctx.check(name, within, f"max err {worst:.3g}")
                except Exception as e:
                    ctx.error(name, e)


# --- correctness: realistic shapes against float64 on the GPU ----------------------

def matmul_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, dtype) -> torch.Tensor:
    """ops/matmul.py's error_bound on the GPU (float32 accumulation over K,
    one rounding to `dtype`), for 16-bit inputs."""
    k = a.shape[-1]
    magnitude = a.double().abs() @ b.double().abs()
    finfo = torch.finfo(dtype)
    return k * 2.0**-24 * magnitude + rounding(dtype) * ref.abs() + finfo.tiny * finfo.eps


def check_realistic_matmul(ctx: Context) -> None:
    """matmul 4096^3 bf16 and an LLM projection (F.linear's layout: the
    weight (N, K) read transposed), forward and both gradients on each
    backend, against float64 products on the GPU within ops/matmul.py's
    bound (each gradient is a product of its own)."""
    import torch_pallas

    shapes = [(4096, 4096, 4096, False), (4096, 4096, 14336, True)]
    if ctx.quick:
        shapes[1] = (2048, 4096, 14336, True)
    for backend in gpu_backends():
        for m, k, n, linear in shapes:
            name = f"{backend} matmul {m}x{k}x{n}{' (linear weight)' if linear else ''} bf16"

            def one(m=m, k=k, n=n, linear=linear, backend=backend, name=name):
                seeded(1)
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                b = w.t() if linear else w.detach().reshape(k, n).clone().requires_grad_()
                grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                with torch_pallas.backend(backend):
                    out = torch_pallas.matmul(a, b)
                    da, db = torch.autograd.grad(out, (a, b), grad)
                a64, b64, g64 = a.detach().double(), b.detach().double(), grad.double()
                ref = a64 @ b64
                compare(ctx, f"{name} forward", out, ref, matmul_bound(a, b, ref, out.dtype))
                del ref
                ref_da = g64 @ b64.T
                compare(ctx, f"{name} d_a", da, ref_da,
                        matmul_bound(grad, b.detach().T, ref_da, da.dtype))
                del ref_da
                ref_db = a64.T @ g64
                compare(ctx, f"{name} d_b", db, ref_db,
                        matmul_bound(a.detach().T, grad, ref_db, db.dtype))

            ctx.guarded(name, one)
            free_memory()


def attention_math(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, sinks=None,
                   scale=None):
    """Attention by its definition in the inputs' dtype (the realistic
    checks' reference in float64, and torch's own composition in 16 bits
    where SDPA has no such option): GQA by repeating key/value heads; a
    soft cap on the scaled scores before the mask; a window (left, right)
    and the causal rule, top-left aligned; sinks (Hq,) as one more logit
    per row in the softmax's denominator."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.mT) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(q.shape[2], device=q.device)[:, None]
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    hidden = torch.zeros(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        hidden |= cols > rows
    left, right = window
    if left >= 0:
        hidden |= cols < rows - left
    if right >= 0:
        hidden |= cols > rows + right
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(scores, -1)
    return p.to(v.dtype) @ v


ATTENTION_ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_realistic_attention(ctx: Context) -> None:
    """B2 H16 L4096 D128 bf16 forward and every gradient (the sinks' too):
    causal, GQA H16/4, a causal window of 1024, softcap 50, sinks, on each
    backend. The reference: attention_math in float64 on the GPU, one batch
    element at a time (a float64 score matrix of one element is 2 GiB). The
    bound, as tests/attention_reference.py's: twice torch's own error in
    bf16 (SDPA where it has the option, else attention_math in bf16) plus
    a floor of 2 x 1.6e-2 x max(1, |ref|)."""
    import torch.nn.functional as F

    import torch_pallas

    b, h, l, d = 2, 16, 4096, 128
    cases = {
        "causal": dict(h_kv=h, causal=True),
        "GQA 16/4 causal": dict(h_kv=4, causal=True),
        "window (1023, 0)": dict(h_kv=h, window=(1023, 0)),
        "softcap 50 causal": dict(h_kv=h, causal=True, softcap=50.0),
        "sinks causal": dict(h_kv=h, causal=True, sinks=True),
    }
    if ctx.quick:
        cases.pop("softcap 50 causal")
    for label, case in cases.items():
        seeded(2)
        q = torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, case["h_kv"], l, d, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        sinks = (torch.randn(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                 if case.get("sinks") else None)
        leaves = (q, k, v) + ((sinks,) if sinks is not None else ())
        grad = torch.randn_like(q)
        extras = dict(causal=case.get("causal", False), window=case.get("window", (-1, -1)),
                      softcap=case.get("softcap", 0.0))

        # float64 reference, one batch element at a time (sinks' gradient summed)
        refs = [torch.empty(q.shape, dtype=torch.float64, device="cuda")] + [
            torch.zeros(t.shape, dtype=torch.float64, device="cuda") for t in leaves]
        for i in range(b):
            one = [t.detach()[i:i + 1].double().requires_grad_() for t in (q, k, v)]
            s64 = sinks.detach().double().requires_grad_() if sinks is not None else None
            out = attention_math(*one, sinks=s64, **extras)
            grads = torch.autograd.grad(out, one + ([s64] if s64 is not None else []),
                                        grad[i:i + 1].double())
            refs[0][i:i + 1] = out.detach()
            for r, g in zip(refs[1:4], grads[:3]):
                r[i:i + 1] = g
            if s64 is not None:
                refs[4] += grads[3]
            del out, grads, one
            free_memory()

        # torch's own error in bf16
        plain = not extras["softcap"] and sinks is None
        if plain:
            mask = None
            if extras["window"] != (-1, -1):
                rows = torch.arange(l, device="cuda")[:, None]
                cols = torch.arange(l, device="cuda")[None, :]
                mask = (cols <= rows) & (cols >= rows - extras["window"][0])
            t_out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=extras["causal"] and mask is None,
                enable_gqa=case["h_kv"] != h)
        else:
            t_out = attention_math(q, k, v, sinks=sinks, **extras)
        torch_results = [t_out, *torch.autograd.grad(t_out, leaves, grad)]
        torch_errs = [(t.detach().double() - r).abs() for t, r in zip(torch_results, refs)]
        del torch_results, t_out
        free_memory()

        for backend in gpu_backends():
            name = f"{backend} attention B{b} H{h} L{l} D{d} bf16 {label}"
            try:
                with torch_pallas.backend(backend):
                    out = torch_pallas.attention(
                        q, k, v, is_causal=extras["causal"], enable_gqa=case["h_kv"] != h,
                        window_size=extras["window"], softcap=extras["softcap"], sinks=sinks)
                    ours = [out, *torch.autograd.grad(out, leaves, grad)]
            except Exception as e:
                if refused(e):
                    ctx.check(name, True, f"refused: {str(e)[:200]}", status="refused")
                else:
                    ctx.error(name, e)
                continue
            for what, o, r, te in zip(("out", "dq", "dk", "dv", "dsinks"), ours, refs,
                                      torch_errs):
                floor = 2 * ATTENTION_ATOL[torch.bfloat16] * max(1.0, r.abs().max().item())
                compare(ctx, f"{name} {what}", o, r, 2 * te + floor)
            del ours, out
            free_memory()
        del refs, torch_errs
        free_memory()


def uneven_offs(rows: int, groups: int, seed: int, multiple: int = 1,
                device="cuda") -> torch.Tensor:
    """Cumulative group ends (int32) of `rows` rows in `groups` uneven
    groups: Dirichlet(1) shares (normalized exponential draws of a seeded
    generator), each size a multiple of `multiple`, the last group taking
    the remainder; small groups may be empty."""
    generator = torch.Generator().manual_seed(seed)
    draws = -torch.log(torch.rand(groups, generator=generator, dtype=torch.float64))
    sizes = (draws / draws.sum() * rows / multiple).floor().long() * multiple
    sizes[-1] += rows - int(sizes.sum())
    return sizes.cumsum(0).to(torch.int32).to(device)


def check_realistic_grouped_mm(ctx: Context) -> None:
    """Mixtral-like experts: x (16384, 4096) on 8 uneven groups times
    weights (8, 4096, 1792) given as transformers passes them (the
    transposed view of (G, N, K)), forward and both gradients on each
    backend against float64 on the GPU, group by group, within
    ops/grouped_mm.py's bound (K of each product)."""
    import torch_pallas
    from torch_pallas.ops import grouped_mm as grouped_mm_op

    rows, hidden, width, groups = (8192 if ctx.quick else 16384), 4096, 1792, 8
    for backend in gpu_backends():
        name = f"{backend} grouped_mm {rows}x{hidden}x{width}, {groups} uneven groups bf16"

        def one(backend=backend, name=name):
            seeded(3)
            offs = uneven_offs(rows, groups, 3)
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)
            w_nk = torch.randn(groups, width, hidden, device="cuda", dtype=torch.bfloat16)
            w_nk = (w_nk * hidden ** -0.5).requires_grad_()
            w = w_nk.transpose(-2, -1)
            grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
            with torch_pallas.backend(backend):
                out = torch_pallas.grouped_mm(x, w, offs=offs)
                dx, dw = torch.autograd.grad(out, (x, w_nk), grad)
            x64, w64, g64 = x.detach().double(), w.detach().double(), grad.double()
            ref, ref_dx = torch.zeros_like(g64), torch.zeros_like(x64)
            ref_dw = torch.zeros(w_nk.shape, dtype=torch.float64, device="cuda")
            bounds = [0, *offs.tolist()]
            for g, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
                ref[s:e] = x64[s:e] @ w64[g]
                ref_dx[s:e] = g64[s:e] @ w64[g].T
                ref_dw[g] = (x64[s:e].T @ g64[s:e]).T
            largest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
            compare(ctx, f"{name} forward", out, ref,
                    grouped_mm_op.error_bound(x, ref, hidden))
            compare(ctx, f"{name} d_x", dx, ref_dx, grouped_mm_op.error_bound(x, ref_dx, width))
            compare(ctx, f"{name} d_w", dw, ref_dw,
                    grouped_mm_op.error_bound(x, ref_dw, largest))

        ctx.guarded(name, one)
        free_memory()


def check_realistic_rows(ctx: Context) -> None:
    """The row ops at 8192 columns in bf16, forward and gradients, against
    float64 on the GPU: rms_norm and layer_norm (4096 x 8192, with weight,
    layer_norm with bias), swiglu (4096 x 8192), rotary_embedding (q 32
    heads, k 8 heads, 4096 positions, head dim 128). Forward bounds are the
    ops' own (ops/*.py error_bound); gradients take the ops' backward
    examples' form, (|ref| + 1) x 8 x rounding x sqrt(terms summed)."""
    import torch_pallas
    from torch_pallas.ops import (layer_norm as layer_norm_op, rms_norm as rms_norm_op,
                                  rotary_embedding as rotary_op, swiglu as swiglu_op)

    rows, cols, dtype = 4096, 8192, torch.bfloat16
    r = rounding(dtype)

    def grad_bound(ref, terms):
        return (ref.abs() + 1) * 8 * r * math.sqrt(terms)

    for backend in gpu_backends():
        def rms(backend=backend):
            seeded(4)
            x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
            w = (torch.rand(cols, device="cuda") + 0.5).to(dtype).requires_grad_()
            grad = torch.randn(rows, cols, device="cuda", dtype=dtype)
            with torch_pallas.backend(backend):
                out = torch_pallas.rms_norm(x, (cols,), w, eps=1e-6)
                dx, dw = torch.autograd.grad(out, (x, w), grad)
            x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
            ref = rms_norm_op.reference(x64, (cols,), w64, eps=1e-6)
            rdx, rdw = torch.autograd.grad(ref, (x64, w64), grad.double())
            name = f"{backend} rms_norm {rows}x{cols} bf16"
            compare(ctx, f"{name} forward", out, ref.detach(),
                    rms_norm_op.error_bound(x, ref.detach()))
            compare(ctx, f"{name} d_x", dx, rdx, grad_bound(rdx, cols))
            compare(ctx, f"{name} d_weight", dw, rdw, grad_bound(rdw, rows))

        def layer(backend=backend):
            seeded(5)
            x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
            w = (torch.rand(cols, device="cuda") + 0.5).to(dtype).requires_grad_()
            bias = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
            grad = torch.randn(rows, cols, device="cuda", dtype=dtype)
            with torch_pallas.backend(backend):
                out = torch_pallas.layer_norm(x, (cols,), w, bias)
                dx, dw, db = torch.autograd.grad(out, (x, w, bias), grad)
            leaves = [t.detach().double().requires_grad_() for t in (x, w, bias)]
            ref = layer_norm_op.reference(leaves[0], (cols,), leaves[1], leaves[2])
            rdx, rdw, rdb = torch.autograd.grad(ref, leaves, grad.double())
            name = f"{backend} layer_norm {rows}x{cols} bf16"
            compare(ctx, f"{name} forward", out, ref.detach(),
                    layer_norm_op.error_bound(x, ref.detach(), cols))
            compare(ctx, f"{name} d_x", dx, rdx, grad_bound(rdx, cols))
            compare(ctx, f"{name} d_weight", dw, rdw, grad_bound(rdw, rows))
            compare(ctx, f"{name} d_bias", db, rdb, grad_bound(rdb, rows))

        def swiglu(backend=backend):
            seeded(6)
            gate, up = (torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
                        for _ in range(2))
            grad = torch.randn(rows, cols, device="cuda", dtype=dtype)
            with torch_pallas.backend(backend):
                out = torch_pallas.swiglu(gate, up)
                dg, du = torch.autograd.grad(out, (gate, up), grad)
            leaves = [t.detach().double().requires_grad_() for t in (gate, up)]
            ref = swiglu_op.reference(*leaves)
            rdg, rdu = torch.autograd.grad(ref, leaves, grad.double())
            name = f"{backend} swiglu {rows}x{cols} bf16"
            compare(ctx, f"{name} forward", out, ref.detach(),
                    swiglu_op.error_bound(gate, ref.detach()))
            compare(ctx, f"{name} d_gate", dg, rdg, grad_bound(rdg, 1))
            compare(ctx, f"{name} d_up", du, rdu, grad_bound(rdu, 1))

        def rotary(backend=backend):
            seeded(7)
            length, dim = 4096, 128
            q = torch.randn(1, 32, length, dim, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(1, 8, length, dim, device="cuda", dtype=dtype, requires_grad=True)
            angles = torch.arange(length, device="cuda")[:, None] * (
                10000.0 ** (-torch.arange(0, dim, 2, device="cuda") / dim))
            angles = torch.cat([angles, angles], -1)[None]
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            gq, gk = torch.randn_like(q), torch.randn_like(k)
            with torch_pallas.backend(backend):
                oq, ok_ = torch_pallas.rotary_embedding(q, k, cos, sin)
                dq, dk = torch.autograd.grad((oq, ok_), (q, k), (gq, gk))
            leaves = [t.detach().double().requires_grad_() for t in (q, k)]
            rq, rk = rotary_op.torch_rotary_embedding(*leaves, cos.double(), sin.double())
            rdq, rdk = torch.autograd.grad((rq, rk), leaves, (gq.double(), gk.double()))
            name = f"{backend} rotary_embedding q(1,32,{length},{dim}) k 8 heads bf16"
            for what, o, ref, x in (("q", oq, rq, q), ("k", ok_, rk, k)):
                bound = rotary_op.error_bound(x, cos, sin, ref.detach().cpu()).to("cuda")
                compare(ctx, f"{name} {what}", o, ref.detach(), bound)
            compare(ctx, f"{name} d_q", dq, rdq, grad_bound(rdq, 2))
            compare(ctx, f"{name} d_k", dk, rdk, grad_bound(rdk, 2))

        for label, fn in (("rms_norm", rms), ("layer_norm", layer), ("swiglu", swiglu),
                          ("rotary_embedding", rotary)):
            ctx.guarded(f"{backend} {label}", fn)
            free_memory()


def check_realistic_linear_cross_entropy(ctx: Context) -> None:
    """linear_cross_entropy at 8192 tokens x hidden 4096, V 128256, bf16
    (4096 tokens with --quick), loss and gradients on each backend against
    float64 on the GPU in chunks of 1024 rows (a float64 logit matrix of
    all rows is 8 GiB): the logits rounded to bf16 first, as
    ops/linear_cross_entropy.py's reference rounds them; the loss within
    its error_bound, the gradients within the backward examples' form."""
    import torch_pallas
    from torch_pallas.ops import linear_cross_entropy as lce_op

    tokens, hidden, vocab = (4096 if ctx.quick else 8192), 4096, 128256
    seeded(8)
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden ** -0.5).to(
        torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    target[::97] = -100  # some ignored rows
    counted = int((target != -100).sum())
    x64, w64 = x.detach().double(), w.detach().double()
    loss_sum, rdx = 0.0, torch.zeros_like(x64)
    rdw = torch.zeros_like(w64)
    for s in range(0, tokens, 1024):
        z = (x64[s:s + 1024] @ w64.T).to(torch.bfloat16).double()
        t = target[s:s + 1024]
        keep = t != -100
        lse = torch.logsumexp(z, -1)
        picked = z.gather(1, t.clamp_min(0)[:, None])[:, 0]
        loss_sum += float(((lse - picked) * keep).sum())
        p = torch.softmax(z, -1)
        p[torch.arange(len(t), device="cuda"), t.clamp_min(0)] -= 1
        p *= keep[:, None] / counted
        rdx[s:s + 1024] = p @ w64
        rdw += p.T @ x64[s:s + 1024]
        del z, p
    ref = torch.tensor(loss_sum / counted, dtype=torch.float64, device="cuda")
    free_memory()
    for backend in gpu_backends():
        name = f"{backend} linear_cross_entropy {tokens}x{hidden} V{vocab} bf16"

        def one(backend=backend, name=name):
            with torch_pallas.backend(backend):
                loss = torch_pallas.linear_cross_entropy(x, w, target)
                dx, dw = torch.autograd.grad(loss, (x, w))
            compare(ctx, f"{name} loss", loss, ref, lce_op.error_bound(x, w, ref))
            for what, o, r in (("d_input", dx, rdx), ("d_weight", dw, rdw)):
                compare(ctx, f"{name} {what}", o, r,
                        (r.abs() + 1) * rounding(torch.bfloat16) * 8 * (hidden + tokens) ** 0.5)

        ctx.guarded(name, one)
        free_memory()


# --- correctness: DLPack, streams, torch.compile, CUDA graphs --------------------

def check_dlpack(ctx: Context) -> None:
    """Zero copy across the bridge (torch_pallas/runtime/bridge.py): a CUDA
    tensor's JAX array is the same memory (unsafe_buffer_pointer ==
    data_ptr), writes to the tensor show in the array, and a JAX result
    handed to torch is the array's memory too."""
    import jax.numpy as jnp

    from torch_pallas.runtime import bridge

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        name = f"DLPack torch -> JAX shares memory, {dtype_name(dtype)} (1000, 999)"

        def into(dtype=dtype, name=name):
            t = torch.arange(1000 * 999, device="cuda").reshape(1000, 999).to(dtype)
            array = bridge.to_jax(t)
            same = array.unsafe_buffer_pointer() == t.data_ptr()
            t[0, 0] = 7  # seen through the array: the same bytes
            torch.cuda.synchronize()
            seen = float(array[0, 0]) == 7.0
            ctx.check(name, same and seen, f"pointers {'equal' if same else 'differ'}, "
                      f"write {'seen' if seen else 'not seen'}")

        ctx.guarded(name, into)

    def back():
        array = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 2
        t = bridge.to_torch(array)
        ok = (t.device.type == "cuda" and t.data_ptr() == array.unsafe_buffer_pointer()
              and torch.equal(t.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2))
        ctx.check("DLPack JAX -> torch shares memory", ok, f"device {t.device}")

    ctx.guarded("DLPack JAX -> torch", back)


def check_streams(ctx: Context) -> None:
    """torch.cuda.Stream semantics kept by each backend's launch, checked
    deterministically: a long `torch.cuda._sleep` queued on a stream delays
    everything ordered after it, so an op that did not order itself after
    the current stream's work would read stale inputs (and one the default
    stream did not wait for would be read unfinished) every time.

    1. on a side stream: the input is written after a sleep, then the op
       runs: its result must reflect the write (the op ordered after the
       side stream's work), read after side.synchronize();
    2. the same result consumed on the default stream after
       current_stream().wait_stream(side), while the side stream's op is
       still behind a sleep: the consumer must see the finished result;
    3. the default stream untouched: work queued on it meanwhile (a sleep,
       then a write of garbage into another tensor) does not change the
       side stream's result."""
    import torch_pallas

    cycles = 200_000_000  # ~0.1 s at 1.8 GHz: far longer than any launch's host path
    for backend in gpu_backends():
        def run(backend=backend):
            with torch_pallas.backend(backend):
                side = torch.cuda.Stream()
                a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
                x = torch.zeros(1024, 1024, device="cuda", dtype=torch.bfloat16)
                bystander = torch.zeros(1024, 1024, device="cuda", dtype=torch.bfloat16)
                expected_sum = (a.float() + b.float()).to(torch.bfloat16).cpu()
                expected_mm = (a.double() @ b.double()).cpu()
                torch.cuda.synchronize()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(cycles)
                    x.copy_(a)  # written late on the side stream
                    y = torch.ops.pallas.add(x, b)
                    m = torch.ops.pallas.matmul(x, b)
                # default stream: garbage into a tensor the op does not touch
                torch.cuda._sleep(cycles // 4)
                bystander.fill_(float("nan"))
                side.synchronize()
                ok1 = torch.equal(y.cpu(), expected_sum)
                err = (m.cpu().double() - expected_mm).abs().max().item()
                ok1 &= err < 1.0  # any stale input (x = 0) gives errors of order 30
                ctx.check(f"{backend} op on a side stream sees the stream's earlier writes",
                          ok1, f"matmul max err {err:.3g}")

                # 2: consumed on the default stream after wait_stream
                z = torch.empty_like(x)
                with torch.cuda.stream(side):
                    torch.cuda._sleep(cycles)
                    x.copy_(b)
                    y2 = torch.ops.pallas.add(x, a)
                torch.cuda.current_stream().wait_stream(side)
                z.copy_(y2)  # on the default stream
                y2.record_stream(torch.cuda.current_stream())
                torch.cuda.synchronize()
                ok2 = torch.equal(z.cpu(), (b.float() + a.float()).to(torch.bfloat16).cpu())
                ctx.check(f"{backend} side stream's result visible to the default stream "
                          "after wait_stream", ok2)
                ok3 = torch.equal(y.cpu(), expected_sum) and bool(bystander.isnan().all())
                ctx.check(f"{backend} default stream's later work leaves the side result",
                          ok3)

        ctx.guarded(f"{backend} streams", run)


def check_compile(ctx: Context) -> None:
    """torch.compile of ops: the generated code launches the Triton
    kernels (no JAX), its values those of eager; mode="reduce-overhead"
    (CUDA graphs) gives identical results."""
    from torch._inductor.utils import run_and_get_code

    import torch_pallas  # noqa: F401

    def f(a, b, x):
        h = torch.ops.pallas.add(torch.ops.pallas.matmul(a, b), x)
        return h * torch.ops.pallas.fill(h.shape, 0.5, dtype=h.dtype, device=h.device)

    a = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(200, 170, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(170, device="cuda", dtype=torch.bfloat16)
    try:
        out, code = run_and_get_code(torch.compile(f, fullgraph=True), a, b, x)
        source = "\n".join(code)
        eager = f(a, b, x)
        ok = ("matmul_kernel" in source and "jax" not in source
              and torch.allclose(out.float(), eager.float(), rtol=2e-2, atol=2e-1))
        graphed = None
        for _ in range(3):
            graphed = torch.compile(f, fullgraph=True, mode="reduce-overhead")(a, b, x)
        ok_graphs = torch.equal(graphed, out)
    except Exception as e:
        ctx.error("torch.compile of pallas ops", e)
        return
    ctx.check("torch.compile launches the Triton kernels, no JAX", ok)
    ctx.check("reduce-overhead (CUDA graphs) gives identical results", ok_graphs)


class TinyBlock(torch.nn.Module):
    """A training step's worth of the ops: rms_norm, a Linear on the
    Pallas matmul, swiglu, another Linear, then the LM head's fused loss."""

    def __init__(self, hidden=512, width=1024, vocab=4096):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.up = torch.nn.Parameter(torch.randn(2 * width, hidden) * hidden ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(hidden, width) * width ** -0.5)
        self.head = torch.nn.Parameter(torch.randn(vocab, hidden) * hidden ** -0.5)

    def forward(self, x, target):
        import torch_pallas

        h = torch_pallas.rms_norm(x, (x.shape[-1],), self.norm, eps=1e-6)
        gate, up = torch_pallas.linear(h, self.up).chunk(2, -1)
        h = x + torch_pallas.linear(torch_pallas.swiglu(gate, up), self.down)
        return torch_pallas.linear_cross_entropy(h, self.head, target)


def check_cuda_graphs_step(ctx: Context) -> None:
    """A training step (forward and backward of TinyBlock) compiled with
    mode="reduce-overhead": run under CUDA graphs (no cudagraph skip
    counted by inductor) and equal to the eager step on the Triton backend
    within bf16 tolerance, loss and every gradient, over three steps (the
    first records the graphs, the next replay them)."""
    import torch_pallas
    from torch._dynamo.utils import counters

    seeded(9)
    model = TinyBlock().cuda().to(torch.bfloat16)
    x = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 4096, (8, 256), device="cuda")

    def step(fn):
        loss = fn(x, target)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        return [loss.detach().clone(), *(g.clone() for g in grads)]

    with torch_pallas.backend("triton"):
        eager = step(model)
    counters["inductor"]["cudagraph_skips"] = 0
    compiled = torch.compile(model, mode="reduce-overhead")
    for i in range(3):
        got = step(compiled)
        worst = max(((g.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-6))
                    .item() for g, e in zip(got, eager))
        ctx.check(f"reduce-overhead training step {i + 1} equals eager (loss and grads)",
                  worst < 2e-2, f"worst relative error {worst:.3g}")
    skips = counters["inductor"]["cudagraph_skips"]
    ctx.check("the compiled step ran under CUDA graphs (no cudagraph skips)", skips == 0,
              f"{skips} skips")


def run_logged(ctx: Context, name: str, command: list[str], timeout: float) -> int | None:
    """A subprocess, its output streamed into the phase's log as it comes;
    killed after `timeout` seconds (None then)."""
    print(f"$ {' '.join(command)}  (timeout {timeout:.0f} s)", flush=True)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    killed = threading.Event()

    def kill():
        killed.set()
        process.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for line in process.stdout:
            sys.stdout.write(line)
        process.wait()
    finally:
        timer.cancel()
    if killed.is_set():
        ctx.check(name, False, f"timed out after {timeout:.0f} s", status="ERROR")
        return None
    return process.returncode


def run_gpu_tests(ctx: Context) -> None:
    """pytest -m gpu over tests/ (one process: the GPU is one)."""
    rc = run_logged(ctx, "pytest -m gpu", [
        sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider",
        "tests"], timeout=ctx.args.remaining())
    if rc is not None:
        ctx.check("pytest -m gpu", rc in (0, 5), f"exit status {rc}")


# --- speed ------------------------------------------------------------------------

ROUNDS = 10


def median_ms(calls: dict[str, Callable], rounds: int | None = None,
              batch_ms: float = 5.0) -> dict[str, float | str]:
    """Each call's median milliseconds, interleaved: after a warm-up (two
    calls: compiled, memory touched), `rounds` rounds each timing every
    call once in turn, as a batch of back-to-back calls lasting about
    `batch_ms` between CUDA events (the host's dispatch overlapping the
    device's work, as in a model's step). A call that raises gets its
    error's first line instead of a time."""
    rounds = rounds or ROUNDS
    result, ready, per_batch = {}, {}, {}
    for name, call in calls.items():
        try:
            call()
            call()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            one = max(start.elapsed_time(end), 1e-3)
            per_batch[name] = max(1, min(200, math.ceil(batch_ms / one)))
            ready[name] = call
        except Exception as e:
            traceback.print_exc()
            result[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    times = {name: [] for name in ready}
    for _ in range(rounds):
        for name, call in ready.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_batch[name]):
                call()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / per_batch[name])
    result.update({name: statistics.median(t) for name, t in times.items()})
    return result


def speed_rows(ctx: Context, times: dict, *, shape: str, dtype: str, reference: str,
               goal: str, goal_ratio: float | None = 1.0, work: float = 0.0,
               unit: str = "TFLOP/s", ours: Callable[[str], bool] = None, note: str = ""):
    """One row per provider: ms, rate (`work` per second: FLOPs for
    TFLOP/s, bytes for GB/s), ratio = the reference's ms / this one's, and
    for our providers (`ours(name)`: pallas or compiled rows) whether
    ratio >= goal_ratio."""
    ours = ours or (lambda name: name.startswith(("pallas", "compiled", "quickstart")))
    ref_ms = times.get(reference)
    for name, ms in times.items():
        if isinstance(ms, str):
            ctx.speed(shape=shape, dtype=dtype, provider=name, ms=None, error=ms,
                      reference=reference, goal=goal, met=False if ours(name) else None)
            continue
        rate = None
        if work:
            rate = work / (ms * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9)
        ratio = ref_ms / ms if isinstance(ref_ms, float) else None
        met = (ratio >= goal_ratio if ratio is not None and goal_ratio is not None else None) \
            if ours(name) else None
        ctx.speed(shape=shape, dtype=dtype, provider=name, ms=ms, rate=rate, unit=unit,
                  ratio=ratio, reference=reference, goal=goal, met=met, note=note)


def time_matmul(ctx: Context) -> None:
    """matmul at 4096^3, 8192^3 and LLM projections (Llama-3-8B's MLP and
    QKV at 8192 tokens, F.linear's weight layout) in bf16 (and fp16 at
    4096^3 unless --quick) against torch.matmul (cuBLAS): the op on each
    backend (mosaic_gpu: the warp-specialized kernel it picks on Hopper),
    the quickstart-style pipelined kernel, and torch.compile of the op (the
    Triton path). Goal: >= 1.0x cuBLAS."""
    import jax

    import torch_pallas
    from torch_pallas.runtime import bridge

    shapes = [(4096, 4096, 4096, False), (8192, 8192, 8192, False),
              (8192, 4096, 14336, True), (8192, 4096, 6144, True)]
    if ctx.quick:
        shapes = shapes[:3]
    cases = [(s, torch.bfloat16) for s in shapes]
    if not ctx.quick:
        cases.append((shapes[0], torch.float16))
    for (m, k, n, linear), dtype in cases:
        seeded(10)
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype).t() if linear else \
            torch.randn(k, n, device="cuda", dtype=dtype)
        if ctx.args.tune and "mosaic_gpu" in gpu_backends():
            from torch_pallas.kernels.mosaic_gpu import matmul_tuning

            matmul_tuning.tune(jax.numpy.dtype(dtype_name(dtype)), m, n, k)
            torch_pallas.clear_cache()
        calls = {"torch.matmul (cuBLAS)": lambda: torch.matmul(a, b)}
        for backend in gpu_backends():
            calls[f"pallas[{backend}]"] = on_backend(backend, lambda: torch_pallas.matmul(a, b))
        compiled = torch.compile(lambda a, b: torch.ops.pallas.matmul(a, b), fullgraph=True)
        calls["compiled (triton)"] = lambda: compiled(a, b)
        if "mosaic_gpu" in gpu_backends() and not linear and m == 4096:
            try:
                from torch_pallas.kernels.mosaic_gpu import matmul as mosaic_matmul

                seed = jax.jit(functools.partial(
                    mosaic_matmul.matmul, transpose_a=False, transpose_b=False,
                    config=mosaic_matmul.MatmulConfig.default("mosaic_gpu"), interpret=None))
                ja, jb = bridge.to_jax(a.reshape(1, m, k)), bridge.to_jax(b.reshape(1, k, n))
                calls["quickstart kernel (jax)"] = lambda: seed(ja, jb).block_until_ready()
            except Exception as e:
                print(f"quickstart kernel not timed: {e}")
        times = median_ms(calls)
        speed_rows(ctx, times, shape=f"{m}x{k}x{n}" + (" (linear weight)" if linear else ""),
                   dtype=dtype_name(dtype), reference="torch.matmul (cuBLAS)",
                   goal=">= 1.0x cuBLAS", work=2.0 * m * n * k,
                   ours=lambda name: name.startswith(("pallas", "compiled")))
        del a, b
        free_memory()


SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def time_attention(ctx: Context) -> None:
    """Attention bf16 D128 H16 at 16384 tokens a batch (L 4096 B4, L 8192
    B2, L 16384 B1; --quick: 4096 and 8192), causal and not, forward and
    forward+backward: torch SDPA on its flash, cuDNN and efficient backends
    (whichever run; the fastest is the reference, named in each row), our
    op on each backend and compiled. TFLOP/s as FlashAttention counts them
    (backward 2.5x the forward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch_pallas
    from torch_pallas.kernels.attention_shapes import AttentionDims, attention_flops

    lengths = (4096, 8192) if ctx.quick else (4096, 8192, 16384)
    h, d = 16, 128
    for length in lengths:
        batch = 16384 // length
        for causal in (False, True):
            seeded(11)
            q, k, v = (torch.randn(batch, h, length, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            flops = attention_flops(AttentionDims(batch, h, h, length, length, d, d), causal)
            forwards = {}
            for name in SDPA_BACKENDS:
                def sdpa(name=name):
                    with sdpa_kernel(getattr(SDPBackend, name)):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=causal)
                forwards[f"sdpa {name.split('_')[0].lower()}"] = sdpa
            for backend in gpu_backends():
                forwards[f"pallas[{backend}]"] = on_backend(
                    backend, lambda: torch_pallas.attention(q, k, v, is_causal=causal))
            compiled = torch.compile(
                lambda q, k, v: torch_pallas.attention(q, k, v, is_causal=causal),
                fullgraph=True)
            forwards["compiled (triton)"] = lambda: compiled(q, k, v)
            both = {name: (lambda f=f: torch.autograd.grad(f(), (q, k, v), grad))
                    for name, f in forwards.items()}
            shape = f"B{batch} H{h} L{length} D{d} {'causal' if causal else 'full'}"
            for label, calls, work in (("fwd", forwards, flops), ("fwd+bwd", both, 3.5 * flops)):
                times = median_ms(calls, rounds=ROUNDS if not ctx.quick else 6)
                sdpa_times = {n: t for n, t in times.items()
                              if n.startswith("sdpa") and isinstance(t, float)}
                reference = min(sdpa_times, key=sdpa_times.get) if sdpa_times else "sdpa flash"
                speed_rows(ctx, times, shape=f"{shape} {label}", dtype="bfloat16",
                           reference=reference, goal=">= 1.0x SDPA's fastest", work=work)
            del q, k, v, grad
            free_memory()


def time_varlen(ctx: Context) -> None:
    """Packed sequences and a sliding window, bf16, 16 heads of 128:
    torch's `varlen_attn` (FlashAttention 2, its window included) against
    `varlen_attention` on each GPU backend, forward and forward+backward
    (no goal of the issue's; kept from the earlier one-shot check)."""
    from torch.nn.attention.varlen import varlen_attn

    import torch_pallas

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(512, 8192, (16,), generator=generator).tolist()
    cases = [("16 packed causal", lengths, (-1, 0))]
    if not ctx.quick:
        cases.append(("32768 tokens window 4096", [32768], (4095, 0)))
    for label, lengths, window in cases:
        tokens, longest = sum(lengths), max(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        q, k, v = (torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        forwards = {"torch varlen_attn": lambda: varlen_attn(q, k, v, cu, cu, longest, longest,
                                                             window_size=window)}
        for backend in gpu_backends():
            forwards[f"pallas[{backend}]"] = on_backend(
                backend, lambda: torch_pallas.varlen_attention(
                    q, k, v, cu, cu, longest, longest, window_size=window))
        both = {name: (lambda f=f: torch.autograd.grad(f(), (q, k, v), grad))
                for name, f in forwards.items()}
        for what, calls in (("fwd", forwards), ("fwd+bwd", both)):
            speed_rows(ctx, median_ms(calls), shape=f"{label} {what}", dtype="bfloat16",
                       reference="torch varlen_attn", goal="(none: reported)", goal_ratio=None)
        del q, k, v, grad
        free_memory()


def torch_grouped_mm_function():
    """F.grouped_mm where torch has it, else torch._grouped_mm."""
    return getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm


def time_grouped_mm(ctx: Context) -> None:
    """grouped_mm bf16 forward and forward+backward against F.grouped_mm
    (torch._grouped_mm): Mixtral-like 8 experts, 16384 x 4096 x 1792, and
    Qwen3-30B-A3B-like 128 experts (16384 tokens x top-8 = 131072 rows,
    hidden 2048, gate and up 1536; --quick: 4096 tokens), uneven groups
    (sizes multiples of 16, which torch's kernel may require), weights as
    transformers passes them (the transposed view of (G, N, K))."""
    import torch_pallas

    tokens = 4096 if ctx.quick else 16384
    cases = [("mixtral-like", 16384, 4096, 1792, 8),
             ("qwen3-moe-like", tokens * 8, 2048, 1536, 128)]
    torch_fn = torch_grouped_mm_function()
    for label, rows, hidden, width, groups in cases:
        seeded(12)
        offs = uneven_offs(rows, groups, 12, multiple=16)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w_nk = (torch.randn(groups, width, hidden, device="cuda", dtype=torch.bfloat16)
                * hidden ** -0.5).requires_grad_()
        grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        forwards = {"F.grouped_mm": lambda: torch_fn(x, w_nk.transpose(-2, -1), offs=offs)}
        for backend in gpu_backends():
            forwards[f"pallas[{backend}]"] = on_backend(
                backend, lambda: torch_pallas.grouped_mm(x, w_nk.transpose(-2, -1), offs=offs))
        compiled = torch.compile(lambda x, w, offs: torch_pallas.grouped_mm(x, w, offs=offs))
        forwards["compiled (triton)"] = lambda: compiled(x, w_nk.transpose(-2, -1), offs)
        both = {name: (lambda f=f: torch.autograd.grad(f(), (x, w_nk), grad))
                for name, f in forwards.items()}
        flops = 2.0 * rows * hidden * width
        shape = f"{label} {rows}x{hidden}x{width} G{groups}"
        for what, calls, work in (("fwd", forwards, flops), ("fwd+bwd", both, 3 * flops)):
            speed_rows(ctx, median_ms(calls), shape=f"{shape} {what}", dtype="bfloat16",
                       reference="F.grouped_mm", goal=">= 1.0x F.grouped_mm", work=work)
        del x, w_nk, grad
        free_memory()


def copy_gbps(nbytes: int) -> float:
    """A plain device copy's rate (dst.copy_(src), bytes read + written):
    the memory-bound ops' ceiling, measured in this process."""
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = median_ms({"copy": lambda: dst.copy_(src)})["copy"]
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_memory_bound(ctx: Context) -> None:
    """rms_norm, layer_norm, swiglu and rotary_embedding at 8192-wide rows
    (8192 x 8192 bf16; rotary: q 64 heads and k 8 heads of 128 at 8192
    positions), forward and forward+backward, in GB/s of the bytes each
    must move (every input read and output written once), against a plain
    device copy of 128 MiB measured in the same run; torch eager and
    torch.compile of torch's composition beside. Goal: >= 85% of the
    copy's GB/s."""
    import torch_pallas
    from torch_pallas.ops import rotary_embedding as rotary_op, swiglu as swiglu_op

    n = 8192
    ceiling = copy_gbps(n * n * 2)
    ctx.speed(shape=f"copy {n}x{n}", dtype="bfloat16", provider="dst.copy_(src)",
              ms=2 * n * n * 2 / (ceiling * 1e9) * 1e3, rate=ceiling, unit="GB/s",
              reference="", goal="the ceiling", met=None)
    x_bytes = n * n * 2

    def row_case(name, make, torch_fn, ours_fn, fwd_bytes, bwd_bytes):
        seeded(13)
        inputs, leaves = make()
        out = torch_fn(*inputs)
        grads = tuple(torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,)))
        compiled = torch.compile(torch_fn)
        providers = {"torch eager": torch_fn, "torch.compile": compiled}
        for backend in gpu_backends():
            providers[f"pallas[{backend}]"] = on_backend(backend, ours_fn)
        forwards = {p: (lambda f=f: f(*inputs)) for p, f in providers.items()}
        both = {p: (lambda f=f: torch.autograd.grad(f(*inputs), leaves, grads))
                for p, f in providers.items()}
        for what, calls, nbytes in (("fwd", forwards, fwd_bytes),
                                    ("fwd+bwd", both, fwd_bytes + bwd_bytes)):
            times = median_ms(calls)
            for provider, ms in times.items():
                if isinstance(ms, str):
                    ctx.speed(shape=f"{name} {what}", dtype="bfloat16", provider=provider,
                              ms=None, error=ms, reference="copy", goal=">= 85% of copy",
                              met=False if provider.startswith("pallas") else None)
                    continue
                gbps = nbytes / (ms * 1e-3) / 1e9
                share = gbps / ceiling
                ref_ms = times.get("torch.compile")
                ctx.speed(shape=f"{name} {what}", dtype="bfloat16", provider=provider, ms=ms,
                          rate=gbps, unit="GB/s", ratio=share, reference="copy GB/s",
                          goal=">= 85% of copy",
                          met=(share >= 0.85) if provider.startswith("pallas") else None,
                          note=(f"{ref_ms / ms:.2f}x torch.compile"
                                if isinstance(ref_ms, float) else ""))
        free_memory()

    def norm_inputs(bias: bool):
        def make():
            x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = (torch.rand(n, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_()
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            return ((x, w, b) if bias else (x, w)), ((x, w, b) if bias else (x, w))
        return make

    row_case(f"rms_norm {n}x{n}", norm_inputs(False),
             lambda x, w: torch.nn.functional.rms_norm(x, (n,), w, 1e-6),
             lambda x, w: torch_pallas.rms_norm(x, (n,), w, eps=1e-6),
             2 * x_bytes, 3 * x_bytes)
    row_case(f"layer_norm {n}x{n}", norm_inputs(True),
             lambda x, w, b: torch.nn.functional.layer_norm(x, (n,), w, b),
             lambda x, w, b: torch_pallas.layer_norm(x, (n,), w, b),
             2 * x_bytes, 3 * x_bytes)

    def swiglu_inputs():
        g, u = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        return (g, u), (g, u)

    row_case(f"swiglu {n}x{n}", swiglu_inputs, swiglu_op.torch_swiglu, torch_pallas.swiglu,
             3 * x_bytes, 5 * x_bytes)

    def rotary_inputs():
        q = torch.randn(1, 64, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        angles = torch.rand(1, n, 128, device="cuda") * 6.28
        return (q, k, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)), (q, k)

    qk = (64 + 8) * n * 128 * 2
    tables = 2 * n * 128 * 2
    row_case(f"rotary q64 k8 heads x{n}x128", rotary_inputs, rotary_op.torch_rotary_embedding,
             torch_pallas.rotary_embedding, 2 * qk + tables, 2 * qk + tables)


def liger_loss():
    """Liger-Kernel's LigerFusedLinearCrossEntropyLoss, installed from
    --liger-wheel-dir first if it does not import (no index: a brought
    wheel only); None with the reason when unavailable."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        return LigerFusedLinearCrossEntropyLoss(), ""
    except Exception as e:
        reason = f"not installed ({type(e).__name__}: {e})"
    return None, reason


def install_liger(wheel_dir: str | None) -> None:
    if not wheel_dir:
        return
    try:
        import liger_kernel  # noqa: F401
        return
    except ImportError:
        pass
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                    "--find-links", wheel_dir, "liger-kernel"], check=False)


def peak_mib(call: Callable) -> float:
    """The most memory `call()` held at once above what was allocated
    before it (its inputs), torch's allocator's peak, in MiB (after a
    first call that compiles and warms)."""
    call()
    torch.cuda.synchronize()
    free_memory()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def time_linear_cross_entropy(ctx: Context) -> None:
    """The LM head's loss at 8192 tokens x hidden 4096, V 128256, bf16,
    forward+backward (gradients of input and weight): ours on each backend
    and compiled, the unfused loss (F.linear, then F.cross_entropy in
    float32) eager and compiled, and Liger-Kernel's fused linear cross
    entropy if it imports. Peak memory above the inputs per provider, and
    time. Goals: memory <= 0.25x the unfused loss's; time <= 1.0x Liger's
    (ratio = Liger's time / ours >= 1)."""
    import torch_pallas
    from torch_pallas.ops import linear_cross_entropy as lce_op

    tokens, hidden, vocab = 8192, 4096, 128256
    seeded(14)
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden ** -0.5).to(
        torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    losses = {"unfused (eager)": lambda: lce_op.torch_linear_cross_entropy(x, w, target),
              "unfused (torch.compile)": functools.partial(
                  torch.compile(lce_op.torch_linear_cross_entropy), x, w, target)}
    for backend in gpu_backends():
        losses[f"pallas[{backend}]"] = on_backend(
            backend, lambda: torch_pallas.linear_cross_entropy(x, w, target))
    compiled = torch.compile(lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t))
    losses["compiled (triton)"] = lambda: compiled(x, w, target)
    install_liger(ctx.args.liger_wheel_dir)
    liger, why = liger_loss()
    if liger is not None:
        losses["liger fused"] = lambda: liger(w, x, target)
    else:
        print(f"Liger-Kernel: {why}")
    steps = {name: (lambda f=f: torch.autograd.grad(f(), (x, w))) for name, f in losses.items()}
    peaks = {}
    for name, step in steps.items():
        try:
            peaks[name] = peak_mib(step)
        except Exception as e:
            peaks[name] = f"{type(e).__name__}: {str(e)[:200]}"
        free_memory()
    times = median_ms(steps, rounds=ROUNDS if not ctx.quick else 6)
    unfused = peaks.get("unfused (eager)")
    reference = "liger fused" if liger is not None else "unfused (eager)"
    ref_ms = times.get(reference)
    shape = f"{tokens}x{hidden} V{vocab} fwd+bwd"
    for name, ms in times.items():
        peak = peaks.get(name)
        mem_share = peak / unfused if isinstance(peak, float) and isinstance(unfused, float) \
            else None
        ratio = ref_ms / ms if isinstance(ms, float) and isinstance(ref_ms, float) else None
        is_ours = name.startswith(("pallas", "compiled"))
        met = None
        if is_ours:
            met = (mem_share is not None and mem_share <= 0.25
                   and (liger is None or (ratio is not None and ratio >= 1.0)))
        ctx.speed(shape=shape, dtype="bfloat16", provider=name,
                  ms=ms if isinstance(ms, float) else None,
                  error=None if isinstance(ms, float) else ms,
                  rate=(3 * 2.0 * tokens * hidden * vocab / (ms * 1e-3) / 1e12
                        if isinstance(ms, float) else None), unit="TFLOP/s",
                  ratio=ratio, reference=reference,
                  goal="peak <= 0.25x unfused; time <= 1.0x Liger", met=met,
                  peak_mib=peak, peak_vs_unfused=mem_share,
                  note=(f"peak {peak:.0f} MiB" + (f" = {mem_share:.2f}x unfused"
                                                  if mem_share is not None else "")
                        if isinstance(peak, float) else f"peak: {peak}")
                  + ("" if liger is not None else f"; Liger {why[:60]}"))


# --- training ---------------------------------------------------------------------

TRAINING_SUITES = ("bench_rms_norm.py", "bench_layer_norm.py", "bench_rotary_embedding.py",
                   "bench_swiglu.py", "bench_linear_cross_entropy.py", "bench_token_log_probs.py",
                   "bench_grouped_mm.py")


def run_training_suites(ctx: Context) -> None:
    """The training ops' pytest-benchmark suites (speed against torch eager
    and compiled, peak memory), their table printed by bench/conftest.py,
    the JSON into --out; bench_models.py (the patched Llama and MoE steps)
    too unless --quick."""
    suites = [f"bench/{name}" for name in TRAINING_SUITES if (ROOT / "bench" / name).exists()]
    if not ctx.quick:
        suites.append("bench/bench_models.py")
    out = ctx.rec.out / "training_suites.json"
    rc = run_logged(ctx, "training suites", [
        sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *suites,
        "--benchmark-only", f"--benchmark-json={out}"], timeout=ctx.args.remaining())
    if rc is not None:
        ctx.check("the training ops' benchmark suites", rc == 0,
                  f"exit status {rc}; JSON {out.name}")


def llama_config(quick: bool):
    """A Llama-3-like config small enough to compile twice within the
    phase: hidden 2048, 16 heads (4 key/value), intermediate 5632, vocab
    128256 (the LM head's logits are the step's largest tensors), 4
    layers (2 with --quick); nothing downloaded."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=2 if quick else 4, num_attention_heads=16, num_key_value_heads=4,
        max_position_embeddings=4096, attn_implementation="sdpa")


def time_llama_compiled(ctx: Context) -> None:
    """A Llama training step (forward with labels, backward, gradients
    dropped) in bf16 at batch 2 x 2048 (x 1024 with --quick), both under
    torch.compile: patched by torch_pallas.transformers.apply (the Triton
    path under compile) against unpatched, same weights, same batch.
    Interleaved medians, peak memory above the model and its inputs, and
    the two losses (equal within bf16's tolerance). Goal: >= 1.0x speed,
    less memory."""
    import copy

    import transformers

    import torch_pallas.transformers

    config = llama_config(ctx.quick)
    seeded(15)
    base = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    patched = copy.deepcopy(base)
    print(torch_pallas.transformers.apply(patched))
    length = 1024 if ctx.quick else 2048
    ids = torch.randint(0, config.vocab_size, (2, length), device="cuda")

    def stepper(model):
        compiled = torch.compile(model)

        def step():
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            for p in model.parameters():
                p.grad = None
            return loss.detach()

        return step

    steps = {"torch (compiled)": stepper(base), "apply() (compiled)": stepper(patched)}
    losses, peaks, compile_s = {}, {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        losses[name] = float(step())
        compile_s[name] = time.perf_counter() - start
        peaks[name] = peak_mib(step)
    close = abs(losses["apply() (compiled)"] - losses["torch (compiled)"]) <= 2e-2 * max(
        1.0, abs(losses["torch (compiled)"]))
    ctx.check("Llama step under torch.compile: apply()'s loss equals the unpatched one's",
              close, f"losses {losses}")
    times = median_ms(steps, rounds=5 if ctx.quick else 8, batch_ms=1.0)
    tokens = 2 * length
    ref = times.get("torch (compiled)")
    for name, ms in times.items():
        ratio = ref / ms if isinstance(ref, float) and isinstance(ms, float) else None
        mem = peaks[name] / peaks["torch (compiled)"]
        ctx.speed(shape=f"llama h2048 L{config.num_hidden_layers} V128256 2x{length} step",
                  dtype="bfloat16", provider=name, ms=ms if isinstance(ms, float) else None,
                  rate=tokens / (ms * 1e-3) / 1e9 if isinstance(ms, float) else None,
                  unit="Gtok/s", ratio=ratio, reference="torch (compiled)",
                  goal=">= 1.0x speed, less memory",
                  met=(ratio is not None and ratio >= 1.0 and mem < 1.0)
                  if name.startswith("apply") else None,
                  peak_mib=peaks[name], peak_vs_torch=mem, loss=losses[name],
                  first_step_s=compile_s[name],
                  note=f"peak {peaks[name]:.0f} MiB ({mem:.2f}x), first step "
                       f"{compile_s[name]:.0f} s")


# --- the phases and their cases ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Context], None]
    seconds: int  # a rough expected time on one H100, compiles included
    quick_seconds: int

    @property
    def doc(self) -> str:
        text = " ".join((self.run.__doc__ or "").split())
        return text if len(text) <= 100 else text[:97] + "..."


PHASES: dict[str, list[Case]] = {
    "correctness": [
        Case("ops", check_ops, 120, 60),
        Case("attention", check_attention, 90, 45),
        Case("examples", check_examples, 120, 90),
        Case("realistic_matmul", check_realistic_matmul, 25, 20),
        Case("realistic_attention", check_realistic_attention, 90, 60),
        Case("realistic_grouped_mm", check_realistic_grouped_mm, 25, 15),
        Case("realistic_rows", check_realistic_rows, 45, 35),
        Case("realistic_lce", check_realistic_linear_cross_entropy, 45, 30),
        Case("dlpack", check_dlpack, 5, 5),
        Case("streams", check_streams, 15, 15),
        Case("compile", check_compile, 40, 40),
        Case("cuda_graphs_step", check_cuda_graphs_step, 60, 60),
        Case("pytest_gpu", run_gpu_tests, 90, 90),
    ],
    "speed": [
        Case("matmul", time_matmul, 90, 50),
        Case("attention", time_attention, 150, 80),
        Case("varlen", time_varlen, 40, 20),
        Case("grouped_mm", time_grouped_mm, 60, 40),
        Case("memory_bound", time_memory_bound, 90, 70),
        Case("linear_cross_entropy", time_linear_cross_entropy, 60, 50),
    ],
    "training": [
        Case("llama_compiled", time_llama_compiled, 240, 150),
        Case("suites", run_training_suites, 400, 240),
    ],
}


def print_list() -> None:
    for phase, cases in PHASES.items():
        full = sum(c.seconds for c in cases)
        quick = sum(c.quick_seconds for c in cases)
        print(f"{phase}  (~{full // 60} min {full % 60} s; --quick ~{quick // 60} min "
              f"{quick % 60} s)")
        for c in cases:
            print(f"  {c.name:<22} ~{c.seconds:>3} s (quick ~{c.quick_seconds:>3} s)  {c.doc}")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", action="append", choices=list(PHASES),
                        help="a phase to run (repeatable; default: all, in order)")
    parser.add_argument("--case", action="append",
                        help="run only these cases of the chosen phases (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smaller sets and shapes")
    parser.add_argument("--out", default="gpu_check_results",
                        help="directory for <phase>.json, <phase>.txt, <phase>.log")
    parser.add_argument("--list", action="store_true", help="print phases and cases, then exit")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip cases whose expected time would end past this many seconds "
                             "from the start (default 420: one device call)")
    parser.add_argument("--liger-wheel-dir", help="a directory holding a liger-kernel wheel, "
                        "installed (--no-deps --no-index) if liger_kernel does not import")
    parser.add_argument("--tune", action="store_true",
                        help="tune the Hopper matmul for the timed shapes first (slow)")
    args = parser.parse_args(argv)
    known = {c.name for cases in PHASES.values() for c in cases}
    for name in args.case or ():
        if name not in known:
            parser.error(f"unknown case {name!r}; --list shows them")
    return args


def selected(args) -> list[tuple[str, Case]]:
    phases = args.phase or list(PHASES)
    return [(phase, c) for phase in phases for c in PHASES[phase]
            if not args.case or c.name in args.case]


def environment() -> dict:
    import importlib.metadata

    found = {"device": torch.cuda.get_device_name(),
             "capability": "sm" + "".join(map(str, torch.cuda.get_device_capability())),
             "backends": gpu_backends()}
    for package in ("torch", "jax", "jaxlib", "triton", "transformers", "liger-kernel"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def main(argv=None) -> int:
    args = parse(argv)
    if args.list:
        print_list()
        return 0
    if not torch.cuda.is_available():
        print("bench/gpu_check.py needs an NVIDIA GPU: torch.cuda.is_available() is False "
              "on this machine. Run it where a CUDA GPU is visible.", file=sys.stderr)
        return 2
    start = time.time()
    args.remaining = lambda: max(30.0, args.budget_s - (time.time() - start))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = environment()
    print(json.dumps(meta), flush=True)
    recorders: dict[str, Recorder] = {}
    stdout = sys.stdout
    for phase, case in selected(args):
        if phase not in recorders:
            sys.stdout = Tee(stdout, out / f"{phase}.log")
            recorders[phase] = Recorder(out, phase, dict(meta, quick=args.quick,
                                                         started=time.ctime()))
        ctx = Context(recorders[phase], args.quick, args, case.name)
        expected = case.quick_seconds if args.quick else case.seconds
        elapsed = time.time() - start
        if elapsed + expected > args.budget_s:
            print(f"== {phase}/{case.name}: skipped, {elapsed:.0f} s gone, ~{expected} s more "
                  f"would pass --budget-s {args.budget_s:.0f}", flush=True)
            ctx.rec.add(kind="skipped", case=case.name, reason="budget",
                        elapsed_s=round(elapsed), expected_s=expected)
            continue
        print(f"\n== {phase}/{case.name} (~{expected} s expected, {elapsed:.0f} s gone)",
              flush=True)
        case_start = time.time()
        try:
            case.run(ctx)
        except Exception as e:
            ctx.error(f"{case.name} (the case as a whole)", e)
        ctx.rec.add(kind="timing", case=case.name, seconds=round(time.time() - case_start, 1))
        free_memory()
    wrong = [r for rec in recorders.values() for r in rec.wrong]
    for phase, rec in recorders.items():
        print(f"\n{phase}: {out / (phase + '.txt')}\n{rec.table()}")
    sys.stdout = stdout
    if wrong:
        print(f"\n{len(wrong)} WRONG:", *(f"{r['case']}: {r['name']} {r.get('detail', '')}"
                                          for r in wrong), sep="\n  ")
        return 1
    print(f"\nall results correct ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
