"""The launcher's command (torchrun, python -m torch.distributed.run, accelerate launch) and the launch smoke."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import JOBS, run_guard

from guard.preflight import PreflightOptions, run_preflight
from guard.preflight._models import GpuInfo
from guard.preflight.launch import (
    SMOKE_SCRIPT,
    check_launch,
    parse_launch,
    smoke_wanted,
)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpus(n: int) -> list[GpuInfo]:
    return [GpuInfo(i, "NVIDIA H100", f"GPU-{i}") for i in range(n)]


def test_torchrun_forms_are_read_with_their_world_and_script() -> None:
    launch = parse_launch(["torchrun", "--nnodes=2", "--nproc_per_node", "4", "--rdzv-endpoint", "node0:29400",
                           "--rdzv-backend", "c10d", "train.py", "--lr", "1e-4"])
    assert launch is not None
    assert (launch.launcher, launch.target, launch.script_args) == ("torchrun", "train.py", ("--lr", "1e-4"))
    assert (launch.nodes, launch.procs_per_node, launch.world_size) == ((2, 2), 4, 8)
    assert launch.master == ("node0", "29400") and launch.script == Path("train.py")
    module = parse_launch(["/usr/bin/python3.11", "-u", "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "gpu", "-m", "pkg.train"])
    assert module is not None and module.target_kind == "module" and module.script is None
    assert module.procs_per_node is None and module.world_size is None
    elastic = parse_launch(["torchrun", "--nnodes", "1:4", "--nproc-per-node", "2", "t.py"])
    assert elastic is not None and elastic.nodes == (1, 4) and elastic.world_size is None
    assert parse_launch(["python", "train.py"]) is None and parse_launch(["bash", "-c", "x"]) is None
    assert parse_launch(["torchrun", "--standalone"]) is None  # no script


def test_accelerate_launch_counts_processes_over_machines() -> None:
    launch = parse_launch(["accelerate", "launch", "--multi_gpu", "--num_processes", "8", "--num_machines", "2",
                           "--machine_rank", "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29500",
                           "train.py", "--epochs", "1"])
    assert launch is not None and launch.launcher == "accelerate"
    assert (launch.nodes, launch.procs_per_node, launch.world_size) == ((2, 2), 4, 8)
    assert launch.master == ("10.0.0.1", "29500") and launch.script_args == ("--epochs", "1")
    bare = parse_launch(["accelerate", "launch", "train.py"])
    assert bare is not None
    why = "the process count is not on the command line (accelerate's config file decides): --launch-smoke on tests it"
    assert smoke_wanted("auto", bare, None) == (False, why)


def test_the_smoke_command_keeps_the_world_arguments_and_swaps_the_script() -> None:
    launch = parse_launch(["torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port",
                           "29500", "--nproc-per-node", "2", "--max-restarts", "3", "train.py", "--x"])
    assert launch is not None
    assert launch.smoke_command(SMOKE_SCRIPT, ["--result-dir", "/tmp/r"]) == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "29500",
        "--nproc-per-node", "2", "--max-restarts", "3", "--max-restarts=0", str(SMOKE_SCRIPT), "--result-dir",
        "/tmp/r"]


def test_auto_runs_the_smoke_for_more_than_one_process_or_node() -> None:
    one = parse_launch(["torchrun", "--nproc-per-node", "1", "t.py"])
    two = parse_launch(["torchrun", "--nproc-per-node", "2", "t.py"])
    nodes = parse_launch(["torchrun", "--nnodes", "2", "t.py"])
    by_gpu = parse_launch(["torchrun", "--nproc-per-node", "gpu", "t.py"])
    assert smoke_wanted("auto", one, None)[0] is False
    assert smoke_wanted("auto", two, None)[0] is True and smoke_wanted("auto", nodes, None)[0] is True
    assert smoke_wanted("auto", by_gpu, gpus(1))[0] is False and smoke_wanted("auto", by_gpu, gpus(8))[0] is True
    assert smoke_wanted("on", one, None)[0] is True
    assert smoke_wanted("off", two, None) == (False, "off by --launch-smoke off")
    assert smoke_wanted("auto", None, None)[0] is False


def test_static_rows_processes_against_gpus_and_the_master_address() -> None:
    launch = parse_launch(["torchrun", "--nproc-per-node", "4", "--master-addr", "nowhere.invalid", "t.py"])
    assert launch is not None

    def no_dns(host: str, port: object) -> object:
        raise socket.gaierror(-2, "Name or service not known")

    rows = check_launch(launch, gpus=gpus(2), timeout_s=1.0, resolve=no_dns)
    assert [r.status for r in rows] == ["fail", "fail"]
    assert "4 processes per node, 2 GPUs visible" in rows[0].seen
    assert "master address nowhere.invalid does not resolve" in rows[1].seen
    ok = check_launch(launch, gpus=gpus(4), timeout_s=1.0, resolve=lambda h, p: [])
    assert [(r.status, r.seen) for r in ok] == [
        ("pass", "torchrun: 1 node x 4 processes (world 4) running t.py; master nowhere.invalid resolves")]


def test_a_launcher_command_is_checked_for_its_script_and_a_failing_world_skips_the_smoke(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("# /// script\n# dependencies = [\"no-such-dist-for-jobguard>=1\"]\n# ///\nprint('hi')\n")
    opts = PreflightOptions(command=("torchrun", "--nproc-per-node", "2", "--master-port", "99999", str(script)),
                            skip_checks={"gpu": "no GPU here"})
    report = run_preflight(opts, environ={"HF_HOME": str(tmp_path / "hf")})
    python = [r for r in report.results if r.name == "python"]
    assert "no-such-dist-for-jobguard not installed" in python[0].seen  # train.py's PEP 723 block was read
    dist = [(r.status, r.seen) for r in report.results if r.name == "distributed"]
    assert dist == [("fail", "master port '99999' is not a port"),
                    ("n/a", "launch smoke: not run: the world's arguments failed above")]


# ---------------------------------------------------------------------------------------------------------------
# End to end: the smoke under a real torchrun on the CPU (gloo)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_process_gloo_smoke_passes_then_the_job_runs(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    pids = tmp_path / "pids"
    pids.mkdir()
    run = run_guard(["--report", str(report), "--", TORCHRUN, "--standalone", "--nproc-per-node", "2",
                     str(JOBS / "ddp_loop.py"), "--steps", "6", "--step-s", "0", "--pid-dir", str(pids)],
                    timeout_s=240)
    assert run.returncode == 0, run.stderr[-3000:]
    smoke = run.stderr.index("launch smoke: world of 2 formed (gloo), all_reduce ok, ranks 0,1, in ")
    assert smoke < run.stderr.index("job started")
    assert sorted(p.name for p in pids.iterdir()) == ["rank0.pid", "rank1.pid"]
    rows = json.loads(report.read_text())["details"]["preflight"]
    dist = [r for r in rows if r["name"] == "distributed"]
    assert dist[0] == {"name": "distributed", "status": "pass", "hint": None,
                       "seen": f"torchrun: 1 node x 2 processes (world 2) running {JOBS / 'ddp_loop.py'}"}
    assert dist[1]["status"] == "pass" and dist[1]["seen"].startswith("launch smoke: world of 2 formed")
    assert [r["status"] for r in rows if r["name"] == "data"] == ["n/a"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(SMOKE_SCRIPT) in (p.info["cmdline"] or [])]


@pytest.mark.slow
def test_a_two_node_world_with_one_node_present_fails_within_the_smoke_timeout(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    started = time.monotonic()
    run = run_guard(["--launch-smoke-timeout", "8s", "--", TORCHRUN, "--nnodes", "2", "--node-rank", "0",
                     "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                     str(JOBS / "ddp_loop.py"), "--steps", "3", "--pid-dir", str(pids)], timeout_s=120)
    took = time.monotonic() - started
    assert run.returncode == 3, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["check"]) == ("preflight", "distributed")
    assert "launch smoke: no world in 8s: the rendezvous did not complete: no rank started on this node " \
           "(expected 2 nodes at 127.0.0.1:" in run.stderr
    assert "job started" not in run.stderr and not list(pids.iterdir())
    assert took < 60  # the smoke's 8 s, the other checks and the interpreter start; not torchrun's 15 min
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(SMOKE_SCRIPT) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers


@pytest.mark.slow
@pytest.mark.skipif(not Path(sys.executable).with_name("accelerate").exists(), reason="accelerate not installed")
def test_accelerate_without_gpus_starts_one_process_and_the_smoke_says_so(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("with GPUs accelerate launch starts a real world")
    pids = tmp_path / "pids"
    pids.mkdir()
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    run = run_guard(["--launch-smoke-timeout", "60s", "--", accelerate, "launch", "--num_processes", "2",
                     str(JOBS / "ddp_loop.py"), "--steps", "3", "--pid-dir", str(pids)], timeout_s=120)
    assert run.returncode == 3, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["check"]) == ("preflight", "distributed")
    assert "launch smoke: accelerate started one plain process (no RANK, WORLD_SIZE), not a world of 2" in run.stderr
    assert "use torchrun" in fields["hint"] and "firewall" not in fields["hint"]
    assert "job started" not in run.stderr and not list(pids.iterdir())


@pytest.mark.slow
def test_launch_smoke_off_by_flag_and_the_python_row_reads_the_launchers_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("# /// script\n# dependencies = [\"packaging\"\n# ///\nimport os\n")  # not valid TOML
    report = tmp_path / "report.json"
    run = run_guard(["preflight", "--launch-smoke", "off", "--report", str(report), "--", TORCHRUN, "--standalone",
                     "--nproc-per-node", "2", str(script)], timeout_s=120)
    assert run.returncode == 3, run.stderr[-3000:]
    assert run.fields()["check"] == "python"
    rows = json.loads(report.read_text())["details"]["preflight"]
    assert {"name": "distributed", "status": "n/a", "seen": "launch smoke: off by --launch-smoke off",
            "hint": None} in rows
    assert any(r["name"] == "python" and r["status"] == "fail"
               and "train.py: the `# /// script` block is not valid TOML" in r["seen"] for r in rows)
    assert "launch smoke: world" not in run.stderr
