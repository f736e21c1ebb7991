"""Checks of a layer call's arguments, the same words in fla_torch and fla_jax.

Each framework describes what it was given as shapes (tuples) and dtype names (canonical
float names from names.py, the framework's own name otherwise) and calls these functions;
errors name the layer, the argument, what was given and what is expected.

The dtype rule for `hidden_states` [B, T, hidden_size]: any float dtype (bf16, fp16, fp32,
fp64). A layer with an explicit compute dtype (a torch `policy`, a Flax `dtype`) casts its
input to it, as the policy asks -- except from one 16-bit format to the other (fp16 <-> bf16),
which re-rounds or overflows values without saying so and is refused. Autocast sets no
explicit compute dtype: under `torch.autocast` any float input is accepted.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .names import FLOAT_NAMES, INT_NAMES, pretty

_SIXTEEN_BIT = ("bf16", "fp16")


def shape_str(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def not_an_array(layer: str, arg: str, given_type: str, expected: str) -> TypeError:
    """The error for an argument that is not an array / tensor at all."""
    return TypeError(f"{layer}: {arg} is {given_type}; expected {expected}")


def check_hidden_states(layer: str, shape: tuple, dtype: str, hidden_size: int,
                        compute: Optional[str] = None, compute_source: str = "") -> None:
    """hidden_states must be a float [B, T, hidden_size] with B, T >= 1.

    compute: the layer's explicit compute dtype name (None when it follows the input);
    compute_source: how it was set, for the message (e.g. 'policy params=fp32,compute=bf16,
    output=bf16', 'dtype=bfloat16')."""
    expected = f"[B, T, hidden_size] = [B, T, {hidden_size}]"
    if len(shape) != 3:
        raise ValueError(f"{layer}: hidden_states has shape {shape_str(shape)} (rank "
                         f"{len(shape)}); expected rank 3, {expected}")
    if shape[-1] != hidden_size:
        raise ValueError(f"{layer}: hidden_states has shape {shape_str(shape)}, last dimension "
                         f"{shape[-1]}; expected {expected} (the layer was built with "
                         f"hidden_size={hidden_size})")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{layer}: hidden_states has shape {shape_str(shape)}; expected "
                         f"B >= 1 and T >= 1")
    if dtype not in FLOAT_NAMES:
        raise TypeError(f"{layer}: hidden_states has dtype {pretty(dtype)}; expected a floating "
                        f"dtype (bfloat16, float16, float32 or float64): the layer takes "
                        f"activations, not token ids (a CausalLM takes the ids)")
    if compute in _SIXTEEN_BIT and dtype in _SIXTEEN_BIT and dtype != compute:
        raise TypeError(f"{layer}: hidden_states has dtype {pretty(dtype)} but the layer "
                        f"computes in {pretty(compute)} ({compute_source}); expected "
                        f"{pretty(compute)} or float32 (a {pretty(dtype)} -> {pretty(compute)} "
                        f"cast loses {'range' if dtype == 'bf16' else 'precision'}: cast it "
                        f"yourself if you mean it)")


def check_attention_mask(layer: str, shape: tuple, dtype: str, B: int, T: int,
                         hidden_shape: tuple) -> None:
    """attention_mask must be [B, T] of bool, an integer or a float dtype."""
    if tuple(shape) != (B, T):
        raise ValueError(f"{layer}: attention_mask has shape {shape_str(shape)}; expected "
                         f"[B, T] = [{B}, {T}] (hidden_states is {shape_str(hidden_shape)})")
    if dtype != "bool" and dtype not in INT_NAMES and dtype not in FLOAT_NAMES:
        raise TypeError(f"{layer}: attention_mask has dtype {pretty(dtype)}; expected bool, an "
                        f"integer or a floating dtype")


def check_cache_shapes(layer: str, entries: Sequence[tuple]) -> None:
    """entries: (argument name, given shape, expected shape, layout) for each cache tensor
    that is present. A mismatch names the argument, both shapes and the likely cause."""
    for arg, given, expected, layout in entries:
        if tuple(given) != tuple(expected):
            raise ValueError(f"{layer}: {arg} has shape {shape_str(given)}; expected {layout} = "
                             f"{shape_str(expected)} for this layer and batch (a cache returned "
                             f"by another layer, or for another batch size?)")


def check_cache_structure(layer: str, kind: str, keys: Sequence[str], use_short_conv: bool,
                          conv_len: Optional[int], needs_k_sum: bool) -> None:
    """The cache is the dict a layer returned with use_cache=True.

    kind: type name of what was given; keys: its keys when it is a dict; conv_len: len of its
    'conv_state' (None when absent or None)."""
    if kind != "dict" or "recurrent_state" not in keys:
        raise TypeError(f"{layer}: past_key_values is {kind}; expected the per-layer cache dict "
                        f"this layer returned with use_cache=True (keys recurrent_state, "
                        f"conv_state, offset)")
    if use_short_conv and conv_len != 3:
        raise ValueError(f"{layer}: past_key_values['conv_state'] is "
                         f"{'None' if conv_len is None else f'of length {conv_len}'}; expected "
                         f"a (q, k, v) tuple of [B, D, W] arrays (use_short_conv=True; a "
                         f"cache from a layer without short convolutions?)")
    if not use_short_conv and conv_len is not None:
        raise ValueError(f"{layer}: past_key_values['conv_state'] holds short-convolution "
                         f"caches; expected None (this layer has no short convolutions: a cache "
                         f"from another layer?)")
    if needs_k_sum and "k_sum" not in keys:
        raise ValueError(f"{layer}: past_key_values has no 'k_sum'; expected the [B, H, K] "
                         f"key sum that LinearAttention(do_feature_map_norm=True) returns")


def check_input_ids(model: str, shape: tuple, dtype: str, vocab_size: int,
                    lowest: Optional[int] = None, highest: Optional[int] = None,
                    allowed: Sequence[str] = INT_NAMES) -> None:
    """input_ids must be integer [B, T] token ids in [0, vocab_size); lowest / highest: the
    smallest and largest id when the values are known (None under a trace); allowed: the
    integer dtype names the framework's embedding takes."""
    if dtype not in allowed:
        raise TypeError(f"{model}: input_ids has dtype {pretty(dtype)}; expected integer token "
                        f"ids (int32 or int64)")
    if len(shape) != 2:
        raise ValueError(f"{model}: input_ids has shape {shape_str(shape)} (rank {len(shape)}); "
                         f"expected rank 2, [B, T]")
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{model}: input_ids has shape {shape_str(shape)}; expected B >= 1 "
                         f"and T >= 1")
    if lowest is not None and lowest < 0:
        raise ValueError(f"{model}: input_ids contains {lowest}; expected token ids in "
                         f"[0, vocab_size) = [0, {vocab_size})")
    if highest is not None and highest >= vocab_size:
        raise ValueError(f"{model}: input_ids contains {highest}; expected token ids in "
                         f"[0, vocab_size) = [0, {vocab_size})")
