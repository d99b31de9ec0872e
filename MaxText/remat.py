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
# The attention kernels' forward residuals, the context and its logsumexp (splash attention's
# residual_checkpoint_name, and layers/context_parallel's blocks tag them). A policy that keeps
# attention_out keeps them with it, where it keeps attention_out: the context alone would not
# spare the kernel's forward, whose backward needs the logsumexp too. An attention slice's
# checkpoint (linears.sum_of_slices) always keeps them, so the slice's backward runs the kernel's
# backward without running its forward a third time.
KERNEL_RESIDUALS = "attention_kernel_residuals"

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
    # full, with attention's context (and its kernel's logsumexp) off the device as well: the
    # backward runs attention's backward, never its forward again.
    "attention_out_input_offloaded": ((), ("attention_out", "decoder_layer_input")),
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


def checkpoint_policy(config, keep_input: bool = False, keep: tuple = ()):
  """The jax.checkpoint policy for config.remat_policy (`none`: nothing but `keep`). keep_input:
  the layer input is kept on the device too where the policy does not offload it (for a region
  around checkpointed layers, so that it recomputes what is between them and not the layers);
  keep: more names kept on the device."""
  device, offload = ((), ()) if config.remat_policy == "none" else saved_names(config.remat_policy,
                                                                                config.to_dict())
  device, offload = (names + (KERNEL_RESIDUALS,) * ("attention_out" in names) for names in (device, offload))
  device, offload = (*device, *keep), tuple(name for name in offload if name not in keep)
  if keep_input and "decoder_layer_input" not in offload:
    device = (*device, "decoder_layer_input")
  if offload:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(device), names_which_can_be_offloaded=list(offload),
        offload_src="device", offload_dst="pinned_host")
  return jax.checkpoint_policies.save_only_these_names(*device)


def _kept(policy: str, platform: str):
  """What `policy` keeps where it counts on `platform`: (names on the device, names offloaded),
  None for `none` (which keeps everything). A checkpoint keeps its input (the layer input)
  whatever a policy names, so naming it on the device changes nothing; on CPU host memory is
  device memory, so an offloaded tensor is a kept one."""
  if policy == "none":
    return None
  device, offload = (frozenset(names) for names in POLICIES[policy])
  device -= {"decoder_layer_input"}
  if platform == "cpu":
    return device | (offload - {"decoder_layer_input"}), frozenset()
  return device, offload


def distinct_policies(policies, platform: str) -> tuple[list, dict]:
  """(the policies that keep different tensors where they count on `platform`, in order; {each
  other policy: the earlier one it equals})."""
  kept, equal, seen = [], {}, {}
  for policy in policies:
    key = policy if policy == "custom" else _kept(policy, platform)
    if key in seen:
      equal[policy] = seen[key]
    else:
      seen[key] = policy
      kept.append(policy)
  return kept, equal


def needs_no_less(policy: str, other: str, platform: str) -> bool:
  """Whether `policy`'s step needs at least the device memory of `other`'s, all else equal: it
  keeps on the device every tensor `other` keeps there and offloads the same ones (an offload
  moves a tensor off the device, so policies that offload differently are not compared)."""
  mine, theirs = _kept(policy, platform), _kept(other, platform)
  if mine is None:
    return True
  return theirs is not None and mine[1] == theirs[1] and theirs[0] <= mine[0]
