"""Connection plumbing every listener and connector of a node shares: who a peer is and the
swarm credential (`auth`), the authenticated handshake and per-frame MACs (`channel`),
admission control (`admission`) and the accept loop (`listener`), bounded peer-caused logs
(`peer_log`), the TCP congestion control of bulk connections (`congestion`) and the event
loop thread the asyncio parts run on (`loop_thread`)."""
