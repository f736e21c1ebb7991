"""FLA's layer-dependent initial values of RWKV7Attention, computed once in numpy for both
frameworks (fla_torch.layers.RWKV7Attention.init_rwkv7 and its fla_jax mirror).

With r0 = layer_idx / (L - 1) and r1 = 1 - layer_idx / L (L = num_hidden_layers), channel n of
D = hidden_size, ddd_n = n / D, lin_n = n / (D - 1) - 1/2, zig_n the signed square of the
position within the head in [-1, 1]:
    x_r = 1 - ddd^(0.2 r1), x_w = 1 - ddd^(0.9 r1), x_k = x_v = 1 - ddd^(0.7 r1),
    x_a = 1 - ddd^(0.9 r1), x_g = 1 - ddd^(0.2 r1); k_a = 1.02; r_k = -0.04;
    k_k = 0.71 - 0.1 lin; w_lora bias = -6 + 6 (n / (D - 1))^(1 + r0^0.3) + 0.5 + 2.5 zig;
    a_lora bias = -0.19 + 0.3 zig + 0.4 lin; v_lora bias = 0.73 - 0.4 lin (over value_dim);
    g_norm weight = ((layer_idx + 1) / L)^0.7.
"""
from __future__ import annotations

import numpy as np


def rwkv7_init_values(hidden_size: int, value_dim: int, head_dim: int, layer_idx: int,
                      num_hidden_layers: int) -> dict:
    """{name: float32 array} of the values above (x_* [D], k_k, k_a [D], r_k [D] to be
    reshaped [H, K], w_bias, a_bias [D], v_bias [value_dim], g_norm: a float)."""
    D, L = hidden_size, num_hidden_layers
    r0 = layer_idx / max(L - 1, 1)
    r1 = 1.0 - layer_idx / L
    n = np.arange(D, dtype=np.float64)
    ddd = n / D
    lin = n / max(D - 1, 1) - 0.5
    half = max((head_dim - 1) / 2, 1e-12)
    zig = ((n % head_dim) - (head_dim - 1) / 2) / half
    zig = zig * np.abs(zig)
    www = -6 + 6 * (n / max(D - 1, 1)) ** (1 + r0 ** 0.3)
    nv = np.arange(value_dim, dtype=np.float64)
    lin_v = nv / max(value_dim - 1, 1) - 0.5
    out = {
        "x_r": 1.0 - ddd ** (0.2 * r1), "x_w": 1.0 - ddd ** (0.9 * r1),
        "x_k": 1.0 - ddd ** (0.7 * r1), "x_v": 1.0 - ddd ** (0.7 * r1),
        "x_a": 1.0 - ddd ** (0.9 * r1), "x_g": 1.0 - ddd ** (0.2 * r1),
        "k_k": 0.71 - lin * 0.1, "k_a": np.full(D, 1.02), "r_k": np.full(D, -0.04),
        "w_bias": www + 0.5 + zig * 2.5, "a_bias": -0.19 + zig * 0.3 + lin * 0.4,
        "v_bias": 0.73 - lin_v * 0.4,
    }
    out = {k: v.astype(np.float32) for k, v in out.items()}
    out["g_norm"] = float(((layer_idx + 1) / L) ** 0.7)
    return out
