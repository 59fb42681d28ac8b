"""Mixed versions on real `fusionnode join --debug` processes on loopback (issue 20; SPEC.md 13.4): one
daemon advertises the check capabilities of an older version (FUSIONNODE_DEBUG_CAPS=legacy: it refuses
`job.ping`'s `caps` field as a daemon from before them does). A job with checks on leaves it out
before planning and bans nobody; one that names it is refused before anything starts, naming it and
what it lacks; with checks off it takes a stage."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from test_verify_e2e import spec_for, train

from fusionnode.errors import DaemonError
from fusionnode.localswarm import LocalSwarm
from fusionnode.verify.compat import DEBUG_CAPS_ENV

pytestmark = pytest.mark.e2e


def test_an_older_daemon_is_left_out_of_a_checked_job_unbanned_and_used_with_checks_off(tmp_path):
    swarm = LocalSwarm(tmp_path, 2, log=sys.stderr)
    swarm.extra_args = ["--debug"]
    try:
        swarm.start()
        os.environ[DEBUG_CAPS_ENV] = "legacy"  # the next daemon answers as an older version
        try:
            old_i = swarm.add_peer()
        finally:
            del os.environ[DEBUG_CAPS_ENV]
        old = swarm.ready[old_i]["peer_id"]
        asyncio.run(swarm.wait_connected())
        base = {"offload": "on", "rebalance_every": 0, "verify_policy": "all"}

        # checks on: the older daemon is left out (a notice names it), no failure, no ban
        spec = spec_for(tmp_path, "checked", steps=2)
        result, events = asyncio.run(train(swarm, {"spec": spec.to_dict(), "stages": 2, **base}))
        assert result["steps"] == spec.steps
        assert old not in [s["peer"] for s in result["stages"]]
        notices = [e for e in events if e["type"] == "event" and e.get("what") == "version_skew"]
        assert notices and all(old in e["reason"] for e in notices), notices
        assert "commitment hash 'b3'" in notices[0]["reason"]
        kinds = [e.get("kind") for e in events if e["type"] == "event"]
        assert "failure" not in kinds and "caught" not in kinds, kinds

        # checks on with the older daemon named: refused before a plan, naming it and what it lacks
        spec = spec_for(tmp_path, "named", steps=2)
        peers = [r["peer_id"] for r in swarm.ready]
        with pytest.raises(DaemonError, match=f"worker peer {old} cannot take part.*'b3'"):
            asyncio.run(train(swarm, {"spec": spec.to_dict(), "stages": 3, "peers": peers, **base}))

        # checks off: it takes a stage, as before
        spec = spec_for(tmp_path, "unchecked", steps=2)
        params = {"spec": spec.to_dict(), "stages": 3, **base, "verify_policy": "off"}
        result, events = asyncio.run(train(swarm, params))
        assert result["steps"] == spec.steps and old in [s["peer"] for s in result["stages"]]
        assert "failure" not in [e.get("kind") for e in events if e["type"] == "event"]
    finally:
        swarm.stop()
