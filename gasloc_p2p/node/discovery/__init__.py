"""Peer discovery: the seam (base) and the hivemind DHT implementation (dht)."""
