"""Between nodes: the wire format, a node that serves its store, and the client that fetches and puts."""
from kvtier.net.client import PeerClient, PeerError
from kvtier.net.directory import Directory, DirectoryError, PeerList, RedisDirectory
from kvtier.net.frames import Frame, FrameError
from kvtier.net.limits import NodeLimits
from kvtier.net.node import Node
from kvtier.net.tls import Tls

__all__ = ["Node", "NodeLimits", "PeerClient", "PeerError", "Tls", "Frame", "FrameError", "Directory",
           "DirectoryError", "PeerList", "RedisDirectory"]
