"""Keyed dither for the stochastic rounding of q8/q4 link messages (issue 20).

A compressing link rounds q8/q4 elements stochastically: ``q = floor(x / s + u)``, ``u`` from a
generator seeded per message (compress/quant.py). With the seed a per-link send counter, the checker
(verify/lossy.py) could not know ``u`` and only asked every element to lie on one of its two grid
points, plus z-tests for bias and excess variance: a worker could steer each element's direction
(keeping P(up) = f, so the variance stays honest) along a vector of its choice, 0.54% of the norm in
the reviewer's test. A keyed dither derives the seed from what the message is, so the checker
recomputes ``u`` and asks for the exact grid point ``floor(y / s + u)``, leaving open only the
elements whose ``y / s + u`` lies within the recompute's tolerance of a grid boundary:

    seed = uint64_le(SHA-256("fusionnode-q-dither/1" 0x00 job 0x00 stage 0x00 step 0x00 mb 0x00
           key 0x00 name)[:8]) >> 1

(``stage``, ``step`` and ``mb`` in decimal, ``key`` the message slot "act" or "grad", ``name`` the
tensor's name in the message; 63 bits, so every generator takes it). The uniforms are torch's
CPU generator seeded with it (`quant.dither_rows`). Nothing of it is on the wire, and the codec's
format (version 1) does not change: the link option ``dither`` ("keyed", the default, or
"counter", the old per-link counter) says which a job's links use, and the driver hands it to
workers and checker alike in the assignment's ``link_options``. Golden vector:
protocol/vectors/q8_keyed_dither.json.
"""

from __future__ import annotations

import hashlib

DITHERS = ("keyed", "counter")
DOMAIN = b"fusionnode-q-dither/1"


def dither_seed(job: str, stage: int, step: int, mb: int, key: str, name: str) -> int:
    """The stochastic-rounding seed of tensor `name` in the `key` message that stage `stage` of job
    `job` sends for micro-batch `mb` of step `step` (module docstring)."""
    fields = [DOMAIN, *(str(v).encode() for v in (job, int(stage), int(step), int(mb), key, name))]
    digest = hashlib.sha256(b"\0".join(fields)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


__all__ = ["DITHERS", "dither_seed"]
