"""LoRA serving in the CPU engine, with the rules SGLang 0.5.23 serves adapters by (`--enable-lora`).

Adapters are PEFT adapters: a PEFT `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`) and tensors named as PEFT saves them
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). They come from a
directory (`--lora-paths`, `/load_lora_adapter`) or from tensors
(`/load_lora_adapter_from_tensors`), go by name (`/unload_lora_adapter`), and each prompt of a
`/generate` names its adapter with `lora_path` (None: the base model).

The registry follows SGLang's `LoRARegistry` and tokenizer manager: a name is loaded once
("LoRA with name ... already exists"); a request naming an adapter that is not loaded is
refused ("The following requested LoRA adapters are not loaded"); unloading first removes
the name, then waits until no request uses the adapter; beyond `--max-loaded-loras` the least
recently used unpinned adapter is unloaded. As SGLang's memory pool, sized at start-up, an
adapter of a rank above `--max-lora-rank` or targeting modules outside `--lora-target-modules`
is refused, and the scheduler admits at most `--max-loras-per-batch` distinct adapters (the
base model counting as one) into a running batch.

Compute: a forward hook on each target linear of the HF model adds scale * B A x (scale =
alpha / r, or alpha / sqrt(r) with `use_rslora`) to the batch rows whose sequence uses an
adapter; `rows(...)` tells the hooks which adapter each row uses during one forward pass.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.rollout.weight_wire import tensor_checksum

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors


class LoraError(ValueError):
    """A refused LoRA operation or request; the message is SGLang's where SGLang has one."""


@dataclass
class Adapter:
    name: str
    path: str
    pinned: bool
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # HF linear path -> (A [r, in], B [out, r])
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    in_flight: int = 0


class LoraServing:
    """The adapters of one server and the hooks that apply them; thread-safe."""

    def __init__(self, model: torch.nn.Module, *, max_lora_rank: int, target_modules: list[str],
                 max_loras_per_batch: int, max_loaded_loras: int | None):
        unknown = sorted(set(target_modules) - set(SUPPORTED_MODULES))
        if unknown:
            raise ValueError(f"--lora-target-modules: {unknown} are not among {list(SUPPORTED_MODULES)}")
        self.max_lora_rank, self.target_modules = max_lora_rank, frozenset(target_modules)
        self.max_loras_per_batch, self.max_loaded_loras = max_loras_per_batch, max_loaded_loras
        self._linears = {name: module for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in self.target_modules}
        self._registry: OrderedDict[str, Adapter] = OrderedDict()  # LRU order: most recently used last
        self._cond = threading.Condition()
        self._rows: list[Adapter | None] | None = None
        for name, module in self._linears.items():
            module.register_forward_hook(self._hook(name))

    # ---- requests -------------------------------------------------------------------------------

    def acquire(self, names: list[str | None]) -> list[Adapter | None]:
        """The adapters `names` call for (None: the base model), each counted in use until `release`."""
        with self._cond:
            adapters = []
            for name in names:
                if name is None:
                    adapters.append(None)
                    continue
                adapter = self._registry.get(name)
                if adapter is None:
                    raise LoraError(f"The following requested LoRA adapters are not loaded: {name}\n"
                                    f"Loaded adapters: {self._registry.keys()}.")
                self._registry.move_to_end(name)
                adapters.append(adapter)
            for adapter in adapters:
                if adapter is not None:
                    adapter.in_flight += 1
            return adapters

    def release(self, adapters: list[Adapter | None]) -> None:
        with self._cond:
            for adapter in adapters:
                if adapter is not None:
                    adapter.in_flight -= 1
            self._cond.notify_all()

    def admits(self, running: set[str | None], adapter: Adapter | None) -> bool:
        """Whether a batch running `running` (adapter ids, None = base) may take a sequence on `adapter`."""
        lora_id = adapter.lora_id if adapter is not None else None
        return lora_id in running or len(running) < self.max_loras_per_batch

    @contextmanager
    def rows(self, adapters: list[Adapter | None]):
        """During the block, row i of every forward pass uses `adapters[i]` (called from the scheduler thread)."""
        self._rows = adapters if any(adapter is not None for adapter in adapters) else None
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, name: str):
        def add_adapters(module, args, output):
            rows = self._rows
            if rows is None:
                return output
            x = args[0]
            for adapter in {id(a): a for a in rows if a is not None}.values():
                weights = adapter.weights.get(name)
                if weights is None:
                    continue
                lora_a, lora_b = weights
                index = torch.tensor([row for row, a in enumerate(rows) if a is adapter], dtype=torch.long)
                delta = (x[index] @ lora_a.t().to(x.dtype)) @ lora_b.t().to(x.dtype)
                output[index] += adapter.scale * delta
            return output

        return add_adapters

    # ---- loading and unloading --------------------------------------------------------------------

    def loaded(self) -> dict[str, str]:
        """{name: path} of the loaded adapters (SGLang's `loaded_adapters`)."""
        with self._cond:
            return {name: adapter.path for name, adapter in self._registry.items()}

    def load_dir(self, name: str, path: str, *, pinned: bool) -> dict[str, str]:
        """An adapter from a PEFT adapter directory."""
        directory = Path(path).expanduser()
        try:
            config = json.loads((directory / ADAPTER_CONFIG).read_text())
            tensors = list(load_file(str(directory / ADAPTER_WEIGHTS)).items())
        except (OSError, ValueError) as error:
            raise LoraError(f"Failed to load LoRA adapter {name} from {path}: {error}") from None
        return self._load(name, path, config, tensors, pinned=pinned)

    def load_tensors(self, name: str, config: dict, tensors: list[tuple[str, torch.Tensor]], *, pinned: bool,
                     expected_checksums: dict[str, str] | None) -> dict[str, str]:
        """An adapter from (name, tensor) pairs; `expected_checksums` ({tensor: SGLang's per-tensor checksum,
        `weight_wire.tensor_checksum`}) must match."""
        if expected_checksums is not None:
            received = dict(tensors)
            bad = [key for key, digest in expected_checksums.items()
                   if key not in received or tensor_checksum(received[key]) != digest]
            if bad:
                raise LoraError(f"LoRA adapter {name}: checksum mismatch for {sorted(bad)[:5]}")
        return self._load(name, TENSOR_PATH, config, tensors, pinned=pinned)

    def _load(self, name: str, path: str, config: dict, tensors, *, pinned: bool) -> dict[str, str]:
        adapter = self._parse(name, path, config, tensors, pinned=pinned)
        evicted = []
        with self._cond:
            if name in self._registry:
                raise LoraError(f"LoRA with name {name} already exists. Loaded LoRAs: {self._registry.keys()}")
            self._registry[name] = adapter
            limit = self.max_loaded_loras
            while limit is not None and len(self._registry) > limit:
                victim = next((n for n, a in self._registry.items() if not a.pinned), None)
                if victim is None:
                    raise LoraError("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                                    f"LoRA registry is: {dict(self._registry)}")
                evicted.append(self._registry.pop(victim))
        for old in evicted:
            self._wait_unused(old)
        return self.loaded()

    def unload(self, name: str) -> dict[str, str]:
        """Forget `name` at once for new requests; returns once no request uses it any more."""
        with self._cond:
            adapter = self._registry.pop(name, None)
            if adapter is None:
                raise LoraError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._registry.keys()}")
        self._wait_unused(adapter)
        return self.loaded()

    def _wait_unused(self, adapter: Adapter) -> None:
        with self._cond:
            self._cond.wait_for(lambda: adapter.in_flight == 0)

    def _parse(self, name: str, path: str, config: dict, tensors, *, pinned: bool) -> Adapter:
        """Check a PEFT config and its tensors against the server's limits and the model's linears."""
        rank, alpha = config.get("r"), config.get("lora_alpha")
        modules = config.get("target_modules")
        if isinstance(modules, str):
            modules = [modules]
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or not modules:
            raise LoraError(f"LoRA adapter {name}: the config needs a positive integer r, lora_alpha and "
                            f"target_modules (got r={rank!r}, lora_alpha={alpha!r}, target_modules={modules!r})")
        if rank > self.max_lora_rank or not set(modules) <= self.target_modules:
            raise LoraError(f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                            "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                            "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in tensors:
            key = tensor_name.removeprefix(PEFT_PREFIX)
            for kind in ("lora_A", "lora_B"):
                suffix = f".{kind}.weight"
                if key.endswith(suffix) and key[: -len(suffix)] in self._linears:
                    parts.setdefault(key[: -len(suffix)], {})[kind] = tensor
                    break
            else:
                raise LoraError(f"LoRA adapter {name}: tensor {tensor_name} adapts no target linear of the model")
        weights = {}
        for linear, pair in parts.items():
            module = self._linears[linear]
            expected = {"lora_A": (rank, module.in_features), "lora_B": (module.out_features, rank)}
            for kind, shape in expected.items():
                tensor = pair.get(kind)
                if tensor is None or tuple(tensor.shape) != shape:
                    got = None if tensor is None else tuple(tensor.shape)
                    raise LoraError(f"LoRA adapter {name}: {linear}.{kind} has shape {got}, expected {shape}")
                if not torch.isfinite(tensor).all():
                    raise LoraError(f"LoRA adapter {name}: {linear}.{kind} holds NaN or infinite values")
            weights[linear] = (pair["lora_A"].detach().float().clone(), pair["lora_B"].detach().float().clone())
        return Adapter(name=name, path=path, pinned=pinned, rank=rank, scale=scale, weights=weights)


def parse_lora_path(spec: str) -> tuple[str, str, bool]:
    """One `--lora-paths` entry, in SGLang's forms: PATH | NAME=PATH | JSON {"lora_name", "lora_path", "pinned"}."""
    text = spec.strip()
    if text.startswith("{"):
        entry = json.loads(text)
        return entry["lora_name"], entry["lora_path"], bool(entry.get("pinned", False))
    if "=" in text:
        name, path = text.split("=", 1)
        return name, path, False
    return text, text, False


def lora_serving_from_args(model: torch.nn.Module, args) -> LoraServing | None:
    """The server's LoRA serving (None without `--enable-lora` / `--lora-paths`), with the `--lora-paths` adapters
    loaded; an unset `--max-lora-rank` / `--lora-target-modules` is inferred from them, as SGLang does."""
    if not (args.enable_lora or args.lora_paths):
        return None
    initial = [parse_lora_path(spec) for spec in args.lora_paths or []]
    configs = [json.loads((Path(path).expanduser() / ADAPTER_CONFIG).read_text()) for _, path, _ in initial]
    rank = args.max_lora_rank or max(config["r"] for config in configs)
    modules = args.lora_target_modules
    if modules == ["all"]:
        modules = list(SUPPORTED_MODULES)
    elif not modules:
        modules = sorted({module for config in configs for module in config["target_modules"]})
    serving = LoraServing(model, max_lora_rank=rank, target_modules=modules,
                          max_loras_per_batch=args.max_loras_per_batch, max_loaded_loras=args.max_loaded_loras)
    for name, path, pinned in initial:
        serving.load_dir(name, path, pinned=pinned)
    return serving
