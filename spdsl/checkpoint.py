"""Checkpoints that survive a crash and reshard on load: model and optimizer state through
``torch.distributed.checkpoint`` (DCP).

What is saved: the model's state dict and the optimizer's (``get_state_dict`` from
``torch.distributed.checkpoint.state_dict``: keys are parameter names, values are the
parameters' own tensors -- DTensor shards under ``shard_state=True``, plain tensors otherwise),
the step, every rank's RNG state and whatever the caller passes as ``extra``. Every rank writes
only its own shards; DCP records each shard's global offset, so a checkpoint saved on a
dp=2 x sp=2 mesh loads on sp=4, on sp=2, or in a single process into plain tensors, with the
same values bit for bit. The state-dict helpers handle DTensor parameters without FSDP:
they only call ``state_dict``/``load_state_dict`` and map optimizer state to names.

Atomicity. A save writes ``root/.step_00000040.tmp`` and, once every rank has finished and
DCP's ``.metadata`` is written, rank 0 renames it to ``root/step_00000040``: a rename within a
directory is atomic, so a directory named ``step_*`` is always complete. A crash during a save
leaves only a ``.tmp`` directory, which loading ignores and the next save removes. Several
nodes need one shared file system for ``root`` (DCP's file writer needs it anyway).

RNG. Each rank saves its CPU (and CUDA) generator state under its own rank; on load a rank
gets its own back, or rank 0's when the checkpoint was written by fewer ranks (with the same
global batch on every rank, the ranks' generators agree anyway).

Loading runs no code from the checkpoint (``spdsl.checkpoint_reader``): DCP's metadata is
unpickled by an unpickler that builds only DCP's metadata classes, and every non-tensor item
loads with ``weights_only=True``; a file asking for anything else is refused with a
``ShardingError`` naming it, before it is built. So ``extra`` holds tensors and plain values
(``dict``, ``list``, ``tuple``, ``str``, numbers, ``bool``, ``None``), checked when saving.
``docs/checkpoints.md`` says what is safe to load.

Example::

    start = spdsl.load_checkpoint("ckpt", model, opt) or 0     # None: nothing saved yet
    for step in range(start + 1, steps + 1):
        ...
        if step % 50 == 0:
            spdsl.save_checkpoint("ckpt", model, opt, step=step)
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import spdsl.collectives as C
from spdsl.checkpoint_reader import SafeLoadPlanner, SafeReader, read_metadata, refused
from spdsl.errors import ShardingError

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_NAME = re.compile(r"step_(\d+)$")
_METADATA = ".metadata"     # DCP's file writer writes it last, on rank 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        C.barrier()


def _module(model: Any) -> torch.nn.Module:
    # a module wrapped by sp_shard keeps its parameters on ``.module``
    m = model if isinstance(model, torch.nn.Module) else getattr(model, "module", None)
    if not isinstance(m, torch.nn.Module):
        raise ShardingError(rule="checkpoint", detail=f"{type(model).__name__} is not a module",
                            fix="pass the nn.Module (or sp_shard(model)) whose parameters "
                                "to save")
    return m


def _state(model: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    m = _module(model)
    if optimizer is None:
        return {"model": get_model_state_dict(m)}
    # get_state_dict fills an empty optimizer state by one step with zero gradients and lr 0
    # (AdamW then holds step=1 and zero moments). Undo that, and record it: a run resumed from
    # a checkpoint taken before the first step must not bias-correct one step off.
    fresh = not optimizer.state
    msd, osd = get_state_dict(m, optimizer)
    if fresh:
        optimizer.state.clear()
    return {"model": msd, "optim": osd, "optim_fresh": fresh}


def _rng() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _quiet(fn, *args, **kwargs):
    # DCP warns on every single-process call that it assumes no process group; that is the
    # intended use here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under ``root`` (highest step), or None.

    Example::

        spdsl.checkpoint.latest_checkpoint("ckpt")    # 'ckpt/step_00000040'
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    best, path = -1, None
    for name in os.listdir(root):
        m = _NAME.match(name)
        full = os.path.join(root, name)
        if m and int(m.group(1)) > best and os.path.isfile(os.path.join(full, _METADATA)):
            best, path = int(m.group(1)), full
    return path


def save_checkpoint(root: str | os.PathLike, model: Any,
                    optimizer: torch.optim.Optimizer | None = None, *, step: int,
                    extra: dict[str, Any] | None = None, keep: int | None = None) -> str:
    """Save ``model`` (and ``optimizer``) as ``root/step_{step:08d}``, atomically; every rank
    calls it. ``extra`` holds tensors and JSON-like plain values -- ``dict`` (string keys),
    ``list``, ``tuple``, ``str``, ``int``, ``float``, ``bool``, ``None`` (a scheduler's
    ``state_dict()``, say): what ``load_checkpoint`` reads back without running code; anything
    else is a ``ShardingError`` here, before anything is written (see
    ``docs/checkpoints.md``). ``keep=N`` removes all but the newest N complete checkpoints.
    Returns the path.

    Example::

        spdsl.save_checkpoint("ckpt", model, opt, step=step, extra={"sched": sched.state_dict()})
    """
    root = os.fspath(root)
    extra = dict(extra or {})
    for key, value in extra.items():
        _check_plain(value, f"extra[{key!r}]")
    name = f"step_{int(step):08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        for old in os.listdir(root):          # left by a crash during an earlier save
            if old.startswith(".step_") and old.endswith(".tmp"):
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier()
    sd = _state(model, optimizer)
    sd.update(step=int(step), rng={f"rank_{_rank()}": _rng()}, extra=extra)
    _quiet(dcp.save, sd, checkpoint_id=tmp)
    _barrier()
    if _rank() == 0:
        if os.path.exists(final):             # the same step saved again after a resume
            trash = os.path.join(root, f".{name}.old.tmp")
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep is not None:
            _prune(root, keep)
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model: Any,
                    optimizer: torch.optim.Optimizer | None = None, *,
                    extra: dict[str, Any] | None = None) -> int | None:
    """Load a checkpoint into ``model`` (and ``optimizer``) in place, resharding to their
    current placements; every rank calls it. ``path`` is one checkpoint or a root, from which
    the newest complete one is taken. Returns its step, or None when ``path`` holds none.
    ``extra`` is filled in place: pass a dict with the keys saved (values replaced).

    No code in the checkpoint runs: DCP's metadata and every non-tensor item are read under
    restrictions (``spdsl.checkpoint_reader``, ``docs/checkpoints.md``), and a checkpoint
    that asks for more (a pickle with a ``__reduce__``, say) is a ``ShardingError`` naming the
    file, raised before anything is built from it.

    Example::

        model = Llama(cfg); step_fn = spdsl.sp_shard(model, seq=4, mesh=mesh, shard_state=True)
        opt = torch.optim.AdamW(model.parameters())
        start = spdsl.load_checkpoint("ckpt", model, opt) or 0
    """
    path = _resolve(os.fspath(path))
    if path is None:
        return None
    metadata = read_metadata(path)       # refuses a tampered file on every rank alike
    saved = set(metadata.state_dict_metadata)
    if optimizer is not None and "optim_fresh" not in saved:
        raise ShardingError(rule="checkpoint", value=path, detail="it holds no optimizer state",
                            fix="load it without an optimizer, or save one with it")
    src = f"rank_{_rank()}" if f"rng.rank_{_rank()}.cpu" in saved else "rank_0"
    rng = {src: {k: v for k, v in _rng().items() if f"rng.{src}.{k}" in saved}}
    sd = _state(model, optimizer)
    sd.update(step=0, rng=rng, extra=dict(extra or {}))
    try:
        _quiet(dcp.load, sd, storage_reader=SafeReader(path, metadata),
               planner=SafeLoadPlanner(path))
    except CheckpointException as exc:
        err = refused(exc)
        if err is None:
            raise
        raise err from None
    m = _module(model)
    if optimizer is None:
        set_model_state_dict(m, sd["model"])
    else:
        set_state_dict(m, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if sd["optim_fresh"]:
            optimizer.state.clear()
    rng = sd["rng"][src]
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    if extra is not None:
        extra.update(sd["extra"])
    return int(sd["step"])


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """``value`` is a tensor or a plain value (what loads with ``weights_only=True``)."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):        # DCP keys nested items by their string keys
                raise _not_plain(f"{where} key {k!r}", k)
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    raise _not_plain(where, value)


def _not_plain(where: str, value: Any) -> ShardingError:
    return ShardingError(
        rule="checkpoint extra",
        value=f"{where}: {type(value).__module__}.{type(value).__qualname__}",
        detail="extra holds tensors and plain values only: loading runs no code from a "
               "checkpoint, so it reads nothing else back",
        fix="store it as a tensor or as dict/list/tuple/str/int/float/bool/None (its "
            "state_dict(), or its fields), and rebuild the object after loading")


def _resolve(path: str) -> str | None:
    """The checkpoint to load; rank 0 decides, so that every rank loads the same one even
    where a shared file system shows a fresh rename to some nodes later than to others."""
    if _rank() == 0:
        found = path if os.path.isfile(os.path.join(path, _METADATA)) else latest_checkpoint(path)
    else:
        found = None
    if _distributed():
        found = C.share(found)
    return found


def _prune(root: str, keep: int) -> None:
    done = sorted((int(m.group(1)), n) for n in os.listdir(root) if (m := _NAME.match(n))
                  and os.path.isfile(os.path.join(root, n, _METADATA)))
    for _, n in done[:max(len(done) - keep, 0)]:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    # the rename is durable only once the directory entry is on disk
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
