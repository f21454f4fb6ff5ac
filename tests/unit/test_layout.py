"""Unit tests of `bus.layout`: dtype buckets, offsets, views into flat buffers, digest, check."""

import pytest
import torch

from tensorbus.bus.errors import LayoutError
from tensorbus.bus.layout import Bucket, Entry, Layout
from tensorbus.bus.messages import RejectCode

pytestmark = pytest.mark.timeout(30)


def named():
    """Mixed dtypes, interleaved, with a 0-dim tensor and an empty one."""
    return [
        ("conv.weight", torch.zeros(2, 3)),
        ("embed.index", torch.zeros(4, dtype=torch.int64)),
        ("conv.bias", torch.zeros(3)),
        ("half", torch.zeros(2, 1, dtype=torch.float16)),
        ("count", torch.zeros((), dtype=torch.int64)),
        ("empty", torch.zeros(0, 5)),
        ("scale", torch.zeros(())),
    ]


LAYOUT = Layout.of(named())


def test_of_groups_by_dtype_in_first_appearance_order():
    assert LAYOUT.buckets == (
        Bucket(torch.float32, 10),
        Bucket(torch.int64, 5),
        Bucket(torch.float16, 2),
    )


def test_of_entries_and_offsets():
    assert LAYOUT.entries == (
        Entry("conv.weight", torch.float32, (2, 3), bucket=0, offset=0, numel=6),
        Entry("embed.index", torch.int64, (4,), bucket=1, offset=0, numel=4),
        Entry("conv.bias", torch.float32, (3,), bucket=0, offset=6, numel=3),
        Entry("half", torch.float16, (2, 1), bucket=2, offset=0, numel=2),
        Entry("count", torch.int64, (), bucket=1, offset=4, numel=1),
        Entry("empty", torch.float32, (0, 5), bucket=0, offset=9, numel=0),
        Entry("scale", torch.float32, (), bucket=0, offset=9, numel=1),
    )


def test_of_keeps_the_given_order_not_sorted_names():
    layout = Layout.of([("b", torch.zeros(2)), ("a", torch.zeros(3))])
    assert [(e.name, e.offset) for e in layout.entries] == [("b", 0), ("a", 2)]


def test_empty_layout():
    layout = Layout.of([])
    assert layout.entries == ()
    assert layout.buckets == ()
    assert layout.nbytes == 0
    assert layout.allocate() == ()
    layout.check([])


def test_nbytes():
    assert [b.nbytes for b in LAYOUT.buckets] == [40, 40, 4]
    assert LAYOUT.nbytes == 84
    assert Layout.of([("flag", torch.zeros(3, dtype=torch.bool)),
                      ("w", torch.zeros(2, dtype=torch.bfloat16))]).nbytes == 7


def test_allocate_gives_zeroed_flat_buffers():
    flat = LAYOUT.allocate()
    assert [(t.dtype, tuple(t.shape)) for t in flat] == [
        (torch.float32, (10,)),
        (torch.int64, (5,)),
        (torch.float16, (2,)),
    ]
    assert all(t.is_contiguous() and not t.any() for t in flat)
    other = LAYOUT.allocate()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(flat, other, strict=True))


def test_views_have_the_entries_shapes_and_dtypes():
    views = LAYOUT.views(LAYOUT.allocate())
    assert [(v.dtype, tuple(v.shape)) for v in views] == [(e.dtype, e.shape) for e in LAYOUT.entries]


def test_views_alias_the_flat_buffers():
    flat = LAYOUT.allocate()
    views = LAYOUT.views(flat)
    for view, entry in zip(views, LAYOUT.entries, strict=True):
        bucket = flat[entry.bucket]
        if entry.numel:
            assert view.data_ptr() == bucket.data_ptr() + entry.offset * bucket.element_size()
    views[2].copy_(torch.tensor([7.0, 8.0, 9.0]))  # conv.bias
    views[4].fill_(-3)  # count
    views[6].fill_(0.5)  # scale
    assert flat[0].tolist() == [0, 0, 0, 0, 0, 0, 7, 8, 9, 0.5]
    assert flat[1].tolist() == [0, 0, 0, 0, -3]
    flat[0][:6] = torch.arange(6.0)
    assert views[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    flat[2][1] = 2.5
    assert views[3].tolist() == [[0.0], [2.5]]


def test_views_copy_a_model_in_and_out():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    layout = Layout.of(model.named_parameters())
    assert [e.name for e in layout.entries] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert layout.buckets == (Bucket(torch.float32, 12 + 4 + 8 + 2),)
    flat = layout.allocate()
    with torch.no_grad():
        for view, p in zip(layout.views(flat), model.parameters(), strict=True):
            view.copy_(p)
    want = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat[0], want)


def test_digest_is_a_short_hex_string_stable_across_builds():
    assert len(LAYOUT.digest) == 16
    int(LAYOUT.digest, 16)
    # A fixed value: workers and coordinators of different processes and releases must agree.
    assert Layout.of([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))]).digest == (
        "6656fe60322802d8"
    )


def test_digest_ignores_values_and_tensor_identity():
    other = Layout.of(
        [(name, torch.full_like(t, 1).requires_grad_(t.is_floating_point()))
         for name, t in named()]
    )
    assert other.digest == LAYOUT.digest
    assert Layout.of(named()).digest == LAYOUT.digest


def _changed(index, name=None, tensor=None):
    items = named()
    old_name, old_tensor = items[index]
    items[index] = (name or old_name, old_tensor if tensor is None else tensor)
    return Layout.of(items)


@pytest.mark.parametrize(
    "layout",
    [
        _changed(0, name="conv.weights"),
        _changed(0, tensor=torch.zeros(3, 2)),  # same numel, other shape
        _changed(0, tensor=torch.zeros(6)),
        _changed(2, tensor=torch.zeros(3, dtype=torch.float64)),
        _changed(4, tensor=torch.zeros((), dtype=torch.int32)),
        _changed(5, tensor=torch.zeros(5, 0)),
        Layout.of(list(reversed(named()))),
        Layout.of(named()[:-1]),
        Layout.of([*named(), ("extra", torch.zeros(1))]),
    ],
    ids=["name", "shape", "flatten", "dtype", "int-dtype", "empty-shape", "order", "fewer", "more"],
)
def test_digest_changes_with_names_shapes_dtypes_and_order(layout):
    assert layout.digest != LAYOUT.digest


EXACT = [(torch.float32, (10,)), (torch.int64, (5,)), (torch.float16, (2,))]


def test_check_accepts_the_exact_specs():
    LAYOUT.check(EXACT)
    LAYOUT.check([(d, list(s)) for d, s in EXACT])  # a shape as the wire's list


@pytest.mark.parametrize(
    ("specs", "reason"),
    [
        (EXACT[:2], "2 buffers, the model has 3"),
        ([*EXACT, (torch.float32, (1,))], "4 buffers, the model has 3"),
        ([], "0 buffers, the model has 3"),
        ([(torch.float64, (10,)), *EXACT[1:]],
         "buffer 0 is torch.float64[10], expected torch.float32[10]"),
        ([EXACT[0], (torch.int64, (6,)), EXACT[2]],
         "buffer 1 is torch.int64[6], expected torch.int64[5]"),
        ([*EXACT[:2], (torch.float16, (2, 1))],
         "buffer 2 is torch.float16[2, 1], expected torch.float16[2]"),
        ([*EXACT[:2], (torch.float16, ())], "buffer 2 is torch.float16[], expected torch.float16[2]"),
        ([EXACT[1], EXACT[0], EXACT[2]], "buffer 0 is torch.int64[5], expected torch.float32[10]"),
    ],
    ids=["fewer", "more", "none", "dtype", "numel", "not-flat", "scalar", "order"],
)
def test_check_refuses_anything_else(specs, reason):
    with pytest.raises(LayoutError) as info:
        LAYOUT.check(specs)
    assert info.value.reason == reason
    assert info.value.code is RejectCode.LAYOUT


# Fragments (streaming averaging) ----------------------------------------------------------


def sized(*numels: int, dtypes: tuple[torch.dtype, ...] = ()) -> Layout:
    return Layout.of((f"t{i}", torch.zeros(n, dtype=dtypes[i] if dtypes else torch.float32))
                     for i, n in enumerate(numels))


def test_fragments_are_runs_of_whole_tensors_cut_nearest_each_share():
    layout = sized(10, 10, 10, 10, 30, 30)  # 100 elements
    cut = [[(s.bucket, s.start, s.stop) for s in f.spans] for f in layout.fragments(2)]
    assert cut == [[(0, 0, 40)], [(0, 40, 100)]]  # 40 is nearer 50 than 70 is
    cut = [[(s.start, s.stop) for s in f.spans] for f in layout.fragments(3)]
    assert cut == [[(0, 30)], [(30, 70)], [(70, 100)]]
    assert [f.spans for f in layout.fragments(1)] == [layout.shard(0, 1).spans]


def test_every_fragment_has_a_tensor_however_large_one_is():
    layout = sized(1000, 1, 1, 1)
    assert [[(s.start, s.stop) for s in f.spans] for f in layout.fragments(4)] == [
        [(0, 1000)], [(1000, 1001)], [(1001, 1002)], [(1002, 1003)]]


def test_a_fragment_is_one_span_a_bucket_and_travels_as_one_bucket_a_span():
    layout = sized(4, 2, 6, 3, dtypes=(torch.float32, torch.float64, torch.float32, torch.float64))
    first, second = layout.fragments(2)
    assert [(s.bucket, s.start, s.stop) for s in first.spans] == [(0, 0, 4), (1, 0, 2)]
    assert [(s.bucket, s.start, s.stop) for s in second.spans] == [(0, 4, 10), (1, 2, 5)]
    assert second.layout.buckets == (Bucket(torch.float32, 6), Bucket(torch.float64, 3))
    assert first.layout.digest != second.layout.digest != layout.digest
    flat = layout.allocate()
    assert second.take(flat)[0].data_ptr() == flat[0][4:].data_ptr()  # views, no copy


@pytest.mark.parametrize("count", [0, 5])
def test_fragments_beyond_the_tensors_are_refused(count):
    with pytest.raises(ValueError, match=rf"^{count} fragments for a model of 4 tensors: use 1 to 4$"):
        sized(1, 2, 3, 4).fragments(count)
