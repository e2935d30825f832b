"""dilonode: a peer-to-peer daemon for decentralized training with Streaming DiLoCo."""

import os as _os

__all__ = ["__version__", "PROTOCOL_VERSION"]

__version__ = "0.1.0"
# Bumped on any incompatible change of the wire protocol (protocol/README.md). Tests set
# DILONODE_TEST_PROTOCOL_VERSION in a child node's environment to stand for a peer of
# another release; nothing else reads it.
PROTOCOL_VERSION = int(_os.environ.get("DILONODE_TEST_PROTOCOL_VERSION", "9"))
