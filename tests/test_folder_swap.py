"""The folder destination never loses its secured copy: a push killed between the fallback swap's two renames, or
in the middle of the final push's renames, is found and finished by the next run (real processes, SIGKILL)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from guard.secure.dest.base import MANIFEST_NAME
from guard.secure.securer import Securer

ROOT = Path(__file__).resolve().parent.parent


def checkpoint(root: Path, step: int) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(bytes([step % 256]) * 5000)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def run_killed(code: str) -> int:
    """Run ``code`` in a child that SIGKILLs itself where the code says; returns its exit status."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return proc.returncode


def test_a_push_killed_between_the_fallback_renames_keeps_the_secured_copy(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    Securer(str(dest)).push_checkpoint(checkpoint(tmp_path / "a", 10), step=10, deadline=math.inf)
    newer = checkpoint(tmp_path / "b", 20)
    run_killed(f"""
        import os, signal, math
        from guard.secure import securer
        from guard.secure.dest import folder_swap
        folder_swap.rename_exchange = lambda a, b: False   # a file system without RENAME_EXCHANGE (NFS)
        real, calls = os.rename, []
        def rename(a, b):
            calls.append(b)
            if len(calls) == 2:                      # the previous copy moved aside, the new one not yet in place
                os.kill(os.getpid(), signal.SIGKILL)
            real(a, b)
        os.rename = rename
        securer.Securer({str(dest)!r}).push_checkpoint({str(newer)!r}, step=20, deadline=math.inf)
        """)
    assert not (dest / "last-checkpoint").exists()  # what the kill left
    securer = Securer(str(dest))
    record = securer.peek_last_checkpoint(deadline=math.inf)
    assert record is not None and record.step == 10  # found again, put back
    assert json.loads((dest / "last-checkpoint" / MANIFEST_NAME).read_text())["step"] == 10
    # the next push runs its stale-staging cleanup first: the previous copy survives it, then is replaced
    securer.push_checkpoint(newer, step=20, deadline=math.inf)
    assert (dest / "last-checkpoint" / "model.bin").read_bytes() == (newer / "model.bin").read_bytes()
    # the record before it kept aside (a taint reaching step 20 swaps it back) until the run is over
    assert sorted(p.name for p in dest.iterdir()) == [".last-checkpoint.kept", "last-checkpoint"]
    assert json.loads((dest / ".last-checkpoint.kept" / MANIFEST_NAME).read_text())["step"] == 10


def test_a_leftover_of_older_versions_is_put_back_not_deleted(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    Securer(str(dest)).push_checkpoint(checkpoint(tmp_path / "a", 10), step=10, deadline=math.inf)
    # the name an older guard gave the previous copy: it matched the stale-staging glob and was deleted
    os.rename(dest / "last-checkpoint", dest / ".last-checkpoint.tmp-999999999-abcd.old")
    Securer(str(dest)).push_checkpoint(checkpoint(tmp_path / "b", 5), step=5, deadline=math.inf)
    assert not (dest / ".last-checkpoint.tmp-999999999-abcd.old").exists()
    assert json.loads((dest / "last-checkpoint" / MANIFEST_NAME).read_text())["step"] == 5


def test_a_final_push_killed_midway_is_finished_by_the_next_run(tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    out.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (out / name).write_bytes(b"1" * 4000)
    Securer(str(dest)).push_final(out, deadline=math.inf)
    for name in ("a.bin", "b.bin", "c.bin"):
        (out / name).write_bytes(b"2" * 4000)
    run_killed(f"""
        import os, signal, math
        from guard.secure import securer
        real, calls = os.replace, []
        def replace(a, b):
            calls.append(b)
            if len(calls) == 2:                      # one file of the new model in place, two of the old
                os.kill(os.getpid(), signal.SIGKILL)
            real(a, b)
        os.replace = replace
        securer.Securer({str(dest)!r}).push_final({str(out)!r}, deadline=math.inf)
        """)
    mixed = {(dest / n).read_bytes()[:1] for n in ("a.bin", "b.bin", "c.bin")}
    assert mixed == {b"1", b"2"}  # what the kill left
    Securer(str(dest)).peek_last_checkpoint(deadline=math.inf)  # any later run looks at the destination first
    assert {(dest / n).read_bytes() for n in ("a.bin", "b.bin", "c.bin")} == {b"2" * 4000}
    assert not any(p.name.startswith(".") for p in dest.iterdir())


def test_a_push_killed_after_its_swap_leaves_no_staging_folder_once_the_run_is_over(tmp_path: Path) -> None:
    """Issue 33 item 3 (seen after accelerate's complete_nlp_example and a Trainer run): a push SIGKILLed after its
    swap, before it removed the previous copy, left ``.last-checkpoint.tmp-*`` at the destination for good when no
    later push came. ``Securer.tidy`` (run by the guard after the VERDICT) removes it; the new copy stays."""
    dest = tmp_path / "dest"
    Securer(str(dest)).push_checkpoint(checkpoint(tmp_path / "a", 10), step=10, deadline=math.inf)
    newer = checkpoint(tmp_path / "b", 20)
    run_killed(f"""
        import os, signal, math, shutil
        from guard.secure import securer
        from guard.secure.dest import folder_swap
        folder_swap.keep_aside = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # killed right after the swap
        securer.Securer({str(dest)!r}).push_checkpoint({str(newer)!r}, step=20, deadline=math.inf)
        """)
    assert [p.name for p in dest.iterdir() if p.name.startswith(".last-checkpoint.tmp-")]  # what the kill left
    assert json.loads((dest / "last-checkpoint" / MANIFEST_NAME).read_text())["step"] == 20
    Securer(str(dest)).tidy()
    assert sorted(p.name for p in dest.iterdir()) == ["last-checkpoint"]
    assert (dest / "last-checkpoint" / "model.bin").read_bytes() == (newer / "model.bin").read_bytes()
