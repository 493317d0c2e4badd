"""One-shot check for a machine with an NVIDIA GPU (Hopper or newer for the
mosaic_gpu backend), meant to finish in a few minutes and need no network:

1. every op on CUDA, on the `mosaic_gpu` and `triton` backends, against torch
   on random data, ragged shapes included, and through torch.compile (whose
   code must launch the Triton kernels, not JAX);
2. the tests marked `gpu` (pytest -m gpu);
3. matmul timings (bfloat16, float16) at 4096^3, 8192^3 and two LLM shapes
   against torch.matmul, with triton.testing.do_bench (median, warm-up,
   fresh inputs per shape): the op on each backend (on Hopper: the tuned
   warp-specialized kernel), the quickstart-style pipelined kernel, and the
   compiled (Triton) path, printed last as a table of TFLOP/s and the ratio
   to torch;
4. attention: pallas::attention on each backend checked first (forward and
   every gradient against float64, ragged, GQA, causal, masks), then timed
   at bfloat16, head dim 128, sequence 4096 and 8192, causal and not,
   forward and forward+backward, against torch's SDPA on its flash backend;
   then varlen_attention on 16 packed causal sequences and a 32768-token
   window of 4096 against torch's varlen_attn (FlashAttention 2 and its
   window), in milliseconds;
5. every registered op's example calls (the training ops' forward and
   backward ops included) on each backend against their float64
   references, then the training ops' benchmark suites (rms_norm,
   layer_norm, rotary_embedding, swiglu, linear_cross_entropy, grouped_mm
   with a Qwen3-MoE layer's experts against F.grouped_mm in bfloat16, and
   the patched Llama and MoE training steps of bench_models.py) with
   pytest-benchmark: speed against torch eager and compiled, and peak memory
   (torch.cuda.max_memory_allocated).

    python bench/gpu_check.py [--quick] [--tune]

--tune first times every matmul configuration that fits the GPU for the
timed shapes and caches the fastest (kernels/mosaic_gpu/matmul_tuning.py);
that takes longer than the check itself.

Exits 1 on any wrong result, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def gpu_backends() -> list[str]:
    major, _ = torch.cuda.get_device_capability()
    return (["mosaic_gpu"] if major >= 9 else []) + ["triton"]


def check_ops(backend: str, failures: list[str]) -> None:
    import torch_pallas
    from torch_pallas.base import dtypes
    from torch_pallas.ops import add as add_op, matmul as matmul_op

    dev = "cuda"

    def expect(name, ok, detail=""):
        status = "ok" if ok else "WRONG"
        print(f"  {backend:<11} {name:<44} {status} {detail}")
        if not ok:
            failures.append(f"{backend}: {name} {detail}")

    def run(name, fn):
        try:
            fn()
        except Exception as e:  # report and go on: one summary at the end
            traceback.print_exc()
            expect(name, False, f"raised {type(e).__name__}: {e}")

    with torch_pallas.backend(backend):
        for size in [(1,), (1000,), (3, 1001)]:
            def fill(size=size):
                value = float(torch.randn(()))
                out = torch.ops.pallas.fill(size, value, dtype=torch.float32, device=dev)
                expect(f"fill {size}", torch.equal(out.cpu(), torch.full(size, value)))
            run(f"fill {size}", fill)
        for n in (1, 1000, 5000):
            def iota(n=n):
                out = torch.ops.pallas.iota(n, dtype=torch.int32, device=dev)
                expect(f"iota {n}", torch.equal(out.cpu(), torch.arange(n, dtype=torch.int32)))
            run(f"iota {n}", iota)
        for dtype in FLOATS:
            def add(dtype=dtype):
                x = torch.randn(1000, 999, device=dev, dtype=dtype)
                y = torch.randn(999, device=dev, dtype=dtype)
                out, ref = torch.ops.pallas.add(x, y), add_op.reference(x.cpu(), y.cpu())
                err = (out.cpu().double() - ref).abs()
                expect(f"add (1000,999)+(999,) {dtype}",
                       bool((err <= dtypes.ROUNDING[dtype] * ref.abs()).all()))
            run(f"add {dtype}", add)
        cases = [((1, 1), (1, 1)), ((7, 5), (5, 3)), ((1000, 999), (999, 1001)),
                 ((257, 129), (129, 65)), ((3, 100, 70), (70, 50)), ((2, 1, 64, 96), (3, 96, 40))]
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
            run("matmul float32 at 'highest'", refuses_full_float32)
        for dtype in FLOATS:
            for a_shape, b_shape in cases:
                def matmul(a_shape=a_shape, b_shape=b_shape, dtype=dtype):
                    a = torch.randn(a_shape, device=dev, dtype=dtype)
                    b = torch.randn(b_shape, device=dev, dtype=dtype)
                    precision = "high" if tf32 and dtype == torch.float32 else "highest"
                    for label, (x, w) in {"": (a, b), " b^T": (a, b.mT.contiguous().mT)}.items():
                        with float32_matmul_precision(precision):
                            out = torch.ops.pallas.matmul(x, w)
                        ref = matmul_op.reference(x.cpu(), w.cpu())
                        bound = matmul_op.error_bound(x.cpu(), w.cpu(), ref,
                                                              tf32=precision == "high")
                        err = (out.cpu().double() - ref).abs()
                        expect(f"matmul {a_shape}x{b_shape}{label} {dtype} ({precision})",
                               bool((err <= bound).all()), f"max err {err.max().item():.3g}")
                run(f"matmul {a_shape} {dtype}", matmul)


@contextlib.contextmanager
def float32_matmul_precision(setting: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def check_compile(failures: list[str]) -> None:
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
        traceback.print_exc()
        ok, ok_graphs = False, False
        source = repr(e)
    for name, good in (("torch.compile launches the Triton kernels, no JAX", ok),
                       ("reduce-overhead (CUDA graphs) gives identical results", ok_graphs)):
        print(f"  {'compile':<11} {name:<52} {'ok' if good else 'WRONG'}")
        if not good:
            failures.append(f"compile: {name}")


def check_examples(backend: str, failures: list[str]) -> None:
    """Every registered op's example calls on CUDA against their float64
    references and bounds (the ones the CPU tests check on the simulators)."""
    import torch_pallas
    from torch_pallas.runtime import registry

    for info in registry.ops():
        for i, example in enumerate(info.examples(torch.device("cuda"), False)):
            name = f"{info.name} example {i}"
            try:
                with torch_pallas.backend(backend):
                    worst, within = example.error(info.function(*example.args, **example.kwargs))
                print(f"  {backend:<11} {name:<44} {'ok' if within else 'WRONG'} max err {worst:.3g}")
                if not within:
                    failures.append(f"{backend}: {name} max err {worst:.3g}")
            except Exception as e:
                traceback.print_exc()
                failures.append(f"{backend}: {name} raised {type(e).__name__}: {e}")


TRAINING_SUITES = ("bench_rms_norm.py", "bench_layer_norm.py", "bench_rotary_embedding.py",
                   "bench_swiglu.py", "bench_linear_cross_entropy.py", "bench_grouped_mm.py")


JSON_NAME = "torch_pallas_gpu_check_training.json"


def run_training_benchmarks(failures: list[str], quick: bool) -> None:
    """The training ops' suites (and the Llama step unless `quick`), their
    table printed by bench/conftest.py, the JSON in the temporary
    directory."""
    suites = [f"bench/{name}" for name in TRAINING_SUITES if (ROOT / "bench" / name).exists()]
    if not quick:
        suites.append("bench/bench_models.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *suites,
         "--benchmark-only", f"--benchmark-json={Path(tempfile.gettempdir()) / JSON_NAME}"],
        cwd=ROOT,
    )
    if result.returncode != 0:
        failures.append("the training ops' benchmarks failed")


def run_gpu_tests(failures: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider",
         "tests"],
        cwd=ROOT,
    )
    if result.returncode not in (0, 5):
        failures.append("pytest -m gpu failed")


def time_matmuls(quick: bool, tune: bool) -> list[tuple]:
    import functools

    import jax
    import triton.testing

    import torch_pallas
    from torch_pallas.runtime import bridge

    shapes = [(4096, 4096, 4096), (2048, 4096, 14336), (128, 4096, 4096)]
    if not quick:
        shapes.insert(1, (8192, 8192, 8192))
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in shapes:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(k, n, device="cuda", dtype=dtype)
            flops = 2.0 * m * n * k
            torch_ms = triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median")
            results = [("torch", torch_ms)]
            if "mosaic_gpu" in gpu_backends():
                from torch_pallas.kernels.mosaic_gpu import matmul as mosaic_matmul, matmul_tuning

                if tune:
                    matmul_tuning.tune(jax.numpy.dtype(str(dtype).removeprefix("torch.")), m, n, k)
                    torch_pallas.clear_cache()
                seed = jax.jit(functools.partial(
                    mosaic_matmul.matmul, transpose_a=False, transpose_b=False,
                    config=mosaic_matmul.MatmulConfig.default("mosaic_gpu"), interpret=None))
                ja, jb = bridge.to_jax(a.reshape(1, m, k)), bridge.to_jax(b.reshape(1, k, n))
                seed(ja, jb).block_until_ready()
                results.append(("quickstart kernel", triton.testing.do_bench(
                    lambda: seed(ja, jb).block_until_ready(), return_mode="median")))
            # b as nn.Linear holds its weight, (n, k): read in place by the kernels.
            b_t = b.t().contiguous().t() if (m, k, n) == shapes[0] else None
            for backend in gpu_backends():
                with torch_pallas.backend(backend):
                    torch.ops.pallas.matmul(a, b)  # compile outside the timing
                    ms = triton.testing.do_bench(lambda: torch.ops.pallas.matmul(a, b),
                                                 return_mode="median")
                    results.append((f"pallas[{backend}]", ms))
                    if b_t is not None:
                        torch.ops.pallas.matmul(a, b_t)
                        results.append((f"pallas[{backend}] b^T", triton.testing.do_bench(
                            lambda: torch.ops.pallas.matmul(a, b_t), return_mode="median")))
            compiled = torch.compile(lambda a, b: torch.ops.pallas.matmul(a, b), fullgraph=True)
            compiled(a, b)
            results.append(("compiled (triton)",
                            triton.testing.do_bench(lambda: compiled(a, b), return_mode="median")))
            for name, ms in results:
                rows.append((f"{m}x{k}x{n}", str(dtype).removeprefix("torch."), name,
                             flops / ms / 1e9, torch_ms / ms))
    return rows


def check_attention(backend: str, failures: list[str]) -> None:
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
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if backend == "triton" else ())
    for dtype in dtypes:
        for q_shape, k_shape, kwargs in cases:
            name = f"attention {q_shape}x{k_shape} {sorted(kwargs)} {dtype}"
            try:
                q = torch.randn(q_shape, device="cuda", dtype=dtype, requires_grad=True)
                k, v = (torch.randn(k_shape, device="cuda", dtype=dtype, requires_grad=True)
                        for _ in range(2))
                kw = dict(kwargs)
                if kw.get("attn_mask") == "padding":
                    kw["attn_mask"] = torch.rand(k_shape[0], 1, 1, k_shape[2], device="cuda") > 0.2
                grad = torch.randn(*q_shape[:-1], k_shape[-1], device="cuda", dtype=dtype)
                leaves64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
                ref = attention_op.reference(*leaves64, **{n: (x.cpu() if torch.is_tensor(x) else x)
                                                           for n, x in kw.items()})
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
                print(f"  {backend:<11} {name:<70} {'ok' if ok else 'WRONG'} max err {worst:.3g}")
                if not ok:
                    failures.append(f"{backend}: {name} max err {worst:.3g}")
            except Exception as e:
                traceback.print_exc()
                failures.append(f"{backend}: {name} raised {type(e).__name__}: {e}")


def time_attention(quick: bool) -> list[tuple]:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch_pallas
    from torch_pallas.kernels.attention_shapes import AttentionDims, attention_flops

    shapes = [(4, 16, 4096, 128)] + ([] if quick else [(2, 16, 8192, 128)])
    rows = []
    for n, h, l, e in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(n, h, l, e, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            flops = attention_flops(AttentionDims(n, h, h, l, l, e, e), causal)

            def flash(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            providers = [("torch flash", flash)]
            for backend in gpu_backends():
                def pallas(q, k, v, backend=backend):
                    with torch_pallas.backend(backend):
                        return torch_pallas.attention(q, k, v, is_causal=causal)
                providers.append((f"pallas[{backend}]", pallas))
            providers.append(("compiled (triton)", torch.compile(
                lambda q, k, v: torch_pallas.attention(q, k, v, is_causal=causal), fullgraph=True)))
            times = {}
            for name, fn in providers:
                fn(q, k, v)  # compile outside the timing
                fwd = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
                both = triton.testing.do_bench(
                    lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad), return_mode="median")
                times[name] = (fwd, both)
            for name, (fwd, both) in times.items():
                label = f"{n}x{h}x{l}x{e} {'causal' if causal else 'full'}"
                rows.append((label, name, flops / fwd / 1e9, times["torch flash"][0] / fwd,
                             3.5 * flops / both / 1e9, times["torch flash"][1] / both))
    return rows


def time_varlen(quick: bool) -> list[tuple]:
    """Packed sequences and a sliding window, bfloat16: torch's `varlen_attn`
    (FlashAttention 2, its window included) against `varlen_attention` on
    each GPU backend, forward and forward+backward, in milliseconds."""
    import triton.testing
    from torch.nn.attention.varlen import varlen_attn

    import torch_pallas

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(512, 8192, (16,), generator=generator).tolist()
    cases = [("16 packed causal", lengths, (-1, 0))]
    if not quick:
        cases.append(("32768 tokens window 4096", [32768], (4095, 0)))
    rows = []
    for label, lengths, window in cases:
        tokens, longest = sum(lengths), max(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        q, k, v = (torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def torch_varlen(q, k, v):
            return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window)

        providers = [("torch varlen_attn", torch_varlen)]
        for backend in gpu_backends():
            def pallas(q, k, v, backend=backend):
                with torch_pallas.backend(backend):
                    return torch_pallas.varlen_attention(q, k, v, cu, cu, longest, longest,
                                                         window_size=window)
            providers.append((f"pallas[{backend}]", pallas))
        times = {}
        for name, fn in providers:
            fn(q, k, v)
            fwd = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
            both = triton.testing.do_bench(
                lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad), return_mode="median")
            times[name] = (fwd, both)
        base = times["torch varlen_attn"]
        for name, (fwd, both) in times.items():
            rows.append((label, name, fwd, base[0] / fwd, both, base[1] / both))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the 8192^3 timing")
    parser.add_argument("--tune", action="store_true",
                        help="tune the Hopper matmul for the timed shapes first (slow)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_check.py needs an NVIDIA GPU: torch.cuda.is_available() is False "
              "on this machine. Run it where a CUDA GPU is visible.", file=sys.stderr)
        return 2
    start = time.time()
    print(f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"backends: {', '.join(gpu_backends())}")
    failures: list[str] = []
    for backend in gpu_backends():
        check_ops(backend, failures)
        check_attention(backend, failures)
        check_examples(backend, failures)
    check_compile(failures)
    run_gpu_tests(failures)
    rows = time_matmuls(args.quick, args.tune)
    attention_rows = time_attention(args.quick)
    varlen_rows = time_varlen(args.quick)
    run_training_benchmarks(failures, args.quick)

    print(f"\nmatmul, median of triton.testing.do_bench ({time.time() - start:.0f} s in all)")
    print(f"{'shape':<16} {'dtype':<9} {'provider':<20} {'TFLOP/s':>8} {'x torch':>8}")
    for shape, dtype, name, tflops, ratio in rows:
        print(f"{shape:<16} {dtype:<9} {name:<20} {tflops:8.1f} {ratio:8.2f}")
    print("\nattention, bfloat16, median of triton.testing.do_bench")
    print(f"{'shape':<22} {'provider':<20} {'fwd TFLOP/s':>11} {'x torch':>8} "
          f"{'fwd+bwd TFLOP/s':>15} {'x torch':>8}")
    for shape, name, fwd, fwd_ratio, both, both_ratio in attention_rows:
        print(f"{shape:<22} {name:<20} {fwd:11.1f} {fwd_ratio:8.2f} {both:15.1f} {both_ratio:8.2f}")
    print("\nvarlen_attention, bfloat16, 16 heads of 128, median of triton.testing.do_bench")
    print(f"{'case':<26} {'provider':<20} {'fwd ms':>8} {'x torch':>8} {'fwd+bwd ms':>11} "
          f"{'x torch':>8}")
    for label, name, fwd, fwd_ratio, both, both_ratio in varlen_rows:
        print(f"{label:<26} {name:<20} {fwd:8.2f} {fwd_ratio:8.2f} {both:11.2f} {both_ratio:8.2f}")
    if failures:
        print(f"\n{len(failures)} WRONG:", *failures, sep="\n  ")
        return 1
    print("\nall results correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
