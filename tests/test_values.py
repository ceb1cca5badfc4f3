"""A rank's value on its way to the kernel (``nb_dist._shared._values``): large plain tensors
cross as raw out-of-band buffers, everything else as ``pickle`` always pickles it, and either
way the value that arrives means what the rank returned."""

from __future__ import annotations

import pickle

import pytest
import torch

from nb_dist import notebook_launcher
from nb_dist._shared import _values

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

BIG = _values.OUT_OF_BAND  # bytes: the smallest tensor that crosses out of band


def _through(value):
    """``value`` as the kernel gets it: dumped, its buffers copied as the pipe would, loaded."""
    data, buffers = _values.dumps(value)
    return _values.loads(data, [bytearray(b) for b in buffers]), buffers


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
    assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int64,
     torch.bool, torch.complex64, torch.uint8],
)  # fmt: skip
def test_a_large_tensor_of_any_dtype_crosses_out_of_band_and_arrives_equal(dtype):
    source = (torch.arange(BIG, dtype=torch.float64) % 7).to(dtype).reshape(-1, 8)
    back, buffers = _through({"w": source})
    assert [b.nbytes for b in buffers] == [source.nbytes]
    _same(back["w"], source)
    assert back["w"].data_ptr() != source.data_ptr()  # the kernel's own memory
    back["w"].view(torch.uint8).view(-1)[0] = 1  # and writable


def test_a_parameter_keeps_its_type_and_its_requires_grad():
    weight = torch.nn.Parameter(torch.randn(BIG // 4))
    frozen = torch.nn.Parameter(torch.randn(BIG // 4), requires_grad=False)
    leaf = torch.randn(BIG // 4).requires_grad_()
    back, buffers = _through([weight, frozen, leaf])
    assert len(buffers) == 3
    for got, sent in zip(back, [weight, frozen, leaf], strict=True):
        _same(got, sent)


def test_a_module_state_dict_arrives_equal():
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    state = model.state_dict()
    back, buffers = _through(state)
    assert len(buffers) == 1  # only the 128x256 weight is large; biases go in band
    assert list(back) == list(state)
    for key in state:
        _same(back[key], state[key])
    torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
                        ).load_state_dict(back)  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(4), id="small"),
        pytest.param(lambda: torch.zeros(0), id="empty"),
        pytest.param(lambda: torch.arange(2.0 * BIG).reshape(-1, 4).t(), id="transposed"),
        pytest.param(lambda: torch.arange(2.0 * BIG)[::2], id="strided-view"),
        pytest.param(lambda: torch.randn(BIG, requires_grad=True) * 2, id="non-leaf"),
        pytest.param(lambda: (1j * torch.randn(BIG // 8, dtype=torch.complex64)).conj(), id="conj"),
        pytest.param(lambda: torch.randn(BIG).to_sparse(), id="sparse"),
    ],
)
def test_other_tensors_are_pickled_as_pickle_does_and_keep_their_meaning(make):
    source = make()
    expected = pickle.loads(pickle.dumps(source))  # what plain pickle gives
    back, buffers = _through(source)
    if source.layout == torch.strided:  # (a sparse tensor's inner tensors may go out of band)
        assert buffers == []
    assert type(back) is type(expected) and back.layout == expected.layout
    assert back.dtype == expected.dtype and back.shape == expected.shape
    assert back.requires_grad == expected.requires_grad
    if source.layout == torch.strided:
        assert back.stride() == expected.stride()
    assert torch.equal(back.detach().to_dense(), source.detach().to_dense())


def test_plain_objects_and_numpy_arrays_round_trip():
    numpy = pytest.importorskip("numpy")
    value = {"step": 3, "name": "run", "curve": [0.5, 0.25], "array": numpy.arange(BIG),
             "small": numpy.arange(3)}  # fmt: skip
    back, buffers = _through(value)
    assert len(buffers) == 1  # numpy's own pickle-5 support; the small array stays in band
    assert back["small"].tolist() == [0, 1, 2]
    assert back["step"] == 3 and back["curve"] == [0.5, 0.25]
    assert (back["array"] == value["array"]).all()


def _rank_returns_tensors():
    import torch

    import nb_dist

    rank = nb_dist.rank()
    return {
        "bf16": torch.full((256, 512), rank + 0.5, dtype=torch.bfloat16),
        "param": torch.nn.Parameter(torch.arange(BIG, dtype=torch.float32)),
        "view": torch.arange(4 * BIG, dtype=torch.int32)[::4],
        "small": torch.tensor([rank]),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ranks_return_tensors_of_every_kind_through_a_real_launch(method):
    result = notebook_launcher(_rank_returns_tensors, num_processes=2, start_method=method)
    for rank, state in enumerate(result):
        assert state["bf16"].dtype == torch.bfloat16
        assert torch.equal(state["bf16"], torch.full((256, 512), rank + 0.5, dtype=torch.bfloat16))
        assert isinstance(state["param"], torch.nn.Parameter) and state["param"].requires_grad
        assert torch.equal(state["param"].detach(), torch.arange(BIG, dtype=torch.float32))
        assert torch.equal(state["view"], torch.arange(4 * BIG, dtype=torch.int32)[::4])
        assert state["small"].tolist() == [rank]


def test_a_result_its_bytes_and_the_idle_cross_one_pipe_in_order():
    """``send_result`` frames as ``Connection.send_bytes`` does and resumes partial writes:
    a value larger than the pipe arrives whole, then the message after it, read as the kernel
    reads a control pipe (``ControlReader``, a turn at a time)."""
    import multiprocessing
    import select
    import threading

    from nb_dist._shared import _protocol

    reader, writer = multiprocessing.Pipe(duplex=False)
    value = {"w": torch.arange(3 * 2**20 // 4, dtype=torch.float32)}  # 3 MiB: several writes
    data, buffers = _values.dumps(value)
    result = _protocol.Result(0.5, len(data), tuple(b.nbytes for b in buffers))
    sender = threading.Thread(
        target=_protocol.send_result,
        args=(writer, result, data, buffers, _protocol.Idle(1, 0)),
    )
    sender.start()
    control = _protocol.ControlReader(reader)
    arrived: list = []
    try:
        while len(arrived) < 2 and not control.closed:
            select.select([reader], [], [], 5.0)
            arrived += control.read()
        assert not control.closed and len(arrived) == 2, arrived
        value_in, idle = arrived
        assert isinstance(value_in, _protocol.Value) and value_in.result == result
        assert torch.equal(_values.loads(value_in.data, value_in.buffers)["w"], value["w"])
        assert idle == _protocol.Idle(1, 0)
    finally:
        sender.join()
        reader.close()
        writer.close()


def test_a_small_value_and_the_idle_after_it_arrive_in_one_read():
    # A node's agent forwards each read at once; had the Idle come in a later read, a live
    # cell on a cluster would have waited one more long poll for its end. A packet-mode pipe
    # (O_DIRECT) keeps each write a packet of its own, and a read returns one packet.
    import os
    from multiprocessing.connection import Connection

    from nb_dist._shared import _protocol

    read_fd, write_fd = os.pipe2(os.O_DIRECT)
    writer = Connection(write_fd, readable=False)
    try:
        data, buffers = _values.dumps(None)
        result = _protocol.Result(0.1, len(data))
        _protocol.send_result(writer, result, data, buffers, _protocol.Idle(3, 2))
        first = os.read(read_fd, 1 << 16)
        expected = _protocol._frame(result) + data + _protocol._frame(_protocol.Idle(3, 2))
        assert first == expected  # the whole of it, in the first read
    finally:
        writer.close()
        os.close(read_fd)


# ----------------------------------------------------------------------------- in transit
def _stream() -> tuple[bytes, list]:
    """A control stream as a rank writes it, and what the kernel must make of it: a message,
    a value with a buffer, a frame that is not a message, and the message after it."""
    from nb_dist._shared import _protocol

    hello = _protocol.Hello(11, 22, 1.5)
    value = {"w": torch.arange(BIG // 4, dtype=torch.float32), "name": "x"}
    data, buffers = _values.dumps(value)
    result = _protocol.Result(0.25, len(data), tuple(b.nbytes for b in buffers))
    stranger = pickle.dumps({"not": "a message"})
    raw = (
        _protocol._frame(hello) + _protocol._frame(result) + bytes(data)
        + b"".join(bytes(b) for b in buffers)
        + len(stranger).to_bytes(4, "big", signed=True) + stranger
        + _protocol._frame(_protocol.Idle(2, 5))
    )  # fmt: skip
    return raw, [hello, (result, value), TypeError, _protocol.Idle(2, 5)]


@pytest.mark.parametrize("piece", [1, 7, 4096, 60000])  # a pipe holds 64 kB
def test_the_control_pipe_is_parsed_as_its_bytes_arrive_in_any_pieces(piece):
    """The kernel's reader never waits for the rest of a frame or a value: pieces of any size
    (a byte at a time, a value cut in two) give the same messages in the same order."""
    import os
    from multiprocessing.connection import Connection

    from nb_dist._shared import _protocol

    raw, expected = _stream()
    read_fd, write_fd = os.pipe()
    conn = Connection(read_fd, writable=False)
    reader = _protocol.ControlReader(conn)
    arrived: list = []
    try:
        for at in range(0, len(raw), piece):
            os.write(write_fd, raw[at : at + piece])
            arrived += reader.read()  # returns at once with what is whole
            assert not reader.closed
        os.close(write_fd)
        write_fd = -1
        arrived += reader.read()
        assert reader.closed and not reader.in_transit
    finally:
        conn.close()
        if write_fd >= 0:
            os.close(write_fd)
    assert len(arrived) == len(expected), arrived
    assert arrived[0] == expected[0] and arrived[3] == expected[3]
    assert isinstance(arrived[2], expected[2])
    result, value = expected[1]
    assert isinstance(arrived[1], _protocol.Value) and arrived[1].result == result
    back = _values.loads(arrived[1].data, arrived[1].buffers)
    assert back["name"] == "x" and torch.equal(back["w"], value["w"])


def test_a_value_cut_off_by_the_ranks_death_is_dropped_and_the_pipe_reads_as_closed():
    import os
    from multiprocessing.connection import Connection

    from nb_dist._shared import _protocol

    read_fd, write_fd = os.pipe()
    conn = Connection(read_fd, writable=False)
    reader = _protocol.ControlReader(conn)
    try:
        os.write(write_fd, _protocol._frame(_protocol.Result(0.1, 1000)) + b"x" * 10)
        assert reader.read() == [] and reader.in_transit and not reader.closed
        os.close(write_fd)
        assert reader.read() == [] and reader.closed
    finally:
        conn.close()


def _returns_megabytes(mb):
    import os

    rank = int(os.environ["RANK"])
    return torch.full((mb * 262144,), float(rank))  # mb MB of float32


@pytest.mark.timeout(240)
def test_four_ranks_each_returning_64_mb_arrive_whole():
    """Every rank's value at once: the kernel reads each as its bytes arrive (one rank's
    value in transit never waits for another's)."""
    result = notebook_launcher(_returns_megabytes, (64,), num_processes=4, timeout=200)
    for rank, value in enumerate(result):
        assert value.shape == (64 * 262144,)
        assert bool((value == rank).all())


def _stalls_inside_its_value():
    """Announce a 1 MB value, send 1000 bytes of it, and stop there (a rank frozen while
    sending, as a stopped or swapped-out process is)."""
    import os
    import time

    from nb_dist._shared import _protocol, _reporting

    control = _reporting._sink._control
    os.write(control.fileno(), _protocol._frame(_protocol.Result(0.0, 1 << 20)) + b"\0" * 1000)
    time.sleep(300)


@pytest.mark.timeout(120)
def test_the_timeout_fires_while_a_value_is_in_transit():
    from nb_dist import LaunchTimeoutError

    began = __import__("time").monotonic()
    with pytest.raises(LaunchTimeoutError) as caught:
        notebook_launcher(_stalls_inside_its_value, num_processes=2, timeout=3)
    took = __import__("time").monotonic() - began
    assert {o.status for o in caught.value.outcomes} == {"stopped"}, caught.value.outcomes
    assert took < 3 + 5, took  # the timeout, then the report and the teardown (about 1 s)
