"""fla_torch under torch.distributed (gloo, CPU, 2 processes): DDP and FSDP2 (fully_shard)
gradients of the tiny LM (Gated DeltaNet, and a hybrid with a softmax Attention block) and of
one layer of each class equal the single-process gradients on the whole batch, fp32 within
1e-5 (parity_tests/torch_distributed.py). Also context parallel: the layers without short
convolutions inside layers.context_parallel, each rank one time slice of every row: the same
parameter gradients."""
from __future__ import annotations

import torch.distributed as dist
import pytest

from .torch_distributed import CP_LAYERS, LAYERS, LM_ATTN, TOL, check


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_ddp_and_fsdp2_match_one_process():
    errors = check(2, ("ddp", "fsdp2"), LM_ATTN + LAYERS, CP_LAYERS)
    runs = [(k, w) for k in ("ddp", "fsdp2") for w in LM_ATTN + LAYERS]
    for kind, what in runs + [("cp", w) for w in CP_LAYERS]:
        assert any(k[:2] == (kind, what) for k in errors), (kind, what)
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= TOL, worst
    print(f"{len(errors)} gradients, worst rel RMS {worst[1]:.2e} at {worst[0]}")
