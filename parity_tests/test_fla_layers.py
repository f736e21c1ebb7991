"""FLA's own RWKV7Attention and KimiDeltaAttention (fla-core, skipped when not importable)
against ours: an FLA layer's state_dict (FLA's initialisation, weights then perturbed) loads
with strict=True into our torch layer and, through interop, our Flax layer; FLA's forward then
gives our outputs in float64 (torch) and float32 (Flax).

FLA's Triton pieces cannot run on CPU, so its forward runs with them replaced: RWKV-7's token
shift, mixing, k update and output correction by FLA's own torch references
(token_shift_ref, torch_addcmul_rwkv7, k_update_ref, gate_output_correction_ref); the
recurrences by our float64 reference op (chunk_rwkv7 / chunk_kda, impl='reference', with
FLA's in-kernel gate and beta-sigmoid written out per FLA's naive_kda_gate); KDA's
ShortConvolution and FusedRMSNormGated by ours (same parameters).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from .cases import CROSS_FACTOR, LAYER_TOLERANCE, rel_rms
from .fla_reference import fla_layer_module

import torch  # noqa: E402  (the suite needs every framework: no silent skip)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import fla_jax.layers as jlayers  # noqa: E402
import fla_torch.layers as tlayers  # noqa: E402
from fla_jax import interop as jinterop  # noqa: E402
from fla_torch import interop as tinterop  # noqa: E402


def _perturbed(layer, scale: float):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(scale * torch.randn_like(p))
    return layer


def _load_both(cls: str, kwargs: dict, fla_sd: dict):
    ours = getattr(tlayers, cls)(**kwargs)
    ours.load_state_dict(fla_sd, strict=True)
    assert set(ours.state_dict()) == set(fla_sd)
    jl = getattr(jlayers, cls)(**kwargs, rngs=nnx.Rngs(0))
    jinterop.from_state_dict(jl, tinterop.to_numpy(fla_sd), strict=True)
    return ours, jl


def _patch_rwkv7(monkeypatch, fr):
    from fla.modules.token_shift import token_shift_ref
    from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
    from fla.ops.rwkv7.fused_k_update import k_update_ref
    from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref

    from fla_torch.ops import chunk_rwkv7

    def op(r, w, k, v, a=None, b=None, kk=None, scale=1.0, initial_state=None,
           output_final_state=False, cu_seqlens=None, **_):
        if kk is not None:      # fused_mul_recurrent_rwkv7(r, w, k, v, kk, a): a = -kk, b = kk a
            a, b = -kk, kk * a
        return chunk_rwkv7(r, w, k, v, a, b, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           impl="reference")

    monkeypatch.setattr(fr, "token_shift", lambda x, cu_seqlens, output_cache, cache:
                        (token_shift_ref(x, cu_seqlens), x[:, -1]))
    monkeypatch.setattr(fr, "fused_addcmul_rwkv7", torch_addcmul_rwkv7)
    monkeypatch.setattr(fr, "fused_k_rwkv7", k_update_ref)
    monkeypatch.setattr(fr, "gate_output_correction", gate_output_correction_ref)
    monkeypatch.setattr(fr, "chunk_rwkv7", op)
    monkeypatch.setattr(fr, "fused_mul_recurrent_rwkv7", op)


RWKV7_CASES = {
    "layer0": dict(hidden_size=32, head_dim=8, layer_idx=0, num_hidden_layers=3, value_dim=48),
    "layer2": dict(hidden_size=32, head_dim=16, layer_idx=2, num_hidden_layers=3),
}


@pytest.mark.parametrize("name", list(RWKV7_CASES))
def test_fla_rwkv7_state_dict_and_forward(name, monkeypatch):
    fr = fla_layer_module("rwkv7")
    kwargs = RWKV7_CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        fla_layer = _perturbed(fr.RWKV7Attention(**kwargs), 0.2).double()
    fla_sd = {k: v.float() for k, v in fla_layer.state_dict().items()}
    ours, jl = _load_both("RWKV7Attention", kwargs, fla_sd)
    _patch_rwkv7(monkeypatch, fr)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 20, 32))
    vf = rng.standard_normal((2, 20, ours.value_dim))
    with torch.no_grad():
        ref = fla_layer(torch.tensor(x), v_first=torch.tensor(vf))
        got = ours.double()(torch.tensor(x), v_first=torch.tensor(vf))
    assert len(ref) == len(got) == 4
    for i in (0, 3):            # o and v_first
        err = rel_rms(got[i].numpy(), ref[i].numpy(), ref[i].numpy())
        assert err <= 1e-12, f"output {i}: {err:.2e}"
    oj = jl(jnp.asarray(x, jnp.float32), v_first=jnp.asarray(vf, jnp.float32))[0]
    err = rel_rms(np.asarray(oj, np.float64), ref[0].numpy(), ref[0].numpy())
    assert err <= LAYER_TOLERANCE["fp32"]["o"] * CROSS_FACTOR, f"flax: {err:.2e}"


def _patch_kda(monkeypatch, fk):
    import torch.nn.functional as F

    from fla_torch.modules import FusedRMSNormGated, ShortConvolution
    from fla_torch.ops import chunk_kda

    def op(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
           output_final_state=False, allow_neg_eigval=False, lower_bound=None,
           cu_seqlens=None, **_):
        g = g + dt_bias.view(g.shape[-2:])
        A = A_log.exp()[:, None]
        g = lower_bound * torch.sigmoid(A * g) if lower_bound is not None else -A * F.softplus(g)
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
        return chunk_kda(q, k, v, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                         use_qk_l2norm_in_kernel=True, impl="reference")

    monkeypatch.setattr(fk, "chunk_kda", op)
    monkeypatch.setattr(fk, "fused_recurrent_kda", op)
    monkeypatch.setattr(fk, "ShortConvolution", lambda hidden_size, kernel_size, bias, activation:
                        ShortConvolution(hidden_size, kernel_size, bias=bias,
                                         activation=activation))
    monkeypatch.setattr(fk, "FusedRMSNormGated", lambda hidden_size, activation, eps:
                        FusedRMSNormGated(hidden_size, activation=activation, eps=eps))


KDA_CASES = {
    "gva": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5),
    "bound": dict(hidden_size=32, head_dim=8, num_heads=4, safe_gate=True, lower_bound=-3.0,
                  allow_neg_eigval=True, conv_bias=True),
}


@pytest.mark.parametrize("name", list(KDA_CASES))
def test_fla_kda_state_dict_and_forward(name, monkeypatch):
    fk = fla_layer_module("kda")
    kwargs = KDA_CASES[name]
    _patch_kda(monkeypatch, fk)
    torch.manual_seed(0)
    fla_layer = _perturbed(fk.KimiDeltaAttention(**kwargs), 0.1).double()
    fla_sd = {k: v.float() for k, v in fla_layer.state_dict().items()}
    ours, jl = _load_both("KimiDeltaAttention", kwargs, fla_sd)
    x = np.random.default_rng(0).standard_normal((2, 20, 32))
    with torch.no_grad():
        ref = fla_layer(torch.tensor(x))[0].numpy()
        got = ours.double()(torch.tensor(x))[0].numpy()
    # our gates are computed in float32 (the contract) where FLA's float64 layer keeps float64
    assert rel_rms(got, ref, ref) <= LAYER_TOLERANCE["fp32"]["o"]
    oj = np.asarray(jl(jnp.asarray(x, jnp.float32))[0], np.float64)
    assert rel_rms(oj, ref, ref) <= LAYER_TOLERANCE["fp32"]["o"] * CROSS_FACTOR
