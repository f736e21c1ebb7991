"""Check a layer call's arguments with fla_contract.layer_inputs
(mirror: fla_torch/layers/inputs.py)."""
from __future__ import annotations

from fla_contract import layer_inputs as contract
from fla_contract.names import pretty

from ..dtypes import dtype_name
from .padding import check_attention_mask


def check_layer_call(layer, name: str, hidden_states, attention_mask=None, past_key_values=None,
                     cu_seqlens=None):
    """Validate hidden_states [B, T, hidden_size], attention_mask [B, T] and past_key_values
    (the cache dict this layer returned: recurrent_state [N, HV, K, V], conv_state
    ([N, D, W],) * 3, offset int or [N], k_sum [N, H, K]; N = B, or len(cu_seqlens) - 1).
    Shapes and dtypes only: works on traced arrays under jax.jit.

    Returns the mask as a bool array [B, T] or None; raises TypeError / ValueError naming
    `name`, the argument, what was given and what is expected."""
    if not hasattr(hidden_states, "shape") or not hasattr(hidden_states, "dtype"):
        raise contract.not_an_array(name, "hidden_states", type(hidden_states).__name__,
                                    "a jax.Array [B, T, hidden_size]")
    compute = None if layer.dtype is None else dtype_name(layer.dtype)
    contract.check_hidden_states(name, tuple(hidden_states.shape), dtype_name(hidden_states.dtype),
                                 layer.hidden_size, compute,
                                 f"dtype={pretty(compute) if compute else None}")
    mask = check_attention_mask(name, attention_mask, hidden_states, cu_seqlens)
    if past_key_values is not None:
        check_cache(layer, name, past_key_values, hidden_states.shape[0], cu_seqlens)
    return mask


def check_cache(layer, name: str, cache, B: int, cu_seqlens=None) -> None:
    """Structure and shapes of a per-layer cache dict (layers/cache.py) for this layer."""
    use_conv = bool(getattr(layer, "use_short_conv", False))
    conv = cache.get("conv_state") if isinstance(cache, dict) else None
    contract.check_cache_structure(
        name, type(cache).__name__, list(cache) if isinstance(cache, dict) else [], use_conv,
        None if conv is None else (len(conv) if hasattr(conv, "__len__") else -1),
        bool(getattr(layer, "do_feature_map_norm", False)))
    N = B if cu_seqlens is None else (cu_seqlens.shape[0] if hasattr(cu_seqlens, "shape")
                                      else len(cu_seqlens)) - 1
    HV = getattr(layer, "num_v_heads", layer.num_heads)
    K, V = layer.head_k_dim, layer.head_v_dim
    entries = []
    state = cache["recurrent_state"]
    if state is not None and hasattr(layer, "state_layouts"):   # a tuple state (GSA's (hk, hv))
        layouts = layer.state_layouts(N)
        if not isinstance(state, tuple) or len(state) != len(layouts):
            raise TypeError(f"{name}: past_key_values['recurrent_state'] is "
                            f"{type(state).__name__}; expected a tuple of {len(layouts)} states "
                            f"({', '.join(lay for _, lay in layouts)})")
        entries += [(f"past_key_values['recurrent_state'][{i}]", tuple(part.shape), shape, lay)
                    for i, (part, (shape, lay)) in enumerate(zip(state, layouts))]
    elif state is not None:
        entries.append(("past_key_values['recurrent_state']", tuple(state.shape), (N, HV, K, V),
                        "[N, HV, K, V]"))
    if use_conv:
        for i, (c, mod) in enumerate(zip(conv, (layer.q_conv1d, layer.k_conv1d,
                                                layer.v_conv1d))):
            if c is not None:
                entries.append((f"past_key_values['conv_state'][{i}] ({'qkv'[i]})",
                                tuple(c.shape), (N, mod.hidden_size, mod.kernel_size),
                                "[N, D, W]"))
    offset = cache.get("offset", 0)
    if len(getattr(offset, "shape", ())) > 0:
        entries.append(("past_key_values['offset']", tuple(offset.shape), (N,), "[N]"))
    if getattr(layer, "do_feature_map_norm", False) and cache["k_sum"] is not None:
        entries.append(("past_key_values['k_sum']", tuple(cache["k_sum"].shape),
                        (N, layer.num_heads, K), "[N, H, K]"))
    contract.check_cache_shapes(name, entries)
