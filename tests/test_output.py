"""Output routing: every rank's lines reach the caller labelled, whole, in order, and logged.

The launcher writes worker output to the caller's ``sys.stdout``/``sys.stderr`` (looked up at
write time), so pytest's ``capsys`` sees exactly what a notebook cell would show.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import sys
import threading

import pytest

from nb_dist import notebook_launcher
from nb_dist._kernel._output import LineSplitter
from nb_dist._kernel._tracebacks import (
    blocked_place,
    format_frames,
    innermost_user_frame,
    parse_fault_dump,
)
from nb_dist._shared._frames import ENTRY_FILE, FUNCTION_CALL

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast

THIS_FILE = os.path.basename(__file__)
N_LINES = 2000


def _line_of(text: str) -> int:
    """Line number (1-based) of the first line of this file containing ``text``."""
    with open(__file__, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if text in line:
                return number
    raise AssertionError(f"{text!r} not found in {__file__}")


# ----------------------------------------------------------------------------- worker functions
def _every_kind_of_output():
    rank = int(os.environ["RANK"])
    print(f"python stdout {rank}")
    print(f"python stderr {rank}", file=sys.stderr)
    os.write(1, f"raw fd write {rank}\n".encode())
    os.write(2, f"raw fd2 write {rank}\n".encode())
    libc = ctypes.CDLL(None)
    libc.printf(b"C printf %d\n", ctypes.c_int(rank))
    libc.fflush(None)
    return rank


def _many_lines():
    rank = int(os.environ["RANK"])
    for i in range(N_LINES):
        print(f"r{rank}-{i}")
    return rank


def _partial_and_progress():
    rank = int(os.environ["RANK"])
    for step in ("\r10%", "\r50%", "\r100%\n"):
        print(step, end="", flush=True)
    print(f"no newline at the end {rank}", end="", flush=True)
    return rank


def _hello():
    rank = int(os.environ["RANK"])
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    return rank


def _unicode():
    print("héllo 🚀 你好 ✓ Ωμέγα")
    return "🚀"


def _gloo_chatter():
    # What gloo prints on every rank of every launch from torch 2.10 to 2.12 (C++ printf),
    # then a warning and an error of gloo's own, which must still show.
    rank = int(os.environ["RANK"])
    libc = ctypes.CDLL(None)
    libc.printf(
        b"[Gloo] Rank %d is connected to 1 peer ranks. Expected number of connected peer "
        b"ranks is : 1\n",
        ctypes.c_int(rank),
    )
    libc.fflush(None)
    print(f"[Gloo] Rank {rank}: a warning of gloo's own", file=sys.stderr)
    print(f"training on rank {rank}")
    return rank


# ----------------------------------------------------------------------------- labels
def test_every_line_is_labelled_and_goes_to_its_stream(capsys):
    """Python, fd-level and C printf output of each rank arrive labelled on the right stream."""
    result = notebook_launcher(_every_kind_of_output, num_processes=2)
    assert list(result) == [0, 1]
    captured = capsys.readouterr()
    out_lines = captured.out.splitlines()
    err_lines = captured.err.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] python stdout {rank}" in out_lines
        assert f"[rank {rank}] raw fd write {rank}" in out_lines
        assert f"[rank {rank}] C printf {rank}" in out_lines
        assert f"[rank {rank}] python stderr {rank}" in err_lines
        assert f"[rank {rank}] raw fd2 write {rank}" in err_lines
        assert sorted(result.logs[rank].splitlines()) == sorted(
            [
                f"python stdout {rank}",
                f"python stderr {rank}",
                f"raw fd write {rank}",
                f"raw fd2 write {rank}",
                f"C printf {rank}",
            ]
        )
    assert len(out_lines) == 6 and len(err_lines) == 4
    assert all(re.match(r"\[rank [01]\] ", line) for line in out_lines + err_lines)
    assert not any("stderr" in line or "fd2" in line for line in out_lines)


@pytest.mark.timeout(60)
def test_lines_of_different_ranks_never_merge(capsys):
    """2 ranks x 2000 fast lines: each output line is one label plus one whole token, in order."""
    result = notebook_launcher(_many_lines, num_processes=2)
    assert list(result) == [0, 1]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * N_LINES
    seen: dict[int, list[int]] = {0: [], 1: []}
    for line in lines:
        match = re.fullmatch(r"\[rank (\d)\] r(\d)-(\d+)", line)
        assert match, f"malformed line: {line!r}"
        assert match[1] == match[2], f"line labelled with the wrong rank: {line!r}"
        seen[int(match[1])].append(int(match[3]))
    for rank in (0, 1):
        assert seen[rank] == list(range(N_LINES)), f"rank {rank}'s lines lost or reordered"
        assert result.logs[rank].splitlines() == [f"r{rank}-{i}" for i in range(N_LINES)]


def test_partial_last_line_and_carriage_return_progress(capsys):
    """A final line without newline is delivered; a \\r progress bar collapses to its last state."""
    notebook_launcher(_partial_and_progress, num_processes=2)
    lines = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        assert f"[rank {rank}] 100%" in lines
        assert f"[rank {rank}] no newline at the end {rank}" in lines
    assert not any("10%" in line or "50%" in line for line in lines), lines
    assert len(lines) == 4


# ----------------------------------------------------------------------------- modes, prefix
def test_output_rank0_shows_rank0_only_but_logs_all(capsys):
    """output='rank0': the cell shows rank 0 only; result.logs keeps rank 1's lines."""
    result = notebook_launcher(_hello, num_processes=2, output="rank0")
    captured = capsys.readouterr()
    assert captured.out == "[rank 0] hello from 0\n"
    assert captured.err == "[rank 0] warning from 0\n"
    assert sorted(result.logs[1].splitlines()) == ["hello from 1", "warning from 1"]
    assert sorted(result.logs[0].splitlines()) == ["hello from 0", "warning from 0"]


def _interleaved(count: int):
    rank = int(os.environ["RANK"])
    for i in range(count):
        print(f"step {i} on rank {rank}", flush=True)
    return rank


@pytest.mark.parametrize("repeat", range(2))
def test_output_grouped_is_rank_by_rank_and_identical_every_run(capsys, repeat):
    """output='grouped': all of rank 0's lines, then rank 1's, whatever the timing was."""
    notebook_launcher(_interleaved, args=(50,), num_processes=2, output="grouped")
    expected = "".join(
        f"[rank {rank}] step {i} on rank {rank}\n" for rank in range(2) for i in range(50)
    )
    assert capsys.readouterr().out == expected


def test_output_none_shows_nothing_but_logs_all(capsys):
    """output='none': nothing is printed; every rank's output is still in result.logs."""
    result = notebook_launcher(_hello, num_processes=2, output="none")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    for rank in (0, 1):
        assert sorted(result.logs[rank].splitlines()) == [
            f"hello from {rank}",
            f"warning from {rank}",
        ]


def test_log_line_prefix_template_is_applied(capsys):
    """log_line_prefix_template='[${rank}/${local_rank}]: ' replaces the default label."""
    notebook_launcher(_hello, num_processes=2, log_line_prefix_template="[${rank}/${local_rank}]: ")
    captured = capsys.readouterr()
    assert sorted(captured.out.splitlines()) == ["[0/0]: hello from 0", "[1/1]: hello from 1"]
    assert sorted(captured.err.splitlines()) == ["[0/0]: warning from 0", "[1/1]: warning from 1"]
    assert "[rank" not in captured.out


def test_unicode_output_survives(capsys):
    """Emoji, CJK and Greek text reach the caller and the logs intact, and as return values."""
    result = notebook_launcher(_unicode, num_processes=2)
    assert list(result) == ["🚀", "🚀"]
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[rank 0] héllo 🚀 你好 ✓ Ωμέγα", "[rank 1] héllo 🚀 你好 ✓ Ωμέγα"]
    assert result.logs[1] == "héllo 🚀 你好 ✓ Ωμέγα\n"


# ----------------------------------------------------------------------------- LineSplitter
def test_line_splitter_joins_chunks_into_whole_lines():
    """Lines split across chunks are joined; complete lines come out as soon as they end."""
    s = LineSplitter()
    assert s.feed(b"hel") == []
    assert s.pending_since is not None
    assert s.feed(b"lo\nwor") == ["hello"]
    assert s.feed(b"ld\n\nlast") == ["world", ""]
    assert s.flush() == ["last"]
    assert s.pending_since is None
    assert s.flush() == []


def test_line_splitter_multibyte_char_split_between_feeds():
    """A UTF-8 character split between two reads is decoded whole, not replaced."""
    data = "é🚀\n".encode()
    assert len(data) == 7
    s = LineSplitter()
    out = []
    for i in range(len(data)):  # one byte per feed: every split point
        out += s.feed(data[i : i + 1])
    assert out == ["é🚀"]
    s = LineSplitter()
    assert s.feed(b"caf\xc3") == []
    assert s.feed(b"\xa9\n") == ["café"]


def test_line_splitter_keeps_what_a_terminal_shows_of_carriage_returns():
    """\\r redraws keep only the last state; CRLF line ends lose the \\r."""
    s = LineSplitter()
    assert s.feed(b"\r10%\r50%") == []
    assert s.feed(b"\r100%\n") == ["100%"]
    assert s.feed(b"windows line\r\n") == ["windows line"]
    assert s.feed(b"epoch 1 \r") == []
    assert s.flush() == ["epoch 1 "]


def test_line_splitter_invalid_utf8_is_replaced_not_fatal():
    """Bytes that are not UTF-8 become U+FFFD instead of breaking the stream."""
    s = LineSplitter()
    assert s.feed(b"bad \xff byte\n") == ["bad \ufffd byte"]
    assert s.feed(b"trailing \xe2\x82") == []
    assert s.flush() == ["trailing \ufffd"]


# ----------------------------------------------------------------------------- tracebacks
FAKE_LIB = "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
NB_DIST_WORKER = ENTRY_FILE
USER_LINE = _line_of("# a stand-in for the user" + "'s code")
MAIN_IDENT = 0x7F1234567000
OTHER_IDENT = 0x7F12345ABC00

FAULT_DUMP = f"""\
Thread 0x{OTHER_IDENT:016x} (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 622 in wait
  File "/home/me/lifeline_helper.py", line 12 in watch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x{MAIN_IDENT:016x} (most recent call first):
  File "{FAKE_LIB}", line 3252 in all_reduce
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{__file__}", line {USER_LINE} in _user_train_step
  File "{NB_DIST_WORKER}", line 106 in _run
  File "<frozen runpy>", line 88 in _run_code
"""


def _user_train_step():  # a stand-in for the user's code in the dump above
    return None


def test_parse_fault_dump_picks_the_thread_by_ident():
    """The worker's main thread is chosen by ident; frames come back most recent last."""
    main = parse_fault_dump(FAULT_DUMP, MAIN_IDENT)
    assert main == [
        ("<frozen runpy>", 88, "_run_code"),
        (NB_DIST_WORKER, 106, "_run"),
        (__file__, USER_LINE, "_user_train_step"),
        ("/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 83, "wrapper"),
        (FAKE_LIB, 3252, "all_reduce"),
    ]
    other = parse_fault_dump(FAULT_DUMP, OTHER_IDENT)
    assert [name for _, _, name in other] == ["run", "watch", "wait", "wait"]
    # Unknown ident or None: the first block.
    assert parse_fault_dump(FAULT_DUMP, None) == other
    assert parse_fault_dump(FAULT_DUMP, 0xDEAD) == other
    assert parse_fault_dump("no dump here\n", MAIN_IDENT) == []


def _blocked_helper(event: threading.Event) -> None:
    event.wait(30)  # the helper thread waits here


def test_parse_fault_dump_of_a_real_two_thread_dump(tmp_path):
    """A dump written by faulthandler itself parses for both the main and a helper thread."""
    event = threading.Event()
    helper = threading.Thread(target=_blocked_helper, args=(event,))
    helper.start()
    try:
        path = tmp_path / "dump.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
    finally:
        event.set()
        helper.join()
    dump = path.read_text()
    assert "Current thread" in dump and dump.count("Thread 0x") >= 1

    helper_frames = parse_fault_dump(dump, helper.ident)
    assert (__file__, _line_of("event.wait(30)  # the helper"), "_blocked_helper") in (
        helper_frames
    )
    assert helper_frames[-1][2] == "wait"  # innermost: threading's wait
    main_frames = parse_fault_dump(dump, threading.main_thread().ident)
    names = [name for _, _, name in main_frames]
    assert "test_parse_fault_dump_of_a_real_two_thread_dump" in names
    assert "_blocked_helper" not in names
    where = innermost_user_frame(helper_frames)
    assert where == (
        f"`event.wait(30)  # the helper thread waits here` at {THIS_FILE}, "
        f"line {_line_of('event.wait(30)  # the helper')}, in _blocked_helper"
    )


def test_format_frames_drops_launcher_frames_and_shows_source():
    """format_frames reads like a traceback body: the user's source is shown; nb_dist's frames
    and everything below the worker's entry (the caller's frames a fork inherits) are hidden."""
    text = format_frames(parse_fault_dump(FAULT_DUMP, MAIN_IDENT))
    assert text.splitlines() == [
        f'  File "{__file__}", line {USER_LINE}, in _user_train_step',
        "    def _user_train_step():  # a stand-in for the user's code in the dump above",
        '  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", '
        "line 83, in wrapper",
        f'  File "{FAKE_LIB}", line 3252, in all_reduce',
    ]
    assert format_frames([]) == ""


def test_innermost_user_frame_skips_library_and_launcher_frames():
    """The reported place is the user's innermost line, not torch's, runpy's or nb_dist's."""
    frames = parse_fault_dump(FAULT_DUMP, MAIN_IDENT)
    assert innermost_user_frame(frames) == (
        "`def _user_train_step():  # a stand-in for the user's code in the dump above` at "
        f"{THIS_FILE}, line {USER_LINE}, in _user_train_step"
    )
    only_library = [f for f in frames if f[2] != "_user_train_step"]
    assert innermost_user_frame(only_library) is None
    # A user file whose source is not available still gives the place, without code.
    assert innermost_user_frame([("/home/me/gone.py", 7, "train")]) == "gone.py, line 7, in train"


def test_blocked_place_names_a_hang_at_the_return_of_the_function():
    """A stack that ends at the worker's call of the function (no user frame) is a native hang
    while the function's locals are freed; other stacks without user code say so."""
    call_file, call_name = FUNCTION_CALL
    inherited = [("/usr/lib/python3.11/runpy.py", 88, "_run_code")]
    at_return = [*inherited, (ENTRY_FILE, 90, "run_rank"), (call_file, 117, call_name)]
    place = blocked_place(at_return)
    assert place.startswith("the return from the function, in native code"), place
    assert "del the model before destroy_process_group()" in place
    lib = "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    in_torch = [*at_return, (lib, 2100, "destroy_process_group")]
    assert blocked_place(in_torch) == "an unknown place (native code, no Python frame of yours)"
    assert blocked_place([]) == "an unknown place (native code, no Python frame of yours)"
    user = [*at_return, ("/home/me/train.py", 7, "train")]
    assert blocked_place(user) == "train.py, line 7, in train"


@pytest.mark.parametrize("output", ["all", "grouped"])
def test_torchs_connection_chatter_stays_in_the_logs(capsys, output):
    """gloo's "is connected to N peer ranks" lines reach ``result.logs``, not the cell; the
    rank's other lines, gloo's warnings included, are shown as ever."""
    result = notebook_launcher(_gloo_chatter, num_processes=2, output=output)
    captured = capsys.readouterr()
    assert "is connected to" not in captured.out + captured.err
    for rank in (0, 1):
        assert f"[rank {rank}] training on rank {rank}" in captured.out.splitlines()
        assert f"[rank {rank}] [Gloo] Rank {rank}: a warning of gloo's own" in (
            captured.err.splitlines()
        )
        assert (
            f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected "
            f"peer ranks is : 1" in result.logs[rank].splitlines()
        )
