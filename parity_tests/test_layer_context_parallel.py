"""layers.context_parallel refuses what it cannot split (both frameworks): short
convolutions, softmax Attention and recurrent mode raise a ValueError naming the layer, and
nothing changes outside the context. The split itself: test_sharding_torch.py ('cp' rows) and
examples/train_sharded.py (both frameworks)."""
from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.layers as jl  # noqa: E402
import fla_torch.layers as tl  # noqa: E402
from fla_jax.layers import context_parallel as jcp  # noqa: E402
from fla_torch.layers import context_parallel as tcp  # noqa: E402

REFUSED = (("GatedDeltaNet", dict(hidden_size=32, head_dim=8, num_heads=2), {},
            "use_short_conv=True"),
           ("Attention", dict(hidden_size=32, num_heads=2), {}, "softmax attention"),
           ("GatedLinearAttention", dict(hidden_size=32, num_heads=2, mode="fused_recurrent"),
            {}, "recurrent mode"))


@pytest.mark.parametrize("cls,kw,call,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_in_both_frameworks(cls, kw, call, words):
    x = np.random.default_rng(0).standard_normal((1, 8, 32)).astype(np.float32)
    t_layer = getattr(tl, cls)(**kw)
    j_layer = getattr(jl, cls)(**kw, rngs=nnx.Rngs(0))
    with tcp.context_parallel(object()), pytest.raises(ValueError, match=words):
        t_layer(torch.from_numpy(x), **call)
    with jcp.context_parallel("cp"), pytest.raises(ValueError, match=words):
        j_layer(jnp.asarray(x), **call)
    assert tcp.active() is None and jcp.active() is None
    t_layer(torch.from_numpy(x), **call)     # outside the context: runs
    j_layer(jnp.asarray(x), **call)
