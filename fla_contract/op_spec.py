"""One description of each public op: its tensors (role, shape, dtype rule, required) and its
op-level facts. `validate_op`, both frameworks' `run_op`, the parity runners, the parity
inputs and the benchmark all read `OPS`, so a new op is one entry here plus its
implementations.

Shapes are written with dimension symbols, bound from the arguments in order:
B batch, T time, H q/k heads, HV value heads, K key size, V value size, N sequences
(len(cu_seqlens) - 1, or B). Softmax attention and GSA: HQ query heads, HKV key/value heads;
attention: S key length; GSA: M memory slots.
"""
from __future__ import annotations

from dataclasses import dataclass

# Roles: how a tensor is checked, converted, drawn for the tests and differentiated.
ACTIVATION = "activation"   # q, k, v: one shared dtype in {bf16, fp16, fp32} (fp64 off-kernel)
GATE = "gate"               # scalar log-decay per token and value head [B, T, HV]
GATE_K = "gate_k"           # per-key-channel log-decay [B, T, HV, K]
BETA = "beta"               # write strength per token and value head [B, T, HV]
GAMMA = "gamma"             # fixed log-decay per value head [HV] (not differentiated)
STATE = "state"             # recurrent state [N, HV, K, V], float32 (float64 with fp64 q)
VECTOR_K = "vector_k"       # per-key vector of a low-rank transition [B, T, HV, K] (RWKV-7 a, b)
GATE_SLOT = "gate_slot"     # per-slot log-decay [B, T, HKV, M] (GSA's forget gate)
ROLES = (ACTIVATION, GATE, GATE_K, BETA, GAMMA, STATE, VECTOR_K, GATE_SLOT)

# Dtype rules.
SHARED = "shared"           # the one activation dtype of q, k, v
GATE_DTYPE = "gate_dtype"   # any float dtype, converted to float32 (float64 with fp64 q)
STATE_DTYPE = "state_dtype"  # exactly float32 (float64 with fp64 q)

_ROLE_DTYPE = {ACTIVATION: SHARED, GATE: GATE_DTYPE, GATE_K: GATE_DTYPE, BETA: GATE_DTYPE,
               GAMMA: GATE_DTYPE, STATE: STATE_DTYPE, VECTOR_K: GATE_DTYPE,
               GATE_SLOT: GATE_DTYPE}
_ROLE_WHAT = {GATE: "a [B, T, HV] log-decay tensor", GATE_K: "a [B, T, HV, K] log-decay tensor",
              BETA: "a [B, T, HV] tensor of write strengths",
              GAMMA: "a [HV] fixed log-decay per head", STATE: "a [N, HV, K, V] float32 state",
              VECTOR_K: "a [B, T, HV, K] per-key vector",
              GATE_SLOT: "a [B, T, HKV, M] per-slot log-decay tensor"}
_ROLE_FLOAT_WORDS = {GATE: "gates/log-decays", GATE_K: "gates/log-decays",
                     GATE_SLOT: "gates/log-decays",
                     GAMMA: "gates/log-decays", BETA: "beta values",
                     VECTOR_K: "low-rank transition vectors (a, b)"}


@dataclass(frozen=True)
class ArgSpec:
    """One tensor argument of an op.

    name: the public keyword ("q", "g", "initial_state"); short: its key in the parity inputs
    and, prefixed with "d", its gradient's ("h0" -> "dh0"); shape: dimension symbols;
    dtype: SHARED | GATE_DTYPE | STATE_DTYPE; label: how errors name it when the public
    argument is a part of another ("initial_state[0]" for a tuple state), else the name.
    """

    name: str
    role: str
    shape: tuple
    dtype: str
    required: bool = True
    short: str = ""
    label: str = ""

    @property
    def key(self) -> str:
        return self.short or self.name

    @property
    def differentiable(self) -> bool:
        return self.role != GAMMA

    @property
    def final_key(self) -> str:
        """A state's key in the parity outputs: 'h0' -> 'ht' (its cotangent 'dht')."""
        return self.key[:-1] + "t" if self.key.endswith("0") else self.key + "t"

    @property
    def layout(self) -> str:
        return "[" + ", ".join(self.shape) + "]"

    @property
    def what(self) -> str:
        """Words for a missing-argument error."""
        return _ROLE_WHAT.get(self.role, f"a {self.layout} tensor")

    @property
    def float_words(self) -> str:
        return _ROLE_FLOAT_WORDS.get(self.role, f"{self.name} values")


def arg(name: str, role: str, shape: str, *, required: bool = True, short: str = "",
        label: str = "") -> ArgSpec:
    """ArgSpec with the dtype rule of its role; shape as "B T H K"."""
    return ArgSpec(name, role, tuple(shape.split()), _ROLE_DTYPE[role], required, short, label)


@dataclass(frozen=True)
class OpSpec:
    """One public op: its tensors in signature order and what the op allows.

    grouped_heads: v may have HV heads with HV % H == 0 (value head hv reads q/k head
    hv // (HV // H)); otherwise HV == H. l2norm: takes use_qk_l2norm_in_kernel.
    grouped_query: q has HQ heads over HKV key/value heads, HQ % HKV == 0 (query head h reads
    k/v head h // (HQ // HKV)): softmax attention's and GSA's GQA.
    state_tuple: the op's STATE arguments, in order, are the parts of ONE public keyword
    `initial_state` (a tuple), and its final state is a tuple in the same order (GSA).
    """

    name: str
    family: str
    variant: str                 # 'chunk' | 'fused_recurrent'
    args: tuple
    grouped_heads: bool = False
    l2norm: bool = False
    grouped_query: bool = False
    options: tuple = ()          # the op's own non-tensor keywords (attention: causal, ...)
    state_tuple: bool = False

    def arg(self, name: str) -> ArgSpec:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no argument {name!r}")

    def of_role(self, *roles: str) -> tuple:
        return tuple(a for a in self.args if a.role in roles)

    @property
    def activations(self) -> tuple:
        return self.of_role(ACTIVATION)

    def label(self, name: str) -> str:
        """How errors name argument `name` (its ArgSpec label, else the name itself)."""
        a = next((a for a in self.args if a.name == name), None)
        return (a.label or a.name) if a is not None else name

    @property
    def states(self) -> tuple:
        return self.of_role(STATE)

    @property
    def gate_optional(self) -> bool:
        """True when the op runs without any decay (simple GLA: g and g_gamma both optional)."""
        gates = self.of_role(GATE, GATE_K, GAMMA, GATE_SLOT)
        return bool(gates) and not any(a.required for a in gates)

    @property
    def has_state(self) -> bool:
        """False for ops that return o only (softmax attention)."""
        return bool(self.of_role(STATE))

    @property
    def family_args(self) -> tuple:
        """Keywords the implementation function takes besides the activations (positional),
        scale, initial_state, output_final_state and cu_seqlens (DESIGN.md)."""
        names = tuple(a.name for a in self.args if a.role not in (ACTIVATION, STATE))
        return names + (("use_qk_l2norm_in_kernel",) if self.l2norm else ())


_Q = arg("q", ACTIVATION, "B T H K")
_K = arg("k", ACTIVATION, "B T H K")
_V = arg("v", ACTIVATION, "B T HV V")
_H0 = arg("initial_state", STATE, "N HV K V", required=False, short="h0")


def _family(family: str, *args: ArgSpec, **facts) -> list:
    return [OpSpec(f"{variant}_{family}", family, variant, (_Q, _K, _V) + args + (_H0,), **facts)
            for variant in ("chunk", "fused_recurrent")]


OPS = {spec.name: spec for spec in (
    _family("simple_gla", arg("g", GATE, "B T HV", required=False),
            arg("g_gamma", GAMMA, "HV", required=False))
    + _family("gla", arg("g", GATE_K, "B T HV K"))
    + _family("delta_rule", arg("beta", BETA, "B T HV"), grouped_heads=True, l2norm=True)
    + _family("gated_delta_rule", arg("g", GATE, "B T HV"), arg("beta", BETA, "B T HV"),
              grouped_heads=True, l2norm=True)
    # Kimi Delta Attention: the gated delta rule with a per-key-channel decay.
    # S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    + _family("kda", arg("g", GATE_K, "B T HV K"), arg("beta", BETA, "B T HV"),
              grouped_heads=True, l2norm=True)
    # RWKV-7 (FLA's DPLR convention, r in place of q, scale defaults to 1.0):
    # S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T ; o_t = scale * r_t S_t
    + [OpSpec(f"{variant}_rwkv7", "rwkv7", variant,
              (arg("r", ACTIVATION, "B T H K"), arg("w", GATE_K, "B T HV K"), _K, _V,
               arg("a", VECTOR_K, "B T HV K"), arg("b", VECTOR_K, "B T HV K"), _H0))
       for variant in ("chunk", "fused_recurrent")]
    # Gated Slot Attention (FLA's gsa): two gated passes over M slots with a softmax between
    # them; s [B, T, HKV, M] is an activation (the slots' write weights; FLA's layer feeds
    # s = 1 - exp(g)); g the per-slot log-decay (None: FLA's additive gate from s's running
    # logsumexp). hk_t = hk_{t-1} diag(exp(g_t)) + k_t^T s_t ; ok_t = scale q_t hk_t ;
    # hv_t = diag(exp(g_t)) hv_{t-1} + s_t^T v_t ; o_t = softmax(ok_t) hv_t.
    + [OpSpec(f"{variant}_gsa", "gsa", variant,
              (arg("q", ACTIVATION, "B T HQ K"), arg("k", ACTIVATION, "B T HKV K"),
               arg("v", ACTIVATION, "B T HKV V"), arg("s", ACTIVATION, "B T HKV M"),
               arg("g", GATE_SLOT, "B T HKV M", required=False),
               arg("hk0", STATE, "N HKV K M", required=False, label="initial_state[0]"),
               arg("hv0", STATE, "N HKV M V", required=False, label="initial_state[1]")),
              grouped_query=True, state_tuple=True)
       for variant in ("chunk", "fused_recurrent")])}


# Softmax attention: no state, no gates; returns o only. variant 'attention'.
ATTENTION = OpSpec("attention", "attention", "attention",
                   (arg("q", ACTIVATION, "B T HQ K"), arg("k", ACTIVATION, "B S HKV K"),
                    arg("v", ACTIVATION, "B S HKV V")), grouped_query=True,
                   options=("causal", "window_size"))
OPS[ATTENTION.name] = ATTENTION
LINEAR_OPS = tuple(name for name, spec in OPS.items() if spec.has_state)
