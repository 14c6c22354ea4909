"""Loading a checkpoint runs no code from it. A checkpoint whose DCP metadata, or one of whose
non-tensor items, is a pickle with a ``__reduce__`` (here: one that creates a file) is refused
with a ``ShardingError`` naming the file, and the payload never runs. The payloads are live:
DCP's own reader runs them (the control at the end of each test)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import spdsl
from spdsl.checkpoint import _state
from tests.checkpoint._train import build, optimizer, train


class Payload:
    """Unpickling it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(tmp_path):
    model = build()
    opt = optimizer(model)
    train(model, model, opt, 1, 1)
    return model, opt, spdsl.save_checkpoint(tmp_path / "ckpt", model, opt, step=1,
                                             extra={"tokens": 64})


def test_metadata_that_would_run_code_is_refused(tmp_path):
    model, opt, path = _saved(tmp_path)
    marker = tmp_path / "ran"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(spdsl.ShardingError, match="checkpoint safety") as err:
        spdsl.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert os.path.join(path, ".metadata") in str(err.value)
    assert "io.open" in str(err.value)            # what open pickles as
    assert not marker.exists()
    dcp.FileSystemReader(path).read_metadata()          # control: DCP's reader runs it
    assert marker.exists()


def _tampered(tmp_path, key: str):
    """A checkpoint written by DCP whose item ``key`` is the payload."""
    model = build()
    opt = optimizer(model)
    train(model, model, opt, 1, 1)
    marker = tmp_path / f"ran_{key}"
    sd = _state(model, opt)
    sd.update(step=1, rng={"rank_0": {"cpu": torch.get_rng_state()}}, extra={"tokens": 64})
    top, _, sub = key.partition(".")
    if sub:
        sd[top][sub] = Payload(str(marker))
    else:
        sd[key] = Payload(str(marker))
    path = tmp_path / "ckpt" / "step_00000001"
    dcp.save(sd, checkpoint_id=path)
    return model, opt, os.fspath(path), marker


@pytest.mark.parametrize("key", ["step", "extra.tokens"])
def test_an_item_that_would_run_code_is_refused(tmp_path, key):
    model, opt, path, marker = _tampered(tmp_path, key)
    extra = {"tokens": 0}
    with pytest.raises(spdsl.ShardingError, match="checkpoint safety") as err:
        spdsl.load_checkpoint(path, model, opt, extra=extra)
    said = str(err.value)
    assert os.path.join(path, "__0_0.distcp") in said and repr(key) in said and "io.open" in said
    assert not marker.exists()
    assert extra == {"tokens": 0}
    sd = {key: 0} if "." not in key else {"extra": {"tokens": 0}}
    dcp.load(sd, checkpoint_id=path)                    # control: DCP's planner runs it
    assert marker.exists()


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    model, opt, path = _saved(tmp_path)
    md = dcp.FileSystemReader(path).read_metadata()
    for info in md.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(spdsl.ShardingError, match="outside"):
        spdsl.load_checkpoint(path, model, opt)


def test_extra_takes_tensors_and_plain_values_only(tmp_path):
    model = build()
    plain = {"t": torch.arange(3), "nested": {"a": [1, 2.5, None, "s", (True, 3)], "4": "four"}}
    spdsl.save_checkpoint(tmp_path, model, step=1, extra=plain)
    back = {"t": torch.zeros(3, dtype=torch.long), "nested": {"a": [0, 0.0, None, "", (False, 0)],
                                                              "4": ""}}
    spdsl.load_checkpoint(tmp_path, model, extra=back)
    assert torch.equal(back["t"], plain["t"]) and back["nested"] == plain["nested"]
    with pytest.raises(spdsl.ShardingError, match=r"extra\['obj'\]\[0\]: .*Payload"):
        spdsl.save_checkpoint(tmp_path, model, step=2, extra={"obj": [Payload("x")]})
    with pytest.raises(spdsl.ShardingError, match="key 4"):     # DCP would make it "4"
        spdsl.save_checkpoint(tmp_path, model, step=2, extra={"d": {4: "four"}})
    assert not os.path.exists(tmp_path / "step_00000002")
