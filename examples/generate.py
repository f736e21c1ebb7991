"""Generate text with recurrent decoding from a saved tiny LM, in PyTorch or JAX.

    python examples/generate.py                                   # torch checkpoint, torch
    python examples/generate.py --framework jax                   # the same file in JAX
    python examples/generate.py --framework both --prompt "The keeper"
    python examples/generate.py --checkpoint examples/out/tiny_lm_jax.safetensors

The prompt is run once through the model (prefill, chunk mode) with use_cache=True; then each
new character is one call on one token that updates every layer's recurrent state and
short-convolution cache (constant memory and time per token, whatever the length) and, in a
hybrid, every Attention layer's KV cache, preallocated for prompt + --max-new-tokens tokens
(max_cache_len), so the cache keeps its shapes and the jitted JAX step compiles once. Sampling
(temperature, top-k) is done in numpy with a seeded generator, so both frameworks draw from the
same stream. At the end the generated sequence is run once more as a whole, and the logits of
the token-by-token decoding are compared with that full forward: pass within DECODE_TOLERANCE
(by compute dtype; rounding-level differences only), else exit status 1.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from checkpoint import load_jax, load_torch  # noqa: E402

DEFAULT_CKPT = Path(__file__).resolve().parent / "out" / "tiny_lm_torch.safetensors"
# Decode vs full forward, rel RMS of the logits, by the model's compute dtype: the same
# computation in another order (recurrent vs chunked), so rounding-level only.
DECODE_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT_CKPT))
    p.add_argument("--framework", default="torch", choices=["torch", "jax", "both"])
    p.add_argument("--prompt", default="The keeper ")
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="torch device: auto | cpu | cuda")
    return p.parse_args(argv)


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float,
           top_k: int) -> int:
    """One token id from logits [vocab] (float64 softmax in numpy)."""
    logits = np.asarray(logits, np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if top_k > 0:
        kth = np.sort(logits)[-min(top_k, logits.size)]
        logits = np.where(logits < kth, -np.inf, logits)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


class TorchDecoder:
    def __init__(self, path, device):
        import torch
        self.torch = torch
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model, self.tok = load_torch(path, device=self.device)
        self.model.eval()

    def _ids(self, ids):
        return self.torch.as_tensor(np.asarray(ids)[None], device=self.device)

    def prefill(self, ids, max_cache_len):
        with self.torch.no_grad():
            logits, cache = self.model(self._ids(ids), use_cache=True,
                                       max_cache_len=max_cache_len)
        return logits[0, -1].float().cpu().numpy(), cache

    def step(self, token, cache):
        with self.torch.no_grad():
            logits, cache = self.model(self._ids([token]), cache=cache, use_cache=True)
        return logits[0, -1].float().cpu().numpy(), cache

    def full(self, ids):
        with self.torch.no_grad():
            return self.model(self._ids(ids))[0].float().cpu().numpy()


class JaxDecoder:
    def __init__(self, path):
        import jax.numpy as jnp
        from flax import nnx
        self.jnp = jnp
        self.model, self.tok = load_jax(path)

        @nnx.jit
        def step(model, token, cache):
            logits, cache = model(token, cache=cache, use_cache=True)
            return logits[0, -1].astype(jnp.float32), cache

        self._step = step

    def prefill(self, ids, max_cache_len):
        logits, cache = self.model(self.jnp.asarray(np.asarray(ids)[None]), use_cache=True,
                                   max_cache_len=max_cache_len)
        return np.asarray(logits[0, -1], np.float32), cache

    def step(self, token, cache):
        logits, cache = self._step(self.model, self.jnp.asarray([[token]]), cache)
        return np.asarray(logits), cache

    def full(self, ids):
        return np.asarray(self.model(self.jnp.asarray(np.asarray(ids)[None]))[0], np.float32)


def generate(decoder, prompt: str, args):
    """Returns (text, decode logits [n_new, vocab], all ids, seconds of each decode step)."""
    ids = list(decoder.tok.encode(prompt))
    if not ids:
        raise SystemExit("--prompt is empty; give at least one character")
    rng = np.random.default_rng(args.seed)
    logits, cache = decoder.prefill(ids, len(ids) + args.max_new_tokens)
    seen = [logits]
    times = []
    for _ in range(args.max_new_tokens):
        token = sample(logits, rng, args.temperature, args.top_k)
        ids.append(token)
        t0 = time.perf_counter()
        logits, cache = decoder.step(token, cache)
        times.append(time.perf_counter() - t0)
        seen.append(logits)
    return decoder.tok.decode(ids), np.stack(seen[:-1]), ids, times


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def compute_dtype_name(cfg) -> str:
    """'fp32' | 'bf16' | 'fp16': the compute dtype of the checkpoint's policy (fp32 without)."""
    from fla_contract import PolicySpec
    return PolicySpec.parse(cfg.policy).compute if cfg.policy else "fp32"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens={args.max_new_tokens}; expected >= 1")
    names = ["torch", "jax"] if args.framework == "both" else [args.framework]
    texts, status = {}, 0
    for name in names:
        try:
            dec = TorchDecoder(args.checkpoint, args.device) if name == "torch" else \
                JaxDecoder(args.checkpoint)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
        cfg = dec.model.config
        print(f"[{name}] {Path(args.checkpoint).name}: {','.join(cfg.layer_types)}, hidden "
              f"{cfg.hidden_size}, vocab {cfg.vocab_size}; prompt {args.prompt!r}, "
              f"{args.max_new_tokens} new chars, temperature {args.temperature}, "
              f"top-k {args.top_k}, seed {args.seed}")
        text, dec_logits, ids, times = generate(dec, args.prompt, args)
        print("-" * 72 + "\n" + text + "\n" + "-" * 72)
        n_prompt = len(ids) - args.max_new_tokens
        full = dec.full(ids[:-1])[n_prompt - 1:]
        err = rel_rms(dec_logits, full)
        rate = (len(times) - 1) / max(sum(times[1:]), 1e-9) if len(times) > 1 else 0.0
        print(f"[{name}] recurrent decoding: {rate:.0f} chars/s after the first step (first "
              f"step {times[0]:.2f} s{', incl. jit compile' if name == 'jax' else ''}); decode "
              f"vs one full forward over the same {len(ids) - 1} tokens: rel RMS diff of logits "
              f"{err:.2e}")
        compute = compute_dtype_name(cfg)
        tol = DECODE_TOLERANCE[compute]
        ok = err <= tol
        print(f"[{name}] {'pass' if ok else 'FAIL'}: decode == full forward within "
              f"{tol:g} ({compute} compute) -> {err:.2e} {'<=' if ok else '>'} {tol:g}")
        status = status or (0 if ok else 1)
        texts[name] = text
    if len(texts) == 2:
        same = texts["torch"] == texts["jax"]
        print(f"torch and jax generated {'the same' if same else 'different'} text from the "
              f"same checkpoint and seed" + ("" if same else " (sampling can flip on a "
                                                         "rounding-level logit difference)"))
    return status


if __name__ == "__main__":
    sys.exit(main())
