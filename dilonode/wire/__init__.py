"""The dilonode wire protocol: messages, framing and the two protocol error families.

Import from here rather than the submodules; protocol/README.md is the normative spec.
"""

from dilonode.wire.errors import LocalProtocolError, RemoteProtocolError, one_line
from dilonode.wire.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    FrameDecoder,
    decode_message,
    encode_frame,
    encode_message,
)
from dilonode.wire.messages import (
    ABORT_REASON_MAX,
    MAX_MEMBERS,
    MESSAGE_TYPES,
    Abort,
    Contribution,
    Hello,
    HelloAck,
    HelloAuth,
    Message,
    Result,
    message_from_dict,
    message_to_dict,
    message_to_json,
)

__all__ = [
    "ABORT_REASON_MAX",
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "MAX_MEMBERS",
    "MESSAGE_TYPES",
    "Abort",
    "Contribution",
    "FrameDecoder",
    "Hello",
    "HelloAck",
    "HelloAuth",
    "LocalProtocolError",
    "Message",
    "RemoteProtocolError",
    "Result",
    "decode_message",
    "encode_frame",
    "encode_message",
    "message_from_dict",
    "message_to_dict",
    "message_to_json",
    "one_line",
]
