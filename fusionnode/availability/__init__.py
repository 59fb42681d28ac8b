"""When this peer contributes: yield the device to its owner, keep to a schedule, obey pause/resume.

Four parts, from pure to I/O:

- ``schedule``: local-time windows and the start of the next one.
- ``policy``: the pure state machine (manual > schedule > owner, with hysteresis on the owner).
- ``activity``: the owner-activity monitor (CPU, GPU through NVML, keyboard/mouse idleness).
- ``controller``: the async runner that samples, feeds the state machine and tells the node what to
  advertise.

Beside them, ``caps``: ``--max-util``, ``--max-memory`` and freeing accelerator memory on a pause.
"""
