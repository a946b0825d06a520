"""The runtime's wire, imported by rlactors: the msgpack codec and the versioned envelopes.
Imports nothing of this project."""
