"""fla_torch under torch.distributed (gloo, CPU, 2 processes): DDP and FSDP2 (fully_shard)
gradients of the tiny LM (Gated DeltaNet, and a hybrid with a softmax Attention block) and of
one layer of each class equal the single-process gradients on the whole batch, fp32 within
1e-5 (parity_tests/torch_distributed.py)."""
from __future__ import annotations

import torch.distributed as dist
import pytest

from .torch_distributed import LAYERS, LM_ATTN, TOL, check


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_ddp_and_fsdp2_match_one_process():
    errors = check(2, ("ddp", "fsdp2"), LM_ATTN + LAYERS)
    for kind in ("ddp", "fsdp2"):
        for what in LM_ATTN + LAYERS:
            assert any(k[:2] == (kind, what) for k in errors), (kind, what)
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= TOL, worst
    print(f"{len(errors)} gradients, worst rel RMS {worst[1]:.2e} at {worst[0]}")
