"""DtypePolicy strings mean the same policy in both frameworks."""
import pytest

from fla_contract import PolicySpec

CASES = {
    "bf16": "params=bf16,compute=bf16,output=bf16",
    "float16": "params=fp16,compute=fp16,output=fp16",
    "params=fp32,compute=bf16,output=bf16": "params=fp32,compute=bf16,output=bf16",
    "p=fp32,c=fp16,o=fp32": "params=fp32,compute=fp16,output=fp32",
    "params=float32, compute=bfloat16": "params=fp32,compute=bf16,output=bf16",
    "compute=half": "params=fp32,compute=fp16,output=fp16",
    " FP32 ": "params=fp32,compute=fp32,output=fp32",
}
BAD = ["", "bf17", "params=fp32,compute", "params=fp32,weights=bf16", "params=fp32,params=bf16"]


@pytest.mark.parametrize("text,canonical", CASES.items())
def test_same_policy_in_both_frameworks(text, canonical):
    import jax.numpy as jnp
    import torch

    from fla_jax.dtypes import DtypePolicy as JaxPolicy
    from fla_torch.dtypes import DtypePolicy as TorchPolicy
    jp, tp = JaxPolicy.parse(text), TorchPolicy.parse(text)
    assert str(jp) == str(tp) == canonical
    assert JaxPolicy.parse(str(jp)) == jp and TorchPolicy.parse(str(tp)) == tp
    names = {"bf16": (jnp.bfloat16, torch.bfloat16), "fp16": (jnp.float16, torch.float16),
             "fp32": (jnp.float32, torch.float32)}
    spec = PolicySpec.parse(text)
    for field, jd, td in (("param", jp.param_dtype, tp.param_dtype),
                          ("compute", jp.compute_dtype, tp.compute_dtype),
                          ("output", jp.output_dtype, tp.output_dtype)):
        assert (jd, td) == names[getattr(spec, field)]


@pytest.mark.parametrize("text", BAD)
def test_bad_policy_strings_raise_in_both(text):
    from fla_jax.dtypes import DtypePolicy as JaxPolicy
    from fla_torch.dtypes import DtypePolicy as TorchPolicy
    msgs = []
    for cls in (JaxPolicy, TorchPolicy):
        with pytest.raises(ValueError) as e:
            cls.parse(text)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


def test_fp32_matmuls_are_ieee_unless_asked():
    from fla_jax import dtypes as jd
    from fla_torch import dtypes as td
    for d in (jd, td):
        assert d.fp32_matmul_precision() == "ieee"
        with d.allow_tf32():
            assert d.fp32_matmul_precision() == "tf32"
        assert d.fp32_matmul_precision() == "ieee"
