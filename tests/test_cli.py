"""What a new user trips over, through the real command line (`python -m fusionnode` and the
`fusionnode` console script) and the formatting functions behind its output."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fusionnode import __version__, cli, messages
from fusionnode.cli.demo import compression_line
from fusionnode.localswarm import fusionnode_command
from fusionnode.train.generate import decode_whole


def run_cli(*args: str, cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fusionnode", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


# ---- wrong results or silent failures -------------------------------------------------------------
def test_a_taken_listen_port_is_an_error_naming_a_free_port(tmp_path):
    # held the way p2pd holds its port (SO_REUSEPORT), which let a second daemon share it silently
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run_cli("join", "--state-dir", str(tmp_path / "s"), "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    assert out.returncode == 2, out.stderr
    assert f"TCP port {port} is already in use" in out.stderr
    assert "--listen /ip4/127.0.0.1/tcp/0" in out.stderr
    assert "Traceback" not in out.stderr


def test_spawned_peers_run_this_package_whatever_the_working_directory(tmp_path):
    # the folder a user cloned into: a `fusionnode` package there shadows the installed one for `-m`
    shadow = tmp_path / "fusionnode"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    (shadow / "__main__.py").write_text("raise SystemExit('the shadow ran')")
    shadowed = run_cli("--version", cwd=str(tmp_path))
    assert shadowed.returncode != 0  # what `demo` used to spawn from here
    out = subprocess.run(
        [*fusionnode_command(), "--version"], capture_output=True, text=True, cwd=str(tmp_path), timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"fusionnode {__version__}"


def _p2pd_sockets_of(pid: int) -> set[str]:
    """The control sockets of the p2pd processes below `pid` (hivemind passes -listen=/unix/PATH)."""
    found = set()
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            for arg in child.cmdline():
                if arg.startswith("-listen=/unix"):
                    found.add(arg[len("-listen=/unix") :])
        except psutil.Error:
            continue
    return found


def test_a_failed_join_leaves_no_p2pd_socket_behind(tmp_path):
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/QmTNrUYXTEJMhUXvBbfVuRkHBSMqz44pNr7uyZtr5rDGe3"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "fusionnode", "join", "--state-dir", str(tmp_path / "s")),
            *("--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peers", unreachable),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sockets: set[str] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        sockets |= _p2pd_sockets_of(proc.pid)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "could not reach any initial peer" in err
    assert sockets, "p2pd was never seen (the test could not check anything)"
    assert not [s for s in sockets if os.path.exists(s)]


def test_bad_options_are_refused_before_anything_starts_with_the_subcommands_usage(tmp_path, capsys):
    out = run_cli("train", "--state-dir", str(tmp_path / "none"), "--compress", "topk:2")
    assert out.returncode == 2 and out.stderr.startswith("usage: fusionnode train"), out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert error == "fusionnode train: error: argument --compress: topk ratio must be in (0, 1], got '2'"
    (tmp_path / "c.toml").write_text('[train]\ncompress = "gzip"\n')
    for command, args, says in (
        ("train", ["--compress", "topk:0"], "topk ratio must be in (0, 1]"),
        ("train", ["--compress", "gzip"], "unknown compression 'gzip'"),
        ("train", ["--config", str(tmp_path / "c.toml")], "unknown compression 'gzip'"),
        ("train", ["--steps", "0"], "--steps: expected an integer >= 1"),
        ("train", ["--verifier", "my laptop"], "--verifier must be process, local or a peer id"),
        (
            "train",
            ["--offload", "off", "--replicas", "2", "--sync", "diloco"],
            "closes rounds on the optimizer",
        ),
        ("join", ["--serve-checks"], "--serve-checks needs --serve-checks-for"),
        ("join", ["--serve-checks", "--serve-checks-for", "me"], "--serve-checks-for takes peer ids"),
        ("demo", ["--peers", "0"], "--peers: expected an integer >= 1"),
        ("generate", ["--checkpoint", "x", "--temperature", "-1"], "expected a number >= 0"),
    ):
        with pytest.raises(SystemExit) as info:
            cli.main([command, *args])
        err = capsys.readouterr().err
        assert info.value.code == 2, (command, args)
        assert err.startswith(f"usage: fusionnode {command}"), err
        error = err.strip().splitlines()[-1]
        assert error.startswith(f"fusionnode {command}: error:") and says in error
        assert "every worker refused" not in error and "{" not in error


def test_a_closed_pipe_ends_the_command_quietly():
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusionnode", "config", "show", "join"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # like `| head -1` that has read its line and gone
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_local_train_save_then_generate_and_export_from_the_printed_paths(tmp_path, capsys):
    """Through the console script: `train --local` shows a real tokens/s and prints the next commands
    for its checkpoint; the step directory it names and the --save directory both work."""
    exe = shutil.which("fusionnode")
    assert exe, "the console script is installed by `pip install -e .`"
    common = ["--steps", "2", "--batch-size", "2", "--micro-batches", "1", "--seq-len", "16"]
    out = subprocess.run(
        [exe, "train", "--local", *common, "--save", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert " 0 tok/s" not in out.stderr and "tok/s" in out.stderr
    step_dir = next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("checkpoint:"))
    assert Path(step_dir).name.startswith("step-")
    assert f"fusionnode generate --checkpoint {step_dir}" in out.stdout
    for ck in (step_dir, str(tmp_path / "ck")):
        assert cli.main(["generate", "--checkpoint", ck, "--tokens", "8"]) == 0
        assert capsys.readouterr().out.startswith("def ")
    model = str(tmp_path / "m.safetensors")
    assert cli.main(["export", "--checkpoint", step_dir, "--out", model]) == 0
    assert cli.main(["export", "--checkpoint", step_dir, "--out", model]) == 2
    assert "pass --force to overwrite" in capsys.readouterr().err
    assert cli.main(["export", "--checkpoint", step_dir, "--out", model, "--force"]) == 0


def test_the_driver_keeps_a_bounded_job_history():
    from fusionnode.train import driver as D
    from fusionnode.train.spec import JobSpec

    d = D.Driver(None, None, config=None, state_dir=None)
    for i in range(D.JOBS_KEPT + 4):
        job = D.Job(JobSpec(seed=i), "me")
        job.state = "done"
        job.history = [{"step": s} for s in range(D.HISTORY_KEPT + 10)]
        d.jobs[job.spec.job_id] = job
    running = D.Job(JobSpec(seed=99), "me")
    running.state = "running"
    running.history = [{"step": s} for s in range(D.HISTORY_KEPT + 10)]
    d.jobs = {running.spec.job_id: running, **d.jobs}
    d._forget_old_jobs()
    assert running.spec.job_id in d.jobs
    assert len(d.jobs) == D.JOBS_KEPT + 1
    for j in d.status():
        limit = D.HISTORY_KEPT if j["state"] == "running" else D.FINISHED_HISTORY_POINTS
        assert j["history"] and len(j["history"]) <= limit
        assert j["history"][-1]["step"] == D.HISTORY_KEPT + 9  # ends with the last record


# ---- messages that mislead --------------------------------------------------------------------------
def test_the_demo_says_when_the_links_needed_no_compression():
    dense = 2400 * 2**20
    text = compression_line(dense, dense)
    assert "kept up" in text and "saved" not in text and "1.0x" not in text
    assert "4.0x fewer bytes" in compression_line(dense, dense // 4)


def test_progress_labels_the_stage_utilisation():
    class Sink:
        def __init__(self):
            self.text = ""

        def isatty(self):
            return False

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    sink = Sink()
    rec = {"step": 0, "loss": 5.0, "tokens_per_s": 900.0, "wire_bytes": 0, "step_time_s": 1.0}
    cli.Progress(1, stream=sink).update({**rec, "stages": [{"compute_s": 0.2}, {"compute_s": 0.8}]})
    assert "stages busy 20%/80%" in sink.text and "900 tok/s" in sink.text


def test_samples_do_not_end_or_start_in_a_cut_character():
    assert decode_whole(list("héllo w".encode() + "é".encode()[:1])) == "héllo w"
    assert decode_whole(list("é ok".encode()[1:]), cut_start=True) == " ok"
    assert decode_whole([104, 0xFF, 105]) == "h\ufffdi"  # a wrong byte in the middle still shows


A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
B = "QmZ4tDuvesekSs4qM5ZBKpXiZGun7S2CYtEZRB3DYXkjGx"
GONE = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def test_events_read_as_sentences():
    refused = {
        "type": "event",
        "kind": "refused",
        "peer": A,
        "reason": f"peer {A[:12]}… refused 'job.assign': PeerError: not enough memory for the stage",
    }
    assert messages.format_event(refused) == (
        f"worker …{A[-8:]} declined its stage (it refused job.assign: not enough memory for the stage); "
        "planning without it"
    )
    failure = {
        "type": "event",
        "kind": "failure",
        "peer": B,
        "step": 12,
        "reason": f"peer {B[:12]}… refused 'job.commit': PeerError: draining",
        "unreachable": False,
        "ban_s": 30.0,
    }
    text = messages.format_event(failure)
    assert (
        text
        == f"step 12: worker …{B[-8:]} failed (it refused job.commit: draining); it is left out of plans for 30 s"
    )
    recovered = {
        "type": "event",
        "kind": "recovered",
        "step": 12,
        "time_to_recover_s": 0.5,
        "reason": "replayed",
    }
    assert messages.format_event(recovered) == "step 12: recovered in 0.50 s: replayed"
    notice = {
        "type": "event",
        "kind": "notice",
        "what": "fewer_stages",
        "reason": "2 stages planned, 1 placed",
    }
    assert messages.format_event(notice) == "2 stages planned, 1 placed"
    for ev in (refused, failure, recovered, notice):
        assert "{" not in messages.format_event(ev) and "ban_s" not in messages.format_event(ev)


def test_a_plan_shows_its_pipelines_and_numbers_stages_within_them():
    stages = [
        {"stage": 1000 + i, "replica": r, "pos": p, "peer": peer, "lo": lo, "hi": hi, "n_params": 4}
        for i, (r, p, peer, lo, hi) in enumerate(
            [(0, 0, A, 0, 103), (0, 1, B, 103, 200), (1, 0, GONE, 0, 200)]
        )
    ]
    lines = messages.format_plan(
        {
            "type": "plan",
            "planner": "fusion",
            "plan_version": 2,
            "stages": stages,
            "offload": True,
            "optimizer_hosts": [A],
        }
    )
    assert lines[0].startswith("  new plan (version 2) (fusion planner): 2 pipeline(s) over 3 worker(s)")
    assert f"pipeline 0 stage 1: OP-DAG nodes [103, 200) on …{B[-8:]}" in lines[2]
    assert f"pipeline 1 stage 0: OP-DAG nodes [0, 200) on …{GONE[-8:]}" in lines[3]
    assert not any("1000" in line or "1001" in line for line in lines)


def test_peers_are_named_alike_and_links_to_departed_peers_are_dropped():
    now = time.time()
    link = {"bandwidth_bps": 1e9}
    peers = [
        {"peer_id": A, "links": {B: link, GONE: link}, "updated_at": now, "roles": ["worker"]},
        {"peer_id": B, "links": {A: link}, "updated_at": now, "roles": ["worker"]},
    ]
    table = cli.format_peers(peers, A)
    assert f"*…{A[-8:]}" in table and f"…{B[-8:]}:1000Mb/s" in table
    assert GONE[-8:] not in table


def test_resume_explains_a_pause_the_schedule_keeps():
    res = {
        "availability": "paused",
        "reason": "schedule",
        "schedule": "22:00-07:00",
        "next_window": "2026-01-01T22:00",
    }
    text = messages.describe_availability("resume", res)
    assert text.startswith("not resumed") and "--schedule 22:00-07:00" in text and "2026-01-01T22:00" in text
    assert messages.describe_availability("resume", {"availability": "available"}).startswith("resumed")


# ---- against a real daemon --------------------------------------------------------------------------
@pytest.mark.e2e
def test_one_daemon_as_a_new_user_meets_it(tmp_path):
    """A private daemon kept paused by its schedule: `status` says the swarm is private, `resume` says
    why it stays paused (exit 1), a second daemon on its port is refused, and `status` into a closed
    pipe ends quietly."""
    from fusionnode.localswarm import LocalSwarm

    assert run_cli("keygen", "--out", str(tmp_path / "swarm.key")).returncode == 0
    now = time.localtime()
    window = f"{(now.tm_hour + 2) % 24:02d}:00-{(now.tm_hour + 3) % 24:02d}:00"  # an hour that is not now
    swarm = LocalSwarm(tmp_path, 1, log=None)
    swarm.extra_args = ["--swarm-key", str(tmp_path / "swarm.key"), "--schedule", window, "--no-probe"]
    try:
        swarm.start()
        state = ["--state-dir", str(swarm.state_dir(0))]
        status = run_cli("status", *state)
        assert status.returncode == 0, status.stderr
        assert "private (swarm key " in status.stdout

        resume = run_cli("resume", *state)
        assert resume.returncode == 1
        assert resume.stdout.startswith(
            f"not resumed: the manual pause is lifted, but it is outside its --schedule {window}"
        )

        port = next(m for m in swarm.ready[0]["maddrs"] if "/tcp/" in m).split("/tcp/")[1].split("/")[0]
        second = run_cli(
            "join", "--state-dir", str(tmp_path / "second"), "--listen", f"/ip4/127.0.0.1/tcp/{port}"
        )
        assert second.returncode == 2 and f"TCP port {port} is already in use" in second.stderr

        proc = subprocess.Popen(
            [sys.executable, "-m", "fusionnode", "status", *state],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        proc.stdout.close()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 141 and b"Traceback" not in err
    finally:
        swarm.stop()
    log = (tmp_path / "peer0.log").read_text()
    assert "Traceback" not in log and "[INFO]" not in log


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_train_leaves_workers_quiet_and_free_to_leave(tmp_path):
    """SIGTERM to `fusionnode train` mid-job: the driver releases the stages with their step aborted,
    so the workers log no tracebacks and a `leave` right after is prompt."""
    import signal

    from fusionnode.localswarm import LocalSwarm

    swarm = LocalSwarm(tmp_path, 2, log=None)
    swarm.extra_args = ["--no-probe"]
    try:
        swarm.start()
        import asyncio

        asyncio.run(swarm.wait_connected())
        train = subprocess.Popen(
            [
                *(sys.executable, "-m", "fusionnode", "train", "--state-dir", str(swarm.state_dir(0))),
                *("--steps", "500", "--stages", "2", "--offload", "off", "--seq-len", "64"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in train.stderr:  # progress lines: wait for the job to be under way
            if line.startswith("step 1/"):
                break
        time.sleep(1.0)
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=60)
        time.sleep(2.0)  # the driver's release reaches the workers
        out = run_cli("leave", "--state-dir", str(swarm.state_dir(1)))
        t0 = time.monotonic()
        assert out.returncode == 0, out.stderr
        swarm.procs[1].wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        swarm.stop()
    assert took < 12, f"the worker took {took:.1f} s to leave"
    for i in range(2):
        log = (tmp_path / f"peer{i}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
