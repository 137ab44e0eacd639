"""The weight-update wire formats (`megarl.rollout.weight_wire`) against SGLang's rules, and the fan-out's logic.

SGLang's receiving side is read from its source (0.5.23): `SafeUnpickler` in
`srt/utils/common.py` (202 exact `(module, name)` pairs, `_load_from_bytes` as a weights-only
storage load, the refusal's text), `FlattenedTensorBucket`
in `srt/weight_sync/tensor_bucket.py` (byte offsets, `flat[start:end].view(dtype).reshape(shape)`),
`monkey_patch_torch_reductions` in `srt/utils/patch_torch.py` (argument 6 of
`rebuild_cuda_tensor` is the device, sent as a UUID). No GPU here: the CUDA path is
checked with a faked device list, and for real in the `gpu` test at the end.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import operator
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

from megarl.rollout.weight_wire import (
    METADATA_FIELDS,
    SafeUnpickler,
    UnsafePayloadError,
    deserialize_named_tensors,
    deserialize_payload,
    device_index_for_uuid,
    entries_for_tp_ranks,
    flatten_bucket,
    serialize_named_tensors,
    serialize_payload,
    unflatten_bucket,
)
from megarl.weightsync.fanout import holders
from megarl.weightsync.session import WeightSyncError

NAMED = [("model.norm.weight", torch.randn(8)), ("lm_head.weight", torch.randn(4, 8).to(torch.bfloat16)),
         ("model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).view(3, 4))]


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """What megarl used to send: its own metadata class (SGLang's allow-list refuses it)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def test_flattened_bucket_metadata_is_a_namespace_with_exactly_sglangs_fields_in_bytes():
    payload = flatten_bucket(NAMED)
    assert set(payload) == {"flattened_tensor", "metadata"} and payload["flattened_tensor"].dtype == torch.uint8
    offsets = 0
    for (name, tensor), meta in zip(NAMED, payload["metadata"]):
        assert type(meta) is SimpleNamespace and tuple(vars(meta)) == METADATA_FIELDS
        nbytes = tensor.numel() * tensor.element_size()
        assert (meta.name, meta.shape, meta.dtype) == (name, tensor.shape, tensor.dtype)
        assert (meta.start_idx, meta.end_idx, meta.numel) == (offsets, offsets + nbytes, nbytes)
        # SGLang's reconstruction, written out: flat[start:end].view(dtype).reshape(shape).
        rebuilt = payload["flattened_tensor"][meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
        assert torch.equal(rebuilt, tensor)
        offsets += nbytes
    assert [(n, t) for n, t in unflatten_bucket(payload)][1][1].dtype == torch.bfloat16


def test_round_trip_through_the_allow_list_in_both_load_formats():
    for load_format in (None, "flattened_bucket"):
        back = deserialize_named_tensors(serialize_named_tensors(NAMED, load_format=load_format),
                                         load_format=load_format)
        assert [name for name, _ in back] == [name for name, _ in NAMED]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, NAMED))


def test_a_payload_with_a_projects_own_metadata_class_is_refused_as_sglang_refuses_it():
    flat = flatten_bucket(NAMED)
    own = [FlattenedTensorMetadata(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel)
           for m in flat["metadata"]]
    entry = serialize_payload({"flattened_tensor": flat["flattened_tensor"], "metadata": own})
    with pytest.raises(UnsafePayloadError, match=rf"^Blocked unsafe global \({__name__}\.FlattenedTensorMetadata\) "
                                                 r"during pickle deserialization$"):
        deserialize_payload(entry)


class Call:
    """Pickles as `func(*args)`: loading it runs the call, unless the unpickler refuses `func`'s global."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def entry_of(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def builtins_chain(path) -> bytes:
    """getattr(__import__("os"), "system")("touch PATH"), in raw opcodes: the chain a prefix rule lets through."""
    def glob(module, name):
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def text(value):
        return b"\x8c" + bytes([len(value)]) + value.encode()

    return (b"\x80\x04" + glob("builtins", "getattr") + glob("builtins", "__import__") + text("os") + b"\x85R"
            + text("system") + b"\x86R" + text(f"touch {path}") + b"\x85R.")


def gadgets(path) -> dict[str, tuple[str, str]]:
    """Payloads that create `path` if anything of them runs, each with the global it is refused at."""
    return {
        "builtins": (base64.b64encode(builtins_chain(path)).decode(), "builtins.getattr"),
        "builtins.open": (entry_of([("w", Call(open, str(path), "w"))]), "io.open"),
        "torch": (entry_of(Call(torch.save, {"pwned": 1}, str(path))), "torch.serialization.save"),
        # `functools.partial` is one of SGLang's pairs: the chain stops at the callable it wraps.
        "functools": (entry_of(Call(functools.partial(open, str(path), "w"))), "io.open"),
        "operator": (entry_of(Call(operator.methodcaller("touch"), Path(path))), "operator.methodcaller"),
        "after an allowed global": (entry_of(SimpleNamespace(name="w", hook=Call(os.system, f"touch {path}"))),
                                    "posix.system"),
    }


@pytest.mark.parametrize("kind", ["builtins", "builtins.open", "torch", "functools", "operator",
                                  "after an allowed global"])
def test_gadget_chains_are_refused_at_their_first_unlisted_global_and_nothing_runs(kind, tmp_path):
    entry, refused_at = gadgets(tmp_path / "pwned")[kind]
    with pytest.raises(UnsafePayloadError,
                       match=rf"^Blocked unsafe global \({re.escape(refused_at)}\) during pickle deserialization$"):
        deserialize_payload(entry)
    assert not (tmp_path / "pwned").exists()


class Recorder(pickle.Unpickler):
    def __init__(self, raw: bytes, seen: set):
        super().__init__(io.BytesIO(raw))
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_every_payload_megarl_sends_loads_and_needs_only_exact_globals_sglang_has():
    """The CPU forms (a list of tensors, a flattened bucket, model parameters) load through the allow-list;
    the globals they name are exactly pairs, none a prefix or a module's code (a gadget)."""
    params = list(torch.nn.Linear(3, 2).named_parameters())
    seen: set = set()
    for payload, load_format in [(NAMED, None), (NAMED, "flattened_bucket"), (params, None)]:
        entry = serialize_named_tensors(payload, load_format=load_format)
        back = deserialize_named_tensors(entry, load_format=load_format)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, payload))
        Recorder(base64.b64decode(entry), seen).load()
    assert seen <= SafeUnpickler.ALLOWED_GLOBALS
    assert ("torch.nn.parameter", "Parameter") not in seen  # parameters travel as the tensors they wrap
    for gadget in [("builtins", "getattr"), ("torch", "load"), ("torch.storage", "_load_from_bytes"),
                   ("operator", "attrgetter"), ("copyreg", "_reconstructor")]:
        assert gadget not in SafeUnpickler.ALLOWED_GLOBALS


# SHA-256 over SGLang 0.5.23's `SafeUnpickler.ALLOWED_GLOBALS` (python/sglang/srt/utils/common.py, read from
# the wheel's source with `ast.literal_eval`), as sorted "module.name" lines joined by newlines.
SGLANG_0_5_23_GLOBALS_SHA256 = "1084398cad22580221d444ada08d367ae6718717d7d69b045248e70e88e63fc0"


def test_the_allow_list_is_exactly_sglangs_202_pairs():
    pairs = SafeUnpickler.ALLOWED_GLOBALS
    assert len(pairs) == 202 and all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs)
    lines = "\n".join(f"{module}.{name}" for module, name in sorted(pairs))
    assert hashlib.sha256(lines.encode()).hexdigest() == SGLANG_0_5_23_GLOBALS_SHA256
    # Plain pickles of tensors and parameters (`_rebuild_tensor_v2`, `_load_from_bytes`) load, as on SGLang.
    tensor, param = torch.randn(3), torch.nn.Parameter(torch.randn(2))
    assert torch.equal(deserialize_payload(entry_of(tensor)), tensor)
    back = deserialize_payload(entry_of({"p": param}))["p"]
    assert type(back) is torch.nn.Parameter and torch.equal(back, param)


class FromBytes:
    """Pickles as `torch.storage._load_from_bytes(data)`: torch's helper would `torch.load` `data` unrestricted."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.data,)


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_load_from_bytes_is_a_weights_only_storage_load_as_on_sglang(tmp_path):
    values = torch.arange(4, dtype=torch.float32)
    back = deserialize_payload(entry_of(FromBytes(saved(values.untyped_storage()))))
    assert isinstance(back, torch.storage.TypedStorage)  # torch.load gives a storage back typed (uint8)
    assert torch.equal(torch.empty(0).set_(back._untyped_storage), values)
    with pytest.raises(ValueError, match="Expected a Torch storage, got dict"):
        deserialize_payload(entry_of(FromBytes(saved({"a": 1}))))
    with pytest.raises(ValueError, match="Weights only load failed"):  # the nested load is restricted too
        deserialize_payload(entry_of(FromBytes(saved(Call(os.system, f"touch {tmp_path / 'pwned'}")))))
    assert not (tmp_path / "pwned").exists()


def test_globals_outside_the_exact_set_are_refused_and_garbage_is_a_value_error():
    with pytest.raises(UnsafePayloadError, match=r"\(posix\.system\)|\(os\.system\)"):
        deserialize_payload(entry_of(Call(os.system, "true")))
    with pytest.raises(UnsafePayloadError, match=r"subprocess\.check_output"):
        deserialize_payload(entry_of(subprocess.check_output))
    with pytest.raises(ValueError, match="not base64"):
        deserialize_payload("not base64 at all!")


def test_each_tp_rank_gets_its_own_pickle_of_the_same_payload():
    payload = flatten_bucket(NAMED)
    entries = entries_for_tp_ranks(payload, 3)
    assert len(entries) == 3
    # Separate pickles: each holds its own reference on the shared buffer, which one receiver drops.
    assert len({id(entry) for entry in entries}) == 3
    for entry in entries:
        assert all(torch.equal(a, b) for (_, a), (_, b) in
                   zip(deserialize_named_tensors(entry, load_format="flattened_bucket"), NAMED))


class _FakeCudaTensor:
    """Pickles as a CUDA tensor from megarl's sender does (torch's `reduce_tensor`, every argument of the same
    type): `rebuild_cuda_tensor` with the GPU's UUID as argument 6. Its globals must all be allowed."""

    def __init__(self, uuid: str):
        self.uuid = uuid

    def __reduce__(self):
        return reductions.rebuild_cuda_tensor, (torch.Tensor, torch.Size([2]), (1,), 0, torch.storage.TypedStorage,
                                                torch.bfloat16, self.uuid, b"handle", 4, 0, False, b"refs", 0,
                                                b"event", False)


def test_a_cuda_handle_resolves_its_gpu_uuid_to_the_receivers_local_index(monkeypatch):
    entries = [base64.b64encode(pickle.dumps([_FakeCudaTensor(uuid)])).decode() for uuid in ("GPU-cccc", "GPU-dddd")]
    calls = []  # torch's rebuild, replaced: no GPU here to map a handle on
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: calls.append(args) or "mapped")
    visible = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]  # what the server process sees, by local index
    assert deserialize_payload(entries[0], visible_devices=lambda: visible) == ["mapped"]
    assert calls[0][6] == 2 and calls[0][:6] == (torch.Tensor, torch.Size([2]), (1,), 0, torch.storage.TypedStorage,
                                                 torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA device GPU-dddd is not visible here"):
        deserialize_payload(entries[1], visible_devices=lambda: visible)
    assert device_index_for_uuid(1, visible) == 1  # an index (a sender without the UUID patch) passes through


def test_each_server_tp_rank_is_handed_the_copy_of_the_trainer_rank_on_its_own_gpu():
    # Colocated, 2 servers x TP2 on 4 GPUs; Ray gave the trainer ranks the GPUs in another order.
    trainer_devices = ["GPU-2", "GPU-0", "GPU-3", "GPU-1"]
    assert holders([["GPU-0", "GPU-1"], ["GPU-2", "GPU-3"]], trainer_devices) == [[1, 3], [0, 2]]
    with pytest.raises(WeightSyncError, match=r"no trainer rank shares a GPU with server 1 TP rank 1 \(device GPU-9\)"):
        holders([["GPU-0", "GPU-1"], ["GPU-2", "GPU-9"]], trainer_devices)


@pytest.mark.gpu
def test_cuda_ipc_handle_maps_the_same_gpu_memory_in_another_process(tmp_path):
    """A real CUDA IPC round trip: this process pickles a bucket on its GPU with the GPU's UUID, a child
    process (which would see the GPUs in another order under Ray) maps it by UUID and reads the same bytes."""
    tensor = torch.arange(1024, dtype=torch.float32, device="cuda").view(32, 32)
    entry = serialize_payload(flatten_bucket([("w", tensor)]))
    script = ("import sys, torch\nfrom megarl.rollout.weight_wire import deserialize_named_tensors\n"
              "(name, t), = deserialize_named_tensors(sys.stdin.read(), load_format='flattened_bucket')\n"
              "print(name, t.device.type, float(t.sum()))\n")
    out = subprocess.run([sys.executable, "-c", script], input=entry, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert out.stdout.split() == ["w", "cuda", str(float(tensor.sum()))]
