"""Activation checkpointing: `remat_policy` names to `jax.checkpoint` policies.

Layers tag their intermediates with `checkpoint_name` (TENSOR_NAMES); a policy says which
of them the backward pass finds saved on the device, which it finds offloaded to host
memory, and (by omission) which it recomputes. `none` wraps nothing at all.
"""

from typing import Mapping

import jax

TENSOR_NAMES = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out",
                "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
ACTIONS = ("remat", "device", "offload")

_QKV = ("query_proj", "key_proj", "value_proj")
_PROJECTIONS = _QKV + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")

# policy -> (names saved on device, names offloaded to host), most memory first.
POLICIES = {
    "minimal": (_PROJECTIONS, ()),
    "save_dot_except_mlpwi": (_QKV + ("out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": (_QKV + ("out_proj",), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "qkv_proj_offloaded": ((), _QKV),
    "minimal_offloaded": ((), _PROJECTIONS),
    # The layer input is the scan carry: offloaded by name, the backward reads the host copy and
    # the stack of carries never lives on the device.
    "save_out_proj_input_offloaded": (("out_proj",), ("decoder_layer_input",)),
    "full": ((), ()),
    "input_offloaded": ((), ("decoder_layer_input",)),
}
# What the planner and remat_policy=auto choose from; `custom` needs per-tensor choices of its own.
SEARCHABLE_POLICIES = ("none",) + tuple(POLICIES)
POLICY_NAMES = SEARCHABLE_POLICIES + ("custom",)


def saved_names(policy: str, actions: Mapping[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(names kept on device, names offloaded) under `policy`, any but `none`.

  `actions` maps each tensor name to its action; only `custom` reads it.
  """
  if policy == "custom":
    device = tuple(n for n in TENSOR_NAMES if actions[n] == "device")
    offload = tuple(n for n in TENSOR_NAMES if actions[n] == "offload")
    return device, offload
  return POLICIES[policy]


def checkpoint_policy(config):
  """The jax.checkpoint policy for config.remat_policy, any but `none`."""
  device, offload = saved_names(config.remat_policy, config.to_dict())
  if offload:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(device), names_which_can_be_offloaded=list(offload),
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(*device)


def distinct_policies(policies, platform: str) -> tuple[list, dict]:
  """(the policies that keep different tensors where they count on `platform`, in order; {each
  other policy: the earlier one it equals}). A checkpoint keeps its input (the layer input)
  whatever a policy names, so naming it on the device changes nothing; on CPU host memory is
  device memory, so an offloaded tensor is a kept one."""
  kept, equal, seen = [], {}, {}
  for policy in policies:
    if policy in ("none", "custom"):
      key = policy
    else:
      device, offload = (frozenset(names) for names in POLICIES[policy])
      device -= {"decoder_layer_input"}
      key = device | (offload - {"decoder_layer_input"}) if platform == "cpu" else (device, offload)
    if key in seen:
      equal[policy] = seen[key]
    else:
      seen[key] = policy
      kept.append(policy)
  return kept, equal

