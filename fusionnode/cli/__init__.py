"""The `fusionnode` command line: one module per concept, `app` ties them together.

`app` holds the parser and the dispatch; each command is defined (its options and its handler) in
the module of its concept: `node` (the local daemon), `jobs` (training jobs), `plan` (offline
planning and simulation), `demo` (a local swarm that trains), `models` (generate, export,
tokenizer). The work itself happens in the modules they call."""

from fusionnode.cli.app import BENCHMARKS, build_parser, main
from fusionnode.term import Progress, format_peers

__all__ = ["BENCHMARKS", "Progress", "build_parser", "format_peers", "main"]
