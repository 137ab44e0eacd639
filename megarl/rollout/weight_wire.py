"""SGLang's weight-update wire formats: the one place both sides of a weight sync take them from.

`megarl.weightsync` (the senders) and megarl's CPU engine (a receiver) import this
module, so the sender side never depends on the test engine, and what the CPU
engine accepts is exactly what real SGLang 0.5.23 accepts:

- Tensor payloads of `/update_weights_from_tensor`: `serialized_named_tensors` holds
  one entry per server TP rank (SGLang's TP rank r reads entry r), each a separate
  `base64(ForkingPickler pickle)`: one pickle per receiver, because every pickled
  shared storage carries one reference that exactly one unpickling drops. The payload
  is a list of `(name, tensor)`, or with `load_format: "flattened_bucket"` a dict
  `{"flattened_tensor": <1-D uint8 tensor>, "metadata": [...]}` whose metadata are
  `types.SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)` with byte
  offsets, the fields SGLang's `FlattenedTensorBucket` reads
  (`srt/weight_sync/tensor_bucket.py`). A namespace, not a class of our own: SGLang
  unpickles with an allow-list (`SafeUnpickler`, `srt/utils/common.py`) that
  refuses any other module's globals, and its scheduler dies of the refusal.
- Restricted unpickling: `SafeUnpickler` allows SGLang 0.5.23's exact set of `(module, name)`
  pairs (`SGLANG_ALLOWED_GLOBALS`) and refuses any other with SGLang's text, so a payload the
  CPU engine loads is one SGLang loads and one it refuses, SGLang refuses.
- CUDA tensors travel with the *UUID* of their GPU instead of its index (SGLang's
  `monkey_patch_torch_reductions`, `srt/utils/patch_torch.py`): the trainer's
  `cuda:0` under Ray and the server's `cuda:0` are different GPUs. Pickling swaps
  index for UUID in a private dispatch table (no global patch); unpickling maps the
  UUID back to a local index (`device_index_for_uuid`).
- SGLang's weight checksums (`tensor_checksum`, `rank_checksum`, `engine_checksum`) for
  `/weights_checker` and `weight_sync.verify: checksum`.
- The name of the adapter a weight version loads (`lora_adapter_name`).
- Weight-update groups: `new_update_group` is SGLang's `init_custom_process_group`
  rendezvous (TCP store at the trainer, `PrefixStore(group_name)`, a group outside
  the default one) for both the trainer (rank 0) and each server TP rank.

Imports only torch and the standard library, so it also runs where megarl's other
dependencies are not installed (the GPU check machine).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import pickle
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler
from torch.multiprocessing import reductions

from megarl.net import gloo_interface_toward, host_port

LOAD_FORMATS = (None, "direct", "flattened_bucket")
METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
NamedTensors = list[tuple[str, torch.Tensor]]


# ---- bucket metadata and payloads ------------------------------------------------------------


def tensor_metadata(name: str, shape: Sequence[int], dtype: torch.dtype, start_idx: int, nbytes: int
                    ) -> SimpleNamespace:
    """One tensor's entry of a flattened bucket: bytes `[start_idx, start_idx + nbytes)` of the buffer."""
    return SimpleNamespace(name=name, shape=torch.Size(shape), dtype=dtype, start_idx=int(start_idx),
                           end_idx=int(start_idx) + int(nbytes), numel=int(nbytes))


def flattened_payload(flat: torch.Tensor, metadata: list[SimpleNamespace]) -> dict[str, Any]:
    """The "flattened_bucket" payload of a filled uint8 buffer (which must cover every entry's bytes)."""
    return {"flattened_tensor": flat, "metadata": metadata}


def flatten_bucket(named_tensors: NamedTensors) -> dict[str, Any]:
    """Pack tensors of any dtypes into one uint8 buffer plus metadata (a copy; senders with their own
    bucket buffers build the payload with `tensor_metadata` + `flattened_payload` instead)."""
    if not named_tensors:
        raise ValueError("flatten_bucket: named_tensors is empty")
    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        metadata.append(tensor_metadata(name, tensor.shape, tensor.dtype, offset, flat.numel()))
        offset += flat.numel()
    return flattened_payload(torch.cat(parts), metadata)


def unflatten_bucket(payload: Any) -> NamedTensors:
    """The tensors of a "flattened_bucket" payload, as views into its buffer; ValueError naming the bad entry."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise ValueError("flattened_bucket payload must be a dict with exactly 'flattened_tensor' and 'metadata'")
    flat = payload["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError("flattened_bucket: 'flattened_tensor' must be a 1-D uint8 tensor")
    named: NamedTensors = []
    for index, meta in enumerate(payload["metadata"]):
        missing = [field for field in METADATA_FIELDS if not hasattr(meta, field)]
        if missing:
            raise ValueError(f"flattened_bucket: metadata entry {index} lacks {missing}")
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel() or meta.numel != meta.end_idx - meta.start_idx:
            raise ValueError(f"flattened_bucket: tensor {meta.name!r} byte range [{meta.start_idx}, {meta.end_idx}) "
                             f"(numel {meta.numel}) does not fit the {flat.numel()}-byte buffer")
        piece = flat[meta.start_idx : meta.end_idx]
        if piece.numel() != math.prod(meta.shape) * meta.dtype.itemsize:
            raise ValueError(f"flattened_bucket: tensor {meta.name!r} has {piece.numel()} bytes, shape "
                             f"{tuple(meta.shape)} of {meta.dtype} needs {math.prod(meta.shape) * meta.dtype.itemsize}")
        named.append((meta.name, piece.view(meta.dtype).view(tuple(meta.shape))))
    return named


# ---- serialisation: one entry per server TP rank -----------------------------------------------


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device `index`, as SGLang writes it (`str(get_device_properties(i).uuid)`)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_for_uuid(uuid: str | int, visible: Sequence[str]) -> int:
    """The local index of the device called `uuid` among the `visible` devices' UUIDs (an int passes through)."""
    if isinstance(uuid, int):
        return uuid
    for index, candidate in enumerate(visible):
        if candidate == uuid:
            return index
    raise ValueError(f"CUDA device {uuid} is not visible here (visible: {list(visible) or 'none'})")


def _reduce_tensor_by_uuid(tensor: torch.Tensor):
    # A Parameter travels as the plain tensor it wraps (same storage): a weight update needs the values only,
    # and the receiver then needs no `torch.nn.parameter.Parameter` global.
    rebuild, args = reductions.reduce_tensor(tensor.detach() if isinstance(tensor, torch.nn.Parameter) else tensor)
    if tensor.is_cuda:  # argument 6 of rebuild_cuda_tensor is the device index
        args = (*args[:6], device_uuid(args[6]), *args[7:])
    return rebuild, args


def serialize_payload(payload: Any) -> str:
    """One `serialized_named_tensors` entry: CPU storages go by /dev/shm name, CUDA ones by IPC handle + GPU UUID."""
    # file_system sharing: the pickle carries a file name, which survives an HTTP body (a file
    # descriptor would not) and which any process on this host can open.
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_by_uuid  # this pickler's own table, not a global patch
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor_by_uuid
    pickler.dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def entries_for_tp_ranks(payload: Any, tp_size: int) -> list[str]:
    """`serialized_named_tensors` for a server with `tp_size` TP ranks that all load `payload`: one pickle each."""
    return [serialize_payload(payload) for _ in range(tp_size)]


def serialize_named_tensors(named_tensors: NamedTensors, *, load_format: str | None = None) -> str:
    """One rank's entry for `named_tensors` in `load_format` (a copy into one buffer for "flattened_bucket")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    return serialize_payload(flatten_bucket(named_tensors) if load_format == "flattened_bucket"
                             else list(named_tensors))


class UnsafePayloadError(RuntimeError):
    """A payload naming a global outside SGLang's allow-list (refused before anything of it ran)."""


# SGLang 0.5.23's `SafeUnpickler.ALLOWED_GLOBALS` (`python/sglang/srt/utils/common.py`), all 202 exact
# `(module, name)` pairs, in SGLang's order: (module, its names). Data, not a rule of megarl's own, so the
# CPU engine loads exactly what SGLang loads. Pairs whose module is not installed here (`sglang.*`,
# `torch_npu.*`) are allowed and fail to import, a malformed payload (400).
SGLANG_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset((module, name) for module, names in (
    ("builtins", "bool bytearray bytes complex dict float frozenset int list range set slice str "
                 "tuple"),
    ("collections", "OrderedDict defaultdict deque Counter"),
    ("copyreg", "__newobj__ __newobj_ex__"),
    ("functools", "partial"),
    ("itertools", "chain repeat"),
    ("multiprocessing.reduction", "_rebuild_partial _rebuild_socket"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("types", "SimpleNamespace"),
    ("_codecs", "encode"),
    ("torch", "Tensor BFloat16Tensor BoolTensor ByteTensor CharTensor DoubleTensor FloatTensor "
              "HalfTensor IntTensor LongTensor ShortTensor"),
    ("torch.cuda", "BFloat16Tensor BoolTensor ByteTensor CharTensor DoubleTensor FloatTensor "
                   "HalfTensor IntTensor LongTensor ShortTensor"),
    ("torch.cuda.sparse", "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor "
                          "HalfTensor IntTensor LongTensor ShortTensor"),
    ("torch.sparse", "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor "
                     "IntTensor LongTensor ShortTensor"),
    ("torch", "Size device dtype bcomplex32 bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 "
              "bool cdouble cfloat chalf complex128 complex32 complex64 double float float16 "
              "float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
              "float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 "
              "int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16 "
              "uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_parameter "
                     "_rebuild_parameter_with_state _rebuild_qtensor _rebuild_sparse_tensor "
                     "_rebuild_meta_tensor_no_storage _rebuild_wrapper_subclass "
                     "_rebuild_device_tensor_from_numpy _rebuild_device_tensor_from_cpu_tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage _UntypedStorage TypedStorage"),
    ("torch", "UntypedStorage BFloat16Storage BoolStorage ByteStorage CharStorage "
              "ComplexDoubleStorage ComplexFloatStorage DoubleStorage FloatStorage HalfStorage "
              "IntStorage LongStorage QInt32Storage QInt8Storage QUInt2x4Storage QUInt4x2Storage "
              "QUInt8Storage ShortStorage"),
    ("torch.cuda", "BFloat16Storage BoolStorage ByteStorage CharStorage ComplexDoubleStorage "
                   "ComplexFloatStorage DoubleStorage FloatStorage HalfStorage IntStorage "
                   "LongStorage ShortStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor rebuild_meta_tensor rebuild_cuda_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor"),
    ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified"),
    ("torch.multiprocessing.reductions", "rebuild_nested_tensor rebuild_sparse_coo_tensor "
                                         "rebuild_sparse_compressed_tensor rebuild_storage_fd "
                                         "rebuild_storage_filename rebuild_storage_empty "
                                         "rebuild_typed_storage rebuild_typed_storage_child"),
    ("torch", "per_tensor_affine per_tensor_symmetric per_channel_affine per_channel_symmetric "
              "per_channel_affine_float_qparams"),
    ("sglang.srt.managers.io_struct", "GenerateReqInput EmbeddingReqInput"),
    ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
    ("sglang.srt.managers.schedule_batch", "Modality"),
    ("sglang.srt.multimodal.modality", "Modality"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata FlattenedTensorBucket"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
) for name in names.split())


def _load_storage_from_bytes(data: bytes):
    """What SGLang loads for `torch.storage._load_from_bytes` (a plainly pickled storage): torch's own helper
    runs an unrestricted nested `torch.load`, this one a weights-only load that must yield a storage."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


class SafeUnpickler(pickle.Unpickler):
    """SGLang 0.5.23's rule (`SafeUnpickler.find_class`, `srt/utils/common.py`): a global loads only if its
    exact `(module, name)` pair is in `SGLANG_ALLOWED_GLOBALS`, and `torch.storage._load_from_bytes` loads as
    a weights-only storage; no module prefix is trusted, because `builtins`, `torch`, `functools`, `operator`
    and SGLang's own modules all hold callables that chain into arbitrary code. The refusal's text is
    SGLang's, so a log line reads the same on both servers."""

    ALLOWED_GLOBALS = SGLANG_ALLOWED_GLOBALS

    def __init__(self, file, *, visible_devices: Callable[[], Sequence[str]]):
        super().__init__(file)
        self._visible_devices = visible_devices

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_from_bytes
        if (module, name) not in self.ALLOWED_GLOBALS:
            raise UnsafePayloadError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        found = super().find_class(module, name)
        if found is reductions.rebuild_cuda_tensor:
            return self._rebuild_cuda_tensor
        return found

    def _rebuild_cuda_tensor(self, *args):
        # SGLang's receiver patch: the sender wrote its GPU's UUID where torch expects an index.
        index = device_index_for_uuid(args[6], self._visible_devices())
        return reductions.rebuild_cuda_tensor(*args[:6], index, *args[7:])


def visible_device_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by local index (none without CUDA)."""
    return [device_uuid(index) for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def deserialize_payload(serialized: str | bytes, *,
                        visible_devices: Callable[[], Sequence[str]] = visible_device_uuids) -> Any:
    """Inverse of `serialize_payload` under SGLang's allow-list.

    Raises UnsafePayloadError for a refused global and ValueError for anything that is
    not a base64 pickle (SGLang's own failure on both is fatal to its scheduler).
    """
    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError, TypeError) as error:
        raise ValueError(f"serialized_named_tensors entry is not base64: {error}") from error
    try:
        return SafeUnpickler(io.BytesIO(raw), visible_devices=visible_devices).load()
    except UnsafePayloadError:
        raise
    except Exception as error:  # noqa: BLE001 - any other unpickling failure is a malformed payload
        raise ValueError(f"serialized_named_tensors entry is not a ForkingPickler payload: {error}") from error


def named_tensors_of(payload: Any, *, load_format: str | None) -> NamedTensors:
    """The (name, tensor) pairs of a deserialised payload in `load_format`; ValueError when malformed."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "flattened_bucket":
        return unflatten_bucket(payload)
    if not isinstance(payload, (list, tuple)) or not all(
            isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor) for item in payload):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in payload]


def deserialize_named_tensors(serialized: str | bytes, *, load_format: str | None = None) -> NamedTensors:
    """`deserialize_payload` then `named_tensors_of`."""
    return named_tensors_of(deserialize_payload(serialized), load_format=load_format)


# ---- checksums (SGLang's `/weights_checker`, `srt/utils/weight_checker.py`) ----------------------

def lora_adapter_name(version: object) -> str:
    """The name a LoRA adapter pushed under weight version `version` is loaded as (adapter-only sync), which
    every generation then names as its `lora_path`."""
    return f"megarl-v{version}"


# SGLang 0.5.23's `_NON_PERSISTENT_BUFFER_PATTERNS` (`srt/utils/weight_checker.py`): tables rebuilt at start-up,
# never loaded, which its weight checker leaves out of checksum, compare and reset.
NON_PERSISTENT_BUFFER_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis",
                                  "expert_mask_gpu")


def skips_weight_check(name: str, tensor: torch.Tensor, skip_tensor_list: Sequence[str] | None = None) -> bool:
    """SGLang's `_is_skip_weight_check`: a tensor the weight checker leaves out, by a pattern in its name, its
    `_skip_weight_check` attribute, or a name fragment the request's `skip_tensor_list` gives."""
    return (any(pattern in name for pattern in NON_PERSISTENT_BUFFER_PATTERNS)
            or getattr(tensor, "_skip_weight_check", False)
            or any(pattern in name for pattern in (skip_tensor_list or ())))


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor checksum of a CPU tensor: the first 8 bytes of the SHA-256 of its raw bytes, as
    16 hex digits (`weight_checker._hash_tensor` over `mm_utils.tensor_hash`). On GPUs SGLang hashes with a
    kernel of its own, whose values differ: compare checksums only between CPU holders."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{int.from_bytes(hashlib.sha256(memoryview(raw.numpy())).digest()[:8], 'big'):016x}"


def held_checksum(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> str:
    """The checksum a server holding `tensor` in floating `dtype` reports (a bf16 trainer tensor, widened
    exactly, as the float32 CPU engine holds it); non-floating tensors are held as they are."""
    values = tensor.detach()
    return tensor_checksum(values.to(dtype) if values.is_floating_point() else values)


def rank_checksum(checksums: dict[str, str]) -> str:
    """SGLang's `per_gpu_checksum`: SHA-256 over the tensor names in sorted order, each followed by its checksum."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(name.encode())
        digest.update(checksums[name].encode())
    return digest.hexdigest()


def engine_checksum(rank_checksums: Sequence[str]) -> str:
    """SGLang's `per_engine_checksum`: SHA-256 over every rank's `per_gpu_checksum`, in rank order."""
    digest = hashlib.sha256()
    for checksum in rank_checksums:
        digest.update(checksum.encode())
    return digest.hexdigest()


# ---- weight-update groups ----------------------------------------------------------------------


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16; ValueError for anything that is not a dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype")
    return dtype


def wire_dtype(dtype: torch.dtype) -> str:
    """How `/update_weights_from_distributed` names a dtype ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def new_update_group(*, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                     backend: str, timeout_s: float):
    """Join weight-update group `group_name` as `rank` (0 hosts the store); blocks until every rank joined."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if backend == "gloo":
        gloo_interface_toward(master_address)  # gloo's own pick is the hostname's address, maybe 127.0.1.1
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(rendezvous(f"tcp://{host_port(master_address, master_port)}", rank, world_size,
                                  timeout=timeout))
    store.set_timeout(timeout)
    group = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    group = group[0] if isinstance(group, tuple) else group  # some torch versions return (group, store)
    # Registered ranks let destroy_process_group forget the name, so a later group may reuse it.
    _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group
