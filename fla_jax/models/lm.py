"""CausalLM for Flax NNX: a tiny causal language model built from fla_jax.layers (mirror of
fla_torch.models.lm, with the same parameter names, shapes and arithmetic).

    embeddings -> num_layers x [x + attn(attn_norm(x)); x + mlp(mlp_norm(x))] -> norm -> head

Parameter names (NNX attribute paths = torch state_dict keys, so fla_jax.interop's
from_state_dict / to_state_dict / safetensors helpers work on the whole model):
    embeddings.weight [vocab, D], layers.{i}.attn_norm.weight, layers.{i}.attn.*,
    layers.{i}.mlp_norm.weight, layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight,
    norm.weight, lm_head.weight (tie_embeddings=False only).

Dtypes (Flax's convention): parameters stored in `param_dtype`, computed in `dtype`. Both come
from config.policy when it is set (params / compute; logits returned in its output dtype);
otherwise `dtype=None` computes in the parameter dtype. The residual stream is in the compute
dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fla_contract.layer_inputs import check_input_ids, not_an_array

from .. import layers as fla_layers
from ..dtypes import DtypePolicy, dtype_name
from ..modules import Linear, RMSNorm
from ..modules.precision import canonical, dense
from .config import LMConfig


class Embedding(nnx.Module):
    """Token embeddings with torch's parameter name: weight [vocab, D] (normal(0, std)).

    __call__(ids [B, T] int) -> [B, T, D] in `dtype` (default: the stored dtype)."""

    def __init__(self, num_embeddings: int, features: int, std: float = 0.02, *,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.num_embeddings, self.features = num_embeddings, features
        w = std * jax.random.normal(rngs.params(), (num_embeddings, features), jnp.float32)
        self.weight = nnx.Param(w.astype(canonical(param_dtype)))

    def __call__(self, ids, dtype=None):
        w = self.weight[...]
        return jnp.take(w, ids, axis=0).astype(w.dtype if dtype is None else dtype)


class GatedMLP(nnx.Module):
    """SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)); silu computed in float32.

    x [..., D] -> [..., D] in `dtype` (x's dtype by default)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        f = {"param_dtype": param_dtype, "rngs": rngs}
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, **f)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, **f)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, **f)

    def __call__(self, x, dtype=None):
        cd = x.dtype if dtype is None else dtype
        gate = self.gate_proj(x, cd)
        up = self.up_proj(x, cd)
        h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(cd)
        return self.down_proj(h, cd)


class Block(nnx.Module):
    """x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); x [B, T, D] in the compute dtype."""

    def __init__(self, config: LMConfig, layer_idx: int, *, param_dtype, rngs: nnx.Rngs):
        f = {"param_dtype": param_dtype, "rngs": rngs}
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **f)
        self.attn = getattr(fla_layers, config.layer_class(layer_idx))(
            **config.attn_kwargs_for(layer_idx), **f)
        _check_attn_sizes(config, self.attn)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **f)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, **f)

    def __call__(self, x, cache=None, use_cache: bool = False, max_cache_len=None,
                 v_first=None):
        """-> (x, cache, v_first): v_first is RWKV-7's value of block 0, passed along."""
        cd = x.dtype
        kv = {} if max_cache_len is None or not _has_kv_cache(self.attn) else \
            {"max_cache_len": max_cache_len}
        if isinstance(self.attn, fla_layers.RWKV7Attention):
            kv["v_first"] = v_first
        out = self.attn(self.attn_norm(x), past_key_values=cache, use_cache=use_cache, **kv)
        o, cache = out[0], out[2]
        if len(out) == 4:
            v_first = out[3]
        x = x + o.astype(cd)
        x = x + self.mlp(self.mlp_norm(x), cd)
        return x, cache, v_first


def _has_kv_cache(attn) -> bool:
    """The softmax Attention layer (a KV cache with a capacity); linear layers have none."""
    return isinstance(attn, fla_layers.Attention)


def _check_attn_sizes(config: LMConfig, attn) -> None:
    """The derived expand_k / expand_v must give exactly num_heads x head_dim (head_v_dim)."""
    want = (config.num_heads * config.head_dim, config.num_heads * config.head_v_dim)
    got = (getattr(attn, "key_dim", want[0]), getattr(attn, "value_dim", want[1]))
    if config.attn in ("gated_deltanet", "kda"):
        want = (want[0], getattr(attn, "num_v_heads", config.num_heads) * config.head_v_dim)
    if "expand_k" not in config.attn_kwargs and "expand_v" not in config.attn_kwargs \
            and tuple(got) != tuple(want):
        raise ValueError(f"LMConfig: {config.attn_class} built key/value dims {got} from "
                         f"hidden_size={config.hidden_size}; expected num_heads * head_dim = "
                         f"{want} (choose sizes whose ratio to hidden_size is exact)")


class CausalLM(nnx.Module):
    """A tiny causal LM over fla_jax.layers.

    Args: config (LMConfig); dtype (compute; default: the policy's compute dtype, else None =
        the parameter dtype); param_dtype (storage; default: the policy's params dtype, else
        float32); rngs (nnx.Rngs).
    __call__(input_ids [B, T] int, cache=None, use_cache=False, max_cache_len=None):
        use_cache=False -> logits [B, T, vocab];
        use_cache=True  -> (logits, cache), cache = a list with one per-layer cache dict
        (fla_jax/layers/cache.py; a pytree, so it passes through jax.jit). A prefill and then
        one token at a time gives the logits of one full forward.
        max_cache_len: the capacity in tokens of the Attention layers' KV caches
        (layers/kv_cache.py) when this call creates the cache (prompt + new tokens; default:
        the prompt + 256, rounded up to a multiple of 256); the cache keeps its shapes from
        step to step. Linear-attention layers ignore it (their state has a fixed size).
    """

    def __init__(self, config: LMConfig, *, dtype=None, param_dtype=None, rngs: nnx.Rngs):
        self.config = config
        policy = DtypePolicy.parse(config.policy) if config.policy is not None else None
        if param_dtype is None:
            param_dtype = policy.param_dtype if policy is not None else jnp.float32
        if dtype is None and policy is not None:
            dtype = policy.compute_dtype
        self.dtype, self.param_dtype = canonical(dtype), canonical(param_dtype)
        self.output_dtype = policy.output_dtype if policy is not None else None
        f = {"param_dtype": self.param_dtype, "rngs": rngs}
        D = config.hidden_size
        self.embeddings = Embedding(config.vocab_size, D, std=config.initializer_range, **f)
        self.layers = nnx.List([Block(config, i, **f) for i in range(config.num_layers)])
        self.norm = RMSNorm(D, eps=config.norm_eps, **f)
        if not config.tie_embeddings:
            self.lm_head = Linear(D, config.vocab_size, bias=False, **f)

    def compute_dtype(self):
        return self.dtype if self.dtype is not None else self.param_dtype

    def head_weight(self):
        return (self.embeddings.weight[...] if self.config.tie_embeddings
                else self.lm_head.weight[...])

    def __call__(self, input_ids, cache=None, use_cache: bool = False,
                 max_cache_len=None):
        if not hasattr(input_ids, "shape") or not hasattr(input_ids, "dtype"):
            raise not_an_array("CausalLM", "input_ids", type(input_ids).__name__,
                               "a jax.Array [B, T] of int32 token ids")
        known = (not isinstance(input_ids, jax.core.Tracer) and input_ids.size > 0
                 and jnp.issubdtype(input_ids.dtype, jnp.integer))
        check_input_ids("CausalLM", tuple(input_ids.shape), dtype_name(input_ids.dtype),
                        self.config.vocab_size,
                        int(np.min(np.asarray(input_ids))) if known else None,
                        int(np.max(np.asarray(input_ids))) if known else None)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"CausalLM: cache has {len(cache)} entries; expected one per layer "
                             f"({len(self.layers)})")
        cd = self.compute_dtype()
        x = self.embeddings(input_ids, cd)
        new_cache, v_first = [], None
        for i, block in enumerate(self.layers):
            x, c, v_first = block(x, None if cache is None else cache[i], use_cache,
                                  max_cache_len, v_first)
            new_cache.append(c)
        x = self.norm(x)
        logits = dense(x, self.head_weight(), None, cd)
        if self.output_dtype is not None:
            logits = logits.astype(self.output_dtype)
        return (logits, new_cache) if use_cache else logits


def lm_loss(logits, targets):
    """Mean next-token cross-entropy in float32: logits [B, T, vocab], targets [B, T] int."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
