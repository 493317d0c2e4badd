"""A model built on torch_pallas.nn.Linear trains under
DistributedDataParallel (gloo, 2 CPU processes on loopback): after one step
its gradients equal a single process's on the union of the batches."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_pallas

WORLD = 2


def build_model() -> torch.nn.Module:
    return torch_pallas.nn.replace_linear(
        torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    )


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _worker(rank, port, state, x, y, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = build_model()
        model.load_state_dict(state)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        shard = slice(rank * len(x) // WORLD, (rank + 1) * len(x) // WORLD)
        loss_of(ddp, x[shard], y[shard]).backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in model.named_parameters()}, out_path)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gradients_equal_a_single_process_on_the_union(tmp_path):
    torch.manual_seed(0)
    model = build_model()
    x, y = torch.randn(16, 12), torch.randn(16, 3)
    out_path = tmp_path / "grads.pt"
    mp.spawn(_worker, args=(free_port(), model.state_dict(), x, y, str(out_path)),
             nprocs=WORLD, join=True)
    ddp_grads = torch.load(out_path)
    loss_of(model, x, y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp_grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
