"""A model built on torch_pallas.nn.Linear trains under PyTorch's own
distributed engines: DistributedDataParallel (gloo, 2 CPU processes on
loopback), whose gradients after one step equal a single process's on the
union of the batches; FSDP2 (gloo, one process), whose AdamW steps equal the
unsharded model's."""

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


def _mesh_worker(rank, world, port, out_path, collect):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        found = collect(rank, init_device_mesh("cpu", (world,)))
        if rank == 0:
            torch.save(found, out_path)
    finally:
        dist.destroy_process_group()


def on_gloo_mesh(collect, world: int, directory):
    """Rank 0's `collect(rank, mesh)` (a module-level function), each of
    `world` spawned gloo processes calling it on one 1-D CPU device mesh."""
    out_path = directory / "results.pt"
    mp.spawn(_mesh_worker, args=(world, free_port(), str(out_path), collect), nprocs=world,
             join=True)
    return torch.load(out_path)


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


def test_fsdp2_steps_equal_the_unsharded_model():
    """FSDP2 (`fully_shard` on each converted Linear and on the root; gloo,
    one process) frees each unsharded parameter after use by resizing its
    storage to 0, which the ops' calls must leave possible: a few AdamW
    steps give the losses and parameters of the same model unsharded."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    plain = build_model()
    sharded = build_model()
    sharded.load_state_dict(plain.state_dict())
    batches = [(torch.randn(9, 12), torch.randn(9, 3)) for _ in range(3)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for layer in (sharded[0], sharded[2]):
            fully_shard(layer)
        fully_shard(sharded)
        losses = {}
        for name, model in (("plain", plain), ("sharded", sharded)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses[name] = []
            for x, y in batches:
                optimizer.zero_grad()
                loss = loss_of(model, x, y)
                loss.backward()
                optimizer.step()
                losses[name].append(loss.detach())
        torch.testing.assert_close(losses["sharded"], losses["plain"], rtol=1e-5, atol=1e-6)
        unsharded = dict(plain.named_parameters())
        for name, p in sharded.named_parameters():
            torch.testing.assert_close(p.full_tensor(), unsharded[name].detach(), rtol=1e-5,
                                       atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()
