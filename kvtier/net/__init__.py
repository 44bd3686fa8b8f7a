"""Between nodes: the wire format, a node that serves its store, and the client that fetches."""
from kvtier.net.client import PeerClient, PeerError
from kvtier.net.directory import Directory, DirectoryError, PeerList, RedisDirectory
from kvtier.net.frames import Frame, FrameError
from kvtier.net.node import Node

__all__ = ["Node", "PeerClient", "PeerError", "Frame", "FrameError", "Directory", "DirectoryError", "PeerList",
           "RedisDirectory"]
