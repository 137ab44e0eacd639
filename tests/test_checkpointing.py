"""Step checkpoints on disk and the start-up decision (resume / refuse / start over), without engines.

The roles' worker groups are stand-ins that write files where the real ones write their
distributed checkpoints, so the directory protocol is tested on its own: temporary name,
marker with a digest per file, rename, pruning after completion, incomplete and corrupt
directories never loaded. The engines' side is covered by the e2e resume tests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megarl.cli import main
from megarl.cluster.engine_worker import MegatronWorker
from megarl.config import dump_recipe, load_recipe
from megarl.controller.checkpointing import (
    MARKER,
    complete_steps,
    load_step,
    remove_incomplete,
    save_step,
    verify,
)
from megarl.controller.resume import check_compatible, resume_or_start
from megarl.controller.roles import PolicyRole, Roles
from megarl.errors import InputError

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"


class FileWritingGroup:
    """Writes a two-file "checkpoint" per save call, like a role's ranks would; counts the calls."""

    def __init__(self, role: str):
        self.role, self.saves = role, 0

    def run(self, method, ckpt_dir: str, **kwargs) -> None:
        assert method is MegatronWorker.save_checkpoint
        self.saves += 1
        path = Path(ckpt_dir)
        path.mkdir(parents=True)
        (path / "metadata.json").write_text(json.dumps({"role": self.role, "save": self.saves, **kwargs}))
        (path / "__0_0.distcp").write_bytes(bytes(range(256)) * (self.saves + 1))


def _roles(reference: bool = True, *, actor_group=None, reference_group=None, **reference_kind) -> Roles:
    """The run's roles on groups that write (or record) checkpoints; `reference_kind`: PolicyRole's `fused` or
    `adapters` for a reference on the actor's group."""
    actor = PolicyRole(actor_group or FileWritingGroup("actor"), batching=None)
    ref_group = actor.group if reference_kind else reference_group or FileWritingGroup("reference")
    return Roles(actor=actor, rollout=None, reward=None, memory=None,
                 reference=PolicyRole(ref_group, batching=None, **reference_kind) if reference else None)


def _recipe(tmp_path: Path, *overrides: str):
    return load_recipe(QUICKSTART, [f"trainer.output_dir={tmp_path}", "name=run", *overrides])


def _save(roles, run_dir: Path, step: int, recipe, keep_last: int = 2):
    return save_step(roles, run_dir, step=step, controller_state={"step": step}, recipe_text=dump_recipe(recipe),
                     keep_last=keep_last, weights_only=False)


def test_a_step_is_complete_with_a_marker_listing_every_file_and_its_digest(tmp_path):
    recipe, run_dir = _recipe(tmp_path), tmp_path / "run"
    checkpoint = _save(_roles(), run_dir, 3, recipe)
    assert checkpoint.path == run_dir / "checkpoints" / "step_3" and checkpoint.step == 3
    marker = json.loads((checkpoint.path / MARKER).read_text())
    files = sorted(str(p.relative_to(checkpoint.path)) for p in checkpoint.path.rglob("*") if p.is_file())
    assert sorted(marker["files"]) == [name for name in files if name != MARKER]
    assert {"actor/metadata.json", "reference/__0_0.distcp", "controller_state.json", "recipe.yaml"} <= set(files)
    for name, digest in marker["files"].items():
        assert hashlib.sha256((checkpoint.path / name).read_bytes()).hexdigest() == digest
    assert marker["roles"] == ["actor", "reference"] and marker["weights_only"] is False
    assert json.loads((checkpoint.path / "controller_state.json").read_text()) == {"step": 3}
    assert verify(checkpoint) == []
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_keep_last_prunes_only_complete_steps_and_the_reference_is_linked_not_rewritten(tmp_path):
    recipe, run_dir, roles = _recipe(tmp_path), tmp_path / "run", _roles()
    for step in (1, 2, 3):
        _save(roles, run_dir, step, recipe, keep_last=2)
    assert [c.step for c in complete_steps(run_dir)] == [2, 3]
    # Written once, then hard-linked: pruning step_1 did not take the data with it.
    assert roles.reference.group.saves == 1 and roles.actor.group.saves == 3
    linked = run_dir / "checkpoints" / "step_3" / "reference" / "__0_0.distcp"
    assert linked.stat().st_nlink == 2 and verify(complete_steps(run_dir)[-1]) == []


def test_an_interrupted_save_is_never_loaded_and_is_removed_at_start(tmp_path):
    recipe, run_dir = _recipe(tmp_path), tmp_path / "run"
    _save(_roles(), run_dir, 1, recipe)
    root = run_dir / "checkpoints"
    (root / ".tmp-step_2" / "actor").mkdir(parents=True)  # killed while writing
    (root / "step_3" / "actor").mkdir(parents=True)  # a step dir without its marker
    (root / "step_4").mkdir()
    (root / "step_4" / MARKER).write_text(json.dumps({"format_version": 1, "step": 5}))  # marker of another step
    assert [c.step for c in complete_steps(run_dir)] == [1]
    assert sorted(p.name for p in remove_incomplete(run_dir)) == [".tmp-step_2", "step_3", "step_4"]
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]


def test_a_corrupt_checkpoint_is_moved_aside_and_the_previous_one_resumed(tmp_path):
    recipe, run_dir = _recipe(tmp_path), tmp_path / "run"
    roles = _roles()
    _save(roles, run_dir, 1, recipe)
    newest = _save(roles, run_dir, 2, recipe)
    with open(newest.path / "actor" / "__0_0.distcp", "r+b") as handle:
        handle.write(b"\xff")  # one flipped byte
    assert verify(newest) == [f"{newest.path}/actor/__0_0.distcp: sha256 differs from {MARKER}"]
    said = []
    resume_from = resume_or_start(run_dir, recipe, say=said.append)
    assert resume_from.step == 1 and (run_dir / "checkpoints" / "corrupt-step_2").is_dir()
    assert any("corrupt" in line for line in said)


def test_resume_refuses_a_changed_model_data_or_algorithm_one_line_per_key(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = _save(_roles(), run_dir, 2, _recipe(tmp_path))
    changed = _recipe(tmp_path, "model.config.hidden_size=256", "data.train_batch_size=128",
                      "algorithm.norm_adv_by_std_in_grpo=false", "rollout.n=4")
    with pytest.raises(InputError) as error:
        check_compatible(checkpoint, changed)
    keys = [line.split(":")[0] for line in error.value.problems]
    assert keys == ["algorithm.norm_adv_by_std_in_grpo", "data.train_batch_size", "model.config.hidden_size",
                    "rollout.n"]
    assert error.value.problems[2].endswith("(it was written with 128); keep it, or start over with --no-resume "
                                            "(got 256)")
    # How the run executes and logs may change: steps, cadence, logging, layout, micro-batches, optimizer.
    check_compatible(checkpoint, _recipe(
        tmp_path, "trainer.total_steps=100", "trainer.val_every=3", "trainer.logging.tensorboard=false",
        "placement.gpus_per_node=2", "rollout.num_servers=2", "actor.parallel.tp=2", "actor.ppo_micro_batch_size=32", "actor.optim.lr=1e-4",
        "trainer.checkpoint.save_every=5", "rollout.max_concurrency=8"))


def _without(recipe_text: str, *keys: str) -> str:
    """`recipe_text` as a megarl from before `keys` existed wrote it: those (dotted) keys removed."""
    tree = yaml.safe_load(recipe_text)
    for key in keys:
        *parents, leaf = key.split(".")
        section = tree
        for name in parents:
            section = section[name]
        del section[leaf]
    return yaml.safe_dump(tree)


def test_a_checkpoint_written_before_a_key_existed_resumes_at_that_keys_default(tmp_path):
    remote = ["reward.remote.url=http://127.0.0.1:9/score"]
    checkpoint = _save(_roles(), tmp_path / "run", 2, _recipe(tmp_path, *remote))
    new_keys = ("actor.policy_loss", "actor.lora", "reward.remote.on_failure", "weight_sync.lora")
    recipe_file = checkpoint.path / "recipe.yaml"
    recipe_file.write_text(_without(recipe_file.read_text(), *new_keys))
    check_compatible(checkpoint, _recipe(tmp_path, *remote))
    # Set to anything but its default, a key the old run did not have changes what the run computes.
    changed = _recipe(tmp_path, *remote, "actor.policy_loss=gspo", "reward.remote.on_failure=drop")
    with pytest.raises(InputError) as error:
        check_compatible(checkpoint, changed)
    assert [line.split(":")[0] for line in error.value.problems] == ["actor.policy_loss", "reward.remote.on_failure"]
    assert error.value.problems[0].endswith("(it was written with <unset>); keep it, or start over with "
                                            "--no-resume (got 'gspo')")


def test_megarl_train_refuses_an_incompatible_resume_with_status_2_naming_the_key(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _save(_roles(), run_dir, 2, _recipe(tmp_path))
    before = sorted(str(p) for p in run_dir.rglob("*"))
    status = main(["train", str(QUICKSTART), "--set", f"trainer.output_dir={tmp_path}", "--set", "name=run",
                   "--set", "model.config.num_hidden_layers=4"])
    assert status == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.config.num_hidden_layers: cannot resume ")
    assert sorted(str(p) for p in run_dir.rglob("*")) == before  # nothing touched


def test_start_over_moves_the_old_run_dir_aside_never_deletes_it(tmp_path):
    recipe, run_dir = _recipe(tmp_path, "trainer.checkpoint.resume=never"), tmp_path / "run"
    _save(_roles(), run_dir, 2, recipe)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    # What `megarl submit` wrote before the job started, and the batch log the job is writing now: they stay.
    (run_dir / "slurm").mkdir()
    (run_dir / "slurm" / "job.json").write_text("{}")
    (run_dir / "logs").mkdir()
    with open(run_dir / "logs" / "slurm-7.out", "w") as batch_log:
        said = []
        assert resume_or_start(run_dir, recipe, say=said.append) is None
        batch_log.write("still here\n")
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert (aside / "checkpoints" / "step_2" / MARKER).is_file() and (aside / "metrics.jsonl").is_file()
    assert sorted(p.name for p in run_dir.iterdir()) == ["logs", "slurm"]
    assert (run_dir / "logs" / "slurm-7.out").read_text() == "still here\n"
    assert str(aside) in said[0]


def test_start_over_keeps_what_train_rm_wrote_for_the_run(tmp_path):
    # `megarl train-rm` then `megarl train` on one recipe, whose reward model lies in the run directory (as
    # quickstart-rm-cpu's does): the run reads that model, so starting over must leave it, and train-rm's logs.
    run_dir = tmp_path / "run"
    recipe = load_recipe(QUICKSTART.with_name("quickstart-rm-cpu.yaml"), [
        f"trainer.output_dir={tmp_path}", "name=run", f"reward_model.path={run_dir / 'reward_model'}"])
    for entry in ("reward_model", "train-rm", "data"):
        (run_dir / entry).mkdir(parents=True)
        (run_dir / entry / "file").write_text(entry)
    said = []
    assert resume_or_start(run_dir, recipe, say=said.append) is None
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert sorted(p.name for p in run_dir.iterdir()) == ["reward_model", "train-rm"]
    assert (run_dir / "reward_model" / "file").read_text() == "reward_model"
    assert sorted(p.name for p in aside.iterdir()) == ["data"] and str(aside) in said[0]


def test_start_over_with_only_launcher_files_moves_nothing(tmp_path):
    recipe, run_dir = _recipe(tmp_path), tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    said = []
    assert resume_or_start(run_dir, recipe, say=said.append) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and said == []


def test_weights_only_saves_and_loads_without_optimizer_state(tmp_path):
    recipe, run_dir, roles = _recipe(tmp_path), tmp_path / "run", _roles()
    checkpoint = save_step(roles, run_dir, step=1, controller_state={"step": 1}, recipe_text=dump_recipe(recipe),
                           keep_last=0, weights_only=True)
    assert checkpoint.weights_only and json.loads((checkpoint.path / MARKER).read_text())["weights_only"] is True
    assert json.loads((checkpoint.path / "actor" / "metadata.json").read_text())["weights_only"] is True

    calls = []

    def recording():
        return SimpleNamespace(run=lambda method, path, **kwargs: calls.append((method.__name__, Path(path).name,
                                                                                  kwargs)))

    load_step(_roles(actor_group=recording(), reference_group=recording()), checkpoint)
    assert calls == [("load_checkpoint", "actor", {"load_optimizer": False}),
                     ("load_checkpoint", "reference", {"load_optimizer": False, "reference": False})]


def test_a_lora_actors_reference_is_neither_saved_nor_loaded(tmp_path):
    """With LoRA the reference is the actor's group with its adapters off: nothing of its own to checkpoint."""
    recipe, run_dir = _recipe(tmp_path), tmp_path / "run"
    roles = _roles(adapters=False)
    checkpoint = save_step(roles, run_dir, step=1, controller_state={"step": 1}, recipe_text=dump_recipe(recipe),
                           keep_last=0, weights_only=False)
    assert json.loads((checkpoint.path / MARKER).read_text())["roles"] == ["actor"]
    assert roles.actor.group.saves == 1 and not (checkpoint.path / "reference").exists()


def test_a_fused_reference_is_saved_and_loaded_through_the_actors_ranks_as_reference(tmp_path):
    """A reference fused into the actor's workers writes the same `reference/` directory as one on ranks of its
    own (so either loads the other's checkpoints), through the actor's group with `reference=True`."""
    recipe, run_dir = _recipe(tmp_path), tmp_path / "run"
    roles = _roles(fused=True)
    checkpoint = save_step(roles, run_dir, step=1, controller_state={"step": 1}, recipe_text=dump_recipe(recipe),
                           keep_last=0, weights_only=False)
    assert json.loads((checkpoint.path / MARKER).read_text())["roles"] == ["actor", "reference"]
    saved = json.loads((checkpoint.path / "reference" / "metadata.json").read_text())
    assert saved["reference"] is True and roles.actor.group.saves == 2
    assert json.loads((checkpoint.path / "actor" / "metadata.json").read_text()).get("reference") is None
    calls = []
    group = SimpleNamespace(run=lambda method, path, **kwargs: calls.append((Path(path).name, kwargs)))
    load_step(_roles(actor_group=group, fused=True), checkpoint)
    assert calls == [("actor", {"load_optimizer": True}), ("reference", {"load_optimizer": False, "reference": True})]
