"""swarm: persistent identity, device profile, signed DHT records, membership heartbeat, link probing."""

from fusionnode.swarm.dht import start_dht, stop_dht
from fusionnode.swarm.identity import Identity, load_or_create_identity
from fusionnode.swarm.membership import Membership, MembershipConfig
from fusionnode.swarm.probe import LinkProber, ProbeConfig
from fusionnode.swarm.profile import DeviceProfile, load_or_measure_profile, measure_profile
from fusionnode.swarm.records import PEERS_KEY, LinkMeasurement, PeerRecord

__all__ = [
    "PEERS_KEY",
    "DeviceProfile",
    "Identity",
    "LinkMeasurement",
    "LinkProber",
    "Membership",
    "MembershipConfig",
    "PeerRecord",
    "ProbeConfig",
    "load_or_create_identity",
    "load_or_measure_profile",
    "measure_profile",
    "start_dht",
    "stop_dht",
]
