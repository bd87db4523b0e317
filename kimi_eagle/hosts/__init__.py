"""A host and its connection: sessions, transports (ssh, local, offline), host keys, verified file transfer,
and calls over several hosts at once."""
