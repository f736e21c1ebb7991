"""Where impl='auto' takes a GPU kernel: one table for both frameworks (op -> q dtypes).

Fail closed: an op/dtype is listed only where a GPU parity run proved its kernels (Pallas AND
Triton) and they are faster than the chunked path. H100 runs of 2026-11-21
(benchmarks/RESULTS.md, run 3): every GPU parity cell of every kernel op passed, fp32 included.
Left out: fp32 of the delta family and of the recurrent simple GLA, whose speed has not been
compared with the chunked path's. chunk_gla: H100 runs of 2026-11-23 (RESULTS.md, run 4):
every GPU parity cell passed in bf16/fp16/fp32 (Pallas and Triton), and the kernels beat the
chunked paths in bf16 (Triton 1.86 / 4.46 ms vs torch chunked 219.8 / 459.5; Pallas 2.67 / 9.14
vs jax chunked 4.71 / 13.98, fwd / fwd+bwd); fp16 kernels time within 3% of bf16. Left out:
chunk_gla fp32 (Pallas fp32 backward not timed) and fused_recurrent_gla (not timed).
chunk_rwkv7: H100 run of 2026-11-25 (RESULTS.md, run 12): every GPU parity cell of both
kernels passed (bf16/fp16/fp32, all gradients, 459 comparisons) and they beat the chunked paths
(bf16 fwd+bwd: Triton 4.53 vs torch chunked 363.5 ms; Pallas 4.35-4.49 vs jax chunked 34.5;
fp16 likewise). Left out: its fp32 (chunked fp32 not timed). An explicit impl= still selects any
kernel.
"""
AUTO_KERNEL = {"chunk_simple_gla": ("bf16", "fp16", "fp32"),
               "fused_recurrent_simple_gla": ("bf16", "fp16"),
               "chunk_delta_rule": ("bf16", "fp16"),
               "chunk_gated_delta_rule": ("bf16", "fp16"),
               "fused_recurrent_delta_rule": ("bf16", "fp16"),
               "fused_recurrent_gated_delta_rule": ("bf16", "fp16"),
               "chunk_gla": ("bf16", "fp16"),
               "chunk_rwkv7": ("bf16", "fp16")}

# impl='auto' on a Hopper GPU (fla_jax only): op -> q dtypes whose Pallas Mosaic GPU kernels
# passed a GPU parity run. Fail closed. H100 runs of 2026-11-27 (RESULTS.md run 14,
# `python -m parity_tests --device cuda --impls mosaic`): every GPU case the kernels take
# (4k, varlen, GQA + l2norm, gates to -20 with beta at its edges, T = 16384, K/V 64 and 256),
# bf16 and fp16, o, final state and every gradient against float64 and against fla_torch's
# Triton kernels: 0 failed. The forward is faster than the Pallas one (bf16 B4 T4096 H16
# K=V=128: GDN 0.393 vs 0.711 ms, simple GLA 0.135-0.144 vs 0.389), fwd+bwd equal or faster.
# fp32 is not taken (the kernels need 16-bit wgmma operands; 'auto' keeps the Pallas kernels).
# chunk_gla: H100 parity of 4k, GQA, varlen, strong gates (edges, uniform) and T = 16384, bf16
# and fp16, 210 comparisons each time, 0 failed: the Mosaic forward (RESULTS.md run 17 calls 6
# and 7; 0.485 vs Pallas 0.823 ms) and its Mosaic backward (run 18 calls 1-5; with bounded
# parts 0.408 / 1.914 ms vs jla 0.437 / 2.089, the Pallas backward's step 3.07).
AUTO_MOSAIC: dict = {"chunk_simple_gla": ("bf16", "fp16"),
                     "chunk_gla": ("bf16", "fp16"),
                     "chunk_delta_rule": ("bf16", "fp16"),
                     "chunk_gated_delta_rule": ("bf16", "fp16")}
