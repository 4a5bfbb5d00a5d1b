"""Where an admin weight update's tensors come from (routes.py): a checkpoint directory on the server's disk, or a
trainer's torch.distributed group. Both stage every tensor on this side; the rollout side's `update_weights` then
validates them all (names, shapes, finite values) before any weight changes.

Over a group, rank 0 broadcasts either one tensor per name, in order, or (`update_info.packed: true`, vLLM's NCCL
engine's packed mode, which TRL's async GRPO sends) the same tensors as flat bytes packed into buffers: in name order,
each buffer takes tensors until its byte count passes `packed_buffer_size_bytes` (vLLM's default 1 GiB; the tensor that
passes it is the buffer's last), the last buffer what remains. Both sides derive the buffers from the names, dtypes
and shapes alone, so the receiver knows each broadcast's size; `packed_num_buffers` (the sender's double buffering)
does not change them.

SGLang's dialect (/init_weights_update_group, /update_weights_from_distributed; AReaL and slime send it) names its
group: the trainer's rank 0 builds it with `init_custom_process_group(init_method="tcp://host:port", group_name=...)`,
SGLang's helper that AReaL and slime copy, which reaches torch's `_new_process_group_helper` and so keys the group's
rendezvous under `{group_name}` + `{group_name}/` + `{device}/` in the TCPStore (`cpu/` for gloo, `cuda/` for nccl).
This server's rank keys its own the same way (`WeightReceiver(group_name=...)`), built from public torch classes;
tests/test_serve_sglang_weights.py builds rank 0 with torch's own helper, so a change in torch's keys fails there.
SGLang's body lists `names`, `dtypes`, `shapes`, one broadcast per tensor; its `load_format: "flattened_bucket"` is one
broadcast of every tensor's bytes back to back in name order (its FlattenedTensorBucket): the packed mode above with
one buffer.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..transport.errors import ApiError, bad_request

GROUP_TIMEOUT_S = 300
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "backend", "timeout_s")
UPDATE_FIELDS = ("names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes", "packed_num_buffers")
SGLANG_GROUP = "weight_update_group"  # SGLang's default group_name
SGLANG_LOAD_FORMATS = (None, "flattened_bucket")
PACKED_BUFFER_BYTES = 1024 ** 3  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


@dataclass(frozen=True)
class Transfer:
    """One group update as `update_info` describes it: the tensors in broadcast order, and the packed buffers' byte
    bound (None: one broadcast per tensor)."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    packed_bytes: int | None = None

    def buffers(self) -> list[list[int]]:
        """The indices of the tensors each packed buffer holds, in broadcast order."""
        groups: list[list[int]] = [[]]
        size = 0
        for i, (dtype, shape) in enumerate(zip(self.dtypes, self.shapes)):
            groups[-1].append(i)
            size += math.prod(shape) * dtype.itemsize
            if size > self.packed_bytes and i < len(self.names) - 1:
                groups.append([])
                size = 0
        return [g for g in groups if g]


def known_fields(body: dict, allowed: tuple[str, ...], where: str = "") -> None:
    """A field with no meaning here is refused by name, never dropped."""
    for name in body:
        if name not in allowed:
            field = f"{where}.{name}" if where else name
            raise bad_request(field, f"{field} is not supported here. Fix: send only {', '.join(allowed)}")


def read_checkpoint(path: Any, field: str) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in directory `path` (one file or shards), on the CPU."""
    from safetensors.torch import load_file

    if not isinstance(path, str) or not os.path.isdir(path):
        raise bad_request(field, f"{field}={path!r} is invalid: not a directory on the server. Fix: pass the "
                          "directory the trainer saved (save_pretrained, safetensors)")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise bad_request(field, f"{field}={path!r} is invalid: no *.safetensors file in it. Fix: save with "
                          "save_pretrained(..., safe_serialization=True)")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(os.path.join(path, name), device="cpu"))
    return weights


class WeightReceiver:
    """This server's rank of a trainer's torch.distributed group (its own TCPStore and ProcessGroup, never the default
    group): rank 0, the trainer, hosts the store at master_address:master_port; the server is rank `rank_offset`.
    Construction returns once every rank has joined. `group_name` (SGLang's dialect): the rendezvous keys are
    prefixed as SGLang's `init_custom_process_group` prefixes them (see the module's docstring); None: vLLM's
    dialect, unprefixed. `where`: the body's object the fields sit in ("init_info"; "" for SGLang's flat body)."""

    def __init__(self, info: dict, device: torch.device, group_name: str | None = None,
                 where: str = "init_info") -> None:
        import torch.distributed as dist

        known_fields(info, INIT_FIELDS, where)
        backend = info.get("backend") or ("nccl" if device.type == "cuda" else "gloo")
        if backend not in ("gloo", "nccl") or (backend == "nccl" and device.type != "cuda"):
            raise bad_request(_field(where, "backend"), f"backend={backend!r} is invalid: 'gloo' (CPU tensors) or "
                              f"'nccl' (GPU tensors; the model is on {device})")
        host, port, rank, world_size, timeout = _rendezvous(info, where)
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.name = group_name
        try:
            self.store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
            store = self.store
            if group_name is not None:  # torch's keys for a group built by init_custom_process_group
                store = dist.PrefixStore(group_name, store)
                store = dist.PrefixStore(f"{group_name}/", store)
                store = dist.PrefixStore("cpu/" if backend == "gloo" else "cuda/", store)
            if backend == "gloo":
                self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            else:
                torch.cuda.set_device(device)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        except RuntimeError as error:  # torch.distributed's errors (a store that never answers, a rank taken)
            raise ApiError(504, f"could not join the trainer's group at {host}:{port} as rank {rank} of {world_size} "
                           f"({type(error).__name__}: {error}). Fix: build rank 0 (TCPStore(is_master=True), then "
                           "the process group) while this request waits", code="group_unreachable") from None

    def receive(self, transfer: Transfer) -> dict[str, torch.Tensor]:
        """Every tensor, broadcast by rank 0 one per name in this order (or packed: see the module's docstring),
        staged before any is applied."""
        if transfer.packed_bytes is not None:
            return self._receive_packed(transfer)
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(transfer.names, transfer.dtypes, transfer.shapes):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(tensor, 0).wait()
            out[name] = tensor
        self._synchronize()
        return out

    def _receive_packed(self, transfer: Transfer) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for indices in transfer.buffers():
            sizes = [math.prod(transfer.shapes[i]) * transfer.dtypes[i].itemsize for i in indices]
            packed = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self.group.broadcast(packed, 0).wait()
            for i, part in zip(indices, packed.split(sizes)):  # each tensor's bytes, viewed as what it was
                out[transfer.names[i]] = part.view(transfer.dtypes[i]).view(transfer.shapes[i])
        self._synchronize()
        return out

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _field(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _rendezvous(info: dict, where: str) -> tuple[str, int, int, int, datetime.timedelta]:
    try:  # master_port may be a string: AReaL sends str(port)
        host, port = str(info["master_address"]), int(info["master_port"])
        rank, world_size = int(info["rank_offset"]), int(info["world_size"])
        timeout = datetime.timedelta(seconds=float(info.get("timeout_s", GROUP_TIMEOUT_S)))
    except (KeyError, TypeError, ValueError) as error:
        raise bad_request(where or None, f"{where or 'the body'} needs master_address, master_port, rank_offset and "
                          f"world_size ({type(error).__name__}: {error})") from None
    if not 0 < rank < world_size:
        raise bad_request(_field(where, "rank_offset"), f"rank_offset={rank} is invalid: must be in [1, world_size="
                          f"{world_size}); rank 0 is the trainer")
    return host, port, rank, world_size, timeout


def parse_update_info(info: Any) -> Transfer:
    """names, dtype_names, shapes, checked so that every broadcast can be received (the group stays in step with the
    trainer even when the weights then fail validation: that is a 400 after the transfer, nothing applied)."""
    if not isinstance(info, dict):
        raise bad_request("update_info", "update_info must be an object with names, dtype_names and shapes")
    known_fields(info, UPDATE_FIELDS, "update_info")
    packed_bytes = _packing(info)
    return _transfer(info, "update_info", "dtype_names", packed_bytes)


def parse_sglang_update(body: dict) -> Transfer:
    """SGLang's /update_weights_from_distributed body (its UpdateWeightsFromDistributedReqInput): names, dtypes,
    shapes and load_format (None: one broadcast per tensor; "flattened_bucket": one broadcast of them all), checked
    like parse_update_info's. The caller has read the fields that are not about the transfer."""
    load_format = body.get("load_format")
    if load_format not in SGLANG_LOAD_FORMATS:
        raise bad_request("load_format", f"load_format={load_format!r} is invalid: must be null (one broadcast per "
                          "tensor) or 'flattened_bucket' (one broadcast of every tensor's bytes in name order)")
    transfer = _transfer(body, "", "dtypes", None)
    if load_format == "flattened_bucket":  # one buffer: its bound is the whole update's bytes
        size = sum(math.prod(shape) * dtype.itemsize for dtype, shape in zip(transfer.dtypes, transfer.shapes))
        transfer = Transfer(transfer.names, transfer.dtypes, transfer.shapes, size)
    return transfer


def _transfer(info: dict, where: str, dtypes_field: str, packed_bytes: int | None) -> Transfer:
    names, dtype_names, shapes = info.get("names"), info.get(dtypes_field), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)
            and len(names) == len(dtype_names) == len(shapes)):
        raise bad_request(where or "names", f"{where or 'the body'} needs names, {dtypes_field} and shapes: lists of "
                          "one length")
    if not names:
        raise bad_request(_field(where, "names"), "names is empty: an update needs at least one tensor")
    dtypes = [_dtype(d, _field(where, dtypes_field)) for d in dtype_names]
    for name, shape in zip(names, shapes):
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad_request(_field(where, "shapes"), f"the shape of {name!r}, {shape!r}, is not a list of sizes "
                              ">= 0")
    return Transfer([str(n) for n in names], dtypes, shapes, packed_bytes)


def _packing(info: dict) -> int | None:
    """The packed buffers' byte bound, or None for one broadcast per tensor."""
    packed = info.get("packed", False)
    if not isinstance(packed, bool):
        raise bad_request("update_info.packed", f"packed={packed!r} is invalid: must be true or false")
    for name, low in (("packed_buffer_size_bytes", 1), ("packed_num_buffers", 1)):
        value = info.get(name)
        if value is not None and (type(value) is not int or value < low):
            raise bad_request(f"update_info.{name}", f"{name}={value!r} is invalid: must be an integer >= {low} "
                              "(the sender's own value: both sides must agree)")
    if not packed:
        return None
    return info.get("packed_buffer_size_bytes") or PACKED_BUFFER_BYTES


def _dtype(name: Any, field: str) -> torch.dtype:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise bad_request(field, f"dtype {name!r} is not a torch dtype (e.g. 'bfloat16')")
    return value
