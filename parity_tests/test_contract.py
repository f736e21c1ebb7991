"""Every bad input raises a named TypeError/ValueError, identically in both frameworks."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

FRAMEWORKS = ("torch", "jax")
DT = ("bf16", "fp16", "fp32")


class Torch:
    def __init__(self):
        import torch

        import fla_torch.ops as ops
        self.ops, self.t = ops, torch
        self.dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                       "fp64": torch.float64, "int32": torch.int32, "int64": torch.int64}
        self.kernel = "triton"

    def arr(self, shape, dtype="fp32", values=None):
        if values is not None:
            return self.t.tensor(values, dtype=self.dtypes[dtype])
        a = np.random.default_rng(0).standard_normal(shape) * 0.1 - (0.5 if dtype != "int32" else 0)
        return self.t.tensor(a, dtype=self.dtypes[dtype])


class Jax:
    def __init__(self):
        import jax
        import jax.numpy as jnp

        import fla_jax.ops as ops
        self.ops, self.jax, self.jnp = ops, jax, jnp
        self.dtypes = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32,
                       "fp64": jnp.float64, "int32": jnp.int32, "int64": jnp.int64}
        self.kernel = "pallas"

    def arr(self, shape, dtype="fp32", values=None):
        if dtype in ("fp64", "int64"):   # without x64 a description is enough: checks run first
            sh = shape if values is None else (len(values),)
            return self.jax.ShapeDtypeStruct(sh, self.dtypes[dtype])
        if values is not None:
            return self.jnp.asarray(values, self.dtypes[dtype])
        a = np.random.default_rng(0).standard_normal(shape) * 0.1 - 0.5
        return self.jnp.asarray(a, self.dtypes[dtype])


@pytest.fixture(params=FRAMEWORKS, scope="module")
def fw(request):
    return Torch() if request.param == "torch" else Jax()


B, T, H, K, V = 1, 20, 2, 16, 16


def gdn_args(fw, q="fp32", k="fp32", v="fp32", HV=H, **over):
    args = dict(q=fw.arr((B, T, H, K), q), k=fw.arr((B, T, H, K), k),
                v=fw.arr((B, T, HV, V), v), g=fw.arr((B, T, HV)), beta=fw.arr((B, T, HV)) + 1.0)
    args.update(over)
    return args


def call(fw, op="chunk_gated_delta_rule", impl="reference", **kw):
    return getattr(fw.ops, op)(**kw, impl=impl)


MIXES = [c for c in itertools.product(DT, repeat=3) if len(set(c)) > 1]


@pytest.mark.parametrize("op", ["chunk_simple_gla", "fused_recurrent_gla", "chunk_delta_rule",
                                "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("mix", MIXES, ids=["-".join(m) for m in MIXES])
def test_qkv_dtype_mix_names_each_tensor(fw, op, mix):
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    q, k, v = (fw.arr((B, T, H, K), d) for d in mix)
    kw = dict(q=q, k=k, v=v)
    if "gla" in op and "simple" not in op:
        kw["g"] = fw.arr((B, T, H, K))
    if "delta" in op:
        kw["beta"] = fw.arr((B, T, H))
    if "gated_delta" in op:
        kw["g"] = fw.arr((B, T, H))
    with pytest.raises(TypeError) as e:
        call(fw, op, **kw)
    msg = str(e.value)
    assert op in msg
    for n, d in zip("qkv", mix):
        assert f"{n}={names[d]}" in msg, msg


def _raises(exc, fragments, fn):
    with pytest.raises(exc) as e:
        fn()
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_wrong_rank(fw):
    _raises(ValueError, ["q has shape", "expected rank 4"],
            lambda: call(fw, **gdn_args(fw) | {"q": fw.arr((B, T, H * K))}))


def test_mismatched_k_shape(fw):
    _raises(ValueError, ["k has shape", "[1, 20, 2, 16]"],
            lambda: call(fw, **gdn_args(fw) | {"k": fw.arr((B, T + 1, H, K))}))


def test_mismatched_v_batch_time(fw):
    _raises(ValueError, ["v has shape"],
            lambda: call(fw, **gdn_args(fw) | {"v": fw.arr((B, T - 1, H, V))}))


def test_grouped_heads_must_divide(fw):
    a = gdn_args(fw, HV=3)
    _raises(ValueError, ["HV % H == 0", "3 heads"], lambda: call(fw, **a))


def test_grouped_heads_refused_where_unsupported(fw):
    _raises(ValueError, ["same number of heads"],
            lambda: call(fw, "chunk_simple_gla", q=fw.arr((B, T, H, K)), k=fw.arr((B, T, H, K)),
                         v=fw.arr((B, T, 2 * H, V))))


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_initial_state_must_be_fp32(fw, dt):
    _raises(TypeError, ["initial_state has dtype", "expected float32"],
            lambda: call(fw, **gdn_args(fw), initial_state=fw.arr((B, H, K, V), dt)))


def test_initial_state_shape(fw):
    _raises(ValueError, ["initial_state has shape", "[N, HV, K, V] = [1, 2, 16, 16]"],
            lambda: call(fw, **gdn_args(fw), initial_state=fw.arr((B, H, V, K + 1))))


def test_initial_state_shape_varlen(fw):
    cu = fw.arr(None, "int32", [0, 5, T])
    _raises(ValueError, ["[N, HV, K, V] = [2, 2, 16, 16]", "len(cu_seqlens) - 1"],
            lambda: call(fw, **gdn_args(fw), cu_seqlens=cu, initial_state=fw.arr((1, H, K, V))))


def test_cu_seqlens_not_integer(fw):
    _raises(TypeError, ["cu_seqlens has dtype float32", "integer"],
            lambda: call(fw, **gdn_args(fw), cu_seqlens=fw.arr(None, "fp32", [0.0, 5.0, T])))


@pytest.mark.parametrize("values,fragment", [
    ([1, 5, T], "starts at 1"), ([0, 12, 8, T], "decreases at index 2"),
    ([0, 5, T - 1], f"ends at {T - 1}; expected it to end at T={T}")])
def test_cu_seqlens_values(fw, values, fragment):
    _raises(ValueError, ["cu_seqlens", fragment],
            lambda: call(fw, **gdn_args(fw), cu_seqlens=fw.arr(None, "int32", values)))


def test_cu_seqlens_needs_batch_one(fw):
    a = dict(q=fw.arr((2, T, H, K)), k=fw.arr((2, T, H, K)), v=fw.arr((2, T, H, V)),
             g=fw.arr((2, T, H)), beta=fw.arr((2, T, H)))
    _raises(ValueError, ["cu_seqlens given with batch size B=2", "expected B == 1"],
            lambda: call(fw, **a, cu_seqlens=fw.arr(None, "int32", [0, 5, T])))


def test_gate_shape_and_dtype(fw):
    _raises(ValueError, ["g has shape", "[B, T, HV]"],
            lambda: call(fw, **gdn_args(fw) | {"g": fw.arr((B, T, H, K))}))
    _raises(ValueError, ["g has shape", "[B, T, HV, K]"],
            lambda: call(fw, "chunk_gla", q=fw.arr((B, T, H, K)), k=fw.arr((B, T, H, K)),
                         v=fw.arr((B, T, H, V)), g=fw.arr((B, T, H))))
    _raises(TypeError, ["g has dtype int32", "floating"],
            lambda: call(fw, **gdn_args(fw) | {"g": fw.arr((B, T, H), "int32")}))


def test_beta_shape(fw):
    _raises(ValueError, ["beta has shape"],
            lambda: call(fw, **gdn_args(fw) | {"beta": fw.arr((B, T, H, 1))}))


def test_float64_refused_by_kernels(fw):
    a = gdn_args(fw, q="fp64", k="fp64", v="fp64")
    a["g"], a["beta"] = fw.arr((B, T, H), "fp64"), fw.arr((B, T, H), "fp64")
    for op in ("chunk_simple_gla", "chunk_gated_delta_rule"):
        kw = {n: a[n] for n in ("q", "k", "v")}
        if op == "chunk_gated_delta_rule":
            kw |= {"g": a["g"], "beta": a["beta"]}
        with pytest.raises((TypeError, ValueError)) as e:
            call(fw, op, impl=fw.kernel, **kw)
        msg = str(e.value)
        if "not available" in msg:   # this op has no kernel registered in this framework yet
            continue
        assert isinstance(e.value, TypeError) and "float64" in msg and "impl='reference'" in msg


def test_unknown_impl(fw):
    _raises(ValueError, ["impl='fast'", "expected one of"],
            lambda: call(fw, impl="fast", **gdn_args(fw)))


def test_scale_must_be_a_number(fw):
    _raises(TypeError, ["scale is str"], lambda: call(fw, **gdn_args(fw), scale="0.1"))


def test_required_gate_missing(fw):
    a = gdn_args(fw)
    a.pop("beta")
    with pytest.raises(TypeError) as e:
        call(fw, **a, beta=None)
    assert "beta" in str(e.value)


def test_cu_seqlens_as_list_names_op_and_fix(fw):
    fix = ("torch.tensor(cu_seqlens, dtype=torch.int32" if isinstance(fw, Torch)
           else "jnp.asarray(cu_seqlens, dtype=jnp.int32)")
    _raises(TypeError, ["chunk_gated_delta_rule: cu_seqlens is a list ([0, 5, 20])", fix],
            lambda: call(fw, **gdn_args(fw), cu_seqlens=[0, 5, T]))
    if isinstance(fw, Jax):   # numpy is accepted, and the message says so
        _raises(TypeError, ["expected a jax.Array or a numpy array"],
                lambda: call(fw, **gdn_args(fw), cu_seqlens=(0, 5, T)))


def test_jax_accepts_numpy_cu_seqlens():
    fw = Jax()
    o, ht = call(fw, **gdn_args(fw), cu_seqlens=np.asarray([0, 5, T], np.int32),
                 output_final_state=True)
    assert o.shape == (B, T, H, V) and ht.shape == (2, H, K, V)


def test_non_tensor_argument_names_op(fw):
    _raises(TypeError, ["chunk_gated_delta_rule: beta is a float", "beta"],
            lambda: call(fw, **gdn_args(fw) | {"beta": 0.5}))


def _swap(fw, x):
    return x.transpose(1, 2) if isinstance(fw, Torch) else fw.jnp.swapaxes(x, 1, 2)


def test_head_first_layout_named(fw):
    a = gdn_args(fw)
    hf = {n: _swap(fw, a[n]) for n in ("q", "k", "v", "g", "beta")}
    # everything head-first: only the state's head count disagrees
    _raises(ValueError, ["initial_state has shape", "q, k, v, g, beta look like the head-first "
                         "layout [B, H, T, K]", "swap axes 1 and 2"],
            lambda: call(fw, **hf, initial_state=fw.arr((B, H, K, V))))
    # q, k, v head-first with gates in [B, T, H]: either side may be the transposed one
    _raises(ValueError, ["g has shape", "Either g, beta or q, k, v look like the head-first"],
            lambda: call(fw, **(a | {n: hf[n] for n in "qkv"})))
    # grouped value heads, head-first: v's time disagrees with q's
    q, k = (fw.arr((B, H, T, K)) for _ in range(2))
    _raises(ValueError, ["v has shape [1, 4, 20, 16]", "q, k, v look like the head-first"],
            lambda: call(fw, q=q, k=k, v=fw.arr((B, 2 * H, T, V)), g=fw.arr((B, T, 2 * H)),
                         beta=fw.arr((B, T, 2 * H))))
    # per-key gate of GLA
    _raises(ValueError, ["v, g look like the head-first layout"],
            lambda: call(fw, "chunk_gla", q=fw.arr((B, T, H, K)), k=fw.arr((B, T, H, K)),
                         v=fw.arr((B, H, T, V)), g=fw.arr((B, H, T, K))))


def test_head_first_hint_not_given_for_other_errors(fw):
    with pytest.raises(ValueError) as e:
        call(fw, **gdn_args(fw) | {"v": fw.arr((B, T - 1, H, V))})
    assert "head-first" not in str(e.value)


def test_fewer_tokens_than_heads_is_valid(fw):
    """T < H (decoding one token) reads like [B, H, T, D] by sizes alone: it must run."""
    heads = 4
    o, ht = call(fw, q=fw.arr((B, 1, heads, K)), k=fw.arr((B, 1, heads, K)),
                 v=fw.arr((B, 1, heads, V)), g=fw.arr((B, 1, heads)),
                 beta=fw.arr((B, 1, heads)) + 1.0, initial_state=fw.arr((B, heads, K, V)),
                 output_final_state=True)
    assert tuple(o.shape) == (B, 1, heads, V) and tuple(ht.shape) == (B, heads, K, V)


@pytest.mark.parametrize("op", ["chunk_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_required_arg_message_from_spec(fw, op):
    a = gdn_args(fw)
    if "gated" not in op:
        a.pop("g")
    a["beta"] = None
    _raises(TypeError, [f"{op}: beta is None; expected beta, a [B, T, HV] tensor of write "
                        f"strengths (this op requires it)"], lambda: call(fw, op, **a))


def test_spec_matches_public_signatures(fw):
    """Every OpSpec argument is a parameter of the public op, without a default exactly when
    the spec requires it; and every tensor parameter has an ArgSpec."""
    import inspect

    from fla_contract import OPS
    from fla_contract.fla_inputs import TRANSFORMS
    non_tensor = {"scale", "output_final_state", "cu_seqlens", "use_qk_l2norm_in_kernel", "impl",
                  "cp_group", "cp_mesh_axis"}
    cp_ops = {f"chunk_{f}" for f in ("simple_gla", "gla", "delta_rule", "gated_delta_rule")}
    for name, spec in OPS.items():
        params = inspect.signature(getattr(fw.ops, name)).parameters
        # context parallelism: the four chunk ops of issue 15, in each framework's own words
        assert ({"cp_group", "cp_mesh_axis"} & set(params)) == (
            {"cp_group" if isinstance(fw, Torch) else "cp_mesh_axis"}
            if name in cp_ops else set()), name
        # a tuple state's parts are one public initial_state (GSA)
        public = {a.name: "initial_state" if spec.state_tuple and a in spec.states else a.name
                  for a in spec.args}
        # FLA's input transforms: keyword-only, after the op's own parameters
        transforms = [p for p, x in params.items() if x.kind is inspect.Parameter.KEYWORD_ONLY]
        assert transforms == [p for p in params if p in TRANSFORMS.get(name, ())], name
        assert sorted(transforms) == sorted(TRANSFORMS.get(name, ())), name
        assert list(dict.fromkeys(public.values())) == [
            p for p in params if p not in non_tensor and p not in spec.options
            and p not in transforms], name
        for a in spec.args:
            has_default = params[public[a.name]].default is not inspect.Parameter.empty
            assert has_default != a.required, f"{name}: {a.name}"
        assert ("use_qk_l2norm_in_kernel" in params) == spec.l2norm, name


def test_a_new_op_is_one_spec_entry():
    """A hypothetical op (per-key gate + beta + grouped value heads, KDA-like) described only
    by an OpSpec is validated and gets parity inputs, with no other code."""
    from fla_contract import OpSpec, TensorInfo, validate_op
    from fla_contract.op_spec import ACTIVATION, BETA, GATE_K, STATE, arg

    from .cases import Case, make_inputs

    spec = OpSpec("chunk_new", "new", "chunk", (
        arg("q", ACTIVATION, "B T H K"), arg("k", ACTIVATION, "B T H K"),
        arg("v", ACTIVATION, "B T HV V"), arg("g", GATE_K, "B T HV K"),
        arg("beta", BETA, "B T HV"), arg("initial_state", STATE, "N HV K V", required=False,
                                          short="h0")), grouped_heads=True, l2norm=True)
    assert spec.family_args == ("g", "beta", "use_qk_l2norm_in_kernel")
    x = make_inputs(spec, Case("c", B=1, T=30, H=2, HV=4, K=8, V=4, cu_seqlens=(0, 10, 30)), 0)
    assert {n: a.shape for n, a in x.items()} == {
        "q": (1, 30, 2, 8), "k": (1, 30, 2, 8), "v": (1, 30, 4, 4), "g": (1, 30, 4, 8),
        "beta": (1, 30, 4), "h0": (2, 4, 8, 4), "do": (1, 30, 4, 4), "dht": (2, 4, 8, 4)}
    info = {a.name: TensorInfo(a.name, x[a.key].shape, "fp32") for a in spec.args}
    cu = TensorInfo("cu_seqlens", (3,), "int32")
    dims = validate_op(spec, "chunked", ("fp32",), info, cu)
    assert (dims.B, dims.T, dims.H, dims.HV, dims.K, dims.V, dims.N) == (1, 30, 2, 4, 8, 4, 2)
    with pytest.raises(ValueError, match=r"g has shape \[1, 30, 4\]; expected \[B, T, HV, K\]"):
        validate_op(spec, "chunked", ("fp32",), info | {"g": TensorInfo("g", (1, 30, 4), "fp32")},
                    cu)
    with pytest.raises(TypeError, match="beta is None; expected beta"):
        validate_op(spec, "chunked", ("fp32",), info | {"beta": None}, cu)


def test_validation_reused_only_for_a_validated_signature():
    """validate_op keeps the Dims of a call signature it passed (read-only sizes) and reuses
    them; a failing signature is checked again on every call; another shape is validated
    afresh."""
    from fla_contract import OPS, validate_op
    from fla_contract.validate import TensorInfo
    spec = OPS["chunk_simple_gla"]

    def call(dtype_k="bf16", T=8):
        t = {"q": TensorInfo("q", (1, T, 2, 4), "bf16"),
             "k": TensorInfo("k", (1, T, 2, 4), dtype_k),
             "v": TensorInfo("v", (1, T, 2, 4), "bf16")}
        return validate_op(spec, "triton", ("bf16", "fp16", "fp32"), t)

    first = call()
    assert call() is first and first.T == 8
    with pytest.raises(TypeError):
        first.sizes["T"] = 9
    assert call(T=16).T == 16 and call() is first
    for _ in range(2):
        with pytest.raises(TypeError, match="k differs"):
            call(dtype_k="fp16")
