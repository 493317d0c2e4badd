"""transformers models on the Pallas attention: `attn_implementation="pallas"`.

    import torch_pallas.transformers
    torch_pallas.transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="pallas")
    # or: model.set_attn_implementation("pallas")

`register()` adds "pallas" to transformers' `AttentionInterface` (every
attention layer of a model that uses the interface then calls
`torch.ops.pallas.attention`) and to its `AttentionMaskInterface` with the
masks transformers builds for SDPA (boolean, None where a causal rule
suffices), so padding masks reach the op. Grouped key/value heads are read
in place (no `repeat_kv`). Importing `torch_pallas` does not import
transformers; this module does, when `register()` runs.

The place for the rest of what puts a transformers model on the Pallas ops
(the one call that patches a model's norms, rotary embeddings, MLPs and
loss onto the training ops lands here, as `patching.py`). An integration:
it imports the ops (`torch_pallas.ops`), and nothing of torch_pallas imports
it but the public API's `torch_pallas.transformers`. The attention function
and its registration are in attention.py.

Imports: `torch_pallas.ops`; transformers itself only inside `register()`.
"""

from torch_pallas.transformers.attention import NAME, attention_forward, register

__all__ = ["NAME", "attention_forward", "register"]
