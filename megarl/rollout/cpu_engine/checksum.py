"""Per-tensor weight checksums: megarl's extension to SGLang's protocol (`GET /weights_checksum`).

SGLang has no endpoint that reports what a server holds; on real SGLang, check a
sync with `rollout/logprob_diff` instead. The CPU engine answers
`GET /weights_checksum` with `{"algorithm", "weight_version", "checksums": {name: hex}}`
for every tensor of its state dict, so a trainer can prove a sync bit-exact.

The digest is over the values widened to float32 (exact for bf16/fp16), so a
bf16 trainer and a float32 server agree exactly when the server holds exactly
the bf16 values; integer tensors are hashed as they are. The shape is part of
the digest.
"""

from __future__ import annotations

import hashlib

import torch

DIGEST_ALGORITHM = "blake2b-128 over float32-widened little-endian bytes and the shape"


def tensor_digest(tensor: torch.Tensor) -> str:
    """The hex digest of one tensor (any device); equal digests mean bitwise-equal widened values."""
    values = tensor.detach()
    if values.is_floating_point() and values.dtype != torch.float64:
        values = values.to(torch.float32)
    values = values.cpu().contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(tuple(tensor.shape)).encode())
    digest.update(memoryview(values.view(torch.uint8).numpy()))
    return digest.hexdigest()
