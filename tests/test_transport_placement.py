"""`megarl validate` refuses placements that cannot work on GPUs, each with one line naming the keys; a
transport is one registry entry, bound for `megarl bench` included.

The transport rules come from the weight-sync transport registry's metadata
(`needs_colocation` / `refuses_colocation`), not from names written into the checks,
and `megarl bench` sets a sync against the `bound` the entry carries.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import main
from megarl.registry import WEIGHT_SYNC_TRANSPORTS
from megarl.weightsync import DiskTransport, make_transport

REPO = Path(__file__).resolve().parents[1]
PRODUCTION = REPO / "recipes" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"  # colocated, 2 x 8 GPUs, rollout tp 2
DISAGGREGATED = [
    "placement.colocate=false",
    "placement.pools={train: {nodes: 1, gpus_per_node: 8}, gen: {nodes: 1, gpus_per_node: 8}}",
    "placement.roles={actor: train, reference: train, rollout: gen}",
    "rollout.num_servers=4",
]


def errors(capsys, *overrides: str) -> list[str]:
    argv = ["validate", str(PRODUCTION)]
    for override in overrides:
        argv += ["--set", override]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2 and out == "", (status, out, err)
    return err.splitlines()


def test_the_production_recipe_validates(capsys):
    assert main(["validate", "--offline", str(PRODUCTION)]) == 0
    capsys.readouterr()


def test_colocated_distributed_is_refused_naming_the_keys(capsys):
    assert errors(capsys, "weight_sync.transport=distributed") == [
        "error: --set: weight_sync.transport: a sender and a server TP rank on one GPU would join one NCCL communicator, "
        "which NCCL refuses; use 'disk' or 'tensor' with colocate: true (got 'distributed')"
    ]


def test_disaggregated_tensor_is_refused_and_distributed_is_accepted(capsys):
    assert errors(capsys, *DISAGGREGATED, "weight_sync.transport=tensor") == [
        "error: --set: weight_sync.transport: tensor handles only reach colocated engines; "
        "use 'disk' or 'distributed' with colocate: false (got 'tensor')"
    ]
    assert main(["validate", "--offline", str(PRODUCTION), *sum((["--set", o] for o in DISAGGREGATED), []),
                 "--set", "weight_sync.transport=distributed"]) == 0
    capsys.readouterr()


def test_a_server_whose_tp_ranks_would_straddle_two_nodes_is_refused(capsys):
    # 8 GPUs per node, tp 16: the server's ranks span both nodes of its pool; megarl starts a server on one node.
    lines = errors(capsys, "rollout.tp=16", "rollout.num_servers=1", "placement.colocate=false", "placement.nodes=3",
                   "placement.pools={train: {nodes: 1, gpus_per_node: 8}, gen: {nodes: 2, gpus_per_node: 8}}",
                   "placement.roles={actor: train, reference: train, rollout: gen}",
                   "weight_sync.transport=distributed")
    assert lines == ["error: --set: rollout.tp: a server's TP ranks must share a node: the rollout pool 'gen' has 8 "
                     "GPUs per node, not divisible by tp (got 16)"]


def test_the_rules_come_from_the_registry_metadata(capsys):
    """Mark `disk` as refusing colocation in the registry alone: validate now refuses it, and the other
    transports' messages list it no more."""
    disk = WEIGHT_SYNC_TRANSPORTS.get("disk")
    WEIGHT_SYNC_TRANSPORTS.remove("disk")
    WEIGHT_SYNC_TRANSPORTS.add("disk", DiskTransport, bound=disk.bound, refuses_colocation="a test says so")
    try:
        assert errors(capsys, "weight_sync.transport=disk") == [
            "error: --set: weight_sync.transport: a test says so; use 'tensor' with colocate: true (got 'disk')"]
        assert errors(capsys, "weight_sync.transport=distributed")[0].endswith(
            "use 'tensor' with colocate: true (got 'distributed')")
    finally:
        WEIGHT_SYNC_TRANSPORTS.remove("disk")
        WEIGHT_SYNC_TRANSPORTS.add("disk", disk.target, **disk.meta)


def test_make_transport_is_a_registry_lookup(tmp_path):
    assert isinstance(make_transport("disk", None, timeout_s=1, disk_dir=tmp_path), DiskTransport)
    with pytest.raises(ValueError, match=r"unknown weight-sync transport 'carrier-pigeon'; known: disk, distributed, "
                                         r"tensor"):
        make_transport("carrier-pigeon", None, timeout_s=1)


def test_a_transport_is_one_registry_entry_with_its_bound(tmp_path):
    from megarl.bench.run import _bound
    from megarl.bench.step_report import Peak, _notes
    from megarl.config import load_recipe
    from megarl.weightsync.bounds import SyncBound

    with pytest.raises(ValueError, match=r"weight-sync transport 'pigeon' needs the metadata \['bound'\]"):
        WEIGHT_SYNC_TRANSPORTS.add("pigeon", DiskTransport)
    seen = {}

    def pigeon_seconds(nbytes, *, bucket_bytes, scratch_dir, device):
        seen.update(nbytes=nbytes, bucket_bytes=bucket_bytes, scratch_dir=scratch_dir, device=device)
        return 0.25

    WEIGHT_SYNC_TRANSPORTS.add("pigeon", DiskTransport, bound=SyncBound("a pigeon's flight", pigeon_seconds))
    try:
        recipe = load_recipe(REPO / "recipes" / "quickstart-grpo-cpu.yaml", ["weight_sync.transport=pigeon"])
        records = [{"weight_sync/bytes": 3 << 20}, {"weight_sync/bytes": 5 << 20}, {}]
        bound = _bound(recipe, records, tmp_path)
        assert (bound.name, bound.seconds) == ("a pigeon's flight", 0.25)
        assert seen == {"nbytes": 4 << 20, "bucket_bytes": int(recipe.weight_sync.bucket_mb * (1 << 20)),
                        "scratch_dir": tmp_path / "weight_sync", "device": "cpu"}
        assert any("a pigeon's flight of the synced bytes" in note for note in _notes(recipe, 1, Peak(1.0, "a test")))
    finally:
        WEIGHT_SYNC_TRANSPORTS.remove("pigeon")


@pytest.mark.parametrize("name,bound_name", [("tensor", "memcpy (1 thread)"), ("disk", "disk write + read")])
def test_the_builtin_bounds_measure(tmp_path, name, bound_name):
    bound = WEIGHT_SYNC_TRANSPORTS.get(name).bound
    seconds = bound.seconds(1 << 20, bucket_bytes=1 << 18, scratch_dir=tmp_path, device="cpu")
    assert bound.name == bound_name and 0 < seconds < 1
    assert WEIGHT_SYNC_TRANSPORTS.get("distributed").bound.name == "broadcast (2 processes)"
