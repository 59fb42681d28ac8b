"""Terminal rendering: progress bars and tables with rich on a terminal, plain lines everywhere else.

Every function takes the stream it writes to; when that stream is not a TTY
(a pipe, a file, CI logs) the output is plain text with no escape codes, one
record a line, so it stays greppable. ``--json`` output never comes through here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from fusionnode.messages import short_peer

PLAIN_EVERY_S = 5.0  # seconds between progress lines when the stream is not a terminal


def is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _console(stream: TextIO) -> Any:
    from rich.console import Console

    return Console(file=stream, highlight=False, soft_wrap=False)


# ---- tables ----------------------------------------------------------------------------------
def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """Plain text: a header line and one line per row, columns padded to their widest cell."""
    cells = [[str(c) for c in columns]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for r in cells:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    right: Sequence[int] = (),
    stream: TextIO | None = None,
) -> None:
    """A table on `stream` (stdout by default): rich on a terminal, `format_table` otherwise.
    `right`: indexes of the columns to align right (numbers)."""
    stream = stream or sys.stdout
    if not is_tty(stream):
        if title:
            print(title, file=stream)
        print(format_table(columns, rows, right=right), file=stream, flush=True)
        return
    from rich.table import Table

    t = Table(title=title, title_justify="left", header_style="bold", box=None, pad_edge=False)
    for i, c in enumerate(columns):
        t.add_column(c, justify="right" if i in right else "left", no_wrap=True)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    _console(stream).print(t)


def lines(pairs: Sequence[tuple[str, str]], *, stream: TextIO | None = None) -> None:
    """`label  value` lines (bold labels on a terminal)."""
    stream = stream or sys.stdout
    width = max((len(k) for k, _ in pairs), default=0)
    if not is_tty(stream):
        for k, v in pairs:
            print(f"{k.ljust(width)}  {v}", file=stream)
        return
    from rich.markup import escape

    con = _console(stream)
    for k, v in pairs:
        con.print(f"[bold]{escape(k.ljust(width))}[/bold]  {escape(v)}")


# ---- progress --------------------------------------------------------------------------------
class Progress:
    """A training job's progress: a rich bar with the step, ETA and last figures on a terminal;
    a plain line every PLAIN_EVERY_S seconds (and at the first and last step) otherwise.

    ``update(rec)`` takes a step record (step, loss, tokens_per_s, wire_bytes, stages, step_time_s)."""

    def __init__(self, total: int, stream: Any = None):
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = is_tty(self.stream)
        self.last = 0.0
        self._bar: Any = None
        self._task: Any = None

    @staticmethod
    def describe(rec: dict[str, Any]) -> str:
        stages = rec.get("stages") or []
        util = "/".join(f"{s['compute_s'] / max(rec['step_time_s'], 1e-9):.0%}" for s in stages)
        return (
            f"loss {rec['loss']:.4f} {rec.get('tokens_per_s', 0):.0f} tok/s "
            f"wire {rec.get('wire_bytes', 0) / 2**20:.1f} MiB" + (f" stages busy {util}" if util else "")
        )

    def update(self, rec: dict[str, Any]) -> None:
        step = rec["step"] + 1
        text = self.describe(rec)
        if not self.tty:
            if time.monotonic() - self.last > PLAIN_EVERY_S or step == self.total or step == 1:
                self.last = time.monotonic()
                print(f"step {step}/{self.total} {text}", file=self.stream, flush=True)
            return
        if self._bar is None:
            self._start()
        self._bar.update(self._task, completed=step, info=text)
        if step >= self.total:
            self.close()

    def _start(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        self._bar = RichProgress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=_console(self.stream),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=self.total, info="")
        self._bar.start()

    def print(self, text: str) -> None:
        """A line above the bar (plan, events), or a plain line."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


# ---- what the commands show ------------------------------------------------------------------
PEER_COLUMNS = ("PEER", "DEVICE", "MEMORY", "TFLOPS", "LINKS", "ROLES", "STATE", "SEEN")


def peer_rows(peers: list[dict[str, Any]], me: str | None = None) -> list[tuple[str, ...]]:
    now = time.time()
    rows = []
    present = {p["peer_id"] for p in peers}
    for p in peers:
        dev = p.get("device") or {}
        links = {k: v for k, v in (p.get("links") or {}).items() if k in present}  # not departed peers'
        link_txt = ", ".join(
            f"{short_peer(k)}:{v.get('bandwidth_bps', 0) / 1e6:.0f}Mb/s" for k, v in list(links.items())[:3]
        )
        pid = p["peer_id"]
        rows.append(
            (
                ("*" if pid == me else " ") + short_peer(pid),
                f"{dev.get('kind', '?')}:{str(dev.get('name', '?'))[:22]}",
                f"{(dev.get('memory_total_bytes') or 0) / 2**30:.1f}G",
                f"{dev.get('tflops_fp32') or 0:.2f}",
                link_txt or "-",
                ",".join(p.get("roles") or []),
                p.get("availability", "?"),
                f"{max(0.0, now - float(p.get('updated_at') or now)):.0f}s ago",
            )
        )
    return rows


def format_peers(peers: list[dict[str, Any]], me: str | None = None) -> str:
    return format_table(PEER_COLUMNS, peer_rows(peers, me), right=(2, 3))


def print_peers(peers: list[dict[str, Any]], me: str | None = None, stream: TextIO | None = None) -> None:
    table(PEER_COLUMNS, peer_rows(peers, me), right=(2, 3), stream=stream)


def reach_text(reach: dict[str, Any] | None) -> str:
    """One line on this peer's reachability (swarm/reachability.py): its state and the links relayed."""
    if not reach:
        return "unknown"
    text = str(reach.get("line", reach.get("state", "unknown"))).removeprefix("reachability: ")
    relayed = reach.get("relayed_peers") or []
    if relayed:
        text += f"; relayed links to {', '.join(p[-6:] for p in relayed)}"
    return text


def print_status(res: dict[str, Any], stream: TextIO | None = None) -> None:
    """What `fusionnode status` shows: this peer, the swarm's peers, the stages served, the jobs driven."""
    dev = res.get("device") or {}
    av = res.get("availability") or {}
    private = res.get("private_swarm")
    swarm_kind = f"private (swarm key {private})" if private else "public (no --swarm-key)"
    lines(
        [
            ("peer", str(res["peer_id"])),
            ("address", " ".join(res["maddrs"][:3])),
            ("uptime", f"{res['uptime_s']:.0f} s    roles {','.join(res['roles'])}"),
            ("device", f"{dev.get('kind')} {dev.get('name')}  {dev.get('tflops_fp32', 0):.2f} TFLOPS fp32"),
            ("state", str(av.get("availability", "?")) + (f" ({av['reason']})" if av.get("reason") else "")),
            ("swarm", f"{len(res['peers'])} peer(s), {swarm_kind}"),
            ("reach", reach_text(res.get("reachability"))),
        ],
        stream=stream,
    )
    print_peers(res["peers"], res["peer_id"], stream=stream)
    serving = res.get("serving") or []
    if serving:
        from fusionnode.train.placement import STAGE_ID_STRIDE  # stage ids count on across re-plans

        table(
            ("JOB", "PLAN", "STAGE", "LAST STEP"),
            [
                (s["job"], f"v{version + 1}", f"{index}/{s['num_stages']}", s["last_step"])
                for s in serving
                for version, index in [divmod(int(s["stage"]), STAGE_ID_STRIDE)]
            ],
            title="serving",
            right=(3,),
            stream=stream,
        )
    jobs = res.get("jobs") or []
    if jobs:
        table(
            ("JOB", "MODEL", "STATE", "STEP", "LOSS", "TOKENS/S", "PLAN"),
            [
                (
                    j["job"],
                    j["model"],
                    j["state"],
                    f"{j['step']}/{j['steps']}",
                    "-" if j["loss"] is None else f"{j['loss']:.4f}",
                    f"{j['tokens_per_s']:.0f}",
                    f"v{j.get('plan_version', 0)}, {len(j.get('stages') or [])} stages",
                )
                for j in jobs
            ],
            title="driving",
            right=(3, 4, 5),
            stream=stream,
        )


def print_plan(p: Any, stream: TextIO | None = None) -> None:
    """A Plan (plan/types.py) as a header line and one stage table per pipeline."""
    stream = stream or sys.stdout
    head = f"plan for {p.model} on {p.cluster}: batch {p.batch_size}, seq {p.seq_len}, offload {p.offload}"
    if p.prediction is not None:
        head += (
            f"\npredicted step {p.prediction.step_time_s:.3f} s, {p.prediction.tokens_per_s:,.0f} tokens/s"
        )
        if p.prediction.simulated_step_time_s is not None:
            head += f" (simulated step {p.prediction.simulated_step_time_s:.3f} s)"
    print(head, file=stream)
    for i, pl in enumerate(p.pipelines):
        table(
            ("stage", "devices", "nodes", "compute s", "comm s", "keep", "mem GB"),
            [
                (
                    k,
                    ",".join(st.devices),
                    f"[{st.lo},{st.hi})",
                    f"{st.compute_s:.4f}",
                    f"{st.comm_s:.4f}",
                    f"{st.keep_ratio:.3f}",
                    f"{st.memory_bytes / 1e9:.2f}",
                )
                for k, st in enumerate(pl.stages)
            ],
            title=f"pipeline {i}: {len(pl.stages)} stages, share {pl.batch_share} = {pl.micro_batches} x "
            f"{pl.micro_batch_size}, time {pl.time_s:.3f} s",
            right=(0, 2, 3, 4, 5, 6),
            stream=stream,
        )
    if p.optimizer_hosts:
        print(
            "optimizer hosts: " + ", ".join(f"{h.device} ({h.share:.0%})" for h in p.optimizer_hosts),
            file=stream,
        )


def print_simulation(out: dict[str, Any], steps: int, stream: TextIO | None = None) -> None:
    """`fusionnode simulate`'s comparison of the plan against the even grid, DT-FM and the baselines."""
    stream = stream or sys.stdout
    rows = []
    for label in ("plan", "grid", "dtfm", "even", "memory", "given"):
        if label not in out:
            continue
        r = out[label]
        if not r["fits"]:
            rows.append((label, "does not fit", "", "", "", r["error"][:80]))
            continue
        ratio = out.get(f"plan_vs_{label}")
        dtfm = ratio.get("dtfm_model") if ratio else None
        rows.append(
            (
                label,
                f"{r['closed_tokens_per_s']:,.0f}",
                f"{r['sim_tokens_per_s']:,.0f}",
                "" if r.get("dtfm_model_step_s") is None else f"{r['dtfm_model_step_s']:.3f}",
                f"{r['sim_total_s']:,.1f}s",
                ""
                if ratio is None
                else f"{ratio['closed']:.2f}/{ratio['sim']:.2f}" + ("" if dtfm is None else f"/{dtfm:.2f}"),
            )
        )
    compress = f", compress {out['compress']}" if "compress" in out else ""
    table(
        (
            "placement",
            "tokens/s (closed)",
            "tokens/s (sim)",
            "DT-FM model s",
            f"{steps} steps (sim)",
            "plan x",
        ),
        rows,
        title=f"{out['model']} on {out['cluster']}, batch {out['batch_size']}, {out['steps']} steps{compress}",
        right=(1, 2, 3, 4, 5),
        stream=stream,
    )
    print(
        "grid: best even grid; dtfm: DT-FM's scheduler (re-implementation, planner's trial budget); "
        "plan x = placement step time / plan step time (closed form / simulator / DT-FM's cost model)",
        file=stream,
    )
