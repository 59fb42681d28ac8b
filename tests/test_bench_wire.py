"""`fusionnode bench wire`'s stream part: every transport in both modes with its ratio to TCP."""

from __future__ import annotations

import json

import pytest

from fusionnode.bench import wire


def test_streams_report_direct_against_tcp_per_size_cold_and_steady(capsys):
    """Default: the receiving ends in a spawned process, whose CPU is reported beside the sender's."""
    assert wire.main(["--no-codec", "--no-p2p", "--quick", "--stream-mib", "1,2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["streams"]
    keys = {(r["transport"], r["size_mib"], r["payload"], r["mode"]) for r in rows}
    assert keys == {
        (t, s, p, m) for t in ("tcp", "direct") for s in (1, 2) for p in ("raw", "framed") for m in wire.MODES
    }
    for r in rows:
        assert r["mib_s"] > 0 and r["cpu_ms_per_mib"] > 0 and r["recv_cpu_ms_per_mib"] > 0
        assert r["processes"] == 2
        if r["transport"] == "tcp":
            assert r["ratio_to_tcp"] == 1.0


def test_in_process_runs_both_ends_here(capsys):
    assert (
        wire.main(["--no-codec", "--no-p2p", "--quick", "--stream-mib", "1", "--in-process", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)["streams"]
    assert len(rows) == 2 * 2 * len(wire.MODES)
    for r in rows:
        assert r["processes"] == 1 and r["cpu_ms_per_mib"] > 0 and "recv_cpu_ms_per_mib" not in r


def test_the_table_names_the_ratio_per_size(capsys):
    assert wire.main(["--no-codec", "--no-p2p", "--quick", "--stream-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "ratio" in out and "steady" in out and "cold" in out and " 1Mi " in out and "rcpu" in out
    assert "TLS ceiling" in out and "TLS/TCP" in out and "(ceiling)" in out.splitlines()[-1]


@pytest.mark.parametrize("bad", ["0", "4,x", ""])
def test_a_bad_size_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        wire.main(["--no-codec", "--stream-mib", bad])
    assert exc.value.code == 2


def test_the_tls_ceiling_is_reported_beside_the_direct_ratio(capsys):
    """The ceiling section: bare TCP and bare TLS 1.3 pairs per size, their ratio, and the direct path's."""
    assert wire.main(["--no-codec", "--no-p2p", "--quick", "--stream-mib", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["ceiling"]
    assert row["size_mib"] == 1 and row["repeats"] == 5
    assert row["tcp_mib_s"] > 0 and row["tls_mib_s"] > 0
    assert row["tcp_cpu_ms_per_mib"] > 0 and row["tls_cpu_ms_per_mib"] > 0
    assert row["tls_ratio_to_tcp"] == pytest.approx(row["tls_mib_s"] / row["tcp_mib_s"])
    assert row["direct_steady_raw_ratio_to_tcp"] > 0 and row["direct_steady_framed_ratio_to_tcp"] > 0


def test_no_ceiling_skips_it(capsys):
    assert (
        wire.main(["--no-codec", "--no-p2p", "--quick", "--stream-mib", "1", "--no-ceiling", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["ceiling"] == []
