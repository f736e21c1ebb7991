"""GatedSlotAttention (torch): FLA's state_dict loads strict and gives FLA's outputs, and the
decode cache (a prefill then token-by-token steps) equals one forward over the sequence.

FLA's layer runs here with its Triton-only pieces swapped for plain torch (its naive recurrent
GSA, an RMSNorm + linear, silu for its swish feature map): what is compared is the wiring
(parameter names and shapes, heads, feature maps, slot gate, norm), not FLA's kernels. Skipped
when FLA is not importable (PYTHONPATH=$PWD:/tmp/fla:/tmp/fake_fa).
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from fla_torch.layers import GatedSlotAttention

from .fla_reference import fla_layer_module

CONFIGS = [dict(hidden_size=64, num_heads=4),
           dict(hidden_size=64, num_heads=4, num_kv_heads=2, num_slots=12, expand_k=0.5),
           dict(hidden_size=64, num_heads=2, feature_map="relu", use_short_conv=True)]


def _fla_layer_module():
    fg = fla_layer_module("gsa")
    try:
        from fla.ops.gsa.naive import naive_recurrent_gsa
    except ImportError as e:
        pytest.skip(f"optional comparison against FLA itself: its naive GSA does not import "
                    f"here ({e})")

    def op(q, k, v, s, g, initial_state=None, output_final_state=False, scale=None,
           cu_seqlens=None):
        return naive_recurrent_gsa(q, k, v, s, g, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state)

    def rms_norm_linear(x, w, b, lw, lb, eps=1e-5):
        x = x.float()
        return F.linear((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w).to(lw.dtype),
                        lw, lb)

    return fg, op, rms_norm_linear


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "gqa_slots12", "relu_conv"])
def test_fla_state_dict_and_outputs(cfg, monkeypatch):
    fg, op, rms_norm_linear = _fla_layer_module()
    monkeypatch.setattr(fg, "chunk_gsa", op)
    monkeypatch.setattr(fg, "fused_recurrent_gsa", op)
    monkeypatch.setattr(fg, "rms_norm_linear", rms_norm_linear)
    torch.manual_seed(0)
    ref = fg.GatedSlotAttention(layer_idx=0, **cfg).double()
    for p in ref.parameters():
        p.data.normal_(0, 0.2)
    if cfg.get("feature_map", "swish") == "swish":
        ref.feature_map = torch.nn.SiLU()    # FLA's swish is a Triton kernel
    if cfg.get("use_short_conv"):
        pytest.importorskip("causal_conv1d", reason="FLA's ShortConvolution needs a GPU kernel")
    ours = GatedSlotAttention(layer_idx=0, **cfg).double()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 100, 64, dtype=torch.float64)
    a, b = ref(x)[0], ours(x)[0]
    # FLA's naive op computes in float32
    assert (a - b).abs().max().item() < 1e-5 * a.abs().max().item() + 1e-6


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "gqa_slots12", "relu_conv"])
def test_decode_cache_matches_full_forward(cfg):
    torch.manual_seed(1)
    layer = GatedSlotAttention(layer_idx=0, **cfg)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(2, 70, 64)
    full = layer(x)[0]
    o, _, cache = layer(x[:, :66], use_cache=True)
    hk, hv = cache["recurrent_state"]
    H = cfg["num_heads"]
    assert hk.dtype == hv.dtype == torch.float32 and hk.shape[:2] == hv.shape[:2] == (2, H)
    outs = [o]
    for t in range(66, 70):
        o, _, cache = layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "gqa_slots12", "relu_conv"])
def test_flax_layer_matches_torch_and_decodes(cfg):
    """The torch layer's weights (fla_torch.interop -> fla_jax.interop, strict) give the Flax
    layer the torch layer's outputs; the Flax decode cache equals its full forward."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from fla_jax.interop import from_state_dict
    from fla_jax.layers import GatedSlotAttention as FlaxGSA
    from fla_torch.interop import to_numpy

    torch.manual_seed(2)
    layer = GatedSlotAttention(layer_idx=0, **cfg)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    flax_layer = FlaxGSA(layer_idx=0, **cfg, rngs=nnx.Rngs(0))
    from_state_dict(flax_layer, to_numpy(layer), strict=True)
    x = torch.randn(2, 70, 64)
    want = layer(x)[0].detach().numpy()
    xj = jnp.asarray(x.numpy())
    got = np.asarray(flax_layer(xj)[0])
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    o, _, cache = flax_layer(xj[:, :66], use_cache=True)
    outs = [np.asarray(o)]
    for t in range(66, 70):
        o, _, cache = flax_layer(xj[:, t:t + 1], past_key_values=cache, use_cache=True)
        outs.append(np.asarray(o))
    assert np.abs(np.concatenate(outs, 1) - got).max() < 1e-4 * np.abs(got).max()
