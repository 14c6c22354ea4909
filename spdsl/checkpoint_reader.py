"""Reading a DCP checkpoint without running code from it (``spdsl.load_checkpoint``).

DCP's own reader unpickles its ``.metadata`` file with ``pickle.load`` and every non-tensor item
(the step, optimizer hyper-parameters, ``extra``) with ``torch.load(weights_only=False)``: a
checkpoint whose metadata, or any of those items, is a pickle with a ``__reduce__`` runs that
code inside the load. spdsl reads both under restrictions instead:

=====================  ===========================================================
what                   read with
=====================  ===========================================================
``.metadata``          an unpickler that builds only DCP's metadata classes
                       (``torch.distributed.checkpoint.metadata.*``, the file
                       reader's ``_StorageInfo``), ``torch.Size``, dtypes, layouts,
                       memory formats and the paths DCP records; each storage file
                       it names must be a plain file of the checkpoint's directory
non-tensor items       ``torch.load(weights_only=True)``: tensors, ``dict``,
                       ``list``, ``tuple``, ``str``, numbers, ``bool``, ``None``
tensors                as DCP reads them (already ``weights_only=True``)
=====================  ===========================================================

Anything else is refused before it is built, with a ``ShardingError`` naming the file (and
the item) and the global it asked for; nothing the file names is imported or called.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from spdsl.errors import ShardingError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),       # how torch pickles a layout (torch.strided)
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_FIX = ("load only checkpoints written by spdsl.save_checkpoint (or DCP) where you trust "
        "every writer of the directory; this file was altered or was not written by them")


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == "torch":          # torch.float32, torch.contiguous_format, ...
        return isinstance(getattr(torch, name, None), _TORCH_VALUES)
    if module == _METADATA_MODULE:  # a class defined there, not a name it imports
        obj = getattr(dcp_metadata, name, None)
        return isinstance(obj, type) and obj.__module__ == _METADATA_MODULE
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise ShardingError(
                rule="checkpoint safety", value=self.path,
                detail=f"the checkpoint's metadata asks for {module}.{name}, which DCP's "
                       "metadata never holds; loading it would run code named by the file, "
                       "so nothing was loaded", fix=_FIX)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP's metadata has no persistent ids")


def read_metadata(checkpoint: str, rank: int | None = None) -> dcp_metadata.Metadata:
    """The DCP metadata of ``checkpoint`` (a directory), read without running code from it.

    Example::

        md = read_metadata("ckpt/step_00000040")
        sorted(md.state_dict_metadata)        # ['extra.tokens', 'model.norm.weight', ...]
    """
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    path = os.path.join(checkpoint, name)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except ShardingError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise ShardingError(rule="checkpoint safety", value=path,
                            detail=f"the checkpoint's metadata does not read as DCP's ({exc})",
                            fix=_FIX) from None
    if not isinstance(md, dcp_metadata.Metadata):
        raise ShardingError(rule="checkpoint safety", value=path,
                            detail=f"the checkpoint's metadata is a {type(md).__name__}, not "
                                   "DCP's Metadata", fix=_FIX)
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise ShardingError(rule="checkpoint safety", value=path,
                                detail=f"the metadata names the storage file {rel!r}, outside "
                                       "the checkpoint's directory", fix=_FIX)
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader, handing DCP metadata already read by :func:`read_metadata`."""

    def __init__(self, checkpoint: str, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(checkpoint)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose non-tensor items load with ``weights_only=True``."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            info = self.metadata.storage_data.get(read_item.storage_index)
            file = os.path.join(self.checkpoint, getattr(info, "relative_path", "?"))
            found = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
            raise RefusedItem(file, fqn, found.group(1) if found else "") from None
        # DCP's own load_bytes places the value (nested keys, flattened state dicts); what it
        # unpickles is this re-saved, already checked value
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        super().load_bytes(read_item, again)


class RefusedItem(Exception):
    """A non-tensor item that is more than tensors and plain values. Plain arguments: DCP
    gathers a rank's exception to every rank by pickling it; ``error()`` is the user's."""

    def __init__(self, file: str, item: str, asked: str) -> None:
        super().__init__(file, item, asked)
        self.file, self.item, self.asked = file, item, asked

    def error(self) -> ShardingError:
        asks = f"it asks for {self.asked}" if self.asked else "it holds more than tensors"
        return ShardingError(
            rule="checkpoint safety", value=f"{self.file} (item {self.item!r})",
            detail=f"a non-tensor item is a pickle of more than tensors and plain values "
                   f"({asks}); loading it would run code named by the file, so the checkpoint "
                   "was not loaded", fix=_FIX)


def refused(exc: BaseException) -> ShardingError | None:
    """The user's error for DCP's ``CheckpointException`` when a rank refused an item."""
    for failure in getattr(exc, "failures", {}).values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, RefusedItem):
            return err.error()
    return None
