"""Defining torch ops on the runtime: `registration.define` registers an
op's torch.library schema, its kernel for every device, its fake function,
its Autograd kernel (backward and forward-mode AD), its torch.compile path
on CUDA, and its FLOP formula (`flop_counting`); `register_autocast` casts
its inputs as torch casts its own op's. The shipped ops (ops/) and users'
ops (`custom_ops`) are both defined through it.

Imports: `base` and `runtime`.
"""
