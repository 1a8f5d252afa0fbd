"""The PS wire format: one msgpack header frame, then the raw bytes of at most one tensor.

    frame 0     msgpack map: {"op": str, "worker": int, ..., "dtype": str, "shape": [int],
                              "frames": int}          (dtype/shape/frames only when a tensor follows)
    frame 1..k  the tensor's bytes in C order, split into frames of CHUNK bytes (the last one shorter);
                an empty tensor has no payload frames

A keyed message (`rowpush`: the rows of embedding tables, ps-lite's keys + values) has `"keys": n` in its
header and the n int64 row keys, framed the same way, before the tensor's frames; the tensor is (n, dim).

Payload frames are handed to ZeroMQ without copying (pyzmq copies frames under its copy_threshold,
64 KiB, itself). `decode` trusts nothing: an unknown op, a missing or ill-typed field, an unknown
dtype, a shape whose byte size differs from the payload, missing or extra frames, or bytes that are
not msgpack all raise WireError with a message that says what was wrong. No pickle anywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np
import torch

CHUNK = 4 * 2**20                 # payload frame size
MAX_HEADER = 64 * 2**10           # a header is a few dozen bytes; anything this big is hostile
MAX_FRAMES = 1024                 # frames of one message: a header, keys and a tensor of up to 4 GiB in CHUNKs
MAX_NDIM = 8
MAX_INT = 2**62

# Every real dtype torch (>= 2.4) has whose bytes the wire can carry (it needs only empty tensors, a
# contiguous copy and a byte view). Complex and float8 dtypes are left out on purpose: nothing in the
# PS sends them; encode refuses them with a message naming the supported ones.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "uint16": torch.uint16,
    "int32": torch.int32, "uint32": torch.uint32, "int64": torch.int64, "uint64": torch.uint64, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# The dtypes numpy has too (bf16 and the wide unsigned ones it lacks, or torch cannot hand it): their bytes are
# viewed, and floating payloads checked for inf/nan, by numpy, whose calls cost a fraction of torch's per message.
NUMPY: dict[torch.dtype, type] = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                                  torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16,
                                  torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}

# op -> (required fields, optional fields, tensor: "required" | "forbidden" | "keyed" (keys, then the tensor))
# Requests (worker -> server): init, push, pull, pushpull (= push + pull in one message), fetch, done,
# save (write this server's part of checkpoint `step` into `path`, once every worker has asked; snapshot.py);
# with backend.embeddings = "rows" (psarch/ps/rows.py): rowpull (the tensor is the int64 keys wanted),
# rowpush (keyed: keys + their rows' gradients or deltas), rowfetch. Replies: ack, params, rows, error, and in GEO
# with compression delta and sparsedelta (keyed).
# push, pushpull and pull name one partition of the server's range by its `offset` (backend.partition_mb; a pull
# without one: the first), and a `params` reply to them names it too.
_INT, _FLOAT, _STR, _BOOL = "int", "float", "str", "bool"
SCHEMA: dict[str, tuple[dict[str, str], dict[str, str], str]] = {
    "init": ({"worker": _INT, "numel": _INT, "offset": _INT}, {}, "required"),
    "push": ({"worker": _INT, "step": _INT, "version": _INT, "offset": _INT},
             {"scale": _FLOAT, "found_inf": _BOOL}, "required"),
    "pushpull": ({"worker": _INT, "step": _INT, "version": _INT, "offset": _INT},
                 {"scale": _FLOAT, "found_inf": _BOOL}, "required"),
    "pull": ({"worker": _INT, "step": _INT, "want": _STR}, {"offset": _INT}, "forbidden"),
    "fetch": ({"worker": _INT}, {}, "forbidden"),
    "rowpull": ({"worker": _INT, "step": _INT, "want": _STR}, {}, "required"),
    "rowpush": ({"worker": _INT, "step": _INT, "version": _INT}, {}, "keyed"),
    # train.compression = "topk": a push of one partition as its k largest (index within the partition, value)
    # pairs, keyed: the keys, then the values as a (k, 1) tensor
    "sparsepush": ({"worker": _INT, "step": _INT, "version": _INT, "offset": _INT}, {}, "keyed"),
    "sparsepushpull": ({"worker": _INT, "step": _INT, "version": _INT, "offset": _INT}, {}, "keyed"),
    # GEO with train.compression (psarch/ps/server/deltas.py): a push (cast to 2 bytes, or top-k's pairs), then a
    # pull answered with the partition's compressed change since what the worker holds: a `delta` (fp16/bf16: the
    # difference cast) or a keyed `sparsedelta` (top-k: its k (index, value) pairs)
    "pushpulldelta": ({"worker": _INT, "step": _INT, "version": _INT, "offset": _INT}, {}, "required"),
    "sparsepushpulldelta": ({"worker": _INT, "step": _INT, "version": _INT, "offset": _INT}, {}, "keyed"),
    "rowfetch": ({"worker": _INT}, {}, "forbidden"),
    "rows": ({"version": _INT}, {}, "required"),
    "done": ({"worker": _INT}, {}, "forbidden"),
    "save": ({"worker": _INT, "step": _INT, "path": _STR}, {}, "forbidden"),
    # a sync worker dropped from rounds that went on without it asks to take part again from round `step`
    "rejoin": ({"worker": _INT, "step": _INT}, {}, "forbidden"),
    # backend.replicas: which workers' pushes round `step` of the partition at `offset` sums, as its first live
    # holder summed them (`members`, replication.members_text); without members: that holder is dead, the server
    # told decides the partition's rounds from now on (psarch/ps/replication.py)
    "commit": ({"worker": _INT, "step": _INT, "offset": _INT}, {"members": _STR}, "forbidden"),
    "ack": ({"version": _INT}, {"staleness": _INT, "skipped": _BOOL}, "forbidden"),
    "params": ({"version": _INT, "offset": _INT},
               {"scale": _FLOAT, "ahead": _INT, "skipped": _BOOL, "staleness": _INT, "summed": _STR}, "required"),
    "delta": ({"version": _INT, "offset": _INT}, {"scale": _FLOAT, "staleness": _INT}, "required"),
    "sparsedelta": ({"version": _INT, "offset": _INT}, {"scale": _FLOAT, "staleness": _INT}, "keyed"),
    # code "non_finite": a refused inf/nan push; "lost": a dropped worker's request (with the server's version)
    "error": ({"message": _STR}, {"code": _STR, "version": _INT}, "forbidden"),
}
# Every message may name a request's id (a worker's number for it, and a reply's for the request it answers): a request
# sent again keeps its id, and a server applies it once (psarch/ps/server/repeats.py)
for _fields in SCHEMA.values():
    _fields[1]["rid"] = _INT
# What each request is answered with.
REPLY_TO = {"init": "ack", "push": "ack", "pull": "params", "pushpull": "params", "fetch": "params", "done": "ack",
            "rejoin": "ack", "commit": "ack",
            "rowpull": "rows", "rowpush": "ack", "rowfetch": "rows", "save": "ack", "sparsepush": "ack",
            "sparsepushpull": "params", "pushpulldelta": "delta", "sparsepushpulldelta": "sparsedelta"}
# The requests whose pull is answered with a compressed delta (GEO with compression)
DELTA_PULLS = ("pushpulldelta", "sparsepushpulldelta")
# The replies that name the partition they answer by its offset (a worker's requests of one exchange are answered
# in the order their partitions become ready)
PARTITION_REPLIES = ("params", "delta", "sparsedelta")
_TENSOR_FIELDS = {"dtype", "shape", "frames"}
_KEYED_FIELDS = _TENSOR_FIELDS | {"keys"}


class WireError(ValueError):
    """A message that does not follow the wire format; the text says what was wrong."""


class NonFinitePayload(WireError):
    """A tensor whose values include inf or nan where only finite values may be sent."""


@dataclass
class Message:
    """A decoded message: its header, and (when it carries a tensor) the raw payload frames."""

    op: str
    header: dict[str, Any]
    payload: list[memoryview]
    key_frames: list[memoryview] = field(default_factory=list)   # keyed messages: the int64 keys

    def keys(self) -> torch.Tensor:
        """The int64 keys of a keyed message (a new tensor)."""
        if "keys" not in self.header:
            raise WireError(f"op {self.op!r} carries no keys")
        out = torch.empty(self.header["keys"], dtype=torch.int64)
        if out.numel():
            _bytes_view(out)[:] = np.frombuffer(b"".join(self.key_frames), dtype=np.uint8)
        return out

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES[self.header["dtype"]] if "dtype" in self.header else None

    @property
    def shape(self) -> tuple[int, ...] | None:
        return tuple(self.header["shape"]) if "shape" in self.header else None

    def tensor_shape(self) -> tuple[int, ...]:
        """The shape of the tensor it carries; WireError when it carries none."""
        if self.shape is None:
            raise WireError(f"op {self.op!r} carries no tensor")
        return self.shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    def tensor(self, out: torch.Tensor | None = None, finite: bool = False) -> torch.Tensor:
        """The payload as a tensor: copied into `out` (same dtype and element count) or a new tensor.
        finite=True: raise NonFinitePayload if a floating-point element is inf or nan (checked frame by
        frame, while the bytes just copied are still in cache)."""
        if self.shape is None:
            raise WireError(f"op {self.op!r} carries no tensor")
        dtype, shape = self.dtype, self.shape
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif out.dtype != dtype or out.numel() != self.numel or not out.is_contiguous():
            raise WireError(f"op {self.op!r}: payload is {self.header['dtype']} {list(shape)}, the destination "
                            f"is {DTYPE_NAMES.get(out.dtype, out.dtype)} {list(out.shape)}"
                            + ("" if out.is_contiguous() else " (not contiguous)"))
        if self.numel:
            dst = _bytes_view(out)
            check = finite and out.is_floating_point()
            values = NUMPY.get(out.dtype) if check else None
            flat = out.reshape(-1) if check and values is None else None
            pos = done = 0
            for frame in self.payload:
                n = len(frame)
                src = np.frombuffer(frame, dtype=np.uint8)
                dst[pos:pos + n] = src
                pos += n
                if values is not None:
                    if not np.isfinite(src.view(values)).all():
                        raise NonFinitePayload(f"op {self.op!r}: the {self.header['dtype']} payload holds inf/nan")
                elif flat is not None:   # (bf16: no numpy dtype) the whole elements copied so far, not yet checked
                    upto = pos // out.element_size()
                    if not bool(torch.isfinite(flat[done:upto]).all()):
                        raise NonFinitePayload(f"op {self.op!r}: the {self.header['dtype']} payload holds inf/nan")
                    done = upto
        return out


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor as a uint8 numpy array sharing its memory (through numpy's own view where
    numpy has the dtype: one torch call, not three, per message)."""
    if t.dtype in NUMPY:
        return t.numpy().reshape(-1).view(np.uint8)
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def _frames(tensor: torch.Tensor) -> list[memoryview]:
    """A tensor's bytes in C order as frames of at most CHUNK bytes (uncopied when contiguous)."""
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot travel on the PS wire; supported: {', '.join(DTYPES)}")
    t = tensor if tensor.is_cpu and not tensor.requires_grad and tensor.is_contiguous() else (
        tensor.detach().cpu().contiguous())
    if not t.numel():
        return []
    data = _bytes_view(t).data
    return [data] if len(data) <= CHUNK else [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]


def encode(header: dict[str, Any], tensor: torch.Tensor | None = None,
           keys: torch.Tensor | None = None) -> list[bytes | memoryview]:
    """Frames of one message: the header (with dtype/shape/frames added), the keys' bytes (a keyed
    message: int64, one per row of the tensor) and the tensor's bytes, uncopied when the tensor is
    contiguous (a non-contiguous one is copied once to C order)."""
    header = dict(header)
    payload: list[memoryview] = []
    if keys is not None:
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise WireError(f"keys of dtype {keys.dtype} and shape {list(keys.shape)}: expected int64 of one dimension")
        payload = _frames(keys)
        header["keys"] = keys.numel()
    if tensor is not None:
        values = _frames(tensor)
        payload += values
        header.update(dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape), frames=len(values))
    return [msgpack.packb(header, use_bin_type=True), *payload]


def _check_field(op: str, key: str, value: Any, kind: str) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT if kind == _INT else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) if kind == _FLOAT
          else isinstance(value, str) and len(value) <= 4096 if kind == _STR else isinstance(value, bool))
    if not ok:
        want = {_INT: f"an integer in [0, {MAX_INT}]", _FLOAT: "a finite number", _STR: "a string",
                _BOOL: "true or false"}[kind]
        raise WireError(f"op {op!r}: field {key!r} = {value!r:.80}: expected {want}")


def decode(frames: Sequence[Any]) -> Message:
    """Validate and decode one message (header frame + payload frames; zmq Frames, bytes or buffers)."""
    if not frames:
        raise WireError("empty message: expected a header frame")
    op, header = _header(memoryview(frames[0]))
    tensor = SCHEMA[op][2]
    payload = [memoryview(f) for f in frames[1:]]
    if tensor == "forbidden":
        if payload:
            raise WireError(f"op {op!r} carries no tensor, got {len(payload)} extra frame(s)")
        return Message(op, header, [])
    key_frames: list[memoryview] = []
    if tensor == "keyed":
        key_frames, payload = _split_keys(op, header, payload)
    shape = _check_payload(op, header, payload)
    if tensor == "keyed" and (len(shape) != 2 or shape[0] != header["keys"]):
        raise WireError(f"op {op!r}: {header['keys']} keys and values of shape {shape}: expected "
                        f"[{header['keys']}, dim], one row per key")
    return Message(op, header, payload, key_frames)


def _header(head: memoryview) -> tuple[str, dict[str, Any]]:
    """(op, header) of a header frame whose fields are those its op's SCHEMA entry allows, each well typed."""
    if len(head) > MAX_HEADER:
        raise WireError(f"header frame of {len(head)} bytes: at most {MAX_HEADER}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, use_list=True,
                                 max_str_len=MAX_HEADER, max_bin_len=0, max_array_len=64, max_map_len=32,
                                 max_ext_len=0)
    except Exception as e:  # msgpack raises many types for bad bytes; all mean the same here
        raise WireError(f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise WireError(f"header is a msgpack {type(header).__name__}, expected a map")
    op = header.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise WireError(f"unknown op {op!r:.80}: expected one of {', '.join(SCHEMA)}")
    required, optional, tensor = SCHEMA[op]
    for key, kind in required.items():
        if key not in header:
            raise WireError(f"op {op!r}: missing field {key!r}")
        _check_field(op, key, header[key], kind)
    for key, value in header.items():
        if key in required or key == "op" or (tensor == "required" and key in _TENSOR_FIELDS) or (
                tensor == "keyed" and key in _KEYED_FIELDS):
            continue
        if key not in optional:
            raise WireError(f"op {op!r}: unexpected field {key!r:.80}")
        _check_field(op, key, value, optional[key])
    return op, header


def _split_keys(op: str, header: dict[str, Any],
                payload: list[memoryview]) -> tuple[list[memoryview], list[memoryview]]:
    """A keyed message's (key frames, value frames): its `keys` int64 keys fill the first frames exactly."""
    _check_field(op, "keys", header.get("keys"), _INT)
    key_bytes = header["keys"] * 8
    k = -(-key_bytes // CHUNK)
    key_frames, payload = payload[:k], payload[k:]
    if sum(len(f) for f in key_frames) != key_bytes or any(len(f) != min(CHUNK, key_bytes - i * CHUNK)
                                                              for i, f in enumerate(key_frames)):
        raise WireError(f"op {op!r}: {header['keys']} keys are {key_bytes} bytes in {k} frame(s); "
                        f"the message's frames do not hold them")
    return key_frames, payload


def _check_payload(op: str, header: dict[str, Any], payload: list[memoryview]) -> list[int]:
    """The tensor's shape, once its dtype, shape and frame count are valid and the frames hold its bytes exactly."""
    dtype, shape, n = header.get("dtype"), header.get("shape"), header.get("frames")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"op {op!r}: dtype {dtype!r:.80}: expected one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_INT for d in shape):
        raise WireError(f"op {op!r}: shape {shape!r:.80}: expected a list of at most {MAX_NDIM} sizes >= 0")
    _check_field(op, "frames", n, _INT)
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes > MAX_INT:
        raise WireError(f"op {op!r}: shape {shape} is too large")
    expected = -(-nbytes // CHUNK)
    if n != len(payload):
        raise WireError(f"op {op!r}: header announces {n} payload frame(s), {len(payload)} arrived")
    if n != expected:
        raise WireError(f"op {op!r}: {dtype} {shape} is {nbytes} bytes = {expected} frame(s), header says {n}")
    for i, f in enumerate(payload):
        want = min(CHUNK, nbytes - i * CHUNK)
        if len(f) != want:
            raise WireError(f"op {op!r}: payload frame {i} has {len(f)} bytes, expected {want} "
                            f"for {dtype} {shape}")
    return shape


def frames_bytes(frames: Sequence[Any]) -> int:
    """Bytes in a list of frames (what the traffic meters count)."""
    return sum(len(memoryview(f)) for f in frames)
