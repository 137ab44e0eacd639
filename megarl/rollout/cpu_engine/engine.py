"""The engine state behind the HTTP routes: model, tokenizer, scheduler, weight version, update session, memory.

Control operations are blocking and run on a worker thread of the HTTP server
(`asyncio.to_thread`); the HTTP layer serves weight operations (group joins,
updates, memory release) one at a time, in arrival order, as SGLang's tokenizer
manager and single-threaded scheduler do. Weight updates follow SGLang 0.5.23:
tensor and distributed updates must sit between `begin_weight_update` and
`end_weight_update` (disk updates need no session); each is decoded and checked,
then copied in while the scheduler holds between two decode steps, so requests
paused in place continue on the new weights and report the new `weight_version`.

`FatalError` marks the failures that kill SGLang's scheduler, and with it the
server, because SGLang does not guard them: a tensor payload that is no pickle
or has no entry for a TP rank, a cache flush after an
update while requests run or wait, a memory release while the server is busy.
The HTTP layer answers such a request with 500 and then ends this process, so a
CPU test fails exactly where a GPU cluster would.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable

from megarl.rollout.cpu_engine.lora import LoraError, LoraServing, lora_serving_from_args
from megarl.rollout.cpu_engine.kv_pool import size_pool
from megarl.rollout.cpu_engine.memory import MemorySaver
from megarl.rollout.cpu_engine.scheduler import Scheduler
from megarl.rollout.cpu_engine.sequence import Sequence
from megarl.rollout.cpu_engine.update_group import UpdateGroups
from megarl.rollout.cpu_engine.weights import (
    WeightUpdateError,
    apply_named_tensors,
    eos_token_ids,
    load_model,
    load_tokenizer,
    read_checkpoint,
)
from megarl.rollout.cpu_engine.weight_checker import WeightChecker
from megarl.rollout.weight_wire import (
    UnsafePayloadError,
    deserialize_payload,
    named_tensors_of,
    parse_dtype,
)

SERVER_VERSION = "megarl-cpu-engine/0.1 (SGLang 0.5.23 HTTP protocol)"
RECENT_BUCKETS = 8  # bucket buffers kept mapped: a few per sender, two or four PP stages
TP_SIZE = 1  # one process holds the whole model: tensor updates read entry 0


class FatalError(RuntimeError):
    """A failure SGLang's scheduler does not survive; the server answers it and then exits."""


@dataclass
class EngineArgs:
    """Command-line settings of one engine process."""

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    threads: int = 1
    max_batch: int = 256
    weight_version: str = "default"
    seed: int = 0
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    health_check_timeout_s: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
    weight_update_group_timeout_s: float = 600.0
    max_request_bytes: int = 16 << 20
    max_sequences: int = 256  # sequences (prompts x n) one /generate may ask for
    max_reply_entries: int = 1 << 22  # token entries of one reply: n x tokens x (1 + top_logprobs_num)
    enable_deterministic_inference: bool = False  # honour sampling_seed (SGLang reads it only with this flag)
    # The KV pool (kv_pool): the free memory a GPU would report at start, and SGLang's two flags
    device_memory_bytes: int | None = None
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    # LoRA serving (SGLang's flags; `--lora-paths` implies `--enable-lora`)
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None


class CpuEngine:
    """Everything one server process serves; built once the model has loaded."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.model = load_model(args.model_path, dtype=args.dtype, attn_implementation=args.attn_implementation)
        self.tokenizer = load_tokenizer(
            args.tokenizer_path or args.model_path, required=args.tokenizer_path is not None
        )
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.context_length = int(self.model.config.max_position_embeddings)
        self.kv_pool = size_pool(model=self.model, dtype=self.model.dtype, context_length=self.context_length,
                                 max_batch=args.max_batch, device_memory_bytes=args.device_memory_bytes,
                                 mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens)
        self.weight_version = args.weight_version
        self.memory = MemorySaver(self.model, cpu_backup=args.enable_weights_cpu_backup)
        self.weight_op_in_progress: str | None = None  # set by the HTTP layer, reported by /server_info
        self._update_selector: str | None = None
        self._update_groups = UpdateGroups(timeout_s=args.weight_update_group_timeout_s)
        # The newest shared-memory bucket buffers received: a trainer reuses a few buffers,
        # and while we hold a storage torch's cache maps its file once instead of once per
        # bucket (re-mapping page-faulted ~0.15 s per 1.9 GB, a third of the update time).
        self._recent_buckets: deque = deque(maxlen=RECENT_BUCKETS)
        self._control_lock = threading.Lock()
        self.lora: LoraServing | None = lora_serving_from_args(self.model, args)
        self._checker = WeightChecker(self.model)
        self.scheduler = Scheduler(
            self.model,
            max_batch=args.max_batch,
            eos_token_ids=eos_token_ids(self.model),
            decode=self.decode if self.tokenizer is not None else None,
            seed=args.seed,
            lora=self.lora,
            pool_tokens=self.kv_pool.max_total_num_tokens,
        )
        self.scheduler.start()

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def stamp(self, seq: Sequence) -> None:
        """Record the weight version a finished sequence was (last) generated with."""
        seq.weight_version = self.weight_version

    def shutdown(self) -> None:
        self.scheduler.stop()
        # Unmap the trainer's buffers: the last process to let go of a /dev/shm file removes it,
        # and one that exits still holding it leaves the file behind for good.
        self._recent_buckets.clear()

    def idle(self) -> bool:
        running, waiting = self.scheduler.load()
        return running == 0 and waiting == 0

    # ---- weight updates: each returns (success, message) or raises FatalError -----------------

    def begin_weight_update(self, selector: str) -> tuple[bool, str]:
        with self._control_lock:
            if self._update_selector is not None:
                return False, "a weight-update session is already open; call end_weight_update() first"
            if selector == "draft":
                return False, "begin_weight_update: selector 'draft': this server has no draft model"
            self._update_selector = selector
            return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        with self._control_lock:
            if self._update_selector is None:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self._update_selector = None
            return True, "Success"

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: str | None,
                                   flush_cache: bool, abort_all_requests: bool, weight_version: str | None
                                   ) -> tuple[bool, str]:
        with self._control_lock:
            refused = self._refuse_update("update_weights_from_tensor")
            if refused:
                return False, refused
            if len(serialized_named_tensors) < TP_SIZE:
                # SGLang's TP rank r reads entry r unguarded: an IndexError its scheduler dies of.
                raise FatalError(f"update_weights_from_tensor: serialized_named_tensors has "
                                 f"{len(serialized_named_tensors)} entries, TP rank 0 of {TP_SIZE} has none")
            if len(serialized_named_tensors) > TP_SIZE:
                return False, (f"serialized_named_tensors: expected {TP_SIZE} entry (one per TP rank, this server "
                               f"has {TP_SIZE}), got {len(serialized_named_tensors)}; the extra pickles' shared "
                               f"buffers would never be released")
            try:
                payload = deserialize_payload(serialized_named_tensors[0])
            except UnsafePayloadError as error:
                # Refused at the global, before any of the payload ran; nothing changed.
                return False, f"update_weights_from_tensor: {error}"
            except ValueError as error:
                raise FatalError(f"update_weights_from_tensor: {error}") from error
            try:
                named = named_tensors_of(payload, load_format=load_format)
            except ValueError as error:
                return False, str(error)
            if load_format == "flattened_bucket" and named:
                self._recent_buckets.append(named[0][1].untyped_storage())
            return self._apply(named, flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                               weight_version=weight_version)

    def update_weights_from_disk(self, model_path: str, *, flush_cache: bool, abort_all_requests: bool,
                                 weight_version: str | None) -> tuple[bool, str]:
        with self._control_lock:
            refused = self.memory.refusal("update_weights_from_disk", needs=("weights",))
            if refused:
                return False, refused
            try:
                named = read_checkpoint(self.model, model_path)
            except WeightUpdateError as error:
                return False, f"update refused, no weight changed: {error}"
            except OSError as error:
                return False, f"model_path {model_path!r}: {error}"
            return self._apply(named, flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                               weight_version=weight_version)

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str) -> tuple[bool, str]:
        try:
            self._update_groups.join(master_address=master_address, master_port=master_port,
                                     rank=rank_offset, world_size=world_size, group_name=group_name)
        except (ValueError, RuntimeError) as error:
            return False, f"init_weights_update_group failed: {error}"
        return True, f"Joined {group_name!r} as rank {rank_offset} of {world_size}"

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, load_format: str | None, flush_cache: bool,
                                        abort_all_requests: bool, weight_version: str | None) -> tuple[bool, str]:
        with self._control_lock:
            refused = self._refuse_update("update_weights_from_distributed")
        try:
            torch_dtypes = [parse_dtype(dtype) for dtype in dtypes]
            # The scheduler waits while this receives, as SGLang's does (it receives on the scheduler
            # thread). Everything is received even when it will be refused: a receiver that stops
            # early would leave the trainer blocked in its broadcast.
            with self.scheduler.hold(), self._update_groups.received(
                    group_name, names, torch_dtypes, shapes, flattened=load_format == "flattened_bucket") as named:
                if refused:
                    return False, refused
                with self._control_lock:
                    return self._apply(named, flush_cache=flush_cache, abort_all_requests=abort_all_requests,
                                       weight_version=weight_version, held=True)
        except (ValueError, RuntimeError) as error:
            if isinstance(error, FatalError):
                raise
            return False, str(error)

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        try:
            self._update_groups.destroy(group_name)
        except ValueError as error:
            return False, str(error)
        return True, "Success"

    def check_weights(self, action: str, skip_tensor_list: list[str] | None = None) -> tuple[bool, str, dict]:
        """SGLang's `/weights_checker` (see `weight_checker`), run between two decode steps."""
        with self._control_lock, self.scheduler.hold():
            refused = self.memory.refusal("check weights", needs=("weights",))
            if refused:
                return False, refused, {}
            return self._checker.handle(action, skip_tensor_list)

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool) -> None:
        with self._control_lock:
            if abort_all_requests:
                self.scheduler.abort(abort_all=True, message="aborted by update_weight_version")
            self.weight_version = new_version

    def _refuse_update(self, action: str) -> str | None:
        if self._update_selector is None:
            return f"{action} must run between begin_weight_update() and end_weight_update()"
        return self.memory.refusal(action, needs=("weights",))

    def _apply(self, named, *, flush_cache: bool, abort_all_requests: bool, weight_version: str | None,
               held: bool = False) -> tuple[bool, str]:
        if abort_all_requests:
            self.scheduler.abort(abort_all=True, message="aborted by a weight update")
        with nullcontext() if held else self.scheduler.hold():
            try:
                count = apply_named_tensors(self.model, named)
            except WeightUpdateError as error:
                return False, f"update refused, no weight changed: {error}"
            self.memory.updated()
            if weight_version is not None:
                self.weight_version = weight_version
        if flush_cache and not self.flush_cache():
            # SGLang: `assert flush_cache_success, "Cache flush failed after updating weights"` in its scheduler.
            running, waiting = self.scheduler.load()
            raise FatalError(f"Cache flush failed after updating weights: flush_cache is true while {running} "
                             f"requests run and {waiting} wait (pause with mode 'abort', or send flush_cache: false "
                             f"and flush once the server is idle)")
        return True, f"Succeeded to update {count} tensors"

    # ---- LoRA adapters: each returns (success, error message or None, loaded adapters) -----------

    def lora_operation(self, call: Callable[[LoraServing], dict]) -> tuple[bool, str | None, dict | None]:
        """`call(self.lora)` (a load or an unload) with SGLang's refusal without --enable-lora; a refused one
        answers its message. A `FatalError` (an unreadable tensor payload) goes up."""
        if self.lora is None:
            return False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", None
        try:
            return True, None, call(self.lora)
        except LoraError as error:
            return False, str(error), None

    def lora_tensors(self, serialized_named_tensors: list[str], load_format: str | None) -> list:
        """The adapter tensors of TP rank 0's entry, read as `update_weights_from_tensor` reads its entry."""
        if len(serialized_named_tensors) < TP_SIZE:
            raise FatalError(f"load_lora_adapter_from_tensors: serialized_named_tensors has "
                             f"{len(serialized_named_tensors)} entries, TP rank 0 of {TP_SIZE} has none")
        if len(serialized_named_tensors) > TP_SIZE:
            raise LoraError(f"serialized_named_tensors: expected {TP_SIZE} entry (one per TP rank), got "
                            f"{len(serialized_named_tensors)}; the extra pickles' shared buffers would never be "
                            f"released")
        try:
            payload = deserialize_payload(serialized_named_tensors[0])
        except (UnsafePayloadError, ValueError) as error:
            raise FatalError(f"load_lora_adapter_from_tensors: {error}") from error
        try:
            return named_tensors_of(payload, load_format=load_format)
        except ValueError as error:
            raise LoraError(str(error)) from None

    # ---- memory --------------------------------------------------------------------------------

    def release_memory_occupation(self, tags: list[str] | None) -> tuple[bool, str]:
        with self._control_lock:
            if not self.args.enable_memory_saver:
                # SGLang without the flag answers success and frees nothing: refusing makes that visible.
                return False, "release_memory_occupation needs the server started with --enable-memory-saver"
            try:
                chosen = MemorySaver.tags_of(tags)
            except ValueError as error:
                return False, str(error)
            if not self.idle():
                running, waiting = self.scheduler.load()
                raise FatalError(f"release_memory_occupation should be called only when server is idle "
                                 f"({running} requests run, {waiting} wait)")
            with self.scheduler.hold():
                self.memory.release(chosen)
            return True, f"Released {chosen}"

    def resume_memory_occupation(self, tags: list[str] | None) -> tuple[bool, str]:
        with self._control_lock:
            if not self.args.enable_memory_saver:
                return False, "resume_memory_occupation needs the server started with --enable-memory-saver"
            try:
                chosen = MemorySaver.tags_of(tags)
            except ValueError as error:
                return False, str(error)
            with self.scheduler.hold():
                self.memory.resume(chosen)
            return True, f"Resumed {chosen}"

    # ---- state ---------------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """No prefix cache to drop on CPU; like SGLang, refuse while requests run or wait."""
        return self.idle()

    def model_info(self) -> dict:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or (self.args.model_path if self.tokenizer else None),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
        }

    def server_info(self) -> dict:
        running, waiting = self.scheduler.load()
        settings = {key: value for key, value in asdict(self.args).items() if key != "api_key"}
        return {
            **settings,
            "version": SERVER_VERSION,
            "tp_size": TP_SIZE,
            "weight_version": self.weight_version,
            "context_length": self.context_length,
            # SGLang's scheduler_info, merged into /get_server_info
            "max_total_num_tokens": self.kv_pool.max_total_num_tokens,
            "max_req_input_len": self.kv_pool.max_req_input_len,
            "internal_states": [{"memory_usage": self.kv_pool.memory_usage()}],
            "vocab_size": self.vocab_size,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "paused": self.scheduler.paused,
            "weight_update_session_open": self._update_selector is not None,
            "memory_released": sorted(self.memory.released),
            "weight_op_in_progress": self.weight_op_in_progress,
        }
