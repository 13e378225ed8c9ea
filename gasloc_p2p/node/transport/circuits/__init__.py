"""Relayed connections for nodes nobody can dial: a reachable node relays (:mod:`.hub`), callers and listeners reach it over gRPC (:mod:`.client`)."""
