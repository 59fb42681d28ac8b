"""Who contributes gradients to an optimizer host's parameters each step: the planned contributors
(one per replica and stage that pushes) and the samples the plan gives each replica. The parameter
store (optim/store.py) weighs and checks pushes against these."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fusionnode.errors import ConfigError


@dataclass(frozen=True)
class Contributor:
    """One planned contributor: its data-parallel replica and that replica's planned samples per step."""

    replica: str
    samples: int


def contributor_key(replica: int | str, stage: int | str) -> str:
    """Conventional contributor key for a (replica, stage) pair: "r{replica}/s{stage}"."""
    return f"r{replica}/s{stage}"


@dataclass(frozen=True)
class ExpectedContributions:
    """For each parameter name, the contributors expected every step: {name: {key: Contributor}}."""

    by_name: Mapping[str, Mapping[str, Contributor]]

    def __post_init__(self) -> None:
        frozen: dict[str, Mapping[str, Contributor]] = {}
        for name, contribs in self.by_name.items():
            if not contribs:
                raise ConfigError(f"parameter {name!r} has no expected contributor")
            per_replica: dict[str, int] = {}
            for key, c in contribs.items():
                if c.samples < 1:
                    raise ConfigError(f"contributor {key!r} of {name!r} plans {c.samples} samples (< 1)")
                if per_replica.setdefault(c.replica, c.samples) != c.samples:
                    raise ConfigError(
                        f"contributors of replica {c.replica!r} for {name!r} plan different samples"
                    )
            frozen[name] = MappingProxyType(dict(contribs))
        object.__setattr__(self, "by_name", MappingProxyType(frozen))

    @classmethod
    def same_for_all(
        cls, names: Iterable[str], contributors: Mapping[str, Contributor]
    ) -> ExpectedContributions:
        """Every name expects the same contributors (e.g. one stage's params, R replicas)."""
        return cls({n: dict(contributors) for n in names})
