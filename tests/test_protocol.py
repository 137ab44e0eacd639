"""Batch: construction, column access, row selection, combining, pickling, and every error message."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from megarl.protocol import Batch


def make_batch(n: int = 4) -> Batch:
    """Rows are recognisable: row i has ids [10i, 10i+1, 10i+2], uid "u{i}", a dict {"gt": i}."""
    ids = torch.arange(n).unsqueeze(1) * 10 + torch.arange(3)
    return Batch.from_dict(
        {
            "input_ids": ids,
            "score": torch.arange(n, dtype=torch.float32),
            "uid": [f"u{i}" for i in range(n)],
            "reward_model": [{"gt": i} for i in range(n)],
        },
        meta={"step": 7},
    )


def rows_of(batch: Batch) -> list[int]:
    """Original row numbers, read back from input_ids (10 * row)."""
    return (batch["input_ids"][:, 0] // 10).tolist()


# ----- construction and columns ------------------------------------------------


def test_from_dict_splits_tensors_and_object_arrays():
    b = Batch.from_dict({"t": torch.zeros(2, 5), "lists": [[1, 2], [3, 4]], "nums": np.array([1.5, 2.5])})
    assert list(b.tensors) == ["t"]
    assert set(b.non_tensors) == {"lists", "nums"}
    # A list of equal-length lists must stay a list of lists, not become 2-D.
    assert b["lists"].shape == (2,) and b["lists"].dtype == object
    assert b["lists"][1] == [3, 4]
    assert b["nums"].dtype == object and b["nums"].tolist() == [1.5, 2.5]
    assert len(b) == 2 and b.keys() == ["t", "lists", "nums"]
    assert "t" in b and "lists" in b and "absent" not in b


def test_two_dim_numpy_becomes_one_row_per_element():
    b = Batch(non_tensors={"pairs": np.array([[1, 2], [3, 4], [5, 6]])})
    assert b["pairs"].shape == (3,)
    np.testing.assert_array_equal(b["pairs"][2], [5, 6])


def test_empty_batch_has_length_zero_and_takes_first_column():
    b = Batch(meta={"step": 1})
    assert len(b) == 0 and b.keys() == []
    b["x"] = torch.ones(3)
    assert len(b) == 3


def test_constructor_names_every_size_on_mismatch():
    with pytest.raises(ValueError, match=r"columns disagree on the batch size: a=2, b=3, c=2"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3, 4)}, {"c": np.array(["x", "y"], dtype=object)})


def test_constructor_rejects_wrong_kinds():
    with pytest.raises(TypeError, match=r"tensor 'a': expected a torch.Tensor, got list"):
        Batch({"a": [1, 2]})
    with pytest.raises(ValueError, match=r"tensor 'a': a 0-d tensor has no batch dimension"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"column 'temp': expected .* got float \(put per-batch values in meta\)"):
        Batch.from_dict({"temp": 0.7})
    with pytest.raises(ValueError, match=r"non-tensor 'z': a 0-d array has no batch dimension"):
        Batch(non_tensors={"z": np.array(3)})
    with pytest.raises(ValueError, match=r"keys \['k'\] are given both as tensors and as non-tensors"):
        Batch({"k": torch.zeros(2)}, {"k": ["a", "b"]})


def test_tensor_and_non_tensor_views_are_read_only():
    b = make_batch()
    with pytest.raises(TypeError):
        b.tensors["new"] = torch.zeros(4)
    with pytest.raises(TypeError):
        b.non_tensors["new"] = np.zeros(4)


def test_setitem_adds_replaces_and_switches_kind():
    b = make_batch()
    b["mask"] = torch.ones(4, 3)
    assert "mask" in b.tensors
    b["uid"] = ["a", "b", "c", "d"]
    assert b["uid"].tolist() == ["a", "b", "c", "d"]
    # Replacing a non-tensor with a tensor moves the key to the tensor side.
    b["uid"] = torch.arange(4)
    assert "uid" in b.tensors and "uid" not in b.non_tensors
    with pytest.raises(ValueError, match=r"column 'bad' has 3 rows, batch has 4 \(column 'input_ids'\)"):
        b["bad"] = torch.zeros(3)
    assert "bad" not in b
    with pytest.raises(TypeError, match=r"column keys are str, got int"):
        b[0] = torch.zeros(4)


def test_getitem_missing_key_names_available_keys():
    with pytest.raises(KeyError, match=r"getitem: no key\(s\) \['nope'\] in batch; it has \['input_ids', 'score', 'uid', 'reward_model'\]"):
        make_batch()["nope"]


def test_select_pop_drop():
    b = make_batch()
    sel = b.select(["uid", "score"])
    assert sorted(sel.keys()) == ["score", "uid"] and sel.meta == {"step": 7}
    assert b.select("uid").keys() == ["uid"]
    assert sorted(b.drop(["uid", "input_ids"]).keys()) == ["reward_model", "score"]
    assert len(b.keys()) == 4  # drop leaves b alone

    popped = b.pop(["reward_model", "score"])
    assert sorted(popped.keys()) == ["reward_model", "score"]
    assert b.keys() == ["input_ids", "uid"]
    assert popped["reward_model"][2] == {"gt": 2}
    torch.testing.assert_close(popped["score"], torch.tensor([0.0, 1.0, 2.0, 3.0]))

    # A pop with one unknown key removes nothing.
    with pytest.raises(KeyError, match=r"select: no key\(s\) \['x'\] in batch"):
        b.pop(["uid", "x"])
    assert b.keys() == ["input_ids", "uid"]
    with pytest.raises(KeyError, match=r"drop: no key\(s\) \['y'\]"):
        b.drop("y")


def test_derived_batches_get_their_own_meta_dict():
    b = make_batch()
    part = b[[0, 1]]
    part.meta["step"] = 99
    assert b.meta == {"step": 7}


# ----- row selection -----------------------------------------------------------


@pytest.mark.parametrize(
    "index",
    [
        [3, 0, 2],
        np.array([3, 0, 2]),
        torch.tensor([3, 0, 2]),
        [-1, 0, -2],
    ],
    ids=["list", "numpy", "torch", "negative"],
)
def test_integer_index(index):
    part = make_batch()[index]
    assert rows_of(part) == [3, 0, 2]
    assert part["uid"].tolist() == ["u3", "u0", "u2"]
    assert [d["gt"] for d in part["reward_model"]] == [3, 0, 2]
    torch.testing.assert_close(part["score"], torch.tensor([3.0, 0.0, 2.0]))
    assert part.meta == {"step": 7}


@pytest.mark.parametrize(
    "mask",
    [np.array([True, False, True, True]), torch.tensor([True, False, True, True]), [True, False, True, True]],
    ids=["numpy", "torch", "list"],
)
def test_bool_mask_index(mask):
    part = make_batch()[mask]
    assert rows_of(part) == [0, 2, 3]
    assert part["uid"].tolist() == ["u0", "u2", "u3"]


def test_slice_index_and_empty_index():
    b = make_batch(6)
    assert rows_of(b[1:5:2]) == [1, 3]
    assert b[1:5:2]["uid"].tolist() == ["u1", "u3"]
    empty = b[[]]
    assert len(empty) == 0 and empty["input_ids"].shape == (0, 3) and empty["uid"].shape == (0,)


def test_index_errors():
    b = make_batch()
    with pytest.raises(IndexError, match=r"row index 4 out of range for batch of length 4"):
        b[[0, 4]]
    with pytest.raises(IndexError, match=r"row index -5 out of range for batch of length 4"):
        b[np.array([-5])]
    with pytest.raises(IndexError, match=r"bool mask has length 3, batch has length 4"):
        b[torch.tensor([True, False, True])]
    with pytest.raises(IndexError, match=r"row index must be 1-D, got shape \(2, 2\)"):
        b[np.array([[0, 1], [2, 3]])]
    with pytest.raises(TypeError, match=r"row index must hold integers or bools, got dtype float"):
        b[torch.tensor([0.0, 1.0])]
    with pytest.raises(TypeError, match=r"b\[2\]: an int selects no rows; use b\[\[2\]\]"):
        b[2]


def test_repeat_interleaved_and_tiled():
    b = make_batch(2)
    inter = b.repeat(3)
    assert rows_of(inter) == [0, 0, 0, 1, 1, 1]
    assert inter["uid"].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert [d["gt"] for d in inter["reward_model"]] == [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(inter["score"], torch.tensor([0.0, 0, 0, 1, 1, 1]))
    assert inter["input_ids"][4].tolist() == [10, 11, 12]

    tiled = b.repeat(3, interleave=False)
    assert rows_of(tiled) == [0, 1, 0, 1, 0, 1]
    assert tiled["uid"].tolist() == ["u0", "u1", "u0", "u1", "u0", "u1"]
    assert [d["gt"] for d in tiled["reward_model"]] == [0, 1, 0, 1, 0, 1]
    assert tiled.meta == {"step": 7}
    with pytest.raises(ValueError, match=r"repeat: n must be a positive int, got 0"):
        b.repeat(0)


def test_reorder():
    b = make_batch()
    out = b.reorder([2, 0, 3, 1])
    assert rows_of(out) == [2, 0, 3, 1] and out["uid"].tolist() == ["u2", "u0", "u3", "u1"]
    assert rows_of(b.reorder(torch.tensor([3, 2, 1, 0]))) == [3, 2, 1, 0]
    with pytest.raises(ValueError, match=r"reorder: perm is not a permutation of range\(4\)"):
        b.reorder([0, 0, 1, 2])
    with pytest.raises(ValueError, match=r"reorder: perm must be 4 integers, got shape \(3,\)"):
        b.reorder([0, 1, 2])


def test_split_and_chunk_sizes():
    b = make_batch(7)
    parts = b.split(3)
    assert [rows_of(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [p["uid"].tolist() for p in parts][-1] == ["u6"]
    chunks = b.chunk(3)
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert [rows_of(c) for c in chunks] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(c) for c in make_batch(8).chunk(4)] == [2, 2, 2, 2]
    assert [len(c) for c in b.chunk(7)] == [1] * 7
    with pytest.raises(ValueError, match=r"chunk: cannot cut 7 samples into 8 non-empty chunks"):
        b.chunk(8)
    with pytest.raises(ValueError, match=r"split: size must be a positive int, got 0"):
        b.split(0)
    with pytest.raises(ValueError, match=r"chunk: n must be a positive int, got -1"):
        b.chunk(-1)


def test_balance_method_uses_mask_row_sums():
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    mask = (torch.arange(10).expand(8, 10) < torch.tensor(lengths).unsqueeze(1)).long()
    b = Batch.from_dict({"attention_mask": mask, "uid": [f"u{i}" for i in range(8)]})
    out, perm = b.balance(2)
    assert sorted(perm.tolist()) == list(range(8))
    assert out["uid"].tolist() == [f"u{i}" for i in perm]
    per_rank = [int(c["attention_mask"].sum()) for c in out.chunk(2)]
    assert per_rank == [20, 20]
    with pytest.raises(KeyError, match=r"balance: no key\(s\) \['response_mask'\]"):
        b.balance(2, mask_key="response_mask")
    with pytest.raises(ValueError, match=r"cannot balance 8 samples over world_size=3"):
        b.balance(3)


# ----- combining ---------------------------------------------------------------


def test_union_merges_columns_and_meta():
    b = make_batch()
    extra = Batch.from_dict(
        {"responses": torch.full((4, 2), 5), "uid": [f"u{i}" for i in range(4)]}, meta={"temperature": 1.0}
    )
    merged = b.union(extra)
    assert merged.keys() == ["input_ids", "score", "responses", "uid", "reward_model"]
    assert merged.meta == {"step": 7, "temperature": 1.0}
    assert merged["responses"].sum().item() == 40
    assert "responses" not in b  # union returns a new batch
    # Identical shared tensors are accepted.
    assert b.union(b.select(["input_ids"])).keys() == b.keys()
    # A batch with no columns only contributes meta.
    assert b.union(Batch(meta={"x": 1})).meta == {"step": 7, "x": 1}


def test_union_conflicts_name_the_key():
    b = make_batch()
    other_ids = b["input_ids"].clone()
    other_ids[2, 1] = -1
    with pytest.raises(ValueError, match=r"union: tensor 'input_ids' differs at row 2"):
        b.union(Batch({"input_ids": other_ids}))
    with pytest.raises(ValueError, match=r"union: tensor 'score' is \(4,\) torch.float32 here, \(4,\) torch.float64"):
        b.union(Batch({"score": torch.arange(4, dtype=torch.float64)}))
    with pytest.raises(ValueError, match=r"union: non-tensor 'uid' differs at row 1: 'u1' vs 'X'"):
        b.union(Batch.from_dict({"uid": ["u0", "X", "u2", "u3"]}))
    with pytest.raises(ValueError, match=r"union: non-tensor 'reward_model' differs at row 3"):
        b.union(Batch.from_dict({"reward_model": [{"gt": 0}, {"gt": 1}, {"gt": 2}, {"gt": 4}]}))
    with pytest.raises(ValueError, match=r"union: batch sizes differ: 4 vs 3"):
        b.union(make_batch(3))
    with pytest.raises(ValueError, match=r"union: meta 'step' conflicts: 7 vs 8"):
        b.union(Batch(meta={"step": 8}))
    with pytest.raises(ValueError, match=r"union: 'uid' is a non-tensor here and a tensor in the other batch"):
        b.union(Batch({"uid": torch.arange(4)}))


def test_union_compares_array_elements():
    arrays = [np.arange(3), np.arange(3) + 1]
    a = Batch(non_tensors={"v": np.fromiter(arrays, dtype=object, count=2)})
    same = Batch(non_tensors={"v": np.fromiter([x.copy() for x in arrays], dtype=object, count=2)})
    assert len(a.union(same)) == 2
    changed = Batch(non_tensors={"v": np.fromiter([arrays[0], arrays[1] * 2], dtype=object, count=2)})
    with pytest.raises(ValueError, match=r"union: non-tensor 'v' differs at row 1"):
        a.union(changed)


def test_concat_in_order_with_merged_meta():
    b = make_batch(5)
    parts = [b[[0, 1]], b[[2]], b[[3, 4]]]
    parts[1].meta["weight_version"] = 3
    out = Batch.concat(parts)
    assert rows_of(out) == [0, 1, 2, 3, 4]
    assert out["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]
    assert out.meta == {"step": 7, "weight_version": 3}


def test_concat_errors_name_keys_and_batches():
    b = make_batch()
    with pytest.raises(
        ValueError,
        match=r"concat: batch 1 lacks tensor keys \['score'\] of batch 0; batch 1 has non-tensor keys \['extra'\] not in batch 0",
    ):
        c = b.drop("score")
        c["extra"] = [1, 2, 3, 4]
        Batch.concat([b, c])
    with pytest.raises(ValueError, match=r"concat: batch 2 lacks non-tensor keys \['uid'\] of batch 0"):
        Batch.concat([b, b, b.drop("uid")])
    wide = make_batch()
    wide["input_ids"] = torch.zeros(4, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"concat: tensor 'input_ids' is \(4, 5\) torch.int64 in batch 1, \(4, 3\) torch.int64 in batch 0"):
        Batch.concat([b, wide])
    other = make_batch()
    other.meta["step"] = 8
    with pytest.raises(ValueError, match=r"concat: meta 'step' conflicts: 7 vs 8 \(batch 1\)"):
        Batch.concat([b, other])
    with pytest.raises(ValueError, match=r"concat: no batches given"):
        Batch.concat([])


def test_split_then_concat_round_trip():
    b = make_batch(10)
    back = Batch.concat(b.split(4))
    assert torch.equal(back["input_ids"], b["input_ids"])
    assert back["uid"].tolist() == b["uid"].tolist()


# ----- movement and serialisation ----------------------------------------------


def test_pickle_round_trip():
    b = make_batch()
    back = pickle.loads(pickle.dumps(b))
    assert back.keys() == b.keys() and back.meta == b.meta
    assert torch.equal(back["input_ids"], b["input_ids"])
    assert back["reward_model"].tolist() == b["reward_model"].tolist()
    assert back["uid"].dtype == object


def test_pickled_shard_carries_only_its_rows():
    big = Batch.from_dict({"x": torch.zeros(1000, 256), "uid": [str(i) for i in range(1000)]})
    shard = big.chunk(10)[3]
    full, part = len(pickle.dumps(big)), len(pickle.dumps(shard))
    # One tenth of the rows should cost about one tenth of the bytes, not the whole storage.
    assert part < full / 8
    back = pickle.loads(pickle.dumps(shard))
    assert back["uid"].tolist() == [str(i) for i in range(300, 400)]
    assert back["x"].shape == (100, 256)


def test_to_and_clone():
    b = make_batch()
    moved = b.to("cpu")
    assert moved["input_ids"].device.type == "cpu" and moved.keys() == b.keys()
    dup = b.clone()
    dup["input_ids"][0, 0] = -1
    dup["reward_model"][0]["gt"] = 42
    dup.meta["step"] = 0
    assert b["input_ids"][0, 0] == 0 and b["reward_model"][0] == {"gt": 0} and b.meta["step"] == 7


def test_repr_lists_keys_and_shapes():
    text = repr(make_batch())
    assert text == (
        "Batch(len=4, tensors={input_ids: (4, 3) int64, score: (4,) float32}, "
        "non_tensors=[uid, reward_model], meta={'step': 7})"
    )
