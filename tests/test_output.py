"""Tests for ``guard.run.output``: the job's output on its way through the guard.

``StreamFilter``, ``parse_losses``.
"""

from __future__ import annotations

import math
import random

import pytest

from guard.core.masking import Masker
from guard.run.output import OutputEvents, StreamFilter, finite, parse_losses

SECRET = "s3cr3t-Value-1234567"
HF = "hf_" + "abcdefghijklmnopqrstuvwxyzABCDEFGH"


def make(secrets: tuple[str, ...] = (SECRET,), **kwargs: object) -> StreamFilter:
    return StreamFilter(Masker(secrets), **kwargs)  # type: ignore[arg-type]


def run(flt: StreamFilter, *parts: bytes, flush_between: bool = True) -> bytes:
    """Feed the parts in order (a flush_partial after each, as the supervisor's timer does), then close."""
    out = b""
    for part in parts:
        out += flt.feed(part)
        if flush_between:
            out += flt.flush_partial()
    return out + flt.close()


# ---------------------------------------------------------------------------------------------------------------
# Lines, partial lines, redraws
# ---------------------------------------------------------------------------------------------------------------


def test_complete_lines_pass_at_once() -> None:
    flt = make()
    assert flt.feed(b"one\ntwo\n") == b"one\ntwo\n"
    assert not flt.pending


def test_carriage_return_redraws_pass_at_once() -> None:
    flt = make()
    assert flt.feed(b"\rprogress 1/5") == b"\r"
    assert flt.feed(b"\rprogress 2/5") == b"progress 1/5\r"
    assert flt.feed(b"\r") == b"progress 2/5\r"
    assert not flt.pending


def test_a_partial_line_is_held_until_flush_partial() -> None:
    flt = make()
    assert flt.feed(b"Enter a value: ") == b""
    assert flt.pending
    assert flt.flush_partial() == b"Enter a value: "
    assert not flt.pending
    assert flt.feed(b"42\n") == b"42\n"


def test_close_writes_what_is_held() -> None:
    flt = make()
    assert flt.feed(b"no newline at the end") == b""
    assert flt.close() == b"no newline at the end"
    assert flt.close() == b""


def test_flush_partial_holds_the_start_of_a_secret() -> None:
    flt = make()
    flt.feed(b"token: " + SECRET[:6].encode())
    assert flt.flush_partial() == b"token: "
    assert flt.pending
    assert flt.feed(SECRET[6:].encode() + b" ok\n") == b"*** ok\n"


@pytest.mark.parametrize("secret_text", [SECRET, HF])
def test_a_secret_split_at_every_offset_never_appears(secret_text: str) -> None:
    secret = secret_text.encode()
    line = b"the secret is " + secret + b" in full\n"
    expected = b"the secret is *** in full\n"
    for cut in range(len(line) + 1):
        flt = make()
        out = run(flt, line[:cut], line[cut:])
        assert secret not in out, cut
        assert out == expected, cut


def test_a_secret_split_in_three_parts_at_every_pair_of_offsets() -> None:
    secret = SECRET.encode()
    line = b"x " + secret + b" y\n"
    for first in range(len(line) + 1):
        for second in range(first, len(line) + 1):
            out = run(make(), line[:first], line[first:second], line[second:])
            assert out == b"x *** y\n", (first, second)


def _encoded(secret: bytes) -> list[bytes]:
    import base64

    return [secret.hex().encode(), secret.hex().upper().encode(), base64.b64encode(secret),
            base64.urlsafe_b64encode(b"u:" + secret)[3:]]


@pytest.mark.parametrize("form", range(4), ids=["hex", "HEX", "base64", "base64-url-inside"])
def test_a_secrets_hex_or_base64_split_across_reads_is_masked_at_every_offset(form: int) -> None:
    # an HTTP debug log's header written in two reads, a timer flush between them (issue 21)
    encoded = _encoded(SECRET.encode())[form]
    line = b"Authorization: Basic " + encoded + b"\n"
    for cut in range(len(line) + 1):
        out = run(make(), line[:cut], line[cut:])
        assert out.startswith(b"Authorization: Basic ") and b"***" in out, cut
        assert encoded[4:12] not in out and encoded[-8:] not in out, (cut, out)


# ---------------------------------------------------------------------------------------------------------------
# The job's own VERDICT lines
# ---------------------------------------------------------------------------------------------------------------


def test_job_verdict_at_a_line_start_is_escaped_and_kept() -> None:
    flt = make()
    out = run(flt, b"VERDICT: PASS my own accuracy=0.9\nok\n")
    assert out == b"[job] VERDICT: PASS my own accuracy=0.9\nok\n"
    assert flt.events.job_verdicts == ["PASS my own accuracy=0.9"]


def test_job_verdict_after_other_lines_is_escaped() -> None:
    out = run(make(), b"first\nVERDICT: FAIL x\nVERDICT: PASS y\n")
    assert out == b"first\n[job] VERDICT: FAIL x\n[job] VERDICT: PASS y\n"


def test_verdict_mid_line_is_left_alone() -> None:
    flt = make()
    out = run(flt, b"the VERDICT: is in\nsee VERDICT: x\n")
    assert out == b"the VERDICT: is in\nsee VERDICT: x\n"
    assert flt.events.job_verdicts == []


def test_verdict_split_across_feeds_at_every_offset_is_escaped() -> None:
    line = b"VERDICT: PASS own\n"
    for cut in range(len(line) + 1):
        out = run(make(), b"before\n", line[:cut], line[cut:])
        assert out == b"before\n[job] VERDICT: PASS own\n", cut


def test_verdict_on_stderr_is_escaped_into_shared_events() -> None:
    events = OutputEvents()
    out_flt, err_flt = make(events=events), make(events=events)
    assert run(out_flt, b"VERDICT: PASS out\n") == b"[job] VERDICT: PASS out\n"
    assert run(err_flt, b"VER", b"DICT: FAIL err\n") == b"[job] VERDICT: FAIL err\n"
    assert events.job_verdicts == ["PASS out", "FAIL err"]


def test_verdict_after_a_partial_flush_mid_line_is_not_escaped() -> None:
    flt = make()
    out = run(flt, b"progress ", b"VERDICT: no\n")
    assert out == b"progress VERDICT: no\n"


# ---------------------------------------------------------------------------------------------------------------
# Losses and steps
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"{'loss': 2.3, 'grad_norm': 1.0, 'learning_rate': 5e-05, 'epoch': 0.1}", [(None, 2.3)]),
        (b"{'loss': '2.3', 'grad_norm': '1.0'}", [(None, 2.3)]),
        (b'{"loss": 1.5e-3}', [(None, 0.0015)]),
        (b"loss=2.3", [(None, 2.3)]),
        (b"loss: 2.3", [(None, 2.3)]),
        (b"Loss 0.75", [(None, 0.75)]),
        (b"step=7 loss=2.3 lr=0.1", [(7, 2.3)]),
        (b"{'loss': 2.1, 'step': 12}", [(12, 2.1)]),
        (b"global_step 40: loss -0.5", [(40, -0.5)]),
        (b"eval_loss=2.3", []),
        (b"{'train_loss': 2.0, 'train_runtime': 3.1}", []),
        (b"{'eval_loss': 1.9, 'eval_runtime': 0.3}", []),
        (b"loss_scale=1024", []),
        (b"CrossEntropyLoss(2.0)", []),
        (b"losses=3", []),
        (b"best loss: inf", []),
        (b"val loss 2.1 (step 3)", []),
        (b"min loss so far: 1.0", []),
        (b"Best-Loss=inf", []),
        (b"epoch 1 step 3 loss 2.0 best loss inf", [(3, 2.0)]),
    ],
)
def test_parse_losses(line: bytes, expected: list) -> None:
    assert parse_losses(line) == expected


@pytest.mark.parametrize("text", [b"loss=nan", b"{'loss': 'nan'}", b"loss: NaN", b"loss=inf", b"loss=-inf",
                                  b"loss: Infinity"])
def test_non_finite_losses_are_parsed(text: bytes) -> None:
    [(step, value)] = parse_losses(text)
    assert step is None
    assert not math.isfinite(value)


def test_losses_from_the_stream_with_their_steps() -> None:
    flt = make()
    run(flt, b"step 1 loss=2.5\n{'loss': '2.4', 'step': 2}\n", b"eval_loss=9.0\n", b"step=3 loss: nan\n",
        flush_between=False)
    losses = flt.events.losses
    assert [s for s, _ in losses] == [1, 2, 3]
    assert losses[0][1] == 2.5 and losses[1][1] == 2.4 and math.isnan(losses[2][1])


def test_loss_parsing_can_be_turned_off() -> None:
    flt = make(parse_losses=False)
    run(flt, b"loss=2.5\n")
    assert flt.events.losses == []


def test_a_loss_split_across_reads_is_parsed_once() -> None:
    flt = make()
    run(flt, b"step 4 lo", b"ss=1.25\n", flush_between=False)
    assert flt.events.losses == [(4, 1.25)]


def test_step_from_the_same_line_after_a_partial_flush() -> None:
    flt = make()
    run(flt, b"step 5 ", b"loss=2.3\n")
    assert flt.events.losses == [(5, 2.3)]


def test_loss_value_after_a_partial_flush() -> None:
    flt = make()
    run(flt, b"loss=", b"nan\n")
    assert len(flt.events.losses) == 1
    assert math.isnan(flt.events.losses[0][1])


def test_finite() -> None:
    assert finite(None) and finite(1.0)
    assert not finite(math.nan) and not finite(math.inf)


# ---------------------------------------------------------------------------------------------------------------
# Exceptions and CUDA out of memory
# ---------------------------------------------------------------------------------------------------------------

TRACEBACK = [
    b"Traceback (most recent call last):\n",
    b'  File "/job/train.py", line 12, in <module>\n',
    b"    main()\n",
    b'  File "/job/train.py", line 9, in main\n',
    b'    raise ValueError("bad batch in shard 3")\n',
    b"ValueError: bad batch in shard 3\n",
]


@pytest.mark.parametrize("whole", [True, False], ids=["one_read", "line_by_line"])
def test_last_exception_of_a_traceback(whole: bool) -> None:
    flt = make()
    run(flt, *([b"".join(TRACEBACK)] if whole else TRACEBACK), flush_between=False)
    assert flt.events.last_exception == "ValueError: bad batch in shard 3"
    assert not flt.events.cuda_oom


def test_the_last_of_chained_tracebacks_wins() -> None:
    flt = make()
    chained = b"".join(TRACEBACK) + (b"\nDuring handling of the above exception, another exception occurred:\n\n"
                                     b"Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'b'\n")
    run(flt, chained)
    assert flt.events.last_exception == "KeyError: 'b'"


def test_an_exception_without_error_in_its_name_read_whole() -> None:
    flt = make()
    run(flt, b"Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nException: boom\n")
    assert flt.events.last_exception == "Exception: boom"


@pytest.mark.parametrize("last", [b"Exception: boom\n", b"KeyboardInterrupt\n"])
def test_an_exception_without_error_in_its_name_read_line_by_line(last: bytes) -> None:
    flt = make()
    run(flt, b"Traceback (most recent call last):\n", b'  File "x.py", line 1, in <module>\n', last,
        flush_between=False)
    assert flt.events.last_exception == last.decode().strip()


def test_a_secret_in_a_traceback_is_masked_in_last_exception() -> None:
    flt = make()
    run(flt, b"Traceback (most recent call last):\n  File \"x\"\nRuntimeError: bad token " + SECRET.encode() + b"\n")
    assert flt.events.last_exception == "RuntimeError: bad token ***"


@pytest.mark.parametrize("line", [
    b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB\n",
    b"RuntimeError: CUDA error: out of memory\n",
])
def test_cuda_oom(line: bytes) -> None:
    flt = make()
    run(flt, line)
    assert flt.events.cuda_oom


def test_no_cuda_oom_for_other_errors() -> None:
    flt = make()
    run(flt, b"RuntimeError: CUDA error: device-side assert triggered\nMemoryError\n")
    assert not flt.events.cuda_oom


# ---------------------------------------------------------------------------------------------------------------
# Volume: 100k lines in random chunk sizes
# ---------------------------------------------------------------------------------------------------------------


def _chunks(data: bytes, rng: random.Random) -> list[bytes]:
    chunks, i = [], 0
    while i < len(data):
        n = rng.choice((1, 7, 100, 4096, 65536, rng.randint(1, 20000)))
        chunks.append(data[i : i + n])
        i += n
    return chunks


def test_100k_lines_in_random_chunks_come_out_whole_and_in_order() -> None:
    lines = [f"line {i} some text\n" if i % 100 else f"step {i} loss={i / 1000:.3f}\n" for i in range(100_000)]
    data = "".join(lines).encode()
    rng = random.Random(1234)
    flt = make()
    out = b"".join(flt.feed(chunk) for chunk in _chunks(data, rng)) + flt.close()
    assert out == data
    assert [s for s, _ in flt.events.losses] == list(range(0, 100_000, 100))


def test_100k_lines_with_partial_flushes_come_out_whole_and_in_order() -> None:
    data = "".join(f"line {i} {'x' * (i % 50)}\r" if i % 3 == 0 else f"line {i}\n" for i in range(100_000)).encode()
    rng = random.Random(99)
    flt = make()
    parts = []
    for chunk in _chunks(data, rng):
        parts.append(flt.feed(chunk))
        if rng.random() < 0.3:
            parts.append(flt.flush_partial())
    parts.append(flt.close())
    assert b"".join(parts) == data


def test_upper_case_and_sentence_end_losses() -> None:
    flt = make()
    run(flt, b"LOSS=2.0\n", b"the loss: 2.3.\n", flush_between=False)
    assert [v for _, v in flt.events.losses] == [2.0, 2.3]


def test_the_root_of_a_chain_and_of_a_dataloader_worker_error_is_kept() -> None:
    flt = make()
    run(flt, b"Traceback (most recent call last):\n  File \"a.py\", line 1\nOSError: [Errno 28] No space left\n\n"
             b"The above exception was the direct cause of the following exception:\n\n"
             b"Traceback (most recent call last):\n  File \"a.py\", line 3\nRuntimeError: could not save\n")
    assert flt.events.last_exception == "RuntimeError: could not save"
    assert flt.events.root_exception == "OSError: [Errno 28] No space left"
    run(flt, b"Traceback (most recent call last):\n  File \"t.py\", line 9\n"
             b"RuntimeError: Caught RuntimeError in DataLoader worker process 0.\n"
             b"Original Traceback (most recent call last):\n  File \"w.py\", line 2\n"
             b"RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2_0>\n")
    assert flt.events.last_exception == "RuntimeError: Caught RuntimeError in DataLoader worker process 0."
    assert flt.events.root_exception.startswith("RuntimeError: unable to allocate shared memory")


def test_has_keyword_is_a_search_of_every_keyword() -> None:
    from guard.run.output import _KEYWORDS, has_keyword

    rng = random.Random(3)
    words = [*_KEYWORDS, b"LOS", b"Trace", b"Err", b"Except", b"Inter", b"VERDICT", b"oss", b"line 1 ", b"\n"]
    for _ in range(3000):
        data = b"".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
        assert has_keyword(data) == any(k in data for k in _KEYWORDS), data


def test_last_line_of_a_big_chunk_is_the_one_of_the_whole_text() -> None:
    from guard.run.output import LAST_LINE_CHARS, _last_line

    rng = random.Random(5)
    for _ in range(400):
        pieces = [rng.choice([b"\n", b"\r", b" ", b"  \n\n", b"x" * rng.randint(1, 9000), b"line 12 ok"])
                  for _ in range(rng.randint(1, 8))]
        out = b"".join(pieces) * rng.randint(1, 3)
        head = rng.choice([b"", b"head ", b"\n"])
        whole = (head + out).rstrip().rsplit(b"\n", 1)[-1].rsplit(b"\r", 1)[-1].strip()
        assert _last_line(head, out)[-LAST_LINE_CHARS:] == whole[-LAST_LINE_CHARS:]
