"""Unit tests of the wire codec (`bus.codec`): round trips, zero-copy, and malformed input.

No sockets: frames are built and fed as in-memory buffers. Received frames are modelled as
writable `bytearray`s, as ZeroMQ delivers them with `copy=False`. Every malformed message
starts from a valid `encode()` header that is unpacked, changed in exactly one place, and
repacked, so that each test names the one check that must fire.
"""

import math
import struct
from dataclasses import MISSING, fields, replace

import msgpack
import numpy as np
import pytest
import torch

from tensorbus.bus.codec import (
    CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DTYPES,
    MAX_ARRAY,
    MAX_DIMS,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
    MAX_STRING,
    MAX_TENSORS,
    MIN_CHUNK_BYTES,
    SMALL_FRAME,
    decode,
    encode,
)
from tensorbus.bus.errors import (
    ByteLengthError,
    DtypeError,
    FrameCountError,
    LayoutError,
    MalformedHeaderError,
    MessageTooLargeError,
    ProtocolVersionError,
    UnknownKindError,
    WireError,
)
from tensorbus.bus.layout import Layout
from tensorbus.bus.messages import (
    COORDINATOR,
    PROTOCOL_VERSION,
    SCHEMA,
    Ack,
    ActivationGrads,
    Activations,
    Changes,
    Collective,
    Describe,
    Follow,
    Fragment,
    Heartbeat,
    Join,
    Kind,
    Leave,
    Peers,
    Pull,
    Push,
    Ready,
    Reject,
    RejectCode,
    Replica,
    Result,
    Stop,
    Weights,
    Welcome,
)
from tensorbus.bus.pieces import Pieces, whole

pytestmark = pytest.mark.timeout(30)

INT64_MAX = 2**63 - 1


# Helpers ------------------------------------------------------------------------------


def received(frames):
    """What the peer gets: the header's bytes, and each tensor frame in a fresh writable buffer."""
    return [bytes(frames[0]), *(bytearray(memoryview(f)) for f in frames[1:])]


def split(message):
    """Encode `message` and return (unpacked header, received tensor frames)."""
    frames = received(encode(message))
    return msgpack.unpackb(frames[0], raw=False), frames[1:]


def repack(header, payload):
    return [msgpack.packb(header, use_bin_type=True), *payload]


def raw_bytes(t):
    """The tensor's bytes as stored, for bit-exact comparison (also -0.0 vs 0.0)."""
    return bytes(t.detach().reshape(-1).view(torch.uint8).numpy())


def assert_same_tensors(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert g.shape == w.shape
        assert torch.equal(g, w)
        assert raw_bytes(g) == raw_bytes(w)


def random_tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)


def two_tensor_push(**changes):
    """A valid Push with a float32 [2, 3] and an int64 [4] bucket."""
    values = {
        "sender": 1,
        "request": 9,
        "version": 3,
        "clock": 4,
        "loss": 0.5,
        "samples": 32,
        "tensors": (
            torch.arange(6, dtype=torch.float32).reshape(2, 3),
            torch.arange(4, dtype=torch.int64),
        ),
    }
    values.update(changes)
    return Push(**values)


def assert_malformed(frames, fragment, **kwargs):
    with pytest.raises(MalformedHeaderError) as info:
        decode(frames, **kwargs)
    assert fragment in info.value.reason
    assert info.value.code is RejectCode.MALFORMED
    return info.value


# Round trips --------------------------------------------------------------------------

WEIGHTS = (torch.linspace(-1, 1, 6), torch.tensor([3, -4, 5], dtype=torch.int64))

SAMPLES = {
    Kind.JOIN: Join(sender=3, request=11, version=7, rank=2, layout="0f1e2d3c4b5a6978",
                    build="0.1.0", shared="tensorbus-2-0123456789abcdef 00112233445566778899aabbccddeeff",
                    stage=2, stages=4, inbox="tcp://127.0.0.1:40123", run="5f0e3a1b9c7d2e84"),
    Kind.WELCOME: Welcome(sender=COORDINATOR, request=11, version=7, rank=2, world_size=4,
                          strategy="ssp", push="weights", local_steps=3, wait="answered",
                          batch_size=32, pub_port=5556, heartbeat_s=0.25, timeout_s=12.5, lr=0.05, position=9,
                          compress="bf16",
                          shared="tensorbus-1-5-0123456789abcdef 00112233445566778899aabbccddeeff",
                          seed=3, clip_grad_norm=0.5, precision="bf16-mixed", micro_batches=8,
                          schedule="gpipe", standby="tcp://10.0.0.2:5555", fragments=4, mix=0.25,
                          run="5f0e3a1b9c7d2e84",
                          tensors=WEIGHTS),
    Kind.READY: Ready(sender=3, request=12, version=7, batches=125, unused=29),
    Kind.PUSH: Push(sender=3, request=13, version=7, term=2, clock=41, loss=0.1, samples=64,
                    began=1.7e9, compute_s=0.02, comm_s=0.003, wait_s=0.01, batches=14, overflows=2,
                    lrs="[0.1, 0.01]", peak_bytes=3 << 30, busy_s=0.015, span_s=0.025, held=3,
                    fragment=2, steps=5, tensors=WEIGHTS),
    Kind.ACK: Ack(sender=COORDINATOR, request=13, version=8, dropped="stale", held_s=0.25,
                  local_steps=6),
    Kind.PULL: Pull(sender=3, request=14, version=6),
    Kind.WEIGHTS: Weights(sender=COORDINATOR, request=14, version=8, generation=3, tensors=WEIGHTS),
    Kind.HEARTBEAT: Heartbeat(sender=3, request=15, version=8, phase="computing", clock=42,
                              standby="tcp://10.0.0.2:5555"),
    Kind.LEAVE: Leave(sender=3, request=16, version=8, reason="error",
                      detail="CUDA out of memory \u00fc \u2713 \U0001f525"),
    Kind.STOP: Stop(sender=COORDINATOR, request=17, version=9, reason="error",
                    detail="2 worker(s) left, fewer than the minimum of 3"),
    Kind.REJECT: Reject(sender=COORDINATOR, request=18, version=9, code="layout",
                        detail="buffer 0 is torch.float64[6]"),
    Kind.COLLECTIVE: Collective(sender=2, request=19, version=1, op="broadcast", seq=18, size=4,
                                timeout_s=30.0, spec="float32[6]", reduce="sum", root=2,
                                host="node7", tensors=WEIGHTS[:1]),
    Kind.RESULT: Result(sender=COORDINATOR, request=19, version=1, seq=18, outcome="mismatch",
                        detail="rank 1 called barrier()", tensors=WEIGHTS),
    Kind.CHANGES: Changes(sender=COORDINATOR, request=20, version=9, base=7,
                          tensors=(torch.tensor([0, 5]), torch.tensor([0.5, -2.0]))),
    Kind.DESCRIBE: Describe(sender=3, request=21, version=1, layout="0f1e2d3c4b5a6978",
                            model='{"params": [["w", [6], "float32", true]], "buffers": []}',
                            build="0.1.0", tensors=WEIGHTS),
    Kind.FOLLOW: Follow(sender=COORDINATOR, request=22, version=3, endpoint="tcp://10.0.0.2:5555",
                        term=1, layout="0f1e2d3c4b5a6978", build="0.1.0",
                        shared="tensorbus-2-0123456789abcdef 00112233445566778899aabbccddeeff",
                        run="5f3c9a1e0b7d2c4a"),
    # A state's tree (bus.tree) then its tensors: any shape, the model's layout or not.
    Kind.REPLICA: Replica(sender=COORDINATOR, request=23, version=9, term=2, generation=5,
                          run="5f3c9a1e0b7d2c4a",
                          tensors=(torch.frombuffer(bytearray(b'{"d":[]}'), dtype=torch.uint8),
                                   torch.ones(2, 3), torch.tensor(4.0))),
    Kind.PEERS: Peers(sender=1, request=22, version=2, previous="tcp://127.0.0.1:40001",
                      next="tcp://127.0.0.1:40003"),
    Kind.ACTIVATIONS: Activations(sender=1, request=23, version=5, stage=1, step=6, micro=3,
                                  outputs=1, batch=16, shard=94,
                                  tensors=(torch.randn(4, 3, 2), torch.arange(4))),
    Kind.ACTIVATION_GRADS: ActivationGrads(sender=1, request=24, version=5, stage=2, step=6,
                                           micro=3, loss=0.625, tensors=(torch.randn(4, 3, 2),)),
    Kind.FRAGMENT: Fragment(sender=COORDINATOR, request=25, version=10, fragment=1,
                            tensors=WEIGHTS),
}


def test_samples_cover_every_kind_with_non_default_values():
    assert set(SAMPLES) == set(SCHEMA) == set(Kind)
    for kind, message in SAMPLES.items():
        cls, own = SCHEMA[kind]
        assert type(message) is cls
        assert message.request != 0 and message.version != 0
        for f in fields(message):
            if f.name in own and f.default is not MISSING:
                assert getattr(message, f.name) != f.default, (kind, f.name)


@pytest.mark.parametrize("kind", list(SAMPLES), ids=lambda k: k.name)
def test_round_trip_every_kind(kind):
    message = SAMPLES[kind]
    decoded = decode(received(encode(message)))
    assert type(decoded) is type(message)
    assert decoded == message
    for f in fields(message):
        if f.name != "tensors":
            got, want = getattr(decoded, f.name), getattr(message, f.name)
            assert got == want, f.name
            assert type(got) is type(want), f.name
    assert_same_tensors(decoded.tensors, message.tensors)


def test_header_is_the_documented_map():
    frames = encode(SAMPLES[Kind.PUSH])
    assert msgpack.unpackb(frames[0], raw=False) == {
        "p": PROTOCOL_VERSION,
        "k": int(Kind.PUSH),
        "s": 3,
        "r": 13,
        "v": 7,
        "e": 2,
        "t": [["float32", [6], 24, CHUNK_BYTES], ["int64", [3], 24, CHUNK_BYTES]],
        "f": {"clock": 41, "loss": 0.1, "samples": 64, "began": 1.7e9, "compute_s": 0.02,
              "comm_s": 0.003, "wait_s": 0.01, "batches": 14, "overflows": 2,
              "lrs": "[0.1, 0.01]", "peak_bytes": 3 << 30, "busy_s": 0.015, "span_s": 0.025,
              "held": 3, "fragment": 2, "steps": 5},
    }
    assert len(frames) == 3


@pytest.mark.parametrize(
    "envelope",
    [(COORDINATOR, 0, 0, 0), (0, 1, 1, 1), (17, 12345, 99, 3),
     (INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX)],
    ids=str,
)
def test_envelope_round_trips_including_bounds(envelope):
    sender, request, version, term = envelope
    decoded = decode(received(encode(Pull(sender=sender, request=request, version=version,
                                          term=term))))
    assert (decoded.sender, decoded.request, decoded.version, decoded.term) == envelope


def test_a_term_given_to_encode_is_sent_in_place_of_the_message_s():
    decoded = decode(received(encode(Pull(sender=2, term=1), term=4)))
    assert decoded.term == 4


def test_a_negative_term_is_refused():
    header, payload = split(Pull(sender=2))
    header["e"] = -1
    with pytest.raises(MalformedHeaderError, match="field 'e' must be an integer >= 0"):
        decode(repack(header, payload))


def test_integer_on_a_float_field_is_taken_as_float():
    header, payload = split(two_tensor_push())
    header["f"]["loss"] = 2
    decoded = decode(repack(header, payload))
    assert decoded.loss == 2.0
    assert type(decoded.loss) is float


def test_string_field_at_the_length_limit_round_trips():
    message = Leave(sender=1, reason="error", detail="x" * MAX_STRING)
    assert decode(received(encode(message))) == message


SHAPES = [(0,), (3, 0, 2), (), (7,), (2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kind", [Kind.PUSH, Kind.WEIGHTS, Kind.WELCOME], ids=lambda k: k.name)
def test_tensor_round_trip_is_bit_exact(kind, dtype_name, shape):
    dtype = DTYPES[dtype_name]
    tensor = random_tensor(dtype, shape, seed=len(shape) + 10 * list(DTYPES).index(dtype_name))
    assert not (tensor.is_floating_point() and tensor.isnan().any())
    message = SAMPLES[kind].__class__(
        **{f.name: getattr(SAMPLES[kind], f.name) for f in fields(SAMPLES[kind])
           if f.name != "tensors"},
        tensors=(tensor,),
    )
    frames = encode(message)
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["t"] == [[dtype_name, list(shape), tensor.numel() * dtype.itemsize, CHUNK_BYTES]]
    decoded = decode(received(frames))
    assert decoded == message
    assert_same_tensors(decoded.tensors, (tensor,))


def test_every_dtype_in_one_message():
    tensors = tuple(random_tensor(d, (5,), seed=i) for i, d in enumerate(DTYPES.values()))
    message = Weights(version=2, tensors=tensors)
    decoded = decode(received(encode(message)))
    assert_same_tensors(decoded.tensors, tensors)


def test_float_special_values_are_bit_exact():
    tensor = torch.tensor(
        [-0.0, 0.0, math.inf, -math.inf, 5e-324, 1.7976931348623157e308], dtype=torch.float64
    )
    decoded = decode(received(encode(Weights(tensors=(tensor,)))))
    assert raw_bytes(decoded.tensors[0]) == raw_bytes(tensor)
    assert math.copysign(1.0, decoded.tensors[0][0].item()) == -1.0


# Zero copy ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_encode_frames_are_the_tensors_own_memory(dtype_name):
    tensor = random_tensor(DTYPES[dtype_name], (2, 3))
    frames = encode(Weights(tensors=(tensor,)))
    frame = frames[1]
    assert isinstance(frame, np.ndarray)
    assert frame.__array_interface__["data"][0] == tensor.data_ptr()
    assert frame.nbytes == tensor.numel() * tensor.element_size()


def test_encode_frame_sees_later_writes_to_the_tensor():
    big = torch.zeros(10, dtype=torch.float32)
    tensor = big[2:6]  # contiguous, at a storage offset
    frames = encode(Weights(tensors=(tensor,)))
    assert frames[1].__array_interface__["data"][0] == tensor.data_ptr() == big.data_ptr() + 8
    tensor[1] = 7.5
    assert bytes(frames[1][4:8]) == struct.pack("=f", 7.5)


def test_encode_scalar_and_empty_tensors():
    scalar = torch.tensor(3.25, dtype=torch.float64)
    empty = torch.zeros(0, 4, dtype=torch.int32)
    frames = encode(Weights(tensors=(scalar, empty)))
    assert frames[1].__array_interface__["data"][0] == scalar.data_ptr()
    assert memoryview(frames[2]).nbytes == 0


def test_decode_tensors_share_the_received_buffer():
    header, _ = split(Weights(tensors=(torch.zeros(4, dtype=torch.float32),)))
    buffer = bytearray(struct.pack("=4f", 1.0, 2.0, 3.0, 4.0))
    (tensor,) = decode(repack(header, [buffer])).tensors
    address = np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]
    assert tensor.data_ptr() == address
    buffer[8:12] = struct.pack("=f", -9.5)
    assert tensor.tolist() == [1.0, 2.0, -9.5, 4.0]
    tensor[0] = 0.5
    assert buffer[0:4] == struct.pack("=f", 0.5)


def test_decode_over_memoryview_slices_of_one_buffer():
    header, _ = split(two_tensor_push())
    arena = bytearray(64)
    base = np.frombuffer(arena, dtype=np.uint8).__array_interface__["data"][0]
    view = memoryview(arena)
    payload = [view[8:32], view[32:64]]  # float32 [2, 3] = 24 bytes, int64 [4] = 32 bytes
    a, b = decode(repack(header, payload)).tensors
    assert a.data_ptr() == base + 8
    assert b.data_ptr() == base + 32
    arena[32:40] = struct.pack("=q", -77)
    assert b[0].item() == -77
    assert a.shape == (2, 3) and b.shape == (4,)


# Malformed input: framing and header --------------------------------------------------


def test_no_frames():
    error = assert_malformed([], "no frames")
    assert isinstance(error, WireError)


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\xc1",  # a reserved msgpack byte
        b"\x92\x01",  # an array cut short
        b"\x81\xa1p\x01\xff",  # a map followed by extra bytes
        b"\xa2\xff\xfe",  # a string that is not UTF-8
        b"\x81\x01\x02",  # a map with an integer key
        b"\x91" * 2000 + b"\xc0",  # nested deeper than the unpacker's stack
        msgpack.packb({"p": 1, "x": b"bin"}, use_bin_type=True),  # binary data
        msgpack.packb({"p": 1, "x": msgpack.ExtType(1, b"e")}),  # an extension type
        msgpack.packb(list(range(MAX_ARRAY + 1))),  # array over the limit
        msgpack.packb({"p": 1, "x": "s" * (MAX_STRING + 1)}),  # string over the limit
        b"\xff" * 32,
    ],
    ids=["empty", "reserved", "truncated", "extra", "utf8", "intkey", "deep", "bin", "ext",
         "longarray", "longstr", "ff"],
)
def test_header_not_msgpack(garbage):
    assert_malformed([garbage], "not a msgpack header")


@pytest.mark.parametrize(
    ("value", "type_name"), [([1, 2, 3], "list"), (1, "int"), ("hello", "str"), (None, "NoneType")]
)
def test_header_not_a_map(value, type_name):
    assert_malformed([msgpack.packb(value)], f"header is a {type_name}, not a map")


def test_header_too_large():
    frame = b"\xc1" * (MAX_HEADER_BYTES + 1)
    assert_malformed([frame], f"header of {MAX_HEADER_BYTES + 1} bytes exceeds {MAX_HEADER_BYTES}")
    # One byte less is read (and then fails as msgpack, not for its size).
    assert_malformed([frame[1:]], "not a msgpack header")
    assert_malformed([memoryview(frame)], f"header of {MAX_HEADER_BYTES + 1} bytes")


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, -1, 255, "13", None, [13]])
def test_wrong_protocol_version(version):
    header, payload = split(two_tensor_push())
    header["p"] = version
    with pytest.raises(ProtocolVersionError) as info:
        decode(repack(header, payload))
    assert info.value.got == version
    assert type(info.value.got) is type(version)
    assert info.value.expected == PROTOCOL_VERSION
    assert info.value.code is RejectCode.PROTOCOL


def test_missing_protocol_version():
    header, payload = split(two_tensor_push())
    del header["p"]
    with pytest.raises(ProtocolVersionError) as info:
        decode(repack(header, payload))
    assert info.value.got is None
    assert info.value.expected == PROTOCOL_VERSION


def test_other_protocol_is_told_its_version_even_if_the_rest_differs():
    with pytest.raises(ProtocolVersionError) as info:
        decode([msgpack.packb({"p": 2, "kind": "push", "body": [1, 2]})])
    assert (info.value.got, info.value.expected) == (2, PROTOCOL_VERSION)


@pytest.mark.parametrize("version", [1.0, True], ids=["float", "bool"])
def test_protocol_version_must_be_the_integer(version):
    header, payload = split(two_tensor_push())
    header["p"] = version
    with pytest.raises(ProtocolVersionError) as info:
        decode(repack(header, payload))
    assert info.value.got == version


@pytest.mark.parametrize("key", ["k", "s", "r", "v", "t", "f"])
def test_missing_header_key(key):
    header, payload = split(two_tensor_push())
    del header[key]
    assert_malformed(repack(header, payload), "header keys")


@pytest.mark.parametrize("key", ["x", "kind", "P"])
def test_extra_header_key(key):
    header, payload = split(two_tensor_push())
    header[key] = 1
    assert_malformed(repack(header, payload), "header keys")


@pytest.mark.parametrize("kind", [0, int(max(Kind)) + 1, 99, -1, 2**40, "push", "4", 4.0, True, None, [4]])
def test_unknown_kind(kind):
    header, payload = split(two_tensor_push())
    header["k"] = kind
    with pytest.raises(UnknownKindError) as info:
        decode(repack(header, payload))
    assert info.value.kind == kind
    assert type(info.value.kind) is type(kind)
    assert info.value.code is RejectCode.UNKNOWN_KIND


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("s", -2),
        ("s", True),
        ("s", 1.0),
        ("s", "1"),
        ("s", None),
        ("s", INT64_MAX + 1),
        ("r", -1),
        ("r", False),
        ("r", 9.0),
        ("r", INT64_MAX + 1),
        ("v", -1),
        ("v", 3.0),
        ("v", 3.5),
        ("v", [3]),
        ("v", 2**64 - 1),
    ],
)
def test_bad_envelope_value(key, value):
    header, payload = split(two_tensor_push())
    header[key] = value
    assert_malformed(repack(header, payload), f"field {key!r} must be an integer")


# Malformed input: the kind's own fields -----------------------------------------------


@pytest.mark.parametrize("value", [[4, 0.5, 32], None, "clock"])
def test_fields_not_a_map(value):
    header, payload = split(two_tensor_push())
    header["f"] = value
    assert_malformed(repack(header, payload), "fields are not a map")


@pytest.mark.parametrize("name", ["clock", "loss", "samples"])
def test_missing_own_field(name):
    header, payload = split(two_tensor_push())
    del header["f"][name]
    assert_malformed(repack(header, payload), f"fields missing [{name!r}], unexpected []")


def test_extra_own_field():
    header, payload = split(two_tensor_push())
    header["f"]["lr"] = 0.1
    assert_malformed(repack(header, payload), "fields missing [], unexpected ['lr']")


def test_envelope_name_is_not_an_own_field():
    header, payload = split(two_tensor_push())
    header["f"]["version"] = 3
    assert_malformed(repack(header, payload), "unexpected ['version']")


@pytest.mark.parametrize(
    ("name", "value", "want", "got"),
    [
        ("clock", "4", "int", "str"),
        ("clock", 4.0, "int", "float"),
        ("clock", True, "int", "bool"),
        ("clock", None, "int", "NoneType"),
        ("samples", [32], "int", "list"),
        ("loss", "0.5", "float", "str"),
        ("loss", True, "float", "bool"),
        ("loss", None, "float", "NoneType"),
    ],
)
def test_wrong_own_field_type(name, value, want, got):
    header, payload = split(two_tensor_push())
    header["f"][name] = value
    assert_malformed(repack(header, payload), f"field {name!r} must be {want}, got {got}")


@pytest.mark.parametrize(
    ("message", "name", "value", "want", "got"),
    [
        (SAMPLES[Kind.WELCOME], "wait", True, "str", "bool"),
        (SAMPLES[Kind.WELCOME], "heartbeat_s", "0.25", "float", "str"),
        (SAMPLES[Kind.LEAVE], "reason", 5, "str", "int"),
        (SAMPLES[Kind.JOIN], "rank", "2", "int", "str"),
    ],
    ids=["str-given-bool", "float", "str", "int"],
)
def test_wrong_field_type_on_other_kinds(message, name, value, want, got):
    header, payload = split(message)
    header["f"][name] = value
    assert_malformed(repack(header, payload), f"field {name!r} must be {want}, got {got}")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_float_field_is_carried_for_the_node_to_judge(value):
    """A NaN loss is a fact about training, not a broken message: the coordinator counts
    it as a not_finite update (tests/integration/test_integration.py), the codec passes it on."""
    message = decode(received(encode(two_tensor_push(loss=value))))
    assert math.isnan(message.loss) if math.isnan(value) else message.loss == value


def test_an_error_after_the_header_carries_the_request_id():
    header, payload = split(two_tensor_push())
    header["r"], header["k"] = 41, 99
    with pytest.raises(UnknownKindError) as info:
        decode(repack(header, payload))
    assert info.value.request == 41


def test_string_field_over_the_limit():
    frames = received(encode(Leave(sender=1, reason="error", detail="x" * (MAX_STRING + 1))))
    assert_malformed(frames, "not a msgpack header")


# Malformed input: tensor specs and frames ---------------------------------------------


@pytest.mark.parametrize("value", [{"0": 1}, None, "float32"])
def test_tensor_list_not_an_array(value):
    header, payload = split(two_tensor_push())
    header["t"] = value
    assert_malformed(repack(header, payload), "tensor list is not an array")


@pytest.mark.parametrize("kind", [k for k, (cls, _) in SCHEMA.items() if not cls.CARRIES_TENSORS],
                         ids=lambda k: k.name)
def test_tensors_on_a_kind_that_carries_none(kind):
    header, _ = split(SAMPLES[kind])
    assert header["t"] == []
    header["t"] = [["float32", [2], 8]]
    assert_malformed(repack(header, [bytearray(8)]), "this kind carries no tensors")


def test_too_many_tensors():
    header, _ = split(Weights())
    header["t"] = [["uint8", [1], 1]] * (MAX_TENSORS + 1)
    payload = [bytearray(1) for _ in range(MAX_TENSORS + 1)]
    assert_malformed(repack(header, payload), f"{MAX_TENSORS + 1} tensors, at most {MAX_TENSORS}")


def test_a_replica_carries_more_tensors_than_other_kinds_and_no_more_than_its_own_limit():
    """A standby's replica holds an optimizer's state, a tensor or two a parameter."""
    most = Replica.MAX_TENSORS
    assert most > MAX_TENSORS
    tensors = tuple(torch.tensor([i % 256], dtype=torch.uint8) for i in range(most))
    decoded = decode(received(encode(Replica(term=1, run="r", tensors=tensors))))
    assert len(decoded.tensors) == most
    header, payload = split(Replica(term=1, run="r", tensors=(*tensors, tensors[0])))
    assert_malformed(repack(header, payload), f"{most + 1} tensors, at most {most}")


def test_tensor_count_at_the_limit_is_accepted():
    tensors = tuple(torch.tensor([i], dtype=torch.uint8) for i in range(MAX_TENSORS))
    decoded = decode(received(encode(Weights(tensors=tensors))))
    assert [t.item() for t in decoded.tensors] == list(range(MAX_TENSORS))


@pytest.mark.parametrize(
    "spec", [["float32", [6], 24], ["float32", [6], 24, 4096, ["tensorbus-1-5-0123456789abcdef", 0], 0],
             "float32", {"d": "float32"},
             None, []]
)
def test_tensor_spec_not_a_quadruple(spec):
    header, payload = split(two_tensor_push())
    header["t"][0] = spec
    assert_malformed(repack(header, payload), "tensor 0: spec must be [dtype, shape, nbytes, chunk]")


@pytest.mark.parametrize(
    ("drop", "declared", "received_count"), [(1, 2, 1), (2, 2, 0)], ids=["one", "all"]
)
def test_truncated_frames(drop, declared, received_count):
    frames = received(encode(two_tensor_push()))
    with pytest.raises(FrameCountError) as info:
        decode(frames[: len(frames) - drop])
    assert (info.value.declared, info.value.received) == (declared, received_count)
    assert info.value.code is RejectCode.MALFORMED


def test_extra_frames():
    frames = received(encode(two_tensor_push()))
    with pytest.raises(FrameCountError) as info:
        decode([*frames, bytearray(4)])
    assert (info.value.declared, info.value.received) == (2, 3)


def test_extra_frame_on_a_kind_without_tensors():
    frames = received(encode(SAMPLES[Kind.ACK]))
    with pytest.raises(FrameCountError) as info:
        decode([*frames, bytearray(8)])
    assert (info.value.declared, info.value.received) == (0, 1)


@pytest.mark.parametrize(
    ("index", "delta"), [(0, -1), (0, 1), (1, -8), (1, 4), (1, -32)],
)
def test_frame_length_differs_from_header(index, delta):
    frames = received(encode(two_tensor_push()))
    declared = len(frames[1 + index])
    frame = frames[1 + index]
    frames[1 + index] = frame[:delta] if delta < 0 else frame + bytearray(delta)
    with pytest.raises(ByteLengthError) as info:
        decode(frames)
    error = info.value
    assert (error.index, error.declared, error.expected, error.received) == (
        index, declared, declared, declared + delta,
    )
    assert error.code is RejectCode.MALFORMED


def test_bytes_in_a_frame_for_an_empty_tensor():
    header, _ = split(Weights(tensors=(torch.zeros(0, dtype=torch.float32),)))
    with pytest.raises(ByteLengthError) as info:
        decode(repack(header, [bytearray(4)]))
    assert (info.value.index, info.value.declared, info.value.received) == (0, 0, 4)


@pytest.mark.parametrize("nbytes", [28, 20, 0, 6], ids=["more", "less", "zero", "numel"])
def test_declared_bytes_inconsistent_with_shape(nbytes):
    header, payload = split(two_tensor_push())
    header["t"][0][2] = nbytes
    payload[0] = bytearray(nbytes)  # the frame agrees with the header; only the shape does not
    with pytest.raises(ByteLengthError) as info:
        decode(repack(header, payload))
    error = info.value
    # -1: the frame is not looked at, the header is already inconsistent with itself.
    assert (error.index, error.declared, error.expected, error.received) == (0, nbytes, 24, -1)


@pytest.mark.parametrize("nbytes", [-1, 24.0, "24", None, True])
def test_bad_byte_count(nbytes):
    header, payload = split(two_tensor_push())
    header["t"][1][2] = nbytes
    assert_malformed(repack(header, payload), f"tensor 1: bad byte count {nbytes!r}")


@pytest.mark.parametrize(
    "dtype",
    ["complex64", "complex128", "object", "float", "torch.float32", "Float32", "uint16",
     "float8_e4m3fn", "", 5, None, 1.5, ["float32"], True],
)
def test_dtype_not_allowed(dtype):
    header, payload = split(two_tensor_push())
    header["t"][1][0] = dtype
    with pytest.raises(DtypeError) as info:
        decode(repack(header, payload))
    assert info.value.dtype == dtype
    assert type(info.value.dtype) is type(dtype)
    assert info.value.code is RejectCode.DTYPE


@pytest.mark.parametrize(
    "shape",
    [[-1], [2, -3], [1] * (MAX_DIMS + 1), [1.5], ["6"], [True], [None], [[6]], [INT64_MAX + 1],
     "6", 6, None, {"0": 6}],
    ids=["neg", "neg2", "dims", "float", "str", "bool", "none", "nested", "huge", "strshape",
         "intshape", "noneshape", "map"],
)
def test_bad_shape(shape):
    header, payload = split(two_tensor_push())
    header["t"][0][1] = shape
    assert_malformed(repack(header, payload), f"tensor 0: bad shape {shape!r}")


def test_shape_with_the_most_dims_is_accepted():
    tensor = torch.arange(2, dtype=torch.int16).reshape([1] * (MAX_DIMS - 1) + [2])
    decoded = decode(received(encode(Weights(tensors=(tensor,)))))
    assert_same_tensors(decoded.tensors, (tensor,))


def test_total_size_over_the_limit():
    frames = received(encode(two_tensor_push()))  # 24 + 32 bytes
    with pytest.raises(MessageTooLargeError) as info:
        decode(frames, max_bytes=55)
    assert (info.value.size, info.value.limit) == (56, 55)
    assert info.value.code is RejectCode.TOO_LARGE
    assert decode(frames, max_bytes=56) == two_tensor_push()


def test_huge_declared_size_is_refused_before_frames_are_read():
    header, _ = split(two_tensor_push())
    size = 2**40 * 4
    header["t"] = [["float32", [2**40], size, CHUNK_BYTES], ["int64", [0], 0, CHUNK_BYTES]]
    with pytest.raises(MessageTooLargeError) as info:
        decode(repack(header, [bytearray(0), bytearray(0)]))
    assert (info.value.size, info.value.limit) == (size, DEFAULT_MAX_MESSAGE_BYTES)


# Layout -------------------------------------------------------------------------------

MODEL = Layout.of(
    [
        ("w", torch.zeros(2, 3)),
        ("steps", torch.zeros(4, dtype=torch.int64)),
    ]
)  # buckets: float32 [6], int64 [4]


def layout_push(*tensors):
    return received(encode(Push(sender=0, clock=0, loss=1.0, samples=8, tensors=tensors)))


def test_matching_layout_is_accepted():
    tensors = (torch.ones(6), torch.arange(4))
    decoded = decode(layout_push(*tensors), layout=MODEL)
    assert_same_tensors(decoded.tensors, tensors)


@pytest.mark.parametrize("cls", [Weights, Welcome], ids=lambda c: c.__name__)
def test_layout_applies_to_every_tensor_kind(cls):
    frames = received(encode(SAMPLES[cls.KIND]))  # float32 [6], int64 [3]
    matching = Layout.of([("w", torch.zeros(6)), ("n", torch.zeros(3, dtype=torch.int64))])
    assert_same_tensors(decode(frames, layout=matching).tensors, WEIGHTS)
    with pytest.raises(LayoutError) as info:
        decode(frames, layout=MODEL)
    assert info.value.reason == "buffer 1 is torch.int64[3], expected torch.int64[4]"


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ((torch.ones(6, dtype=torch.float64), torch.arange(4)),
         "buffer 0 is torch.float64[6], expected torch.float32[6]"),
        ((torch.ones(5), torch.arange(4)), "buffer 0 is torch.float32[5], expected torch.float32[6]"),
        ((torch.ones(6), torch.arange(5)), "buffer 1 is torch.int64[5], expected torch.int64[4]"),
        ((torch.ones(2, 3), torch.arange(4)),
         "buffer 0 is torch.float32[2, 3], expected torch.float32[6]"),
        ((torch.arange(4), torch.ones(6)), "buffer 0 is torch.int64[4], expected torch.float32[6]"),
        ((torch.ones(6),), "1 buffers, the model has 2"),
        ((torch.ones(6), torch.arange(4), torch.ones(1)), "3 buffers, the model has 2"),
    ],
    ids=["dtype", "numel", "numel2", "shape", "order", "fewer", "more"],
)
def test_layout_mismatch(tensors, reason):
    with pytest.raises(LayoutError) as info:
        decode(layout_push(*tensors), layout=MODEL)
    assert info.value.reason == reason
    assert info.value.code is RejectCode.LAYOUT


def changes(*tensors):
    return received(encode(Changes(version=9, base=8, tensors=tensors)))


def test_changes_are_checked_as_indices_and_values_per_bucket():
    tensors = (torch.tensor([1, 4]), torch.tensor([0.5, 2.0]),
               torch.arange(4), torch.arange(4))  # every element of the int64 bucket
    assert_same_tensors(decode(changes(*tensors), layout=MODEL).tensors, tensors)
    none = torch.zeros(0, dtype=torch.int64)
    assert decode(changes(none, torch.zeros(0), none, none), layout=MODEL).base == 8  # no change


def _bucket(b, indices, values, dtype, most):
    return (f"bucket {b}: indices {indices} and values {values}, expected int64[m] and "
            f"{dtype}[m], m <= {most}")


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ((torch.tensor([1]), torch.tensor([0.5])),
         "2 buffers, want an index and a value buffer for each of the model's 2"),
        ((torch.tensor([1]), torch.tensor([0.5], dtype=torch.float64), torch.arange(1), torch.arange(1)),
         _bucket(0, "torch.int64[1]", "torch.float64[1]", "torch.float32", 6)),
        ((torch.tensor([1], dtype=torch.int32), torch.tensor([0.5]), torch.arange(1), torch.arange(1)),
         _bucket(0, "torch.int32[1]", "torch.float32[1]", "torch.float32", 6)),
        ((torch.tensor([1, 2]), torch.tensor([0.5]), torch.arange(1), torch.arange(1)),
         _bucket(0, "torch.int64[2]", "torch.float32[1]", "torch.float32", 6)),
        ((torch.tensor([1]), torch.tensor([0.5]), torch.arange(5), torch.arange(5)),
         _bucket(1, "torch.int64[5]", "torch.int64[5]", "torch.int64", 4)),
    ],
    ids=["fewer", "dtype", "index-dtype", "lengths", "too-many"],
)
def test_changes_that_do_not_fit_the_layout_are_refused(tensors, reason):
    with pytest.raises(LayoutError) as info:
        decode(changes(*tensors), layout=MODEL)
    assert info.value.reason == reason


FRAGMENTS = (Layout.of([("a", torch.zeros(4))]), Layout.of([("b", torch.zeros(2)),
                                                            ("n", torch.zeros(4, dtype=torch.int64))]))


@pytest.mark.parametrize("cls", [Push, Fragment], ids=lambda c: c.__name__)
def test_a_message_of_a_fragment_is_checked_against_that_fragment(cls):
    """Streaming averaging: a push (or a broadcast) of fragment i has fragment i's layout."""
    base = SAMPLES[cls.KIND]
    tensors = (torch.ones(2), torch.arange(4))
    message = decode(received(encode(replace(base, fragment=1, tensors=tensors))),
                     layout=MODEL, fragments=FRAGMENTS)
    assert message.fragment == 1
    assert_same_tensors(message.tensors, tensors)
    with pytest.raises(LayoutError) as info:  # fragment 0's layout is another
        decode(received(encode(replace(base, fragment=0, tensors=tensors))), layout=MODEL,
               fragments=FRAGMENTS)
    assert info.value.reason == "2 buffers, the model has 1"


@pytest.mark.parametrize(("fragment", "fragments", "reason"), [
    (2, FRAGMENTS, "fragment 2 of a model in 2 fragments"),
    (-2, FRAGMENTS, "fragment -2 of a model in 2 fragments"),
    (0, (), "fragment 0 of a model not in fragments"),
])
def test_a_fragment_the_model_is_not_cut_into_is_refused(fragment, fragments, reason):
    frames = received(encode(replace(SAMPLES[Kind.PUSH], fragment=fragment)))
    with pytest.raises(LayoutError) as info:
        decode(frames, layout=MODEL, fragments=fragments)
    assert info.value.reason == reason
    assert info.value.code is RejectCode.LAYOUT


def test_a_whole_push_is_checked_against_the_model_where_it_is_cut():
    tensors = (torch.ones(6), torch.arange(4))
    push = decode(layout_push(*tensors), layout=MODEL, fragments=FRAGMENTS)
    assert push.fragment == -1


def test_kinds_without_tensors_pass_a_layout_check():
    assert decode(received(encode(SAMPLES[Kind.ACK])), layout=MODEL) == SAMPLES[Kind.ACK]


@pytest.mark.parametrize("kind", [Kind.ACTIVATIONS, Kind.ACTIVATION_GRADS], ids=lambda k: k.name)
def test_activations_are_of_any_shape_not_the_model_s_layout(kind):
    decoded = decode(received(encode(SAMPLES[kind])), layout=MODEL)
    assert decoded == SAMPLES[kind]
    assert_same_tensors(decoded.tensors, SAMPLES[kind].tensors)


def test_an_activation_sent_whole_is_one_frame_read_where_it_lies():
    # (A stage sends each activation as one frame, so that the next stage computes on it
    # where ZeroMQ put it: nodes.neighbours.)
    big = torch.randn(3 * CHUNK_BYTES // 4)
    message = Activations(sender=0, stage=0, step=1, micro=0, outputs=1, batch=3,
                          tensors=(big, torch.arange(3)))
    frames = received(encode(message, chunk_bytes=DEFAULT_MAX_MESSAGE_BYTES))
    assert len(frames) == 3
    decoded = decode(frames)
    assert isinstance(decoded.tensors[0], torch.Tensor)
    assert decoded.tensors[0].data_ptr() == np.frombuffer(frames[1], dtype=np.uint8).ctypes.data
    assert torch.equal(decoded.tensors[0], big)


def test_an_activation_of_a_dtype_not_allowed_is_refused_before_it_is_read():
    header, payload = split(SAMPLES[Kind.ACTIVATIONS])
    header["t"][0][0] = "complex64"
    with pytest.raises(DtypeError):
        decode(repack(header, payload))


def test_an_activation_over_the_limit_is_refused():
    with pytest.raises(MessageTooLargeError):
        decode(received(encode(SAMPLES[Kind.ACTIVATIONS])), max_bytes=64)


def test_weights_without_tensors_means_nothing_newer_and_passes_the_layout_check():
    message = decode(received(encode(Weights(version=7))), layout=MODEL)
    assert message == Weights(version=7) and message.tensors == ()


@pytest.mark.parametrize("kind", [Kind.PUSH, Kind.WELCOME], ids=lambda k: k.name)
def test_tensor_kind_without_tensors_fails_the_layout_check(kind):
    cls = SCHEMA[kind][0]
    message = SAMPLES[kind]
    empty = cls(**{f.name: getattr(message, f.name) for f in fields(message)
                   if f.name not in ("tensors", "fragment")})
    with pytest.raises(LayoutError) as info:
        decode(received(encode(empty)), layout=MODEL)
    assert info.value.reason == "0 buffers, the model has 2"


# Encoding errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.complex128, torch.uint16, torch.float8_e4m3fn],
    ids=str,
)
def test_encode_refuses_dtype_not_allowed(dtype):
    tensor = torch.zeros(3, dtype=dtype)
    with pytest.raises(DtypeError) as info:
        encode(Weights(tensors=(torch.zeros(2), tensor)))
    assert info.value.dtype == str(dtype)
    assert info.value.code is RejectCode.DTYPE


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(6.0).reshape(2, 3).t(),
        lambda: torch.arange(8, dtype=torch.int32)[::2],
        lambda: torch.zeros(1, 3).expand(4, 3),
    ],
    ids=["transposed", "strided", "expanded"],
)
def test_encode_refuses_non_contiguous(make):
    tensor = make()
    assert not tensor.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        encode(Weights(tensors=(tensor,)))


def test_encode_accepts_a_tensor_that_requires_grad():
    weight = torch.nn.Parameter(torch.arange(3.0))
    frames = encode(Weights(tensors=(weight,)))
    assert frames[1].__array_interface__["data"][0] == weight.data_ptr()
    decoded = decode(received(frames))
    assert torch.equal(decoded.tensors[0], torch.arange(3.0))
    assert not decoded.tensors[0].requires_grad


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (MalformedHeaderError, RejectCode.MALFORMED),
        (ProtocolVersionError, RejectCode.PROTOCOL),
        (UnknownKindError, RejectCode.UNKNOWN_KIND),
        (FrameCountError, RejectCode.MALFORMED),
        (DtypeError, RejectCode.DTYPE),
        (ByteLengthError, RejectCode.MALFORMED),
        (LayoutError, RejectCode.LAYOUT),
        (MessageTooLargeError, RejectCode.TOO_LARGE),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_every_wire_error_is_a_wire_error_with_its_code(cls, code):
    assert issubclass(cls, WireError)
    assert cls.code is code


# Chunks -------------------------------------------------------------------------------


def _big(n: int = 5000) -> Weights:
    """A float32 [n] and an int64 [3]: the first is cut into several chunks of 4096 bytes."""
    return Weights(version=2, tensors=(torch.arange(n, dtype=torch.float32), torch.arange(3)))


def test_a_large_tensor_travels_in_chunks_and_arrives_in_pieces():
    frames = encode(_big(), chunk_bytes=MIN_CHUNK_BYTES)
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["t"] == [["float32", [5000], 20000, 4096], ["int64", [3], 24, 4096]]
    assert [memoryview(f).nbytes for f in frames[1:]] == [4096] * 4 + [3616, 24]
    decoded = decode(received(frames))
    big, small = decoded.tensors
    assert isinstance(big, Pieces) and len(big.parts) == 5
    assert (big.shape, big.dtype, big.numel()) == ((5000,), torch.float32, 5000)
    assert torch.equal(whole(big), torch.arange(5000, dtype=torch.float32))
    assert isinstance(small, torch.Tensor) and torch.equal(small, torch.arange(3))


@pytest.mark.parametrize("n", [CHUNK_BYTES // 4 + 1, 5 * CHUNK_BYTES // 4 + 3000])
def test_no_last_chunk_is_left_small_enough_for_pyzmq_to_copy(n):
    # pyzmq copies frames under 64 KiB: a colocated worker could not compute on them in place.
    tensor = torch.arange(n, dtype=torch.float32)
    frames = encode(Weights(tensors=(tensor,)))
    sizes = [memoryview(f).nbytes for f in frames[1:]]
    assert sum(sizes) == 4 * n and len(sizes) == -(-4 * n // CHUNK_BYTES)
    assert min(sizes) >= SMALL_FRAME and max(sizes) <= CHUNK_BYTES
    assert torch.equal(whole(decode(received(frames)).tensors[0]), tensor)


def test_chunks_hold_whole_elements_and_a_shaped_tensor_keeps_its_shape():
    tensor = torch.arange(3 * 1000, dtype=torch.float64).view(3, 1000)
    frames = encode(Weights(tensors=(tensor,)), chunk_bytes=5000)  # 625 float64
    assert msgpack.unpackb(frames[0], raw=False)["t"][0][3] == 5000
    got = decode(received(frames)).tensors[0]
    assert got.shape == (3, 1000) and torch.equal(whole(got), tensor)


def test_pieces_are_views_of_the_received_frames():
    frames = received(encode(_big(), chunk_bytes=MIN_CHUNK_BYTES))
    big = decode(frames).tensors[0]
    frames[2][:4] = struct.pack("<f", -1.0)  # the second chunk's first element: 1024
    assert big.parts[1][0].item() == -1.0


@pytest.mark.parametrize("cut", [lambda fs: fs[:-2] + fs[-1:], lambda fs: [*fs, b"x"]],
                         ids=["one-less", "one-more"])
def test_a_chunk_missing_or_extra_is_refused(cut):
    frames = received(encode(_big(), chunk_bytes=MIN_CHUNK_BYTES))
    with pytest.raises(FrameCountError):
        decode([frames[0], *cut(frames[1:])])


def test_a_chunk_of_the_wrong_size_is_refused():
    frames = received(encode(_big(), chunk_bytes=MIN_CHUNK_BYTES))
    frames[1], frames[2] = frames[1][:-4], frames[2] + frames[1][-4:]  # same total, cut elsewhere
    with pytest.raises(ByteLengthError):
        decode(frames)


@pytest.mark.parametrize("chunk", [4098, MIN_CHUNK_BYTES - 4, 0, -4096, 4096.0, "4096", None])
def test_a_bad_chunk_size_is_refused(chunk):
    header, payload = split(_big())
    header["t"][0][3] = chunk
    assert_malformed(repack(header, payload), "tensor 0: chunk of")


def test_a_small_tensor_may_declare_a_chunk_below_the_minimum_if_it_fits():
    header, payload = split(two_tensor_push())
    header["t"][0][3] = 24  # float32 [2, 3]: 24 bytes, one frame
    assert decode(repack(header, payload)) == two_tensor_push()


def test_too_many_frames_are_refused_before_any_is_read():
    header, _ = split(_big())
    n = (MAX_FRAMES + 1) * MIN_CHUNK_BYTES // 4
    header["t"] = [["float32", [n], n * 4, MIN_CHUNK_BYTES]]
    assert_malformed(repack(header, []), f"{MAX_FRAMES + 1} tensor frames, at most {MAX_FRAMES}")


def test_only_tensors_are_encoded():
    big = decode(received(encode(_big(), chunk_bytes=MIN_CHUNK_BYTES))).tensors[0]
    with pytest.raises(TypeError, match="only tensors are sent, not Pieces"):
        encode(Weights(tensors=(big,)))
