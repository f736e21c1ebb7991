"""Lower every Mosaic GPU op of fla_jax for CUDA on this machine (no GPU needed), per head-size
pair, forward and (with the Mosaic backward) forward + backward: one line per case, ok or the
first line of the error. The CI lowers with its jax (0.10.2); the GPU machine runs jax 0.11.2,
whose Mosaic lowering differs (a constant SMEM slot in a loop, layout inference): run this with
a jax 0.11.2 interpreter before a GPU call, e.g.

    /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/j11
    /tmp/j11/bin/pip install jax==0.11.2 jaxlib==0.11.2 numpy
    /tmp/j11/bin/python benchmarks/mosaic_lowering_check.py

(the Pallas backward behind impl="mosaic" uses the Triton lowering, which jax 0.11.2 lowers only
with a GPU present: forward + backward cases use the Mosaic backwards). Exit status 1 if any
case fails.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS = ((64, 64), (128, 128), (256, 256), (64, 256), (256, 64))


def _case(op: str, K: int, V: int, backward: bool, split: bool = False):
    import jax
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as S

    from fla_jax.ops.delta_rule import chunk_delta_rule
    from fla_jax.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla_jax.ops.gla import chunk_gla
    from fla_jax.ops.simple_gla import chunk_simple_gla
    # split: fixed length with few CTAs, which the delta family cuts into sequence pieces
    # (mosaic_pieces.py: 4 pieces here); else varlen
    B, T, H, N = (1, 4096, 2, 1) if split else (1, 300, 2, 3)
    HV = H if op in ("chunk_simple_gla", "chunk_gla") else 2 * H
    dt, f32 = jnp.bfloat16, jnp.float32
    args = [S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, V), dt), S((B, T, HV), f32),
            S((B, T, HV), f32), S((N, HV, K, V), f32), S((N + 1,), jnp.int32)]
    if op == "chunk_gla":   # per-key gates
        args[3] = S((B, T, H, K), f32)

    def f(q, k, v, g, beta, h0, cu):
        kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=None if split else cu,
                  impl="mosaic")
        if op == "chunk_gated_delta_rule":
            return chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        if op == "chunk_delta_rule":
            return chunk_delta_rule(q, k, v, beta, **kw)
        if op == "chunk_gla":
            return chunk_gla(q, k, v, g, **kw)
        return chunk_simple_gla(q, k, v, g, **kw)

    def fb(*a):
        (o, ht), vjp = jax.vjp(lambda *x: f(*x, a[6]), *a[:6])
        return o, ht, vjp((jnp.ones_like(o), jnp.ones_like(ht)))
    return (fb if backward else f), args


def main() -> int:
    import jax

    from fla_jax.ops.common.mosaic import export_for_cuda
    from fla_jax.ops.gated_delta_rule import mosaic_bwd as gdn_bwd
    from fla_jax.ops.gated_delta_rule import mosaic_chunk as gdn_mosaic
    from fla_jax.ops.gla import mosaic_chunk as gla_mosaic
    from fla_jax.ops.simple_gla import mosaic_bwd as sgla_bwd
    from fla_jax.ops.simple_gla import mosaic_chunk as sgla_mosaic
    print(f"jax {jax.__version__}")
    modules = (gdn_mosaic, sgla_mosaic, gla_mosaic)

    def lower(op, K, V, backward, split=False) -> bool:
        """Lowers one case under the Mosaic backwards; prints its line; True when it lowered
        (split of the delta family: and its map pass is in the program)."""
        saved = [m.BACKWARD for m in modules]
        for m in modules:
            m.BACKWARD = "mosaic"
        try:
            fn, args = _case(op, K, V, backward, split=split)
            text = export_for_cuda(fn, *args)
            delta = op in ("chunk_gated_delta_rule", "chunk_delta_rule")
            status = ("ok" if not (split and delta) or "gdn_map_ws" in text
                      else "FAIL no map pass")
        except Exception as e:     # report every case, then the exit status
            status = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        finally:
            for m, b in zip(modules, saved):
                m.BACKWARD = b
        part = "fwd+bwd (Mosaic)" if backward else "fwd"
        print(f"{op:24s} K={K:3d} V={V:3d} {part:16s} {'split ' if split else ''}{status}",
              flush=True)
        return status == "ok"

    bad = 0
    ops = ("chunk_gated_delta_rule", "chunk_delta_rule", "chunk_simple_gla", "chunk_gla")
    for K, V in HEADS:
        for op in ops:
            for backward in (False, True):
                if backward and op == "chunk_simple_gla" and not sgla_bwd.supports(K, V):
                    continue     # its Mosaic backward takes K, V <= 128 (else the Pallas one)
                if backward and op not in ("chunk_simple_gla", "chunk_gla") \
                        and max(K, V) > gdn_bwd.MAX_HEAD:
                    continue     # likewise the delta family's
                bad += not lower(op, K, V, backward)
    for op in ops:              # the sequence split (GLA: with mosaic_split.SPLIT), K = V = 128, 64
        for K in (128, 64):
            for backward in (False, True):
                bad += not lower(op, K, K, backward, split=True)
    print(f"{bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
