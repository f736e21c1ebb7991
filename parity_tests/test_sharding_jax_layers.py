"""fla_jax layers and the tiny LM's train step under jax.jit with batch-sharded inputs
(data parallel over 4 virtual CPU devices, parameters replicated): outputs, input and
parameter gradients of one layer of each class, and the LM's loss and updated parameters after
a train step (loss, grad, clip, AdamW), equal the one-device run, fp32 within 1e-5."""
from __future__ import annotations

import pytest

from .multi_device import in_child, run_module_in_child

if not in_child():
    def test_on_four_devices():
        print(run_module_in_child(__file__))
else:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from fla_jax.models import CausalLM, LMConfig, lm_loss
    from fla_jax.models import train as jtrain

    from .cases import rel_rms
    from .layer_runners import CASES_BY_NAME, HIDDEN, draw, make_jax_layer, make_torch_layer
    from fla_torch import interop as tinterop

    MESH = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    BATCH = NamedSharding(MESH, P("data"))
    REPLICATED = NamedSharding(MESH, P())
    TOL = 1e-5

    def replicate(tree):
        return jax.tree.map(lambda a: jax.device_put(a, REPLICATED), tree)

    def layer_grads(layer, x, dy, shard: bool):
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x):
            o, _, _ = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(o * dy), o
        if shard:
            params, rest, x, dy = replicate(params), replicate(rest), \
                jax.device_put(x, BATCH), jax.device_put(dy, BATCH)
        (_, o), (dp, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, x)
        if shard:
            assert tuple(o.sharding.spec)[:1] == ("data",), o.sharding
        flat = {"o": o, "dx": dx}
        flat.update({jax.tree_util.keystr(k): v
                     for k, v in jax.tree_util.tree_leaves_with_path(dp)})
        return {k: np.asarray(v) for k, v in flat.items()}

    @pytest.mark.parametrize("name", ("gdn", "deltanet", "gla", "retention", "linear_attn",
                                      "attn"))
    def test_layer_batch_sharded(name):
        case = CASES_BY_NAME[name]
        layer = make_jax_layer(case, tinterop.to_numpy(make_torch_layer(case)))
        x, dy = draw(case)
        x = jnp.asarray(np.concatenate([x, x[::-1] * 0.5]), jnp.float32)   # B = 4
        dy = jnp.asarray(np.concatenate([dy, dy]), jnp.float32)
        ref = layer_grads(layer, x, dy, shard=False)
        out = layer_grads(layer, x, dy, shard=True)
        for k in ref:
            err = rel_rms(out[k], ref[k], ref[k])
            assert err <= TOL, f"{name} {k}: rel RMS {err:.2e}"

    def test_lm_data_parallel(attn="hybrid"):
        """A hybrid LM (a Gated DeltaNet block, an Attention block): its loss and parameter
        gradients, then the losses of two train steps (loss,
        grad, clip, AdamW; Adam's normalised update turns rounding-level gradient differences
        of near-zero gradients into lr-sized parameter differences, so the parameters after a
        step are compared through the next loss)."""
        kw = dict(vocab_size=40, hidden_size=HIDDEN, num_layers=2, num_heads=2, head_dim=16)
        cfg = LMConfig(**kw, attn="gated_deltanet", attn_layers=[1] if attn == "hybrid" else [])
        ids = np.random.default_rng(3).integers(0, 40, (4, 41))
        x, y = jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])

        @nnx.jit
        def loss_and_grads(model, x, y):
            return nnx.value_and_grad(lambda m: lm_loss(m(x), y))(model)

        results = []
        for shard in (False, True):
            model = CausalLM(cfg, rngs=nnx.Rngs(0))
            opt = jtrain.make_optimizer(model, jtrain.adamw([1e-2, 1e-2, 1e-2]))
            xs, ys = x, y
            if shard:
                nnx.update(model, replicate(nnx.state(model)))
                nnx.update(opt, replicate(nnx.state(opt)))
                xs, ys = jax.device_put(x, BATCH), jax.device_put(y, BATCH)
            loss, grads = loss_and_grads(model, xs, ys)
            flat = {jax.tree_util.keystr(k): np.asarray(v)
                    for k, v in jax.tree_util.tree_leaves_with_path(grads)}
            losses = [float(jtrain.train_step(model, opt, xs, ys)) for _ in range(3)]
            results.append((float(loss), flat, losses))
        (l0, g0, s0), (l1, g1, s1) = results
        assert abs(l0 - l1) <= TOL * l0, (l0, l1)
        for k in g0:
            err = rel_rms(g1[k], g0[k], g0[k])
            assert err <= TOL, f"{attn} d{k}: rel RMS {err:.2e}"
        assert np.allclose(s0, s1, rtol=TOL, atol=0), (s0, s1)
