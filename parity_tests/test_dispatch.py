"""impl='auto' fails closed: kernels only where a GPU run proved them (AUTO_KERNEL), in both
frameworks identically; everything else takes the chunked path."""
from unittest import mock

import pytest

CASES = [("chunk_simple_gla", "bf16", True), ("fused_recurrent_simple_gla", "fp16", True),
         ("chunk_simple_gla", "fp32", True), ("fused_recurrent_simple_gla", "fp32", False),
         ("chunk_gated_delta_rule", "bf16", True), ("chunk_gated_delta_rule", "fp32", False),
         ("fused_recurrent_delta_rule", "fp16", True), ("chunk_gla", "bf16", True),
         ("chunk_gla", "fp32", False), ("fused_recurrent_gla", "bf16", False)]


@pytest.mark.parametrize("op,dtype,kernel", CASES)
def test_auto_on_gpu_jax(op, dtype, kernel):
    import jax.numpy as jnp

    from fla_jax.ops.common import dispatch
    q = jnp.zeros((1, 1, 1, 1), {"bf16": jnp.bfloat16, "fp16": jnp.float16,
                                 "fp32": jnp.float32}[dtype])
    registry = {"reference": 0, "chunked": 0, "pallas": 0}
    with mock.patch.object(dispatch, "on_gpu", return_value=True):
        assert dispatch.resolve_impl(op, "auto", registry, q) == ("pallas" if kernel else "chunked")
    assert dispatch.resolve_impl(op, "auto", registry, q) == "chunked"     # CPU backend


@pytest.mark.parametrize("op,dtype,kernel", CASES)
def test_auto_on_gpu_torch(op, dtype, kernel):
    import torch

    from fla_torch.ops.common import dispatch
    q = torch.zeros(1, dtype={"bf16": torch.bfloat16, "fp16": torch.float16,
                              "fp32": torch.float32}[dtype])
    registry = {"reference": 0, "chunked": 0, "triton": 0}
    with mock.patch.object(torch.Tensor, "is_cuda", new_callable=mock.PropertyMock,
                           return_value=True):
        assert dispatch.resolve_impl(op, "auto", registry, q) == ("triton" if kernel else "chunked")
    assert dispatch.resolve_impl(op, "auto", registry, q) == "chunked"     # CPU tensor


def test_same_auto_table_in_both():
    from fla_contract.auto_kernel import AUTO_KERNEL
    from fla_jax.ops.common.dispatch import AUTO_KERNEL as J
    from fla_torch.ops.common.dispatch import AUTO_KERNEL as T
    assert J is AUTO_KERNEL and T is AUTO_KERNEL
