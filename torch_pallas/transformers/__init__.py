"""transformers models on the Pallas ops: `attn_implementation="pallas"` and `apply(model)`.

    import torch_pallas.transformers
    torch_pallas.transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="pallas")
    # or: model.set_attn_implementation("pallas")

`register()` adds "pallas" to transformers' `AttentionInterface` (every
attention layer of a model that uses the interface then calls
`torch.ops.pallas.attention`) and to its `AttentionMaskInterface` with the
masks transformers builds for SDPA (boolean, None where a causal rule
suffices), so padding masks reach the op. Grouped key/value heads are read
in place (no `repeat_kv`). With transformers 5.x it also adds "pallas" to
the `ExpertsInterface` (experts.py): `from_config(config,
experts_implementation="pallas")` or `model.set_experts_implementation(
"pallas")` then runs a mixture of experts' experts on
`torch.ops.pallas.grouped_mm` (transformers 4.x has no such interface:
nothing is registered there). Importing `torch_pallas` does not import
transformers; this module does, when `register()` or `apply()` runs.

`apply(model)` (patching.py) puts the rest of a model on the Pallas
training ops in place, in one call: its norms, rotary embeddings, gated
MLPs, MoE experts, Linear layers, attention and, for causal-LM training,
the LM head with its loss; it returns a `Report` of what it replaced.

    report = torch_pallas.transformers.apply(model)

An integration above `torch_pallas.nn`: it imports the ops
(`torch_pallas.ops`) and nn's drop-in layers and `replace_linear`, and
nothing of torch_pallas imports it but the public API's
`torch_pallas.transformers`.

Imports: `torch_pallas.ops`, `torch_pallas.nn`; transformers itself only
inside `register()` and `apply()`.
"""

from torch_pallas.transformers.attention import NAME, attention_forward, register
from torch_pallas.transformers.experts import experts_forward
from torch_pallas.transformers.log_probs import token_log_probs
from torch_pallas.transformers.patching import Report, apply

__all__ = ["NAME", "Report", "apply", "attention_forward", "experts_forward", "register",
           "token_log_probs"]
