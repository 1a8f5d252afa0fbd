"""PS wire format: round trips of every dtype and shape, and the validation of every field. No processes."""
from __future__ import annotations

import msgpack
import pytest
import torch

from psarch.ps import wire
from psarch.ps.layout import server_ranges

SHAPES = [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4, 1)]


# Written out, not read from wire.DTYPES: a dtype dropped from the wire makes these tests fail.
EXPECTED_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "uint16": torch.uint16,
    "int32": torch.int32, "uint32": torch.uint32, "int64": torch.int64, "uint64": torch.uint64, "bool": torch.bool,
}
EXCLUDED_DTYPES = [torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    # small values (any integer dtype holds 0..100) with the top bit of the unsigned ones set somewhere
    t = torch.randint(0, 100, shape, generator=g, dtype=torch.int64).to(dtype)
    if t.numel() and not dtype.is_signed:
        t.reshape(-1).view(torch.uint8)[-1] = 0xFF   # the last byte: the top byte of the last element
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (compared as bytes: needs no arithmetic on uint16/32/64)."""
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


def roundtrip(t: torch.Tensor, header: dict | None = None) -> wire.Message:
    frames = wire.encode(header or {"op": "params", "version": 1, "offset": 0}, t)
    return wire.decode([bytes(f) for f in frames])  # what arrives is plain bytes


def test_the_wire_carries_exactly_the_expected_dtypes():
    assert wire.DTYPES == EXPECTED_DTYPES


@pytest.mark.parametrize("dtype", list(EXPECTED_DTYPES.values()), ids=list(EXPECTED_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_every_dtype_and_shape(dtype, shape):
    t = _sample(dtype, shape)
    msg = roundtrip(t)
    assert msg.header["dtype"] == {v: k for k, v in EXPECTED_DTYPES.items()}[dtype]
    out = msg.tensor()
    assert out.dtype == dtype and out.shape == t.shape
    assert same_bytes(out, t)


@pytest.mark.parametrize("dtype", list(EXPECTED_DTYPES.values()), ids=list(EXPECTED_DTYPES))
def test_non_contiguous_and_sliced_tensors(dtype):
    base = _sample(dtype, (6, 10))
    for t in (base.t(), base[:, ::3], base[2:4], base.t()[1:3]):
        assert not t.is_contiguous() or t.storage_offset()
        out = roundtrip(t).tensor()
        assert out.is_contiguous() and same_bytes(out, t)


@pytest.mark.parametrize("dtype", EXCLUDED_DTYPES, ids=str)
def test_excluded_dtypes_are_refused_with_the_supported_list(dtype):
    with pytest.raises(wire.WireError, match=f"dtype {dtype} cannot travel on the PS wire; supported: float32"):
        wire.encode({"op": "params", "version": 0, "offset": 0}, torch.zeros(2).to(dtype))


def test_large_tensor_is_split_into_chunks_and_decoded_into_a_destination():
    t = torch.arange(wire.CHUNK // 4 * 2 + 123, dtype=torch.float32)  # 2 full chunks + a short one
    frames = wire.encode({"op": "params", "version": 0, "offset": 0}, t)
    assert [len(memoryview(f)) for f in frames[1:]] == [wire.CHUNK, wire.CHUNK, 123 * 4]
    assert msgpack.unpackb(frames[0])["frames"] == 3
    dest = torch.zeros_like(t)
    out = wire.decode(frames).tensor(dest)
    assert out is dest and torch.equal(dest, t)
    # the payload of a contiguous tensor is not copied: the frames view the tensor's memory
    t[0] = -1.0
    assert torch.frombuffer(bytearray(frames[1][:4]), dtype=torch.float32).item() == -1.0


def test_bfloat16_bits_survive():
    t = torch.tensor([1.0, -0.0, float("inf"), float("nan"), 3.140625], dtype=torch.bfloat16)
    out = roundtrip(t).tensor()
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


def _push(**over) -> list:
    header = {"op": "push", "worker": 0, "step": 0, "version": 0, "offset": 0}
    frames = wire.encode(header, torch.ones(10))
    h = msgpack.unpackb(frames[0])
    for k, v in over.items():
        if v is KeyError:
            h.pop(k)
        else:
            h[k] = v
    return [msgpack.packb(h), *frames[1:]]


@pytest.mark.parametrize("frames, match", [
    ([], "empty message"),
    ([b"\xc1\xff\x00"], "not valid msgpack"),
    ([b"\x93\x01\x02\x03"], "expected a map"),
    ([msgpack.packb({"op": "explode"})], "unknown op"),
    ([msgpack.packb({"op": 7})], "unknown op"),
    ([msgpack.packb({"worker": 0})], "unknown op"),
    (_push(worker=KeyError), "missing field 'worker'"),
    (_push(worker=-1), "field 'worker'"),
    (_push(worker=True), "field 'worker'"),
    (_push(step=1.5), "field 'step'"),
    (_push(version=2**63 + 5), "field 'version'"),
    (_push(scale=float("nan")), "field 'scale'"),
    (_push(found_inf=1), "field 'found_inf'"),
    (_push(colour="red"), "unexpected field"),
    (_push(dtype="float128"), "dtype"),
    (_push(dtype=None), "dtype"),
    (_push(dtype=[3]), "dtype"),
    (_push(dtype={"a": 1}), "dtype"),
    (_push(shape=[11]), "is 44 bytes|frame 0 has 40 bytes"),
    (_push(shape=[-10]), "shape"),
    (_push(shape="10"), "shape"),
    (_push(shape=[1] * 9), "shape"),
    (_push(shape=[2**40, 2**40]), "too large"),
    (_push(frames=2), "announces 2 payload frame"),
    (_push(frames=-1), "field 'frames'"),
    (_push()[:1], "announces 1 payload frame\\(s\\), 0 arrived"),
    (_push() + [b"extra"], "announces 1 payload frame\\(s\\), 2 arrived"),
    ([_push()[0], bytes(memoryview(_push()[1]))[:-1]], "has 39 bytes"),
    ([msgpack.packb({"op": "pull", "worker": 0, "step": 0, "want": "float32"}), b"x"], "extra frame"),
    ([b"\x81" + b"\xa2op" + b"\xa4pull" + b"\x00" * (wire.MAX_HEADER)], "header frame"),
])
def test_decode_rejects_malformed_messages(frames, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(frames)


def test_tensor_into_a_mismatched_destination_is_refused():
    msg = roundtrip(torch.ones(4))
    with pytest.raises(wire.WireError, match="destination"):
        msg.tensor(torch.zeros(5))
    with pytest.raises(wire.WireError, match="destination"):
        msg.tensor(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(wire.WireError, match="not contiguous"):
        msg.tensor(torch.zeros(4, 2)[:, 0])


def test_server_ranges_are_contiguous_and_balanced():
    for numel, s in [(10, 1), (10, 3), (7, 7), (1000003, 4)]:
        r = server_ranges(numel, s)
        assert r[0][0] == 0 and r[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
        sizes = [hi - lo for lo, hi in r]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="fewer than one per server"):
        server_ranges(3, 4)
