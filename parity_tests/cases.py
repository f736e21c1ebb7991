"""Parity cases, input generation (numpy float64, seeded) and THE tolerance table.

Everything both frameworks are fed comes from `make_inputs`: one draw in float64, then each
framework casts the same values to the dtype under test. The float64 oracle is fed the values
after that rounding, so a measured error is the implementation's, not the input quantisation's.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import numpy as np

from fla_contract.op_spec import (ACTIVATION, BETA, GAMMA, GATE, GATE_K, GATE_SLOT, OPS, STATE,
                                  VECTOR_K, OpSpec)

DTYPES = ("bf16", "fp16", "fp32")
TENSORS = ("o", "ht", "hkt", "hvt", "dq", "dr", "dk", "dv", "ds", "dg", "dw", "dbeta", "da", "db",
           "dh0", "dhk0", "dhv0")

# RMS(a - b) / RMS(ref), per dtype and tensor kind: an implementation against the float64
# oracle. fp32 is held to fp32 rounding; bf16/fp16 to a few output-rounding units.
# Two implementations against each other (e.g. JAX vs torch) get CROSS_FACTOR times this.
TOLERANCE = {
    "fp32": {"o": 1e-5, "ht": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5, "dg": 2e-5,
             "dbeta": 2e-5, "dh0": 1e-5},
    "fp16": {"o": 2e-3, "ht": 2e-3, "dq": 3e-3, "dk": 3e-3, "dv": 3e-3, "dg": 5e-3,
             "dbeta": 5e-3, "dh0": 3e-3},
    "bf16": {"o": 1e-2, "ht": 1e-2, "dq": 1.5e-2, "dk": 1.5e-2, "dv": 1.5e-2, "dg": 2.5e-2,
             "dbeta": 2.5e-2, "dh0": 1.5e-2},
}
# RWKV-7's names for the same kinds: r is the query, w the per-key log-decay, a and b
# enter the transition like beta does.
for _t in TOLERANCE.values():
    _t.update(dr=_t["dq"], dw=_t["dg"], da=_t["dbeta"], db=_t["dbeta"])
# GSA's: s (the slots' write weights) is an activation like v, and its state is the pair
# (hk, hv) of the same kind as h.
for _t in TOLERANCE.values():
    _t.update(hkt=_t["ht"], hvt=_t["ht"], ds=_t["dv"], dhk0=_t["dh0"], dhv0=_t["dh0"])
# fp64: a float64 implementation (impl='chunked') against the float64 oracle: equal up to
# float64 rounding, so the chunked path can stand in for the token loop as the GPU's oracle.
TOLERANCE["fp64"] = {t: 1e-9 for t in TOLERANCE["fp32"]}
CROSS_FACTOR = 2.0

# Whole layers (parity_tests/test_layers.py): projections, convs, norms and the op, each
# rounding to the compute dtype, so a layer output carries several roundings where an op
# output carries one. 'o' = layer output, 'grad' = input and parameter gradients; against the
# float64 oracle, and CROSS_FACTOR times this for fla_jax against fla_torch.
LAYER_TOLERANCE = {
    "fp32": {"o": 2e-5, "grad": 5e-5},
    "fp16": {"o": 3e-3, "grad": 5e-3},
    "bf16": {"o": 2e-2, "grad": 4e-2},
}


def interpreted_dtypes(i: int, dtypes=("fp32", "bf16", "fp16")) -> tuple:
    """The dtypes of a kernel file's i-th case: every one of `dtypes` on a GPU run
    (PARITY_DEVICE=cuda: the compiled kernels, whose bf16 and fp16 builds differ); interpreted on
    CPU, fp32 and ONE 16-bit dtype, bf16 for even i and fp16 for odd i, so a file's cases still
    run both. An interpreted kernel runs the same program text in bf16 and fp16 (only the
    element type and its rounding differ), and its second 16-bit run was a third of the CI time
    of those files. A case given only 16-bit dtypes keeps one of them."""
    if os.environ.get("PARITY_DEVICE", "cpu") == "cuda" or not {"bf16", "fp16"} <= set(dtypes):
        return tuple(dtypes)
    drop = "fp16" if i % 2 == 0 else "bf16"
    return tuple(d for d in dtypes if d != drop)


def tolerance(dtype: str, tensor: str, cross: bool = False) -> float:
    if tensor not in TOLERANCE[dtype]:
        raise KeyError(f"no tolerance for {tensor!r} ({dtype}): add it to TOLERANCE in "
                       f"parity_tests/cases.py")
    return TOLERANCE[dtype][tensor] * (CROSS_FACTOR if cross else 1.0)


def rel_rms(a: np.ndarray, b: np.ndarray, ref: np.ndarray) -> float:
    """RMS(a - b) / RMS(ref); NaN/inf anywhere -> inf (never passes)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    ref = np.asarray(ref, np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch {a.shape} vs {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    denom = np.sqrt(np.mean(ref ** 2)) if ref.size else 0.0
    num = np.sqrt(np.mean((a - b) ** 2)) if a.size else 0.0
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / denom)


# every linear-attention family of fla_contract.op_spec.OPS (ops with a recurrent state); the
# delta-rule-like ones take beta. Softmax attention ("attention") has cases of its own.
FAMILIES = tuple(dict.fromkeys(spec.family for spec in OPS.values() if spec.has_state))
BETA_FAMILIES = tuple(f for f in FAMILIES if OPS[f"chunk_{f}"].of_role(BETA))


def family_spec(family: str) -> OpSpec:
    """The OpSpec whose inputs a family's ops share: chunk_<family>, or the family's only op."""
    return OPS.get(f"chunk_{family}") or next(s for s in OPS.values() if s.family == family)


@dataclass(frozen=True)
class Case:
    name: str
    B: int = 2
    T: int = 100
    H: int = 2
    HV: int = 2
    K: int = 32
    V: int = 32
    M: int = 32                  # gsa: memory slots
    cu_seqlens: tuple | None = None
    strength: float = 1.0        # per-token log-decay magnitude
    floor: float = 0.05          # g drawn in -strength * [floor, 1]
    h0: bool = True
    gate_mode: str = "g"         # simple_gla: 'g' | 'gamma' | 'both' | 'none'
    l2norm: bool = False
    beta_max: float = 1.0        # beta drawn in beta_max * (beta_lo, beta_hi)
    beta_lo: float = 0.02
    beta_hi: float = 0.98
    beta_edges: bool = False     # beta near 0 (1e-4) and near beta_max (beta_max - 1e-4) only
    families: tuple = FAMILIES
    dtypes: tuple = ("bf16", "fp16", "fp32")
    causal: bool = True          # attention: causal mask
    window: object = None        # attention: window_size (int or (left, right))
    scale: float | None = None   # the op's scale; None: K ** -0.5

    def applies_to(self, spec: OpSpec) -> bool:
        if spec.family not in self.families:
            return False
        if self.HV != self.H and not (spec.grouped_heads or spec.grouped_query):
            return False
        return True


_ALL = FAMILIES
_DELTA = BETA_FAMILIES

# Small shapes for CPU (CI): T not a multiple of 64, K != V, varlen with sequences shorter
# than a chunk (one empty), initial states, weak to strong gates (down to -20 per token),
# GQA + l2norm + beta in (0, 2) for the delta family. The two base cases run in all three
# dtypes; the feature cases in fp32 (tightest check) and bf16 (the training dtype).
_FEATURE = ("fp32", "bf16")
CPU_CASES = (
    Case("basic", B=2, T=100, strength=1.0, families=_ALL),
    Case("varlen", B=1, T=300, cu_seqlens=(0, 15, 100, 300), strength=0.5, families=_ALL),
    Case("t63_kv_weak", B=1, T=63, K=32, V=48, h0=False, strength=0.01, families=_ALL,
         dtypes=_FEATURE),
    Case("short_strong", B=1, T=70, cu_seqlens=(0, 5, 20, 20, 70), strength=20.0, families=_ALL,
         dtypes=("fp32", "bf16", "fp16")),   # fp16: decayed operands must not underflow
    # every gate in [-20, -10]: each dg term is decayed except O(1) ones that a careless sum
    # forms and cancels (fp32 dg errors 1e-3..8e-3 in three of the four chunk kernels)
    Case("uniform_strong", B=1, T=150, cu_seqlens=(0, 60, 150), strength=20.0, floor=0.5,
         families=_ALL, dtypes=_FEATURE),
    Case("gamma", B=1, T=100, gate_mode="gamma", families=("simple_gla",), dtypes=_FEATURE),
    Case("both_gates", B=1, T=100, gate_mode="both", families=("simple_gla",), dtypes=("fp32",)),
    Case("no_gate", B=1, T=100, gate_mode="none", strength=0.0, families=("simple_gla", "gsa"),
         dtypes=_FEATURE),
    Case("gqa_l2_beta2", B=1, T=100, H=2, HV=4, l2norm=True, beta_max=2.0, families=_DELTA,
         dtypes=_FEATURE),
    Case("beta_edges", B=1, T=100, strength=3.0, beta_edges=True, families=_DELTA,
         dtypes=_FEATURE),
    # GSA: 4 query heads over 2 key/value heads, M slots != K != V
    Case("gsa_gqa", B=1, T=100, H=2, HV=4, K=32, V=48, M=24, families=("gsa",),
         dtypes=_FEATURE),
)

# Softmax attention (op 'attention'): HV query heads over H key/value heads, K != V, packed
# sequences with an empty one, a causal sliding window and a two-sided one, T not a multiple
# of 64.
_ATTN = ("attention",)
CPU_CASES += (
    Case("attn_basic", B=2, T=100, families=_ATTN),
    Case("attn_gqa", B=1, T=70, H=2, HV=4, K=32, V=48, families=_ATTN, dtypes=_FEATURE),
    Case("attn_varlen", B=1, T=150, cu_seqlens=(0, 15, 15, 100, 150), H=2, HV=4,
         families=_ATTN),
    Case("attn_window", B=2, T=100, window=16, families=_ATTN, dtypes=_FEATURE),
    Case("attn_window_lr", B=1, T=63, causal=False, window=(8, 4), families=_ATTN,
         dtypes=_FEATURE),
)

# Realistic shapes for a GPU run.
GPU_CASES = (
    Case("gpu_4k", B=2, T=4096, H=4, HV=4, K=128, V=128, strength=0.5, families=_ALL),
    Case("gpu_varlen", B=1, T=2000, H=4, HV=4, K=128, V=128,
         cu_seqlens=(0, 15, 100, 300, 1200, 2000), families=_ALL),
    Case("gpu_gqa", B=1, T=1000, H=4, HV=8, K=128, V=128, l2norm=True, families=_DELTA),
    Case("gpu_d100", B=1, T=1000, H=2, HV=2, K=100, V=100, families=_ALL),
    # robustness (issue 4 point 3): per-token gates down to -20 with beta at its edges, and a
    # 16k-token sequence in the half-precision dtypes (fp16 overflow / underflow of decays)
    Case("gpu_strong_edges", B=1, T=2048, H=2, HV=2, K=128, V=128, strength=20.0,
         beta_edges=True, families=_ALL),
    Case("gpu_strong_uniform", B=1, T=1024, H=2, HV=2, K=128, V=128, strength=20.0, floor=0.5,
         families=_ALL),
    Case("gpu_t16k", B=1, T=16384, H=2, HV=2, K=128, V=128, strength=1.0, families=_ALL,
         dtypes=("fp16", "bf16")),
    # head sizes 64 and 256 with varlen (issue 11: the Mosaic kernels take K, V of 64..256; the
    # Triton / Pallas kernels too), for the families with Mosaic kernels and GLA
    Case("gpu_k64_v256", B=1, T=1500, H=2, HV=2, K=64, V=256, strength=1.0,
         cu_seqlens=(0, 60, 700, 1500), families=("simple_gla", "gla", "delta_rule",
                                                   "gated_delta_rule")),
    Case("gpu_k256_v64", B=2, T=1000, H=2, HV=2, K=256, V=64, strength=1.0,
         families=("simple_gla", "gla", "delta_rule", "gated_delta_rule")),
    Case("gpu_attn_4k", B=1, T=4096, H=4, HV=4, K=128, V=128, families=_ATTN),
    Case("gpu_attn_varlen", B=1, T=2000, H=4, HV=4, K=128, V=128,
         cu_seqlens=(0, 15, 100, 300, 1200, 2000), families=_ATTN),
    Case("gpu_attn_gqa", B=1, T=1000, H=2, HV=8, K=128, V=128, families=_ATTN),
    Case("gpu_attn_window", B=1, T=2048, H=4, HV=4, K=128, V=128, window=256, families=_ATTN),
)

# Kernel-only GLA cases of parity_tests/test_triton_gla.py (head sizes 16..256, varlen with
# empty / sub-chunk sequences, gates to -20 over several chunks); not part of the CLI's sets.
GLA_KERNEL_CASES = (
    Case("tgla_varlen_short", B=1, T=150, cu_seqlens=(0, 5, 20, 20, 83, 150), strength=1.0,
         families=("gla",)),
    Case("tgla_k100", B=1, T=80, H=1, HV=1, K=100, V=100, strength=1.0, families=("gla",)),
    Case("tgla_k256", B=1, T=70, H=1, HV=1, K=256, V=256, cu_seqlens=(0, 64, 70),
         strength=1.0, families=("gla",)),
    Case("tgla_k16_v256", B=1, T=40, H=1, HV=1, K=16, V=256, h0=False, strength=1.0,
         families=("gla",)),
    Case("tgla_k256_v48", B=1, T=40, H=1, HV=1, K=256, V=48, strength=1.0, families=("gla",)),
    Case("tgla_strong_long", B=1, T=200, H=1, HV=1, cu_seqlens=(0, 130, 200), strength=20.0,
         floor=0.5, families=("gla",)),
)
# Pallas GLA kernels (test_pallas_gla.py): varlen with an empty first sequence and sub-chunk
# ones, no h0 with K > V, K = V = 256, K = 100 / V = 48 and K = 16 / V = 100 (not powers of
# two), per-channel gates to -20 (all in [-20, -10] over several chunks), weak gates (0.01)
_GLA = ("gla",)
GLA_KERNEL_CASES += (
    Case("pgla_varlen_empty_sub", B=1, T=150, cu_seqlens=(0, 0, 10, 40, 150), strength=1.0,
         families=_GLA),
    Case("pgla_sub_chunk_only", B=1, T=30, cu_seqlens=(0, 7, 7, 23, 30), strength=2.0,
         families=_GLA),
    Case("pgla_no_h0_k48_v32", B=2, T=80, K=48, V=32, h0=False, families=_GLA),
    Case("pgla_kv256", B=1, T=40, H=1, HV=1, K=256, V=256, families=_GLA),
    Case("pgla_k100_v48", B=1, T=70, H=1, HV=1, K=100, V=48, cu_seqlens=(0, 64, 70),
         families=_GLA),
    Case("pgla_k16_v100", B=1, T=50, H=1, HV=1, K=16, V=100, families=_GLA),
    # K, V in (128, 192]: the padded state tiles past cdiv(K, 64) blocks (once left unwritten)
    Case("pgla_k160_v144", B=1, T=40, H=1, HV=1, K=160, V=144, families=_GLA),
    Case("pgla_strong_channels", B=1, T=130, cu_seqlens=(0, 50, 130), strength=20.0,
         families=_GLA),
    Case("pgla_uniform_strong_long", B=1, T=256, cu_seqlens=(0, 60, 256), strength=20.0,
         floor=0.5, families=_GLA),
    Case("pgla_weak", B=1, T=100, strength=0.01, families=_GLA),
)

# output_final_state=False (harness.check_no_final_state) for the GLA kernels of both
# frameworks: varlen with an empty sequence, an explicit scale, K != V
GLA_KERNEL_CASES += (
    Case("gla_no_final_state", B=1, T=70, K=32, V=16, cu_seqlens=(0, 20, 20, 70), scale=0.3,
         floor=0.0, families=("gla",)),
)

# Kernel-only DPLR cases (KDA, RWKV-7) of parity_tests/test_triton_recurrent_dplr.py: varlen
# with an empty and a short sequence and one crossing a state checkpoint (64 tokens), no h0
# with K != V, per-channel gates in [-20, -1], K = V = 256.
_DPLR = ("kda", "rwkv7")
DPLR_KERNEL_CASES = (
    Case("dplr_varlen_kv", B=1, T=100, H=1, HV=1, K=16, V=48, cu_seqlens=(0, 5, 20, 20, 100),
         h0=False, strength=1.0, families=_DPLR),
    Case("dplr_strong", B=1, T=100, H=1, HV=1, cu_seqlens=(0, 75, 100), strength=20.0,
         floor=0.05, families=_DPLR),
    Case("dplr_k256", B=1, T=8, H=1, HV=1, K=256, V=256, cu_seqlens=(0, 3, 8), strength=1.0,
         families=_DPLR),
    # token-by-token calls chained through the final state (gates in [-20, 0])
    Case("dplr_decode", B=1, T=5, H=2, HV=2, K=16, V=32, strength=20.0, floor=0.0,
         l2norm=True, families=_DPLR),
    # output_final_state=False, no initial state, per-channel gates in [-20, 0]
    Case("dplr_no_final_state", B=1, T=70, H=1, HV=1, K=16, V=16, h0=False, strength=20.0,
         floor=0.0, families=_DPLR),
)

# Pallas DPLR kernels (test_pallas_dplr.py: chunk_kda / chunk_rwkv7 on the engine;
# test_pallas_recurrent_dplr.py: the fused_recurrent driver): grouped value heads with l2norm,
# varlen with an empty first sequence, short ones and ones spanning two 64-token checkpoints,
# K = 48 / V = 24 (not powers of two), K = V = 256 on few tokens, gates to -20 (all in
# [-20, -10] over two chunks), no initial state with K != V.
PALLAS_DPLR_CASES = (
    Case("pdplr_kda_gqa_l2_varlen", B=1, T=90, H=1, HV=2, K=48, V=24, l2norm=True,
         cu_seqlens=(0, 0, 10, 90), strength=20.0, families=("kda",)),
    Case("pdplr_kda_basic", B=2, T=40, K=32, V=32, families=("kda",)),
    Case("pdplr_rwkv7_uniform_strong", B=1, T=100, K=32, V=32, cu_seqlens=(0, 70, 100),
         strength=20.0, floor=0.5, families=("rwkv7",)),
    Case("pdplr_rwkv7_no_h0", B=2, T=40, K=32, V=16, h0=False, families=("rwkv7",)),
    Case("pdplr_varlen_empty_short", B=1, T=150, cu_seqlens=(0, 0, 5, 70, 150), strength=1.0,
         families=_DPLR),
    Case("pdplr_strong", B=1, T=100, cu_seqlens=(0, 30, 100), strength=20.0, families=_DPLR),
    Case("pdplr_no_h0_k48_v32", B=2, T=40, K=48, V=32, h0=False, families=_DPLR),
    Case("pdplr_kv256", B=1, T=12, H=1, HV=1, K=256, V=256, families=_DPLR),
    Case("pdplr_no_final_state", B=1, T=80, cu_seqlens=(0, 10, 10, 80), families=_DPLR),
)

# Pallas chunk_kda on the delta-rule stages (test_pallas_kda.py): every gate exactly -20 per
# token and channel (the per-pair diagonal sub-blocks, exp(b) far below fp16's range) over
# varlen sequences crossing chunks, grouped value heads with l2norm, varlen with an empty first
# sequence, K = 48 / V = 24, no initial state with K != V, K = V = 256 on few tokens.
PALLAS_KDA_CASES = (
    Case("pkda_all_minus20_varlen", B=1, T=150, H=1, HV=1, K=32, V=32,
         cu_seqlens=(0, 30, 150), strength=20.0, floor=1.0, families=("kda",)),
    Case("pkda_gqa_l2_varlen", B=1, T=90, H=1, HV=2, K=48, V=24, l2norm=True,
         cu_seqlens=(0, 0, 10, 90), strength=20.0, families=("kda",)),
    Case("pkda_no_h0_k48_v32", B=2, T=70, K=48, V=32, h0=False, strength=3.0,
         families=("kda",)),
    Case("pkda_kv256", B=1, T=20, H=1, HV=1, K=256, V=256, families=("kda",)),
    Case("pkda_k144_v160", B=1, T=20, H=1, HV=1, K=144, V=160, families=("kda",)),
)

# Kernel-only GSA cases of parity_tests/test_gsa_kernels.py (small: interpreted kernels of both
# frameworks): varlen with an empty sequence and no initial state, GQA with M != K != V and a
# non-power-of-two M, no g (FLA's additive gate from the slot logits), slot gates of -20.
GSA_KERNEL_CASES = (
    Case("tgsa_varlen_gqa", B=1, T=70, H=1, HV=2, K=16, V=32, M=24, cu_seqlens=(0, 5, 5, 70),
         h0=False, strength=1.0, families=("gsa",)),
    Case("tgsa_no_gate", B=1, T=40, H=1, HV=1, K=16, V=16, M=16, gate_mode="none",
         strength=0.0, families=("gsa",)),
    Case("tgsa_strong", B=1, T=80, H=1, HV=1, K=16, V=16, M=16, cu_seqlens=(0, 70, 80),
         strength=20.0, floor=0.5, families=("gsa",)),
)

# Kernel-only simple-GLA cases of parity_tests/test_triton_simple_gla.py and
# test_pallas_simple_gla.py: varlen with empty and sub-chunk sequences, no initial state, K != V,
# head sizes 16..256 (100: not a power of two), g / g_gamma / both / neither, gates from weak to
# -20 per token (every gate in [-20, -10] over several chunks), an explicit scale; the sgla_rec_*
# ones are short for the interpreted token loops.
_SGLA = ("simple_gla",)
SIMPLE_GLA_KERNEL_CASES = (
    Case("sgla_varlen_short", B=1, T=70, cu_seqlens=(0, 5, 20, 20, 70), families=_SGLA),
    Case("sgla_varlen_both", B=1, T=90, cu_seqlens=(0, 7, 7, 70, 90), gate_mode="both",
         families=_SGLA),
    Case("sgla_varlen_b", B=1, T=90, cu_seqlens=(0, 5, 40, 40, 90), families=_SGLA),
    Case("sgla_strong", B=1, T=100, strength=10.0, families=_SGLA),
    Case("sgla_weak", B=1, T=100, strength=0.01, families=_SGLA),
    Case("sgla_b2_kv", B=2, T=50, K=32, V=48, strength=0.16, floor=0.01, families=_SGLA),
    Case("sgla_t150_both", B=1, T=150, H=1, HV=1, K=32, V=48, gate_mode="both", families=_SGLA),
    Case("sgla_t128", B=1, T=128, families=_SGLA),
    Case("sgla_gamma_no_h0", B=2, T=50, K=32, V=48, gate_mode="gamma", h0=False,
         families=_SGLA),
    Case("sgla_both_kv", B=2, T=50, K=32, V=48, gate_mode="both", families=_SGLA),
    Case("sgla_plain", B=2, T=50, K=16, V=16, gate_mode="none", strength=0.0, h0=False,
         families=_SGLA),
    Case("sgla_k100", B=1, T=80, H=1, HV=1, K=100, V=100, families=_SGLA),
    Case("sgla_k16_v256", B=1, T=70, H=1, HV=1, K=16, V=256, cu_seqlens=(0, 64, 70),
         families=_SGLA),
    Case("sgla_k256_v24", B=1, T=40, H=1, HV=1, K=256, V=24, gate_mode="both", families=_SGLA),
    Case("sgla_k256_v24_no_h0", B=1, T=40, H=1, HV=1, K=256, V=24, gate_mode="both", h0=False,
         families=_SGLA),
    Case("sgla_scale", B=2, T=100, scale=0.37, families=_SGLA),
    # fp32 dg under strong per-token gates: [-20, -1] (two sequences of 60 and 240 tokens) and
    # every gate in [-20, -10] (60 and 196 tokens)
    Case("sgla_strong_long", B=1, T=300, H=1, HV=1, cu_seqlens=(0, 60, 300), strength=20.0,
         families=_SGLA),
    Case("sgla_uniform_strong_long", B=1, T=256, H=1, HV=1, cu_seqlens=(0, 60, 256),
         strength=20.0, floor=0.5, families=_SGLA),
    Case("sgla_rec_kv", B=2, T=20, K=32, V=48, strength=0.16, floor=0.01, families=_SGLA),
    Case("sgla_rec_k100_v40", B=2, T=12, K=100, V=40, gate_mode="both", families=_SGLA),
    Case("sgla_rec_plain", B=2, T=12, K=16, V=16, gate_mode="none", strength=0.0, h0=False,
         families=_SGLA),
    Case("sgla_rec_varlen", B=1, T=24, cu_seqlens=(0, 3, 3, 24), gate_mode="both",
         families=_SGLA),
)

# Kernel-only delta-rule cases (delta_rule, gated_delta_rule) of parity_tests/test_triton_delta.py
# and test_pallas_delta.py: grouped value heads with K != V, head sizes 12..144 (wide: several K /
# V tiles), varlen with an empty and a 3-token sequence and sequences over several chunks, no
# initial state, beta in (0, 2) (negative eigenvalues), near 0 and near 1, gates from weak to
# -20 per token (fp32 dg under gates in [-20, -1] and [-20, -10] over several chunks; fp16 dh0
# with every gate in [-20, -10]). *_rec: short, for the interpreted token loops.
_DR = ("delta_rule", "gated_delta_rule")
_GDN = ("gated_delta_rule",)
DELTA_KERNEL_CASES = (
    Case("dr_gqa_kv", B=2, T=140, H=2, HV=4, K=32, V=24, strength=0.3, floor=0.0,
         beta_lo=0.05, beta_hi=1.0, families=_DR),
    Case("dr_gqa_kv_rec", B=2, T=37, H=2, HV=4, K=32, V=24, strength=0.3, floor=0.0,
         beta_lo=0.05, beta_hi=1.0, families=_DR),
    Case("dr_l2_beta2", B=2, T=100, K=16, V=32, l2norm=True, beta_max=2.0, strength=0.3,
         floor=0.0, families=_DR),
    Case("dr_l2_beta2_rec", B=2, T=41, K=16, V=32, l2norm=True, beta_max=2.0, strength=0.3,
         floor=0.0, families=_DR),
    Case("dr_gqa_no_l2", B=1, T=80, H=2, HV=4, K=16, V=16, strength=0.3, floor=0.0,
         families=_DR),
    Case("dr_varlen_l2", B=1, T=150, H=1, HV=2, K=32, V=16, cu_seqlens=(0, 7, 7, 80, 150),
         l2norm=True, beta_max=2.0, strength=0.3, floor=0.0, families=_DR),
    Case("dr_strong_tiny_beta", B=1, T=130, H=1, HV=1, K=16, V=16, h0=False, strength=20.0,
         floor=0.0, beta_lo=0.0, beta_hi=1e-3, families=_DR),
    Case("dr_k24_beta1", B=1, T=33, H=1, HV=2, K=24, V=16, l2norm=True, beta_lo=0.999,
         beta_hi=1.0, families=_DR),
    Case("dr_wide", B=1, T=70, H=1, HV=2, K=144, V=130, l2norm=True, beta_max=2.0, strength=0.3,
         floor=0.0, families=_DR),
    Case("dr_strong_long_beta1", B=1, T=300, H=1, HV=1, cu_seqlens=(0, 60, 300), strength=20.0,
         beta_lo=1 - 1e-4, beta_hi=1.0, families=_DR),
    Case("dr_uniform_strong_long", B=1, T=300, H=1, HV=1, cu_seqlens=(0, 60, 300),
         strength=20.0, floor=0.5, beta_lo=0.5, beta_hi=1.0, families=_DR),
    Case("dr_uniform_strong_k64", B=1, T=128, H=1, HV=1, K=64, V=64, strength=20.0, floor=0.5,
         l2norm=True, families=_DR),
    Case("dr_gqa_l2_no_h0", B=1, T=21, H=1, HV=2, K=32, V=16, h0=False, l2norm=True,
         strength=0.16, floor=0.01, beta_lo=0.05, beta_hi=0.95, families=_DR),
    Case("dr_varlen_small", B=1, T=40, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 7, 7, 25, 40),
         l2norm=True, strength=0.16, floor=0.01, beta_lo=0.05, beta_hi=0.95, families=_DR),
    Case("dr_neg_eig_strong", B=1, T=24, H=2, HV=2, K=16, V=64, l2norm=True, beta_max=2.0,
         strength=20.0, floor=0.0, families=_DR),
    Case("dr_multi_chunk_varlen", B=1, T=200, H=1, HV=2, K=16, V=32, cu_seqlens=(0, 3, 131, 200),
         l2norm=True, strength=3.0, floor=0.0, beta_lo=0.05 / 1.5, beta_hi=1.0, beta_max=1.5,
         families=_DR),
    Case("dr_odd_dims", B=1, T=17, H=1, HV=1, K=12, V=20, strength=0.16, floor=0.01,
         beta_lo=0.9, beta_hi=1.0, families=_DR),
    Case("dr_strong_multi_chunk", B=1, T=150, H=1, HV=1, K=16, V=16, cu_seqlens=(0, 128, 150),
         l2norm=True, beta_max=2.0, strength=20.0, floor=0.0, families=_GDN),
)

# Pallas Mosaic GPU kernels interpreted on the CPU (test_mosaic_lowering.py,
# test_mosaic_delta_lowering.py; bf16 / fp16, K = 64, V = 64 / 128): several chunks and a tail,
# varlen with an empty sequence and one ending mid-chunk, g / g_gamma / both, grouped value heads
# with l2norm and beta in (0, 2) under gates to -5, gates in [-20, -10].
MOSAIC_KERNEL_CASES = (
    Case("mos_sgla_g_h0_t150", B=1, T=150, H=1, HV=1, K=64, V=64, strength=0.16, floor=0.01,
         families=_SGLA),
    Case("mos_sgla_gamma_varlen", B=1, T=100, H=1, HV=1, K=64, V=128, gate_mode="gamma",
         cu_seqlens=(0, 7, 7, 70, 100), families=_SGLA),
    Case("mos_sgla_split", B=1, T=300, H=1, HV=1, K=64, V=64, gate_mode="both", families=_SGLA),
    # per-token gates in [-20, -10] (the H100 gpu_strong_* dg of the Mosaic backward: 1.6e-1,
    # 1.2e+3 in bf16 before its gate terms were summed in closed form)
    Case("mos_sgla_strong", B=1, T=150, H=1, HV=1, K=64, V=64, cu_seqlens=(0, 60, 150),
         strength=20.0, floor=0.5, families=_SGLA),
    Case("mos_dr_gqa_h0_t100", B=2, T=100, H=1, HV=2, K=64, V=64, strength=5.0, floor=0.0,
         beta_max=2.0, l2norm=True, families=_DR),
    # the sequence split (mosaic_pieces.py with pieces of >= 1 chunk): 4 pieces of 2, 2, 1, 0
    # (one head: the interpreter's time scales with the CTAs; GQA in the map pass's own test)
    Case("mos_dr_split", B=1, T=300, H=1, HV=1, K=64, V=64, strength=1.0, families=_DR),
    Case("mos_dr_varlen", B=1, T=140, H=1, HV=1, K=64, V=128, cu_seqlens=(0, 7, 7, 100, 140),
         strength=0.16, floor=0.01, beta_lo=0.05, beta_hi=0.95, families=_DR),
    # per-token gates in [-20, -10]: fp16 underflow of the gate factors (H100 gpu_strong_* fp16)
    Case("mos_dr_strong", B=1, T=150, H=1, HV=1, K=64, V=64, cu_seqlens=(0, 60, 150),
         strength=20.0, floor=0.5, families=_DR),
    # GLA (per-key gates): varlen with an empty sequence and a tail; gates in [-20, -10]
    Case("mos_gla_varlen", B=1, T=150, H=1, HV=1, K=64, V=128, cu_seqlens=(0, 7, 7, 100, 150),
         strength=1.0, families=("gla",)),
    Case("mos_gla_strong", B=1, T=150, H=1, HV=1, K=64, V=64, cu_seqlens=(0, 60, 150),
         strength=20.0, floor=0.5, families=("gla",)),
    # gates to -0.3 per token: every part bounded (the diagonal blocks on the tensor cores),
    # fp16 included (mosaic_intra_kernel.FAST_SPAN)
    Case("mos_gla_mild", B=1, T=150, H=1, HV=1, K=64, V=64, cu_seqlens=(0, 60, 150),
         strength=0.3, families=("gla",)),
)

# float64 cases of parity_tests/test_chunked_fp64_torch.py (impl='chunked' in fp64 against the
# fp64 oracle, TOLERANCE['fp64']): T = 1, 63, 64, 100, 130 in a padded batch, varlen with an
# empty sequence (also the last one), no initial state, gates from 0.01 to -15 per token,
# K != V both ways; each shape once for simple_gla / gla (H = HV) and once for the delta rules
# with grouped value heads (*_gqa: HV = 4). Gates -1.5 * gate * U(1/3, 1) per token.
_GLAS = ("simple_gla", "gla")
_F64 = ("fp64",)


def _fp64_pair(name, gate=1.0, **kw):
    kw = dict(strength=1.5 * gate, floor=1 / 3, dtypes=_F64, **kw)
    return (Case(f"f64_{name}", families=_GLAS, **kw),
            Case(f"f64_{name}_gqa", HV=4, families=_DR, **kw))


FP64_CASES = sum((
    _fp64_pair("T1", B=2, T=1, V=48), _fp64_pair("T63", B=2, T=63, V=48),
    _fp64_pair("T64", B=2, T=64, V=48), _fp64_pair("T100", B=2, T=100, V=48),
    _fp64_pair("T130", B=2, T=130, V=48),
    _fp64_pair("varlen", B=1, T=300, V=48, cu_seqlens=(0, 15, 100, 300)),
    _fp64_pair("varlen_empty", B=1, T=140, V=48, cu_seqlens=(0, 70, 70, 140, 140)),
    _fp64_pair("no_h0", B=2, T=100, V=48, h0=False),
    _fp64_pair("weak", B=1, T=130, V=48, gate=0.01),
    _fp64_pair("strong", B=1, T=130, V=48, gate=10.0),
    _fp64_pair("k48_v32", B=1, T=70, K=48, V=32),
    # packed for JAX (test_chunked_fp64_jax.py: each shape compiles once): sequences of 1, 63,
    # 100 and 130 tokens; an empty one with weak gates, l2norm, no h0; fixed-length T = 1
    # with g and g_gamma
    _fp64_pair("varlen_1_63_100_130_strong", B=1, T=294, V=48, cu_seqlens=(0, 1, 64, 164, 294),
               gate=10.0, beta_max=2.0),
    _fp64_pair("varlen_empty_weak_l2_no_h0", B=1, T=300, V=48, cu_seqlens=(0, 15, 15, 100, 300),
               gate=0.01, h0=False, l2norm=True),
    _fp64_pair("b2_t130_beta2_l2", B=2, T=130, V=48, beta_max=2.0, l2norm=True),
    _fp64_pair("b2_t1_both_gates", B=2, T=1, V=48, gate=0.5, gate_mode="both"),
), ()) + (
    Case("f64_gamma", B=1, T=100, V=48, gate_mode="gamma", strength=1.5, floor=1 / 3,
         families=_SGLA, dtypes=_F64),
    Case("f64_both_gates", B=1, T=100, V=48, gate_mode="both", strength=0.75, floor=1 / 3,
         families=_SGLA, dtypes=_F64),
    Case("f64_no_gate", B=1, T=100, V=48, gate_mode="none", strength=0.0, families=_SGLA,
         dtypes=_F64),
    Case("f64_strong_gamma", B=1, T=100, V=48, gate_mode="gamma", strength=15.0, floor=1 / 3,
         families=_SGLA, dtypes=_F64),
    Case("f64_l2norm", B=1, T=130, HV=4, V=48, l2norm=True, strength=1.5, floor=1 / 3,
         families=_DR, dtypes=_F64),
    Case("f64_beta2", B=1, T=130, HV=4, V=48, beta_max=2.0, strength=1.5, floor=1 / 3,
         families=_DR, dtypes=_F64),
    Case("f64_l2norm_beta2_varlen", B=1, T=300, HV=4, V=48, l2norm=True, beta_max=2.0,
         cu_seqlens=(0, 15, 100, 300), strength=1.5, floor=1 / 3, families=_DR, dtypes=_F64),
    Case("f64_mha", B=1, T=100, V=48, strength=1.5, floor=1 / 3, families=_DR, dtypes=_F64),
    Case("f64_gqa_h1", B=1, T=65, H=1, HV=3, V=48, strength=1.5, floor=1 / 3, families=_DR,
         dtypes=_F64),
    # the chunked paths with other chunk sizes (varlen with an empty sequence), and with gates
    # down to -19.5 in fp32 / bf16
    Case("f64_varlen_chunks", B=1, T=90, V=48, cu_seqlens=(0, 7, 40, 40, 90), strength=1.5,
         floor=1 / 3, families=_GLAS, dtypes=_F64),
    Case("f64_varlen_chunks_gqa", B=1, T=90, HV=4, V=48, cu_seqlens=(0, 7, 40, 40, 90),
         l2norm=True, strength=1.5, floor=1 / 3, families=_DR, dtypes=_F64),
    Case("chunked_strong13", B=1, T=130, V=48, strength=19.5, floor=1 / 3, families=_GLAS),
    Case("chunked_strong13_gqa", B=1, T=130, HV=4, V=48, strength=19.5, floor=1 / 3,
         families=_DR),
    # KDA / RWKV-7
    Case("f64_dplr_basic", B=2, T=100, V=48, families=_DPLR, dtypes=_F64),
    Case("f64_kda_varlen_strong_gqa_l2", B=1, T=90, H=1, HV=2, K=16, V=24,
         cu_seqlens=(0, 5, 20, 20, 90), strength=20.0, l2norm=True, families=("kda",),
         dtypes=_F64),
    Case("f64_rwkv7_varlen_strong", B=1, T=90, K=16, V=24, cu_seqlens=(0, 5, 20, 20, 90),
         strength=20.0, families=("rwkv7",), dtypes=_F64),
)

CASES = {c.name: c for c in (CPU_CASES + GPU_CASES + GLA_KERNEL_CASES + DPLR_KERNEL_CASES
                              + GSA_KERNEL_CASES + SIMPLE_GLA_KERNEL_CASES + DELTA_KERNEL_CASES
                              + MOSAIC_KERNEL_CASES + PALLAS_DPLR_CASES + PALLAS_KDA_CASES
                              + FP64_CASES)}


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def make_inputs(spec: OpSpec, case: Case, seed: int) -> dict:
    """float64 numpy inputs and cotangents for one op and case, keyed by ArgSpec.key
    ('q', 'g', 'h0', ...), then 'do' and one 'd' + ArgSpec.final_key per state part ('dht').
    Each tensor is drawn by its role, in the spec's argument order, from one generator."""
    rng = np.random.default_rng(seed)
    N = len(case.cu_seqlens) - 1 if case.cu_seqlens else case.B
    sizes = dict(B=case.B, T=case.T, H=case.H, HV=case.HV, K=case.K, V=case.V, N=N,
                 HQ=case.HV, HKV=case.H, S=case.T, M=case.M)
    x = {}
    for a in spec.args:
        if _present(a, case):
            x[a.key] = _draw(spec, a, case, rng, tuple(sizes[s] for s in a.shape))
    if "a" in x and "b" in x and spec.arg("a").role == VECTOR_K:
        # RWKV-7's layer: a = -kk, b = kk * sigmoid(.) with kk a unit key per head
        x["b"] = -x["a"] * rng.uniform(0.0, 1.0, x["a"].shape)
    x["do"] = rng.standard_normal((case.B, case.T, case.HV, case.V))
    for a in spec.of_role(STATE):   # one cotangent per final state part ('dht', 'dhkt', ...)
        x["d" + a.final_key] = 0.5 * rng.standard_normal(tuple(sizes[s] for s in a.shape))
    return x


def _present(a, case: Case) -> bool:
    """Required arguments always; optional decays by case.gate_mode ('g' | 'gamma' | 'both' |
    'none'), the initial state by case.h0."""
    if a.role == STATE:
        return case.h0
    if a.required:
        return True
    if a.role in (GATE, GATE_K, GATE_SLOT):
        return case.gate_mode in ("g", "both")
    if a.role == GAMMA:
        return case.gate_mode in ("gamma", "both")
    return True


def _draw(spec: OpSpec, a, case: Case, rng, shape: tuple) -> np.ndarray:
    if a.role == ACTIVATION:
        x = rng.standard_normal(shape)
        if a.name == "k" and spec.has_state:   # keys set the state's growth
            if spec.of_role(BETA) and not case.l2norm:
                return x / np.linalg.norm(x, axis=-1, keepdims=True)   # delta rule: |k| = 1
            return x / np.sqrt(shape[-1])
        return x
    if a.role in (GATE, GATE_K, GATE_SLOT):
        return -case.strength * rng.uniform(case.floor, 1.0, shape)
    if a.role == GAMMA:
        return -np.log2(1 + 2.0 ** -np.linspace(3, 8, shape[0])) * max(case.strength, 0.1)
    if a.role == BETA:
        beta = rng.uniform(case.beta_lo, case.beta_hi, shape) * case.beta_max
        if case.beta_edges:
            near_one = rng.uniform(size=shape) < 0.5
            beta = np.where(near_one, case.beta_max - 1e-4, 1e-4)
        return beta
    if a.role == STATE:
        return 0.5 * rng.standard_normal(shape)
    if a.role == VECTOR_K:    # -kk, a unit vector per token and head (b is drawn from it)
        x = rng.standard_normal(shape)
        return -x / np.linalg.norm(x, axis=-1, keepdims=True)
    raise ValueError(f"{spec.name}: no input rule for role {a.role!r} of {a.name}")


def op_kwargs(spec: OpSpec, case: Case) -> dict:
    """Non-tensor keyword arguments of the op for this case."""
    if not spec.has_state:
        return {"scale": None, "causal": case.causal, "window_size": case.window}
    kw = {"scale": case.scale, "output_final_state": True}
    if spec.l2norm:
        kw["use_qk_l2norm_in_kernel"] = case.l2norm
    return kw
