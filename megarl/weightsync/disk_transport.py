"""The `disk` transport: safetensors files in a run-local directory, then `/update_weights_from_disk`.

Each stage sender writes its buckets as `model-<bucket>.safetensors` into
`<root>/.v<version>.tmp/`; a bucket buffer already is a safetensors data section
(tensors back to back), so a file is a small JSON header plus one write of the
buffer, no copy. When every sender is done, rank 0 adds
`model.safetensors.index.json`, renames the directory to `<root>/v<version>`
(atomic: a server never sees a half-written version), points every server at
it (`flush_cache: false`: the update session flushes) and deletes older versions. The root must be visible to the servers (a
shared file system across nodes).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from megarl.registry import WEIGHT_SYNC_TRANSPORTS
from megarl.rollout.client import RolloutClient
from megarl.weightsync.bounds import SyncBound, disk_seconds
from megarl.weightsync.buffers import BufferRing
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import call_servers

Tensor = torch.Tensor
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _disk_bound(nbytes: int, *, bucket_bytes: int, scratch_dir: Path, device: str) -> float:
    # Writing the bytes once (no fsync, as the transport) and reading them back once.
    return disk_seconds(nbytes, scratch_dir)


@WEIGHT_SYNC_TRANSPORTS.register("disk", bound=SyncBound("disk write + read", _disk_bound))
class DiskTransport:
    name = "disk"

    def __init__(self, client: RolloutClient, *, root: str | Path):
        self.client = client
        self.root = Path(root)
        self._ring = BufferRing()

    @classmethod
    def create(cls, client: RolloutClient, *, timeout_s: float, disk_dir: str | Path | None = None,
               server_devices=None) -> DiskTransport:
        if disk_dir is None:
            raise ValueError("the disk transport needs disk_dir (a run-local directory the servers can read)")
        return cls(client, root=disk_dir)

    def buffer(self, slot: int, nbytes: int) -> Tensor:
        return self._ring.get(slot, nbytes)

    def staging_dir(self, weight_version: str) -> Path:
        return self.root / f".v{weight_version}.tmp"

    def version_dir(self, weight_version: str) -> Path:
        return self.root / f"v{weight_version}"

    def prepare(self, *, weight_version: str) -> None:
        for stale in self.root.glob(".v*.tmp"):  # left by failed syncs
            shutil.rmtree(stale, ignore_errors=True)
        self.staging_dir(weight_version).mkdir(parents=True)

    def start_stage(self, pp_rank: int, *, weight_version: str) -> None:
        self._staging = self.staging_dir(weight_version)
        self._staging.mkdir(parents=True, exist_ok=True)

    def send(self, bucket: Bucket, flat: Tensor, *, last: bool) -> None:
        write_safetensors(self._staging / f"model-{bucket.index:05d}.safetensors", bucket, flat)

    def commit(self, *, weight_version: str) -> None:
        staging, final = self.staging_dir(weight_version), self.version_dir(weight_version)
        weight_map = {}
        for file in sorted(staging.glob("*.safetensors")):
            with file.open("rb") as handle:
                header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
            weight_map.update({name: file.name for name in header if name != "__metadata__"})
        (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        call_servers(self.client, "POST", "/update_weights_from_disk",
                     {"model_path": str(final.resolve()), "flush_cache": False},
                     phase=f"disk transport, load {final}")
        for old in self.root.glob("v*"):
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    def release_buffers(self) -> None:
        self._ring.clear()

    def close(self) -> None:
        self.release_buffers()


def write_safetensors(path: Path, bucket: Bucket, flat: Tensor) -> None:
    """A safetensors file of the bucket's HF tensors: header, then the bucket buffer as the data section."""
    dtype = _SAFETENSORS_DTYPES[bucket.dtype]
    header = {t.name: {"dtype": dtype, "shape": list(t.shape), "data_offsets": [t.offset, t.offset + t.nbytes]}
              for t in bucket.tensors}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8-byte alignment
    data = flat[: bucket.nbytes].cpu()
    partial = path.with_suffix(".partial")
    with partial.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        handle.write(memoryview(data.numpy()))
    partial.rename(path)
