"""The exchange protocol without I/O: messages, header checks and the tensor side of an exchange.

Nothing here imports gRPC or asyncio: the daemon's gRPC shell, the simulator and the tests drive
the same objects.
"""
