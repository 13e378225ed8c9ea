"""The node daemon: asyncio, gRPC, hivemind DHT (see gasloc_p2p.node.daemon)."""
