"""dilonode: a peer-to-peer daemon for decentralized training with Streaming DiLoCo."""

__all__ = ["__version__", "PROTOCOL_VERSION"]

__version__ = "0.1.0"
# Bumped on any incompatible change of the wire protocol (protocol/README.md).
PROTOCOL_VERSION = 8
