"""The Pallas ops under PyTorch's own distributed engines (FSDP2, tensor
parallelism on DTensor): their sharding rules, registered through torch's
public machinery (`torch.distributed.tensor.experimental.register_sharding`,
or the op-strategy registry where that cannot express a rule), one module
per op family beside this file (`matmul.py`, `attention.py`, the training
ops'), never distribution code of the package's own.

DDP and FSDP2 need no rule: they hand the ops plain tensors, which a call
leaves as it found them (tests/test_distributed.py).

Imports: the ops (`torch_pallas.ops`) and `library`, like every integration;
nothing below imports it.
"""
