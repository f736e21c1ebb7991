"""Cross-framework parity suite and CLI (`python -m parity_tests`)."""

# XLA flags of every CPU run of the suite and the CLI (conftest.py, __main__.py, the CP worker):
# CPU compile time dominates, and XLA's cheaper backend passes cut it by about a third; its
# older (non-MLIR) fusion code generation compiles the interpreted kernels' large programs in
# about half the time (KDA's Pallas fwd+bwd 20 -> 12 s, GDN's 9 -> 3, RWKV-7's 16 -> 8;
# test_pallas_simple_gla + test_pallas_kda with -n 2: 167 -> 114 s). Test runs only: the library
# sets no XLA flag. An XLA_FLAGS already in the environment is kept instead.
CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false")
