"""Tensor parallelism on DTensor (torch.distributed.tensor.parallel, gloo,
2 CPU processes on loopback) of a small Llama on the Pallas ops, against
one process running the same unpatched, unsharded model on the same batch.

Tensor parallelism hands the Pallas ops DTensors: `parallelize_module`
makes the parameters DTensors and DTensor runs each op on its local shards
under the sharding rules of torch_pallas/distributed/. What is checked, for
each way of wrapping the model and each plan (VARIANTS):

- the eval logits, the training loss (`model(input_ids, labels=labels)`)
  and every parameter's gradient (DTensor gradients gathered whole) equal
  the one process's within float32 rounding;
- the forward's collectives (as the local tensors see them) are the plan's own: the
  all-reduce of each RowwiseParallel layer, or with sequence parallelism
  its reduce-scatter and the all-gather of the activations before each
  ColwiseParallel block; and no collective, forward or backward, moves a
  tensor of a parameter's shape (no weight is gathered);
- the Pallas kernels receive local shards (every op's operands as the
  kernel sees them, under DTensor): the column-split projections' half of
  the output features, attention and rotary embedding on this rank's 2 of
  the 4 query heads and 1 of the 2 key/value heads, swiglu on half the
  intermediate features, the norms on half the sequence;
- each rank holds half of every sharded parameter's bytes;
- `torch.compile(fullgraph=True)` of a tensor-parallel decoder layer
  gives the eager layer's output and gradients, without a graph break.

The variants (each a wrapping, a plan and a loss):
- "apply": `torch_pallas.transformers.apply(model)` with transformers' own
  plan for Llama (`config.base_model_tp_plan`: ColwiseParallel q/k/v and
  gate/up, RowwiseParallel o and down). With the default
  `use_local_output=True` the attention reshapes the local projections
  with `view(..., -1, head_dim)`, so each rank computes its own heads with
  the config's head counts untouched. The LM head stays whole.
- "apply_sequence_parallel": apply, and the sequence-parallel plan of
  torchtitan's Llama: the embedding RowwiseParallel to a sequence split,
  SequenceParallel norms, PrepareModuleInput gathering the sequence before
  attention and the MLP, RowwiseParallel o and down reduce-scattering back
  to it; the LM head's input gathered whole for the fused loss.
- "apply_vocabulary_parallel": apply, and the same sequence-parallel plan
  with the LM head ColwiseParallel (split on the vocabulary): the fused
  loss computes on each rank's vocabulary shard and gathers per-token
  statistics only, never the weight or the logits.
- "apply_loss_parallel": apply(cross_entropy=False) and the same
  sequence-parallel plan with the LM head ColwiseParallel, its logits left
  split on the vocabulary and the loss under torch's `loss_parallel()`.
- "replace_linear": `torch_pallas.nn.replace_linear` and
  attn_implementation="pallas" (no other patch), transformers' plan and
  the loss_parallel LM head.
- "dtensor_activations": apply, with the ColwiseParallel outputs kept as
  DTensors (`use_local_output=False`) so that rotary embedding, attention
  and swiglu themselves run on DTensors through their rules (heads and
  intermediate features split), under `implicit_replication()` for the
  plain cos/sin. (torch's own SDPA has no DTensor rule on the CPU:
  `aten._scaled_dot_product_flash_attention_for_cpu` "does not have a
  sharding strategy registered".)

The collectives are counted by LocalCalls (below), not torch's
CommDebugMode: its module tracker registers a forward hook on each call of
a module and pops its stack once per hook, so a module called more than
once in a forward breaks it (IndexError); transformers 5 calls
`apply_rotary_pos_emb`, an nn.Module with the `kernels` distribution
installed, in every layer, patched or not.

All of it runs in one spawn (each process imports JAX and torch), in one
test (under the project's `-n auto` a module fixture would spawn once per
xdist worker); rank 0 saves what it saw and the checks run in the test's
process, every failing check reported.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import torch_pallas
import torch_pallas.transformers
from test_distributed import WORLD, free_port

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 128, 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
BATCH, SEQUENCE = 2, 6  # the sequence splits evenly under sequence parallelism
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=64, use_cache=False)
    return transformers.AutoModelForCausalLM.from_config(config)


# --- the plans ------------------------------------------------------------------

def transformers_plan(model, *, use_local_output: bool = True) -> dict:
    """transformers' own tensor-parallel plan for the model's decoder
    (`config.base_model_tp_plan`), on torch's parallel styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": lambda: ColwiseParallel(use_local_output=use_local_output),
              "rowwise": RowwiseParallel}
    return {f"model.{name}": styles[style]() for name, style in model.config.base_model_tp_plan.items()}


def sequence_parallel_plan(model) -> dict:
    """torchtitan's Llama plan: the residual stream split on the sequence
    between the blocks, gathered whole inside attention and the MLP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel)

    layers = "model.layers.*."
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        layers + "input_layernorm": SequenceParallel(),
        layers + "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        **{layers + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        layers + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        layers + "post_attention_layernorm": SequenceParallel(),
        layers + "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        layers + "mlp.gate_proj": ColwiseParallel(),
        layers + "mlp.up_proj": ColwiseParallel(),
        layers + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
    }


def whole_head_after_sequence_parallel() -> dict:
    """The LM head's input gathered whole (a plain tensor), its weight left
    whole: what the fused loss reads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return {"lm_head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)}


def loss_parallel_head(*, sequence_parallel: bool) -> dict:
    """The LM head split on the vocabulary (its input the sequence shards
    under sequence parallelism, else whole), its logits left split for
    torch's loss_parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"lm_head": ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                       output_layouts=Shard(-1), use_local_output=False)}


def on_pallas_matmul_and_attention(model) -> None:
    torch_pallas.nn.replace_linear(model)
    torch_pallas.transformers.register()
    model.set_attn_implementation(torch_pallas.transformers.NAME)


# patch(model); plan(model) -> parallelize_module's plan; whether the steps run
# under implicit_replication() and loss_parallel().
Variant = collections.namedtuple("Variant", "patch plan implicit_replication loss_parallel")
VARIANTS = {
    "apply": Variant(torch_pallas.transformers.apply, transformers_plan, False, False),
    "apply_sequence_parallel": Variant(
        torch_pallas.transformers.apply,
        lambda m: {**sequence_parallel_plan(m), **whole_head_after_sequence_parallel()}, False, False),
    "apply_vocabulary_parallel": Variant(
        torch_pallas.transformers.apply,
        lambda m: {**sequence_parallel_plan(m), **loss_parallel_head(sequence_parallel=True)}, False, False),
    "apply_loss_parallel": Variant(
        lambda m: torch_pallas.transformers.apply(m, cross_entropy=False),
        lambda m: {**sequence_parallel_plan(m), **loss_parallel_head(sequence_parallel=True)}, False, True),
    "replace_linear": Variant(
        on_pallas_matmul_and_attention,
        lambda m: {**transformers_plan(m), **loss_parallel_head(sequence_parallel=False)}, False, True),
    "dtensor_activations": Variant(
        torch_pallas.transformers.apply, lambda m: transformers_plan(m, use_local_output=False),
        True, False),
}

FUSED_LOSS = {"apply", "apply_sequence_parallel", "dtensor_activations",
              "apply_vocabulary_parallel"}  # the rest: torch's loss under loss_parallel

# Each variant's forward collectives: two RowwiseParallel layers per decoder
# layer; with sequence parallelism also the embedding's reduce-scatter and
# an all-gather of the activations before attention, the MLP and the head.
SEQUENCE_PARALLEL_COMMS = {"reduce_scatter_tensor": 1 + 2 * LAYERS, "all_gather_into_tensor": 2 * LAYERS + 1}
FORWARD_COMMS = {
    "apply": {"all_reduce": 2 * LAYERS},
    "apply_sequence_parallel": SEQUENCE_PARALLEL_COMMS,
    "apply_vocabulary_parallel": SEQUENCE_PARALLEL_COMMS,
    "apply_loss_parallel": SEQUENCE_PARALLEL_COMMS,
    "replace_linear": {"all_reduce": 2 * LAYERS},
    "dtensor_activations": {"all_reduce": 2 * LAYERS},
}


# --- what the processes record ---------------------------------------------------------

class LocalCalls(TorchDispatchMode):
    """Every Pallas op and collective as it runs on local tensors, with its
    tensor operands' shapes. A mode sees a call on DTensors first; handing
    it back (NotImplemented) lets DTensor redistribute and run it on the
    shards, whose calls then come here. DTensor's sharding propagation runs
    the ops on fake tensors too; those are left out."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import is_fake
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        name = func.name().replace("_c10d_functional::", "")
        if (func.namespace == "pallas" or name in COLLECTIVES) and not any(map(is_fake, tensors)):
            self.calls.append((name, tuple(tuple(t.shape) for t in tensors)))
        return out

    def collectives(self) -> list[tuple[str, tuple]]:
        return [(name, shapes[0]) for name, shapes in self.calls if name in COLLECTIVES]

    def pallas(self) -> collections.Counter:
        return collections.Counter(call for call in self.calls if call[0].startswith("pallas::"))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it), or the tensor."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def parallel_model(variant: Variant, mesh, state: dict) -> torch.nn.Module:
    """The Llama with `state`, wrapped and parallelized as `variant` says."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = llama()
    variant.patch(model)
    model.load_state_dict(state)
    return parallelize_module(model, mesh, variant.plan(model))


def _run_variant(variant: Variant, mesh, state: dict, input_ids, labels) -> dict:
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel

    model = parallel_model(variant, mesh, state)
    context = implicit_replication if variant.implicit_replication else contextlib.nullcontext
    seen: dict = {}

    eval_calls = LocalCalls()
    with torch.no_grad(), context(), eval_calls:
        logits = model.eval()(input_ids).logits
    seen["forward_collectives"] = eval_calls.collectives()
    seen["pallas_calls"] = eval_calls.pallas()
    seen["logits"] = whole(logits)

    train_calls = LocalCalls()
    with context(), loss_parallel() if variant.loss_parallel else contextlib.nullcontext():
        with train_calls:
            loss = model.train()(input_ids, labels=labels).loss
            loss.backward()
    seen["train_collectives"] = train_calls.collectives()
    seen["train_pallas_ops"] = {name for name, _ in train_calls.pallas()}
    seen["loss"] = whole(loss)
    seen["grads"] = {name: whole(p.grad) for name, p in model.named_parameters()}

    params = dict(model.named_parameters())
    seen["parameter_shapes"] = {tuple(t.shape) for p in params.values() for t in (p, local(p))}
    seen["sharded"] = sorted(name for name, p in params.items() if local(p).shape != p.shape)
    local_bytes = sum(local(p).nbytes for p in params.values())
    per_rank = [None] * WORLD
    dist.all_gather_object(per_rank, local_bytes)
    seen["local_bytes"] = per_rank
    return seen


def _compiled_decoder_layer(mesh, state: dict, *_batch) -> dict:
    """A tensor-parallel decoder layer of the "apply" variant, eager and
    compiled (fullgraph): outputs and gradients, and dynamo's counters."""
    model = parallel_model(VARIANTS["apply"], mesh, state)
    torch.manual_seed(2)
    layer = model.model.layers[0]
    hidden = torch.randn(BATCH, SEQUENCE, HIDDEN)
    positions = torch.arange(SEQUENCE)[None]
    angles = model.model.rotary_emb(hidden, positions)

    def step(run):
        x = hidden.clone().requires_grad_()
        layer.zero_grad()
        out = run(x, position_embeddings=angles, attention_mask=None, position_ids=positions)
        out.backward(torch.ones_like(out))
        return {"out": out.detach(), "x": x.grad,
                **{name: whole(p.grad) for name, p in layer.named_parameters()}}

    eager = step(layer)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = step(torch.compile(layer, fullgraph=True))
    counters = torch._dynamo.utils.counters
    return {"eager": eager, "compiled": compiled, "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"]}


def _seen_or_error(step, *args) -> dict:
    """What `step` saw, or its traceback: both ranks fail alike, and the
    step's tests show it while the others still run."""
    try:
        return step(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _worker(rank, port, state, input_ids, labels, out_path):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        batch = (init_device_mesh("cpu", (WORLD,)), state, input_ids, labels)
        seen = {name: _seen_or_error(_run_variant, variant, *batch) for name, variant in VARIANTS.items()}
        seen["compiled"] = _seen_or_error(_compiled_decoder_layer, *batch)
        if rank == 0:
            torch.save(seen, out_path)
    finally:
        dist.destroy_process_group()


# --- the checks -------------------------------------------------------------------

def seen_by(seen: dict, name: str) -> dict:
    if "error" in seen[name]:
        raise AssertionError(f"{name} raised in the worker:\n{seen[name]['error']}")
    return seen[name]


def assert_equal(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def check_values_and_gradients(seen, reference, name):
    """Logits, loss and every gradient are the one process's."""
    seen = seen_by(seen, name)
    assert_equal(seen["logits"], reference["logits"], "logits")
    assert_equal(seen["loss"], reference["loss"], "loss")
    assert seen["grads"].keys() == reference["grads"].keys()
    for param, grad in reference["grads"].items():
        assert_equal(seen["grads"][param], grad, param)
    fused = bool({"pallas::linear_cross_entropy_forward", "pallas::linear_logsumexp"}
                 & seen["train_pallas_ops"])
    assert fused == (name in FUSED_LOSS), "the loss ran on the fused op" if fused else "torch's loss ran"


# What the plans' collectives may move: activations only.
ACTIVATIONS = {
    (BATCH, SEQUENCE, HIDDEN),  # the residual stream, all-reduced
    (BATCH, SEQUENCE // WORLD, HIDDEN),  # a sequence shard, all-gathered
    (WORLD * BATCH, SEQUENCE // WORLD, HIDDEN),  # the stream as reduce-scatter takes it: the shards stacked
    (BATCH * SEQUENCE, 1),  # loss_parallel's per-token statistics
    (1, BATCH * SEQUENCE),  # the fused loss's: each vocabulary shard's log-sum-exps, gathered
    (BATCH * SEQUENCE,),  # and its target logits, summed
}


def check_collectives(seen, reference, name):
    """The forward's collectives are the plan's; none, forward or backward, moves a weight."""
    seen = seen_by(seen, name)
    assert collections.Counter(c for c, _ in seen["forward_collectives"]) == FORWARD_COMMS[name]
    # A weight gathered or reduced would move a tensor of a parameter's
    # shape, whole or local (or its transpose), none of which is an activation's.
    weights = seen["parameter_shapes"]
    assert not ACTIVATIONS & (weights | {shape[::-1] for shape in weights})
    every = seen["forward_collectives"] + seen["train_collectives"]
    for collective, shape in every:
        assert shape in ACTIVATIONS, (collective, shape, every)


def _matmul(tokens_shape, weight_t):
    return ("pallas::matmul", (tokens_shape, weight_t))


def check_pallas_kernels_receive_local_shards(seen, reference):
    """The eval forward's Pallas calls on rank 0, as the kernels see them."""
    half_heads, half_kv_heads = HEADS // WORLD, KV_HEADS // WORLD
    half_features = INTERMEDIATE // WORLD
    tokens = (BATCH, SEQUENCE, HIDDEN)
    q = (BATCH, half_heads, SEQUENCE, HEAD_DIM)
    kv = (BATCH, half_kv_heads, SEQUENCE, HEAD_DIM)
    angles = (1, SEQUENCE, HEAD_DIM)
    per_layer = collections.Counter([  # a list: down_proj's call is gate_proj's here (32 = 64 / 2)
        _matmul(tokens, (HIDDEN, half_heads * HEAD_DIM)),  # q_proj: its output features split
        _matmul(tokens, (HIDDEN, half_kv_heads * HEAD_DIM)),  # k_proj
        _matmul(tokens, (HIDDEN, half_kv_heads * HEAD_DIM)),  # v_proj
        ("pallas::rotary_embedding", (q, kv, angles, angles)),
        ("pallas::attention_forward", (q, kv, kv)),
        _matmul((BATCH, SEQUENCE, half_heads * HEAD_DIM), (half_heads * HEAD_DIM, HIDDEN)),  # o_proj
        _matmul(tokens, (HIDDEN, half_features)),  # gate_proj
        _matmul(tokens, (HIDDEN, half_features)),  # up_proj
        ("pallas::swiglu", ((BATCH, SEQUENCE, half_features),) * 2),
        _matmul((BATCH, SEQUENCE, half_features), (half_features, HIDDEN)),  # down_proj
    ])

    def model(norm_rows, layer_calls, head):
        norm = ("pallas::rms_norm_forward", (norm_rows, (HIDDEN,)))
        return collections.Counter({norm: 2 * LAYERS + 1, head: 1}) + collections.Counter(
            {call: n * LAYERS for call, n in layer_calls.items()})

    whole_head = _matmul(tokens, (HIDDEN, VOCAB))
    assert seen_by(seen, "apply")["pallas_calls"] == model(tokens, per_layer, whole_head)
    # Under DTensor rules: the same local shards, the same calls.
    assert seen_by(seen, "dtensor_activations")["pallas_calls"] == model(tokens, per_layer, whole_head)
    # Sequence parallelism: the norms on half the sequence; the head whole
    # (its input gathered) for the fused loss, or split on the vocabulary.
    half_sequence = (BATCH, SEQUENCE // WORLD, HIDDEN)
    assert seen_by(seen, "apply_sequence_parallel")["pallas_calls"] == model(
        half_sequence, per_layer, whole_head)
    split_head = _matmul(tokens, (HIDDEN, VOCAB // WORLD))
    for name in ("apply_loss_parallel", "apply_vocabulary_parallel"):
        assert seen_by(seen, name)["pallas_calls"] == model(half_sequence, per_layer, split_head)
    # replace_linear: the products and attention alone on the Pallas ops
    products_and_attention = collections.Counter({
        call: n * LAYERS for call, n in per_layer.items()
        if call[0] in ("pallas::matmul", "pallas::attention_forward")})
    products_and_attention[split_head] += 1
    assert seen_by(seen, "replace_linear")["pallas_calls"] == products_and_attention


def check_each_rank_holds_half_of_every_sharded_parameter(seen, reference):
    single = llama()
    full_bytes = {name: p.nbytes for name, p in single.named_parameters()}
    total = sum(full_bytes.values())
    for name in ("apply", "apply_loss_parallel", "apply_vocabulary_parallel"):
        variant = seen_by(seen, name)
        sharded = sum(full_bytes[p] for p in variant["sharded"])
        assert variant["local_bytes"] == [total - sharded // WORLD] * WORLD, name
    # transformers' plan splits every projection of the decoder layers
    projections = [p for p in full_bytes if "_proj." in p]
    assert sorted(seen_by(seen, "apply")["sharded"]) == sorted(projections)
    # with sequence parallelism and a vocabulary-split head, all but the
    # norms: each rank holds about half the model
    split = seen_by(seen, "apply_loss_parallel")
    assert sorted(p for p in full_bytes if "norm" not in p) == split["sharded"]
    assert max(split["local_bytes"]) < 0.51 * total


def check_compiled_decoder_layer_equals_eager_without_graph_breaks(seen, reference):
    compiled = seen_by(seen, "compiled")
    assert compiled["graph_breaks"] == {} and compiled["graphs"] == 1
    for what, expected in compiled["eager"].items():
        assert_equal(compiled["compiled"][what], expected, what)


def run_tensor_parallel(tmp_path) -> tuple[dict, dict]:
    """(what rank 0 saw, the one process's logits, loss and gradients)."""
    torch.manual_seed(0)
    reference = llama()
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
    labels = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
    out_path = tmp_path / "seen.pt"
    mp.spawn(_worker, args=(free_port(), reference.state_dict(), input_ids, labels, str(out_path)),
             nprocs=WORLD, join=True)
    with torch.no_grad():
        logits = reference.eval()(input_ids).logits
    loss = reference.train()(input_ids, labels=labels).loss
    loss.backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    return torch.load(out_path, weights_only=False), {"logits": logits, "loss": loss.detach(), "grads": grads}


def test_tensor_parallel_llama_on_the_pallas_ops(tmp_path):
    """Every check above, in one test: the project's xdist run (-n auto)
    would start a module fixture's spawn once per worker. The failures are
    reported together."""
    seen, reference = run_tensor_parallel(tmp_path)
    checks = [(f"{check.__name__}[{name}]", functools.partial(check, name=name))
              for check in (check_values_and_gradients, check_collectives) for name in VARIANTS]
    checks += [(check.__name__, check) for check in (
        check_pallas_kernels_receive_local_shards, check_each_rank_holds_half_of_every_sharded_parameter,
        check_compiled_decoder_layer_equals_eager_without_graph_breaks)]
    failed = []
    for label, check in checks:
        try:
            check(seen, reference)
        except AssertionError as error:
            failed.append(f"{label}: {error}")
    assert not failed, "\n\n".join(failed)
