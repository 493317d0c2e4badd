"""TRL's GRPO with its per-token log-probs and entropies on the Pallas ops.

    from torch_pallas.trl import GRPOTrainer   # in place of: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()

TRL's `GRPOTrainer` scores every completion token through one method,
`_get_per_token_logps_and_entropies(model, input_ids, attention_mask,
logits_to_keep, batch_size=None, compute_entropy=False, ...)`: for the
policy in the loss (with entropies: the `entropy` metric, the
`top_entropy_quantile` mask and the `entropy_coef` bonus), and, without
gradients, for the old policy (importance sampling) and the reference
model (the `beta` KL term). `FusedLogProbs` overrides that method alone
(the trainers built on TRL's GRPO inherit it), so the trainer's
generation, loss, metrics and everything else stay TRL's; `GRPOTrainer`
is `trl.GRPOTrainer` with it mixed in. (A subclass of TRL's trainer that
overrides the method itself should put `FusedLogProbs` first among its
bases: `class MyTrainer(FusedLogProbs, trl.GRPOTrainer)`.)

What the method returns is TRL's contract (trl 1.16), computed by
`torch_pallas.transformers.token_log_probs` (the model's backbone, then the
LM head, the temperature and the log-softmax in one op that never holds
the (tokens x vocabulary) logits), batch by batch as TRL chunks
(`batch_size` rows at a time, all at once when None):
- log-probs (B, K), float32: for each of the last K = `logits_to_keep`
  tokens, its log-probability given the tokens before it, the logits
  divided by the trainer's `temperature`;
- entropies (B, K), float32, with gradients, where `compute_entropy`
  asks, None otherwise;
- 0 for both where `attention_mask` is 0 (a completion's padding), as
  TRL's labels of -100 give, with no gradient through them;
- None for the third value, the MoE load-balancing loss (where
  `compute_aux_loss` asks for it, TRL's method runs: below);
- under `accelerator.autocast()`, as TRL's forward runs.

What the fused path does not serve goes to TRL's own method, with a
warning that says why (each reason once), so a step is never computed
differently, only without the fused op:
- vision-language inputs (`pixel_values`, `image_grid_thw`,
  `token_type_ids`, ...: any model input besides the tokens and their
  mask), and any input a later TRL passes that this module does not know;
- `compute_aux_loss` (an MoE model's `router_aux_loss_coef`): the loss
  comes from the router logits of TRL's forward;
- a model whose logits are more than its LM head's product (and Gemma's
  softcap), which token_log_probs refuses: Cohere's `logit_scale`,
  Granite's `logits_scaling`, Falcon-H1's `lm_head_multiplier`, ... (TRL's
  fused head applies those);
- a model inside a distributed container (DistributedDataParallel, FSDP's
  wrapper, DeepSpeed's engine, DataParallel): their forward prepares the
  gradients' synchronisation or gathers the parameters, which a call past
  the container would skip (TRL calls the container). A compiled model
  (`torch.compile`'s wrapper) is unwrapped: its decoder runs eagerly;
- a PEFT model (the adapters and prompt-learning's virtual tokens are
  applied in PeftModel's forward, and TRL scores the reference by
  disabling them);
- `cast_lm_head_to_fp32=True` (TRL then projects the hidden states in
  float32, outside autocast);
- a `logits_to_keep` outside 1 .. sequence length - 1 (TRL's slicing reads
  0 as "every position");
- a trl whose method takes other arguments than the ones above (the
  version this was written for is 1.16).

Imports: `torch_pallas.transformers.log_probs` (`token_log_probs`, looked
up at each call, and its check of a model), and trl (with accelerate),
which a user of this module has installed.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import trl
from accelerate.utils import is_compiled_module, is_peft_model  # as TRL's trainer tells them
from trl.extras.profiling import profiling_decorator

from torch_pallas.transformers import log_probs

WHERE = "torch_pallas.trl"
TRL_METHOD = "_get_per_token_logps_and_entropies"
# The arguments of TRL's method that the fused path reads, in TRL's order;
# every other one is a model input (vision-language models') that it does not
# pass, served by TRL's method whenever it is not None.
TRL_LEADING_PARAMETERS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep",
                          "batch_size",
                          "compute_entropy", "compute_aux_loss")


def _signature_refusal() -> str | None:
    """Why this trl's method is not the one the fused path stands in for, or None."""
    method = getattr(trl.GRPOTrainer, TRL_METHOD, None)
    if method is None:
        return f"trl {trl.__version__}'s GRPOTrainer has no {TRL_METHOD}"
    parameters = tuple(inspect.signature(method).parameters)
    if parameters[:len(TRL_LEADING_PARAMETERS)] != TRL_LEADING_PARAMETERS:
        return (f"trl {trl.__version__}'s {TRL_METHOD} takes {parameters}, not "
                f"{TRL_LEADING_PARAMETERS} and model inputs as trl 1.16's")
    return None


SIGNATURE_REFUSAL = _signature_refusal()


class FusedLogProbs:
    """Mixin for TRL trainers: `_get_per_token_logps_and_entropies` through
    `torch_pallas.transformers.token_log_probs` (this module's docstring has
    the contract and what falls back to TRL's own method)."""

    @profiling_decorator
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False,
                                           **model_inputs):
        given = model
        # (accelerate's `dynamo_backend`, the Trainer's `torch_compile`)
        if is_compiled_module(model):
            model = model._orig_mod  # its decoder then runs eagerly, before the op
        why = self._fused_log_probs_refusal(model, input_ids, logits_to_keep, compute_aux_loss,
                                            model_inputs)
        if why is not None:
            warnings.warn(f"{WHERE}: per-token log-probs through TRL's own {TRL_METHOD}: {why}",
                          stacklevel=2)
            return super()._get_per_token_logps_and_entropies(
                given, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **model_inputs)

        batch_size = batch_size or input_ids.size(0)  # TRL's chunks: bounds the peak memory
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            mask = attention_mask[start:start + batch_size]
            with self.accelerator.autocast():
                out = log_probs.token_log_probs(
                    model, ids, mask, logits_to_keep=logits_to_keep, temperature=self.temperature,
                    return_entropy=compute_entropy)
            logps, entropy = out if compute_entropy else (out, None)
            # TRL scores a padded target as label -100: 0, and no gradient
            padded = mask[:, -logits_to_keep:] == 0
            all_logps.append(logps.masked_fill(padded, 0.0))
            if compute_entropy:
                all_entropies.append(entropy.masked_fill(padded, 0.0))
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return torch.cat(all_logps, dim=0), entropies, None

    def _fused_log_probs_refusal(self, model, input_ids, logits_to_keep, compute_aux_loss,
                                 model_inputs) -> str | None:
        """Why the fused path cannot compute what TRL's method would, or None."""
        if SIGNATURE_REFUSAL is not None:
            return SIGNATURE_REFUSAL
        inputs = sorted(name for name, value in model_inputs.items() if value is not None)
        if inputs:
            return f"the model takes inputs besides the tokens ({', '.join(inputs)})"
        if compute_aux_loss:
            return ("the MoE load-balancing loss (compute_aux_loss) comes from TRL's forward's "
                    "router logits")
        if self.accelerator.unwrap_model(model) is not model:
            return (f"the model is inside a {type(model).__name__}, whose forward synchronises "
                    "gradients or gathers parameters")
        if is_peft_model(model):
            return "a PEFT model applies its adapters in its own forward"
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            return ("cast_lm_head_to_fp32=True projects the hidden states in float32 outside "
                    "autocast")
        length = input_ids.size(1)
        if not 0 < logits_to_keep < length:
            return (f"logits_to_keep={logits_to_keep} is not in 1 .. {length - 1} (the sequence's "
                    "length - 1)")
        # a model whose logits are more than its LM head's product (a logit scale, say)
        return log_probs.refusal(model)


class GRPOTrainer(FusedLogProbs, trl.GRPOTrainer):
    """`trl.GRPOTrainer`, its per-token log-probs and entropies through
    `torch_pallas.transformers.token_log_probs` (`FusedLogProbs`)."""


__all__ = ["FusedLogProbs", "GRPOTrainer"]
