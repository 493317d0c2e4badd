"""Train a small Llama twice, on torch and on the Pallas ops, side by side.

    python examples/train_llama.py                 # about 4 minutes on 2 CPU cores
    python examples/train_llama.py --steps 100 --plot losses.png
    python examples/train_llama.py --device cuda

The model is built from a config (nothing downloaded) and learns to write
Python, a byte at a time, from the sources of a few modules of Python's own
standard library. It trains once as transformers builds it, and once, from
the same weights on the same batches, after

    torch_pallas.transformers.apply(model)

which puts its norms, rotary embeddings, SwiGLU MLPs, Linear layers,
attention and the LM head with its loss on the Pallas ops (the loss never
holds the tokens x vocabulary logits). The two loss curves should lie on
top of each other; the table at the end gives each run's final loss,
tokens/s and peak memory (above what the process held when training
began: resident memory on the CPU, torch's allocator on a GPU). The first
step of each run, which builds the kernels, is done on a throwaway copy of
the model and not counted.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import importlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

import torch_pallas
import torch_pallas.transformers

# The corpus: these standard-library modules' source, as bytes.
CORPUS_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "dataclasses",
                  "functools", "string", "shlex")


def corpus() -> torch.Tensor:
    text = b"\n".join(Path(importlib.import_module(name).__file__).read_bytes()
                      for name in CORPUS_MODULES)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int, batch_size: int, seq_len: int, seed: int):
    """`steps` batches of random windows of the corpus: the same ones for
    every run with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def build_model(args) -> transformers.LlamaForCausalLM:
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=args.seq_len,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


class PeakMemory:
    """The most memory held at once while the `with` block ran, above what
    was held when it began: torch's allocator's peak on CUDA; on Linux, the
    process's resident set (its high-water mark, reset at the start), which
    sees torch's and JAX's buffers alike; None elsewhere."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        elif Path("/proc/self/clear_refs").exists():
            try:  # give freed heap back first, so that reused memory counts again
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark
            self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        elif Path("/proc/self/clear_refs").exists():
            self.bytes = self._status("VmHWM") - self.start

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)


@dataclass
class Run:
    name: str
    losses: list[float] = field(default_factory=list)
    tokens_per_second: float = 0.0
    peak_memory: int | None = None


def train_step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train(name: str, model, data, args, device) -> Run:
    run = Run(name)
    model.to(device).train()
    # One step on a copy: kernels built, memory touched, the model untouched.
    warm = copy.deepcopy(model)
    train_step(warm, torch.optim.AdamW(warm.parameters(), lr=args.lr),
               next(batches(data, 1, args.batch_size, args.seq_len, args.seed)).to(device))
    del warm

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    progress = tqdm(batches(data, args.steps, args.batch_size, args.seq_len, args.seed),
                    total=args.steps, desc=f"{name:>12}", file=sys.stdout, mininterval=0.5)
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        for ids in progress:
            loss = train_step(model, optimizer, ids.to(device)).item()
            run.losses.append(loss)
            progress.set_postfix(loss=f"{loss:.3f}", refresh=False)
        elapsed = time.perf_counter() - start
    run.tokens_per_second = args.steps * args.batch_size * args.seq_len / elapsed
    run.peak_memory = memory.bytes
    return run


def mean_of_last(losses, n=10) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def table(runs: list[Run]) -> str:
    def mib(n):
        return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"

    rows = [("", *(r.name for r in runs)),
            ("final loss (mean of last 10)", *(f"{mean_of_last(r.losses):.4f}" for r in runs)),
            ("tokens/s", *(f"{r.tokens_per_second:,.0f}" for r in runs)),
            ("peak memory", *(mib(r.peak_memory) for r in runs))]
    return "\n".join(f"{row[0]:<30}" + "".join(f"{cell:>16}" for cell in row[1:]) for row in rows)


def plot(runs: list[Run], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for run, style in zip(runs, ("-", "--")):
        axes.plot(range(1, len(run.losses) + 1), run.losses, style, label=run.name)
    axes.set(xlabel="step", ylabel="training loss (nats per byte)",
             title="A small Llama on torch and on the Pallas ops")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"loss curves: {path}")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot", nargs="?", const="train_llama.png", metavar="PNG",
                        help="draw the two loss curves (default file: %(const)s)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> list[Run]:
    args = parse(argv)
    device = torch.device(args.device)
    data = corpus()
    model = build_model(args)
    print(f"a Llama of {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{len(data):,} bytes of Python to learn from, {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len} bytes on {device}")

    patched = copy.deepcopy(model)
    print(torch_pallas.transformers.apply(patched))
    runs = [train("torch", model, data, args, device),
            train("torch_pallas", patched, data, args, device)]
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)
    return runs


if __name__ == "__main__":
    main()
