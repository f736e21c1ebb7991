"""Train the tiny causal LM on examples/data/tiny.txt in PyTorch (torch.optim.AdamW) and in JAX
(optax.adamw) from the SAME initial weights (initialised in torch, converted to Flax) on the
SAME batches, and compare the loss curves step by step.

    python examples/train_tiny_lm.py                      # fp32, 50 steps, both frameworks
    python examples/train_tiny_lm.py --dtype bf16         # bf16 compute, fp32 parameters
    python examples/train_tiny_lm.py --frameworks torch --steps 400   # train longer, one side
    python examples/train_tiny_lm.py --attn hybrid        # Gated DeltaNet + softmax attention

Prints a table (step, learning rate, torch loss, jax loss, |difference|) and the largest
difference; writes to --out (default examples/out/): losses.csv, loss_curves.png (if
matplotlib is installed), tiny_lm_torch.safetensors and tiny_lm_jax.safetensors (weights +
config + vocabulary; see examples/generate.py and examples/convert_weights.py).
On a GPU both frameworks run their kernels (layers call the ops with impl='auto').
"""
from __future__ import annotations

import argparse
import csv
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))          # tiny_data, progress, ...
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # the repo (fla_torch, fla_jax)

from checkpoint import save_jax, save_torch  # noqa: E402
from progress import progress_bar  # noqa: E402
from tiny_data import BatchSampler, eval_windows, load_corpus  # noqa: E402

POLICIES = {"fp32": None, "bf16": "params=fp32,compute=bf16,output=fp32"}
# What "the curves agree" means here: the largest |loss_torch - loss_jax| over the run.
# fp32: rounding-level differences (different but equivalent summation orders) that training
# amplifies slowly; bf16: one bf16 rounding of the activations.
AGREEMENT = {"fp32": 1e-4, "bf16": 2e-2}
ZERO_FLOOR = 1e-9     # where the |difference| panel (log scale) draws an exact 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--attn", default="gated_deltanet",
                   choices=["linear_attention", "retention", "gla", "delta_net",
                            "gated_deltanet", "kda", "rwkv7", "attention", "hybrid"],
                   help="'hybrid': gated_deltanet blocks with softmax Attention in blocks "
                        "3, 7, 11, ... (3:1, as Qwen3-Next), or in the last block when "
                        "num_layers < 4")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--dtype", default="fp32", choices=sorted(POLICIES),
                   help="compute dtype (parameters and optimizer state stay fp32)")
    p.add_argument("--frameworks", default="torch,jax",
                   help="comma-separated subset of torch,jax")
    p.add_argument("--device", default="auto", help="torch device: auto | cpu | cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    return p.parse_args(argv)


def build_config(args, vocab_size: int):
    from fla_torch.models import LMConfig   # pure Python; fla_jax.models.LMConfig is the same
    attn, attn_layers = args.attn, []
    if attn == "hybrid":
        n = args.num_layers
        attn, attn_layers = "gated_deltanet", [i for i in range(n) if i % 4 == 3] or [n - 1]
    return LMConfig(vocab_size=vocab_size, hidden_size=args.hidden_size,
                    num_layers=args.num_layers, attn=attn, num_heads=args.num_heads,
                    head_dim=args.head_dim, policy=POLICIES[args.dtype],
                    attn_layers=attn_layers)


class TorchRun:
    def __init__(self, cfg, init_state, lrs, args):
        import torch

        from fla_torch.interop import from_numpy
        from fla_torch.models import CausalLM, lm_loss
        from fla_torch.models import train as torch_train
        self.torch, self.lm_loss, self.train = torch, lm_loss, torch_train
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        self.model = CausalLM(cfg).to(self.device)
        self.model.load_state_dict(from_numpy(init_state), strict=True)
        self.opt = torch_train.adamw(self.model, lr=lrs[0], weight_decay=args.weight_decay)
        self.lrs, self.clip = lrs, args.clip_norm
        self.seconds = 0.0

    def step(self, i, x, y) -> float:
        t0 = time.perf_counter()
        tx = self.torch.from_numpy(x).to(self.device)
        ty = self.torch.from_numpy(y).to(self.device)
        loss = self.train.train_step(self.model, self.opt, tx, ty, self.lrs[i], self.clip)
        self.seconds += time.perf_counter() - t0
        return loss

    def evaluate(self, x, y) -> float:
        with self.torch.no_grad():
            logits = self.model(self.torch.from_numpy(x).to(self.device))
            return float(self.lm_loss(logits, self.torch.from_numpy(y).to(self.device)))


class JaxRun:
    def __init__(self, cfg, init_state, lrs, args):
        import jax.numpy as jnp
        from flax import nnx

        from fla_jax.interop import from_state_dict
        from fla_jax.models import CausalLM, LMConfig, lm_loss
        from fla_jax.models import train as jax_train
        self.jnp, self.nnx, self.lm_loss, self.train = jnp, nnx, lm_loss, jax_train
        self.model = CausalLM(LMConfig.from_dict(cfg.to_dict()), rngs=nnx.Rngs(args.seed))
        from_state_dict(self.model, init_state)
        self.opt = jax_train.make_optimizer(
            self.model, jax_train.adamw(lrs, weight_decay=args.weight_decay))
        self.clip = args.clip_norm
        self.seconds = 0.0
        self.first_step_seconds = None

    def step(self, i, x, y) -> float:
        t0 = time.perf_counter()
        loss = float(self.train.train_step(self.model, self.opt, self.jnp.asarray(x),
                                           self.jnp.asarray(y), clip_norm=self.clip))
        dt = time.perf_counter() - t0
        if self.first_step_seconds is None:
            self.first_step_seconds = dt      # includes jit compilation
        else:
            self.seconds += dt
        return loss

    def evaluate(self, x, y) -> float:
        logits = self.model(self.jnp.asarray(x))
        return float(self.lm_loss(logits, self.jnp.asarray(y)))


def plot(path, steps, curves, title) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the plot (pip install matplotlib)"
    both = len(curves) == 2
    fig, axes = plt.subplots(2 if both else 1, 1, figsize=(7, 6 if both else 4), sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3, 1.3][:1 + both]})
    ax = axes[0, 0]
    styles = {"torch": dict(lw=2.5, alpha=0.6), "jax": dict(lw=1.0, ls="--", color="k")}
    for name, losses in curves.items():
        ax.plot(steps, losses, label=name, **styles.get(name, {}))
    ax.set_ylabel("training loss (nats / char)")
    ax.set_title(title)
    ax.legend()
    if both:
        a, b = (np.asarray(v) for v in curves.values())
        diff = np.abs(a - b)
        zeros = diff == 0
        axes[1, 0].semilogy(steps, np.where(zeros, ZERO_FLOOR, diff), color="tab:red", lw=1)
        axes[1, 0].set_ylabel("|torch - jax|")
        if zeros.any():     # a log axis has no 0: exact agreement is drawn at ZERO_FLOOR
            axes[1, 0].axhline(ZERO_FLOOR, color="0.6", lw=0.8, ls=":")
            axes[1, 0].annotate(f"exactly 0 at {int(zeros.sum())} step(s), drawn at "
                                f"{ZERO_FLOOR:g}", xy=(0.01, 0.04), xycoords="axes fraction",
                                fontsize=8, color="0.35")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def next_commands(out_dir: str, frameworks) -> list[str]:
    """The commands that read this run's checkpoints (naming --out's directory unless it is the
    default one)."""
    custom = Path(out_dir).resolve() != Path(parse_args([]).out).resolve()
    if "torch" in frameworks:
        ckpt = shlex.quote(str(Path(out_dir) / "tiny_lm_torch.safetensors"))
        return ["python examples/generate.py" + (f" --checkpoint {ckpt}" if custom else ""),
                "python examples/convert_weights.py"
                + (f" --checkpoint {ckpt} --out {shlex.quote(out_dir)}" if custom else "")]
    ckpt = shlex.quote(str(Path(out_dir) / "tiny_lm_jax.safetensors"))
    return [f"python examples/generate.py --framework jax --checkpoint {ckpt}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in frameworks if f not in ("torch", "jax")]
    if bad or not frameworks:
        raise SystemExit(f"--frameworks={args.frameworks!r}; expected a comma-separated subset "
                         f"of torch,jax")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tok, train_ids, val_ids = load_corpus()
    cfg = build_config(args, tok.vocab_size)
    print(f"text: {len(train_ids) + len(val_ids)} chars, vocabulary {tok.vocab_size}; "
          f"model: {','.join(cfg.layer_types)}, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads of {cfg.head_dim}; dtype {args.dtype} "
          f"(policy {cfg.policy or 'fp32'}); batch {args.batch_size} x {args.seq_len}, "
          f"{args.steps} steps, peak lr {args.lr}")

    # The initial weights: drawn once in torch (seeded), handed to both frameworks as numpy.
    import torch

    from fla_torch.interop import to_numpy
    from fla_torch.models import CausalLM as TorchLM
    from fla_torch.models import train as torch_train
    torch.manual_seed(args.seed)
    init_state = to_numpy(TorchLM(cfg))
    n_params = sum(v.size for k, v in init_state.items())
    print(f"parameters: {n_params:,} (tied embeddings)")
    lrs = torch_train.lr_schedule(args.lr, args.steps)

    runs = {}
    if "torch" in frameworks:
        runs["torch"] = TorchRun(cfg, init_state, lrs, args)
    if "jax" in frameworks:
        runs["jax"] = JaxRun(cfg, init_state, lrs, args)

    sampler = BatchSampler(train_ids, args.batch_size, args.seq_len, seed=args.seed)
    losses = {name: [] for name in runs}
    bar = progress_bar(args.steps, f"train {'+'.join(runs)} {args.dtype}")
    for i in range(args.steps):
        x, y = sampler.sample()
        for name, run in runs.items():
            losses[name].append(run.step(i, x, y))
        bar.set_postfix_str(" ".join(f"{n} {v[-1]:.4f}" for n, v in losses.items()))
        bar.update(1)
    bar.close()

    # The table.
    names = list(runs)
    both = len(names) == 2
    header = f"{'step':>5} {'lr':>9} " + " ".join(f"{n + ' loss':>11}" for n in names)
    header += f" {'|diff|':>10}" if both else ""
    print("\n" + header)
    every = max(1, args.steps // 50)
    for i in range(args.steps):
        if i % every and i != args.steps - 1:
            continue
        row = f"{i:>5} {lrs[i]:>9.2e} " + " ".join(f"{losses[n][i]:>11.6f}" for n in names)
        if both:
            row += f" {abs(losses['torch'][i] - losses['jax'][i]):>10.2e}"
        print(row)

    with open(out / "losses.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr"] + [f"{n}_loss" for n in names])
        for i in range(args.steps):
            w.writerow([i, lrs[i]] + [losses[n][i] for n in names])
    print(f"\nwrote {out / 'losses.csv'}")
    print(plot(out / "loss_curves.png", list(range(args.steps)), losses,
               f"tiny LM ({','.join(cfg.layer_types)}, {args.dtype}): torch.optim vs optax"))

    vx, vy = eval_windows(val_ids, args.seq_len)
    for name, run in runs.items():
        extra = ""
        if name == "jax" and run.first_step_seconds is not None:
            extra = f" (+ {run.first_step_seconds:.1f} s first step incl. jit compile)"
        per_step = run.seconds / max(1, args.steps - (1 if name == "jax" else 0))
        print(f"{name:>5}: final train loss {losses[name][-1]:.4f}, held-out loss "
              f"{run.evaluate(vx, vy):.4f}, {per_step * 1e3:.0f} ms/step{extra}")

    status = 0
    if both:
        diffs = np.abs(np.asarray(losses["torch"]) - np.asarray(losses["jax"]))
        tol = AGREEMENT[args.dtype]
        ok = bool(diffs.max() <= tol)
        print(f"max |loss_torch - loss_jax| over {args.steps} steps: {diffs.max():.3e} "
              f"(step {int(diffs.argmax())}; first 10 steps: {diffs[:10].max():.3e}) -> "
              f"{'agree' if ok else 'DISAGREE'} (tolerance {tol:g} for {args.dtype})")
        status = 0 if ok else 1

    if "torch" in runs:
        save_torch(runs["torch"].model.cpu(), tok, out / "tiny_lm_torch.safetensors")
        print(f"wrote {out / 'tiny_lm_torch.safetensors'}")
    if "jax" in runs:
        save_jax(runs["jax"].model, tok, out / "tiny_lm_jax.safetensors")
        print(f"wrote {out / 'tiny_lm_jax.safetensors'}")
    print("next: " + "   |   ".join(next_commands(args.out, list(runs))))
    return status


if __name__ == "__main__":
    sys.exit(main())
