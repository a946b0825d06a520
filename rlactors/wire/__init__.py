"""Between processes, in every runtime process: ZeroMQ sockets on the event loop, their
authentication, the calling side (client, runtime client, heartbeats) and the serving side."""
