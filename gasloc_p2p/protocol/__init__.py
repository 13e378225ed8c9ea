"""The exchange protocol without I/O: messages, the session state machine and the tensor side.

- ``messages``: codes, errors, identity, header checks, chunking;
- ``session``: :class:`ExchangeSession`, one exchange for either role (events in, actions out);
- ``actions``: what a session asks its shell to do, and the :class:`Outcome` of a commit;
- ``engine``: :class:`ExchangeEngine`, snapshot / encode / check / commit on a node's tensors;
- ``memory``: :class:`MemoryExchange`, two sessions wired back to back (simulator, tests).

Nothing here imports gRPC or asyncio: the daemon's gRPC shell, the simulator and the tests drive
the same objects.
"""
