"""swarm"""
