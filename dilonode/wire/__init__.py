"""The dilonode wire protocol: messages, framing and the two protocol error families.

`messages` holds the validated message models, `framing` the length-prefixed msgpack frames
and `errors` the remote/local protocol errors; protocol/README.md is the normative spec.
"""
