"""Convert a trained PyTorch tiny LM to JAX (Flax NNX) and back, and show that the logits match.

    python examples/convert_weights.py                    # examples/out/tiny_lm_torch.safetensors
    python examples/convert_weights.py --checkpoint path/to/model.safetensors

Steps: load the torch checkpoint (written by examples/train_tiny_lm.py; without one, a freshly
initialised model is used and the script says so) -> fla_torch.interop.to_numpy -> load into
fla_jax's CausalLM with fla_jax.interop.from_state_dict -> save it with
fla_jax.interop.save_safetensors -> load that file back into a new torch model
(fla_torch.interop.load_safetensors, strict) -> compare.

Checks (a table; exit status 1 if any fails):
  fp32 logits, torch vs JAX, on held-out text        rel RMS <= 1e-5
  bf16 models (parameters rounded to bf16 on load)   bf16 parameters bit-identical;
                                                      each framework vs the fp32 logits <= 5e-2;
                                                      torch vs JAX <= 2e-2
  torch -> JAX -> safetensors -> torch               every tensor bit-identical, logits identical
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from checkpoint import read_metadata, save_jax  # noqa: E402
from tiny_data import eval_windows, load_corpus  # noqa: E402

HERE = Path(__file__).resolve().parent
# bf16: parameters rounded to bf16 and every activation rounded to bf16, through the whole LM
# (a random-init model, whose logits are tiny, measures about 2e-2 against fp32).
TOL = {"fp32": 1e-5, "bf16_vs_fp32": 5e-2, "bf16_cross": 2e-2}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default=str(HERE / "out" / "tiny_lm_torch.safetensors"))
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--windows", type=int, default=4, help="held-out windows to compare on")
    p.add_argument("--device", default="auto", help="torch device: auto | cpu | cuda")
    return p.parse_args(argv)


def rel_rms(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((a - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import fla_jax.interop as jax_interop
    import fla_torch.interop as torch_interop
    from fla_jax.models import CausalLM as JaxLM
    from fla_jax.models import LMConfig as JaxConfig
    from fla_torch.models import CausalLM as TorchLM
    from fla_torch.models import LMConfig

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.allow_tf32 = False     # fp32 means fp32 on a GPU too

    # 1. The torch model.
    ckpt = Path(args.checkpoint)
    corpus_tok, _, val_ids = load_corpus()
    if ckpt.exists():
        cfg_dict, tok, meta = read_metadata(ckpt)
        cfg_dict["policy"] = None                          # the fp32 model
        cfg = LMConfig.from_dict(cfg_dict)
        torch_model = TorchLM(cfg)
        torch_interop.load_safetensors(torch_model, ckpt, strict=True)
        print(f"loaded {ckpt} (written by {meta.get('framework', '?')}): {cfg.attn} x "
              f"{cfg.num_layers}, hidden {cfg.hidden_size}")
    else:
        tok = corpus_tok
        cfg = LMConfig(vocab_size=tok.vocab_size, hidden_size=128, head_dim=64)
        torch.manual_seed(0)
        torch_model = TorchLM(cfg)
        print(f"no checkpoint at {ckpt} (run examples/train_tiny_lm.py first); converting a "
              f"freshly initialised {cfg.attn} model instead")
    torch_model = torch_model.to(device).eval()
    x, y = eval_windows(tok.encode(corpus_tok.decode(val_ids)), args.seq_len, args.windows)

    def torch_logits(model):
        with torch.no_grad():
            return model(torch.from_numpy(x).to(device)).float().cpu().numpy()

    def jax_logits(model):
        return np.asarray(model(jnp.asarray(x)).astype(jnp.float32))

    # 2. torch -> numpy -> JAX; save the JAX model.
    state = torch_interop.to_numpy(torch_model)
    jax_model = JaxLM(JaxConfig.from_dict(cfg.to_dict()), rngs=nnx.Rngs(0))
    jax_interop.from_state_dict(jax_model, state)
    out = Path(args.out)
    jax_path = out / "converted_jax.safetensors"
    save_jax(jax_model, tok, jax_path)
    print(f"converted {len(state)} tensors ({sum(v.size for v in state.values()):,} values); "
          f"wrote {jax_path}")

    rows = []

    def check(name, value, tol, fmt="{:.2e}"):
        ok = value <= tol
        rows.append((name, fmt.format(value), f"<= {tol:g}", "PASS" if ok else "FAIL"))

    ref = torch_logits(torch_model)
    jl = jax_logits(jax_model)
    check("fp32 logits: torch vs JAX (rel RMS)", rel_rms(jl, ref), TOL["fp32"])

    # 3. bf16: both frameworks load the fp32 weights into bf16 parameters and compute in bf16.
    bf16_cfg = LMConfig.from_dict({**cfg.to_dict(), "policy": "bf16"})
    torch_bf16 = TorchLM(bf16_cfg)
    torch_bf16.load_state_dict(torch_interop.from_numpy(state), strict=True)
    torch_bf16 = torch_bf16.to(device).eval()
    jax_bf16 = JaxLM(JaxConfig.from_dict(bf16_cfg.to_dict()), rngs=nnx.Rngs(0))
    jax_interop.from_state_dict(jax_bf16, state)
    tb = torch_interop.to_numpy(torch_bf16)
    jb = jax_interop.to_state_dict(jax_bf16)
    mismatched = [k for k in tb if tb[k].dtype != jb[k].dtype or
                  tb[k].view(np.uint16).tobytes() != jb[k].view(np.uint16).tobytes()]
    rows.append(("bf16 parameters identical in both", f"{len(tb) - len(mismatched)}/{len(tb)}",
                 "all", "PASS" if not mismatched else "FAIL"))
    tbl, jbl = torch_logits(torch_bf16), jax_logits(jax_bf16)
    check("bf16 logits: torch vs fp32 (rel RMS)", rel_rms(tbl, ref), TOL["bf16_vs_fp32"])
    check("bf16 logits: JAX vs fp32 (rel RMS)", rel_rms(jbl, ref), TOL["bf16_vs_fp32"])
    check("bf16 logits: torch vs JAX (rel RMS)", rel_rms(jbl, tbl), TOL["bf16_cross"])

    # 4. JAX -> safetensors -> a new torch model.
    back = TorchLM(LMConfig.from_dict(cfg.to_dict()))
    torch_interop.load_safetensors(back, jax_path, strict=True)
    back = back.to(device).eval()
    orig_sd, back_sd = torch_model.state_dict(), back.state_dict()
    same = sum(torch.equal(orig_sd[k], back_sd[k]) for k in orig_sd)
    rows.append(("round trip torch->JAX->torch: tensors bit-identical",
                 f"{same}/{len(orig_sd)}", "all", "PASS" if same == len(orig_sd) else "FAIL"))
    check("round trip: max |logits - original|", float(np.abs(torch_logits(back) - ref).max()),
          0.0, "{:.1e}")

    losses = {}
    for name, logits in (("torch fp32", ref), ("JAX fp32", jl), ("torch bf16", tbl),
                         ("JAX bf16", jbl)):
        lp = logits.astype(np.float64) - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        losses[name] = -np.take_along_axis(lp, y[..., None], -1).mean()

    w = max(len(r[0]) for r in rows)
    print(f"\ncompared on {x.shape[0]} held-out windows of {x.shape[1]} chars "
          f"(logits [{x.shape[0]}, {x.shape[1]}, {cfg.vocab_size}])\n")
    print(f"{'check':<{w}}  {'value':>9}  {'tolerance':>10}  result")
    for name, value, tol, res in rows:
        print(f"{name:<{w}}  {value:>9}  {tol:>10}  {res}")
    print("\nheld-out loss: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))
    failed = [r for r in rows if r[3] != "PASS"]
    print(f"\n{'all checks passed' if not failed else f'{len(failed)} check(s) FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
