"""One call, from torch tensors to a compiled kernel and back.

`launch.run(op, device, tensors, params)` is the whole path: `backends`
picks the backend that serves the call (the one module that branches on
devices), `registry` gives the op's kernel for that backend's family (a
`KernelSpec` from kernels/), `compilation` builds it for the inputs' shapes
(`compile_cache` keeps it in memory, `disk_cache` across processes,
`shape_buckets` bounds how many a changing size builds), `bridge` hands the
tensors to JAX and the results back without copies, and `simulators` runs
the simulated backends one kernel at a time. `compile_path` holds the
torch.compile path on CUDA, where an op's body runs again with its Triton
kernels.

Imports: `base` and `torch_pallas.kernels`, nothing above (the op
definitions, custom ops or integrations). What a user's kernel needs beyond
a shipped one (simulating windowed pallas_calls, advice on a failure) is
handed to `launch` by `custom_ops` (`launch.support_user_kernels`).
"""
